"""GroupedExperts: every local expert's weights in one [E_local, ...] tensor, run as a grouped GEMM.

Tokens arrive sorted into contiguous per-expert segments; `torch._grouped_mm` computes all experts in
one call where the installed torch supports it for the device/dtype, else a loop over the segments.
Weights are stored [E, in, out], or transposed [E, out, in] (the nn.Linear layout of Hugging Face's fused
experts), which every path reads in place. Routing gives the expert GEMMs new row counts every step, so a
process that trains bf16 experts on CPU bounds oneDNN's per-shape caches first (`bound_onednn_caches`, which
recipes.pretrain's Run calls before its first GEMM); importing this module changes nothing in the process.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = ("swiglu", "gelu")

#: Shapes kept by oneDNN's primitive cache and by ideep's cache in front of it (torch's CPU bf16 matmul) where
#: the environment sets neither (torch's defaults: 1,024 each); see bound_onednn_caches.
ONEDNN_CACHE_CAPACITY = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "16"}


def bound_onednn_caches() -> None:
    """Bound the caches that torch's CPU bf16 GEMMs keep per shape (`ONEDNN_CACHE_CAPACITY`).

    oneDNN compiles a primitive for every GEMM shape and keeps the last 1,024; ideep, torch's wrapper, keeps
    another 1,024. Expert GEMMs have data-dependent row counts, so every training step adds new shapes: with
    bf16 experts on CPU, resident memory grew by tens of MiB per step until both caches were full (about
    600 MiB per rank for 4 layers of 8 experts of width 256), and malloc_trim returned none of it. A cached
    primitive is only reused, never computes differently, so the bound changes no value; a shape evicted and
    seen again is compiled again (1-2 ms for a 1024x256 @ 256x768 GEMM on an AVX-512 core).

    Both capacities are read when oneDNN first runs in the process, so this sets them in `os.environ` and must
    run before the process's first GEMM: call it at the start of a training process (recipes.pretrain's Run
    does, and with it the planner's measurements; a Lightning or Trainer script calls it itself); a variable
    already in the environment wins. Where oneDNN has run before, set them in the environment that starts the
    process, e.g. `ONEDNN_PRIMITIVE_CACHE_CAPACITY=64 LRU_CACHE_CAPACITY=16`. (LRU_CACHE_CAPACITY=0 crashes torch
    2.13.)"""
    for name, value in ONEDNN_CACHE_CAPACITY.items():
        os.environ.setdefault(name, value)


def onednn_cache_capacities() -> tuple[int, int]:
    """(oneDNN's primitive cache, ideep's cache): the shapes each keeps in a process that called
    `bound_onednn_caches` (a training run of the recipe): the environment's value where it sets one, else the
    bound."""
    return tuple(int(os.environ.get(name, value)) for name, value in ONEDNN_CACHE_CAPACITY.items())

_GROUPED_MM_OK: dict[tuple, bool] = {}


def grouped_mm_supported(device: torch.device, dtype: torch.dtype, k: int, n: int) -> bool:
    """Probe once per (device, dtype, shape) whether torch._grouped_mm runs forward and backward GEMMs."""
    key = (device.type, dtype, k, n)
    if key not in _GROUPED_MM_OK:
        ok = hasattr(torch, "_grouped_mm")
        if ok:
            try:
                x = torch.zeros(4, k, device=device, dtype=dtype)
                w = torch.zeros(2, k, n, device=device, dtype=dtype)
                g = torch.zeros(4, n, device=device, dtype=dtype)
                offs = torch.tensor([1, 4], device=device, dtype=torch.int32)
                torch._grouped_mm(x, w, offs=offs)
                torch._grouped_mm(g, w.transpose(-2, -1), offs=offs)
                torch._grouped_mm(x.t(), g, offs=offs)
            except (RuntimeError, NotImplementedError, TypeError):
                ok = False
        _GROUPED_MM_OK[key] = ok
    return _GROUPED_MM_OK[key]


def _as_kn(w: torch.Tensor, transposed: bool) -> torch.Tensor:
    """The [E, k, n] operand of x [M, k] @ w: the weight itself, or a view of a transposed [E, n, k] one."""
    return w.transpose(-2, -1) if transposed else w


class _GroupedMM(torch.autograd.Function):
    """y[seg e] = x[seg e] @ w[e] (w stored [E, k, n], or [E, n, k] when transposed); backward as two more
    grouped GEMMs (gradients contiguous in the stored layout)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, fuse_grad: bool,
                transposed: bool) -> torch.Tensor:
        ctx.save_for_backward(x, w, offs)
        ctx.param = w if fuse_grad else None
        ctx.transposed = transposed
        return torch._grouped_mm(x, _as_kn(w, transposed), offs=offs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w, offs = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch._grouped_mm(grad, _as_kn(w, not ctx.transposed), offs=offs)  # [M, n] @ [E, n, k]
        sink = _grad_sink(ctx.param) if ctx.param is not None else None
        if sink is not None:  # fused accumulation into the existing .grad (GroupedExperts doc)
            counts = torch.diff(offs, prepend=offs.new_zeros(1)).tolist()
            _wgrad_stored(x, grad, counts, sink, ctx.transposed, accumulate=True)
        elif ctx.needs_input_grad[1] and ctx.transposed:
            grad_w = torch._grouped_mm(grad.t(), x, offs=offs)  # [n, M] @ [M, k] per segment -> [E, n, k]
        elif ctx.needs_input_grad[1]:
            grad_w = torch._grouped_mm(x.t(), grad, offs=offs)  # [k, M] @ [M, n] per segment -> [E, k, n]
        return grad_x, grad_w, None, None, None


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, tokens_per_expert: torch.Tensor,
                   fuse_grad_accumulation: bool = False, transposed: bool = False) -> torch.Tensor:
    """x [M, k] in per-expert segments, w [E, k, n] (transposed: [E, n, k]) -> [M, n] (fusion: see
    GroupedExperts)."""
    w_kn = _as_kn(w, transposed)
    if grouped_mm_supported(x.device, x.dtype, w_kn.shape[1], w_kn.shape[2]):
        offs = torch.cumsum(tokens_per_expert, 0).to(torch.int32)
        return _GroupedMM.apply(x, w, offs, fuse_grad_accumulation, transposed)
    return _segment_loop(x, w_kn, tokens_per_expert.tolist())


def _segment_loop(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The portable grouped GEMM: one matmul per expert segment (differentiable)."""
    return torch.cat([seg @ w[e] for e, seg in enumerate(torch.split(x, counts))], dim=0)


def _activate(h: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "swiglu":
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(h)


def _activate_backward(grad: torch.Tensor, h: torch.Tensor, activation: str) -> torch.Tensor:
    """Gradient w.r.t. the pre-activation h given the gradient of _activate(h)."""
    if activation == "gelu":
        return torch.ops.aten.gelu_backward(grad, h)
    gate, up = h.chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    grad_up = grad * gate * sig
    grad_gate = grad.mul_(up).mul_(sig).mul_(1.0 + gate * (1.0 - sig))  # d silu = sig * (1 + g (1 - sig))
    return torch.cat([grad_gate, grad_up], dim=-1)


def _gmm(x: torch.Tensor, w: torch.Tensor, counts: list[int], transposed: bool = False) -> torch.Tensor:
    """Raw (no autograd) grouped GEMM of segments x[seg e] @ w[e] (w[e].T when `transposed`)."""
    w = _as_kn(w, transposed)
    if grouped_mm_supported(x.device, x.dtype, w.shape[1], w.shape[2]):
        offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        return torch._grouped_mm(x, w, offs=offs)
    return _segment_loop(x, w, counts)


def _expert_chunks(counts: list[int], max_chunks: int) -> list[tuple[int, int, int, int]]:
    """Split experts into contiguous groups of about total/max_chunks rows: (e0, e1, r0, r1) each."""
    total = sum(counts)
    target = max(1, -(-total // max_chunks))
    chunks, e0, r0, rows = [], 0, 0, 0
    for e, c in enumerate(counts):
        rows += c
        if rows >= target or e == len(counts) - 1:
            chunks.append((e0, e + 1, r0, r0 + rows))
            e0, r0, rows = e + 1, r0 + rows, 0
    return chunks


class _FusedExpertMLP(torch.autograd.Function):
    """out[token_index[m]] += gate[m] * MLP_e(x[token_index[m]]) for all slots m, expert-sorted.

    One node for gather -> grouped MLP -> gate-weighted scatter-add, run over chunks of experts.
    Backward keeps only the pre-activation h of each chunk: nothing of size [M, dim] (the gathered
    rows are re-gathered; the gate gradient is <act, dL/d act_unweighted>, so the expert outputs
    are not kept either) and not the activation act(h) (recomputed from h in backward: one
    elementwise pass buys a third (SwiGLU) or half (GELU) of the retained memory, and the forward's
    act buffer is reused chunk after chunk instead of being fresh memory). Backward releases each
    chunk's h as soon as it is done, so the end of backward, when the weight gradients exist, holds
    almost nothing else.
    """

    @staticmethod
    def forward(ctx, x, w_in, w_out, gate, token_index, counts, activation, max_chunks, fuse_grad, repeatable,
                transposed):
        out = x.new_zeros(x.shape)
        chunks = _expert_chunks(counts, max_chunks)
        acts = []
        for e0, e1, r0, r1 in chunks:
            tok = token_index[r0:r1]
            h = _gmm(x.index_select(0, tok), w_in[e0:e1], counts[e0:e1], transposed)  # [m, ffn] (x2 for SwiGLU)
            a = _activate(h, activation)  # [m, ffn], freed at the end of the chunk
            y = _gmm(a, w_out[e0:e1], counts[e0:e1], transposed).mul_(gate[r0:r1].unsqueeze(1))  # [m, dim]
            del a
            out.index_add_(0, tok, y)
            acts.append(h)
        ctx.save_for_backward(x, w_in, w_out, gate, token_index)
        ctx.chunks, ctx.acts, ctx.counts, ctx.activation = chunks, acts, counts, activation
        ctx.params = (w_in, w_out) if fuse_grad else None
        ctx.repeatable, ctx.transposed = repeatable, transposed
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, w_in, w_out, gate, token_index = ctx.saved_tensors
        counts, t = ctx.counts, ctx.transposed
        grad_out = grad_out.contiguous()
        grad_x = torch.zeros_like(x)
        # Fused accumulation: the weight-gradient GEMMs add straight into an existing .grad (no
        # [E, ...] temporary, no separate add). Otherwise fresh buffers, uninitialised: every expert's
        # slice is written by _wgrad chunk by chunk, so on CPU the pages become resident only as the
        # activations of finished chunks are released.
        sink_in, sink_out = (_grad_sink(p) for p in ctx.params) if ctx.params else (None, None)
        grad_w_in = sink_in if sink_in is not None else torch.empty_like(w_in)
        grad_w_out = sink_out if sink_out is not None else torch.empty_like(w_out)
        grad_gate = torch.empty_like(gate)
        # Chunks in forward order: the activations freed first are the oldest (lowest) in the heap, so
        # the temporaries below reuse them instead of growing the heap again (16384 tokens x 64 experts:
        # 13-21k page faults per backward instead of 64-78k).
        for i in range(len(ctx.chunks)):
            e0, e1, r0, r1 = ctx.chunks[i]
            h = ctx.acts[i]
            if not ctx.repeatable:
                ctx.acts[i] = None  # this chunk's pre-activation dies with the locals below
            a = _activate(h, ctx.activation)  # recomputed (see the class doc)
            tok = token_index[r0:r1]
            g = gate[r0:r1].unsqueeze(1)
            grad_rows = grad_out.index_select(0, tok)  # [m, dim] dL/d(expert output), unweighted
            grad_a = _gmm(grad_rows, w_out[e0:e1], counts[e0:e1], not t)  # [m, ffn], unweighted
            grad_gate[r0:r1] = torch.linalg.vecdot(grad_a, a)  # row-wise <dL/dy, y>
            _wgrad_stored(a, grad_rows.mul_(g), counts[e0:e1], grad_w_out[e0:e1], t, accumulate=sink_out is not None)
            del a, grad_rows
            grad_h = _activate_backward(grad_a.mul_(g), h, ctx.activation)
            del h, grad_a
            _wgrad_stored(x.index_select(0, tok), grad_h, counts[e0:e1], grad_w_in[e0:e1], t,
                          accumulate=sink_in is not None)
            grad_x.index_add_(0, tok, _gmm(grad_h, w_in[e0:e1], counts[e0:e1], not t))
            del grad_h
        if not ctx.repeatable:
            ctx.acts = None
        return (grad_x, None if sink_in is not None else grad_w_in, None if sink_out is not None else grad_w_out,
                grad_gate, None, None, None, None, None, None, None)


def _wgrad(x: torch.Tensor, grad: torch.Tensor, counts: list[int], out: torch.Tensor,
           accumulate: bool = False) -> None:
    """out[e] (+)= x[seg e]^T @ grad[seg e], written straight into the gradient buffer (no temporary)."""
    start = 0
    for e, c in enumerate(counts):
        if c and accumulate:
            out[e].addmm_(x[start:start + c].t(), grad[start:start + c])
        elif c:
            torch.mm(x[start:start + c].t(), grad[start:start + c], out=out[e])
        elif not accumulate:
            out[e].zero_()
        start += c


def _wgrad_stored(x: torch.Tensor, grad: torch.Tensor, counts: list[int], out: torch.Tensor, transposed: bool,
                  accumulate: bool = False) -> None:
    """_wgrad into a weight gradient stored [E, k, n], or transposed [E, n, k] (then grad^T @ x per expert)."""
    if transposed:
        _wgrad(grad, x, counts, out, accumulate=accumulate)
    else:
        _wgrad(x, grad, counts, out, accumulate=accumulate)


def _grad_sink(p: torch.Tensor) -> torch.Tensor | None:
    """`p.grad` if the weight gradient may be added into it in place by the backward GEMMs, else None.

    Only a plain existing gradient qualifies: none while building a double-backward graph, and none
    when the parameter has hooks that must see an accumulated gradient (they would not fire).
    """
    g = p.grad
    if (g is None or torch.is_grad_enabled() or g.requires_grad or g.shape != p.shape or g.dtype != p.dtype
            or g.device != p.device or p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None)):
        return None
    return g


class GroupedExperts(nn.Module):
    """`num_local` expert MLPs (dim -> ffn_dim -> dim) as two stacked weights.

    w_in [E_local, dim, ffn_dim] (GELU) or [E_local, dim, 2 * ffn_dim] (SwiGLU: gate | up), w_out
    [E_local, ffn_dim, dim]. `expert_range` selects which slice of the full
    `num_experts` initialisation this module keeps, so expert-parallel ranks hold exactly the
    weights a single-rank model built with the same seed would have.

    `fuse_grad_accumulation` (default False): when a weight already has a `.grad` at backward time,
    the weight-gradient GEMMs add into it in place (addmm) instead of returning a fresh [E, ...]
    gradient for autograd to add: no 2 x E x dim x ffn temporary, no separate add pass. The hooks that
    autograd would run on the accumulated gradient do not fire for those weights, so only turn it on
    where nothing relies on them (`moe.set_fused_grad_accumulation`, e.g. when the ZeRO engine says
    `grads_accumulate_in_place`, stages 0-1; DDP does not qualify).

    `transposed=True` stores both weights the other way round, [E, out, in] like nn.Linear: w_in
    [E_local, 2 * ffn_dim (or ffn_dim), dim], w_out [E_local, dim, ffn_dim], the layout of Hugging Face's
    fused experts (gate | up), whose tensors this module can then hold as they are. Every path reads them
    in place (transposed views, no copies) and produces their gradients in that layout.
    """

    fuse_grad_accumulation = False
    #: Keep the saved activations through backward, for backwards that run twice over one graph (the
    #: separate input- and weight-gradient passes of zero-bubble pipeline schedules); see moe.set_repeatable_backward.
    repeatable_backward = False
    #: Parameter names of the (input, output) weights. A subclass that stores them under other names (another
    #: framework's) overrides this and defines `w_in` / `w_out` as properties reading them.
    weight_names = ("w_in", "w_out")

    def __init__(self, dim: int, ffn_dim: int, num_experts: int, activation: str = "swiglu",
                 expert_range: tuple[int, int] | None = None, init_std: float = 0.02, *,
                 transposed: bool = False) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r} is not supported; use one of {ACTIVATIONS}")
        start, stop = expert_range or (0, num_experts)
        self.dim, self.ffn_dim, self.activation = dim, ffn_dim, activation
        self.num_experts, self.expert_range = stop - start, (start, stop)
        self.transposed = transposed
        in_width = 2 * ffn_dim if activation == "swiglu" else ffn_dim
        w_in = torch.empty((num_experts, in_width, dim) if transposed else (num_experts, dim, in_width))
        w_out = torch.empty((num_experts, dim, ffn_dim) if transposed else (num_experts, ffn_dim, dim))
        nn.init.normal_(w_in, std=init_std)
        nn.init.normal_(w_out, std=init_std)
        if (start, stop) != (0, num_experts):  # keep only this rank's slice, not a view of the full tensor
            w_in, w_out = w_in[start:stop].clone(), w_out[start:stop].clone()
        self._set_weights(w_in, w_out)

    def _set_weights(self, w_in: torch.Tensor, w_out: torch.Tensor) -> None:
        """Register (or replace) the two weights as parameters named `weight_names`."""
        for name, w in zip(self.weight_names, (w_in, w_out)):
            self.register_parameter(name, nn.Parameter(w))

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, ffn_dim={self.ffn_dim}, experts={self.num_experts} "
                f"(range {self.expert_range}), activation={self.activation}" + (", transposed" * self.transposed))

    def keep_experts(self, start: int, stop: int) -> None:
        """Drop every expert outside [start, stop) (relative to this module's current experts)."""
        self._set_weights(self.w_in.data[start:stop].clone(), self.w_out.data[start:stop].clone())
        base = self.expert_range[0]
        self.num_experts, self.expert_range = stop - start, (base + start, base + stop)

    def keep_hidden(self, start: int, stop: int) -> None:
        """Keep hidden units [start, stop) of every expert (expert tensor parallelism): the output is then
        this slice's partial sum of the expert MLP, to be summed over the ranks holding the other slices."""
        if self.transposed:  # [E, out, in]: the hidden units are rows of w_in and columns of w_out
            w_in = _hidden_columns(self.w_in.data.transpose(1, 2), self.ffn_dim, start, stop, self.activation)
            self._set_weights(w_in.transpose(1, 2).contiguous(), self.w_out.data[:, :, start:stop].clone())
        else:
            self._set_weights(_hidden_columns(self.w_in.data, self.ffn_dim, start, stop, self.activation),
                              self.w_out.data[:, start:stop].clone())
        self.ffn_dim = stop - start

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor, *, sync_free: bool = False) -> torch.Tensor:
        """x [M, dim] in contiguous per-expert segments of sizes tokens_per_expert [E_local] -> [M, dim].

        sync_free=True (the device path): the segment sizes stay on the device as the grouped GEMMs' offsets,
        forward and backward (no fused gradient accumulation: its per-expert addmm reads the sizes on the
        host); raises NotImplementedError where torch._grouped_mm cannot serve the device, dtype and shape."""
        fuse, transposed = self.fuse_grad_accumulation and not sync_free, self.transposed
        if sync_free:
            self.check_sync_free(x.device, x.dtype)
        h = grouped_matmul(x, self.w_in, tokens_per_expert, fuse, transposed)  # [M, ffn] or [M, 2 ffn]
        return grouped_matmul(_activate(h, self.activation), self.w_out, tokens_per_expert, fuse, transposed)

    def supports_sync_free(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether torch._grouped_mm runs both expert GEMMs (forward and backward) on `device` in `dtype`."""
        w_in, w_out = (_as_kn(w, self.transposed) for w in (self.w_in, self.w_out))
        return all(grouped_mm_supported(device, dtype, w.shape[1], w.shape[2]) for w in (w_in, w_out))

    def check_sync_free(self, device: torch.device, dtype: torch.dtype) -> None:
        if not self.supports_sync_free(device, dtype):
            raise NotImplementedError(
                f"the device MoE path needs torch._grouped_mm for {dtype} on {device.type} at dim={self.dim}, "
                f"ffn_dim={self.ffn_dim} (torch {torch.__version__} cannot run it there; its rows must be 16-byte "
                "aligned); without it only the host path (local_path='host') runs these experts")

    def forward_tokens(self, x: torch.Tensor, token_index: torch.Tensor, gate: torch.Tensor,
                       tokens_per_expert: torch.Tensor, max_chunks: int = 8) -> torch.Tensor:
        """sum over slots m of gate[m] * expert(x[token_index[m]]), scattered back to x's rows.

        x [N, dim] unpermuted tokens; token_index/gate [M] expert-sorted slots (segments sized by
        tokens_per_expert). Gathers and combines inside one autograd node (see _FusedExpertMLP), so
        it needs far less activation memory than permute -> forward -> unpermute.
        """
        return _FusedExpertMLP.apply(x.contiguous(), self.w_in, self.w_out, gate, token_index,
                                     tokens_per_expert.tolist(), self.activation, max_chunks,
                                     self.fuse_grad_accumulation, self.repeatable_backward, self.transposed)


def _hidden_columns(w: torch.Tensor, hidden: int, start: int, stop: int, activation: str) -> torch.Tensor:
    """Columns of hidden units [start, stop) of an input weight [..., hidden] or, for SwiGLU,
    [..., 2 * hidden] laid out gate | up (the slice keeps both halves of each unit)."""
    if activation == "swiglu":
        return torch.cat([w[..., start:stop], w[..., hidden + start : hidden + stop]], dim=-1).clone()
    return w[..., start:stop].clone()


class SharedExperts(nn.Module):
    """Always-on dense MLP (width num_shared * ffn_dim) added to the routed output (DeepSeekMoE)."""

    def __init__(self, dim: int, hidden: int, activation: str = "swiglu", init_std: float = 0.02) -> None:
        super().__init__()
        self.activation = activation
        self.w_in = nn.Linear(dim, 2 * hidden if activation == "swiglu" else hidden, bias=False)
        self.w_out = nn.Linear(hidden, dim, bias=False)
        for lin in (self.w_in, self.w_out):
            nn.init.normal_(lin.weight, std=init_std)

    def keep_hidden(self, start: int, stop: int) -> None:
        """Keep hidden units [start, stop): the output becomes this slice's partial sum."""
        hidden = self.w_out.weight.shape[1]
        w_in = _hidden_columns(self.w_in.weight.data.t(), hidden, start, stop, self.activation).t()
        self.w_in.weight = nn.Parameter(w_in.contiguous())
        self.w_out.weight = nn.Parameter(self.w_out.weight.data[:, start:stop].contiguous())
        self.w_in.out_features, self.w_out.in_features = w_in.shape[0], stop - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_out(_activate(self.w_in(x), self.activation))
