"""Flat, padded, rank-partitioned parameter buffers: the storage every ZeRO stage builds on.

A `FlatBucket` lays a list of parameters end to end in one buffer padded to a multiple of the group
size, so rank r owns the contiguous slice [r * shard_size, (r + 1) * shard_size) and every
reduce-scatter / all-gather is a single contiguous collective. Modules see views into the buffer.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.distributed import ProcessGroup

from zero import comm
from zero.topology import group_rank, group_size


def _resize_storage(t: torch.Tensor, nbytes: int) -> None:
    storage = t.untyped_storage()
    if storage.nbytes() != nbytes:
        storage.resize_(nbytes)


class FlatBucket:
    """Parameters of one reduction group flattened into one padded buffer split evenly over the group.

    `group` is the set of ranks holding replicas of these parameters (gradients are reduced over
    `grad_group`, a twin of it by default the same group); `reduce_group` names that reduction.
    shard=False keeps the whole buffer on every rank (stage 0). resident=False (stage 3) keeps only
    this rank's shard; the full buffer's storage is allocated by `gather` and released by `free`, and
    the parameters stay views into it, so tensors autograd saved in forward see the data again after
    the re-gather for backward.
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        names: list[str],
        group: ProcessGroup | None,
        *,
        dtype: torch.dtype,
        shard: bool,
        resident: bool,
        reduce_group: str = "dense",
        grad_group: ProcessGroup | None = None,
    ) -> None:
        if not params:
            raise ValueError("a FlatBucket needs at least one parameter")
        self.params = params
        self.names = names
        self.group = group  # parameter all-gathers and the initial broadcast
        self.grad_group = grad_group if grad_group is not None else group  # gradient reductions
        self.dtype = dtype
        self.reduce_group = reduce_group  # the name of the engine's reduction this bucket belongs to
        self.trainable = params[0].requires_grad
        self.sharded = shard
        self.resident = resident
        self.world = group_size(group) if shard else 1
        self.rank = group_rank(group) if shard else 0
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        self.offsets = [0]
        for n in self.numels[:-1]:
            self.offsets.append(self.offsets[-1] + n)
        self.numel = sum(self.numels)
        self.padded = math.ceil(self.numel / self.world) * self.world
        self.shard_size = self.padded // self.world
        self.shard_start = self.rank * self.shard_size
        # Ranks of the group holding each element (the global gradient norm counts every element once).
        self.replicas = group_size(group) // self.world
        self.device = params[0].device
        self.full = torch.zeros(self.padded, dtype=dtype, device=self.device)
        with torch.no_grad():
            for p, o, n in zip(params, self.offsets, self.numels):
                self.full[o : o + n].copy_(p.detach().reshape(-1))
        self.local: torch.Tensor | None = None  # this rank's shard when not resident
        self.gathered = True
        # Gradient state, managed by the reducer: the full-size flat gradient (stages 0-1 keep it for the
        # whole step) and this rank's reduced fp32 shard accumulated over micro-batches.
        self.grad_full: torch.Tensor | None = None
        self.grad_acc: torch.Tensor | None = None

    # ------------------------------------------------------------------ layout
    def param_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of `flat` ([padded]) shaped like each parameter."""
        return [flat[o : o + n].view(s) for o, n, s in zip(self.offsets, self.numels, self.shapes)]

    def shard_of(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.shard_start : self.shard_start + self.shard_size]

    def shard_ranges(self) -> list[tuple[int, int, int]]:
        """(param index, start, end) of each parameter's elements in this rank's shard (shard coordinates)."""
        out = []
        lo, hi = self.shard_start, self.shard_start + self.shard_size
        for i, (o, n) in enumerate(zip(self.offsets, self.numels)):
            a, b = max(o, lo), min(o + n, hi)
            if a < b:
                out.append((i, a - lo, b - lo))
        return out

    # ------------------------------------------------------------------ setup
    def broadcast_from_first_rank(self) -> None:
        """Make every replica start from the values of the group's first rank."""
        if self.group is not None:
            import torch.distributed as dist

            comm.broadcast(self.full, src=dist.get_global_rank(self.group, 0), group=self.group)

    def attach(self) -> None:
        """Point the module parameters at the flat buffer (and, non-resident, keep only the shard)."""
        # `.data` gives views with their own version counter: refilling the buffer in place (the
        # stage-3 re-gather) must not look like an in-place edit of tensors autograd saved.
        base = self.full.data
        for p, v in zip(self.params, self.param_views(base)):
            p.data = v
        if not self.resident:
            self.local = self.shard_of(self.full).clone()
            self.free()

    # ------------------------------------------------------------------ stage-3 gather / free
    def gather(self, async_op: bool = False):
        """All-gather the full buffer from the shards; returns the work handle when async."""
        if self.resident or self.gathered:
            return None
        _resize_storage(self.full, self.padded * self.full.element_size())
        self.gathered = True
        return comm.all_gather_into_tensor(self.full, self.local, self.group, async_op=async_op)

    def free(self) -> None:
        if self.resident or not self.gathered:
            return
        _resize_storage(self.full, 0)
        self.gathered = False

    def shard_tensor(self) -> torch.Tensor:
        """This rank's shard of the parameter values (compute dtype)."""
        return self.shard_of(self.full) if self.resident else self.local

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for the bucket's parameters and gradients right now."""
        params = self.full.untyped_storage().nbytes()
        if self.local is not None:
            params += self.local.untyped_storage().nbytes()
        grads = sum(t.untyped_storage().nbytes() for t in (self.grad_full, self.grad_acc) if t is not None)
        return {"params": params, "grads": grads}


def split_into_buckets(
    params: list[tuple[str, nn.Parameter]], max_numel: int
) -> list[list[tuple[str, nn.Parameter]]]:
    """Consecutive runs of parameters of at most `max_numel` elements each (a larger one stands alone)."""
    buckets: list[list[tuple[str, nn.Parameter]]] = []
    current: list[tuple[str, nn.Parameter]] = []
    size = 0
    for name, p in params:
        if current and size + p.numel() > max_numel:
            buckets.append(current)
            current, size = [], 0
        current.append((name, p))
        size += p.numel()
    if current:
        buckets.append(current)
    return buckets
