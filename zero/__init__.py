"""The shared runtime: parallel topology, collectives, ZeRO stages, offload, pipeline and checkpoints.

Sub-packages by concern, each importable alone: `zero.dist` (topology, comm), `zero.sharding` (buckets,
reducers, stage 3), `zero.offload.masters` (host, nvme), `zero.parallel` (tensor, pipeline), `zero.state`
(checkpoints, resharding); `zero.plan` and `zero.contract` hold the declaration types and the model
contract. The names below load their module on first use, so `import zero.dist.comm` loads no engine.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "CheckpointError": "zero.state.checkpoint", "describe_layout": "zero.state.checkpoint",
    "open_checkpoint": "zero.state.checkpoint", "verify_checkpoint": "zero.state.checkpoint",
    "CheckpointReader": "zero.state.reshard", "ReshardError": "zero.state.reshard", "consolidate": "zero.state.reshard",
    "ConfigError": "zero.config", "ZeroConfig": "zero.config",
    "Engine": "zero.engine", "initialize": "zero.engine",
    "FastAdamW": "zero.sharding.optimizer",
    "Placement": "zero.plan", "ReduceGroup": "zero.plan", "Plan": "zero.plan", "compose": "zero.plan",
    "LayoutError": "zero.dist.topology", "ParallelDims": "zero.dist.topology",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'zero' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
