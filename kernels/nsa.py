"""Native Sparse Attention (NSA, Yuan et al. 2025): three causal branches per query, summed with gates.

- compressed: attention over compressed tokens, one per block of `compress_block` keys taken every
  `compress_stride` tokens and mapped to one key (value) by a learnable MLP with intra-block positions;
  a query sees a compressed token only once the whole block is at or before it.
- selected: attention over `select_blocks` blocks of `block_size` tokens: the first block and the two local
  ones (the query's own block and the one before), plus the highest-scoring others. A block's score is the
  compressed attention probability of the compressed tokens that overlap it, summed over the query heads of
  a GQA group. The selection is made once per query block, from the block's FIRST query (so it never depends
  on a later token), and shared by the heads of the group; it runs on the block-sparse kernel.
- window: the query's own block and the `window_blocks - 1` before it (block-aligned sliding window).
The gates [b, s, h, 3] (sigmoid of a projection of the token's hidden state, computed by the model) weight
the branches. Unlike the paper, the three branches share one set of keys and values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from moe_lst.kernels.attention import check_qkv
from moe_lst.kernels.sparse import BlockLayout, SparseConfig, block_layout, block_sparse_attention


@dataclass
class NSAConfig:
    block_size: int = 64  # selection block (tokens); the selection is made per query block of this size
    select_blocks: int = 16  # blocks each query block attends in the selected branch (first + 2 local included)
    compress_block: int = 32  # tokens per compressed token
    compress_stride: int = 16  # tokens between the starts of consecutive compressed blocks
    window_blocks: int = 8  # sliding-window branch: own block and the ones before it (512 tokens at block 64)

    def __post_init__(self) -> None:
        for name, minimum in (("block_size", 1), ("select_blocks", 3), ("compress_block", 1),
                              ("compress_stride", 1), ("window_blocks", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                why = " (the first block and the two local blocks are always selected)" if minimum == 3 else ""
                raise ValueError(f"model.nsa.{name}={value!r} must be an integer >= {minimum}{why}")
        if self.compress_block % self.compress_stride or self.block_size % self.compress_stride:
            raise ValueError(f"model.nsa.compress_stride={self.compress_stride} must divide compress_block="
                             f"{self.compress_block} and block_size={self.block_size}, so compressed blocks line up "
                             "with selection blocks")


class Compressor(nn.Module):
    """phi: every block of `block` consecutive tokens (a new block each `stride` tokens) -> one token, per head:
    add a learned position encoding per offset in the block, flatten, two-layer SiLU MLP back to head_dim."""

    def __init__(self, head_dim: int, block: int, stride: int, device=None) -> None:
        super().__init__()
        self.block, self.stride = block, stride
        self.pos = nn.Parameter(torch.zeros(block, head_dim, device=device))
        self.w1 = nn.Linear(block * head_dim, head_dim, bias=False, device=device)
        self.w2 = nn.Linear(head_dim, head_dim, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [b, s, heads, d] -> [b, n_compressed, heads, d], n_compressed = (s - block) // stride + 1 (or 0)."""
        b, s, h, d = x.shape
        if s < self.block:
            return x.new_zeros(b, 0, h, d)
        blocks = x.unfold(1, self.block, self.stride).transpose(-1, -2)  # [b, n_c, h, block, d]
        return self.w2(F.silu(self.w1((blocks + self.pos).flatten(-2))))


def compressed_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, cfg: NSAConfig, scale: float,
                         chunk: int = 2048) -> torch.Tensor:
    """Query t attends compressed token i iff its block ends at or before t (i * stride + block - 1 <= t); a
    query before the first complete block gets zeros. SDPA per chunk of queries (flash on CPU and CUDA:
    only out and log-sum-exp are kept), each chunk over the compressed tokens it can see."""
    b, s, h, d = q.shape
    l, stride = cfg.compress_block, cfg.compress_stride
    first = l - 1
    if kc.shape[1] == 0:
        return q.new_zeros(q.shape)
    # torch.split, not slicing: backward then joins the chunks' gradients instead of summing full-size zeros
    sizes = [first] + [min(chunk, s - t0) for t0 in range(first, s, chunk)]
    pieces, t0 = [q.new_zeros(b, first, h, d)], first
    for qc in q.split(sizes, dim=1)[1:]:
        t1 = t0 + qc.shape[1]
        visible = min(kc.shape[1], (t1 - 1 - first) // stride + 1)
        t = torch.arange(t0, t1, device=q.device)[:, None]
        mask = torch.arange(visible, device=q.device)[None, :] * stride + first <= t
        out = F.scaled_dot_product_attention(qc.transpose(1, 2), kc[:, :visible].transpose(1, 2),
                                             vc[:, :visible].transpose(1, 2), attn_mask=mask, scale=scale,
                                             enable_gqa=h != kc.shape[2])
        pieces.append(out.transpose(1, 2))
        t0 = t1
    return torch.cat(pieces, 1)


@torch.no_grad()
def select_blocks(q: torch.Tensor, kc: torch.Tensor, cfg: NSAConfig, scale: float) -> BlockLayout:
    """The selected branch's layout: per (sequence, kv head, query block) the ascending key blocks.

    Query block Q is scored by its first query t0 = Q * block_size: p = softmax over the compressed tokens
    visible to t0, summed over the group's heads; a key block's score is the sum of p over the compressed
    tokens that overlap it. Blocks 0, Q-1 and Q are always taken; the rest are the best-scoring blocks in
    1..Q-2 (ties to the lower index), up to `select_blocks` in all.
    """
    b, s, h, d = q.shape
    hk, B = kc.shape[2], cfg.block_size
    n, n_c = -(-s // B), kc.shape[1]
    l, stride = cfg.compress_block, cfg.compress_stride
    device = q.device
    starts = torch.arange(n, device=device) * B
    imp = torch.zeros(b, hk, n, n, dtype=torch.float32, device=device)
    if n_c:
        q0 = q[:, starts].float().view(b, n, hk, h // hk, d)  # first query of every block
        scores = torch.einsum("bnkgd,bckd->bkgnc", q0, kc.float()) * scale
        visible = torch.arange(n_c, device=device)[None, :] * stride + l - 1 <= starts[:, None]  # [n, n_c]
        p = scores.masked_fill(~visible, float("-inf")).softmax(-1).nan_to_num(0.0).sum(2)  # [b, hk, n, n_c]
        first = torch.arange(n_c, device=device) * stride // B  # key blocks a compressed token overlaps
        last = (torch.arange(n_c, device=device) * stride + l - 1) // B
        for r in range(int((last - first).max()) + 1):
            hit = first + r <= last
            imp.index_add_(-1, (first + r)[hit], p[..., hit])
    rows, cols = torch.arange(n, device=device)[:, None], torch.arange(n, device=device)[None, :]
    imp = imp.masked_fill(~((cols >= 1) & (cols <= rows - 2)), float("-inf"))
    picks = max(0, cfg.select_blocks - 3)
    top = torch.sort(imp, dim=-1, descending=True, stable=True)
    chosen = torch.zeros(b, hk, n, n + 1, dtype=torch.bool, device=device)
    chosen.scatter_(-1, torch.where(top.values[..., :picks] > float("-inf"), top.indices[..., :picks], n), True)
    chosen = chosen[..., :n] | (cols == 0) | (cols == rows) | (cols == rows - 1)
    counts = chosen.sum(-1)
    order = torch.sort(chosen.to(torch.uint8), dim=-1, descending=True, stable=True).indices
    return BlockLayout("nsa_selected", B, s, True, order[..., : int(counts.max())].contiguous(), counts)


def nsa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: torch.Tensor, compress_k: nn.Module,
                  compress_v: nn.Module, cfg: NSAConfig, scale: float | None = None) -> torch.Tensor:
    """q [b, s, h, d], k/v [b, s, h_kv, d], gates [b, s, h, 3] (compressed, selected, window) -> [b, s, h, d]."""
    check_qkv(q, k, v, same_seq=True, what="nsa_attention")
    if gates.shape != (*q.shape[:3], 3):
        raise ValueError(f"nsa_attention: gates{tuple(gates.shape)} must be [batch, seq, heads, 3] for "
                         f"q{tuple(q.shape)} (one weight per branch)")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    kc, vc = compress_k(k), compress_v(v)  # [b, n_c, h_kv, d]
    out_compressed = compressed_attention(q, kc, vc, cfg, scale)
    selected = select_blocks(q.detach(), kc.detach(), cfg, scale)
    out_selected = block_sparse_attention(q, k, v, selected, scale)
    window = SparseConfig(layout="sliding_window", block_size=cfg.block_size, window_blocks=cfg.window_blocks)
    out_window = block_sparse_attention(q, k, v, block_layout(window, q.shape[1], True), scale)
    gates = gates.to(q.dtype)
    return gates[..., 0:1] * out_compressed + gates[..., 1:2] * out_selected + gates[..., 2:3] * out_window


class NativeSparseAttention:
    """`attn_fn(q, k, v, causal=True, gates=...)` for a model, with the model's two compressors.

    Not a module: the compressors stay registered where the model put them, so their parameter names do not
    change when sequence parallelism wraps this function. `gates` is a per-token, per-head tensor, so Ulysses
    moves it to the head shards with q.
    """

    def __init__(self, config: NSAConfig, compress_k: nn.Module, compress_v: nn.Module) -> None:
        self.config, self.compress_k, self.compress_v = config, compress_k, compress_v
        self.__name__ = "native_sparse_attention"

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                 gates: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
        if not causal:
            raise ValueError("native sparse attention is causal only (its compressed and selected branches are "
                             "defined by what precedes each query)")
        if gates is None:
            raise ValueError("native sparse attention needs gates=[batch, seq, heads, 3] (branch weights)")
        return nsa_attention(q, k, v, gates, self.compress_k, self.compress_v, self.config, scale)

    def __repr__(self) -> str:
        return f"NativeSparseAttention({self.config})"
