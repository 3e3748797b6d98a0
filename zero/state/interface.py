"""The narrow view of the engine that checkpoints and resharding use (nothing private, no engine import)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch
from torch import nn

from zero.config import ZeroConfig
from zero.dist.topology import ParallelDims
from zero.plan import Placement
from zero.sharding.buckets import FlatBucket


class CheckpointedEngine(Protocol):
    """What `zero.state` reads and calls on an engine to save, verify, load and reshard its state."""

    module: nn.Module
    config: ZeroConfig
    dims: ParallelDims
    device: torch.device
    buckets: list[FlatBucket]
    placements: Mapping[str, Placement]
    global_steps: int
    loaded_checkpoint: dict | None

    def bucket_records(self) -> list[dict]: ...

    def state_dict(self, *, file_backed: bool = False, streamed: bool = False) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def state_mismatch(self, state: dict) -> str | None: ...

    def unplaced_split_params(self) -> list[str]: ...

    def full_state_dict(self) -> dict[str, Any]: ...
