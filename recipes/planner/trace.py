"""The collectives of one micro-batch's forward and backward, counted by running this rank's model on the meta
device under the fake process group: tensor-parallel gathers and reduce-scatters, Ulysses all-to-alls, the
vocabulary-parallel and sequence-parallel losses, recomputation under activation checkpointing.

MoE layers cannot route meta tensors (routing is data): each is replaced during the trace by a stand-in that
passes its input through and records the layer's collectives from its shapes (balancing statistics over
sp, the expert all-to-alls at uniform routing, whose rows are returned apart so a measured routing can
replace them).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch.utils._python_dispatch import TorchDispatchMode

from recipes.planner.build import RankModel
from zero.dist import comm
from zero.dist.comm import group_size


@dataclass
class Trace:
    """Per micro-batch: bytes and calls per collective kind (as zero.dist.comm counts them), and the MoE
    all-to-all rows this rank sends (uniform routing), which the caller turns into bytes."""

    bytes: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    a2a_rows: float = 0.0  # token rows sent by the expert all-to-alls (dispatch + combine, fwd + bwd)
    a2a_row_bytes: int = 0
    a2a_calls: int = 0  # those all-to-alls (the count exchanges are in `bytes`)
    moe_layer_calls: int = 0  # MoE layer forwards, recomputes included
    # the distinct GEMMs (operation, shapes and strides of the operands) the micro-batch runs, where the trace
    # was asked to record them; expert GEMMs are not among them (the stand-in runs none), see `expert_shapes`
    gemms: set[tuple] = field(default_factory=set)
    # whether the experts' GEMMs reach the CPU math library with a new shape at every routing: in bf16 / fp16,
    # torch's CPU grouped GEMM (and the per-expert loop) runs one oneDNN GEMM per expert segment, whose row
    # count is the router's
    expert_shapes: bool = False


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _record_allreduce(nbytes: int, n: int) -> None:
    if n > 1:
        comm.stats.record("all_reduce", 2 * (n - 1) / n * nbytes)


def _moe_standin(trace: Trace, ep: int):
    """A forward for MoELayer that records its collectives and returns its input (plus a zero of its router
    so backward reaches it)."""

    def forward(layer, x):
        n = x.numel() // x.shape[-1]
        sp = group_size(layer.stats_group)
        e = layer.num_experts
        if sp > 1:  # load_balancing_loss and router_z_loss over the sequence-parallel group
            seqs = x.shape[0] if layer.seq_aux else 1
            for nbytes in (seqs * (e + 1) * 4, seqs * e * 4, 4, 4):
                _record_allreduce(nbytes, sp)
        if ep > 1:
            comm.stats.record("all_to_all", e * 8 * (ep - 1) / ep)  # the per-expert counts
            rows = n * layer.top_k * (ep - 1) / ep  # slots for other ranks' experts, and as many back
            passes = 1 if _in_backward() else 2  # a recompute runs forward only
            trace.a2a_rows += 2 * rows * passes
            trace.a2a_calls += 2 * passes
            trace.a2a_row_bytes = x.shape[-1] * x.element_size()
        trace.moe_layer_calls += 1
        if x.dtype in (torch.bfloat16, torch.float16):
            trace.expert_shapes = True
        return x * 1.0 + 0.0 * layer.router.weight.sum().to(x.dtype)

    return forward


_GEMMS = ("mm", "addmm", "bmm", "baddbmm")


class _GemmRecorder(TorchDispatchMode):
    """Records every distinct GEMM (operation, operand shapes and strides) that runs under it."""

    def __init__(self, into: set) -> None:
        super().__init__()
        self.into = into

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in _GEMMS:
            self.into.add((func.overloadpacket.__name__,) + tuple(
                (tuple(a.shape), a.stride(), a.dtype) for a in args if isinstance(a, torch.Tensor)))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _moe_replaced(trace: Trace, ep: int):
    from moe import MoELayer

    original = MoELayer.forward
    MoELayer.forward = _moe_standin(trace, ep)
    try:
        yield
    finally:
        MoELayer.forward = original


class _BackwardBytes(torch.autograd.Function):
    """Identity whose backward records `nbytes` point-to-point bytes (ring attention's backward traffic)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, nbytes: int) -> torch.Tensor:
        ctx.nbytes = nbytes
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        comm.stats.record("p2p", ctx.nbytes)
        return grad, None


@contextlib.contextmanager
def _ring_replaced(dims):
    """Ring attention on the meta device: it sends what `sequence_parallel.ring.ring_bytes_per_rank` says (the
    formula its test checks against comm's counts), recorded by a stand-in at each forward (recomputation
    included) and once in backward; the stand-in returns a tensor of q's shape that depends on q, k and v."""
    if dims.cp == 1:
        yield
        return
    from sequence_parallel.ring import RingAttention, ring_bytes_per_rank

    original = RingAttention.forward
    me = dims.coordinate()["cp"]

    def forward(ring, q, k, v, causal=True, documents=None, scale=None, window=None, sinks=None):
        sent = ring_bytes_per_rank(q.shape[1] * ring.cp, q.shape[0], k.shape[2], k.shape[3], ring.cp, k.element_size(),
                                   ring.sparse, causal)[me]
        comm.stats.record("p2p", sent["forward"])
        return _BackwardBytes.apply(q + 0 * (k.sum() + v.sum()), sent["backward"])

    RingAttention.forward = forward
    try:
        yield
    finally:
        RingAttention.forward = original


def _loss(rm: RankModel, cfg: DictConfig, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    from recipes.losses import IGNORE_INDEX, logits_loss
    from sequence_parallel import sp_loss

    model = rm.model
    h = model.norm(h)
    if cfg.train.tiled_loss:  # (tiled_cross_entropy checks its labels' values: a stand-in of its outputs)
        loss_sum = (h.float().sum() + model.output_weight.float().sum()) * 0.0
        count = (labels != IGNORE_INDEX).sum()
        return sp_loss(loss_sum, count, rm.dims.sequence_group)
    return logits_loss(F.linear(h, model.output_weight), labels, rm.dims)


def trace_micro_batch(rm: RankModel, cfg: DictConfig, dtype: torch.dtype, gemms: bool = False) -> Trace:
    """Run one micro-batch of this rank's stages forward and backward on the meta device; count collectives
    (and with `gemms`, record the distinct GEMMs into `Trace.gemms`)."""
    dims, model = rm.dims, rm.model
    if dims.tp > 1 and cfg.model.moe.num_experts:
        raise NotImplementedError("the planner's trace of MoE layers under expert tensor parallelism (MoE with "
                                  "parallel.tp > 1) is not implemented")
    model.to(dtype)
    b = cfg.train.micro_batch_size
    s_local = -(-cfg.train.seq_len // (dims.sp * dims.cp))  # shard_sequence pads to a multiple of sp (cp: divides)
    meta = {"device": "meta"}
    tokens = torch.zeros(b, s_local, dtype=torch.long, **meta)
    positions = torch.arange(s_local, **meta).expand(b, s_local)
    trace = Trace()
    from torch.fx.experimental import _config as fx_config

    # (boolean masks on meta tensors: the vocabulary-parallel loss's backward indexes with one; no collective
    # depends on its size)
    recorder = _GemmRecorder(trace.gemms) if gemms else contextlib.nullcontext()
    with comm.counting() as stats, _moe_replaced(trace, dims.ep), _ring_replaced(dims), \
            fx_config.patch(meta_nonzero_assume_all_nonzero=True), recorder:
        stats.enabled = True
        if rm.first:
            h = model.tok_embeddings(tokens)
        else:
            h = torch.zeros(b, s_local // dims.tp, cfg.model.dim, dtype=dtype, requires_grad=True, **meta)
        cos, sin = model.rotary(positions)
        for i in rm.stage_layers:
            h = model.layers[i](h, cos.to(dtype), sin.to(dtype), None)
        loss = _loss(rm, cfg, h, tokens) if rm.last else h.float().sum()
        loss.backward()
        trace.bytes, trace.calls = dict(stats.bytes), dict(stats.calls)
        stats.reset()
    if dims.sp > 1 and rm.stage_layers and cfg.data.get("packing", "concat") == "document":
        # packed documents: Ulysses gathers the whole rows' position ids once per forward of each stage
        for _ in range(rm.stages):
            _add(trace, "all_gather", (dims.sp - 1) * b * s_local * 8)
    if dims.cp > 1 and rm.stage_layers and cfg.data.get("packing", "concat") == "document":
        # ... and ring attention those of every ring rank's two chunks, once per forward
        for _ in range(rm.stages):
            _add(trace, "all_gather", (dims.cp - 1) * b * (cfg.train.seq_len // dims.cp) * 8)
    return trace


def _add(trace: Trace, kind: str, nbytes: float) -> None:
    trace.bytes[kind] = trace.bytes.get(kind, 0) + int(nbytes)
    trace.calls[kind] = trace.calls.get(kind, 0) + 1
