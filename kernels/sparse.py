"""Block-sparse attention: layouts (fixed, BigBird, Longformer, sliding window, variable) and the attention
that computes only their non-zero blocks, forward and backward, never the dense [seq, seq] scores.

A layout is data: per query block, the ascending list of key blocks it attends (`BlockLayout`), built from
a `SparseConfig` and cached per (config, sequence length, causal). On CPU the attention is a fused C++ kernel
(`kernels/csrc/block_sparse.cpp`, compiled on first use) or, for fp64 or without a compiler, PyTorch ops
batched over blocks in chunks of query blocks; both keep memory O(seq x non-zero blocks per row x block).
On CUDA the same call runs FlexAttention with a BlockMask built from the same layout.
"""

from __future__ import annotations

import functools
import math
import os
import warnings
from dataclasses import astuple, dataclass, field, fields

import torch
from moe_lst.kernels.attention import check_qkv

LAYOUTS = ("fixed", "bigbird", "longformer", "sliding_window", "variable")
# The SparseConfig fields each layout reads (block_size always); any other field set away from its default
# is refused by `SparseConfig.unused_fields`, so a key that would silently do nothing is caught.
LAYOUT_FIELDS = {
    "fixed": ("window_blocks", "global_blocks"),
    "bigbird": ("window_blocks", "global_blocks", "random_blocks", "seed"),
    "longformer": ("window_blocks", "global_tokens"),
    "sliding_window": ("window_blocks",),
    "variable": ("local_window_blocks", "global_block_indices"),
}


@dataclass
class SparseConfig:
    """Which key blocks each query block attends (all counts in blocks of `block_size` tokens).

    - sliding_window: the blocks within `window_blocks - 1` of the query block (earlier ones only when causal).
    - fixed (Sparse Transformer): the sequence is cut into windows of `window_blocks` blocks; a query block
      attends its own window and the last `global_blocks` blocks of every window (strided global columns).
    - bigbird: sliding window, the first `global_blocks` blocks attend and are attended by every block, and
      `random_blocks` more blocks per row drawn with `seed`.
    - longformer: sliding window, and the blocks holding the `global_tokens` (token positions) attend and
      are attended by every block.
    - variable: windows of `local_window_blocks` blocks (the last size repeats), and every block attends
      the blocks in `global_block_indices`.
    Causal layouts keep only key blocks at or before the query block; inside a block the usual token-level
    causal mask applies.
    """

    layout: str = "fixed"
    block_size: int = 64
    window_blocks: int = 4
    global_blocks: int = 1
    random_blocks: int = 1
    seed: int = 0
    global_tokens: tuple[int, ...] = (0,)
    local_window_blocks: tuple[int, ...] = (4,)
    global_block_indices: tuple[int, ...] = (0,)

    def __post_init__(self) -> None:
        for name in ("global_tokens", "local_window_blocks", "global_block_indices"):  # lists from a config file
            setattr(self, name, tuple(int(x) for x in getattr(self, name)))
        if self.layout not in LAYOUTS:
            raise ValueError(f"model.sparse.layout={self.layout!r} is not a layout; choose one of {', '.join(LAYOUTS)}")
        for name, minimum in (("block_size", 1), ("window_blocks", 1), ("global_blocks", 0), ("random_blocks", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"model.sparse.{name}={value!r} must be an integer >= {minimum}")
        if self.layout == "fixed" and self.global_blocks > self.window_blocks:
            raise ValueError(f"model.sparse.global_blocks={self.global_blocks} must be <= window_blocks="
                             f"{self.window_blocks} for layout=fixed (the global blocks are the last blocks of "
                             "each window); lower global_blocks or raise window_blocks")
        if self.layout == "variable" and (not self.local_window_blocks or min(self.local_window_blocks) < 1):
            raise ValueError(f"model.sparse.local_window_blocks={list(self.local_window_blocks)} must be a non-empty "
                             "list of window sizes >= 1 (in blocks)")
        negative = [t for t in self.global_tokens + self.global_block_indices if t < 0]
        if negative:
            raise ValueError(f"global token / block positions must be >= 0, got {negative}")

    def unused_fields(self) -> list[str]:
        """Fields set away from their defaults that this layout does not read."""
        used = ("layout", "block_size", *LAYOUT_FIELDS[self.layout])
        return [f.name for f in fields(self) if f.name not in used and getattr(self, f.name) != _DEFAULT[f.name]]

    def check_sequence(self, seq_len: int) -> None:
        """Raise a ValueError if this layout cannot be built for `seq_len` tokens (global blocks or tokens
        beyond the sequence)."""
        n = -(-seq_len // self.block_size)
        if self.layout == "bigbird" and self.global_blocks > n:
            raise ValueError(f"model.sparse.global_blocks={self.global_blocks} is more global blocks than the "
                             f"sequence has ({seq_len} tokens: {n} block(s) of {self.block_size}); lower it")
        if self.layout == "longformer" and any(t >= seq_len for t in self.global_tokens):
            raise ValueError(f"model.sparse.global_tokens={list(self.global_tokens)} must be token positions "
                             f"< the sequence length {seq_len}")
        if self.layout == "variable" and any(j >= n for j in self.global_block_indices):
            raise ValueError(f"model.sparse.global_block_indices={list(self.global_block_indices)} must be blocks "
                             f"< {n}: the sequence has {seq_len} tokens, {n} blocks of {self.block_size}")


_DEFAULT = {f.name: getattr(SparseConfig(), f.name) for f in fields(SparseConfig)}


@dataclass(frozen=True, eq=False)
class BlockLayout:
    """A block-sparse mask as data: query block r attends key blocks `cols[..., r, :counts[..., r]]`
    (ascending; the slots after `counts` are padding). Leading dims, when present, are [batch, kv_heads]
    (a per-sequence, per-head layout such as NSA's selected blocks; sizes 1 broadcast).

    Inside the attended blocks a token-level mask applies only where needed: the causal mask on the
    diagonal block and the tail of a ragged last block. Both can only hit a row's last attended block (its
    largest index), which the kernel uses to mask just that slot.
    """

    name: str
    block_size: int
    seq_len: int
    causal: bool
    cols: torch.Tensor  # [..., n_blocks, max_nnz] int64
    counts: torch.Tensor  # [..., n_blocks] int64
    _on_device: dict = field(default_factory=dict, repr=False, compare=False)  # copies per device, BlockMasks

    @property
    def num_blocks(self) -> int:
        return self.cols.shape[-2]

    @property
    def nnz(self) -> int:
        """Attended (query block, key block) pairs, summed over any leading dims."""
        return int(self.counts.sum())

    @property
    def density(self) -> float:
        """Fraction of the blocks a dense (causal or not) attention would compute."""
        n = self.num_blocks
        full = n * (n + 1) // 2 if self.causal else n * n
        return self.nnz / (full * max(1, self.counts[..., 0].numel()))

    def to(self, device: torch.device | str) -> BlockLayout:
        device = torch.device(device)
        if device == self.cols.device:
            return self
        if device not in self._on_device:
            self._on_device[device] = BlockLayout(self.name, self.block_size, self.seq_len, self.causal,
                                                  self.cols.to(device), self.counts.to(device))
        return self._on_device[device]

    def block_mask(self) -> torch.Tensor:
        """Dense block-level mask [..., n_blocks, n_blocks] (bool): for display and tests."""
        n = self.num_blocks
        valid = torch.arange(self.cols.shape[-1], device=self.cols.device) < self.counts[..., None]
        mask = torch.zeros(*self.cols.shape[:-1], n + 1, dtype=torch.bool, device=self.cols.device)
        mask.scatter_(-1, torch.where(valid, self.cols, n), True)  # padding slots land in the spare column
        return mask[..., :n]

    def token_mask(self) -> torch.Tensor:
        """Dense token-level mask [..., seq, seq]: quadratic, for tests on short sequences only."""
        s, B = self.seq_len, self.block_size
        blocks = torch.arange(s, device=self.cols.device) // B
        mask = self.block_mask()[..., blocks, :][..., blocks]
        if self.causal:
            mask = mask & torch.ones(s, s, dtype=torch.bool, device=mask.device).tril()
        return mask

    def __str__(self) -> str:
        n = self.num_blocks
        head = (f"BlockLayout({self.name}, {'causal' if self.causal else 'bidirectional'}, seq_len={self.seq_len}, "
                f"block_size={self.block_size}: {n}x{n} blocks, {self.nnz} non-zero, density {self.density:.3f})")
        if self.cols.dim() > 2 or n > 64:
            return head
        rows = ["".join("#" if x else "." for x in row) for row in self.block_mask().tolist()]
        return "\n".join([head, *rows])

    def save_image(self, path: str, title: str | None = None) -> None:
        """Save the block mask as an image (matplotlib): one pixel row per query block."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        mask = self.block_mask()
        while mask.dim() > 2:
            mask = mask[0]
        fig, ax = plt.subplots(figsize=(4, 4), dpi=150)
        ax.imshow(mask.cpu().numpy(), cmap="Greys", interpolation="nearest")
        ax.set_xlabel("key block")
        ax.set_ylabel("query block")
        ax.set_title(title or f"{self.name} ({self.block_size}-token blocks, density {self.density:.2f})", fontsize=8)
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)


# ----------------------------------------------------------------------------------------------- layouts
def _window_ids(sizes: tuple[int, ...], n: int) -> torch.Tensor:
    """Window index of each of n blocks for consecutive windows of `sizes` blocks (the last size repeats)."""
    ids, start, w = [], 0, 0
    while start < n:
        size = sizes[min(w, len(sizes) - 1)]
        ids += [w] * size
        start, w = start + size, w + 1
    return torch.tensor(ids[:n])


_HASH_PRIME = 2**31 - 1


def _uniform_hash(seed: int, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """Pseudo-random numbers in [0, 1) that depend on (seed, i, j) alone: a causal layout's random blocks
    are then the same whatever the sequence length (a padded sequence under Ulysses keeps them)."""
    h = (i * 1_000_003 + j * 7_919 + (seed % _HASH_PRIME) * 104_729 + 12_345) % _HASH_PRIME
    for mult in (48_271, 16_807, 69_621):  # xor-shift then multiply mod a prime: products stay below 2**62
        h = ((h ^ (h >> 15)) * mult) % _HASH_PRIME
    return h.double().div_(_HASH_PRIME).float()


def _rows(cfg: SparseConfig, n: int, causal: bool, i: torch.Tensor) -> torch.Tensor:
    """Block mask rows `i` [R] of the layout: bool [R, n]."""
    j = torch.arange(n)[None, :]
    i = i[:, None]
    w = cfg.window_blocks
    window = (i - j).abs() < w
    if cfg.layout == "sliding_window":
        mask = window
    elif cfg.layout == "fixed":
        mask = (i // w == j // w) | (j % w >= w - cfg.global_blocks)
    elif cfg.layout == "bigbird":
        mask = window | (j < cfg.global_blocks) | (i < cfg.global_blocks)
    elif cfg.layout == "longformer":
        g = torch.tensor(sorted({t // cfg.block_size for t in cfg.global_tokens}), dtype=torch.long)
        mask = window | torch.isin(j, g) | torch.isin(i, g)
    else:  # variable
        ids = _window_ids(cfg.local_window_blocks, n)
        g = torch.tensor(cfg.global_block_indices, dtype=torch.long)
        mask = (ids[i] == ids[j]) | torch.isin(j, g)
    allowed = j <= i if causal else torch.ones_like(mask)
    mask = mask & allowed
    if cfg.layout == "bigbird" and cfg.random_blocks:
        scores = _uniform_hash(cfg.seed, i, j).masked_fill(~(allowed & ~mask), -1.0)
        top = scores.topk(min(cfg.random_blocks, n), dim=1)
        mask = mask.scatter(1, top.indices, top.values >= 0) | mask
    return mask


def block_layout(cfg: SparseConfig, seq_len: int, causal: bool = True) -> BlockLayout:
    """The layout of `cfg` for `seq_len` tokens, cached per (config values, length, causal)."""
    return _cached_layout(astuple(cfg), seq_len, causal)


@functools.lru_cache(maxsize=64)
def _cached_layout(values: tuple, seq_len: int, causal: bool) -> BlockLayout:
    # Keyed on the values, not the (mutable) config object. Built in chunks of rows, never [seq, seq].
    cfg = SparseConfig(*values)
    cfg.check_sequence(seq_len)
    n = -(-seq_len // cfg.block_size)
    cols, counts = [], []
    step = max(1, (1 << 22) // n)
    for r0 in range(0, n, step):
        mask = _rows(cfg, n, causal, torch.arange(r0, min(n, r0 + step)))
        c = mask.sum(1)
        rows, found = mask.nonzero(as_tuple=True)  # row-major: each row's key blocks in ascending order
        slot = torch.arange(rows.numel()) - (torch.cumsum(c, 0) - c)[rows]
        chunk = torch.zeros(mask.shape[0], int(c.max()), dtype=torch.long)
        chunk[rows, slot] = found
        cols.append(chunk)
        counts.append(c)
    width = max(x.shape[1] for x in cols)
    cols = torch.cat([torch.nn.functional.pad(x, (0, width - x.shape[1])) for x in cols])
    return BlockLayout(cfg.layout, cfg.block_size, seq_len, causal, cols, torch.cat(counts))


# ------------------------------------------------------------------------------------- the attention
def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockLayout,
                           scale: float | None = None) -> torch.Tensor:
    """Attention of q [b, s, h, d] over k, v [b, s, h_kv, d] (GQA) restricted to `layout`'s blocks.

    Equals dense attention with the layout's token mask applied as -inf. CUDA tensors go to FlexAttention;
    others to the chunked PyTorch path (`cpu_block_sparse_attention`).
    """
    check_qkv(q, k, v, same_seq=True, what="block_sparse_attention")
    if layout.seq_len != q.shape[1]:
        raise ValueError(f"block_sparse_attention: the layout was built for {layout.seq_len} tokens but q has "
                         f"{q.shape[1]}; build it with block_layout(config, seq_len={q.shape[1]})")
    lead = layout.cols.shape[:-2]
    if len(lead) not in (0, 2) or any(x not in (1, want) for x, want in zip(lead, (q.shape[0], k.shape[2]))):
        raise ValueError(f"block_sparse_attention: layout leading dims {tuple(lead)} must be [batch or 1, "
                         f"kv_heads or 1] for q{tuple(q.shape)} k{tuple(k.shape)}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    layout = layout.to(q.device)
    if q.is_cuda and _flex_attention is not None:
        return flex_block_sparse_attention(q, k, v, layout, scale)
    return cpu_block_sparse_attention(q, k, v, layout, scale)


class SparseAttention:
    """`attn_fn(q, k, v, causal=True, scale=None)` for a model: the layout of `config` at q's length."""

    def __init__(self, config: SparseConfig) -> None:
        self.config = config
        self.__name__ = f"sparse_attention[{config.layout}]"

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                 scale: float | None = None) -> torch.Tensor:
        return block_sparse_attention(q, k, v, block_layout(self.config, q.shape[1], causal), scale=scale)

    def __repr__(self) -> str:
        return f"SparseAttention({self.config})"


# Elements of one chunk's score tensor [rows, b, kv_heads, group * block, nnz * block]: small enough to stay
# in the CPU caches between the passes over it, large enough that per-chunk Python overhead is noise.
CHUNK_ELEMENTS = 1 << 19

# Which CPU implementation runs: "native" (the fused C++ kernel in kernels/csrc/block_sparse.cpp, compiled on
# first use), "eager" (PyTorch ops, chunked), or "auto": native for fp32/bf16/fp16 inputs when it builds,
# eager for fp64 or when it does not (with one warning naming why). Also set by MOE_LST_SPARSE_CPU.
CPU_IMPL = os.environ.get("MOE_LST_SPARSE_CPU", "auto")
CPU_IMPLS = ("auto", "native", "eager")
_NATIVE_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "block_sparse.cpp")
_native_state: dict = {}


def native_kernel():
    """The compiled CPU kernel module, built on first use (torch.utils.cpp_extension: g++ and ninja, about
    30 s, then cached per source and flags). Raises RuntimeError naming the cause if it cannot be built."""
    if "module" not in _native_state:
        try:
            from torch.utils.cpp_extension import load

            # -fno-trapping-math lets GCC vectorise the exp loops (float -> int conversion); inf/nan stay IEEE.
            flags = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]
            # -march=native: the build is named after this CPU's features, so a cache directory shared by
            # machines with different CPUs never hands one of them a binary built for the other.
            _native_state["module"] = load(name=f"moe_lst_block_sparse_{_cpu_tag()}", sources=[_NATIVE_SOURCE],
                                           extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False)
        except Exception as exc:  # noqa: BLE001 - a missing compiler or ninja, a build error: reported below
            _native_state["module"] = None
            lines = str(exc).strip().splitlines() or [""]
            _native_state["error"] = f"{type(exc).__name__}: {lines[-1]}"
    if _native_state["module"] is None:
        raise RuntimeError(f"the native block-sparse CPU kernel could not be built ({_native_state['error']}); "
                           "it needs g++ and ninja (pip install ninja)")
    return _native_state["module"]


def _cpu_tag() -> str:
    import hashlib
    import platform

    flags = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            flags += next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return hashlib.sha1(flags.encode()).hexdigest()[:10]


def _use_native(q: torch.Tensor) -> bool:
    if CPU_IMPL not in CPU_IMPLS:
        raise ValueError(f"moe_lst.kernels.sparse.CPU_IMPL={CPU_IMPL!r} (or MOE_LST_SPARSE_CPU) must be one of "
                         f"{CPU_IMPLS}")
    if CPU_IMPL == "eager":
        return False
    if CPU_IMPL == "native":
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
    """(first row, end row, max count) of consecutive query-block rows whose scores fit CHUNK_ELEMENTS."""
    widest = counts.reshape(-1, counts.shape[-1]).amax(0).tolist()
    out, r0, width = [], 0, 0
    for r, c in enumerate(widest):
        wider = max(width, c)
        if r > r0 and (r + 1 - r0) * wider * per_row > CHUNK_ELEMENTS:
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
        plan = _Plan(cols, counts, b, hk, s, B, causal, qb.shape[-2])
        ws = _Workspace(plan, d, dtype, q.device, backward=False)
        out = torch.empty_like(qb)
        lse = torch.empty(qb.shape[:-1] + (1,), dtype=dtype, device=q.device)
        for r0, r1, m in plan.chunks:
            idx = plan.index(r0, r1, m)
            kg, vg = ws.gather(ws.k, kb, idx, r1 - r0, m), ws.gather(ws.v, vb, idx, r1 - r0, m)  # [R, b, hk, mB, d]
            scores = plan.scores(qb[r0:r1], kg, r0, r1, m, ws.take(ws.scores, (r1 - r0, b, hk, plan.gB, m * B)))
            mx = scores.amax(-1, keepdim=True)
            scores.sub_(mx).exp_()
            total = scores.sum(-1, keepdim=True)
            torch.matmul(scores, vg, out=out[r0:r1]).div_(total)
            lse[r0:r1] = mx.add_(total.log_())
        del ws, qb, kb, vb
        result = _q_tokens(out, s, h, q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.plan, ctx.scale = plan, scale
        return result

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        plan, B = ctx.plan, ctx.plan.B
        (b, s, h, d), hk, dtype = q.shape, k.shape[2], lse.dtype
        delta = _q_rows((grad_out.to(dtype) * out).sum(-1), hk, B)  # [n, b, hk, gB, 1]
        qb = _q_blocks(q, hk, B, dtype).mul_(ctx.scale)
        kb, vb = _kv_blocks(k, B, dtype), _kv_blocks(v, B, dtype)
        dob = _q_blocks(grad_out, hk, B, dtype)  # [n, b, hk, gB, d]
        dq = torch.empty_like(qb)
        dk, dv = torch.zeros_like(kb), torch.zeros_like(vb)
        ws = _Workspace(plan, d, dtype, q.device, backward=True)
        for r0, r1, m in plan.chunks:
            R, idx = r1 - r0, plan.index(r0, r1, m)
            kg, vg = ws.gather(ws.k, kb, idx, R, m), ws.gather(ws.v, vb, idx, R, m)
            qc, doc = qb[r0:r1], dob[r0:r1]
            p = plan.scores(qc, kg, r0, r1, m, ws.take(ws.scores, (R, b, hk, plan.gB, m * B)))
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

    def __init__(self, plan: _Plan, d: int, dtype: torch.dtype, device, backward: bool) -> None:
        self.b, self.hk = plan.b, plan.hk
        rows_slots = max((r1 - r0) * m for r0, r1, m in plan.chunks)
        blocks = rows_slots * plan.b * plan.hk  # gathered K/V blocks of the largest chunk
        self.scores = torch.empty(blocks * plan.gB * plan.B, dtype=dtype, device=device)
        self.k = torch.empty(blocks * plan.B * d, dtype=dtype, device=device)
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


class _Plan:
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


# ------------------------------------------------------------------------------------- CUDA: FlexAttention
try:  # FlexAttention needs a recent torch; without it CUDA tensors take the PyTorch path too
    from torch.nn.attention.flex_attention import BlockMask as _BlockMask
    from torch.nn.attention.flex_attention import flex_attention as _flex_attention
except Exception:  # noqa: BLE001 - any import failure means "not available"
    _flex_attention = _BlockMask = None

_compiled_flex = None
# FlexAttention's Triton kernels tile by 128 (or 64) tokens; a layout of smaller blocks is coarsened to 128-token
# blocks for the kernel's skip list while the mask function keeps the exact layout.
FLEX_BLOCK = 128


def flex_block_mask(layout: BlockLayout, heads: int):
    """A FlexAttention BlockMask for `layout`: the kernel visits only blocks the layout touches, and the mask
    function applies exactly the layout's token mask (so eager and compiled FlexAttention agree)."""
    B, s, causal = layout.block_size, layout.seq_len, layout.causal
    allowed = layout.block_mask()  # [..., n, n] block level
    if allowed.dim() == 2:
        allowed = allowed[None, None]
    if allowed.shape[1] > 1:  # per kv head (GQA): every query head of a group uses its kv head's blocks
        allowed = allowed.repeat_interleave(heads // allowed.shape[1], dim=1)

    def mask_mod(b, h, q_idx, kv_idx):
        ok = allowed[b % allowed.shape[0], h % allowed.shape[1], q_idx // B, kv_idx // B] & (kv_idx < s)
        return ok & (kv_idx <= q_idx) if causal else ok

    F = B if B % FLEX_BLOCK == 0 or FLEX_BLOCK % B else FLEX_BLOCK
    n, nf = allowed.shape[-1], -(-s // F)
    rows, cols = torch.arange(n, device=allowed.device), torch.arange(n, device=allowed.device)
    # A fine block is "full" (no token mask) unless it is the causal diagonal or the ragged tail.
    clean = ~((cols[None, :] == n - 1) & (s % B != 0))
    if causal:
        clean = clean & (cols[None, :] < rows[:, None])
    full = allowed & clean
    if F != B:
        per, pad = F // B, nf * (F // B) - n
        fine = torch.nn.functional.pad(allowed, (0, pad, 0, pad)).view(*allowed.shape[:2], nf, per, nf, per)
        full = torch.nn.functional.pad(full, (0, pad, 0, pad), value=True).view_as(fine)
        any_ = fine.any(5).any(3)
        every = full.all(5).all(3) & any_
    else:
        any_, every = allowed, full
    partial = any_ & ~every

    def ordered(mask):
        num = mask.sum(-1, dtype=torch.int32)
        idx = torch.sort(mask.to(torch.uint8), dim=-1, descending=True, stable=True).indices.to(torch.int32)
        return num.contiguous(), idx.contiguous()

    kv_num, kv_idx = ordered(partial)
    full_num, full_idx = ordered(every)
    return _BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=F, mask_mod=mask_mod,
                                     seq_lengths=(s, s))


def flex_block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockLayout,
                                scale: float) -> torch.Tensor:
    """The CUDA path: compiled FlexAttention (fused Triton kernels, forward and backward) with the layout's
    BlockMask. q [b, s, h, d], k/v [b, s, h_kv, d]."""
    global _compiled_flex
    if _compiled_flex is None:
        _compiled_flex = torch.compile(_flex_attention, dynamic=False)
    # A shared layout (built by block_layout, cached) keeps its BlockMask; a per-call one (NSA) builds its own.
    key = ("flex", q.shape[2])
    mask = layout._on_device.get(key)
    if mask is None:
        mask = flex_block_mask(layout, q.shape[2])
        if layout.cols.dim() == 2:
            layout._on_device[key] = mask
    out = _compiled_flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=mask, scale=scale,
                         enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)
