import pytest
import torch

from moe import TopKRouter
from moe.router import load_balancing_loss, router_z_loss

from .reference import reference_aux_loss, reference_z_loss


def _router(**kw):
    torch.manual_seed(0)
    return TopKRouter(16, 8, **kw)


def test_softmax_top2_renormalised_matches_formula():
    r = _router(top_k=2)
    x = torch.randn(32, 16)
    out = r(x)
    probs = torch.softmax(x @ r.weight.t(), -1)
    top = probs.topk(2, -1)
    torch.testing.assert_close(out.indices, top.indices)
    torch.testing.assert_close(out.weights, top.values / top.values.sum(-1, keepdim=True))
    torch.testing.assert_close(out.weights.sum(-1), torch.ones(32))
    torch.testing.assert_close(out.probs, probs)


def test_softmax_without_renormalisation_keeps_raw_probabilities():
    r = _router(top_k=2, renormalize=False)
    x = torch.randn(32, 16)
    probs = torch.softmax(x @ r.weight.t(), -1)
    torch.testing.assert_close(r(x).weights, probs.topk(2, -1).values)
    # Top-1 softmax defaults to raw probabilities (Switch), else the router would get no gradient.
    assert _router(top_k=1).renormalize is False


def test_sigmoid_scores_normalised_over_chosen():
    r = _router(top_k=3, score_func="sigmoid")
    x = torch.randn(32, 16)
    s = torch.sigmoid(x @ r.weight.t())
    top = s.topk(3, -1)
    out = r(x)
    torch.testing.assert_close(out.indices, top.indices)
    torch.testing.assert_close(out.weights, top.values / top.values.sum(-1, keepdim=True))
    torch.testing.assert_close(out.probs, s / s.sum(-1, keepdim=True))


def test_router_runs_in_fp32_for_bf16_inputs():
    r = _router(top_k=2).to(torch.bfloat16)
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    out = r(x)
    assert out.logits.dtype == out.weights.dtype == torch.float32
    torch.testing.assert_close(out.logits, x.float() @ r.weight.float().t())


def test_expert_bias_changes_selection_not_gate_values():
    r = _router(top_k=2)
    x = torch.randn(64, 16)
    r.expert_bias[3] = 10.0  # expert 3 always selected
    out = r(x)
    assert (out.indices == 3).any(-1).all()
    probs = torch.softmax(x @ r.weight.t(), -1)
    chosen = probs.gather(1, out.indices)
    torch.testing.assert_close(out.weights, chosen / chosen.sum(-1, keepdim=True))


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_group_limited_routing_picks_only_from_chosen_groups(score_func):
    r = _router(top_k=3, score_func=score_func, num_groups=4, topk_groups=2)
    x = torch.randn(256, 16)
    out = r(x)
    s = torch.softmax(x @ r.weight.t(), -1) if score_func == "softmax" else torch.sigmoid(x @ r.weight.t())
    grouped = s.view(256, 4, 2)
    gscore = grouped.max(-1).values if score_func == "softmax" else grouped.sum(-1)  # 2 per group: top-2 sum
    top_groups = gscore.topk(2, -1).indices
    allowed = torch.zeros(256, 4, dtype=torch.bool).scatter_(1, top_groups, True)
    assert allowed.gather(1, out.indices // 2).all()
    # And inside the allowed groups it is plain top-k.
    masked = s.masked_fill(~allowed.repeat_interleave(2, dim=1), -1.0)
    torch.testing.assert_close(out.indices, masked.topk(3, -1).indices)
    # Without grouping some tokens would have picked experts across more than 2 groups.
    free = s.topk(3, -1).indices // 2
    assert any(len(set(row.tolist())) > 0 and not allowed[i, row].all() for i, row in enumerate(free))


def test_jitter_only_in_training():
    r = _router(top_k=2, jitter_eps=0.5)
    x = torch.randn(32, 16)
    r.eval()
    torch.testing.assert_close(r(x).logits, x @ r.weight.t())
    r.train()
    torch.manual_seed(1)
    assert not torch.allclose(r(x).logits, x @ r.weight.t())


def test_aux_and_z_loss_match_hand_computed():
    r = _router(top_k=2)
    x = torch.randn(40, 16)
    out = r(x)
    aux = load_balancing_loss(out.probs, out.indices)
    torch.testing.assert_close(aux, reference_aux_loss(out.probs, out.indices, 8))
    torch.testing.assert_close(router_z_loss(out.logits), reference_z_loss(out.logits))
    # A tiny fully hand-written case: 2 tokens, 2 experts, top-1.
    probs = torch.tensor([[0.9, 0.1], [0.6, 0.4]])
    idx = torch.tensor([[0], [0]])
    # f = [1, 0], P = [0.75, 0.25] -> 2 * 0.75 = 1.5
    assert load_balancing_loss(probs, idx).item() == pytest.approx(1.5)
    logits = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    lse = torch.tensor([2.0, 2 * torch.e]).log()
    assert router_z_loss(logits).item() == pytest.approx(lse.pow(2).mean().item())


def test_per_sequence_aux_loss_matches_formula():
    r = _router(top_k=2)
    x = torch.randn(3, 10, 16)
    out = r(x.reshape(30, 16))
    per_seq = load_balancing_loss(out.probs, out.indices, num_seqs=3)
    expected = torch.stack([
        reference_aux_loss(out.probs[i * 10:(i + 1) * 10], out.indices[i * 10:(i + 1) * 10], 8)
        for i in range(3)]).mean()
    torch.testing.assert_close(per_seq, expected)
    assert not torch.allclose(per_seq, load_balancing_loss(out.probs, out.indices))


@pytest.mark.parametrize("kw, match", [
    (dict(top_k=9), "top_k=9"),
    (dict(score_func="tanh"), "tanh"),
    (dict(num_groups=3, topk_groups=1), "num_groups=3"),
    (dict(num_groups=4), "together"),
    (dict(num_groups=4, topk_groups=5), "topk_groups=5"),
    (dict(top_k=4, num_groups=4, topk_groups=1), "fewer than top_k"),
    (dict(jitter_eps=1.5), "jitter_eps"),
])
def test_bad_router_settings_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        TopKRouter(16, 8, **kw)
