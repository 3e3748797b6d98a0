"""The shared runtime: parallel topology, collectives, ZeRO stages, offload, pipeline and checkpoints."""

from zero.config import ConfigError, ZeroConfig
from zero.engine import Engine, ReduceGroup, initialize
from zero.optimizer import FastAdamW
from zero.topology import LayoutError, ParallelDims

__all__ = [
    "ConfigError", "Engine", "FastAdamW", "LayoutError", "ParallelDims", "ReduceGroup", "ZeroConfig", "initialize",
]
