"""The engine builds its optimizer over its own flat fp32 master shards, so an optimizer another framework built
over the model's parameters is turned back into a factory: its class and hyperparameters."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from zero.engine import OptimizerFactory


def rebuild_factory(optimizer: torch.optim.Optimizer) -> OptimizerFactory:
    """A factory building `optimizer`'s class with its hyperparameters over other parameters (the engine's flat
    master shards). Param groups with different hyperparameters (e.g. no weight decay for norms) are refused:
    the engine's shards are one group."""
    ignored = {"params", "initial_lr", "param_names"}
    groups = [{k: v for k, v in g.items() if k not in ignored} for g in optimizer.param_groups]
    differ = sorted(k for k in groups[0] if any(g.get(k) != groups[0][k] for g in groups[1:]))
    if differ:
        raise NotImplementedError(f"param groups with different {', '.join(differ)} are not implemented: the engine "
                                  "steps its flat master shards as one group; use one group (or a factory)")
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return class_factory(type(optimizer), {k: v for k, v in groups[0].items() if k in accepted})


def class_factory(cls: type[torch.optim.Optimizer], hyper: dict) -> OptimizerFactory:
    """`cls(params, **hyper)` as the engine's optimizer factory."""

    def build(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return cls(params, **hyper)

    build.__qualname__ = f"{cls.__name__}({', '.join(f'{k}={v!r}' for k, v in hyper.items())})"
    return build
