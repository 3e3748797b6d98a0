"""Which Hugging Face configs the adapter builds: a config.json (or a model directory holding one) of a model type
it covers, with typed overrides of its keys, and the features it refuses in one line (HFConfigError)."""

from __future__ import annotations

import copy
import difflib
import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from transformers import CONFIG_MAPPING, PreTrainedConfig

#: model_type -> whether its feed-forward blocks are sparse MoE (models/hf/moe.py adopts those).
#: Each has the decoder layout the adapter reads: `model.layers.{i}` holding `self_attn` and `mlp`, then
#: `model.norm` and `lm_head`, with Hugging Face's own rotary embedding applied inside `self_attn`.
MODEL_TYPES = {"llama": False, "mistral": False, "qwen2": False, "qwen3": False, "mixtral": True, "qwen3_moe": True,
               "olmoe": True}
#: rotary types whose tables depend on the longest position a forward sees: under Ulysses each rank sees another.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


class HFConfigError(ValueError):
    """A Hugging Face config, override or directory the adapter cannot build or load; the message is one line."""


def _one_line(error: BaseException) -> str:
    """The cause of a transformers config error in one line (its validators wrap the real message)."""
    cause = error.__cause__ or error
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    return lines[-1] if lines else type(cause).__name__


def config_file(source: str | Path) -> Path:
    """The config.json that `source` names: the file itself, or the one inside a model directory."""
    path = Path(source)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise HFConfigError(f"{source} is neither a config.json nor a directory holding one")
    return file


def _read(file: Path) -> dict[str, Any]:
    try:
        raw = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HFConfigError(f"{file} is not a readable JSON config ({e})") from None
    if not isinstance(raw, dict):
        raise HFConfigError(f"{file} holds a JSON {type(raw).__name__}, not a config object")
    kind = raw.get("model_type")
    if kind not in MODEL_TYPES:
        raise HFConfigError(f"model_type={kind!r} ({file}) is not covered by the Hugging Face adapter; it builds "
                            f"model_type {', '.join(MODEL_TYPES)}")
    return raw


def _build(values: dict[str, Any], where: str) -> PreTrainedConfig:
    try:
        return CONFIG_MAPPING[values["model_type"]].from_dict(dict(values))
    except Exception as e:  # noqa: BLE001 - transformers' validators raise several types; all mean a bad config
        raise HFConfigError(f"{where}: {_one_line(e)}") from None


def _kind(value: Any) -> str:
    return {bool: "a bool", int: "an int", float: "a number", str: "a string", list: "a list",
            dict: "a mapping"}.get(type(value), type(value).__name__)


def _check_override(key: str, value: Any, base: PreTrainedConfig, file: Path) -> Any:
    """`value` for config key `key`, checked against the key's value in the base config (same type; an int
    where a float is is a float)."""
    known = sorted(set(base.to_dict()) | set(base.attribute_map))
    if key == "model_type":
        raise HFConfigError("model.hf.overrides.model_type cannot change the model type: choose another config")
    if key not in known:
        close = difflib.get_close_matches(key, known, n=1)
        hint = f"did you mean {close[0]}?" if close else "see the keys of that config.json"
        raise HFConfigError(f"model.hf.overrides.{key} is not a key of the {base.model_type} config ({file}): {hint}")
    current = getattr(base, key)
    if current is None or value is None:
        return value
    if isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if type(value) is not type(current) and not (isinstance(current, (list, tuple)) and isinstance(value, list)):
        raise HFConfigError(f"model.hf.overrides.{key}={value!r} must be {_kind(current)} like the config's "
                            f"{key}={current!r}")
    return value


def _relayered(raw: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """A config.json that lists `layer_types` per layer gets a list of the new length when only the number of
    layers is overridden and every layer has the same type."""
    types = raw.get("layer_types")
    if "num_hidden_layers" not in overrides or "layer_types" in overrides or not isinstance(types, list):
        return {}
    if len(set(types)) > 1:
        raise HFConfigError(f"model.hf.overrides.num_hidden_layers={overrides['num_hidden_layers']} but the config "
                            f"lists mixed layer_types ({', '.join(sorted(set(types)))}): override layer_types too")
    return {"layer_types": types[:1] * int(overrides["num_hidden_layers"])}


def _unsupported(config: PreTrainedConfig) -> list[str]:
    """Features of `config` that the adapter does not cover."""
    problems = []
    if getattr(config, "attention_dropout", 0.0):
        problems.append(f"attention_dropout={config.attention_dropout} (the adapter's attention has no dropout; "
                        "set model.hf.overrides.attention_dropout=0.0)")
    if getattr(config, "quantization_config", None):
        problems.append("quantization_config (quantized weights do not train here)")
    return problems


@functools.lru_cache(maxsize=16)
def _load(file: str, stamp: float, overrides_json: str) -> PreTrainedConfig:
    path = Path(file)
    raw = _read(path)
    base = _build(raw, str(path))
    overrides = json.loads(overrides_json)
    checked = {key: _check_override(key, value, base, path) for key, value in overrides.items()}
    where = f"{path} with model.hf.overrides" if overrides else str(path)
    config = _build({**raw, **_relayered(raw, checked), **checked}, where) if overrides else base
    problems = _unsupported(config)
    if problems:
        raise HFConfigError(f"{where}: not covered by the Hugging Face adapter: {'; '.join(problems)}")
    return config


def load_config(source: str | Path, overrides: Mapping[str, Any] | None = None) -> PreTrainedConfig:
    """The transformers config of `source` (a config.json or a model directory) with `overrides` of its keys
    (e.g. {"hidden_size": 64, "num_hidden_layers": 2} for a tiny model), checked: the model type is one the
    adapter covers, each key exists with a value of its type, transformers' own validation passes, and the
    features it uses are covered. A fresh copy each call (cached by file, modification time and overrides)."""
    file = config_file(source)
    try:
        overrides_json = json.dumps(dict(overrides or {}), sort_keys=True)
    except TypeError as e:
        raise HFConfigError(f"model.hf.overrides must hold plain values (numbers, strings, lists, mappings): {e}") \
            from None
    return copy.deepcopy(_load(str(file.resolve()), file.stat().st_mtime, overrides_json))


def is_moe(config: PreTrainedConfig) -> bool:
    """Whether the model's feed-forward blocks are sparse MoE (Mixtral, Qwen3-MoE, OLMoE)."""
    return MODEL_TYPES[config.model_type]


def dense_mlp_layers(config: PreTrainedConfig) -> list[int]:
    """The layers whose feed-forward is a dense MLP (every layer of a dense model; none of Mixtral's or OLMoE's;
    Qwen3-MoE's mlp_only_layers and those off its decoder_sparse_step)."""
    layers = range(config.num_hidden_layers)
    if config.model_type in ("mixtral", "olmoe"):
        return []
    if config.model_type == "qwen3_moe":
        return [i for i in layers if i in config.mlp_only_layers or not config.num_experts
                or (i + 1) % config.decoder_sparse_step]
    return list(layers)


def sliding_window(config: PreTrainedConfig) -> int | None:
    """The attention window the model's layers use, or None for full causal attention. (Qwen2 / Qwen3 keep
    `sliding_window` only with use_sliding_window; Mistral, Mixtral and Qwen3-MoE pass it to every layer.)"""
    return getattr(config, "sliding_window", None)


def rope_type(config: PreTrainedConfig) -> str:
    """The rotary embedding's type (default, linear, llama3, yarn, dynamic, ...)."""
    rope = getattr(config, "rope_parameters", None) or {}
    return rope.get("rope_type", "default")
