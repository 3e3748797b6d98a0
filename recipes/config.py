"""Checks on the recipe's Hydra config, run before any work starts, so bad input fails in one line."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from hydra.core.config_store import ConfigStore
from moe_lst.kernels.nsa import NSAConfig
from moe_lst.kernels.sparse import SparseConfig
from omegaconf import DictConfig, OmegaConf

from recipes.models.llama import MoEConfig

# The MoE, sparse-attention and NSA blocks of every model config (`defaults: [moe: base, sparse: base,
# nsa: base]` in conf/model/*.yaml) are the dataclasses themselves: one source for their keys and defaults,
# and a misspelt key is refused by name.
ConfigStore.instance().store(group="model/moe", name="base", node=MoEConfig)
ConfigStore.instance().store(group="model/sparse", name="base", node=SparseConfig)
ConfigStore.instance().store(group="model/nsa", name="base", node=NSAConfig)


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key, the rule and the fix."""


def _positive_int(cfg: DictConfig, key: str, minimum: int = 1) -> int:
    value = OmegaConf.select(cfg, key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{key}={value!r} must be an integer >= {minimum}")
    return value


def check_config(cfg: DictConfig) -> None:
    """Validate the keys the recipe reads; raise ConfigError on the first bad value."""
    for key in ("train.steps", "train.micro_batch_size", "train.seq_len", "train.grad_accum"):
        _positive_int(cfg, key)
    for key in ("train.eval_every", "train.ckpt_every", "train.eval_batches", "train.sample_tokens",
                "train.tiled_mlp", "optim.warmup_steps", "train.keep_checkpoints"):
        _positive_int(cfg, key, minimum=0)
    _positive_int(cfg, "train.max_nonfinite_steps")
    if not cfg.train.collective_timeout_s > 0:
        raise ConfigError(f"train.collective_timeout_s={cfg.train.collective_timeout_s!r} must be > 0")
    if not isinstance(cfg.train.resume, (bool, str)) or cfg.train.resume == "":
        raise ConfigError(f"train.resume={cfg.train.resume!r} must be auto, true, false or a checkpoint directory")
    if any(not 0 <= b < 1 for b in cfg.optim.betas) or len(cfg.optim.betas) != 2:
        raise ConfigError(f"optim.betas={list(cfg.optim.betas)} must be two values in [0, 1)")
    check_model(cfg)
    if not isinstance(cfg.train.seed, int):
        raise ConfigError(f"train.seed={cfg.train.seed!r} must be an integer")
    if not cfg.optim.lr > 0:
        raise ConfigError(f"optim.lr={cfg.optim.lr!r} must be > 0")
    if not 0 <= cfg.optim.min_lr_ratio <= 1:
        raise ConfigError(f"optim.min_lr_ratio={cfg.optim.min_lr_ratio!r} must be in [0, 1]")
    if cfg.optim.grad_clip < 0:
        raise ConfigError(f"optim.grad_clip={cfg.optim.grad_clip!r} must be >= 0 (0 turns clipping off)")
    if cfg.wandb.mode not in ("offline", "online", "disabled"):
        raise ConfigError(f"wandb.mode={cfg.wandb.mode!r} must be one of offline, online, disabled")
    if cfg.train.seq_len > cfg.model.max_seq_len:
        raise ConfigError(
            f"train.seq_len={cfg.train.seq_len} does not fit the model: model.max_seq_len={cfg.model.max_seq_len}; "
            "lower train.seq_len or raise model.max_seq_len"
        )
    if cfg.parallel.ep > 1 and cfg.model.moe.num_experts == 0:
        raise ConfigError(f"parallel.ep={cfg.parallel.ep} needs an MoE model (model.moe.num_experts > 0)")
    check_crop(cfg)
    check_layout(cfg)


def check_crop(cfg: DictConfig) -> None:
    """train.crop_check_tokens needs a bounded receptive field, a data/sequence-parallel layout and room."""
    n = _positive_int(cfg, "train.crop_check_tokens", minimum=0)
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


def check_model(cfg: DictConfig) -> None:
    """The model's own rules (dims, heads, MoE routing, sparse layouts) as one-line errors, before any process
    group."""
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


def check_layout(cfg: DictConfig) -> None:
    """Tensor, sequence and pipeline parallel rules against the model, before any process group exists."""
    from zero.parallel.pipeline import check_pipeline_layout

    par, model = cfg.parallel, cfg.model
    for key in ("dp", "tp", "pp", "sp", "ep"):
        if key != "dp" or par.dp is not None:
            _positive_int(cfg, f"parallel.{key}")
    tp, sp, pp = par.tp, par.sp, par.pp
    if tp > 1:
        from recipes.models.llama import check_tensor_parallel

        try:
            check_tensor_parallel(model_config(cfg), tp)
        except ValueError as e:
            raise ConfigError(f"{e}; e.g. parallel.tp={_tp_that_works(cfg, tp)}") from None
        for key in ("tiled_loss", "tiled_mlp"):
            if cfg.train[key]:
                raise ConfigError(f"train.{key} with parallel.tp > 1 is not supported (the tensor-parallel MLP and "
                                  "vocabulary-parallel loss already split that work); turn it off")
    if sp > 1 and model.n_heads // tp < sp:
        raise ConfigError(f"tp={tp} leaves {model.n_heads // tp} attention heads per rank and Ulysses splits them "
                          f"over sp={sp}: the rule is sp <= n_heads / tp; use sp <= {max(model.n_heads // tp, 1)}")
    if sp > 1 and model.attention == "nsa":
        from sequence_parallel.ulysses import head_layout

        if head_layout(model.n_heads, model.n_kv_heads, sp).kv_repeat > 1:
            raise ConfigError(f"model.attention=nsa with parallel.sp={sp} and {model.n_kv_heads} kv heads: NSA "
                              "selects blocks once per GQA group, so each rank must hold whole groups; use an sp "
                              f"that divides model.n_kv_heads={model.n_kv_heads}")
    if tp > 1 and cfg.train.seq_len % (tp * sp):  # (sp alone pads the sequence to a multiple of sp)
        raise ConfigError(f"train.seq_len={cfg.train.seq_len} must be a multiple of tp x sp = {tp * sp} "
                          "(the sequence is split over both)")
    if pp > 1 and model.tie_embeddings and cfg.zero.offload_optimizer == "nvme" and cfg.zero.stage >= 2:
        raise ConfigError("model.tie_embeddings=true with parallel.pp > 1 and zero.offload_optimizer=nvme at "
                          "zero.stage >= 2 is not supported (the tied gradients would be summed in nvme files); "
                          "use zero.offload_optimizer=cpu, zero.stage=1 or model.tie_embeddings=false")
    if pp > 1 and cfg.train.tiled_loss:
        raise ConfigError("train.tiled_loss with parallel.pp > 1 is not supported (the last stage computes the "
                          "loss from its logits); turn it off")
    if pp > 1:
        split = None if par.pp_split is None else list(par.pp_split)
        check_pipeline_layout(par.pp_schedule, pp, par.pp_virtual_stages, model.n_layers, cfg.train.grad_accum, split)
    elif par.pp_split is not None:
        raise ConfigError("parallel.pp_split is set but parallel.pp=1; set pp to the number of stages")


def _tp_that_works(cfg: DictConfig, tp: int) -> int:
    """The largest tensor-parallel degree below `tp` that this model accepts (a layout that would work)."""
    from recipes.models.llama import check_tensor_parallel

    for degree in range(tp - 1, 1, -1):
        try:
            check_tensor_parallel(model_config(cfg), degree)
            return degree
        except ValueError:
            continue
    return 1


def model_config(cfg: DictConfig):
    """The model's config from the recipe's `model` group."""
    from recipes.models.llama import ModelConfig

    return ModelConfig(**OmegaConf.to_container(cfg.model, resolve=True))  # its moe dict becomes a MoEConfig


def check_run_dir(run_dir: str) -> Path:
    """Create run_dir and prove it is writable, or fail now rather than at the first checkpoint."""
    path = Path(run_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as e:
        raise ConfigError(f"run_dir={run_dir!r} cannot be written ({e.strerror}); choose another run_dir") from None
    return path


CHECKPOINT_NAME = re.compile(r"^step_\d{7}$")


def checkpoints(run_dir: Path) -> list[Path]:
    """The run's complete checkpoint directories (`<run_dir>/checkpoints/step_NNNNNNN`), newest first."""
    directory = Path(run_dir) / "checkpoints"
    if not directory.is_dir():
        return []
    return sorted((p for p in directory.iterdir() if p.is_dir() and CHECKPOINT_NAME.match(p.name)), reverse=True)


def atomic_write_text(path: Path, text: str) -> None:
    """Write a small file so a crash never leaves it half-written."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
