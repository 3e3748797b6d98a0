import math

import pytest
import torch

from moe import GroupedExperts, LocalDispatcher, MoELayer, collect_moe_stats, update_router_biases
from moe import experts as experts_mod

from .reference import expert_mlp, reference_aux_loss, reference_moe, reference_routing, reference_z_loss


def _layer(seed=0, **kw):
    torch.manual_seed(seed)
    kw.setdefault("init_std", 0.2)  # large enough weights that routing and outputs are far from ties
    return MoELayer(16, 32, 8, **kw)


def _grads(layer, x):
    return [x.grad] + [p.grad for p in layer.parameters()]


@pytest.mark.parametrize("kw", [
    dict(top_k=2, activation="swiglu"),
    dict(top_k=1, activation="gelu"),
    dict(top_k=3, router="sigmoid", activation="gelu"),
])
def test_dropless_matches_naive_reference_outputs_and_grads(kw):
    layer = _layer(aux_loss_coef=0.0, z_loss_coef=0.0, **kw)
    x = torch.randn(2, 12, 16, requires_grad=True)
    y = layer(x)
    g = torch.randn_like(y)
    y.backward(g)

    xr = x.detach().clone().requires_grad_(True)
    wr = layer.router.weight.detach().clone().requires_grad_(True)
    w_in = layer.experts.w_in.detach().clone().requires_grad_(True)
    w_out = layer.experts.w_out.detach().clone().requires_grad_(True)
    gates, idx, _, _ = reference_routing(xr.reshape(-1, 16), wr, kw["top_k"], kw.get("router", "softmax"),
                                         renormalize=layer.router.renormalize)
    yr = reference_moe(xr.reshape(-1, 16), gates, idx, w_in, w_out, kw["activation"]).view_as(x)
    yr.backward(g)
    torch.testing.assert_close(y, yr)
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(layer.router.weight.grad, wr.grad)
    torch.testing.assert_close(layer.experts.w_in.grad, w_in.grad)
    torch.testing.assert_close(layer.experts.w_out.grad, w_out.grad)
    assert layer.router.weight.grad.abs().sum() > 0
    assert layer.last_stats["dropped"].item() == 0.0
    assert layer.last_stats["tokens_per_expert"].sum().item() == 24 * kw["top_k"]


def test_shared_experts_add_dense_mlp():
    layer = _layer(num_shared_experts=2, aux_loss_coef=0.0, z_loss_coef=0.0)
    x = torch.randn(10, 16)
    routed_only = _layer(aux_loss_coef=0.0, z_loss_coef=0.0)(x)
    shared = layer.shared_experts
    assert shared.w_out.weight.shape == (16, 64)
    expected = routed_only + expert_mlp(x, shared.w_in.weight.t(), shared.w_out.weight.t(), "swiglu")
    torch.testing.assert_close(layer(x), expected)


def test_capacity_drops_lowest_scoring_slots_exactly():
    layer = _layer(top_k=2, capacity_factor=0.5, aux_loss_coef=0.0, z_loss_coef=0.0)
    x = torch.randn(40, 16)
    # 20 tokens near one direction all pick the same two experts: 40 slots for 2 x cap = 10 places, so
    # at least 10 of those tokens lose both their slots (the small noise keeps their scores apart).
    x[:20] = 3 * torch.randn(16) + 0.05 * torch.randn(20, 16)
    y = layer(x)
    gates, idx, _, _ = reference_routing(x, layer.router.weight, 2)
    assert (idx[:20].sort(1).values == idx[0].sort().values).all()
    cap = math.ceil(0.5 * 40 * 2 / 8)
    keep = torch.zeros(40, 2, dtype=torch.bool)
    for e in range(8):
        slots = [(gates[t, j].item(), t, j) for t in range(40) for j in range(2) if idx[t, j] == e]
        for _, t, j in sorted(slots, reverse=True)[:cap]:
            keep[t, j] = True
    assert 0 < (~keep).sum() < 80  # the case really drops something
    expected = reference_moe(x, gates, idx, layer.experts.w_in, layer.experts.w_out, "swiglu", keep)
    torch.testing.assert_close(y, expected)
    assert layer.last_stats["dropped"].item() == pytest.approx((~keep).sum().item() / 80)
    fully_dropped = ~keep.any(1)
    assert fully_dropped[:20].sum() >= 10  # the crowded tokens above
    assert y[fully_dropped].abs().max() == 0
    assert y[~fully_dropped].abs().amax(1).min() > 0  # and only they give zeros


def test_aux_and_z_losses_values_and_exact_gradient_contribution():
    x = torch.randn(3, 8, 16)
    g = torch.randn(3, 8, 16)
    grads = {}
    for coefs in [(0.0, 0.0), (0.3, 0.05)]:
        layer = _layer(aux_loss_coef=coefs[0], z_loss_coef=coefs[1])
        xi = x.clone().requires_grad_(True)
        layer(xi).backward(g)
        grads[coefs] = (xi.grad, layer.router.weight.grad.clone(), layer)
    layer = grads[(0.3, 0.05)][2]
    wr = layer.router.weight.detach().clone().requires_grad_(True)
    xr = x.reshape(-1, 16).clone().requires_grad_(True)
    _, idx, logits, probs = reference_routing(xr, wr, 2)
    aux = reference_aux_loss(probs, idx, 8)
    z = reference_z_loss(logits)
    assert layer.last_stats["aux_loss"].item() == pytest.approx(aux.item(), rel=1e-5)
    assert layer.last_stats["z_loss"].item() == pytest.approx(z.item(), rel=1e-5)
    (0.3 * aux + 0.05 * z).backward()
    diff_w = grads[(0.3, 0.05)][1] - grads[(0.0, 0.0)][1]
    diff_x = grads[(0.3, 0.05)][0] - grads[(0.0, 0.0)][0]
    assert diff_w.abs().max() > 1e-4
    torch.testing.assert_close(diff_w, wr.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(diff_x, xr.grad.view_as(diff_x), rtol=1e-4, atol=1e-6)
    # The attached losses leave the output value untouched ...
    with torch.no_grad():
        torch.testing.assert_close(layer(x), _layer(aux_loss_coef=0.0, z_loss_coef=0.0)(x))
    # ... and are not attached in eval mode.
    layer.eval()
    layer.zero_grad()
    layer(x).backward(g)
    torch.testing.assert_close(layer.router.weight.grad, grads[(0.0, 0.0)][1])


def test_per_sequence_aux_loss_in_layer():
    layer = _layer(seq_aux=True)
    x = torch.randn(3, 10, 16)
    layer(x)
    _, idx, _, probs = reference_routing(x.reshape(-1, 16), layer.router.weight, 2)
    expected = torch.stack([reference_aux_loss(probs[i * 10:(i + 1) * 10], idx[i * 10:(i + 1) * 10], 8)
                            for i in range(3)]).mean()
    assert layer.last_stats["aux_loss"].item() == pytest.approx(expected.item(), rel=1e-5)
    with pytest.raises(ValueError, match="seq_aux"):
        layer(torch.randn(30, 16))


def test_bias_update_moves_load_toward_uniform():
    layer = _layer(top_k=2, router="sigmoid", bias_update_rate=0.05, aux_loss_coef=0.0, z_loss_coef=0.0)
    with torch.no_grad():
        layer.router.weight[:2] += 0.1  # experts 0 and 1 attract almost everything
    x = torch.randn(256, 16).abs() + 0.5
    spreads = []
    for _ in range(10):
        layer(x)
        counts = layer.last_stats["tokens_per_expert"].float()
        spreads.append((counts.max() - counts.min()).item())
        w_before = layer.router.weight.detach().clone()
        update_router_biases(layer)
        assert torch.equal(layer.router.weight, w_before)  # only the buffer moves
        assert layer.load_since_update.sum() == 0
    assert spreads[0] > 240  # nearly every token picks experts 0 and 1
    assert max(spreads[-3:]) < 0.5 * spreads[0]
    bias = layer.router.expert_bias
    assert bias[:2].max() < 0 <= bias[2:].min()
    # Rate 0 disables it: no accumulation, no change.
    off = _layer(bias_update_rate=0.0)
    off(x)
    update_router_biases(off)
    assert off.router.expert_bias.abs().sum() == 0


def test_stats_and_collect():
    model = torch.nn.Sequential(_layer(), torch.nn.Identity(), _layer(seed=1, capacity_factor=0.5))
    model(torch.randn(4, 6, 16))
    stats = collect_moe_stats(model)
    for i in range(2):
        for key in ("aux_loss", "z_loss", "load_max", "load_min", "dropped"):
            assert isinstance(stats[f"moe/layer{i}/{key}"], float)
        tpe = stats[f"moe/layer{i}/tokens_per_expert"]
        assert len(tpe) == 8 and sum(tpe) == 48
        assert stats[f"moe/layer{i}/load_max"] == pytest.approx(max(tpe) / 48)
        assert stats[f"moe/layer{i}/load_min"] == pytest.approx(min(tpe) / 48)
    assert stats["moe/layer0/dropped"] == 0.0 and stats["moe/layer1/dropped"] > 0


def test_grouped_mm_and_loop_fallback_agree(monkeypatch):
    torch.manual_seed(0)
    ex = GroupedExperts(16, 32, 4, "gelu", init_std=0.2)
    x = torch.randn(20, 16, requires_grad=True)
    counts = torch.tensor([5, 0, 12, 3])
    assert experts_mod.grouped_mm_supported(x.device, x.dtype, 16, 32)
    y = ex(x, counts)
    y.backward(torch.ones_like(y))  # an expanded (stride-0) gradient must work too
    grads = [x.grad.clone(), ex.w_in.grad.clone(), ex.w_out.grad.clone()]
    x.grad = ex.w_in.grad = ex.w_out.grad = None
    monkeypatch.setattr(experts_mod, "grouped_mm_supported", lambda *a: False)
    y2 = ex(x, counts)
    y2.backward(torch.ones_like(y2))
    torch.testing.assert_close(y, y2)
    for a, b in zip(grads, [x.grad, ex.w_in.grad, ex.w_out.grad]):
        torch.testing.assert_close(a, b)
    assert grads[1][1].abs().sum() == 0  # the expert with no tokens gets zero gradient


def test_bf16_layer_runs_with_fp32_router():
    layer = _layer().to(torch.bfloat16)
    x = torch.randn(4, 16, dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and x.grad is not None
    ref = _layer()(x.detach().float())
    torch.testing.assert_close(y.float(), ref, atol=2e-2, rtol=5e-2)


@pytest.mark.parametrize("kw, match", [
    (dict(top_k=9), "top_k=9"),
    (dict(router="hash"), "hash"),
    (dict(capacity_factor=0.0), "capacity_factor=0.0"),
    (dict(capacity_factor=-1.0), "capacity_factor=-1.0"),
    (dict(num_groups=3, topk_groups=1), "num_groups=3"),
    (dict(activation="relu"), "relu"),
    (dict(aux_loss_coef=-1.0), "aux_loss_coef"),
])
def test_bad_layer_settings_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        MoELayer(16, 32, 8, **kw)


def test_wrong_input_width_raises():
    with pytest.raises(ValueError, match="16"):
        _layer()(torch.randn(3, 15))


def test_empty_input_gives_empty_output_and_finite_stats():
    layer = _layer(capacity_factor=1.0)
    x = torch.randn(0, 16, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    assert y.shape == (0, 16)
    assert layer.last_stats["aux_loss"].item() == 0.0 and layer.last_stats["z_loss"].item() == 0.0


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_fused_expert_path_loop_fallback_and_chunking_agree(monkeypatch, activation):
    """The layer's fused gather-MLP-scatter node gives the same numbers whether it uses
    torch._grouped_mm or the per-segment loop, and for any number of expert chunks."""
    layer = _layer(activation=activation, capacity_factor=1.0)
    x = torch.randn(30, 16)
    routing = layer.router(x)
    from moe.dispatch import assign_slots
    assignment = assign_slots(routing.indices, routing.weights, 8, capacity=8)
    gate = routing.weights.reshape(-1)[assignment.slot_index].detach().requires_grad_(True)
    outs = []
    for supported, chunks in [(True, 8), (True, 1), (True, 3), (False, 8)]:
        monkeypatch.setattr(experts_mod, "grouped_mm_supported", lambda *a, s=supported: s)
        xi = x.clone().requires_grad_(True)
        gate.grad = None
        layer.zero_grad()
        y = layer.experts.forward_tokens(xi, assignment.token_index, gate, assignment.tokens_per_expert,
                                         max_chunks=chunks)
        y.backward(torch.cos(y))
        outs.append([y, xi.grad, gate.grad, layer.experts.w_in.grad, layer.experts.w_out.grad])
    assert len(outs) == 4 and all(t is not None for o in outs for t in o)
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            torch.testing.assert_close(a, b)
    # And the chunking helper covers every expert and row exactly once.
    chunks = experts_mod._expert_chunks([3, 0, 5, 1, 0, 7], 3)
    assert len(chunks) >= 2  # several chunks, so the adjacency check below compares something
    assert chunks[0][0] == 0 and chunks[-1][1] == 6 and chunks[-1][3] == 16
    assert all(a[1] == b[0] and a[3] == b[2] for a, b in zip(chunks, chunks[1:]))


@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_local_dispatcher_fused_and_unfused_agree(capacity_factor):
    """The fused gather-MLP-scatter node and dispatch -> experts -> combine give the same numbers."""
    layer = _layer(capacity_factor=capacity_factor, num_shared_experts=1)
    x, g = torch.randn(3, 10, 16), torch.randn(3, 10, 16)
    results = []
    for fused in (True, False):
        layer.dispatcher = LocalDispatcher(8, fused=fused)
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        y = layer(xi)
        y.backward(g)
        results.append([y, xi.grad] + [p.grad for p in layer.parameters()])
        stats = layer.last_stats
        assert torch.equal(stats["tokens_per_local_expert"], stats["tokens_per_expert"]) == (capacity_factor is None)
    # every output and gradient exists on both paths (None == None would compare nothing)
    assert len(results[0]) == len(results[1]) == 2 + len(list(layer.parameters()))
    assert all(t is not None for r in results for t in r)
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)


def _expert_grads_after(layer, x, g, preset=None, fuse=False):
    layer.experts.fuse_grad_accumulation = fuse
    layer.zero_grad(set_to_none=True)
    params = (layer.experts.w_in, layer.experts.w_out)
    if preset is not None:
        for p, v in zip(params, preset):
            p.grad = v.clone()
    layer(x).backward(g)
    return [p.grad.clone() for p in params]


@pytest.mark.parametrize("path", ["fused_node", "grouped_experts"])
def test_fused_grad_accumulation_adds_into_existing_grad(monkeypatch, path):
    layer = _layer(activation="gelu", aux_loss_coef=0.0, z_loss_coef=0.0)
    if path == "grouped_experts":
        # The expert-parallel code path (permute -> GroupedExperts.forward -> unpermute) on one rank.
        layer.dispatcher = LocalDispatcher(8, fused=False)
    x, g = torch.randn(30, 16), torch.randn(30, 16)
    fresh = _expert_grads_after(layer, x, g)
    preset = [torch.randn_like(p) for p in (layer.experts.w_in, layer.experts.w_out)]
    calls = []
    real_wgrad = experts_mod._wgrad
    monkeypatch.setattr(experts_mod, "_wgrad", lambda *a, **k: calls.append(k["accumulate"]) or real_wgrad(*a, **k))
    fused = _expert_grads_after(layer, x, g, preset, fuse=True)
    assert calls and all(calls)  # the in-place path really ran
    for got, base, add in zip(fused, preset, fresh):
        torch.testing.assert_close(got, base + add)
    # Without a preset .grad, fusion changes nothing: autograd receives a fresh gradient.
    for got, want in zip(_expert_grads_after(layer, x, g, fuse=True), fresh):
        torch.testing.assert_close(got, want)


def test_fused_grad_accumulation_yields_to_grad_hooks():
    layer = _layer(activation="gelu", aux_loss_coef=0.0, z_loss_coef=0.0)
    x, g = torch.randn(30, 16), torch.randn(30, 16)
    fresh = _expert_grads_after(layer, x, g)
    seen = []
    handle = layer.experts.w_in.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    preset = [torch.ones_like(p) for p in (layer.experts.w_in, layer.experts.w_out)]
    got = _expert_grads_after(layer, x, g, preset, fuse=True)
    handle.remove()
    assert len(seen) == 1  # the hook saw the accumulated gradient: w_in was not fused
    torch.testing.assert_close(seen[0], preset[0] + fresh[0])
    torch.testing.assert_close(got[1], preset[1] + fresh[1])  # w_out (no hook) fused, same sum
