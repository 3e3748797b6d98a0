"""Block-sparse attention over a layout's non-zero blocks, forward and backward, never the dense [seq, seq] scores:
the public names, the settings (read from here at each call), and the choice of the CPU or the CUDA path."""

from __future__ import annotations

import math
import os

import torch
from moe_lst.kernels.attention import check_qkv
from moe_lst.kernels.sparse import flex
from moe_lst.kernels.sparse.cpu import cpu_block_sparse_attention, native_kernel
from moe_lst.kernels.sparse.flex import flex_block_mask, flex_block_sparse_attention
from moe_lst.kernels.sparse.layouts import LAYOUT_FIELDS, LAYOUTS, BlockLayout, SparseConfig, block_layout

__all__ = ["LAYOUTS", "LAYOUT_FIELDS", "SparseConfig", "BlockLayout", "block_layout", "block_sparse_attention",
           "SparseAttention", "CHUNK_ELEMENTS", "CPU_IMPL", "CPU_IMPLS", "FLEX_BLOCK", "native_kernel",
           "cpu_block_sparse_attention", "flex_block_mask", "flex_block_sparse_attention"]

# Settings: set them on this module (moe_lst.kernels.sparse.CPU_IMPL = ...); cpu.py and flex.py read them here at
# each call.
# Elements of one chunk's score tensor [rows, b, kv_heads, group * block, nnz * block]: small enough to stay
# in the CPU caches between the passes over it, large enough that per-chunk Python overhead is noise.
CHUNK_ELEMENTS = 1 << 19

# Which CPU implementation runs: "native" (the fused C++ kernel in kernels/csrc/block_sparse.cpp, compiled on
# first use), "eager" (PyTorch ops, chunked), or "auto": native for fp32/bf16/fp16 inputs when it builds,
# eager for fp64 or when it does not (with one warning naming why). Also set by MOE_LST_SPARSE_CPU.
CPU_IMPL = os.environ.get("MOE_LST_SPARSE_CPU", "auto")
CPU_IMPLS = ("auto", "native", "eager")
# FlexAttention's Triton kernels tile by 128 (or 64) tokens; a layout of smaller blocks is coarsened to 128-token
# blocks for the kernel's skip list while the mask function keeps the exact layout.
FLEX_BLOCK = 128


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
    if q.is_cuda and flex.available():
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
