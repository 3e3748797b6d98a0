"""Tiny Hugging Face configs of every model type the adapter covers, written into test directories: byte-level
vocabularies (the recipe's default corpus), a few layers, every variant worth covering (tied heads, q/k norms,
q/k/v biases, a padding row, mixed dense and MoE layers)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from moe_lst.models.hf import moe_supported
from transformers import CONFIG_MAPPING, AutoModelForCausalLM

COMMON = dict(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.05)
EXTRA = {
    "llama": dict(pad_token_id=0),
    "gemma2": dict(),
    "qwen3": dict(head_dim=8, tie_word_embeddings=True),
    "mistral": dict(sliding_window=64),
    "qwen2": dict(),  # q/k/v projections with biases
    # trained with transformers' balancing loss (output_router_logits), weighted so that it shows
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.1),
    "qwen3_moe": dict(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=[1],
                      norm_topk_prob=True, output_router_logits=True, router_aux_loss_coef=0.1),
    "olmoe": dict(num_experts=4, num_experts_per_tok=3, output_router_logits=True, router_aux_loss_coef=0.1,
                  clip_qkv=4.0),
}
DENSE = ("llama", "qwen3", "mistral", "qwen2")
MOE = ("mixtral", "qwen3_moe", "olmoe")
#: The mark of a test parameter that needs models/hf/moe.py (MoE model types): skipped until it exists.
NEEDS_MOE = pytest.mark.skipif(not moe_supported(), reason="models/hf/moe.py (adopt_moe_blocks) is not there")
#: Every covered model type as a pytest parameter; the MoE ones run once models/hf/moe.py exists.
ALL = [*DENSE, *(pytest.param(kind, marks=NEEDS_MOE) for kind in MOE)]
#: The ones the longer tests run: the two the adapter is built for first, and the MoE ones when they can.
MAIN = ["llama", "qwen3", *(pytest.param(kind, marks=NEEDS_MOE) for kind in MOE)]


def tiny_config(kind: str, **overrides):
    """A tiny transformers config of model type `kind`."""
    return CONFIG_MAPPING[kind](**{**COMMON, **EXTRA[kind], **overrides})


def write_config(directory: Path, kind: str, **overrides) -> Path:
    """A directory holding the config.json of tiny_config(kind)."""
    tiny_config(kind, **overrides).save_pretrained(directory)
    return directory


def plain_model(kind: str, seed: int = 0, **overrides):
    """The plain transformers model of tiny_config(kind) (its own init, SDPA attention), fp32."""
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(kind, **overrides), dtype=torch.float32)


def adapted_copy(model):
    """The adapter around a copy of the plain `model`, with its weights."""
    from moe_lst.models.hf import HFCausalLM

    return HFCausalLM(copy.deepcopy(model))
