"""Optimizers that change what the engine communicates: 1-bit Adam's compressed momentum (onebit.py) over
the 1-bit compressed all-reduce (compression.py)."""

from zero.optim.onebit import OneBitAdam, StepOverride

__all__ = ["OneBitAdam", "StepOverride"]
