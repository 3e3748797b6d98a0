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


@pytest.mark.parametrize("kind, overrides", [("granite", dict(embedding_multiplier=3.0)), ("minicpm3", {})])
def test_the_stages_repeat_what_the_model_does_around_its_layers(kind, overrides):
    """What the base model does to the embedding before its layers (granite's embedding_multiplier, on the first
    stage) and what the causal LM does to the hidden states before its head (minicpm3's division by logits_scaling,
    on the last) is repeated: the stages chained give the model's logits; a head so preceded is not plain (tiled
    losses, which apply the head to the base model's hidden states, are refused)."""
    from moe_lst.models.hf import coverage

    torch.manual_seed(0)
    model = build(coverage.tiny_config(kind, **overrides))
    assert not model.plain_head
    n = len(model.blocks())
    first, last = model.pipeline_stage(range(n // 2), True, False), model.pipeline_stage(range(n // 2, n), False, True)
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(12).expand(2, 12)
    with torch.no_grad():
        want = model(tokens)
        got = last(first(tokens, positions), positions)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_layers_sharing_keys_and_values_are_staged_together_or_refused():
    """Gemma 4's KV-shared layers read the keys and values the last `store` layer of their type wrote into the dict
    the base model gives its layers: a stage gives its own, so a split keeping each pair on one stage gives the
    model's logits, and one putting them on two stages is refused naming both layers."""
    from transformers import CONFIG_MAPPING

    from zero.contract import ContractError

    config = CONFIG_MAPPING["gemma4_unified_text"](
        vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=6, max_position_embeddings=64, num_kv_shared_layers=2,
        layer_types=["sliding_attention", "full_attention"] * 3)
    assert config.kv_sharing_modes == [None, None, "store", "store", "reuse", "reuse"]
    torch.manual_seed(0)
    model = build(config)
    first, last = model.pipeline_stage(range(2), True, False), model.pipeline_stage(range(2, 6), False, True)
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(12).expand(2, 12)
    with torch.no_grad():
        want = model(tokens)
        got = last(first(tokens, positions), positions)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(ContractError, match="layer 4 reuses the keys and values of layer 2 .* on another stage"):
        model.pipeline_stage(range(3, 6), False, True)


def test_what_a_stage_cannot_give_its_layers_is_refused_by_name():
    """gemma4_text's per-layer inputs (computed from the token ids and the embedding, a second positional argument of
    every layer) do not reach later stages: refused naming them."""
    from transformers import CONFIG_MAPPING

    from zero.contract import ContractError

    config = CONFIG_MAPPING["gemma4_text"](
        vocab_size=256, vocab_size_per_layer_input=256, hidden_size_per_layer_input=8, hidden_size=32,
        intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = build(config, meta=True)
    with pytest.raises(ContractError, match="gives its layers per_layer_input, which a stage does not"):
        model.pipeline_stage(range(0), True, False)
