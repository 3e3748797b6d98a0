"""A Hugging Face transformers causal LM as a registered model family (moe_lst.models.spec), selected with
`model=hf` (conf/model/hf.yaml, whose `model.hf` block names this family: moe_lst.models.spec.BUILTIN_BLOCKS): its
config.json with typed overrides, its rules against a run's layout, weights from and to model directories, and its
export through transformers' own save_pretrained."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from moe_lst.kernels.sparse import SparseConfig
from moe_lst.models.spec import ConfigError, ExportError, FamilySpec, check_tiled_mlp, positive_int, register
from omegaconf import DictConfig, OmegaConf
from torch import nn

import zero

#: The transformers config.json of a run, written into its run_dir (export writes it out again).
HF_CONFIG_FILE = "hf_config.json"


def hf_model_config(cfg: Any):
    """The transformers config of a model=hf run: model.hf.config (else train.init_from's) with model.hf.overrides,
    checked (moe_lst.models.hf.load_config); ConfigError in one line."""
    from moe_lst.models.hf import HFConfigError, load_config

    source = cfg.model.hf.config or cfg.train.init_from
    if source is None:
        raise ConfigError("model=hf needs model.hf.config=<a config.json or a model directory> (or train.init_from="
                          "<a Hugging Face model directory>, whose config it then takes)")
    key = "model.hf.config" if cfg.model.hf.config else "train.init_from"
    overrides = cfg.model.hf.overrides
    if overrides is not None and not isinstance(overrides, DictConfig):
        raise ConfigError(f"model.hf.overrides={overrides!r} must be a mapping of config.json keys to values, e.g. "
                          "model.hf.overrides='{hidden_size: 64, num_hidden_layers: 2}'")
    try:
        return load_config(source, None if overrides is None else OmegaConf.to_container(overrides, resolve=True))
    except HFConfigError as e:
        raise ConfigError(f"{key}={source}: {e}") from None


def check_attention(cfg: Any) -> None:
    """model.attention of a model=hf run: dense or sparse, with model.sparse keys only for sparse."""
    m = cfg.model
    if m.attention not in ("dense", "sparse"):
        raise ConfigError(f"model.attention={m.attention!r} with model=hf must be dense or sparse (nsa needs the "
                          "project's Llama: its gates and compressors are parameters a Hugging Face model lacks)")
    sparse = SparseConfig(**OmegaConf.to_container(m.sparse, resolve=True))
    changed = [f.name for f in fields(sparse) if getattr(sparse, f.name) != getattr(SparseConfig(), f.name)]
    if changed and m.attention != "sparse":
        raise ConfigError(f"model.sparse.{changed[0]} is set but model.attention={m.attention}; it applies only with "
                          "model.attention=sparse: set that, or drop the key")
    if m.attention == "sparse":
        unused = sparse.unused_fields()
        if unused:
            raise ConfigError(f"model.sparse.{unused[0]} has no effect with model.sparse.layout={sparse.layout}; drop "
                              "the key or choose a layout that reads it")
        try:
            sparse.check_sequence(cfg.train.seq_len)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def _stages_per_rank(par: Any) -> int:
    """The pipeline stages each rank holds under the run's schedule (1 where the schedule is unknown: the recipe's
    own pipeline check names that)."""
    from zero.dist.topology import LayoutError
    from zero.parallel.pipeline import resolve_virtual_stages

    try:
        return resolve_virtual_stages(par.pp_schedule, par.pp_virtual_stages)
    except LayoutError:
        return 1


#: Config keys that bound a model's positions, in the order read (the first one the config has as an int).
POSITION_LIMIT_KEYS = ("max_position_embeddings", "max_target_positions", "n_positions", "max_sequence_length")


class HFSpec(FamilySpec):
    """Any causal LM of a model type the adapter covers (moe_lst.models.hf): data, sequence (Ulysses) and expert
    parallelism; tensor and pipeline parallelism where the adapter maps the config's plans (check_layout)."""

    # (its model section is typed: recipes.config.HFModelConfig, stored for conf/model/hf.yaml; the recipe's schema
    # keeps it so that a Llama run never imports this family, whose package imports transformers' model classes)

    def model_config(self, cfg: Any):
        return hf_model_config(cfg)

    def check_model(self, cfg: Any) -> None:
        """A config the adapter covers, its attention options, the sequence against its positions and window,
        MoE needs, and what its runtime does not offer."""
        from moe_lst.models.hf import dense_mlp_layers, is_moe, moe_supported, sliding_window

        config = hf_model_config(cfg)
        check_attention(cfg)
        seq_len, fix = cfg.train.seq_len, "lower train.seq_len or set model.hf.overrides.{key}"
        # (the key its positions are bounded by: decoders of encoder-decoder families name it otherwise; a model with
        # none, e.g. recurrent layers beside local attention, has no bound)
        key = next((k for k in POSITION_LIMIT_KEYS if isinstance(getattr(config, k, None), int)), None)
        if key is not None and seq_len > getattr(config, key):
            raise ConfigError(f"train.seq_len={seq_len} does not fit the model: its {key}={getattr(config, key)}; "
                              f"{fix.format(key=key)}")
        window = sliding_window(config)
        if window is not None and window < seq_len:
            raise ConfigError(f"train.seq_len={seq_len} is longer than the model's sliding_window={window}: the "
                              f"Hugging Face adapter's attention is full causal attention; "
                              f"{fix.format(key='sliding_window')}")
        if is_moe(config) and not moe_supported():
            raise ConfigError(f"model_type={config.model_type} has sparse-MoE blocks and moe_lst.models.hf.moe "
                              "(adopt_moe_blocks, which swaps them for this project's MoE) is not available")
        if cfg.parallel.ep > 1 and not is_moe(config):
            raise ConfigError(f"parallel.ep={cfg.parallel.ep} needs an MoE model (model_type {config.model_type} is "
                              "dense)")
        check_tiled_mlp(cfg, len(dense_mlp_layers(config)), f"model_type {config.model_type}")
        if cfg.train.get("tiled_loss", False):
            problem = _head_problem(config.to_json_string())
            if problem:
                raise ConfigError(f"train.tiled_loss with model=hf computes logits from the last hidden states with "
                                  f"the head alone, but model_type {config.model_type}: {problem}; set "
                                  "train.tiled_loss=false")
        if positive_int(cfg, "train.crop_check_tokens", minimum=0):
            raise ConfigError("train.crop_check_tokens needs the project's Llama with sliding-window sparse "
                              "attention; set it to 0 with model=hf")

    def check_layout(self, cfg: Any) -> None:
        """Tensor and pipeline parallelism where the adapter maps the config's plans (moe_lst.models.hf.model.
        layout_problem: the sweep passed them for its type, and its sizes split), Ulysses over at most the model's
        query heads, and position-independent rotary tables under it."""
        from moe_lst.models.hf.config import LENGTH_DEPENDENT_ROPE, rope_type
        from moe_lst.models.hf.model import layout_problem
        from moe_lst.models.spec import PARALLEL_KEYS

        from sequence_parallel.ulysses import check_ulysses_heads

        par, config = cfg.parallel, hf_model_config(cfg)
        for key in ("tp", "pp"):
            problem = layout_problem(config, key, par[key]) if par[key] > 1 else None
            if problem:
                raise ConfigError(f"parallel.{key}={par[key]} with model=hf is refused: {problem}; use parallel."
                                  f"{key}=1 (data, sequence and expert parallelism)")
        if par.pp > 1 and _stages_per_rank(par) > 1:
            raise ConfigError(f"parallel.pp_schedule={par.pp_schedule} places several stages on a rank, which model=hf "
                              "does not offer (each stage holds its own part of the base model); use parallel."
                              "pp_schedule=1f1b or gpipe")
        check_ulysses_heads(config.num_attention_heads, par.sp, par.tp, keys=PARALLEL_KEYS)
        cp, packed = par.get("cp", 1), cfg.data.get("packing", "concat") == "document"
        if par.sp > 1 or cp > 1 or packed:
            outside, numbering, sinks, ring_refused, temperature = _sequence_structure(config.to_json_string())
            what = (f"parallel.sp={par.sp}" if par.sp > 1 else f"parallel.cp={cp}" if cp > 1
                    else "data.packing=document")
            if outside:
                raise ConfigError(f"{what} with model=hf is refused: its layer {outside} mixes tokens outside "
                                  "transformers' AttentionInterface, so sequence shards and packed documents do not "
                                  "reach it; train it with parallel.sp=1, parallel.cp=1 and data.packing=concat")
            if numbering:
                raise ConfigError(f"{what} with model=hf is refused: {numbering} takes no position_ids (it numbers "
                                  "the positions of the sequence it is given from 0), so sequence shards and packed "
                                  "documents would get other positions; train it with parallel.sp=1, parallel.cp=1 "
                                  "and data.packing=concat")
            if cp > 1 and sinks:
                raise ConfigError(f"parallel.cp={cp} with model=hf is refused: {sinks} has attention sinks (a sink "
                                  "logit per head joins every query's softmax), which ring attention does not run; "
                                  "use parallel.sp for this model")
            if cp > 1 and ring_refused:
                raise ConfigError(f"parallel.cp={cp} with model=hf is refused: {ring_refused}, which ring attention "
                                  "does not compute; use parallel.sp for this model")
            seq_len = cfg.train.seq_len
            if temperature is not None and (par.sp > 1 or packed) and seq_len >= temperature[1]:
                what = f"parallel.sp={par.sp}" if par.sp > 1 else "data.packing=document"
                raise ConfigError(f"{what} with model=hf is refused at train.seq_len={seq_len}: {temperature[0]} "
                                  "scales its queries by positions it numbers from 0 over the tokens it is given "
                                  f"(attention temperature tuning, floor_scale={temperature[1]}), so sequence shards "
                                  "and packed documents would get other scales; use a train.seq_len below floor_scale "
                                  "or set model.hf.overrides.attn_temperature_tuning=false")
        if cfg.model.attention == "sparse":
            dense_only = _sequence_structure(config.to_json_string())[3]
            if dense_only:
                raise ConfigError(f"model.attention=sparse with model=hf is refused: {dense_only}, which only the "
                                  "dense attention computes; use model.attention=dense for this model")
        if par.sp > 1 and rope_type(config) in LENGTH_DEPENDENT_ROPE:
            raise ConfigError(f"rope_type={rope_type(config)} scales its tables by the longest position a forward "
                              f"sees, which differs per rank under parallel.sp={par.sp}; use parallel.sp=1 or "
                              "another rope type")

    def num_layers(self, cfg: Any) -> int:
        return hf_model_config(cfg).num_hidden_layers

    def vocab_size(self, cfg: Any) -> int:
        return hf_model_config(cfg).vocab_size

    def is_moe(self, cfg: Any) -> bool:
        from moe_lst.models.hf import is_moe

        return is_moe(hf_model_config(cfg))

    def num_experts(self, cfg: Any) -> int:
        from moe_lst.models.hf import num_experts

        return num_experts(hf_model_config(cfg))

    def moe_layers(self, cfg: Any) -> list[int]:
        from moe_lst.models.hf import dense_mlp_layers

        config = hf_model_config(cfg)
        dense = set(dense_mlp_layers(config))
        return [i for i in range(config.num_hidden_layers) if i not in dense]

    def num_params(self, cfg: Any) -> int:
        from moe_lst.models.hf import num_params

        return num_params(hf_model_config(cfg))

    def build(self, cfg: Any, dims: zero.ParallelDims, meta: bool) -> nn.Module:
        """The adapted model (its buffers on this rank's device when built on meta; an MoE model's balancing loss
        over the sequence's sp ranks), its attention block-sparse with model.attention=sparse."""
        from moe_lst.kernels.attention import attention
        from moe_lst.kernels.sparse import SparseAttention
        from moe_lst.models.hf import build

        from zero.dist.topology import default_device

        fn = SparseAttention(SparseConfig(**OmegaConf.to_container(cfg.model.sparse))) \
            if cfg.model.attention == "sparse" else attention
        model = build(hf_model_config(cfg), meta=meta, device=default_device() if meta else None, attention_fn=fn,
                      sp_group=dims.sequence_group)  # (its balancing statistics: over cp x sp)
        if meta:
            model.continue_global_generator()  # (an MoE model: what is drawn next draws what it would after eager)
        return model

    def shape_model(self, cfg: Any, dims: zero.ParallelDims) -> nn.Module:
        from moe_lst.models.hf import build

        return build(hf_model_config(cfg), meta=True)  # (no generator to continue: nothing trains it)

    def builds_on_meta(self, cfg: Any) -> bool:
        """Every model whose meta build gives an eager build's values, under any layout: MoE models (each
        parameter, or a rank's slice of an expert weight, from moe_lst.models.hf.model's replayed fills) and dense
        ones whose modules the per-name init fills (the eager build uses the same init); a model it cannot fill
        (a dense one's module without a per-name init, an MoE one's parameter whose random fill is changed
        afterwards, such as a linear-attention gate's A_log or dt_bias) is built whole, eagerly, with transformers'
        own init."""
        return _meta_buildable(hf_model_config(cfg).to_json_string())

    def plans(self, model: nn.Module, dims: zero.ParallelDims) -> list[zero.Plan]:
        return [model.loss_plan()]  # (a balancing loss attached inside the model)

    def init_from(self, cfg: Any, source: str):
        """Any directory save_pretrained wrote for a model of the run's config, streamed: its config and tensor
        headers checked here (one line naming what differs), each rank reading only its slices once the engine
        exists (moe_lst.models.hf.streaming)."""
        from moe_lst.models.hf import HFConfigError, check_model_directory
        from moe_lst.models.hf.streaming import open_streaming
        from moe_lst.models.loading import CheckpointError

        config = hf_model_config(cfg)
        try:
            directory = check_model_directory(source, config)
        except HFConfigError as e:  # (its text begins with the directory)
            raise ConfigError(f"train.init_from={e}") from None
        try:
            return open_streaming(directory, config)
        except (HFConfigError, CheckpointError) as e:
            raise ConfigError(f"train.init_from={source}: {e}") from None

    def run_files(self, cfg: Any) -> dict[str, str]:
        return {HF_CONFIG_FILE: hf_model_config(cfg).to_json_string()}

    def check_exportable(self, run_cfg: Any, run_dir: Path) -> None:
        """Raise ExportError unless the run's model is what its transformers config describes: its attention
        (model.attention=sparse trains block-sparse attention, which no transformers config can express, so the
        exported model would attend densely and give other logits)."""
        attention = run_cfg.model.get("attention", "dense")
        if attention != "dense":
            layout = run_cfg.model.sparse.get("layout") if attention == "sparse" else None
            raise ExportError(f"{run_dir} was trained with model.attention={attention}"
                              f"{f' (layout {layout})' if layout else ''}: transformers has "
                              "no block-sparse attention to express it, so the export would be a dense-attention "
                              "model with other outputs; only model=hf runs with model.attention=dense export")

    def export(self, run_dir: Path, run_cfg: Any, checkpoint: Path, out_dir: str | Path, experts: str,
               consolidate: Callable[[Path], dict[str, torch.Tensor]], max_shard_bytes: int = 5 * 2**30) -> Path:
        """The run's config.json (its run_dir's hf_config.json) and its weights and persistent buffers (a router's
        correction bias), which already carry Hugging Face's names, as save_pretrained lays them out (MoE experts per
        expert, the published layout, or fused), streamed: each tensor read whole from the checkpoint's shards and
        written into safetensors shards of at most `max_shard_bytes` (moe_lst.models.loading.ShardedWriter): the
        whole model is never in memory."""
        from moe_lst.models.hf import HFConfigError, load_config, parameter_shapes
        from moe_lst.models.hf.streaming import export_parts
        from moe_lst.models.loading import ShardedWriter

        written = run_dir / HF_CONFIG_FILE
        try:
            config = load_config(written) if written.is_file() else hf_model_config(run_cfg)
            reader = zero.open_checkpoint(checkpoint)
        except (HFConfigError, ConfigError) as e:
            raise ExportError(f"{run_dir}: {e}") from None
        except (zero.CheckpointError, zero.ReshardError) as e:
            raise ExportError(str(e)) from e
        held, shapes = set(reader.names()), parameter_shapes(config)
        stray = sorted(held - set(shapes))
        if stray:
            raise ExportError(f"{run_dir}: {stray[0]} is not a tensor of the {config.model_type} model its config "
                              "describes")
        untrained = _tied_or_buffers(config)
        missing = sorted(n for n in shapes if n not in held and n not in untrained)
        if missing:
            raise ExportError(f"{run_dir}: the checkpoint lacks {', '.join(missing[:3])}")
        writer = ShardedWriter(out_dir, max_shard_bytes)
        for name in shapes:  # (the state dict's order: parameters and persistent buffers; a tied head is not written)
            value = reader.full(name) if name in held else reader.buffer(name)
            if value is None:
                continue
            for file_name, part in export_parts(name, value.reshape(shapes[name]), config,
                                                original_format=experts == "per_expert"):
                writer.add(file_name, part)
        out = writer.close()
        config.save_pretrained(out)
        return out

    def check_plannable(self, cfg: Any) -> None:
        raise NotImplementedError("the planner covers the project's Llama family (model=hf is not planned yet)")


def _config_from_json(config_json: str):
    """The transformers config of a config.json as PreTrainedConfig.to_json_string writes it."""
    import json

    from transformers import AutoConfig, PreTrainedConfig

    values = PreTrainedConfig._decode_special_floats(json.loads(config_json))  # (to_json_string tags Infinity)
    return AutoConfig.for_model(values.pop("model_type"), **values)


def _meta_causal_lm(config_json: str) -> nn.Module:
    """The plain transformers model of a config.json on the meta device, for reading its structure (torch's
    global generator left as it was, like _meta_buildable)."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        return AutoModelForCausalLM.from_config(_config_from_json(config_json))


@functools.lru_cache(maxsize=16)
def _head_problem(config_json: str) -> str | None:
    """moe_lst.models.hf.model.head_problem of this config.json's model."""
    from moe_lst.models.hf.model import head_problem

    return head_problem(_meta_causal_lm(config_json))


@functools.lru_cache(maxsize=16)
def _sequence_structure(config_json: str) -> tuple[str | None, str | None, str | None, str | None,
                                                   tuple[str, int] | None]:
    """What of this config.json's model sequence shards, packed documents, ring attention or block-sparse layouts
    cannot reach, read from its modules on the meta device: (a repeated layer holding no AttentionInterface module,
    the module numbering positions itself, an attention module with sinks, an attention module whose softcapping or
    chunks only the dense attention computes, named with what it has, and (an attention module scaling its queries
    by positions it numbers itself, its floor_scale): moe_lst.models.hf.attention.temperature_floor_of), each None
    where there is none."""
    from moe_lst.models.hf.attention import chunk_size_of, softcap_of, temperature_floor_of
    from moe_lst.models.hf.structure import attention_modules, blocks_outside_attention, positions_from_length

    causal_lm = _meta_causal_lm(config_json)
    outside = blocks_outside_attention(causal_lm)
    sites = attention_modules(causal_lm)
    sinks = next((name for name, module in sites if isinstance(getattr(module, "sinks", None), torch.Tensor)), None)
    dense_only = next((f"{name} has attention logit softcapping ({softcap_of(module)})" for name, module in sites
                       if softcap_of(module) is not None), None)
    dense_only = dense_only or next((f"{name} has chunked attention (chunks of {chunk_size_of(module)} positions)"
                                     for name, module in sites if chunk_size_of(module) is not None), None)
    floors = [(f"{name} ({type(module).__name__})", temperature_floor_of(module)) for name, module in sites
              if temperature_floor_of(module) is not None]
    temperature = min(floors, key=lambda x: x[1]) if floors else None
    return (outside[0] if outside else None), positions_from_length(causal_lm), sinks, dense_only, temperature


@functools.lru_cache(maxsize=16)
def _meta_buildable(config_json: str) -> bool:
    """Whether the model of this config.json builds on the meta device with an eager build's values (a dense
    one's per-name init fills every module; an MoE one's every parameter is a replayable fill or a constant),
    tried once per config on the meta device, leaving torch's global generator as it was (the build draws from
    it, and whether this cached check ran must not change what the run's own build draws)."""
    from moe_lst.models.hf import build

    config = _config_from_json(config_json)
    try:
        with torch.random.fork_rng(devices=[]):
            build(config, meta=True)
    except NotImplementedError:
        return False
    return True


def _tied_or_buffers(config: Any) -> set[str]:
    """The state-dict entries of `config`'s model that are not trained tensors: its buffers and a tied head."""
    import copy

    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32)
    return set(dict(model.named_buffers())) | ({"lm_head.weight"} if config.tie_word_embeddings else set())


register("hf", HFSpec())
