"""Optimizers that change what the engine communicates: 1-bit Adam's compressed momentum (onebit.py) over
the 1-bit compressed all-reduce (compression.py); bound.py is how such an optimizer takes over engine steps."""

from zero.optim.bound import BoundOptimizer, StepOverride
from zero.optim.onebit import OneBitAdam

__all__ = ["BoundOptimizer", "OneBitAdam", "StepOverride"]
