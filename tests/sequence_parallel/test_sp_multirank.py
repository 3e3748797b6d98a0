"""Ulysses attention and SP training on 2 and 4 gloo ranks equal the single-rank computation.

One spawn per world size runs every case and returns max errors; the tests assert on them.
"""

from __future__ import annotations

import pytest
import torch

from tests.multirank import run_multirank

# (batch, global seq, q heads, kv heads, causal); per world size, chosen to cover MHA, GQA, uneven
# head splits (heads % sp != 0) and fewer kv heads than ranks (kv replication).
ATTN_CASES = {
    2: [(2, 12, 4, 4, True), (2, 12, 4, 4, False), (2, 12, 8, 2, True), (1, 10, 3, 3, True),
        (2, 8, 6, 2, False), (2, 8, 4, 1, True), (1, 6, 5, 5, False)],
    4: [(2, 16, 8, 8, True), (2, 16, 8, 8, False), (2, 16, 8, 2, True), (1, 12, 6, 6, True),
        (2, 12, 6, 6, False), (2, 12, 6, 2, False), (2, 8, 4, 1, True), (1, 8, 6, 3, True)],
}
TOL = 2e-5


def _attention_checks(P: int, rank: int, group) -> dict:
    from moe_lst.kernels.attention import attention

    from sequence_parallel import UlyssesAttention
    from zero.dist import comm

    out = {}
    ulysses = UlyssesAttention(group, attn_fn=attention)
    for case in ATTN_CASES[P]:
        b, s, h, hkv, causal = case
        gen = torch.Generator().manual_seed(hash(case) % 2**31)
        q = torch.randn(b, s, h, 8, generator=gen, requires_grad=True)
        k = torch.randn(b, s, hkv, 8, generator=gen, requires_grad=True)
        v = torch.randn(b, s, hkv, 8, generator=gen, requires_grad=True)
        g = torch.randn(b, s, h, 8, generator=gen)
        ref = attention(q, k, v, causal=causal)
        ref.backward(g)
        sl = s // P
        part = slice(rank * sl, (rank + 1) * sl)
        ql, kl, vl = (t.detach()[:, part].clone().requires_grad_() for t in (q, k, v))
        with comm.counting() as stats:
            o = ulysses(ql, kl, vl, causal=causal)
            calls_fwd = stats.calls["all_to_all"]
        o.backward(g[:, part])
        out[case] = {
            "out": (o - ref[:, part]).abs().max().item(),
            "dq": (ql.grad - q.grad[:, part]).abs().max().item(),
            "dk": (kl.grad - k.grad[:, part]).abs().max().item(),
            "dv": (vl.grad - v.grad[:, part]).abs().max().item(),
            "shape_ok": o.shape == (b, sl, h, 8),
            "a2a_calls_forward": calls_fwd,
        }
    # Errors are raised on every rank before any communication, so nothing hangs.
    errors = {}
    for name, (qs, ks, vs) in {
        "sp_gt_heads": ((1, 4, P - 1, 8), (1, 4, P - 1, 8), (1, 4, P - 1, 8)),
        "gqa": ((1, 4, 4, 8), (1, 4, 3, 8), (1, 4, 3, 8)),
        "kv_shape": ((1, 4, 4, 8), (1, 4, 2, 8), (1, 4, 4, 8)),
        "rank3": ((4, 4, 8), (4, 4, 8), (4, 4, 8)),
        "head_dim": ((1, 4, 4, 8), (1, 4, 4, 16), (1, 4, 4, 16)),
    }.items():
        try:
            ulysses(torch.randn(*qs), torch.randn(*ks), torch.randn(*vs))
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    out["errors"] = errors
    return out


def _model_checks(P: int) -> dict:
    """A small Llama with sp=P through the ZeRO engine (plain, and with every ALST piece on) against sp=1
    on the full batch, with ignored labels falling unevenly over the ranks."""
    from moe_lst.models.llama import ModelConfig
    from tests.sequence_parallel.sp_model import sp_records

    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
    gen = torch.Generator().manual_seed(1)
    s = 4 * P + 3  # not divisible by P: shard_sequence pads the end
    tokens = torch.randint(0, 64, (2, s + 1), generator=gen)
    inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
    labels[0, : s // 2] = -100  # ignored labels fall unevenly: rank 0 holds far fewer real labels
    labels[1, -2:] = -100
    return sp_records(cfg, inputs, labels, {"mlp_tile": 3, "loss_tile": 5, "offload": True})


def _sp_worker() -> dict:
    import torch.distributed as dist

    P, rank = dist.get_world_size(), dist.get_rank()
    group = dist.new_group(list(range(P)))
    return {"attention": _attention_checks(P, rank, group), "model": _model_checks(P)}


@pytest.fixture(scope="module", params=[2, 4], ids=["sp2", "sp4"])
def sp_results(request):
    return request.param, run_multirank(_sp_worker, request.param, timeout=240)


def test_ulysses_matches_single_rank_attention(sp_results):
    P, results = sp_results
    for rank, res in enumerate(results):
        for case in ATTN_CASES[P]:
            r = res["attention"][case]
            assert r["shape_ok"], (P, rank, case)
            for key in ("out", "dq", "dk", "dv"):
                assert r[key] < TOL, f"sp={P} rank {rank} case {case}: {key} error {r[key]}"


def test_ulysses_packs_qkv_into_one_all_to_all(sp_results):
    P, results = sp_results
    for res in results:
        for case in ATTN_CASES[P]:
            # one all-to-all for q, k, v together and one for the output
            assert res["attention"][case]["a2a_calls_forward"] == 2


def test_ulysses_clear_errors(sp_results):
    P, results = sp_results
    errors = results[0]["attention"]["errors"]
    assert errors["sp_gt_heads"] is not None and f"sp={P}" in errors["sp_gt_heads"]
    assert "sp <=" in errors["sp_gt_heads"]
    assert errors["gqa"] is not None and "multiple of kv heads" in errors["gqa"]
    assert errors["kv_shape"] is not None and "same shape" in errors["kv_shape"]
    assert errors["rank3"] is not None and "[batch, local sequence, heads, head_dim]" in errors["rank3"]
    assert errors["head_dim"] is not None and "head_dim" in errors["head_dim"]


def test_sharded_model_loss_and_grads_match_sp1(sp_results):
    from tests.sequence_parallel.sp_model import assert_sp_equivalent

    P, results = sp_results
    assert len(results) == P
    counts = [res["model"]["plain"]["local_count"] for res in results]
    assert len(set(counts)) > 1, f"the case must put different label counts on the ranks, got {counts}"
    assert results[0]["model"]["plain"]["local_len"] * P >= 4 * P + 3  # padded, not truncated
    assert_sp_equivalent([res["model"] for res in results], f"sp={P}")
