"""Attention dispatch on `[batch, seq, heads, head_dim]`: flash-attn on CUDA when installed, else SDPA.

GQA (fewer kv heads than query heads) is handled by every backend. `reference_attention` is the plain
softmax(QK^T)V implementation the other paths are tested against. Packed documents (`documents=`, see
`moe_lst.kernels.documents`) attend only within themselves: flash-attn's varlen kernel, else on CUDA a
FlexAttention document mask, else (CPU) one call per document, which computes only the diagonal blocks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from moe_lst.kernels.documents import Documents, document_ids, per_document

try:  # optional: only on CUDA machines with the `cuda` extra installed
    from flash_attn import flash_attn_func as _flash_attn_func
    from flash_attn import flash_attn_varlen_func as _flash_attn_varlen_func
except Exception:  # noqa: BLE001 - any import failure means "not available"
    _flash_attn_func = _flash_attn_varlen_func = None

try:  # FlexAttention (a recent torch): the document mask on CUDA when flash-attn is not installed
    from torch.nn.attention.flex_attention import BlockMask as _BlockMask
    from torch.nn.attention.flex_attention import flex_attention as _flex_attention
except Exception:  # noqa: BLE001 - any import failure means "not available"
    _BlockMask = _flex_attention = None
_compiled_flex = None

BACKENDS = ("auto", "flash", "sdpa", "reference")


def flash_available(q: torch.Tensor) -> bool:
    return _flash_attn_func is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, same_seq: bool = False,
              same_dtype: bool = False, what: str = "attention", seq: str = "seq") -> None:
    """Raise a ValueError unless q [batch, seq, heads, head_dim] and k, v [batch, seq_k, kv_heads, head_dim]
    fit one attention call (query heads a multiple of kv heads: GQA).

    `same_seq` / `same_dtype`: also require k and v to have q's sequence length / all three one dtype,
    for callers that pack q, k and v into one buffer. `what` names the caller and `seq` the sequence
    dim in the messages (e.g. "local sequence" for a sequence shard).
    """
    layout = f"[batch, {seq}, heads, head_dim]"
    packed = "since q, k and v are packed into one buffer"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"{what} expects {layout} tensors, got q{tuple(q.shape)} k{tuple(k.shape)} "
                         f"v{tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"{what}: k{tuple(k.shape)} and v{tuple(v.shape)} must have the same shape")
    if same_seq:
        if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
            raise ValueError(f"{what}: q{tuple(q.shape)} and k{tuple(k.shape)} must agree in batch, {seq} "
                             f"length and head_dim, {packed}")
    elif q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"{what}: q{tuple(q.shape)} and k{tuple(k.shape)} differ in batch or head_dim; "
                         f"both must match, only the sequence length ({seq}) may differ")
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"{what}: query heads ({q.shape[2]}) must be a multiple of kv heads ({k.shape[2]}) "
                         "for grouped-query attention")
    if same_dtype and not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{what}: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); cast them to one "
                         f"dtype, {packed}")


def _causal_mask(s_q: int, s_k: int, device) -> torch.Tensor:
    # Bottom-right aligned, as flash-attn does: query i attends to keys <= i + (s_k - s_q).
    i = torch.arange(s_q, device=device)[:, None]
    j = torch.arange(s_k, device=device)[None, :]
    return j <= i + (s_k - s_q)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                        scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v computed in fp32, GQA by repeating kv heads."""
    check_qkv(q, k, v)
    rep = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(rep, dim=2)
    v = v.repeat_interleave(rep, dim=2)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    # [b, s, h, d] -> scores [b, h, s_q, s_k]
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scale
    if causal:
        scores = scores.masked_fill(~_causal_mask(q.shape[1], k.shape[1], q.device), float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v.float()).to(q.dtype)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                   scale: float | None = None) -> torch.Tensor:
    check_qkv(q, k, v)
    gqa = q.shape[2] != k.shape[2]
    # SDPA wants [b, h, s, d]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if causal and q.shape[1] != k.shape[1]:
        mask = _causal_mask(q.shape[1], k.shape[1], q.device)
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=gqa)
    else:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    scale: float | None = None) -> torch.Tensor:
    if not flash_available(q):
        raise RuntimeError(
            "flash-attn backend needs the flash_attn package, a CUDA tensor and fp16/bf16 inputs; "
            f"got package={'yes' if _flash_attn_func else 'no'}, device={q.device}, dtype={q.dtype}"
        )
    check_qkv(q, k, v)
    return _flash_attn_func(q, k, v, causal=causal, softmax_scale=scale)


def flash_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents,
                             causal: bool = True, scale: float | None = None) -> torch.Tensor:
    """flash-attn's varlen kernel over the documents of the rows, flattened to one [b * s] sequence."""
    if not flash_available(q) or _flash_attn_varlen_func is None:
        raise RuntimeError("flash_document_attention needs flash_attn (with its varlen kernel), a CUDA tensor and "
                           f"fp16/bf16 inputs; got device={q.device}, dtype={q.dtype}")
    check_qkv(q, k, v, same_seq=True, what="flash_document_attention")
    b, s = q.shape[:2]
    if "cu_seqlens" not in documents.derived:
        documents.derived["cu_seqlens"] = documents.cu_seqlens()
    cu, longest = documents.derived["cu_seqlens"]
    out = _flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, longest, longest,
                                  causal=causal, softmax_scale=scale)
    return out.unflatten(0, (b, s))


def flex_document_mask(documents: Documents, causal: bool = True, block: int = 128):
    """A FlexAttention BlockMask that keeps each query inside its own document (and causal), built from the
    documents' spans per block of `block` tokens (never an element-wise [seq, seq] mask): the kernel skips block
    pairs that share no document, runs the ones wholly inside one document unmasked, and applies the token-level
    mask function only where a block pair holds a boundary (or the causal diagonal)."""
    ids = document_ids(documents.position_ids)
    b, s = ids.shape
    n = -(-s // block)
    padded = torch.nn.functional.pad(ids, (0, n * block - s), value=-1).view(b, n, block)
    last = padded.amax(-1)  # documents are numbered in order along the row: a block spans [first, last]
    first = torch.where(padded >= 0, padded, torch.full_like(padded, torch.iinfo(ids.dtype).max)).amin(-1)
    rows, cols = torch.arange(n, device=ids.device)[:, None], torch.arange(n, device=ids.device)[None, :]
    lo, hi = torch.maximum(first[:, :, None], first[:, None, :]), torch.minimum(last[:, :, None], last[:, None, :])
    shared = lo <= hi  # [b, q block, kv block]: some document is in both
    whole = (first[:, :, None] == last[:, :, None]) & (first[:, None, :] == last[:, None, :]) & \
        (first[:, :, None] == first[:, None, :])
    whole = whole & ~((cols == n - 1) & (s % block != 0))  # the ragged tail needs the mask function
    if causal:
        shared, whole = shared & (cols <= rows), whole & (cols < rows)

    def ordered(mask):
        num = mask.sum(-1, dtype=torch.int32)[:, None]
        idx = torch.sort(mask.to(torch.uint8), dim=-1, descending=True, stable=True).indices.to(torch.int32)
        return num.contiguous(), idx[:, None].contiguous()

    def mask_mod(batch, head, q_idx, kv_idx):
        same = ids[batch, q_idx] == ids[batch, kv_idx]
        return same & (kv_idx <= q_idx) if causal else same

    kv_num, kv_idx = ordered(shared & ~whole)
    full_num, full_idx = ordered(whole)
    return _BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=mask_mod,
                                     seq_lengths=(s, s))


def flex_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents,
                            causal: bool = True, scale: float | None = None, compiled: bool = True) -> torch.Tensor:
    """FlexAttention with the document mask (compiled: the fused Triton kernels on CUDA; eager only for tests,
    as it computes the full scores). The mask is built once per forward and shared by every layer."""
    global _compiled_flex
    if _flex_attention is None:
        raise RuntimeError("flex_document_attention needs torch.nn.attention.flex_attention (a recent torch)")
    check_qkv(q, k, v, same_seq=True, what="flex_document_attention")
    key = ("flex_mask", causal)
    if key not in documents.derived:
        documents.derived[key] = flex_document_mask(documents, causal)
    if compiled and _compiled_flex is None:
        _compiled_flex = torch.compile(_flex_attention, dynamic=False)
    run = _compiled_flex if compiled else _flex_attention
    out = run(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=documents.derived[key],
              scale=scale, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
              scale: float | None = None, backend: str = "auto", documents: Documents | None = None) -> torch.Tensor:
    """Multi-head attention on `[batch, seq, heads, head_dim]`; k/v may have fewer heads (GQA). With packed
    `documents`, no query attends outside its own document (see the module docstring)."""
    if backend == "auto":
        backend = "flash" if flash_available(q) else "sdpa"
    if documents is not None and not documents.single:
        if backend == "flash":
            return flash_document_attention(q, k, v, documents, causal=causal, scale=scale)
        if backend == "sdpa" and q.is_cuda and _flex_attention is not None:
            return flex_document_attention(q, k, v, documents, causal=causal, scale=scale)
        return per_document(attention, q, k, v, documents, causal=causal, scale=scale, backend=backend)
    if backend == "flash":
        return flash_attention(q, k, v, causal=causal, scale=scale)
    if backend == "sdpa":
        return sdpa_attention(q, k, v, causal=causal, scale=scale)
    if backend == "reference":
        return reference_attention(q, k, v, causal=causal, scale=scale)
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")


attention.handles_documents = True  # moe_lst.kernels.documents.attend passes it the documents
