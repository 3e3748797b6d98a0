"""Flat, padded, rank-partitioned parameter buffers: the storage every ZeRO stage builds on.

A `FlatBucket` lays a list of parameters end to end in one buffer padded to a multiple of the group
size, so rank r owns the contiguous slice [r * shard_size, (r + 1) * shard_size) and every
reduce-scatter / all-gather is a single contiguous collective. Modules see views into the buffer.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed import ProcessGroup

from zero.dist import comm, quantized
from zero.dist.topology import group_rank, group_size
from zero.offload.hugepages import advise_huge_pages
from zero.offload.nvme import TensorFile


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

    #: The group of ranks holding a copy of these parameters elsewhere in the model (e.g. an embedding
    #: tied to a head on another pipeline stage): reduced gradients are summed over it before the step.
    tie_group: ProcessGroup | None = None
    #: Stage 3: the codec of this bucket's parameter all-gathers (None: the compute dtype, exact) and of its gradient
    #: reduce-scatter (None: exact), with `quant_block` elements per fp32 scale (zero.ZeroConfig.quantize_*).
    weight_codec: str | None = None
    grad_codec: str | None = None
    quant_block: int = 256
    #: hpZ (zero.ZeroConfig.hpz_partition_size): the group of consecutive ranks among which backward re-gathers
    #: this bucket from `secondary`, this rank's 1 / group-size part of the full buffer, kept from the forward gather.
    secondary_group: ProcessGroup | None = None

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
        fill: Callable[[str, nn.Parameter, torch.Tensor], None] | None = None,
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
        # `fill(name, p, view)` writes a parameter's initial values into its view of the buffer (default:
        # a copy of its data; the engine passes one that materialises parameters built on the meta device).
        with torch.no_grad():
            for p, name, view in zip(params, names, self.param_views(self.full)):
                if fill is not None:
                    fill(name, p, view)
                else:
                    view.copy_(p.detach())
        self.local: torch.Tensor | None = None  # this rank's shard when not resident (device or host)
        self.home = "none"  # where a non-resident shard waits between gathers (see attach)
        self.file: TensorFile | None = None  # the shard's file when home == "nvme"
        self._gather_source: torch.Tensor | None = None
        self._shard_view: torch.Tensor | None = None  # this rank's slice of `full` (gather_resident)
        self.gathered = True
        self.secondary: torch.Tensor | None = None
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

    def attach(self, home: str = "none", nvme_path: str | None = None, file_name: str = "") -> None:
        """Point the module parameters at the flat buffer (and, non-resident, keep only the shard).

        `home` (non-resident buckets) is where the shard waits between gathers: "none" (the device),
        "cpu" (host memory, pinned on CUDA) or "nvme" (a file `file_name` under `nvme_path`).
        """
        # `.data` gives views with their own version counter: refilling the buffer in place (the
        # stage-3 re-gather) must not look like an in-place edit of tensors autograd saved.
        base = self.full.data
        for p, v in zip(self.params, self.param_views(base)):
            p.data = v
        if self.resident:
            return
        shard = self.shard_of(self.full)
        self.home = home
        if home == "nvme":
            self.file = TensorFile(nvme_path, file_name, self.shard_size, ["shard"], self.dtype)
            # A copy: handing `full`'s own storage to numpy would pin its size (free() resizes it).
            self.file.write("shard", 0, shard.clone())
        elif home == "cpu":
            self.local = torch.empty(self.shard_size, dtype=self.dtype, pin_memory=torch.cuda.is_available())
            self.local.copy_(shard)
        else:
            self.local = shard.clone()
        self.free()

    # ------------------------------------------------------------------ stage-3 gather / free
    def _shard_for_gather(self) -> torch.Tensor:
        if self.file is not None:
            return self.file.read_all("shard").to(self.device, non_blocking=True)
        return self.local.to(self.device, non_blocking=True)  # the same tensor unless it waits on the host

    def gather(self, async_op: bool = False, backward: bool = False):
        """All-gather the full buffer from the shards; returns the work handle when async (wait() before use).

        `backward`: the gather is for backward (a unit's re-gather), which may come from the secondary partition
        (hpZ) the forward's gather left; any other gather comes from the shards and refreshes that partition.
        """
        if self.resident or self.gathered:
            return None
        _resize_storage(self.full, self.padded * self.full.element_size())
        advise_huge_pages(self.full)  # before the gather first writes it: faulted in 2 MiB pages where THP allows
        self.gathered = True
        if backward and self.secondary is not None:
            self._gather_source = self.secondary
            return comm.all_gather_into_tensor(self.full, self.secondary, self.secondary_group, async_op=async_op)
        if self.weight_codec is not None and self.world > 1:
            # Kept until `free`: an asynchronous gather still reads it.
            self._gather_source = self._shard_for_gather()
            handle = quantized.all_gather(self.full, self._gather_source, self.group, self.weight_codec,
                                          self.quant_block, async_op=async_op)
        else:
            # In place: the shard is copied into its own slice of the full buffer, so the copy read from its file is
            # released at once instead of staying beside the gathered buffer. (Not read into the slice directly:
            # handing `full`'s storage to numpy would pin its size, which free() changes.)
            mine = self.shard_of(self.full)
            mine.copy_(self._shard_for_gather(), non_blocking=True)
            handle = comm.all_gather_into_tensor(self.full, mine, self.group, async_op=async_op)
        if self.secondary_group is None:
            return handle
        if handle is None:
            self._keep_secondary()
            return None
        return _ThenKeep(handle, self)

    def _keep_secondary(self) -> None:
        """Copy this rank's part of the just-gathered buffer aside for backward's re-gather (hpZ)."""
        size = self.padded // comm.group_size(self.secondary_group)
        start = comm.group_rank(self.secondary_group) * size
        self.secondary = self.full[start : start + size].clone()

    def drop_secondary(self) -> None:
        """Forget the secondary partition (end of backward: the next step's shards will differ)."""
        self.secondary = None

    def free(self) -> None:
        if self.resident or not self.gathered:
            return
        _resize_storage(self.full, 0)
        self.gathered = False
        self._gather_source = None

    def gather_resident(self, async_op: bool = False):
        """All-gather a resident bucket's full buffer from the shards in place: this rank's shard is
        already its slice of `full`, so nothing is copied first (the view is made once)."""
        if self._shard_view is None:
            self._shard_view = self.shard_of(self.full)
        return comm.all_gather_into_tensor(self.full, self._shard_view, self.group, async_op=async_op)

    @property
    def shard_in_memory(self) -> bool:
        """False when the shard lives in a file (read with read_shard, set with write_shard)."""
        return self.file is None

    def shard_tensor(self) -> torch.Tensor:
        """This rank's shard of the parameter values (compute dtype), where it lives in memory."""
        if self.file is not None:
            raise RuntimeError("this bucket's shard lives in an nvme file: use read_shard()/write_shard()")
        return self.shard_of(self.full) if self.resident else self.local

    def read_shard(self) -> torch.Tensor:
        """This rank's shard (compute dtype): the tensor itself, or a fresh copy read from its file."""
        return self.file.read_all("shard") if self.file is not None else self.shard_tensor()

    @torch.no_grad()
    def write_shard(self, values: torch.Tensor, start: int = 0) -> None:
        """Set shard elements [start, start + len(values)) (cast to the compute dtype)."""
        if self.file is not None:
            self.file.write("shard", start, values)
        else:
            self.shard_tensor()[start : start + values.numel()].copy_(values, non_blocking=True)

    def close(self) -> None:
        """Remove the shard's file (nvme home); the bucket is unusable afterwards."""
        if self.file is not None:
            self.file.close()

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for the bucket's parameters and gradients right now."""
        params = self.full.untyped_storage().nbytes()
        if self.local is not None:
            params += self.local.untyped_storage().nbytes()
        if self.secondary is not None:
            params += self.secondary.untyped_storage().nbytes()
        grads = sum(t.untyped_storage().nbytes() for t in (self.grad_full, self.grad_acc) if t is not None)
        return {"params": params, "grads": grads}


class _ThenKeep:
    """An asynchronous gather's handle whose wait() also keeps the bucket's secondary partition (once)."""

    __slots__ = ("work", "bucket")

    def __init__(self, work, bucket: FlatBucket) -> None:
        self.work, self.bucket = work, bucket

    def wait(self, *args) -> bool:
        if self.bucket is not None:
            self.work.wait(*args)
            bucket, self.bucket = self.bucket, None
            bucket._keep_secondary()
        return True

