"""Native sparse attention against a per-token reference written from its documented semantics."""

import math

import pytest
import torch
import torch.nn.functional as F
from moe_lst.kernels.nsa import Compressor, NativeSparseAttention, NSAConfig, nsa_attention, select_blocks

CFG = NSAConfig(block_size=8, select_blocks=4, compress_block=8, compress_stride=4, window_blocks=2)


def _compress(module, x):
    """phi of one block x [l, d]: position encoding, flatten, MLP."""
    return module.w2(F.silu(module.w1((x + module.pos).flatten())))


def _attend(qv, keys, values, scale):
    if not keys:
        return torch.zeros_like(qv)
    scores = torch.stack([qv @ kk for kk in keys]) * scale
    return (scores.softmax(0)[:, None] * torch.stack(values)).sum(0)


def _reference(q, k, v, gates, ck, cv, cfg, scale):
    """Loops over sequences, heads and tokens; every rule spelled out."""
    b, s, h, d = q.shape
    hk = k.shape[2]
    g, B, l, st = h // hk, cfg.block_size, cfg.compress_block, cfg.compress_stride
    n_c = (s - l) // st + 1 if s >= l else 0
    out = torch.zeros_like(q)
    for bi in range(b):
        kc = [[_compress(ck, k[bi, i * st: i * st + l, kh]) for i in range(n_c)] for kh in range(hk)]
        vc = [[_compress(cv, v[bi, i * st: i * st + l, kh]) for i in range(n_c)] for kh in range(hk)]
        selected = {}
        for kh in range(hk):
            for Q in range(-(-s // B)):
                t0 = Q * B  # the block's first query chooses for the whole block
                score = [0.0] * (-(-s // B))
                for hi in range(kh * g, (kh + 1) * g):
                    seen = [i for i in range(n_c) if i * st + l - 1 <= t0]
                    if seen:
                        p = (torch.stack([q[bi, t0, hi] @ kc[kh][i] for i in seen]) * scale).softmax(0)
                        for i, pi in zip(seen, p.tolist()):
                            for j in range(i * st // B, (i * st + l - 1) // B + 1):
                                score[j] += pi
                forced = {j for j in (0, Q - 1, Q) if j >= 0}
                others = sorted(range(1, Q - 1), key=lambda j: (-score[j], j))[: cfg.select_blocks - 3]
                selected[kh, Q] = forced | set(others)
        for hi in range(h):
            kh = hi // g
            for t in range(s):
                Q = t // B
                seen = [i for i in range(n_c) if i * st + l - 1 <= t]
                o_cmp = _attend(q[bi, t, hi], [kc[kh][i] for i in seen], [vc[kh][i] for i in seen], scale)
                keys = [u for u in range(t + 1) if u // B in selected[kh, Q]]
                o_slc = _attend(q[bi, t, hi], [k[bi, u, kh] for u in keys], [v[bi, u, kh] for u in keys], scale)
                keys = [u for u in range(t + 1) if u // B > Q - cfg.window_blocks]
                o_win = _attend(q[bi, t, hi], [k[bi, u, kh] for u in keys], [v[bi, u, kh] for u in keys], scale)
                gt = gates[bi, t, hi]
                out[bi, t, hi] = gt[0] * o_cmp + gt[1] * o_slc + gt[2] * o_win
    return out


def _inputs(s, h, hk, d=8, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, s, n, d, generator=gen, dtype=dtype, requires_grad=True) for n in (h, hk, hk))
    gates = torch.rand(2, s, h, 3, generator=gen, dtype=dtype, requires_grad=True)
    torch.manual_seed(seed)
    ck = Compressor(d, CFG.compress_block, CFG.compress_stride).to(dtype)
    cv = Compressor(d, CFG.compress_block, CFG.compress_stride).to(dtype)
    for p in (*ck.parameters(), *cv.parameters()):
        torch.nn.init.normal_(p, std=0.3)
    return q, k, v, gates, ck, cv


@pytest.mark.parametrize("s, h, hk", [(45, 4, 2), (40, 2, 2)])
def test_nsa_forward_and_backward_equal_the_reference(s, h, hk):
    q, k, v, gates, ck, cv = _inputs(s, h, hk)
    scale = 1 / math.sqrt(q.shape[-1])
    out = nsa_attention(q, k, v, gates, ck, cv, CFG)
    ref = _reference(q, k, v, gates, ck, cv, CFG, scale)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-8)
    leaves = (q, k, v, gates, *ck.parameters(), *cv.parameters())
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, grad)
    want = torch.autograd.grad(ref, leaves, grad)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, atol=1e-10, rtol=1e-8)


def test_selection_uses_the_scores_and_stays_causal():
    q, k, v, gates, ck, cv = _inputs(64, 4, 2, seed=1)
    layout = select_blocks(q, ck(k), CFG, 1 / math.sqrt(8))
    n = 8
    assert layout.cols.shape[:3] == (2, 2, n)
    counts = layout.counts
    assert counts[..., 3:].eq(4).all() and counts[..., 0].eq(1).all() and counts[..., 2].eq(3).all()
    # different sequences and kv heads choose different blocks somewhere
    picks = {tuple(layout.cols[b, kh, n - 1].tolist()) for b in range(2) for kh in range(2)}
    assert len(picks) > 1
    # nothing at or after position t changes any output before t: perturb the last 20 tokens
    out = nsa_attention(q, k, v, gates, ck, cv, CFG)
    cut = 44
    noisy = [x.detach().clone() for x in (q, k, v, gates)]
    for x in noisy:
        x[:, cut:] = torch.randn_like(x[:, cut:]).abs()
    out2 = nsa_attention(*noisy, ck, cv, CFG)
    torch.testing.assert_close(out2[:, :cut], out[:, :cut], atol=1e-12, rtol=0)
    assert not torch.allclose(out2[:, cut:], out[:, cut:])


def test_short_sequences_and_errors():
    q, k, v, gates, ck, cv = _inputs(5, 2, 1)  # shorter than one compressed block: compressed branch is zero
    fn = NativeSparseAttention(CFG, ck, cv)
    out = fn(q, k, v, gates=gates)
    ref = _reference(q, k, v, gates, ck, cv, CFG, 1 / math.sqrt(8))
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-8)
    with pytest.raises(ValueError, match="causal only"):
        fn(q, k, v, causal=False, gates=gates)
    with pytest.raises(ValueError, match="needs gates"):
        fn(q, k, v)
    with pytest.raises(ValueError, match="gates\\(2, 5, 2, 2\\) must be"):
        fn(q, k, v, gates=gates[..., :2])
    with pytest.raises(ValueError, match="select_blocks=2 must be an integer >= 3"):
        NSAConfig(select_blocks=2)
    with pytest.raises(ValueError, match="compress_stride=5 must divide"):
        NSAConfig(compress_stride=5)


def test_compressed_branch_is_the_same_in_any_query_chunks():
    from moe_lst.kernels.nsa import compressed_attention

    q, k, v, gates, ck, cv = _inputs(45, 4, 2, seed=2)
    whole = compressed_attention(q, ck(k), cv(v), CFG, 0.3)
    pieces = compressed_attention(q, ck(k), cv(v), CFG, 0.3, chunk=5)
    torch.testing.assert_close(pieces, whole)
    grad = torch.randn_like(whole)
    for a, e in zip(torch.autograd.grad(pieces, (q, k, v), grad), torch.autograd.grad(whole, (q, k, v), grad)):
        torch.testing.assert_close(a, e)
