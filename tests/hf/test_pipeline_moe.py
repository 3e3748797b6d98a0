"""Pipeline stages of an MoE model trained with transformers' balancing loss (moe_lst.models.hf.pipeline), in one
process: each stage sends its micro-batch's per-expert sums on with its activation and the last stage computes the
loss over every layer, so the stages chained give the whole model's logits, balancing loss and gradients (the
routers of the first stage included), with two micro-batches in flight at once as under 1F1B, and with activation
checkpointing (a layer recomputed in backward takes its own micro-batch's statistics). Through the recipe on
2 ranks: tests/hf/test_recipe_layouts.py (the MoE families' pp2 cases, -m slow)."""

from __future__ import annotations

import pytest
import torch
from moe_lst.models.hf import build
from moe_lst.models.hf.pipeline import pipeline_shapes

from sequence_parallel import apply_activation_checkpointing
from tests.hf.tiny import NEEDS_MOE, tiny_config


@NEEDS_MOE
@pytest.mark.parametrize("checkpointed", [False, True])  # (a recomputed layer finds its own micro-batch's sums)
def test_chained_stages_give_the_models_balancing_loss_and_gradients(checkpointed):
    torch.manual_seed(0)
    model = build(tiny_config("qwen3_moe", mlp_only_layers=[]))  # (both layers routed: one per stage)
    model.train()
    if checkpointed:
        apply_activation_checkpointing(model)
    model.balance.scale(0.5)  # the engine's loss multiplier (as with 2 micro-batches), the main loss's factor too
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 256, (2, 12), generator=gen) for _ in range(2)]
    positions = torch.arange(12).expand(2, 12)
    want_logits, want_aux = [], []
    for tokens in batches:  # one process: a forward and backward per micro-batch, the balancing loss attached
        logits = model(tokens)
        want_logits.append(logits.detach())
        want_aux.append(model.balance.last_value)
        (logits.square().mean() * 0.5).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    first, last = model.pipeline_stage(range(0, 1), True, False), model.pipeline_stage(range(1, 2), False, True)
    sent = [first(tokens, positions) for tokens in batches]  # (both micro-batches forward before any backward)
    assert [tuple(a.shape) for a in sent] == [pipeline_shapes(model, (2, 12))[0]] * 2
    received = [a.detach().requires_grad_() for a in sent]
    outs, aux = [], []
    for a in received:
        outs.append(last(a, positions))
        aux.append(model.balance.last_value)
    for a, b, out, logits in zip(sent, received, outs, want_logits):
        torch.testing.assert_close(out, logits, rtol=1e-6, atol=1e-6)
        (out.square().mean() * 0.5).backward()
        a.backward(b.grad)  # the activation's gradient back to the first stage, as the pipeline sends it
    assert aux == want_aux and all(v > 0 for v in aux)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-5, atol=1e-8, msg=name)
    router = next(n for n in want if n.startswith("model.layers.0.") and "gate.weight" in n)
    model.balance.coef = 0.0  # (and the balancing loss's share of the first stage's router gradient is not small)
    model.zero_grad()
    (last(first(batches[0], positions), positions).square().mean() * 0.5).backward()
    assert not torch.allclose(model.get_parameter(router).grad, want[router], rtol=1e-3, atol=0)
