"""Expert parallelism and stats_group on 4 gloo ranks, proven by equivalence with the 1-rank layer."""

import torch
import torch.distributed as dist

from moe import MoELayer, set_stats_group, shard_experts, update_router_biases
from tests.multirank import run_multirank

DIM, FFN, E = 16, 32, 8

EP_CASES = {
    # name: (ep size, layer kwargs, force every token onto experts 0 and 1)
    "ep4_softmax_shared": (4, dict(top_k=2, num_shared_experts=1), False),
    "ep2_sigmoid_capacity": (2, dict(top_k=2, router="sigmoid", activation="gelu", capacity_factor=0.5),
                             False),
    "ep4_all_same_expert": (4, dict(top_k=2, activation="gelu"), True),
    "ep2_all_same_expert_top1": (2, dict(top_k=1), True),
}


def _build(kw, seed=0):
    torch.manual_seed(seed)
    return MoELayer(DIM, FFN, E, init_std=0.2, **kw)


def _run(layer, x, g):
    x = x.clone().requires_grad_(True)
    y = layer(x)
    y.backward(g)
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    return {"y": y.detach(), "x_grad": x.grad, "grads": grads, "stats": dict(layer.last_stats)}


def _worker():
    rank = dist.get_rank()
    world = dist.new_group([0, 1, 2, 3])
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[rank // 2]
    out = {}
    for name, (ep, kw, skew) in EP_CASES.items():
        group = world if ep == 4 else pair
        torch.manual_seed(100 + rank)  # every rank has its own tokens
        x = torch.randn(3, 5, DIM).abs()
        g = torch.randn(3, 5, DIM)
        layers = [_build(kw), shard_experts(_build(kw), group), _build(dict(kw, ep_group=group))]
        if skew:
            for layer in layers:
                with torch.no_grad():
                    layer.router.weight.zero_()
                    layer.router.weight[0] = 3.0
                    layer.router.weight[1] = 2.0
        out[name] = [_run(layer, x, g) for layer in layers]

    # stats_group: one batch of 2 sequences of 8 tokens, split along the sequence over a pair.
    kw = dict(top_k=2, seq_aux=True, aux_loss_coef=0.5, z_loss_coef=0.1)
    torch.manual_seed(7)
    x_full, g_full = torch.randn(2, 8, DIM), torch.randn(2, 8, DIM)
    half = slice((rank % 2) * 4, (rank % 2 + 1) * 4)
    out["seq_full"] = _run(_build(kw), x_full, g_full)
    out["seq_split"] = _run(_build(dict(kw, stats_group=pair)), x_full[:, half], g_full[:, half])
    out["seq_split_set"] = _run(set_stats_group(_build(kw), pair), x_full[:, half], g_full[:, half])
    out["seq_split_nogroup"] = _run(_build(kw), x_full[:, half], g_full[:, half])

    # Aux-loss-free bias: different tokens per rank, loads summed over the world -> identical biases.
    layer = _build(dict(top_k=2, bias_update_rate=0.01))
    torch.manual_seed(200 + rank)
    layer(torch.randn(6 + rank, DIM))
    loads = layer.load_since_update.clone()
    update_router_biases(layer, group=world)
    out["bias"] = {"loads": loads, "bias": layer.router.expert_bias.clone()}
    return out


def test_expert_parallel_and_stats_group_equal_single_rank():
    results = run_multirank(_worker, 4)
    for name, (ep, _, skew) in EP_CASES.items():
        for rank in range(4):
            ref, converted, direct = results[rank][name]
            members = range(4) if ep == 4 else range(rank // 2 * 2, rank // 2 * 2 + 2)
            el = E // ep
            lo, hi = (rank % ep) * el, (rank % ep + 1) * el
            for ep_run in (converted, direct):
                torch.testing.assert_close(ep_run["y"], ref["y"])
                torch.testing.assert_close(ep_run["x_grad"], ref["x_grad"])
                for pname, grad in ref["grads"].items():
                    if pname.startswith("experts."):
                        # The owner's expert gradient collects the tokens of every rank in its ep group.
                        total = sum(results[m][name][0]["grads"][pname] for m in members)
                        torch.testing.assert_close(ep_run["grads"][pname], total[lo:hi])
                    else:
                        torch.testing.assert_close(ep_run["grads"][pname], grad)
                assert ep_run["grads"]["experts.w_in"].shape[0] == el
            if skew:
                # Every token went to experts 0 and 1: their owner got all, every other rank none.
                assert ref["stats"]["tokens_per_expert"][2:].sum() == 0
                received = converted["stats"]["tokens_per_local_expert"].sum().item()
                assert (received > 0) == (lo == 0), (name, rank, received)

    for rank in range(4):
        mine = results[rank]
        full, split, alone = mine["seq_full"], mine["seq_split"], mine["seq_split_nogroup"]
        partner = results[rank ^ 1]["seq_split"]
        for key in ("aux_loss", "z_loss"):
            torch.testing.assert_close(split["stats"][key], full["stats"][key])
            torch.testing.assert_close(mine["seq_split_set"]["stats"][key], full["stats"][key])
        assert not torch.allclose(alone["stats"]["aux_loss"], full["stats"]["aux_loss"])
        # Each sp rank holds a partial router gradient; their sum is the unsplit gradient.
        w = "router.weight"
        torch.testing.assert_close(split["grads"][w] + partner["grads"][w], full["grads"][w])
        assert not torch.allclose(alone["grads"][w] + results[rank ^ 1]["seq_split_nogroup"]["grads"][w],
                                  full["grads"][w])

    total = sum(results[r]["bias"]["loads"] for r in range(4))
    expected = 0.01 * torch.sign(total.mean() - total)
    for rank in range(4):
        torch.testing.assert_close(results[rank]["bias"]["bias"], expected)
    assert not torch.equal(results[0]["bias"]["loads"], results[1]["bias"]["loads"])
