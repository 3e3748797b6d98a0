"""The project's Llama as a registered model family (moe_lst.models.spec): its config is the `model` section
itself (ModelConfig's fields), its rules against a run's layout, weights from and to Hugging Face Llama / Mixtral
directories (state_dict.py) and its export."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from moe_lst.models.llama.model import ModelConfig, Transformer
from moe_lst.models.loading import StreamingWeights
from moe_lst.models.spec import ConfigError, ExportError, FamilySpec, check_tiled_mlp, positive_int, register
from omegaconf import OmegaConf
from torch import nn

import zero


def model_config(cfg: Any) -> ModelConfig:
    """The ModelConfig of a run's `model` section (its `family` key, when written, is not one of its fields)."""
    values = OmegaConf.to_container(cfg.model, resolve=True)
    values.pop("family", None)
    return ModelConfig(**values)  # its moe dict becomes a MoEConfig


def tp_that_works(cfg: Any, tp: int) -> int:
    """The largest tensor-parallel degree below `tp` that this model accepts (a layout that would work)."""
    from moe_lst.models.llama.parallelize import check_tensor_parallel

    for degree in range(tp - 1, 1, -1):
        try:
            check_tensor_parallel(model_config(cfg), degree)
            return degree
        except ValueError:
            continue
    return 1


def check_crop(cfg: Any) -> None:
    """train.crop_check_tokens needs a bounded receptive field, a data/sequence-parallel layout and room."""
    n = positive_int(cfg, "train.crop_check_tokens", minimum=0)
    if not n:
        return
    if cfg.model.attention != "sparse" or cfg.model.sparse.layout != "sliding_window":
        raise ConfigError(f"train.crop_check_tokens={n} needs model.attention=sparse with model.sparse.layout="
                          "sliding_window (a receptive field bounded by window x layers)")
    if cfg.parallel.tp > 1 or cfg.parallel.pp > 1:
        raise ConfigError(f"train.crop_check_tokens={n} runs with data and sequence parallelism only "
                          "(parallel.tp=1 parallel.pp=1)")
    if cfg.model.moe.num_experts:
        raise ConfigError(f"train.crop_check_tokens={n} needs a dense FFN (model.moe.num_experts=0): routing with "
                          "capacity or jitter depends on the whole sequence")
    if cfg.zero.dtype != "fp32":
        raise ConfigError(f"train.crop_check_tokens={n} compares with an fp32 forward: it needs zero.dtype=fp32")
    if n > cfg.train.seq_len:
        raise ConfigError(f"train.crop_check_tokens={n} must be <= train.seq_len={cfg.train.seq_len}")


class LlamaSpec(FamilySpec):
    """The project's Llama (dense, MoE, block-sparse or NSA attention): every layout the runtime offers."""

    schema = ModelConfig

    def model_config(self, cfg: Any) -> ModelConfig:
        return model_config(cfg)

    def check_model(self, cfg: Any) -> None:
        """The model's own rules (dims, heads, MoE routing, sparse layouts), the sequence against its positions,
        ep against its experts, the crop check and MLP tiling, as one-line errors."""
        try:
            model = model_config(cfg)
            if model.attention == "sparse":
                model.sparse.check_sequence(cfg.train.seq_len)
        except (ValueError, TypeError) as e:
            raise ConfigError(str(e)) from None
        m = cfg.model.moe
        if m.num_experts:
            if not 1 <= m.top_k <= m.num_experts:
                raise ConfigError(f"model.moe.top_k={m.top_k} must be in [1, model.moe.num_experts={m.num_experts}]")
            if m.router not in ("softmax", "sigmoid"):
                raise ConfigError(f"model.moe.router={m.router!r} must be softmax or sigmoid")
        check_tiled_mlp(cfg, sum(not model.is_moe_layer(i) for i in range(model.n_layers)),
                        f"the model (model.moe.num_experts={m.num_experts}, every={m.every}, "
                        f"first_dense={m.first_dense})")
        if cfg.train.seq_len > cfg.model.max_seq_len:
            raise ConfigError(f"train.seq_len={cfg.train.seq_len} does not fit the model: model.max_seq_len="
                              f"{cfg.model.max_seq_len}; lower train.seq_len or raise model.max_seq_len")
        if cfg.parallel.ep > 1 and cfg.model.moe.num_experts == 0:
            raise ConfigError(f"parallel.ep={cfg.parallel.ep} needs an MoE model (model.moe.num_experts > 0)")
        check_crop(cfg)

    def check_layout(self, cfg: Any) -> None:
        """Tensor parallelism against the heads and widths, Ulysses against the heads (and NSA's GQA groups), and
        what a tied embedding cannot do under pp."""
        par, model = cfg.parallel, cfg.model
        tp, sp, pp = par.tp, par.sp, par.pp
        if tp > 1:
            from moe_lst.models.llama.parallelize import check_tensor_parallel

            try:
                check_tensor_parallel(model_config(cfg), tp)
            except ValueError as e:
                raise ConfigError(f"{e}; e.g. parallel.tp={tp_that_works(cfg, tp)}") from None
        from moe_lst.models.spec import PARALLEL_KEYS

        from sequence_parallel.ulysses import check_ulysses_heads, head_split

        check_ulysses_heads(model.n_heads, sp, tp, PARALLEL_KEYS)
        if sp > 1 and model.attention == "nsa":
            if head_split(model.n_heads, model.n_kv_heads, sp).kv_repeat > 1:
                raise ConfigError(f"model.attention=nsa with parallel.sp={sp} and {model.n_kv_heads} kv heads: NSA "
                                  "selects blocks once per GQA group, so each rank must hold whole groups; use an "
                                  f"sp that divides model.n_kv_heads={model.n_kv_heads}")
        if pp > 1 and model.tie_embeddings and cfg.zero.offload_optimizer == "nvme" and cfg.zero.stage >= 2:
            raise ConfigError("model.tie_embeddings=true with parallel.pp > 1 and zero.offload_optimizer=nvme at "
                              "zero.stage >= 2 is not supported (the tied gradients would be summed in nvme files); "
                              "use zero.offload_optimizer=cpu, zero.stage=1 or model.tie_embeddings=false")

    def num_layers(self, cfg: Any) -> int:
        return cfg.model.n_layers

    def vocab_size(self, cfg: Any) -> int:
        return cfg.model.vocab_size

    def num_experts(self, cfg: Any) -> int:
        return cfg.model.moe.num_experts

    def moe_layers(self, cfg: Any) -> list[int]:
        model = model_config(cfg)
        return [i for i in range(model.n_layers) if model.is_moe_layer(i)]

    def num_params(self, cfg: Any) -> int:
        return model_config(cfg).num_params()

    def builds_on_meta(self, cfg: Any) -> bool:
        """Always: dense and MoE, any layout (init_parameter gives any parameter or slice an eager build's values,
        MoE layers' replayed from the global generator), so no rank ever holds more than its own part."""
        return True

    def build(self, cfg: Any, dims: zero.ParallelDims, meta: bool) -> nn.Module:
        if not meta:
            return Transformer(model_config(cfg))
        from zero.dist.topology import default_device

        model = Transformer(model_config(cfg), device="meta", buffer_device=default_device())
        model.continue_global_generator()  # (what is drawn next draws what it would after an eager build)
        return model

    def shape_model(self, cfg: Any, dims: zero.ParallelDims) -> nn.Module:
        return Transformer(model_config(cfg), device="meta")  # (no generator to continue: nothing trains it)

    def init_from(self, cfg: Any, source: str) -> StreamingWeights:
        """A Hugging Face Llama / Mixtral / GLM-4.5 MoE directory (as recipes.export writes), streamed: each rank
        reads its slices of the parameters and, whole, the expert biases of the layers it holds. Refused in one
        line naming every model key on which it differs from the run's model, or the tensor that does not fit."""
        from moe_lst.models.llama.state_dict import open_hf_checkpoint
        from moe_lst.models.loading import CheckpointError

        try:
            return open_hf_checkpoint(source, model_config(cfg))
        except ExportError as e:
            sep = " " if str(e).startswith("holds another model") else ": "
            raise ConfigError(f"train.init_from={source}{sep}{e}") from None
        except CheckpointError as e:
            raise ConfigError(f"train.init_from={source}: {e}") from None

    def check_exportable(self, run_cfg: Any, run_dir: Path) -> None:
        from moe_lst.models.llama.state_dict import check_exportable

        check_exportable(model_config(run_cfg))

    def export(self, run_dir: Path, run_cfg: Any, checkpoint: Path, out_dir: str | Path, experts: str,
               consolidate: Callable[[Path], dict[str, torch.Tensor]], max_shard_bytes: int = 5 * 2**30) -> Path:
        """As Hugging Face Llama (dense), Mixtral or GLM-4.5 MoE (MoE), experts per expert or fused, streamed: each
        parameter read whole from the checkpoint's shards (zero.open_checkpoint), cut into its Hugging Face tensors
        by state_dict.weight_sources (as to_hf cuts them) and written into safetensors shards of at most
        `max_shard_bytes` (moe_lst.models.loading.ShardedWriter): the whole model is never in memory."""
        import json

        from moe_lst.models.llama.state_dict import (
            EXPERT_LAYOUTS,
            _box,
            _part,
            check_exportable,
            hf_config,
            weight_sources,
        )
        from moe_lst.models.loading import ShardedWriter

        cfg = model_config(run_cfg)
        if experts not in EXPERT_LAYOUTS:
            raise ExportError(f"experts={experts!r} must be one of {', '.join(EXPERT_LAYOUTS)}")
        try:
            reader = zero.open_checkpoint(checkpoint)
        except (zero.CheckpointError, zero.ReshardError) as e:
            raise ExportError(str(e)) from e
        held = set(reader.names())
        buffers: dict[str, torch.Tensor] = {}
        for state in reader.states:  # (as the first rank holding one wrote it)
            for name, value in state["engine"]["buffers"].items():
                buffers.setdefault(name, value)
        biases = {n: reader.full(n) for n in held if n.endswith("router.expert_bias")}
        check_exportable(cfg, {**buffers, **biases})
        shapes = {n: tuple(p.shape) for n, p in Transformer(cfg, device="meta").state_dict().items()}
        writer = ShardedWriter(out_dir, max_shard_bytes)
        for name, sources in weight_sources(cfg, experts=experts).items():
            if name in held:
                tensor = reader.full(name).reshape(shapes[name])
            elif name in buffers:
                tensor = buffers[name].to(torch.float32).reshape(shapes[name])
            elif name.endswith("router.expert_bias") or 0 in _box(sources):
                tensor = torch.zeros(_box(sources))  # (GLM's bias at zero, its empty shared experts)
            else:
                raise ExportError(f"checkpoint {checkpoint} has no tensor {name}: it was written for another model")
            for s in sources:
                writer.add(s.name, _part(tensor, s).to(torch.float32))
            del tensor
        out = writer.close()
        (out / "config.json").write_text(json.dumps(hf_config(cfg), indent=1))
        return out

    def check_plannable(self, cfg: Any) -> None:
        """The planner models this family's layers."""


register("llama", LlamaSpec())
