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

import torch
from transformers import CONFIG_MAPPING, PreTrainedConfig

#: The families (model_type -> whether it has routed experts) that pass every check of the coverage sweep
#: (python -m moe_lst.models.hf.coverage, which writes coverage.json beside this file and docs/hf_coverage.md):
#: the adapter builds these; any other causal LM is refused with the sweep's one-line reason.
COVERAGE_FILE = Path(__file__).with_name("coverage.json")


def coverage() -> dict[str, dict[str, Any]]:
    """model_type -> {"moe": bool, "features": {feature: "pass" or the reason it is refused}} from the sweep."""
    return _coverage(COVERAGE_FILE.stat().st_mtime if COVERAGE_FILE.is_file() else 0.0)


@functools.lru_cache(maxsize=2)
def _coverage(stamp: float) -> dict[str, dict[str, Any]]:
    return json.loads(COVERAGE_FILE.read_text())["families"] if stamp else {}


def refusal(kind: str) -> str | None:
    """Why model type `kind` is not built (None: it is covered): the sweep's reason for its first failing check."""
    record = coverage().get(kind)
    if record is None:
        return "it is not a causal LM of the installed transformers" if kind not in _causal_lm_types() else \
            "the coverage sweep has not run it"
    bad = [f"{feature}: {result}" for feature, result in record["features"].items() if feature == "logits"
           and result != "pass"]
    return bad[0] if bad else None


@functools.cache
def _causal_lm_types() -> frozenset[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return frozenset(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


class _Covered(Mapping):
    """MODEL_TYPES: the covered model types (their logits and gradients equal plain transformers') -> is MoE."""

    def _items(self) -> dict[str, bool]:
        return {k: bool(v["moe"]) for k, v in coverage().items() if refusal(k) is None}

    def __getitem__(self, key: str) -> bool:
        return self._items()[key]

    def __iter__(self):
        return iter(self._items())

    def __len__(self) -> int:
        return len(self._items())


MODEL_TYPES: Mapping[str, bool] = _Covered()
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
    try:  # (as transformers reads it: floats it cannot write as JSON, e.g. Infinity, are tagged objects)
        raw = PreTrainedConfig._dict_from_json_file(file)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HFConfigError(f"{file} is not a readable JSON config ({e})") from None
    if not isinstance(raw, dict):
        raise HFConfigError(f"{file} holds a JSON {type(raw).__name__}, not a config object")
    kind = raw.get("model_type")
    why = refusal(kind) if isinstance(kind, str) else "it names no model_type"
    if why is not None:
        raise HFConfigError(f"model_type={kind!r} ({file}) is not covered by the Hugging Face adapter: {why} "
                            "(docs/hf_coverage.md lists the model types it builds)")
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
    # (a key under an alias, e.g. num_experts for num_local_experts, overrides the key the config.json holds)
    checked = {base.attribute_map.get(key, key): _check_override(key, value, base, path)
               for key, value in overrides.items()}
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


@functools.lru_cache(maxsize=32)
def _structure(config_json: str) -> tuple[tuple[bool, ...], int]:
    """(per decoder layer: whether it holds routed experts, the number of routed experts) of a config's model,
    read from the model built on the meta device."""
    from moe_lst.models.hf.experts import is_experts
    from moe_lst.models.hf.structure import decoder_blocks
    from transformers import AutoModelForCausalLM

    values = json.loads(config_json)
    config = CONFIG_MAPPING[values["model_type"]].from_dict(values)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    layers = tuple(any(is_experts(m) for m in block.modules()) for _, block in decoder_blocks(model))
    experts = [m for m in model.modules() if is_experts(m)]
    count = int((experts[0].gate_up_proj if experts[0].has_gate else experts[0].up_proj).shape[0]) if experts else 0
    return layers, count


def _structure_of(config: PreTrainedConfig) -> tuple[tuple[bool, ...], int]:
    return _structure(json.dumps(config.to_dict(), sort_keys=True, default=str))


def is_moe(config: PreTrainedConfig) -> bool:
    """Whether the model has routed experts (transformers' ExpertsInterface experts) in any layer."""
    return any(_structure_of(config)[0])


def num_experts(config: PreTrainedConfig) -> int:
    """The number of routed experts per MoE layer (0 for a dense model)."""
    return _structure_of(config)[1]


def dense_mlp_layers(config: PreTrainedConfig) -> list[int]:
    """The decoder layers whose feed-forward is a dense MLP (no routed experts)."""
    return [i for i, moe in enumerate(_structure_of(config)[0]) if not moe]


def sliding_window(config: PreTrainedConfig) -> int | None:
    """A window that bounds the sequence the adapter can train: None, as the adapter's attention honours every
    layer's sliding window exactly (moe_lst.models.hf.attention)."""
    return None


def rope_type(config: PreTrainedConfig) -> str:
    """The rotary embedding's type (default, linear, llama3, yarn, dynamic, ...)."""
    rope = getattr(config, "rope_parameters", None) or {}
    return rope.get("rope_type", "default") if isinstance(rope, dict) else "default"
