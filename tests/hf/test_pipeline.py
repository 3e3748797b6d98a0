"""Pipeline stages of the adapter from a config's base_model_pp_plan (moe_lst.models.hf.pipeline), in one process:
the stages chained give the whole model's logits and gradients, a tied head's last stage holds the embedding under
its own name (so the pipeline keeps and sums the two copies), and what cannot be staged is refused in one line.
The stages on 2 ranks through the recipe: tests/hf/test_recipe_layouts.py; with a balancing loss:
tests/hf/test_pipeline_moe.py."""

from __future__ import annotations

import pytest
import torch
from moe_lst.models.hf import build

from tests.hf.tiny import tiny_config


@pytest.mark.parametrize("kind", ["llama", "qwen3"])  # (qwen3's tiny config ties its head to the embedding)
def test_chained_stages_give_the_models_logits_and_gradients(kind):
    torch.manual_seed(0)
    model = build(tiny_config(kind))
    first, last = model.pipeline_stage(range(0, 1), True, False), model.pipeline_stage(range(1, 2), False, True)
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(12).expand(2, 12)
    want = model(tokens)
    want.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    got = last(first(tokens, positions), positions)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    got.square().mean().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-6, atol=1e-9, msg=name)
    names = {n for n, _ in last.named_parameters()}
    tied = model.config.tie_word_embeddings
    assert ("model.embed_tokens.weight" in names) == tied and ("lm_head.weight" in names) != tied
    assert [n for n, _ in first.blocks()] == ["model.layers.0"] and [n for n, _ in last.blocks()] == ["model.layers.1"]


def test_the_last_stage_applies_the_models_logit_softcapping():
    """gemma3_text softcaps its logits after the (tied) head: the stages chained give the model's logits (a last
    stage without the softcap gives other logits; the unknown forms are refused: tests/hf/test_tp_styles.py)."""
    from moe_lst.models.hf import coverage

    torch.manual_seed(0)
    model = build(coverage.tiny_config("gemma3_text", final_logit_softcapping=2.0))
    assert model.config.final_logit_softcapping and not model.plain_head
    n = len(model.blocks())
    first, last = model.pipeline_stage(range(n // 2), True, False), model.pipeline_stage(range(n // 2, n), False, True)
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(12).expand(2, 12)
    with torch.no_grad():
        want = model(tokens)
        got = last(first(tokens, positions), positions)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
