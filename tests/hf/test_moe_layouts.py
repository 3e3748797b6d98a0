"""The two options of moe/ that Hugging Face MoE blocks use: GroupedExperts(transposed=True) (weights stored
[E, out, in] like Hugging Face's fused experts) computes what the default layout computes, on every path;
a router with fp32_logits=False routes exactly as Mixtral's and Qwen3-MoE's routers in bf16.
"""

from __future__ import annotations

import pytest
import torch
from moe_lst.models.hf.moe import HFRouter
from transformers import MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

import moe.experts as experts_mod
from moe import GroupedExperts, TopKRouter

DIM, FFN, E = 16, 12, 5
COUNTS = torch.tensor([3, 0, 6, 2, 1])  # an expert without tokens included


def _pair(activation: str) -> tuple[GroupedExperts, GroupedExperts]:
    torch.manual_seed(0)
    plain = GroupedExperts(DIM, FFN, E, activation)
    flipped = GroupedExperts(DIM, FFN, E, activation, transposed=True)
    width = 2 * FFN if activation == "swiglu" else FFN
    assert flipped.w_in.shape == (E, width, DIM) and flipped.w_out.shape == (E, DIM, FFN)
    with torch.no_grad():
        flipped.w_in.copy_(plain.w_in.transpose(1, 2))
        flipped.w_out.copy_(plain.w_out.transpose(1, 2))
    return plain, flipped


def _run(ex: GroupedExperts, fused_tokens: bool, preset: bool) -> list[torch.Tensor]:
    """Output and gradients of one forward/backward; weight gradients in the default [E, in, out] layout."""
    g = torch.Generator().manual_seed(1)
    ex.w_in.grad = torch.ones_like(ex.w_in) if preset else None
    ex.w_out.grad = torch.ones_like(ex.w_out) if preset else None
    if fused_tokens:
        x = torch.randn(7, DIM, generator=g, requires_grad=True)
        gate = torch.rand(int(COUNTS.sum()), generator=g, requires_grad=True)
        token_index = torch.randint(0, 7, (int(COUNTS.sum()),), generator=g)
        y = ex.forward_tokens(x, token_index, gate, COUNTS, max_chunks=2)
    else:
        x = torch.randn(int(COUNTS.sum()), DIM, generator=g, requires_grad=True)
        gate = None
        y = ex(x, COUNTS)
    (y * torch.randn(y.shape, generator=g)).sum().backward()
    grads = [ex.w_in.grad, ex.w_out.grad]
    if ex.transposed:
        grads = [w.transpose(1, 2) for w in grads]
    return [y, x.grad, *grads] + ([gate.grad] if gate is not None else [])


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("grouped_mm", [True, False], ids=["grouped-mm", "segment-loop"])
def test_transposed_experts_compute_the_default_layout(activation, grouped_mm, monkeypatch):
    if not grouped_mm:
        monkeypatch.setattr(experts_mod, "grouped_mm_supported", lambda *a: False)
    plain, flipped = _pair(activation)
    for fused_tokens in (False, True):
        for fuse, preset in ((False, False), (True, False), (True, True)):  # in-place accumulation into .grad
            plain.fuse_grad_accumulation = flipped.fuse_grad_accumulation = fuse
            want, got = _run(plain, fused_tokens, preset), _run(flipped, fused_tokens, preset)
            where = f"fused_tokens={fused_tokens} fuse={fuse} preset={preset}"
            for i, (a, b) in enumerate(zip(got, want)):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, i=i, w=where: f"{w} {i}: {m}")
    assert flipped.w_in.grad.shape == flipped.w_in.shape and flipped.w_in.grad.is_contiguous()


def test_transposed_experts_slice_like_the_default_layout():
    plain, flipped = _pair("swiglu")
    for ex in (plain, flipped):
        ex.keep_hidden(3, 10)
        ex.keep_experts(1, 4)
    assert flipped.expert_range == plain.expert_range == (1, 4) and flipped.ffn_dim == plain.ffn_dim == 7
    assert torch.equal(flipped.w_in.transpose(1, 2), plain.w_in)
    assert torch.equal(flipped.w_out.transpose(1, 2), plain.w_out)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_router_in_model_dtype_routes_like_hugging_face(kind):
    torch.manual_seed(0)
    if kind == "mixtral":
        hf = MixtralTopKRouter(MixtralConfig(hidden_size=DIM, num_local_experts=8, num_experts_per_tok=2))
        ours = HFRouter(DIM, 8, 2, renormalize=True, weights_in_logits_dtype=False)
    else:
        hf = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=DIM, num_experts=8, num_experts_per_tok=2,
                                               norm_topk_prob=False))
        ours = HFRouter(DIM, 8, 2, renormalize=False, weights_in_logits_dtype=True)
    with torch.no_grad():
        hf.weight.normal_(0, 0.5)
    hf = hf.to(torch.bfloat16)
    ours.weight = hf.weight  # the same bf16 parameter
    x = torch.randn(64, DIM, dtype=torch.bfloat16)
    logits, weights, indices = hf(x)
    routing = ours(x)
    assert routing.logits.dtype == torch.bfloat16 and torch.equal(routing.logits, logits)
    assert torch.equal(routing.indices, indices)
    assert routing.weights.dtype == weights.dtype == (torch.float32 if kind == "mixtral" else torch.bfloat16)
    assert torch.equal(routing.weights, weights)
    # the project's router keeps fp32 logits by default
    default = TopKRouter(DIM, 8, 2)
    default.weight = hf.weight
    assert default(x).logits.dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_transposed_experts_on_gpu_in_bf16():
    torch.manual_seed(0)
    plain = GroupedExperts(64, 128, 8, init_std=0.1).cuda().to(torch.bfloat16)
    flipped = GroupedExperts(64, 128, 8, init_std=0.1, transposed=True).cuda().to(torch.bfloat16)
    with torch.no_grad():
        flipped.w_in.copy_(plain.w_in.transpose(1, 2))
        flipped.w_out.copy_(plain.w_out.transpose(1, 2))
    assert experts_mod.grouped_mm_supported(torch.device("cuda"), torch.bfloat16, 64, 256)  # the grouped kernel
    counts = torch.tensor([40, 0, 100, 7, 1, 0, 60, 92], device="cuda")
    x = torch.randn(300, 64, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(300, 64, device="cuda", dtype=torch.bfloat16)
    for fuse in (False, True):
        outs = []
        for ex in (plain, flipped):
            ex.fuse_grad_accumulation = fuse
            ex.w_in.grad = torch.zeros_like(ex.w_in) if fuse else None
            ex.w_out.grad = torch.zeros_like(ex.w_out) if fuse else None
            xi = x.clone().requires_grad_(True)
            y = ex(xi, counts)
            y.backward(g)
            w_grads = [ex.w_in.grad, ex.w_out.grad]
            outs.append([y, xi.grad] + ([w.transpose(1, 2) for w in w_grads] if ex.transposed else w_grads))
        for a, b in zip(outs[1], outs[0]):
            assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 1e-2
