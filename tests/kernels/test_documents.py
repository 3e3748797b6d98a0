"""moe_lst.kernels.documents: boundaries read from restarting position ids, and attention that stays inside each
document on every dense path that runs here (per-document SDPA, the reference, FlexAttention's document mask)."""

from __future__ import annotations

import warnings

import pytest
import torch
from moe_lst.kernels.attention import attention, flex_document_attention, flex_document_mask, reference_attention
from moe_lst.kernels.documents import Documents, attend, document_ids, per_document, positions_from_starts


def _starts(rows: list[list[int]], s: int) -> torch.Tensor:
    marks = torch.zeros(len(rows), s, dtype=torch.bool)
    for r, offsets in enumerate(rows):
        marks[r, offsets] = True
    return marks


def test_positions_and_bounds_round_trip():
    starts = _starts([[0, 3, 4], [2, 7]], 9)  # row 1 begins inside a document cut at the row's start
    pos = positions_from_starts(starts)
    assert pos.tolist() == [[0, 1, 2, 0, 0, 1, 2, 3, 4], [0, 1, 0, 1, 2, 3, 4, 0, 1]]
    assert document_ids(pos).tolist() == [[0, 0, 0, 1, 2, 2, 2, 2, 2], [0, 0, 1, 1, 1, 1, 1, 2, 2]]
    docs = Documents(pos)
    assert docs.bounds() == [(0, 3, 4, 9), (0, 2, 7, 9)]
    assert not docs.single
    cu, longest = docs.cu_seqlens()
    assert cu.tolist() == [0, 3, 4, 9, 11, 16, 18] and cu.dtype == torch.int32 and longest == 5
    assert Documents(torch.arange(9).expand(2, 9)).single
    # positions continuing past a cut (not restarting at 0) still mark a new document where they jump
    assert Documents(torch.tensor([[5, 6, 7, 0, 1, 9, 10]])).bounds() == [(0, 3, 5, 7)]


def _qkv(b=2, s=40, h=4, hk=2, d=8, dtype=torch.float64):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(b, s, n, d, generator=gen, dtype=dtype, requires_grad=True) for n in (h, hk, hk)]


def _by_hand(q, k, v, bounds):
    rows = []
    for r, b in enumerate(bounds):
        pieces = [reference_attention(q[r:r + 1, a:e], k[r:r + 1, a:e], v[r:r + 1, a:e]) for a, e in zip(b, b[1:])]
        rows.append(torch.cat(pieces, 1))
    return torch.cat(rows)


@pytest.mark.parametrize("backend", ["sdpa", "reference"])
def test_dense_attention_stays_inside_documents(backend):
    q, k, v = _qkv()
    docs = Documents(positions_from_starts(_starts([[0, 9, 10, 31], [0, 17]], 40)))
    out = attend(attention, q, k, v, documents=docs, backend=backend)
    want = _by_hand(q, k, v, docs.bounds())  # the reference computes in fp32
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-5)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    torch.testing.assert_close(grads, torch.autograd.grad(want.square().sum(), (q, k, v)), atol=1e-5, rtol=1e-5)


def test_rows_with_equal_bounds_run_together_and_kwargs_are_cut():
    q, k, v = _qkv()
    seen = []

    def fn(q, k, v, causal=True, gate=None, scale=None):
        seen.append((q.shape[0], q.shape[1], gate.shape[1], scale))
        return reference_attention(q, k, v) * gate

    docs = Documents(positions_from_starts(_starts([[0, 25], [0, 25]], 40)))
    gate = torch.rand(2, 40, 4, 1, dtype=torch.float64)
    out = per_document(fn, q, k, v, docs, gate=gate, scale=None)
    assert seen == [(2, 25, 25, None), (2, 15, 15, None)]
    torch.testing.assert_close(out, _by_hand(q, k, v, docs.bounds()) * gate)


def test_one_document_per_row_is_the_plain_call():
    q, k, v = _qkv()
    calls = []

    def fn(q, k, v, causal=True):
        calls.append(q.shape)
        return reference_attention(q, k, v)

    attend(fn, q, k, v, documents=Documents(torch.arange(40).expand(2, 40)))
    assert calls == [q.shape]
    with pytest.raises(ValueError, match="documents of 39"):
        attend(fn, q, k, v, documents=Documents(torch.arange(39).expand(2, 39)))


def test_flex_document_mask_equals_documents_alone():
    """The CUDA path's mask, run by eager FlexAttention (which computes the full scores: a test of the mask only)."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    q, k, v = (t.detach() for t in _qkv(s=64, dtype=torch.float32))  # (no FlexAttention backward on CPU)
    docs = Documents(positions_from_starts(_starts([[0, 9, 10, 31], [0, 17, 50]], 64)))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*without torch.compile")
        out = flex_document_attention(q, k, v, docs, compiled=False)
    torch.testing.assert_close(out, _by_hand(q, k, v, docs.bounds()), atol=2e-6, rtol=1e-5)


def test_flex_document_block_mask_skips_and_keeps_the_right_blocks():
    """Block level (16-token blocks, a ragged tail): pairs sharing no document are skipped, pairs inside one
    document run without the mask function, and eager FlexAttention over the mask equals each document alone."""
    from torch.nn.attention.flex_attention import flex_attention

    q, k, v = (t.detach() for t in _qkv(s=100, dtype=torch.float32))
    docs = Documents(positions_from_starts(_starts([[0, 40, 41, 90], [0, 16, 33]], 100)))
    mask = flex_document_mask(docs, block=16)
    partial = mask.kv_num_blocks[0, 0].tolist()
    full = mask.full_kv_num_blocks[0, 0].tolist()
    # row 0: documents [0, 40) [40, 41) [41, 90) [90, 100) over blocks of 16: block 3 (48..63) sees blocks 2
    # (shares the third document at 41..47: partial) and 3 (diagonal: partial), nothing of blocks 0-1
    assert (partial[3], full[3]) == (2, 0)
    assert (partial[4], full[4]) == (2, 1)  # 64..79: block 2 partial, block 3 full, itself partial (diagonal)
    # row 1: documents [0, 16) [16, 33) [33, 100): block 4 (64..79) with block 3 whole (full), block 2 (32..47,
    # the boundary at 33) partial, blocks 0-1 skipped
    assert (mask.kv_num_blocks[1, 0, 4].item(), mask.full_kv_num_blocks[1, 0, 4].item()) == (2, 1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*without torch.compile")
        out = flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=mask,
                             enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out, _by_hand(q, k, v, docs.bounds()), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_flex_document_block_classes_hold_for_random_documents(causal):
    """Over random rows, block sizes and ragged tails: no block pair run without the mask function (full) holds a
    pair the mask forbids, no skipped pair holds one it allows, and no pair is visited for nothing (eager
    FlexAttention cannot show this: it applies the mask function everywhere)."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(60):
        b, s, block = int(torch.randint(1, 4, (1,), generator=gen)), int(torch.randint(1, 121, (1,), generator=gen)), \
            (8, 16, 32)[int(torch.randint(0, 3, (1,), generator=gen))]
        starts = torch.rand(b, s, generator=gen) < 0.08
        docs = Documents(positions_from_starts(starts))
        mask = flex_document_mask(docs, causal, block=block)
        ids = document_ids(docs.position_ids)
        allowed = ids[:, :, None] == ids[:, None, :]
        if causal:
            allowed &= torch.ones(s, s, dtype=torch.bool).tril()
        n = -(-s // block)
        pad = torch.nn.functional.pad(allowed, (0, n * block - s, 0, n * block - s))
        blocks = pad.view(b, n, block, n, block)
        for row in range(b):
            for qb in range(n):
                partial = set(mask.kv_indices[row, 0, qb, :mask.kv_num_blocks[row, 0, qb]].tolist())
                full = set(mask.full_kv_indices[row, 0, qb, :mask.full_kv_num_blocks[row, 0, qb]].tolist())
                assert not partial & full
                q_rows = slice(0, min(block, s - qb * block))
                for kb in range(n):
                    k_cols = slice(0, min(block, s - kb * block))
                    pair = blocks[row, qb, q_rows, kb, k_cols]
                    if kb in full:
                        assert pair.all(), (row, qb, kb)
                    else:  # a visited pair holds an allowed one (no block is visited for nothing)
                        assert pair.any() == (kb in partial), (row, qb, kb)
