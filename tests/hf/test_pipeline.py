"""Pipeline stages of the adapter from a config's base_model_pp_plan (moe_lst.models.hf.pipeline), in one process:
the stages chained give the whole model's logits and gradients, a tied head's last stage holds the embedding under
its own name (so the pipeline keeps and sums the two copies), and what cannot be staged is refused in one line.
The stages on 2 ranks through the recipe: tests/hf/test_recipe_layouts.py; with a balancing loss:
tests/hf/test_pipeline_moe.py."""

from __future__ import annotations

import pytest
import torch
from moe_lst.models.hf import build
from torch import nn

from tests.hf.tiny import tiny_config


def _halves(model) -> tuple[nn.Module, nn.Module]:
    """The model's first and last pipeline stages, its layers split in two."""
    n = len(model.blocks())
    return model.pipeline_stage(range(n // 2), True, False), model.pipeline_stage(range(n // 2, n), False, True)


def _assert_chained(model, first: nn.Module, last: nn.Module) -> None:
    """The stages chained give the model's logits exactly."""
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(12).expand(2, 12)
    with torch.no_grad():
        torch.testing.assert_close(last(first(tokens, positions), positions), model(tokens), rtol=0, atol=0)


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
    first, last = _halves(model)
    _assert_chained(model, first, last)


@pytest.mark.parametrize("kind, overrides", [("granite", dict(embedding_multiplier=3.0, logits_scaling=2.0)),
                                              ("minicpm3", {})])
def test_the_stages_repeat_what_the_model_does_around_its_layers(kind, overrides):
    """What the base model does to the embedding before its layers (granite's embedding_multiplier, on the first
    stage), what the causal LM does to the hidden states before its head (minicpm3's division by logits_scaling,
    on the last) and to its logits after it (granite's) is repeated: the stages chained give the model's logits; a
    head so preceded or followed is not plain (tiled losses, which apply the head to the base model's hidden
    states, are refused)."""
    from moe_lst.models.hf import coverage

    torch.manual_seed(0)
    model = build(coverage.tiny_config(kind, **overrides))
    assert not model.plain_head
    first, last = _halves(model)
    _assert_chained(model, first, last)


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
    _assert_chained(model, first, last)
    with pytest.raises(ContractError, match="layer 4 reuses the keys and values of layer 2 .* on another stage"):
        model.pipeline_stage(range(3, 6), False, True)


def test_per_layer_inputs_are_made_on_the_first_stage_and_sent_on():
    """gemma4_text's per-layer inputs (made from the token ids and the embedding, each layer given its slice as a
    second positional argument) are made by the first stage and sent on after the hidden states (pipeline_shapes
    counting their positions): three stages chained give the model's logits and every gradient, the per-layer
    embedding's included."""
    from transformers import CONFIG_MAPPING

    config = CONFIG_MAPPING["gemma4_text"](
        vocab_size=256, vocab_size_per_layer_input=256, hidden_size_per_layer_input=8, hidden_size=32,
        intermediate_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        layer_types=["sliding_attention", "full_attention"] * 2)
    torch.manual_seed(0)
    model = build(config)
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(12).expand(2, 12)
    want = model(tokens)
    want.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    stages = [model.pipeline_stage(range(0, 1), True, False), model.pipeline_stage(range(1, 3), False, False),
              model.pipeline_stage(range(3, 4), False, True)]
    assert "model.embed_tokens_per_layer.weight" in dict(stages[0].named_parameters())
    x = tokens
    for stage in stages:
        x = stage(x, positions)
        if stage is not stages[-1]:  # (12 positions of hidden states, 12 * 4 * 8 / 32 of per-layer inputs)
            assert x.shape == model.pipeline_shapes((2, 12))[0] == (2, 24, 32)
    torch.testing.assert_close(x, want, rtol=0, atol=0)
    x.square().mean().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-6, atol=1e-9, msg=name)


@pytest.mark.parametrize("kind, overrides", [("beam", {}), ("granite_swa", dict(layer_rope_theta=[500.0, 0.0]))])
def test_layer_arguments_made_from_the_positions_are_replayed(kind, overrides):
    """Layer arguments the base model makes from the positions by statements of its own are made by the same
    statements on each stage: beam's query scale of its layers without rope (attention_scaling, and no rotary table
    for them), granite_swa's rotary tables per layer theta from several rotary embeddings (and none for a NoPE
    layer). The stages chained give the model's logits."""
    from moe_lst.models.hf import coverage

    torch.manual_seed(0)
    model = build(coverage.tiny_config(kind, **overrides))
    first, last = _halves(model)
    assert first.replay is not None and "position_embeddings" in first.replay.keywords
    _assert_chained(model, first, last)


class _UnstageableModel(nn.Module):
    """A base model whose layers get an argument made from something a stage does not have (the token ids)."""

    def forward(self, input_ids=None, position_ids=None):
        hidden_states = self.embed_tokens(input_ids)
        token_scale = (input_ids > 0).float()
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, position_ids=position_ids, token_scale=token_scale)
        return self.norm(hidden_states)


def test_what_a_stage_cannot_make_for_its_layers_is_refused_by_name():
    from moe_lst.models.hf.pipeline import layer_replay

    replay = layer_replay(_UnstageableModel())
    assert replay.keywords == ["token_scale"]
    assert replay.problem == "its base model makes its layers' token_scale from input_ids"


def test_a_plan_naming_its_layers_otherwise_is_staged_under_their_names():
    """GPT-J's plan names its layers `h` (and a dropout after the embedding, its forward a token-type statement the
    adapter never feeds and a layer loop over `block`): the stages hold `transformer.h.{i}` and chained give the
    model's logits."""
    from moe_lst.models.hf import coverage

    torch.manual_seed(0)
    model = build(coverage.tiny_config("gptj"))
    first, last = _halves(model)
    n = len(model.blocks())
    assert [name for name, _ in last.blocks()] == [f"transformer.h.{i}" for i in range(n // 2, n)]
    _assert_chained(model, first, last)


def test_a_layer_cache_argument_is_left_to_its_default():
    """GPT-NeoX gives its layers `layer_past=cache` (the key/value cache, None in training): a stage leaves it at its
    default instead of refusing to make it, and the stages chained give the model's logits."""
    from moe_lst.models.hf import coverage
    from moe_lst.models.hf.pipeline import layer_arguments

    torch.manual_seed(0)
    model = build(coverage.tiny_config("gpt_neox"))
    assert "layer_past" in layer_arguments(type(model.base))
    first, last = _halves(model)
    _assert_chained(model, first, last)
