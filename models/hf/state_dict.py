"""Weights from and to Hugging Face model directories. The adapter's state dict is transformers' own (the same
names and shapes), so a directory written by `save_pretrained` (or `python -m recipes.export`) loads through
`from_pretrained` (its conversions included, e.g. Mixtral's per-expert tensors) and a trained state dict is
written back through `save_pretrained`."""

from __future__ import annotations

import copy
from collections.abc import Collection
from pathlib import Path

import torch
from moe_lst.models.files import follow_umask
from moe_lst.models.hf.config import HFConfigError, load_config
from transformers import AutoModelForCausalLM, PreTrainedConfig
from transformers.initialization import no_init_weights

#: Config keys that decide parameter names and shapes, named when two models' weights do not fit each other.
WEIGHT_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
               "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings",
               "num_local_experts", "attention_bias", "mlp_bias", "mlp_only_layers", "decoder_sparse_step")


def parameter_shapes(config: PreTrainedConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the state dict of `config`'s model (built on the meta device)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def num_params(config: PreTrainedConfig) -> int:
    """Parameters of `config`'s model, a tied embedding counted once."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32)
    return sum(p.numel() for p in model.parameters())


def weight_mismatches(ours: PreTrainedConfig, theirs: PreTrainedConfig) -> list[str]:
    """What makes the weights of `theirs` not fit the model of `ours` (empty when they fit): the differing
    WEIGHT_KEYS, else the first tensors that differ."""
    mine, other = parameter_shapes(ours), parameter_shapes(theirs)
    if mine == other:
        return []
    keys = [f"{k}={getattr(ours, k, None)!r} here but {getattr(theirs, k, None)!r} there" for k in WEIGHT_KEYS
            if getattr(ours, k, None) != getattr(theirs, k, None)]
    if keys:
        return keys
    names = [n for n in sorted(set(mine) | set(other)) if mine.get(n) != other.get(n)]
    return [f"{n} is {mine.get(n)} here but {other.get(n)} there" for n in names[:3]]


def check_model_directory(directory: str | Path, config: PreTrainedConfig) -> Path:
    """`directory` as a Path once it is a Hugging Face model directory whose config.json describes `config`'s
    weights (HFConfigError in one line naming what differs, before any tensor is read)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise HFConfigError(f"{directory} is not a directory (a Hugging Face model directory, as save_pretrained "
                            "or python -m recipes.export writes, holds config.json and the weights)")
    differ = weight_mismatches(config, load_config(directory))
    if differ:
        raise HFConfigError(f"{directory} holds another model: {', '.join(differ)}; set model.hf.overrides to the "
                            "directory's values, or leave model.hf.config unset to take the directory's config")
    return directory


def save_weights(state: dict[str, torch.Tensor], config: PreTrainedConfig, out_dir: str | Path,
                 original_format: bool = True, buffers: Collection[str] = ()) -> Path:
    """Write the full state dict `state` (Hugging Face names, flat or shaped) of `config`'s model into `out_dir`
    through transformers' `save_pretrained` (config.json and safetensors), loadable by
    `AutoModelForCausalLM.from_pretrained`. The tied head may be absent; transformers' non-persistent buffers
    (rotary tables) and the names in `buffers` (the trained model's own, e.g. MoE load counters) are left out.
    `original_format`: MoE experts per expert (the published layout) rather than fused as transformers 5
    holds them."""
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32)
    model.tie_weights()  # (skipped with the init: a tied head would be saved as its own uninitialised tensor)
    shapes = {name: t.shape for name, t in model.state_dict().items()}
    left_out = {name for name, _ in model.named_buffers()} | set(buffers)
    tensors = {}
    for name, value in state.items():
        if name in shapes:
            tensors[name] = value.detach().to(torch.float32).reshape(shapes[name])
        elif name not in left_out:
            raise HFConfigError(f"{name} is not a tensor of the {config.model_type} model this config describes")
    result = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()  # the embedding's, loaded under its name
    missing = [n for n in result.missing_keys if n not in tied]
    if missing:
        raise HFConfigError(f"the state dict lacks {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, save_original_format=original_format)
    follow_umask(*out_dir.glob("*.safetensors"))  # (save_pretrained writes them through safetensors' save_file)
    return out_dir
