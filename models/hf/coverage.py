"""The coverage sweep: every `*ForCausalLM` of the installed transformers, built from a tiny config derived from its
config class (no downloads), run through the adapter and checked against plain transformers.

    python -m moe_lst.models.hf.coverage [--families a,b,...] [--features tp2,pp2] [--local-only] [--update]

For each family: `logits` (the adapter's logits and every parameter's gradient equal the plain model's, its
balancing loss included), then, on 2 gloo processes (torch.distributed.run), `dp2_zero3` (data parallel at ZeRO-3),
`sp2` (Ulysses), `ep2` (expert parallelism, MoE families): two SGD steps whose losses and parameters equal one
process of the plain model; `tp2` (the config's tensor-parallel plan on the runtime's tensor parallelism) and `pp2`
(its pipeline plan as two stages of the runtime's pipeline, 1F1B over two micro-batches) likewise. Each result is
"pass" or the one-line reason the check refuses or fails; the sweep
writes coverage.json beside this file (read by moe_lst.models.hf.config: the families whose logits pass are the
ones the adapter builds) and docs/hf_coverage.md.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

FEATURES = ("logits", "dp2_zero3", "sp2", "ep2", "tp2", "pp2")
MULTIRANK = ("dp2_zero3", "sp2", "ep2", "tp2", "pp2")
#: Sizes of a tiny model, set on every config key (or attribute_map alias) of these names that the config has.
TINY = dict(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, initializer_range=0.05,
            moe_intermediate_size=24, shared_expert_intermediate_size=24, num_experts_per_tok=2, n_routed_experts=4,
            num_experts=4, num_local_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=2,
            topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
            sliding_window=6, attention_chunk_size=8, router_aux_loss_coef=0.1, output_router_logits=True,
            decoder_sparse_step=1, moe_layer_freq=1, num_nextn_predict_layers=0, rope_theta=10000.0, num_dense_layers=1,
            linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
            encoder_attention_heads=4, decoder_attention_heads=4, mamba_n_heads=8, mamba_d_head=8, mamba_d_state=16,
            d_head=8, d_inner=48, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
            expert_layer_offset=1, vocab_size_per_layer_input=256, hidden_size_per_layer_input=8,
            encoder_layers=2, decoder_layers=2, ffn_dim=48, dim_ff=48, dim_head=8)
#: Dropout keys zeroed (the adapter trains without dropout).
DROPOUT = ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop",
           "hidden_dropout_prob", "attention_probs_dropout_prob", "embedding_dropout", "residual_dropout",
           "ffn_dropout", "activation_dropout", "summary_first_dropout")
SEQ, BATCH, STEPS, LR = 12, 4, 2, 0.1
REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "hf_coverage.md"


def causal_lm_types() -> dict[str, str]:
    """model_type -> its *ForCausalLM class name, for every causal LM of the installed transformers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return {k: v for k, v in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()) if isinstance(v, str)}


class NoTinyConfig(NotImplementedError):
    """No tiny config of a family could be derived; the message names the key or validator that stops it (the
    sweep's cell reads `refused: no tiny config: <message>`)."""


def _read_only(cls, key: str) -> bool:
    """Whether config class `cls` derives `key` (or the attribute it aliases) from other fields: a property
    without a setter, which a tiny value must not be set on."""
    name = getattr(cls, "attribute_map", {}).get(key, key)
    attr = getattr(cls, name, None)
    return isinstance(attr, property) and attr.fset is None


def _construct(cls, values: dict[str, Any]):
    """`cls` built from `values` (a copy) with each value under the config's own key, not its attribute_map alias:
    an alias is applied after the config's own __post_init__, which may already have read the key it names (DBRX
    copies d_model into its ffn_config there, so `hidden_size=32` left its experts 2048 wide), as a config.json
    holding the key itself is read."""
    aliases = getattr(cls, "attribute_map", {})
    own = {k: v for k, v in values.items() if k not in aliases}
    own.update({aliases[k]: v for k, v in values.items() if k in aliases})  # (an alias wins, as it did when set last)
    return cls(**copy.deepcopy(own))


def _tiny_values(kind: str, layers: int = 2) -> dict[str, Any]:
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[kind]
    try:
        base = cls()
        text = base.get_text_config()
    except Exception as e:  # noqa: BLE001 - the default config itself does not give one text config
        if type(e).__name__ == "StrictDataclassClassValidationError":
            raise NoTinyConfig(_config_problem(cls, e, "its own defaults")) from e
        raise NoTinyConfig(f"{cls.__name__}() with its defaults gives no text config ({_one_line(e)})") from e
    if text is not base:
        raise NotImplementedError("a composite config (its causal LM is a sub-config of another model)")
    return _derive(cls, base, layers)


def _derive(cls, base, layers: int = 2) -> dict[str, Any]:
    """The tiny values of config class `cls` (its default instance `base`) with `layers` layers; its sub-configs (a
    vision or audio tower of the causal LM, a patcher, a depth decoder) derived the same way from their own
    classes."""
    from transformers import PreTrainedConfig

    known = set(base.to_dict()) | set(getattr(base, "attribute_map", {}))
    values = {k: v for k, v in TINY.items() if k in known}
    if "num_hidden_layers" in values:
        values["num_hidden_layers"] = layers
    values.update({k: 0.0 for k in DROPOUT if isinstance(getattr(base, k, None), float)})
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
        if isinstance(getattr(base, key, None), int):
            values[key] = {"pad_token_id": 0, "bos_token_id": 1}.get(key, 2)
    layers = values.get("num_hidden_layers", 2)
    if isinstance(getattr(base, "layer_types", None), list) and not _read_only(cls, "layer_types"):
        kinds = list(dict.fromkeys(base.layer_types))  # (each kind, cycled over the tiny layers)
        values["layer_types"] = [kinds[i % len(kinds)] for i in range(layers)]
    elif "layer_types" in base.to_dict() and getattr(base, "layer_types", None) is None:
        kinds = _kinds_left_open(cls, values)
        if kinds:
            values["layer_types"] = [kinds[i % len(kinds)] for i in range(layers)]
    if isinstance(getattr(base, "attention_types", None), list):  # ([[kinds, repeats]] spelling the layers)
        kinds = list(dict.fromkeys(k for group, _ in base.attention_types for k in group))[:layers]
        values["attention_types"] = [[kinds, layers // len(kinds)]]
    for key in ("block_types",):  # (a hybrid's pattern of kinds: each kind within the 2 layers)
        if isinstance(getattr(base, key, None), list) and not _read_only(cls, key):
            values[key] = list(dict.fromkeys(getattr(base, key)))[-layers:]
    if "attn_layer_indices" in known:  # (a hybrid with no attention layer unless told)
        values["attn_layer_indices"] = [layers - 1]
    defaults = base.to_dict()
    if defaults.get("per_layer_config"):
        values["per_layer_config"] = _tiny_layer_overrides(defaults, values, layers)
    aliases = set(getattr(base, "attribute_map", {}).values())
    if "num_heads" in known and "num_heads" not in aliases and isinstance(getattr(base, "expand", None), int):
        # (state-space heads: num_heads * head_dim spans expand * hidden_size)
        values["num_heads"] = values.get("hidden_size", 32) * base.expand // values.get("head_dim", 8)
    for key in ("mlp_only_layers",):
        if isinstance(getattr(base, key, None), list):
            values[key] = []
    values.update(_tiny_layer_counts(cls, base, values, layers))
    _tiny_layer_schedules(base, defaults, values, layers)
    for key, value in defaults.items():  # (a choice left open among listed ones: X-MOD's default_language)
        choices = defaults.get(key.removeprefix("default_") + "s")
        if key.startswith("default_") and value is None and isinstance(choices, (list, tuple)) and choices:
            values[key] = choices[0]
    values.update(_tiny_rotary_dims(base, defaults, values))
    values = {k: v for k, v in values.items() if not _read_only(cls, k)}
    for key in getattr(cls, "sub_configs", None) or {}:
        sub = _default(base, key)  # (the parent's default sub-config, of its actual class)
        if key not in known or not isinstance(sub, PreTrainedConfig):
            continue
        try:
            derived = _derive(type(sub), sub)
            _construct(cls, {**values, key: derived})
        except Exception:  # noqa: BLE001 - the parent derives this sub-config from others: its default is kept
            continue
        values[key] = derived
    values.update(_tiny_unknown_sizes(cls, base, defaults, values))
    return values


def _tiny_layer_counts(cls, base, values: dict[str, Any], layers: int) -> dict[str, int]:
    """Where the model does not build from the tiny values: each count of some of the default layers (a
    `num_*_layers` key up to num_hidden_layers that TINY does not name) scaled as the layers are, rounded down
    (Gemma 3n's num_kv_shared_layers, 15 of 35, gives 0 of 2: a key of 15 shared layers left at 15 of 2 layers
    leaves none to make the caches they share); {} where it builds, or the scaled counts do not make it build."""
    full = getattr(base, "num_hidden_layers", None)
    aliases = set(getattr(base, "attribute_map", {}).values())
    counts = {k: v * layers // full for k, v in base.to_dict().items()
              if k.startswith("num_") and k.endswith("_layers") and k not in values and k not in aliases
              and type(v) is int and type(full) is int and 0 < v <= full}
    if not counts:
        return {}
    try:
        _meta_size(_construct(cls, values))
        return {}
    except Exception:  # noqa: BLE001 - the model does not build from the tiny values: the scaled counts may be why
        pass
    try:
        _meta_size(_construct(cls, {**values, **counts}))
    except Exception:  # noqa: BLE001 - nor from the scaled counts: the tiny values stay as they are
        return {}
    return counts


def _kinds_left_open(cls, values: dict[str, Any]) -> list[str]:
    """The layer kinds of a config that leaves `layer_types` at None (none derived from other keys either) while its
    model indexes it (LFM2-MoE): the kinds its modeling module compares `layer_types[...]` with, then full
    attention; [] where the config derives its own or the module names none."""
    try:
        if _construct(cls, values).layer_types is not None:
            return []
        module = importlib.import_module(cls.__module__.replace(".configuration_", ".modeling_"))
        source = Path(module.__file__).read_text()
    except Exception:  # noqa: BLE001 - the config refuses these values or has no modeling module: nothing to add
        return []
    named = re.findall(r"layer_types\[[^\]]+\]\s*[!=]=\s*[\"'](\w+)[\"']", source)
    return list(dict.fromkeys(named + ["full_attention"])) if named else []


def _default(base, key: str) -> Any:
    """The default config's value of `key` (through its attribute_map), None where it has none or where it differs by
    layer (a heterogeneous config refuses a global value of a per-layer size)."""
    try:
        return getattr(base, key, None)
    except Exception:  # noqa: BLE001 - a per-layer attribute with no single global value
        return None


def _tiny_layer_schedules(base, defaults: dict[str, Any], values: dict[str, Any], layers: int) -> None:
    """Per-layer schedules beside `layer_types` (`mlp_layer_types`: dense or sparse, hash-routed or learned MoE): each
    kind cycled over the tiny layers as the layer kinds are; a list of layer indices that names exactly the default
    layers of one kind (Zamba 2's `hybrid_layer_ids`) names the tiny layers of that kind."""
    aliases = set(getattr(base, "attribute_map", {}).values())
    for key, value in defaults.items():
        if key.endswith("_layer_types") and key not in aliases and key not in values and isinstance(value, list) \
                and value and all(isinstance(v, str) for v in value):
            kinds = list(dict.fromkeys(value))
            values[key] = [kinds[i % len(kinds)] for i in range(layers)]
    full, tiny = getattr(base, "layer_types", None), values.get("layer_types")
    if not (isinstance(full, list) and isinstance(tiny, list)):
        return
    for key, value in defaults.items():
        if key in values or not isinstance(value, list) or not value or not all(type(v) is int for v in value):
            continue
        for kind in dict.fromkeys(full):
            if value == [i for i, t in enumerate(full) if t == kind]:
                values[key] = [i for i, t in enumerate(tiny) if t == kind]
                break


def _tiny_rotary_dims(base, defaults: dict[str, Any], values: dict[str, Any]) -> dict[str, int]:
    """A rotary width given in channels (`rotary_dim`: GPT-J, CodeGen) keeps its share of the head (64 of 256 gives 2
    of the tiny 8), an even number of at least 2 and at most the tiny head dim."""
    heads, width = _default(base, "num_attention_heads"), _default(base, "hidden_size")
    full_head = _default(base, "head_dim") or (width // heads if heads and width else None)
    tiny_head = values.get("head_dim") or values.get("hidden_size", 32) // values.get("num_attention_heads", 4)
    out = {}
    for key, value in defaults.items():
        if (key == "rotary_dim" or key.endswith("_rotary_dim")) and type(value) is int and full_head \
                and value > tiny_head:
            out[key] = min(tiny_head, max(2, 2 * round(value * tiny_head / full_head / 2)))
    return out


def _tiny_unknown_sizes(cls, base, defaults: dict[str, Any], values: dict[str, Any]) -> dict[str, int]:
    """Sizes under keys TINY does not name, shrunk by two rules that hold for every config: a key named after a TINY
    size, at its start or end, `_size` or not (`swa_head_dim`, `first_dense_intermediate_size`, `unpadded_vocab_size`,
    `encoder_hash_byte_group_vocab`) takes that size's tiny value; else
    a key whose default (16 or more) equals the default of a size the tiny config shrinks (`o_lora_rank` as
    `q_lora_rank`, `index_n_heads` as the attention heads) takes its tiny value (the smallest where several match).
    A key counts as a size where it sizes parameters (shrinking it alone shrinks the model), so scalars and windows
    that share a default with a size keep theirs; keys the config derives itself (whose value moves when the known
    sizes shrink, as DeepSeek's qk_head_dim) and token ids are left alone."""
    aliases = set(getattr(base, "attribute_map", {}).values())
    try:
        probe = _construct(cls, values)
    except Exception:  # noqa: BLE001 - the config refuses these values: nothing is known to be derived or counted
        probe = None
    try:
        derived = {k for k, v in probe.to_dict().items() if k in defaults and v != defaults[k]}
        count = _meta_size(probe)
    except Exception:  # noqa: BLE001 - or the model does not build from them
        derived, count = set(), None
    named = sorted((k for k, v in TINY.items() if type(v) is int), key=len, reverse=True)
    shrunk: dict[int, int] = {}
    for key, tiny in values.items():
        full = _default(base, key)
        if type(tiny) is int and type(full) is int and tiny < full:
            shrunk[full] = min(tiny, shrunk.get(full, tiny))
    out = {}
    for key, full in defaults.items():
        if type(full) is not int or key in values or key in aliases or key in derived or _read_only(cls, key) \
                or key.endswith(("_id", "_ids")):
            continue
        size = next((TINY[t] for t in named for word in (t, t.removesuffix("_size"))
                     if key.endswith("_" + word) or key.startswith(word + "_")),
                    shrunk.get(full) if full >= 16 else None)
        if size is None or size >= full:
            continue
        if count is not None:
            try:
                if _meta_size(_construct(cls, {**values, key: size})) >= count:
                    continue  # (not a size of the model: a window, a scale, a length)
            except Exception:  # noqa: BLE001 - the config or model refuses it shrunk alone: leave it
                continue
        out[key] = size
    if probe is None:  # (the config refuses the tiny sizes: a full-size optional key it can derive itself may be why)
        out.update(_left_to_derive(cls, defaults, {**values, **out}))
    return out


def _left_to_derive(cls, defaults: dict[str, Any], values: dict[str, Any]) -> dict[str, None]:
    """{key: None} for the first full-size key (an int of 16 or more) left at its default whose None lets the config
    accept the tiny sizes: an optional size the config derives from others when unset (Falcon-H1's mamba_d_ssm of
    1024 against the tiny mamba_expand * hidden_size); {} where none does."""
    named = {getattr(cls, "attribute_map", {}).get(k, k) for k in values}
    for key, full in defaults.items():
        if type(full) is not int or full < 16 or key in named or _read_only(cls, key):
            continue
        try:
            _construct(cls, {**values, key: None})
        except Exception:  # noqa: BLE001 - not this key (or it takes no None)
            continue
        return {key: None}
    return {}


def _tiny_layer_overrides(defaults: dict[str, Any], values: dict[str, Any], layers: int,
                          flat: bool = False) -> dict[int, dict]:
    """The tiny model's per-layer overrides (a heterogeneous config's `per_layer_config`): tiny layer i takes the
    overrides of the first default layer of its kind (of layer i where the config names no kinds), each size that the
    tiny config shrinks scaled by the same ratio (Gemma 4's 512-wide global heads against its 256-wide ones give 16
    against 8), so the tiny model keeps the family's heterogeneity without its full-size widths; `flat`: those sizes
    left out (the layer takes the tiny ones), its other overrides kept."""
    per_layer = {int(k): v for k, v in defaults["per_layer_config"].items()}
    kinds, tiny_kinds = defaults.get("layer_types"), values.get("layer_types")
    out: dict[int, dict] = {}
    for i in range(layers):
        source = i
        if isinstance(kinds, list) and isinstance(tiny_kinds, list):
            source = kinds.index(tiny_kinds[i]) if tiny_kinds[i] in kinds else -1
        layer = {}
        for key, value in per_layer.get(source, {}).items():
            full = defaults.get(key)
            if key in values and isinstance(value, int) and isinstance(full, int) and full > 0 \
                    and not isinstance(value, bool):
                if flat:
                    continue
                value = max(1, round(value * values[key] / full))
            layer[key] = value
        if layer:
            out[i] = layer
    return out


def _config_problem(cls, error: BaseException, what: str = "the derived sizes") -> str:
    """One line: why config class `cls` refuses the derived values, naming its validator or key."""
    text = str(error)
    if type(error).__name__ == "StrictDataclassClassValidationError":
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        validator = text.split("validator '", 1)[-1].split("'", 1)[0]
        detail = lines[1] if len(lines) > 1 else type(error).__name__
        return f"{cls.__name__}'s validator {validator!r} rejects {what} ({detail})"
    if isinstance(error, AttributeError) and "has no setter" in text:
        key = text.split("property '", 1)[-1].split("'", 1)[0]
        return f"{cls.__name__}.{key} is derived from other fields and has no setter"
    return f"{cls.__name__} refuses {what} ({_one_line(error)})"


def tiny_config(kind: str, **overrides):
    """A tiny config of model type `kind` (2 layers, width 32, 4 heads, 4 experts top-2 for MoE, 256 tokens),
    derived from its config class; variants are tried until the plain transformers model runs a forward. Where none
    can be derived: NoTinyConfig naming the key, validator or model class that stops it. A family none of whose
    2-layer variants runs is derived again with 4 layers, its layer kinds cycled over them (Zamba ties one shared
    transformer across its hybrid layers: a single hybrid layer leaves nothing to tie, which its model refuses); the
    2-layer reason stands where that fails too."""
    if "num_hidden_layers" in overrides:
        return _tiny_config(kind, overrides["num_hidden_layers"], overrides)
    try:
        return _tiny_config(kind, 2, overrides)
    except NotImplementedError as first:
        try:
            return _tiny_config(kind, 4, overrides)
        except NotImplementedError:
            raise first from None


def _tiny_config(kind: str, layers: int, overrides: dict[str, Any]):
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[kind]
    values = {**_tiny_values(kind, layers), **overrides}
    defaults = cls().to_dict()
    scaled = defaults.get("per_layer_config") and "per_layer_config" not in overrides
    error: Exception | None = None
    problem = None
    too_big = 0
    for attempt in _variants(values):
        flat = attempt.pop(_FLAT, False)
        if scaled:  # (the per-layer overrides scaled from this variant's own sizes)
            attempt["per_layer_config"] = _tiny_layer_overrides(defaults, attempt,
                                                                attempt.get("num_hidden_layers", 2), flat)
        try:
            config = _construct(cls, attempt)
        except Exception as e:  # noqa: BLE001 - a variant the config's own checks refuse: try the next one
            problem = problem or _config_problem(cls, e)
            continue
        try:
            config, size = _built(cls, config, attempt)
        except Exception as e:  # noqa: BLE001 - a variant the model class does not build from: try the next one
            problem = problem or (f"{cls.__name__}'s model does not build from the derived sizes ({_one_line(e)}"
                                  f"{_where(e)})")
            continue
        if size > MAX_PARAMS:  # (a variant that restores a full-size default: the next one may not)
            too_big = max(too_big, size)
            continue
        try:
            _plain(config)(input_ids=torch.randint(3, 200, (1, 8)))
            return config
        except Exception as e:  # noqa: BLE001 - any failure of the plain model means: try the next variant
            error = e
    if error is None and too_big:
        raise NotImplementedError(f"the derived config still has {too_big / 1e6:.1f}M parameters (sizes under keys "
                                  "the sweep does not know)")
    if error is None:
        raise NoTinyConfig(problem)
    raise NoTinyConfig(f"no variant runs in plain transformers ({_one_line(error)}{_where(error)})")


def _built(cls, config, values: dict[str, Any]):
    """(config, its parameter count), as long as the model asks for more: a model that reads a key its sub-config's
    class does not declare (DBRX's attention reads attn_config.rope_theta, which its checkpoints carry as an extra
    key) gets the parent config's value of that key (its own, or in its rope_parameters) in that sub-config; one that
    reads rotary parameters per layer kind from a config that leaves them empty (Cohere Compass) gets the default
    rotary embedding for each kind."""
    for _ in range(4):
        try:
            return config, _meta_size(config)
        except KeyError as e:
            rope, kinds = getattr(config, "rope_parameters", None), getattr(config, "layer_types", None) or []
            if not (isinstance(rope, dict) and e.args and e.args[0] in kinds and e.args[0] not in rope):
                raise
            values["rope_parameters"] = {**rope, **{k: {"rope_type": "default", "rope_theta": TINY["rope_theta"]}
                                                    for k in kinds if k not in rope}}
            config = _construct(cls, values)
        except AttributeError as e:
            found = re.fullmatch(r"'(\w+)' object has no attribute '(\w+)'", str(e))
            subs = {k: getattr(config, k, None) for k in getattr(cls, "sub_configs", None) or {}}
            key = next((k for k, v in subs.items() if found and type(v).__name__ == found[1]), None)
            rope = getattr(config, "rope_parameters", None)
            value = getattr(config, found[2], None) if found else None
            if value is None and found and isinstance(rope, dict):
                value = rope.get(found[2])
            if key is None or value is None:
                raise
            sub = values.get(key)
            values[key] = {**(sub if isinstance(sub, dict) else subs[key].to_dict()), found[2]: value}
            config = _construct(cls, values)
    return config, _meta_size(config)


def _where(error: BaseException) -> str:
    """Where in transformers' modeling code `error` was raised (`, in Class.method: the statement`), or ""."""
    import traceback

    frames = [(f, t) for f, t in zip(traceback.extract_tb(error.__traceback__), traceback.walk_tb(error.__traceback__))
              if "/transformers/models/" in f.filename]
    if not frames:
        return ""
    frame, (code, _) = frames[-1]
    owner = code.f_locals.get("self")
    where = f"{type(owner).__name__}.{frame.name}" if owner is not None else f"{Path(frame.filename).stem}.{frame.name}"
    return f", in {where}: `{(frame.line or '').strip()}`"


#: A variant's marker (not a config key): its per-layer overrides keep the tiny sizes (_tiny_layer_overrides flat).
_FLAT = "__flat_per_layer_sizes__"


def _variants(values: dict[str, Any]) -> list[dict[str, Any]]:
    """The derived values, then each relaxation alone, then every combination of them (in that order, so a family
    that runs with one keeps the config it had): as many key-value heads as query heads, no head_dim (the config
    derives it), head_dim 16, no cache (a hybrid whose 2 layers hold no attention gives none), per-layer overrides
    that keep the tiny sizes (a heterogeneous layer whose scaled sizes break the config's own rules, as a head
    width that must equal the sum of its rotary and plain parts), top-1 routing (a config that routes each token to
    one expert only: ZAYA)."""
    relaxations = [("num_key_value_heads", values.get("num_attention_heads", 4)), ("head_dim", None),
                   ("head_dim", 16), ("use_cache", False), (_FLAT, True), ("num_experts_per_tok", 1)]
    if "head_dim" not in values:
        relaxations = [r for r in relaxations if r[0] != "head_dim"]
    if "per_layer_config" not in values:
        relaxations = [r for r in relaxations if r[0] != _FLAT]
    if values.get("num_experts_per_tok", 1) == 1:
        relaxations = [r for r in relaxations if r[0] != "num_experts_per_tok"]
    out = []
    for n in range(len(relaxations) + 1):
        for combo in itertools.combinations(relaxations, n):
            keys = [key for key, _ in combo]
            if len(set(keys)) < len(keys):
                continue
            attempt = dict(values)
            for key, value in combo:
                if value is None:
                    attempt.pop(key, None)
                else:
                    attempt[key] = value
            out.append(attempt)
    return out


MAX_PARAMS = 2_000_000


def _meta_size(config) -> int:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    return sum(p.numel() for p in model.parameters())


def _plain(config, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32)


def _one_line(error: BaseException | None, prefix: str | None = None) -> str:
    """The error's first line, `Type: message` (or `prefix` + message), at most 160 characters."""
    if error is None:
        return "unknown"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    head = f"{type(error).__name__}: " if prefix is None else prefix
    text = f"{head}{lines[0]}" if lines else head + type(error).__name__
    limit = 160 if prefix is None else 240  # (a refusal keeps room for the key or validator it names)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s tokens and targets: random ids past the special ones, and in each batch the first id of the
    second half of the vocabulary (the first row a second tensor-parallel rank holds: a row its split misplaces,
    e.g. a padding row counted from its own first, shows)."""
    tokens = torch.randint(3, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))
    tokens[0, 0] = TINY["vocab_size"] // 2
    return tokens[:, :-1], tokens[:, 1:]


def _plain_loss(model, x: torch.Tensor, y: torch.Tensor, value_only_ce: bool = False,
                record: dict[str, Any] | None = None) -> torch.Tensor:
    """Cross-entropy of the plain model, plus its aux loss where it computes one, scaled as its own forward scales it
    (moe_lst.models.hf.balance.balancing_coefficient; its value left out with `value_only_ce`: the gradient joins,
    the recorded loss is the cross-entropy); `record` gets the forward's aux_loss."""
    out = model(input_ids=x)
    loss = F.cross_entropy(out.logits.flatten(0, 1), y.flatten())
    aux = getattr(out, "aux_loss", None)
    if record is not None:
        record["aux_loss"] = aux
    if aux is not None:
        from moe_lst.models.hf.balance import balancing_coefficient

        term = balancing_coefficient(model) * aux
        loss = loss + (term - term.detach() if value_only_ce else term)
    return loss


def untrained_balancing_loss(causal_lm, ours, aux_loss: torch.Tensor | None) -> str | None:
    """Why the adapter `ours` does not train the balancing loss that plain `causal_lm`'s forward adds to its loss
    (one line), or None: it trains it, or the model adds none (its forward gave no `aux_loss`, or a zero
    coefficient)."""
    from moe_lst.models.hf.balance import balancing_coefficient

    if aux_loss is None:
        return None
    coef = balancing_coefficient(causal_lm)
    if not coef or ours.balance is not None:
        return None
    return (f"{type(causal_lm).__name__} trains no balancing loss here: the adapter found no router_logits it "
            "records (moe_lst.models.hf.balance.records_router_logits)")


def check_logits(config) -> None:
    """The adapter's logits, loss (balancing loss included) and every gradient equal the plain model's."""
    from moe_lst.models.hf.model import HFCausalLM

    ref = _plain(config)
    with torch.no_grad():  # non-trivial norm gains, biases and sinks, so a misplaced one shows
        for name, p in ref.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    ours = HFCausalLM(copy.deepcopy(ref))
    x, y = _batch(0)
    seen: dict[str, Any] = {}
    want = _plain_loss(ref, x, y, record=seen)
    problem = untrained_balancing_loss(ref, ours, seen["aux_loss"])
    if problem:
        raise NotImplementedError(problem)
    want.backward()
    logits = ours(x)
    got = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    got.backward()
    with torch.no_grad():
        plain_logits = ref(input_ids=x).logits
    torch.testing.assert_close(logits, plain_logits, rtol=1e-4, atol=1e-5, msg=lambda m: f"logits: {m}")
    grads = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        g = grads[name].grad
        if g is None and p.grad is None:
            continue
        if g is None or p.grad is None:
            raise AssertionError(f"gradient of {name}: {'none' if p.grad is None else 'some'} here, "
                                 f"{'none' if g is None else 'some'} in transformers")
        scale = float(g.abs().max()) or 1.0
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-5 * scale, msg=lambda m, n=name: f"grad {n}: {m}")


# ------------------------------------------------------------------------------------------ the ranks
def rank_run(config_dict: dict, layout: str) -> dict:
    """One rank's two SGD steps of `layout`: (global) losses and this rank's parameters after them."""
    import torch.distributed as dist
    from moe_lst.models.hf.model import build
    from transformers import CONFIG_MAPPING

    import zero
    from moe import apply_expert_parallel
    from sequence_parallel import apply_ulysses, shard_sequence, sp_loss

    config = CONFIG_MAPPING[config_dict["model_type"]].from_dict(config_dict)
    from moe_lst.models.hf.config import is_moe

    moe = is_moe(config)
    from zero.parallel.pipeline import apply_pipeline
    from zero.parallel.tensor import apply_tensor_parallel, vocab_parallel_cross_entropy

    dims = {"dp2_zero3": zero.ParallelDims(dp=2), "sp2": zero.ParallelDims(dp=1, sp=2),
            "ep2": zero.ParallelDims(dp=2, ep=2), "tp2": zero.ParallelDims(dp=1, tp=2),
            "pp2": zero.ParallelDims(dp=1, pp=2)}[layout]
    torch.manual_seed(0)
    model = build(config, meta=layout == "dp2_zero3" and not moe, sp_group=dims.sp_group)
    plans = [model.loss_plan()] + ([apply_expert_parallel(model, dims)] if moe else [])
    tp_plan = apply_tensor_parallel(model, dims.tp_group)
    plans.append(tp_plan)
    apply_ulysses(model, dims.sp_group)
    pipe = None
    if dims.pp > 1:  # (the batch's two halves as the micro-batches, as the reference's two parts)
        pipe = apply_pipeline(model, dims, "1f1b", microbatches=2,
                              loss_fn=lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()))
        plans.append(pipe)
    engine = zero.initialize(pipe.module if pipe else model, lambda params: torch.optim.SGD(params, lr=LR),
                             zero.ZeroConfig(stage=3 if layout == "dp2_zero3" else 0,
                                             grad_accum_steps=2 if pipe else 1), dims, plans=plans)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        if pipe is not None:
            losses.append(pipe.train_step(engine, x, y, position_ids=torch.arange(SEQ).expand(BATCH, SEQ)))
            engine.step()
            continue
        if dims.dp > 1:
            rows = slice(dims.dp_rank * BATCH // 2, (dims.dp_rank + 1) * BATCH // 2)
            x, y = x[rows], y[rows]
        x, y, positions = shard_sequence(x, y, dims.sp_group)
        loss_sum, _ = vocab_parallel_cross_entropy(engine(x, positions).flatten(0, 1), y.flatten(), dims.tp_group)
        loss = sp_loss(loss_sum, y.numel(), dims.sp_group)
        engine.backward(loss)
        engine.step()
        value = loss.detach().clone()
        dist.all_reduce(value, group=dims.dp_group)  # (every rank of the group holds its rows' mean or the same)
        losses.append(value.item() / dist.get_world_size(dims.dp_group))
    state = tp_plan.full_state_dict({k: v.clone() for k, v in engine.full_state_dict().items()})
    ranges = {name: list(block.experts.expert_range) for name, block in
              ((n, model.get_submodule(n)) for n in model.moe_blocks)}
    return {"losses": losses, "state": state, "expert_ranges": ranges}


def reference_run(config, layout: str) -> dict:
    """One process of the plain transformers model with the adapter's initial weights: the global batch as the dp
    ranks' two micro-batches (a balancing loss is per micro-batch, as on each dp rank), or whole (sp)."""
    from moe_lst.models.hf.model import build

    torch.manual_seed(0)
    initial = build(config).state_dict()
    model = _plain(config)
    model.load_state_dict(initial, strict=False)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    whole = layout in ("sp2", "tp2")  # (Ulysses and tensor-parallel ranks see the whole batch; pp its halves)
    parts = (slice(0, BATCH),) if whole else (slice(0, BATCH // 2), slice(BATCH // 2, BATCH))
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        total = 0.0
        for rows in parts:
            loss = _plain_loss(model, x[rows], y[rows], value_only_ce=True) / len(parts)
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def compare(ranks: list[dict], reference: dict) -> None:
    """Every rank's losses and parameters (expert slices against theirs) equal the reference's."""
    want = reference["state"]
    for rank, result in enumerate(ranks):
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=1e-5,
                                   atol=1e-6, msg=lambda m, r=rank: f"rank {r} losses: {m}")
        for name, value in result["state"].items():
            if name not in want:
                continue
            ref = want[name]
            block = next((b for b in result["expert_ranges"] if name.startswith(b + ".experts.")), None)
            # (a tensor of the experts module that is not sharded, whole on every rank, is compared whole)
            if block is not None and value.numel() != ref.numel():
                start, stop = result["expert_ranges"][block]
                ref = ref[start:stop]
            scale = float(ref.abs().max()) or 1.0  # (a floor for tensors that stay near 0, e.g. key biases)
            torch.testing.assert_close(value.reshape(ref.shape), ref, rtol=1e-4, atol=1e-5 * scale + 1e-7,
                                       msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}")


def multirank_applies(config, layout: str) -> str | None:
    """None where `layout` applies to the family, else why not (one line)."""
    from moe_lst.models.hf.config import is_moe

    if layout == "ep2" and not is_moe(config):
        return "n/a (dense)"
    if layout == "sp2" and config.num_attention_heads % 2:
        return f"n/a ({config.num_attention_heads} heads do not split over 2 ranks)"
    if layout in ("tp2", "pp2"):
        from moe_lst.models.hf.model import build

        from zero.contract import ContractError

        try:
            model = build(config, meta=not is_moe(config))
        except Exception as e:  # noqa: BLE001 - a model the check cannot build fails the check with its reason
            return _one_line(e)
        try:
            if layout == "tp2":
                model.tensor_parallel_styles(2)
            else:
                model.pipeline_stage(range(0), True, False)
                problem = _staged_forward_problem(config)
                if problem:
                    return problem
        except ContractError as e:
            return f"refused: {str(e).split(', but ', 1)[-1]}"  # (what the runtime does not map)
        return None
    if layout == "sp2":
        from moe_lst.models.hf.structure import blocks_outside_attention, positions_from_length
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            causal_lm = AutoModelForCausalLM.from_config(copy.deepcopy(config))
        outside = blocks_outside_attention(causal_lm)
        if outside:
            return (f"n/a (refused: {outside[0]} mixes tokens outside AttentionInterface, so Ulysses shards do not "
                    "reach it)")
        numbering = positions_from_length(causal_lm)
        if numbering:
            return f"n/a (refused: {numbering} takes no position_ids, so Ulysses shards would get positions from 0)"
    return None


def _staged_forward_problem(config) -> str | None:
    """None where two pipeline stages chained in this process give the model's logits, else why not (one line):
    a stage that fails on one rank only would leave the other waiting for its activations."""
    from moe_lst.models.hf.model import build

    torch.manual_seed(0)
    model = build(config)
    n = len(model.blocks())
    x, _ = _batch(0)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    try:
        with torch.no_grad():
            first, last = model.pipeline_stage(range(0, n // 2), True, False), model.pipeline_stage(
                range(n // 2, n), False, True)
            got, want = last(first(x, positions), positions), model(x)
    except Exception as e:  # noqa: BLE001 - the stages' own failure is the family's reason
        return _one_line(e)
    if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
        return f"refused: its stages chained give other logits (max difference {(got - want).abs().max():.3g})"
    return None


# --------------------------------------------------------------------------------------- the sweep
FAMILY_SECONDS = 180


def _too_slow(signum, frame):
    raise TimeoutError(f"the tiny model took over {FAMILY_SECONDS} s")


def local_sweep(families: list[str]) -> dict[str, dict[str, Any]]:
    """The one-process checks of each family: its tiny config and `logits`; the rest marked for the ranks."""
    from moe_lst.models.hf.config import is_moe

    out: dict[str, dict[str, Any]] = {}
    for kind in families:
        record: dict[str, Any] = {"moe": False, "features": {}, "config": None}
        signal.signal(signal.SIGALRM, _too_slow)
        signal.alarm(FAMILY_SECONDS)
        try:
            config = tiny_config(kind)
            record["moe"] = is_moe(config)
            record["config"] = config.to_dict()
            check_logits(config)
            record["features"]["logits"] = "pass"
        except NoTinyConfig as e:
            record["features"]["logits"] = _one_line(e, prefix="refused: no tiny config: ")
        except Exception as e:  # noqa: BLE001 - the table records any failure as the family's reason
            record["features"]["logits"] = _one_line(e)
        finally:
            signal.alarm(0)
        out[kind] = record
        print(f"{kind}: logits {record['features']['logits']}", flush=True)
    return out


def _ranks_main(spec_file: str) -> None:
    """Under torch.distributed.run: every listed (family, layout) on this rank; results to spec_file.rank<r>."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    jobs = json.loads(Path(spec_file).read_text())
    results = {}
    for kind, layout, config_dict in jobs:
        try:
            results[f"{kind}/{layout}"] = {"ok": rank_run(config_dict, layout)}
        except Exception as e:  # noqa: BLE001 - recorded as the family's reason (the other rank fails too)
            results[f"{kind}/{layout}"] = {"error": _one_line(e)}
        dist.barrier()
    torch.save(results, f"{spec_file}.rank{rank}")
    dist.destroy_process_group()


def multirank_sweep(records: dict[str, dict[str, Any]], timeout: float = 3600,
                    layouts: tuple[str, ...] = MULTIRANK) -> None:
    """The 2-process checks (`layouts`) of every family whose logits pass, in one torchrun of 2 ranks; results
    into records."""
    from transformers import CONFIG_MAPPING

    jobs = []
    for kind, record in records.items():
        for layout in layouts:
            if record["features"].get("logits") != "pass":
                record["features"][layout] = "n/a (logits fail)"
                continue
            config = CONFIG_MAPPING[kind].from_dict(record["config"])
            why = multirank_applies(config, layout)
            if why:
                record["features"][layout] = why
            else:
                jobs.append((kind, layout, record["config"]))
    if not jobs:
        return
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "jobs.json"
        spec.write_text(json.dumps(jobs, default=str))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                              "--standalone",
                              "-m", "moe_lst.models.hf.coverage", "--ranks", str(spec)], env=env, timeout=timeout,
                             capture_output=True, text=True)
        if run.returncode:
            raise RuntimeError(f"the 2-rank sweep failed: {run.stderr[-2000:]}")
        per_rank = [torch.load(f"{spec}.rank{r}", weights_only=False) for r in range(2)]
    for kind, layout, _ in jobs:
        key = f"{kind}/{layout}"
        config = CONFIG_MAPPING[kind].from_dict(records[kind]["config"])
        errors = [r[key]["error"] for r in per_rank if "error" in r[key]]
        if errors:
            records[kind]["features"][layout] = errors[0]
            continue
        try:
            compare([r[key]["ok"] for r in per_rank], reference_run(config, layout))
            records[kind]["features"][layout] = "pass"
        except AssertionError as e:
            records[kind]["features"][layout] = _one_line(e)


def finish(records: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    for record in records.values():
        record["features"] = {f: record["features"].get(f, "not run") for f in FEATURES}
    return records


#: The checks a family must pass (or that do not apply to it) to count as covered; tp2 and pp2 are counted apart.
CORE = ("logits", "dp2_zero3", "sp2", "ep2")


def passes(record: dict[str, Any]) -> bool:
    """Whether a family passes every core check that applies to it (CORE; tensor and pipeline parallelism apart)."""
    return all(v == "pass" or v.startswith("n/a (") and "logits fail" not in v
               for f, v in record["features"].items() if f in CORE)


#: A tp2 / pp2 cell that means the check does not apply: the config declares no plan for it.
NO_PLAN = "refused: there is no plan to map"


def passes_every_check(record: dict[str, Any]) -> bool:
    """Whether a family passes every check that applies to it, tensor and pipeline parallelism included (they apply
    where the config declares its base_model_tp_plan / base_model_pp_plan)."""
    return passes(record) and all(record["features"][f] in ("pass", NO_PLAN) for f in ("tp2", "pp2"))


def render(records: dict[str, dict[str, Any]]) -> str:
    """docs/hf_coverage.md: family x feature, pass or the one-line reason."""
    good = [k for k, r in records.items() if passes(r)]
    moe = [k for k in good if records[k]["moe"]]
    tp = [k for k in good if records[k]["features"]["tp2"] == "pass"]
    pp = [k for k in good if records[k]["features"]["pp2"] == "pass"]
    lines = ["# Hugging Face causal LMs under the runtime", "",
             "Generated by `python -m moe_lst.models.hf.coverage` from the installed transformers (every "
             "`*ForCausalLM`, a tiny config derived from its config class); `tests/hf/test_coverage.py` keeps it "
             "current. `logits`: the adapter's logits and gradients equal plain transformers'; `dp2_zero3`, `sp2`, "
             "`ep2`: two SGD steps on 2 processes (data parallel at ZeRO-3, Ulysses, expert parallel) equal one "
             "process of the plain model. A cell is `pass` or the one-line reason the check refuses or fails.", "",
             f"{len(good)} of {len(records)} families pass every check of logits, dp2_zero3, sp2 and ep2 that "
             f"applies to them ({len(moe)} of them MoE). `tp2`: the config's `base_model_tp_plan` mapped onto the "
             "runtime's tensor parallelism (sequence-parallel norms, vocabulary-parallel embedding and logits, a "
             "tied head on the embedding's slice, unsplit layer children replicated on the gathered sequence), two "
             f"steps on 2 processes equal to one: {len(tp)} of those families pass, the others are refused in one "
             "line (no plan, a structure the mapping does not cover). `pp2`: the config's "
             "`base_model_pp_plan` as two stages of the runtime's pipeline (1F1B, two micro-batches), two steps on 2 "
             f"processes equal to one (a balancing loss included: each stage sends its per-expert sums on with its "
             f"activation): {len(pp)} of those families pass, the others are refused in one line (no plan, "
             "arguments its layers get that a stage does not give, modules outside the plan).", "",
             f"**{sum(passes_every_check(r) for r in records.values())} families pass every check that applies to "
             "them, tp2 and pp2 included** (they apply where the config declares its tensor- or pipeline-parallel "
             "plan).", "",
             "| family | MoE | " + " | ".join(FEATURES) + " |", "|" + "---|" * (len(FEATURES) + 2)]
    for kind, record in records.items():
        cells = [record["features"][f].replace("|", "/") for f in FEATURES]
        lines.append(f"| {kind} | {'yes' if record['moe'] else ''} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write(records: dict[str, dict[str, Any]]) -> None:
    from moe_lst.models.hf.config import COVERAGE_FILE

    slim = {k: {"moe": r["moe"], "features": r["features"]} for k, r in records.items()}
    COVERAGE_FILE.write_text(json.dumps({"families": slim}, indent=1, sort_keys=True) + "\n")
    DOC.write_text(render(records))


def update(records: dict[str, dict[str, Any]], features: tuple[str, ...]) -> None:
    """Merge `features` of `records` into the recorded table and rewrite it and its page (under a lock: sweeps of
    other families may update it at the same time)."""
    import fcntl

    from moe_lst.models.hf.config import COVERAGE_FILE

    with open(COVERAGE_FILE) as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        merged = json.loads(COVERAGE_FILE.read_text())["families"]
        for kind, record in records.items():
            row = merged.setdefault(kind, {"moe": record["moe"], "features": {}})
            row["moe"] = record["moe"]
            row["features"].update({f: record["features"][f] for f in features})
        write(merged)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", help="comma-separated model types (default: every causal LM)")
    parser.add_argument("--local-only", action="store_true", help="only the one-process logits check")
    parser.add_argument("--features", help=f"comma-separated multi-rank checks (default: {','.join(MULTIRANK)})")
    parser.add_argument("--update", action="store_true",
                        help="merge these families' results (the checks run) into the recorded table and its page")
    parser.add_argument("--ranks", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    layouts = tuple(args.features.split(",")) if args.features else MULTIRANK
    if set(layouts) - set(MULTIRANK):
        parser.error(f"--features {args.features}: the multi-rank checks are {', '.join(MULTIRANK)}")
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    if args.ranks:
        _ranks_main(args.ranks)
        return
    families = args.families.split(",") if args.families else list(causal_lm_types())
    records = local_sweep(families)
    if not args.local_only:
        multirank_sweep(records, layouts=layouts)
    finish(records)
    if not args.families:
        write(records)
    elif args.update:
        update(records, ("logits",) + (() if args.local_only else layouts))
    good = [k for k, r in records.items() if passes(r)]
    print(f"{len(good)} of {len(records)} families pass: {', '.join(good)}")


if __name__ == "__main__":
    main()
