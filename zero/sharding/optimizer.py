"""ZeRO-1/2 gradient reduction and the sharded optimizer step over flat buckets (also used by stage 3).

Gradients are reduced per flat bucket (all-reduce at stage 0, reduce-scatter from stage 1), each rank
steps the fp32 master copy of its own shard, and the updated shards are gathered back into the model.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed import ReduceOp

from zero.config import ZeroConfig
from zero.dist import comm, quantized
from zero.offload.hugepages import empty_advised, zeros_advised
from zero.offload.masters import build_masters
from zero.sharding.buckets import FlatBucket


class DynamicLossScaler:
    """fp16 loss scale: shrink after `hysteresis` consecutive overflows, grow after `window` clean steps."""

    def __init__(self, initial: float, window: int, minimum: float, hysteresis: int) -> None:
        self.scale = float(initial)
        self.window = window
        self.minimum = minimum
        self.hysteresis = hysteresis
        self._clean_steps = 0
        self._overflows_left = hysteresis

    def update(self, overflow: bool) -> None:
        if overflow:
            self._clean_steps = 0
            self._overflows_left -= 1
            if self._overflows_left <= 0:
                self.scale = max(self.scale / 2.0, self.minimum)
                self._overflows_left = self.hysteresis
        else:
            self._clean_steps += 1
            if self._clean_steps % self.window == 0:
                self.scale *= 2.0
                self._overflows_left = self.hysteresis

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self._clean_steps, "overflows_left": self._overflows_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale = state["scale"]
        self._clean_steps = state["clean_steps"]
        self._overflows_left = state["overflows_left"]



def collect_grads(b: FlatBucket) -> None:
    """Fold gradients that bypassed the bucket's flat buffer (a caller reset .grad) back into it, None counting
    as zero, and point every .grad at its view of the buffer again."""
    for p, v in zip(b.params, b.param_views(b.grad_full)):
        g = p.grad
        if g is None:
            v.zero_()
        elif g.data_ptr() != v.data_ptr():
            v.copy_(g.reshape(v.shape))
        p.grad = v

def _reduce(bucket: FlatBucket, flat: torch.Tensor, async_op: bool):
    """Sum `flat` ([padded]) over the bucket's group: into this rank's shard, or whole when unsharded."""
    if bucket.sharded and bucket.world > 1 and bucket.grad_codec is not None:
        out = torch.empty(bucket.shard_size, dtype=torch.float32, device=flat.device)
        return out, quantized.reduce_scatter(out, flat, bucket.grad_group, bucket.grad_codec, bucket.quant_block,
                                             async_op=async_op)
    if bucket.sharded and bucket.world > 1:
        out = empty_advised(bucket.shard_size, flat.dtype, flat.device)
        return out, comm.reduce_scatter_scratch(out, flat, bucket.grad_group, async_op=async_op)  # (flat: ours)
    return flat, comm.all_reduce(flat, bucket.grad_group, async_op=async_op)


def _whole(bucket: FlatBucket, grad: torch.Tensor) -> bool:
    """Whether `grad` can serve as the bucket's flat staging buffer itself: the bucket holds one parameter,
    unpadded, and the gradient is a dense contiguous tensor of the bucket's dtype and device."""
    return (len(bucket.params) == 1 and bucket.padded == grad.numel() and grad.layout == torch.strided
            and grad.is_contiguous() and grad.dtype == bucket.dtype and grad.device == bucket.device)


class FullGradReducer:
    """Stages 0-1: every rank keeps the full gradient in flat buffers; reduced once per optimizer step."""

    def __init__(self, buckets: list[FlatBucket]) -> None:
        self.buckets = buckets
        for b in buckets:
            b.grad_full = torch.zeros(b.padded, dtype=b.dtype, device=b.device)
            self._point_grads(b)

    @staticmethod
    def _point_grads(b: FlatBucket) -> None:
        # Autograd accumulates into an existing .grad in place, so presetting views makes backward
        # write straight into the flat buffer (no copy at reduction time).
        for p, v in zip(b.params, b.param_views(b.grad_full)):
            p.grad = v

    def after_backward(self) -> None:
        pass

    def reduce(self, async_op: bool) -> None:
        pending = []
        for b in self.buckets:
            collect_grads(b)
            pending.append((b, *_reduce(b, b.grad_full, async_op)))
        for b, out, handle in pending:
            if handle is not None:
                handle.wait()
            b.grad_acc = out if out.dtype == torch.float32 else out.float()

    def clear(self) -> None:
        for b in self.buckets:
            b.grad_acc = None
            b.grad_full.zero_()
            self._point_grads(b)


@dataclass(eq=False)
class _BucketProgress:
    """Where one bucket stands in the current backward (owned by HookGradReducer)."""

    bucket: FlatBucket
    arrived: list[bool] = field(default_factory=list)  # per parameter: its gradient is staged
    missing: int = 0  # parameters still without a gradient
    launched: bool = False  # the bucket's reduction has been issued
    staging: torch.Tensor | None = None  # full-size gradient being assembled
    late: torch.Tensor | None = None  # gradients that arrived after the launch (second round)

    def reset(self) -> None:
        self.arrived = [False] * len(self.bucket.params)
        self.missing = len(self.bucket.params)
        self.launched = False
        self.staging = None
        self.late = None


class HookGradReducer:
    """Stages 2-3: gradients are reduce-scattered bucket by bucket during backward; no rank keeps them whole.

    A post-accumulate-grad hook copies each parameter's gradient into its bucket's staging buffer and
    drops `.grad`. Buckets of one reduction group launch strictly in a fixed order (a bucket waits for
    the ones before it), so every rank issues the same collectives in the same order even when a
    parameter gets no gradient on some rank (an expert that received no tokens): such buckets launch
    at the end of backward with zeros in place of the missing gradients. A gradient that arrives after
    its bucket was launched (a parameter used in several reentrant-checkpoint regions) is reduced in
    a second round that every rank joins, agreed by a small all-reduce of flags.
    """

    def __init__(
        self,
        buckets: list[FlatBucket],
        overlap: bool,
        on_complete: Callable[[FlatBucket], None] | None = None,
        on_reduced: Callable[[FlatBucket], None] | None = None,
    ) -> None:
        self.buckets = buckets
        self.overlap = overlap
        self.on_complete = on_complete  # all of a bucket's gradients have arrived (stage 3 frees it)
        self.on_reduced = on_reduced  # a bucket's reduced shard was added into grad_acc
        # One launch chain per reduction group, each in the fixed bucket order.
        self.chains: dict[str, list[_BucketProgress]] = {}
        for b in buckets:
            progress = _BucketProgress(b)
            progress.reset()
            self.chains.setdefault(b.reduce_group, []).append(progress)
        self.next = dict.fromkeys(self.chains, 0)
        self.pending: list = []
        self.max_in_flight = 1
        self._spare: torch.Tensor | None = None  # the last released staging buffer, reused within this backward
        self.handles = []
        for chain in self.chains.values():
            for progress in chain:
                for i, p in enumerate(progress.bucket.params):
                    hook = functools.partial(self._on_grad, progress, i)
                    self.handles.append(p.register_post_accumulate_grad_hook(hook))

    def _on_grad(self, progress: _BucketProgress, i: int, p: nn.Parameter) -> None:
        b = progress.bucket
        g = p.grad
        p.grad = None
        if g is None:
            return
        o, n = b.offsets[i], b.numels[i]
        with torch.no_grad():
            if progress.launched:
                if progress.late is None:
                    progress.late = torch.zeros(b.padded, dtype=b.dtype, device=b.device)
                progress.late[o : o + n].add_(g.reshape(-1))
                return
            if progress.staging is None and _whole(b, g):
                # The bucket's one parameter fills it: its gradient (autograd's own, .grad is dropped)
                # is the staging buffer, not copied into a second full-size one.
                progress.staging = g.view(-1)
                self._arrived(progress, i)
                return
            if progress.staging is None:
                progress.staging = self._zeros(b)
            view = progress.staging[o : o + n]
            if progress.arrived[i]:
                view.add_(g.reshape(-1))
                return
            view.copy_(g.reshape(-1))
        self._arrived(progress, i)

    def _arrived(self, progress: _BucketProgress, i: int) -> None:
        """Parameter i's first gradient of this backward is staged: launch the bucket when it is complete."""
        progress.arrived[i] = True
        progress.missing -= 1
        if progress.missing == 0:
            b = progress.bucket
            if self.on_complete is not None:
                self.on_complete(b)
            self._advance(b.reduce_group, flush=False)

    def _advance(self, key: str, flush: bool) -> None:
        chain = self.chains[key]
        while self.next[key] < len(chain):
            progress = chain[self.next[key]]
            if progress.missing and not flush:
                return
            b = progress.bucket
            if progress.staging is None:
                progress.staging = self._zeros(b)
            self._launch(progress, progress.staging)
            progress.launched = True
            self.next[key] += 1

    def _zeros(self, b: FlatBucket) -> torch.Tensor:
        """A zeroed staging buffer for `b`: the last released one when it has the same size, else a new one (the
        released one is dropped). Within a backward, buckets of one size (the units of stage 3) then share two or
        three buffers instead of taking a fresh full-size block from the allocator each (on the host: fresh
        pages, or heap fragments)."""
        # The reductions in flight finish first: their full-size buffers are released (and one reused here) before
        # a new one is taken, so a large one (an output head's gradient) does not wait beside the next.
        while self.pending:
            self._finish(*self.pending.pop(0))
        t, self._spare = self._spare, None
        if t is not None and t.numel() == b.padded and t.dtype == b.dtype and t.device == b.device:
            return t.zero_()
        return zeros_advised(b.padded, b.dtype, b.device)  # faulted in 2 MiB pages where THP allows

    def _launch(self, progress: _BucketProgress, flat: torch.Tensor) -> None:
        out, handle = _reduce(progress.bucket, flat, self.overlap)
        self.pending.append((progress, flat, out, handle))
        # Bound the staging memory: a full-size gradient buffer lives only while its reduction is in flight. A large
        # one in host memory is waited for at once: in flight, it would stay beside the next unit's whole backward.
        large = flat.device.type == "cpu" and flat.numel() * flat.element_size() >= HOST_WAIT_BYTES
        while len(self.pending) > (0 if large else self.max_in_flight):
            self._finish(*self.pending.pop(0))

    def _finish(self, progress: _BucketProgress, flat: torch.Tensor, out: torch.Tensor, handle) -> None:
        if handle is not None:
            handle.wait()
        # Release the full-size staging buffer now, not at the end of backward: for the next bucket of its size
        # to reuse in this backward (it holds no gradient of its own and did not become the reduced one).
        if flat is progress.staging:
            progress.staging = None
            if flat._base is None and out is not flat:
                self._spare = flat
        elif flat is progress.late:
            progress.late = None
        out = out.float()
        b = progress.bucket
        if b.grad_acc is None:
            b.grad_acc = out  # the staging buffer is dropped at reset, so taking it over is safe
        else:
            b.grad_acc.add_(out)
        if self.on_reduced is not None:
            self.on_reduced(b)

    def after_backward(self) -> None:
        """End of one backward: launch what is left, agree on late gradients, wait, accumulate."""
        # Gradients written into .grad without autograd's accumulation (e.g. a pipeline schedule's
        # separate weight-gradient pass) have not passed the hooks: take them now.
        for chain in self.chains.values():
            for progress in chain:
                for i, p in enumerate(progress.bucket.params):
                    if p.grad is not None:
                        self._on_grad(progress, i, p)
        for key in self.chains:
            self._advance(key, flush=True)
        for chain in self.chains.values():
            first = chain[0].bucket
            flags = torch.tensor([p.late is not None for p in chain], dtype=torch.int32, device=first.device)
            comm.all_reduce(flags, first.grad_group, op=ReduceOp.MAX)
            for progress, flag in zip(chain, flags.tolist()):
                if flag:
                    b = progress.bucket
                    if progress.late is None:
                        progress.late = torch.zeros(b.padded, dtype=b.dtype, device=b.device)
                    self._launch(progress, progress.late)
        for item in self.pending:
            self._finish(*item)
        self.pending.clear()
        self._spare = None  # no full-size gradient buffer outlives backward
        for key, chain in self.chains.items():
            self.next[key] = 0
            for progress in chain:
                progress.reset()

    def reduce(self, async_op: bool) -> None:
        pass  # already reduced during backward

    def clear(self) -> None:
        for b in self.buckets:
            b.grad_acc = None


class ZeroOptimizer:
    """Owns the reduction of gradients, clipping, loss scaling and the step over the master shards.

    Where the fp32 master shards and the optimizer state live (device, host or nvme files) is the
    business of a master store (`zero.offload.masters`); the torch optimizer is built by
    `optimizer_factory(list_of_flat_master_shards)`: one fp32 parameter per trainable bucket, so it
    must be elementwise (AdamW, Adam, SGD, ...).
    """

    def __init__(
        self,
        buckets: list[FlatBucket],
        config: ZeroConfig,
        dp: int,
        norm_group,
        optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        on_bucket_complete: Callable[[FlatBucket], None] | None = None,
        rank: int = 0,
    ) -> None:
        self.buckets = buckets
        self.trainable = [b for b in buckets if b.trainable]
        self.config = config
        self.dp = dp
        self.norm_group = norm_group
        self.device = buckets[0].device if buckets else torch.device("cpu")
        self.masters = build_masters(self.trainable, config, optimizer_factory, rank)
        self.optimizer = self.masters.optimizer
        self._index = {b: i for i, b in enumerate(self.trainable)}
        #: Set by the engine before each backward: True when it completes an accumulation cycle, so the
        #: reduced gradients are final and an offloaded store may start copying them.
        self.final_micro_batch = False
        if config.stage >= 2:
            self.reducer = HookGradReducer(self.trainable, config.overlap_comm, on_bucket_complete, self._reduced)
        else:
            self.reducer = FullGradReducer(self.trainable)
        self.scaler = None
        if config.dtype == "fp16":
            self.scaler = DynamicLossScaler(
                config.initial_loss_scale,
                config.loss_scale_window,
                config.min_loss_scale,
                config.loss_scale_hysteresis,
            )
        self.last_grad_norm: float | None = None

    def _reduced(self, b: FlatBucket) -> None:
        if self.masters.spills_grads:  # into the store's file at once: the shard leaves memory
            self.masters.accumulate_grad(self._index[b], b.grad_acc, self.final_micro_batch)
            b.grad_acc = None
        elif self.final_micro_batch and b.tie_group is None:  # a tied one changes at the step: no early copy
            self.masters.grad_ready(self._index[b], b.grad_acc)

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    @property
    def predivide(self) -> int:
        """What the loss multiplier divides gradients by before their reduction: dp under fp16, so that the sum
        over the dp ranks of loss-scaled fp16 gradients stays within the range one rank's gradient has (summed
        first, at the default scale 2^16 the reduction overflowed and skipped steps that one process takes); 1
        otherwise (the reduced sum is divided by dp at the step). A power-of-two dp changes no value."""
        return self.dp if self.scaler is not None else 1

    def grad_norm_sq(self, grads: list[torch.Tensor]) -> float:
        """The squared global gradient norm, accumulated in float64: an fp32 norm of a whole flat shard (1.7M
        elements) was 9e-5 of its value off on the CPU, and by other amounts for other shard sizes (dp ranks'
        halves), so one process and dp ranks logged different norms of the same gradient. Each piece of
        NORM_PIECE elements is normed in float64 (its temporary bounded), as the spilled-gradient path sums."""
        local = torch.zeros(1, dtype=torch.float64, device=grads[0].device if grads else self.device)
        for b, g in zip(self.trainable, grads):
            norms = torch._foreach_norm(g.reshape(-1).split(NORM_PIECE), dtype=torch.float64)
            local += torch.stack(norms).square().sum() / b.replicas
        return self._all_reduce_sum(local)

    def _all_reduce_sum(self, local: torch.Tensor | float) -> float:
        local = torch.as_tensor(local, dtype=torch.float64).reshape(1).to(self.device)
        comm.all_reduce(local, self.norm_group)
        return float(local)

    def step(self) -> bool:
        """Reduce (stages 0-1), unscale, clip, step, publish. False when fp16 overflow skipped the step."""
        self.reducer.reduce(self.config.overlap_comm)
        for b in self.trainable:
            if b.tie_group is not None:  # the copies' gradients (same shard layout) are summed
                if b.grad_acc is None:
                    b.grad_acc = torch.zeros(b.shard_size, dtype=torch.float32, device=b.device)
                comm.all_reduce(b.grad_acc, b.tie_group)
        scale = self.predivide / (self.dp * self.loss_scale)
        if self.masters.spills_grads:  # the gradients are in files: the store unscales and clips as it steps
            grads = None
            local = self.masters.grad_sq_sum([scale * scale / b.replicas for b in self.trainable])
            norm = math.sqrt(self._all_reduce_sum(local))
        else:
            grads = self.masters.collect_grads(self._grad_shards())  # where the step runs (the host, offloaded)
            if grads:
                torch._foreach_mul_(grads, scale)
            norm = math.sqrt(self.grad_norm_sq(grads))
        self.last_grad_norm = norm
        if not math.isfinite(norm):  # never apply a non-finite gradient: the weights stay finite
            if self.scaler is not None:
                self.scaler.update(overflow=True)
            self.clear_grads()
            return False
        coef = min(1.0, self.config.clip_grad_norm / (norm + 1e-6)) if self.config.clip_grad_norm else 1.0
        if grads and coef < 1.0:
            torch._foreach_mul_(grads, coef)
        self.masters.step(grads, scale, coef)  # updates the masters and writes the new values into the shards
        if self.scaler is not None:
            self.scaler.update(overflow=False)
        self.gather_shards()
        self.clear_grads()
        return True

    def _grad_shards(self) -> list[torch.Tensor]:
        """Each trainable bucket's reduced fp32 gradient shard (zeros for one that got none)."""
        return [b.grad_acc if b.grad_acc is not None
                else torch.zeros(b.shard_size, dtype=torch.float32, device=b.device) for b in self.trainable]

    def clear_grads(self) -> None:
        self.reducer.clear()
        self.masters.clear_grads()

    @torch.no_grad()
    def load_masters(self, values: list[torch.Tensor], done: Callable[[torch.Tensor], None] | None = None) -> None:
        """Set every trainable bucket's fp32 master (and its compute-dtype shard) from `values`, calling `done(v)`
        once each value is written (a loaded checkpoint's tensor then releases its file pages, bucket by bucket)."""
        for i, (b, v) in enumerate(zip(self.trainable, values)):
            self.masters.write_master(i, v)
            b.write_shard(v)
            if done is not None:
                done(v)

    def read_master(self, b: FlatBucket) -> torch.Tensor:
        """This rank's fp32 master shard of trainable bucket `b` (read from wherever it lives)."""
        return self.masters.read_master(self._index[b])

    @torch.no_grad()
    def gather_shards(self) -> None:
        """All-gather the updated shards of resident sharded buckets back into their full buffers."""
        in_flight: list = []
        elements = 0
        for b in self.trainable:
            if b.resident and b.sharded and b.world > 1:
                # allgather_bucket_size bounds the gathered elements in flight (and their temporaries).
                if in_flight and elements + b.padded > self.config.allgather_bucket_size:
                    for h in in_flight:
                        h.wait()
                    in_flight, elements = [], 0
                in_flight.append(b.gather_resident(async_op=True))
                elements += b.padded
        for h in in_flight:
            if h is not None:
                h.wait()


#: Bytes from which a gradient buffer in host memory is reduced synchronously (HookGradReducer._launch).
HOST_WAIT_BYTES = 64 << 20

#: Elements of a gradient shard per float64 norm in grad_norm_sq (each piece's float64 temporary: 8 MiB at most).
NORM_PIECE = 1 << 20

_FUSED_OK: dict[str, bool] = {}


def _fused_adamw_runs(device: torch.device) -> bool:
    """Probe once per device type whether torch.optim.AdamW(fused=True) steps there."""
    if device.type not in _FUSED_OK:
        try:
            p = nn.Parameter(torch.zeros(4, device=device))
            p.grad = torch.ones(4, device=device)
            torch.optim.AdamW([p], fused=True).step()
            _FUSED_OK[device.type] = True
        except (RuntimeError, NotImplementedError, TypeError, ValueError):
            _FUSED_OK[device.type] = False
    return _FUSED_OK[device.type]


class FastAdamW:
    """Optimizer factory for the fastest AdamW on the device of the parameters it is given.

    `torch.optim.AdamW(fused=True)` where it runs (CUDA, and CPU in recent torch: ~8x the default
    foreach path on a 2-core CPU, and faster than DeepSpeedCPUAdam, see benchmarks/offload.md), else
    the foreach implementation. The engine calls it with the master shards wherever they live (the
    device, pinned host memory, or the chunk window of an nvme-offloaded step), so offloaded steps
    get the host's fast path too.
    """

    def __init__(self, **hyper) -> None:
        self.hyper = hyper

    def __call__(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        params = list(params)
        device = params[0].device if params else torch.device("cpu")
        kind = {"fused": True} if _fused_adamw_runs(device) else {"foreach": True}
        return torch.optim.AdamW(params, **self.hyper, **kind)

    def __repr__(self) -> str:
        return f"FastAdamW({self.hyper})"
