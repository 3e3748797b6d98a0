"""The shared runtime: parallel topology, collectives, ZeRO stages, offload, pipeline and checkpoints."""

from zero.topology import LayoutError, ParallelDims

__all__ = ["LayoutError", "ParallelDims"]
