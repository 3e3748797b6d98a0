"""Optimizers that change what the engine communicates: 1-bit Adam's compressed momentum (onebit.py) over
the 1-bit compressed all-reduce (compression.py), and DiLoCo's replicas that synchronise every H steps (diloco.py,
with ReplicaDims, the layout of one replica); bound.py is how such an optimizer takes over engine steps."""

from zero.optim.bound import BoundOptimizer, StepOverride
from zero.optim.diloco import DiLoCo, ReplicaDims
from zero.optim.onebit import OneBitAdam

__all__ = ["BoundOptimizer", "DiLoCo", "OneBitAdam", "ReplicaDims", "StepOverride"]
