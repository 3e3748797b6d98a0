"""The CPU path of block-sparse attention: the fused C++ kernel (kernels/csrc/block_sparse.cpp, built on first use)
or PyTorch ops over chunks of query blocks; both keep memory O(seq x non-zero blocks per row x block)."""

from __future__ import annotations

import math
import os
import warnings

import torch
from moe_lst.kernels import sparse
from moe_lst.kernels.sparse.layouts import BlockLayout

# The settings CPU_IMPL and CHUNK_ELEMENTS live on the package (moe_lst.kernels.sparse) and are read at each call.
_NATIVE_SOURCE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc",
                              "block_sparse.cpp")
_native_state: dict = {}


def _use_native(q: torch.Tensor) -> bool:
    impl = sparse.CPU_IMPL
    if impl not in sparse.CPU_IMPLS:
        raise ValueError(f"moe_lst.kernels.sparse.CPU_IMPL={impl!r} (or MOE_LST_SPARSE_CPU) must be one of "
                         f"{sparse.CPU_IMPLS}")
    if impl == "eager":
        return False
    if impl == "native":
        if q.dtype == torch.float64:
            raise ValueError("the native block-sparse CPU kernel computes in fp32; use CPU_IMPL='eager' for fp64")
        native_kernel()
        return True
    if q.dtype == torch.float64:
        return False
    try:
        native_kernel()
        return True
    except RuntimeError as exc:
        if not _native_state.get("warned"):
            _native_state["warned"] = True
            warnings.warn(f"{exc}; block-sparse attention runs the slower eager PyTorch path", stacklevel=3)
        return False


def cpu_block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockLayout,
                               scale: float) -> torch.Tensor:
    """The CPU path. Native: per (sequence, head, query block) the scores of the attended keys stay in one
    cache-resident buffer between MKL GEMMs and fused softmax loops; backward recomputes them from the saved
    log-sum-exp (flash style). Eager: per chunk of query blocks, gather the attended K/V blocks and softmax
    over them with the log-sum-exp kept per query; backward recomputes each chunk's scores."""
    if _use_native(q):
        lead = layout.cols.shape[:-2] or (1, 1)
        cols = layout.cols.reshape(*lead, *layout.cols.shape[-2:]).contiguous()
        counts = layout.counts.reshape(*lead, layout.counts.shape[-1]).contiguous()
        return _NativeBlockSparseFn.apply(q, k, v, cols, counts, layout.block_size, layout.causal, scale)
    return _BlockSparseFn.apply(q, k, v, layout.cols, layout.counts, layout.block_size, layout.causal, scale)


# ------------------------------------------------------------------------------------ native: the C++ kernel
def native_kernel():
    """The compiled CPU kernel module, built on first use (torch.utils.cpp_extension: g++ and ninja, about
    30 s, then cached per source and flags). Raises RuntimeError naming the cause if it cannot be built."""
    if "module" not in _native_state:
        try:
            from moe_lst.kernels.build import build_lock, clear_stale_lock
            from torch.utils.cpp_extension import load

            # -fno-trapping-math lets GCC vectorise the exp loops (float -> int conversion); inf/nan stay IEEE.
            flags = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]
            # -march=native: the build is named after this CPU's features, so a cache directory shared by
            # machines with different CPUs never hands one of them a binary built for the other.
            # ... and after its source path: another copy of the project (or a missing source) builds apart
            # instead of invalidating this one's cached binary.
            name = f"moe_lst_block_sparse_{_cpu_tag(_NATIVE_SOURCE)}"
            if clear_stale_lock(build_lock(name)):  # (a builder killed mid-build left it: loading would wait forever)
                warnings.warn(f"removed the stale build lock of {name} (its builder was killed)", stacklevel=2)
            _native_state["module"] = load(name=name,
                                           sources=[_NATIVE_SOURCE],
                                           extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False)
        except Exception as exc:  # noqa: BLE001 - a missing compiler or ninja, a build error: reported below
            _native_state["module"] = None
            lines = str(exc).strip().splitlines() or [""]
            _native_state["error"] = f"{type(exc).__name__}: {lines[-1]}"
    if _native_state["module"] is None:
        raise RuntimeError(f"the native block-sparse CPU kernel could not be built ({_native_state['error']}); "
                           "it needs g++ and ninja (pip install ninja)")
    return _native_state["module"]


def _cpu_tag(source: str = "") -> str:
    import hashlib
    import platform

    flags = source + platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            flags += next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return hashlib.sha1(flags.encode()).hexdigest()[:10]


class _NativeBlockSparseFn(torch.autograd.Function):
    """The C++ kernel (fp32 compute; bf16/fp16 inputs are cast). Saves q, k, v, the output and the
    log-sum-exp [b, h, s]."""

    @staticmethod
    def forward(ctx, q, k, v, cols, counts, B, causal, scale):
        qf, kf, vf = (x.to(torch.float32).contiguous() for x in (q, k, v))
        out, lse = native_kernel().forward(qf, kf, vf, cols, counts, B, causal, scale)
        ctx.save_for_backward(qf, kf, vf, out, lse, cols, counts)
        ctx.meta = (B, causal, scale, q.dtype, k.dtype, v.dtype)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        qf, kf, vf, out, lse, cols, counts = ctx.saved_tensors
        B, causal, scale, qt, kt, vt = ctx.meta
        g = grad_out.to(torch.float32).contiguous()
        dq, dk, dv = native_kernel().backward(g, qf, kf, vf, out, lse, cols, counts, B, causal, scale)
        return dq.to(qt), dk.to(kt), dv.to(vt), None, None, None, None, None


# ------------------------------------------------------------------------ eager: PyTorch ops, chunks of query blocks
def _padded(x: torch.Tensor, B: int) -> torch.Tensor:
    s = x.shape[1]
    n = -(-s // B)
    return torch.nn.functional.pad(x, (0, 0, 0, 0, 0, n * B - s)) if n * B != s else x


def _q_blocks(q: torch.Tensor, hk: int, B: int, dtype: torch.dtype) -> torch.Tensor:
    """[b, s, h, d] -> [n_blocks, b, kv_heads, group * B, d]. Query blocks outermost, so a chunk of them is
    one contiguous slice; the heads of one GQA group form one matrix, sharing the group's K/V blocks."""
    b, s, h, d = q.shape
    n, g = -(-s // B), h // hk
    # Written into a fresh tensor (not returned as a view), so autograd may save it.
    out = torch.empty(n, b, hk, g * B, d, dtype=dtype, device=q.device)
    out.view(n, b, hk, g, B, d).copy_(_padded(q, B).reshape(b, n, B, hk, g, d).permute(1, 0, 3, 4, 2, 5))
    return out


def _kv_blocks(x: torch.Tensor, B: int, dtype: torch.dtype) -> torch.Tensor:
    """[b, s, kv_heads, d] -> [b * kv_heads * n_blocks, B, d]: one row per (sequence, head, block) to gather."""
    b, s, hk, d = x.shape
    n = -(-s // B)
    out = torch.empty(b * hk * n, B, d, dtype=dtype, device=x.device)
    out.view(b, hk, n, B, d).copy_(_padded(x, B).reshape(b, n, B, hk, d).permute(0, 3, 1, 2, 4))
    return out


def _tokens(blocks: torch.Tensor, s: int, dtype: torch.dtype) -> torch.Tensor:
    """A blocked view [b, n, B, *heads, d] -> a new [b, s, heads, d] tensor (the padding dropped)."""
    b, n, B = blocks.shape[:3]
    heads, d = blocks.shape[3:-1], blocks.shape[-1]
    out = torch.empty(b, s, math.prod(heads), d, dtype=dtype, device=blocks.device)
    full = s // B
    if full:
        out[:, : full * B].view(b, full, B, *heads, d).copy_(blocks[:, :full])
    if s % B:
        out[:, full * B:].view(b, s % B, *heads, d).copy_(blocks[:, full, : s % B])
    return out


def _q_tokens(x: torch.Tensor, s: int, h: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of _q_blocks: [n, b, kv_heads, group * B, d] -> [b, s, h, d]."""
    n, b, hk, gB, d = x.shape
    return _tokens(x.view(n, b, hk, h // hk, gB * hk // h, d).permute(1, 0, 4, 2, 3, 5), s, dtype)


def _kv_tokens(x: torch.Tensor, b: int, hk: int, s: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of _kv_blocks: [b * kv_heads * n, B, d] -> [b, s, kv_heads, d]."""
    return _tokens(x.view(b, hk, -1, *x.shape[1:]).permute(0, 2, 3, 1, 4), s, dtype)


def _q_rows(x: torch.Tensor, hk: int, B: int) -> torch.Tensor:
    """A per-query value [b, s, h] -> [n, b, kv_heads, group * B, 1], the layout of _q_blocks."""
    b, s, h = x.shape
    n = -(-s // B)
    x = torch.nn.functional.pad(x, (0, 0, 0, n * B - s)) if n * B != s else x
    return x.reshape(b, n, B, hk, h // hk).permute(1, 0, 3, 4, 2).reshape(n, b, hk, -1, 1)


def _chunks(counts: torch.Tensor, per_row: int) -> list[tuple[int, int, int]]:
    """(first row, end row, max count) of consecutive query-block rows whose scores fit sparse.CHUNK_ELEMENTS."""
    widest = counts.reshape(-1, counts.shape[-1]).amax(0).tolist()
    out, r0, width = [], 0, 0
    for r, c in enumerate(widest):
        wider = max(width, c)
        if r > r0 and (r + 1 - r0) * wider * per_row > sparse.CHUNK_ELEMENTS:
            out.append((r0, r, width))
            r0, wider = r, c
        width = wider
    out.append((r0, len(widest), width))
    return out


class _BlockSparseFn(torch.autograd.Function):
    """Saves only q, k, v, the output and the log-sum-exp; backward rebuilds the blocked copies and recomputes
    each chunk's probabilities. Chunk temporaries live in one workspace per call."""

    @staticmethod
    def forward(ctx, q, k, v, cols, counts, B, causal, scale):
        b, s, h, d = q.shape
        hk = k.shape[2]
        dtype = torch.promote_types(q.dtype, torch.float32)
        qb = _q_blocks(q, hk, B, dtype).mul_(scale)  # [n, b, hk, gB, d], pre-scaled
        kb, vb = _kv_blocks(k, B, dtype), _kv_blocks(v, B, dtype)  # [b * hk * n, B, d]
        schedule = _Schedule(cols, counts, b, hk, s, B, causal, qb.shape[-2])
        ws = _Workspace(schedule, d, dtype, q.device, backward=False)
        out = torch.empty_like(qb)
        lse = torch.empty(qb.shape[:-1] + (1,), dtype=dtype, device=q.device)
        for r0, r1, m in schedule.chunks:
            idx = schedule.index(r0, r1, m)
            kg, vg = ws.gather(ws.k, kb, idx, r1 - r0, m), ws.gather(ws.v, vb, idx, r1 - r0, m)  # [R, b, hk, mB, d]
            scores = schedule.scores(qb[r0:r1], kg, r0, r1, m, ws.take(ws.scores, (r1 - r0, b, hk, schedule.gB, m * B)))
            mx = scores.amax(-1, keepdim=True)
            scores.sub_(mx).exp_()
            total = scores.sum(-1, keepdim=True)
            torch.matmul(scores, vg, out=out[r0:r1]).div_(total)
            lse[r0:r1] = mx.add_(total.log_())
        del ws, qb, kb, vb
        result = _q_tokens(out, s, h, q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.schedule, ctx.scale = schedule, scale
        return result

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        schedule, B = ctx.schedule, ctx.schedule.B
        (b, s, h, d), hk, dtype = q.shape, k.shape[2], lse.dtype
        delta = _q_rows((grad_out.to(dtype) * out).sum(-1), hk, B)  # [n, b, hk, gB, 1]
        qb = _q_blocks(q, hk, B, dtype).mul_(ctx.scale)
        kb, vb = _kv_blocks(k, B, dtype), _kv_blocks(v, B, dtype)
        dob = _q_blocks(grad_out, hk, B, dtype)  # [n, b, hk, gB, d]
        dq = torch.empty_like(qb)
        dk, dv = torch.zeros_like(kb), torch.zeros_like(vb)
        ws = _Workspace(schedule, d, dtype, q.device, backward=True)
        for r0, r1, m in schedule.chunks:
            R, idx = r1 - r0, schedule.index(r0, r1, m)
            kg, vg = ws.gather(ws.k, kb, idx, R, m), ws.gather(ws.v, vb, idx, R, m)
            qc, doc = qb[r0:r1], dob[r0:r1]
            p = schedule.scores(qc, kg, r0, r1, m, ws.take(ws.scores, (R, b, hk, schedule.gB, m * B)))
            p.sub_(lse[r0:r1]).exp_()  # [R, b, hk, gB, m * B]
            grad_blocks = ws.take(ws.grad, (R, b, hk, m * B, d))
            dv.index_add_(0, idx, torch.matmul(p.transpose(-1, -2), doc, out=grad_blocks).view(-1, B, d))
            ds = torch.matmul(doc, vg.transpose(-1, -2), out=ws.take(ws.dp, p.shape)).sub_(delta[r0:r1]).mul_(p)
            torch.matmul(ds, kg, out=dq[r0:r1])
            # qc carries the scale already
            dk.index_add_(0, idx, torch.matmul(ds.transpose(-1, -2), qc, out=grad_blocks).view(-1, B, d))
        del ws, qb, kb, vb, dob
        dq = _q_tokens(dq.mul_(ctx.scale), s, h, q.dtype)
        dk = _kv_tokens(dk, b, hk, s, k.dtype)
        return dq, dk, _kv_tokens(dv, b, hk, s, v.dtype), None, None, None, None, None


class _Workspace:
    """Buffers sized for the largest chunk, reused by every chunk of one call."""

    def __init__(self, schedule: _Schedule, d: int, dtype: torch.dtype, device, backward: bool) -> None:
        self.b, self.hk = schedule.b, schedule.hk
        rows_slots = max((r1 - r0) * m for r0, r1, m in schedule.chunks)
        blocks = rows_slots * schedule.b * schedule.hk  # gathered K/V blocks of the largest chunk
        self.scores = torch.empty(blocks * schedule.gB * schedule.B, dtype=dtype, device=device)
        self.k = torch.empty(blocks * schedule.B * d, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        if backward:
            self.dp, self.grad = torch.empty_like(self.scores), torch.empty_like(self.k)

    @staticmethod
    def take(buffer: torch.Tensor, shape) -> torch.Tensor:
        return buffer[: math.prod(shape)].view(shape)

    def gather(self, buffer: torch.Tensor, x: torch.Tensor, idx: torch.Tensor, R: int, m: int) -> torch.Tensor:
        """Blocks `idx` of x [b * hk * n, B, d] -> [R, b, hk, m * B, d] in `buffer`."""
        B, d = x.shape[1:]
        picked = self.take(buffer, (idx.numel(), B, d))
        torch.index_select(x, 0, idx, out=picked)
        return picked.view(R, self.b, self.hk, m * B, d)


class _Schedule:
    """Index bookkeeping of one call: chunks of query-block rows, the K/V block rows they gather, and the
    token mask of each row's last attended block."""

    def __init__(self, cols, counts, b, hk, s, B, causal, gB):
        self.B, self.s, self.causal, self.g = B, s, causal, gB // B
        self.b, self.hk, self.gB = b, hk, gB
        n = self.n = cols.shape[-2]
        lead = cols.shape[:-2] or (1, 1)
        # [..., n, nnz] -> rows outermost: [n, lb, lh, nnz] and [n, lb, lh]
        self.cols = cols.reshape(*lead, *cols.shape[-2:]).permute(2, 0, 1, 3)
        self.counts = counts.reshape(*lead, n).permute(2, 0, 1)
        device = cols.device
        base = (torch.arange(b, device=device)[:, None] * hk + torch.arange(hk, device=device)) * n
        self.base = base[:, :, None]  # [b, hk, 1]: row of block 0 of each (sequence, kv head)
        # A row's last attended block needs a token mask if it is the diagonal (causal) or the ragged tail.
        rows = torch.arange(n, device=device)[:, None, None]
        last = self.cols.gather(-1, (self.counts - 1).clamp(min=0)[..., None])[..., 0]
        partial = (last == n - 1) & (s % B != 0)
        if causal:
            partial |= last >= rows
        self.full = self.counts - partial.long()  # leading slots that need no mask
        self.chunks = _chunks(counts, b * hk * gB * B)

    def index(self, r0: int, r1: int, m: int) -> torch.Tensor:
        """Rows of the [b * hk * n, B, d] K/V blocks that rows r0..r1 attend: [R * b * hk * m]."""
        return (self.base + self.cols[r0:r1, :, :, :m]).reshape(-1)

    def scores(self, qc: torch.Tensor, kg: torch.Tensor, r0: int, r1: int, m: int, out: torch.Tensor) -> torch.Tensor:
        """Masked scores of rows r0..r1 into `out` [R, b, hk, g * B, m * B]; -inf outside the layout's tokens."""
        scores = torch.matmul(qc, kg.transpose(-1, -2), out=out)
        start = int(self.full[r0:r1].min())  # slots from here on may need a mask in some row
        if start < m:
            B, device = self.B, qc.device
            slots = torch.arange(start, m, device=device)
            cols = self.cols[r0:r1, :, :, start:m]  # [R, lb, lh, T]
            keys = (cols[..., None] * B + torch.arange(B, device=device)).flatten(-2)  # [R, lb, lh, T * B]
            ok = (slots < self.counts[r0:r1, :, :, None]).repeat_interleave(B, -1) & (keys < self.s)
            ok = ok[..., None, :]  # [R, lb, lh, 1 (query), T * B]
            if self.causal:
                queries = torch.arange(r0 * B, r1 * B, device=device).view(-1, 1, 1, B, 1)
                ok = ok & (keys[..., None, :] <= queries)  # [R, lb, lh, B, T * B]
            tail = scores.view(*scores.shape[:3], self.g, B, m * B)[..., start * B:]
            tail.masked_fill_(~ok[:, :, :, None], float("-inf"))
        return scores


