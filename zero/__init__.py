"""The shared runtime: parallel topology, collectives, ZeRO stages, offload, pipeline and checkpoints."""

from zero.checkpoint import CheckpointError, verify_checkpoint
from zero.config import ConfigError, ZeroConfig
from zero.engine import Engine, ReduceGroup, initialize
from zero.optimizer import FastAdamW
from zero.topology import LayoutError, ParallelDims

__all__ = [
    "CheckpointError", "verify_checkpoint",
    "ConfigError", "Engine", "FastAdamW", "LayoutError", "ParallelDims", "ReduceGroup", "ZeroConfig", "initialize",
]
