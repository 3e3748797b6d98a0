"""Optimizers that bind to the engine they are built into, and may take over its steps (1-bit Adam, DiLoCo)."""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn as nn


class StepOverride(Protocol):
    """What a bound optimizer gives the engine: it may take over steps, and its state goes into checkpoints."""

    def takes_step(self) -> bool: ...

    def step(self) -> bool: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict | None) -> None: ...


class BoundOptimizer:
    """An optimizer factory (`__call__(master shards) -> torch optimizer`) that zero.initialize binds to the engine
    once built: `bind(engine)` refuses what cannot work (`refuse_layout`) and returns the engine's StepOverride."""

    def __call__(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        raise NotImplementedError(f"{type(self).__name__} does not build an optimizer")

    def refuse_layout(self, config: Any, dims: Any) -> None:
        """Raise, in one line, where this optimizer cannot train with `config` (a ZeroConfig) and `dims` (anything
        with the degrees: a ParallelDims, or a recipe's parallel section before any process group exists)."""

    def bind(self, engine: Any) -> StepOverride:
        raise NotImplementedError(f"{type(self).__name__} does not bind to an engine")
