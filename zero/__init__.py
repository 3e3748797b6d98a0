"""The shared runtime: parallel topology, collectives, ZeRO stages, offload, pipeline and checkpoints."""

from zero.checkpoint import CheckpointError, describe_layout, open_checkpoint, verify_checkpoint
from zero.config import ConfigError, ZeroConfig
from zero.engine import Engine, ReduceGroup, initialize
from zero.optimizer import FastAdamW
from zero.placement import Placement, compose
from zero.reshard import CheckpointReader, ReshardError, consolidate
from zero.topology import LayoutError, ParallelDims

__all__ = [
    "CheckpointError", "CheckpointReader", "ReshardError", "consolidate", "describe_layout", "open_checkpoint",
    "verify_checkpoint",
    "ConfigError", "Engine", "FastAdamW", "LayoutError", "ParallelDims", "Placement", "ReduceGroup", "ZeroConfig",
    "compose", "initialize",
]
