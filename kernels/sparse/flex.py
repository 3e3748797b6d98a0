"""The CUDA path of block-sparse attention: compiled FlexAttention with a BlockMask built from the layout (the
kernel visits only the layout's blocks; its mask function applies the exact token mask)."""

from __future__ import annotations

import torch
from moe_lst.kernels import sparse
from moe_lst.kernels.sparse.layouts import BlockLayout

try:  # FlexAttention needs a recent torch; without it CUDA tensors take the PyTorch path too
    from torch.nn.attention.flex_attention import BlockMask as _BlockMask
    from torch.nn.attention.flex_attention import flex_attention as _flex_attention
except Exception:  # noqa: BLE001 - any import failure means "not available"
    _flex_attention = _BlockMask = None

_compiled_flex = None


def available() -> bool:
    """Whether this torch has FlexAttention (else CUDA tensors take the CPU path's PyTorch code too)."""
    return _flex_attention is not None


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

    tile = sparse.FLEX_BLOCK
    F = B if B % tile == 0 or tile % B else tile
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
