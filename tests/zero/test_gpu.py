"""The ZeRO engine on a CUDA device: bf16 and fp16 (dynamic loss scaling) with MoE balancing losses."""

from __future__ import annotations

import functools

import pytest
import torch

import zero
from tests.zero.models import build_moe, global_batch, lm_loss

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEVICE = "cuda"


def _one_step_router_grads(dtype: str, stage: int) -> tuple[dict, float]:
    """Router gradients of one accumulated step (SGD lr=1: the change of the fp32 masters)."""
    from moe import expert_reduce_group, loss_scale_hooks

    model = build_moe(seed=0, aux_loss_coef=0.01, z_loss_coef=0.001).to(DEVICE)
    config = zero.ZeroConfig(stage=stage, dtype=dtype, grad_accum_steps=2, initial_loss_scale=2.0**12)
    engine = zero.initialize(model, functools.partial(torch.optim.SGD, lr=1.0), config,
                             reduce_groups=[expert_reduce_group(model, None)],
                             loss_scale_hooks=loss_scale_hooks(model))
    before = engine.full_state_dict()
    for micro in range(2):
        engine.backward(lm_loss(engine, global_batch(0, micro, 4).to(DEVICE)))
    assert engine.step(), "the step was skipped (overflow)"
    after = engine.full_state_dict()
    grads = {k: before[k] - after[k] for k in before if k.endswith("router.weight")}
    return grads, engine.loss_scale


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_mixed_precision_router_gradients_on_gpu_match_fp32(dtype, stage):
    ref, _ = _one_step_router_grads("fp32", stage)
    got, scale = _one_step_router_grads(dtype, stage)
    if dtype == "fp16":
        assert scale == 2.0**12  # the scale was well above 1 and no step overflowed
    for k in ref:
        assert (got[k] - ref[k]).norm() < 2e-2 * ref[k].norm(), k


def test_fp16_training_on_gpu_follows_fp32():
    losses = {}
    for dtype in ("fp32", "fp16"):
        model = build_moe(seed=0, aux_loss_coef=0.01).to(DEVICE)
        from moe import expert_reduce_group, loss_scale_hooks

        engine = zero.initialize(model, functools.partial(torch.optim.AdamW, lr=1e-2),
                                 zero.ZeroConfig(stage=2, dtype=dtype, initial_loss_scale=2.0**12),
                                 reduce_groups=[expert_reduce_group(model, None)],
                                 loss_scale_hooks=loss_scale_hooks(model))
        losses[dtype] = []
        for step in range(8):
            loss = lm_loss(engine, global_batch(step, 0, 8).to(DEVICE))
            engine.backward(loss)
            engine.step()
            losses[dtype].append(loss.item())
    torch.testing.assert_close(torch.tensor(losses["fp16"]), torch.tensor(losses["fp32"]), rtol=3e-2, atol=0)
