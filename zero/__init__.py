"""The shared runtime: parallel topology, collectives, ZeRO stages, offload, pipeline and checkpoints."""

from zero.config import ConfigError, ZeroConfig
from zero.engine import Engine, ReduceGroup, initialize
from zero.topology import LayoutError, ParallelDims

__all__ = ["ConfigError", "Engine", "LayoutError", "ParallelDims", "ReduceGroup", "ZeroConfig", "initialize"]
