"""MoE on a CUDA device: the grouped GEMM in bf16 and the whole layer in bf16 against fp32."""

from __future__ import annotations

import pytest
import torch

from moe import GroupedExperts, MoELayer
from moe import experts as experts_mod

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEVICE = "cuda"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def test_grouped_gemm_runs_in_bf16_and_matches_the_fp32_segment_loop():
    torch.manual_seed(0)
    ref = GroupedExperts(64, 128, 8, init_std=0.1).to(DEVICE)
    half = GroupedExperts(64, 128, 8, init_std=0.1).to(DEVICE)
    half.load_state_dict(ref.state_dict())
    half.to(torch.bfloat16)
    # The grouped kernel itself, not the loop fallback, must serve bf16 here.
    assert experts_mod.grouped_mm_supported(torch.device(DEVICE), torch.bfloat16, 64, 256)
    counts = torch.tensor([40, 0, 100, 7, 1, 0, 60, 92], device=DEVICE)  # empty experts included
    x = torch.randn(300, 64, device=DEVICE)
    g = torch.randn(300, 64, device=DEVICE)
    x32, x16 = x.clone().requires_grad_(), x.to(torch.bfloat16).requires_grad_()
    y32, y16 = ref(x32, counts), half(x16, counts)
    y32.backward(g)
    y16.backward(g.to(torch.bfloat16))
    assert y16.dtype == torch.bfloat16
    assert _rel(y16, y32) < 2e-2
    assert _rel(x16.grad, x32.grad) < 2e-2
    for p16, p32 in zip(half.parameters(), ref.parameters()):
        assert _rel(p16.grad, p32.grad) < 2e-2
    assert half.w_in.grad[1].abs().sum() == 0  # an expert without tokens gets exactly zero


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_moe_layer_bf16_on_gpu_matches_fp32(capacity_factor):
    torch.manual_seed(0)
    ref = MoELayer(64, 128, 8, top_k=2, capacity_factor=capacity_factor, num_shared_experts=1,
                   init_std=0.1).to(DEVICE)
    half = MoELayer(64, 128, 8, top_k=2, capacity_factor=capacity_factor, num_shared_experts=1,
                    init_std=0.1).to(DEVICE)
    half.load_state_dict(ref.state_dict())
    half.to(torch.bfloat16)
    x = torch.randn(4, 64, 64, device=DEVICE)
    y32 = ref(x)
    y16 = half(x.to(torch.bfloat16))
    y32.float().square().mean().backward()
    y16.float().square().mean().backward()
    assert y16.dtype == torch.bfloat16
    # The router runs in fp32 in both, so (nearly) every token picks the same experts.
    same = (ref.last_stats["tokens_per_expert"] == half.last_stats["tokens_per_expert"]).all()
    assert same
    assert _rel(y16, y32) < 3e-2
    assert _rel(half.router.weight.grad, ref.router.weight.grad) < 5e-2
    assert _rel(half.experts.w_in.grad, ref.experts.w_in.grad) < 5e-2


@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_device_path_is_chosen_on_cuda_never_syncs_in_forward_and_equals_the_host_path(capacity_factor):
    torch.manual_seed(0)
    kw = dict(top_k=2, capacity_factor=capacity_factor, num_shared_experts=1, init_std=0.1)
    host = MoELayer(64, 128, 8, local_path="host", **kw).to(DEVICE, torch.bfloat16)
    auto = MoELayer(64, 128, 8, **kw).to(DEVICE, torch.bfloat16)
    auto.load_state_dict(host.state_dict())
    x = torch.randn(4, 64, 64, device=DEVICE, dtype=torch.bfloat16)
    g = torch.randn_like(x)
    assert auto.uses_device_path(x) and not host.uses_device_path(x)
    auto(x)  # first call: the grouped-GEMM probe and the allocator's first blocks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any device-to-host synchronisation raises
    try:
        x_auto = x.clone().requires_grad_()
        y_auto = auto(x_auto)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    y_auto.backward(g)
    x_host = x.clone().requires_grad_()
    y_host = host(x_host)
    y_host.backward(g)
    # the same routing and GEMMs in bf16; only the order of the sums differs (bf16 eps ~4e-3)
    assert _rel(y_auto, y_host) < 1e-2 and _rel(x_auto.grad, x_host.grad) < 1e-2
    for (name, p), q in zip(auto.named_parameters(), host.parameters()):
        assert _rel(p.grad, q.grad) < 3e-2, name
    for key in ("tokens_per_expert", "tokens_per_local_expert", "dropped"):
        torch.testing.assert_close(auto.last_stats[key].float(), host.last_stats[key].float())
