"""The device MoE path (local_path="device"), run on the CPU: the same outputs, gradients and statistics as the
host path; no host synchronisation between router and output on one rank (one under expert parallelism: the
all-to-all split sizes); torch.compile(fullgraph=True) captures routing and permutation, and the whole layer."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from moe import MoELayer, shard_experts
from moe.dispatch import assign_slots, assign_slots_static, permute
from tests.multirank import run_multirank

DIM, FFN, E = 16, 32, 8

CASES = {
    "dropless_softmax": dict(top_k=2),
    "capacity_sigmoid_gelu": dict(top_k=2, router="sigmoid", activation="gelu", capacity_factor=0.5),
    "capacity_shared": dict(top_k=2, capacity_factor=0.75, num_shared_experts=1),
    "top1_groups_seq_aux": dict(top_k=1, num_groups=4, topk_groups=2, seq_aux=True, aux_loss_coef=0.3),
    "top3_bias_rate": dict(top_k=3, bias_update_rate=0.01, z_loss_coef=0.1),
}
# Ops that read a tensor's value on the host (a device-to-host synchronisation on a GPU) or size a tensor by
# its values (the same, inside the op).
HOST_READS = {"tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__", "bincount",
              "nonzero", "masked_select", "unique", "unique_consecutive"}


class HostReads(TorchFunctionMode):
    """Records every tensor op that reads values on the host; repeat_interleave counts unless given output_size,
    indexing counts when the index is a bool tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in HOST_READS or (name == "repeat_interleave" and "output_size" not in kwargs
                                  and isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"), torch.Tensor)):
            self.seen.append(name)
        elif name == "__getitem__" and isinstance(args[1], torch.Tensor) and args[1].dtype == torch.bool:
            self.seen.append("bool index")
        return func(*args, **kwargs)


def _pair(kw, seed=0, **extra):
    """(host layer, device layer) with identical weights."""
    torch.manual_seed(seed)
    host = MoELayer(DIM, FFN, E, init_std=0.2, local_path="host", **kw, **extra)
    torch.manual_seed(seed)
    device = MoELayer(DIM, FFN, E, init_std=0.2, local_path="device", **kw, **extra)
    return host, device


def _run(layer, x, g):
    x = x.clone().requires_grad_(True)
    y = layer(x)
    y.backward(g)
    return {"y": y.detach(), "x_grad": x.grad, "stats": dict(layer.last_stats),
            "grads": {n: p.grad.clone() for n, p in layer.named_parameters()},
            "load": layer.load_since_update.clone()}


def _assert_same(got, want, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(got["y"], want["y"], rtol=rtol, atol=atol)
    torch.testing.assert_close(got["x_grad"], want["x_grad"], rtol=rtol, atol=atol)
    assert got["grads"].keys() == want["grads"].keys()
    for name, grad in want["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=rtol, atol=atol, msg=name)
    for key, value in want["stats"].items():  # counts exactly, losses to fp32 rounding
        torch.testing.assert_close(got["stats"][key], value, rtol=rtol, atol=0, msg=key)
    torch.testing.assert_close(got["load"], want["load"], rtol=0, atol=0)


@pytest.mark.parametrize("name", list(CASES))
def test_device_path_equals_host_path(name):
    host, device = _pair(CASES[name])
    for layer in (host, device):
        layer.train()
    torch.manual_seed(1)
    x, g = torch.randn(3, 10, DIM), torch.randn(3, 10, DIM)
    want, got = _run(host, x, g), _run(device, x, g)
    _assert_same(got, want)
    if CASES[name].get("capacity_factor"):
        assert want["stats"]["dropped"] > 0  # the case really drops slots


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_dropped_slots_cannot_poison_the_device_path(activation):
    """The dropped slots are computed by the last expert (gemm_counts) and weighted by 0: they enter it as zero
    rows, so an expert whose outputs overflow for real tokens gives no inf * 0 = NaN. The last expert here is
    never chosen (its selection bias) and has huge weights: the host path never runs it, the device path runs
    it on the dropped rows only; both stay finite and equal, gradients included."""
    host, device = _pair(dict(top_k=2, capacity_factor=0.5, activation=activation))
    with torch.no_grad():
        for layer in (host, device):
            layer.router.expert_bias[-1] = -1e4  # selection only: expert E-1 gets no slot
            layer.experts.w_in[-1].fill_(1e30)  # any real token overflows to inf through it
            layer.experts.w_out[-1].fill_(1e30)
    torch.manual_seed(1)
    x, g = torch.randn(3, 10, DIM), torch.randn(3, 10, DIM)
    want, got = _run(host, x, g), _run(device, x, g)
    assert want["stats"]["dropped"] > 0 and want["load"][-1] == 0
    assert torch.isfinite(got["y"]).all() and torch.isfinite(got["x_grad"]).all()
    assert all(torch.isfinite(grad).all() for grad in got["grads"].values())
    _assert_same(got, want)


def test_static_assignment_keeps_assign_slots_order_and_the_dropped_ones_last():
    torch.manual_seed(0)
    indices = torch.randint(0, E, (40, 2))
    weights = torch.rand(40, 2)
    for capacity in (None, 3, 7):
        host, static = assign_slots(indices, weights, E, capacity), assign_slots_static(indices, weights, E, capacity)
        kept = int(host.tokens_per_expert.sum())
        assert static.num_slots == static.token_index.numel() == 80  # sized before routing
        torch.testing.assert_close(static.slot_index[:kept], host.slot_index, rtol=0, atol=0)
        torch.testing.assert_close(static.tokens_per_expert, host.tokens_per_expert, rtol=0, atol=0)
        torch.testing.assert_close(static.routed_per_expert, host.routed_per_expert, rtol=0, atol=0)
        assert sorted(static.slot_index.tolist()) == list(range(80))  # every slot once
        assert (static.slot_index[static.slot_position] == torch.arange(80)).all()  # its inverse
        assert static.kept_mask().sum() == kept and static.kept_mask()[:kept].all()
        assert static.gemm_counts().sum() == 80 and (static.gemm_counts()[:-1] == host.tokens_per_expert[:-1]).all()


def test_auto_is_the_host_path_on_cpu_and_bitwise_unchanged():
    torch.manual_seed(0)
    auto = MoELayer(DIM, FFN, E, top_k=2, capacity_factor=0.5, init_std=0.2)
    host = MoELayer(DIM, FFN, E, top_k=2, capacity_factor=0.5, init_std=0.2, local_path="host")
    host.load_state_dict(auto.state_dict())
    x, g = torch.randn(2, 9, DIM), torch.randn(2, 9, DIM)
    assert not auto.uses_device_path(x)
    a, b = _run(auto, x, g), _run(host, x, g)
    _assert_same(a, b, rtol=0, atol=0)


def test_bad_local_path_and_unsupported_device_path_refused():
    with pytest.raises(ValueError, match="local_path='gpu'"):
        MoELayer(DIM, FFN, E, local_path="gpu")
    layer = MoELayer(6, 10, 4, local_path="device")  # 6 * 4 bytes: rows not 16-byte aligned for _grouped_mm
    with pytest.raises(NotImplementedError, match="torch._grouped_mm"):
        layer(torch.randn(5, 6))


@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_device_path_reads_nothing_on_the_host_and_the_host_path_does(capacity_factor):
    host, device = _pair(dict(top_k=2, capacity_factor=capacity_factor, num_shared_experts=1))
    x = torch.randn(4, 6, DIM)
    with HostReads() as reads:
        device(x)
    assert reads.seen == []
    with HostReads() as reads:
        host(x)
    assert reads.seen  # the probe sees the host path's reads: it would see the device path's


def _route_and_permute(layer, x, capacity):
    routing = layer.router(x)
    assignment = assign_slots_static(routing.indices, routing.weights, layer.num_experts, capacity)
    return (routing.weights, assignment.token_index, assignment.tokens_per_expert, assignment.kept_mask(),
            permute(x, assignment))


@pytest.mark.parametrize("capacity", [None, 5])
def test_routing_and_permutation_compile_without_graph_break(capacity):
    torch._dynamo.reset()
    _, device = _pair(dict(top_k=2, router="sigmoid", num_groups=4, topk_groups=2))
    x = torch.randn(12, DIM)
    want = _route_and_permute(device, x, capacity)
    compiled = torch.compile(_route_and_permute, fullgraph=True, backend="eager")  # a graph break raises
    for got, ref in zip(compiled(device, x, capacity), want):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)


@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_whole_local_layer_compiles_fullgraph_in_bf16(capacity_factor):
    # (torch._grouped_mm's fake kernel accepts bf16 only, so the layer is traced in bf16.)
    torch._dynamo.reset()
    host, device = _pair(dict(top_k=2, capacity_factor=capacity_factor, num_shared_experts=1))
    host.to(torch.bfloat16)
    device.to(torch.bfloat16)
    x = torch.randn(3, 4, DIM, dtype=torch.bfloat16)
    want = device(x)
    got = torch.compile(device, fullgraph=True, backend="eager")(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(Exception, match="(?i)graph break|tolist|data.dependent|Unsupported"):
        torch.compile(host, fullgraph=True, backend="eager")(x)  # the host path's reads do break the graph


def _parallel_worker():
    rank = dist.get_rank()
    world = dist.new_group([0, 1, 2, 3])
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[rank // 2]
    out = {}
    torch.manual_seed(100 + rank)  # every rank has its own tokens
    x, g = torch.randn(3, 5, DIM), torch.randn(3, 5, DIM)
    for name, group, kw in (("ep4_capacity_shared", world, CASES["capacity_shared"]),
                            ("ep2_dropless_gelu", pair, dict(top_k=2, activation="gelu"))):
        host, device = (shard_experts(layer, group) for layer in _pair(kw))
        with HostReads() as reads:
            device(x)
        out[name] = {"host": _run(host, x, g), "device": _run(device, x, g), "reads": reads.seen}
    # expert tensor parallelism over a pair: both ranks route the full sequence, each keeps half the hidden units
    torch.manual_seed(7)
    x_full, g_full = torch.randn(2, 6, DIM), torch.randn(2, 6, DIM)
    half = slice((rank % 2) * 3, (rank % 2 + 1) * 3)
    host, device = _pair(CASES["capacity_shared"])
    for layer in (host, device):
        layer.set_tensor_parallel(pair)
    out["etp2"] = {"host": _run(host, x_full, g_full[:, half]), "device": _run(device, x_full, g_full[:, half])}
    return out


def test_expert_and_expert_tensor_parallel_device_path_equals_host_path():
    results = run_multirank(_parallel_worker, 4)
    for rank in range(4):
        for name, record in results[rank].items():
            _assert_same(record["device"], record["host"])
            if name.startswith("ep"):
                assert record["reads"] == ["tolist"], (name, record["reads"])  # the split sizes, once
