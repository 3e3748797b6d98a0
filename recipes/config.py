"""The recipe's Hydra config: one typed definition (a dataclass) per section, and the checks run before any
work starts, so bad input fails in one line."""

from __future__ import annotations

import difflib
import functools
import os
import re
import signal
import sys
import tempfile
from dataclasses import dataclass, field, fields, is_dataclass, make_dataclass
from pathlib import Path
from typing import Any, get_type_hints

from hydra.core.config_store import ConfigStore
from moe_lst.data.format import DataError
from moe_lst.data.mixture import check_mixture_config
from moe_lst.kernels.nsa import NSAConfig
from moe_lst.kernels.sparse import SparseConfig
from moe_lst.models import spec as families
from moe_lst.models.llama import MoEConfig
from moe_lst.models.spec import check_tiled_mlp  # noqa: F401 (the rule's home is the families' spec module)
from omegaconf import MISSING, DictConfig, OmegaConf

from moe.dispatch import check_expert_parallel
from zero.config import ConfigError, ZeroConfig, int_at_least
from zero.dist.topology import ParallelDims
from zero.optim import BoundOptimizer, DiLoCo, OneBitAdam, ReplicaDims
from zero.optim.diloco import replica_world
from zero.sharding.optimizer import FastAdamW

# Every section of the config is a dataclass registered in Hydra's ConfigStore: one source for its keys, their
# types and defaults (the embedded default run's values) and what they mean. The yaml files under conf/ pull them
# in through their defaults lists (`train: base` in config.yaml, `defaults: [base]` in conf/optim/adamw.yaml,
# `moe: base` in conf/model/*.yaml) and list only what differs. Hydra refuses a misspelt key without `+` and a
# value of the wrong type; `check_keys` refuses one added with `+`.


@dataclass
class TrainConfig:
    """`train.*`: the training loop, its cadences and the long-sequence switches."""

    steps: int = 150  # optimizer steps
    seed: int = 1234  # model init and data order
    micro_batch_size: int = 16  # sequences per rank per micro step
    seq_len: int = 256  # tokens per sequence (must fit model.max_seq_len)
    grad_accum: int = 1  # micro steps per optimizer step; global batch = dp x micro_batch_size x grad_accum
    eval_every: int = 50  # validation loss every k steps (and always at the end); 0 = only at the end
    eval_batches: int = 8  # global batches of held-out text per evaluation (0 = no evaluation)
    ckpt_every: int = 0  # checkpoint every k steps (and always at the end); 0 = only at the end
    # auto (or true): the newest checkpoint in run_dir that verifies (none: start); false: never (refused if
    # run_dir has checkpoints); or a checkpoint directory to start from (a bool or a string: Any, checked by
    # check_config)
    resume: Any = "auto"
    keep_checkpoints: int = 3  # keep the newest k checkpoints of run_dir (0 = all)
    # a Hugging Face model directory whose weights start a fresh run (a resumed run ignores it): for the project's
    # Llama a Llama / Mixtral one (python -m recipes.export writes one), its model matching model.*; with model=hf
    # any directory save_pretrained wrote for a model of model.hf.config (whose config it is when that is unset)
    init_from: str | None = None
    max_nonfinite_steps: int = 3  # stop (exit 3) after this many consecutive steps with a non-finite loss/grad norm
    collective_timeout_s: float = 600  # a rank waiting this long in one collective ends the run (exit 4)
    # signals that stop the run at the next step boundary with a checkpoint (result.json status preempted,
    # exit code 128 + the signal's number: 143 SIGTERM, 130 SIGINT, 138 SIGUSR1); [] keeps each signal's default
    stop_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGINT", "SIGUSR1"])
    # seconds from such a signal within which the run must have saved and exited (a scheduler's grace period,
    # less a margin); past it the run exits without the new checkpoint, the previous one intact
    stop_grace_s: float = 120
    sample_tokens: int = 200  # bytes generated from sample_prompt at the end (0 = no sample)
    sample_prompt: str = "def "  # the prompt of that sample
    progress: bool = True  # progress bar on rank 0
    # Long-sequence switches (ALST): each is independent.
    activation_checkpointing: bool = False  # recompute each block's activations in backward
    offload_activations: bool = False  # offload checkpointed layer inputs to CPU memory (GPU runs)
    tiled_mlp: int = 0  # run each MLP over this many sequence tiles (0 = off)
    tiled_loss: bool = False  # logits + cross-entropy in sequence tiles, never [seq, vocab] at once
    # at the end: the last k tokens of a held-out sequence against a plain forward over their receptive field
    # (sliding-window sparse attention; 0 = off)
    crop_check_tokens: int = 0


@dataclass
class OneBitConfig:
    """`optim.onebit.*` (optim.name=onebit_adam): AdamW for `warmup_steps`, then frozen variance and 1-bit momentum."""

    warmup_steps: int = 100  # full-precision AdamW steps before the variance freezes and the momentum is compressed
    block: int = 2048  # elements sharing one fp32 scale in the 1-bit momentum (a multiple of 8; smaller: finer)
    # compress the momentum divided by the frozen Adam denominator (the update direction) instead of the raw
    # momentum (DeepSpeed's choice, false): a block's scale then never meets an element of tiny variance
    precondition: bool = True
    # every refresh_every-th step after the warm-up averages the gradients themselves (sent as refresh_dtype) and
    # takes an Adam step on them: the momentum exact, the variance updated; 0: the variance stays frozen (classic
    # 1-bit Adam)
    refresh_every: int = 0
    refresh_dtype: str = "int8"  # int8 (one fp32 scale per 256 elements), bf16 or fp32
    # after the warm-up, clip each element's bias-corrected Adam update to +-max_update (learning rates per step),
    # a brake a frozen variance lacks; null: no bound
    max_update: float | None = None


@dataclass
class DiLoCoConfig:
    """`optim.diloco.*`: with inner_steps > 0, each of the parallel.replicas replicas takes inner_steps optimizer steps
    alone, then their parameter deltas are averaged and an outer SGD with Nesterov momentum applies them."""

    inner_steps: int = 0  # optimizer steps between synchronisations (0: DiLoCo off)
    outer_lr: float = 0.7  # the outer SGD's learning rate (1.0 with no momentum: the plain average of the replicas)
    outer_momentum: float = 0.9  # its Nesterov momentum, in [0, 1)
    delta_dtype: str = "fp32"  # what the deltas travel as: fp32, bf16 or int8 (one fp32 scale per 2048 elements)
    # optimizer steps of ordinary data parallelism over all replicas (fp32 gradient all-reduce) before the first
    # local period: a synchronous warm start (0: the replicas train apart from the first step)
    warmup_steps: int = 0


OPTIMIZERS = ("adamw", "onebit_adam")


@dataclass
class OptimConfig:
    """`optim.*`: AdamW (zero.FastAdamW) with linear warmup to `lr`, then cosine decay to `lr * min_lr_ratio`;
    name=onebit_adam: the same AdamW for optim.onebit.warmup_steps, then 1-bit Adam (zero.optim.OneBitAdam)."""

    name: str = "adamw"  # adamw | onebit_adam
    onebit: OneBitConfig = field(default_factory=OneBitConfig)
    diloco: DiLoCoConfig = field(default_factory=DiLoCoConfig)
    lr: float = 2.0e-3  # peak learning rate (small byte-level models tolerate a high one)
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at the last step
    warmup_steps: int = 20  # linear warmup steps (0 = none)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW's two moment decays, each in [0, 1)
    eps: float = 1.0e-8  # AdamW's denominator epsilon
    weight_decay: float = 0.1  # decoupled weight decay
    grad_clip: float = 1.0  # global gradient-norm clip (0 = off); the engine's zero.ZeroConfig.clip_grad_norm


@dataclass
class ParallelConfig:
    """`parallel.*`: the degrees multiply to the number of processes, dp * tp * pp * sp = world size; ep divides
    dp * sp."""

    # data parallel: auto (or null) is what the number of processes leaves after tp * pp * sp; a number must fill
    # it exactly (an int or auto: Any, checked by check_config)
    dp: Any = "auto"
    tp: int = 1  # tensor parallel: heads, MLP and vocabulary split, sequence-parallel norms
    pp: int = 1  # pipeline stages; its micro-batches are the train.grad_accum micro-batches
    sp: int = 1  # Ulysses sequence parallel (splits the heads left after tp)
    # ring attention (context parallelism): the sequence split over cp x sp ranks, Ulysses' all-to-all inside each
    # group of sp, the ring across the cp groups (sequence_parallel.ring); for sp past the heads, or across nodes
    cp: int = 1
    ep: int = 1  # expert parallel (MoE models): experts split over ep of the dp * sp ranks
    # DiLoCo replicas (optim.diloco.*): the processes split into this many copies of the dp/tp/pp/sp/ep layout,
    # which synchronise every optim.diloco.inner_steps; the degrees above then fill world size / replicas
    replicas: int = 1
    # pipeline schedule: gpipe, 1f1b, interleaved_1f1b, looped_bfs, interleaved_zb, zbv or dualpipev
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int | None = None  # stages per rank (null: what the schedule needs, 2 for interleaved / zb / V)
    pp_split: list[int] | None = None  # layers per stage, e.g. [3, 5] (null: balanced by parameter count)


@dataclass
class StdlibDataConfig:
    """`data=stdlib`: byte-level text of the running Python's standard library (.py files; 1 in 20 files held
    out)."""

    kind: str = "stdlib"  # the corpus reader (recipes.data.build_streams); comes with the data=... choice
    max_bytes: int | None = None  # cap on corpus size in bytes (null = all of it, about 30 MB)


@dataclass
class BinDataConfig:
    """`data=bin`: pre-tokenised corpora, flat token files (e.g. written with numpy's tofile)."""

    kind: str = "bin"  # the corpus reader (recipes.data.build_streams); comes with the data=... choice
    train_path: str = MISSING  # the training token file (required)
    val_path: str = MISSING  # the held-out token file (required)
    dtype: str = "uint16"  # uint8, uint16 or uint32; model.vocab_size must exceed every id


@dataclass
class TokenizedDataConfig:
    """`data=tokenized`: a corpus prepared by `python -m recipes.prepare_data` (token shards, document index and
    meta.json; docs/data.md); its tokenizer's vocabulary must fit model.vocab_size."""

    kind: str = "tokenized"  # the corpus reader (recipes.data.build_streams); comes with the data=... choice
    path: str = MISSING  # the directory prepare_data wrote (its --out; required)
    # document: position ids restart at each document, attention and loss never cross a document boundary;
    # concat: rows are plain windows of the token stream (documents attend to the ones before them)
    packing: str = "document"


@dataclass
class MixtureSourceConfig:
    """One source of `data=mixture` (`data.sources[i].*`)."""

    path: str = MISSING  # a directory prepare_data wrote (either --format), or a Megatron dataset's PREFIX
    weight: float = 1.0  # relative share of the rows (0.7 and 0.3, or 7 and 3)
    max_epochs: float | None = None  # with data.on_exhausted=repeat: passes over the source allowed (null: no limit)
    val_path: str | None = None  # a bare Megatron prefix's validation PREFIX (a prepared directory has its val split)
    name: str | None = None  # in metrics (tokens/NAME, val_loss/NAME); null: the last part of path


@dataclass
class MixtureDataConfig:
    """`data=mixture`: weighted sources (moe_lst.data.mixture); each global batch's composition is a function of
    (train.seed, step, global batch size), so a resume under another layout continues the same samples."""

    kind: str = "mixture"  # the corpus reader (recipes.data.build_streams); comes with the data=... choice
    sources: list[MixtureSourceConfig] = field(default_factory=list)  # at least one (required)
    # a source used up: stop (a run that would read any source twice is refused before training) or repeat (another
    # epoch in a new order, said once, up to the source's max_epochs)
    on_exhausted: str = "stop"
    packing: str = "document"  # as data=tokenized's, across the mixture (each row's documents are its source's)


@dataclass
class RetrievalEvalConfig:
    """`eval.retrieval.*`: pass-key retrieval prompts built from validation text, scored by the likelihood of the
    key (recipes/evals.py)."""

    enabled: bool = False
    lengths: list[int] | None = None  # prompt lengths in tokens, each <= train.seq_len (null: seq_len/4, /2, seq_len)
    depths: list[float] = field(default_factory=lambda: [0.1, 0.5, 0.9])  # the needle's place: 0 start .. 1 end
    prompts: int = 2  # prompts per (length, depth) cell, each with its own key and text
    digits: int = 5  # digits of the pass key


@dataclass
class EvalConfig:
    """`eval.*`: evaluations in the loop, every `eval.every` steps and at the end, into metrics.jsonl and W&B
    (recipes/evals.py)."""

    every: int | None = None  # null: train.eval_every
    per_source: bool = True  # with data=mixture: each source's validation loss (val_loss/NAME)
    retrieval: RetrievalEvalConfig = field(default_factory=RetrievalEvalConfig)
    # your evaluations: "package.module:function", each called as function(model, step) -> {name: number}
    hooks: list[str] = field(default_factory=list)


@dataclass
class WandbConfig:
    """`wandb.*`: Weights & Biases; metrics.jsonl is written whatever the mode."""

    # offline (no network; `wandb sync` uploads later), online or disabled. online without a W&B key or without a
    # reachable server logs offline instead, said in one line with the `wandb sync` command that uploads it later
    mode: str = "offline"
    init_timeout_s: float = 30  # seconds wandb.mode=online waits for the W&B server before logging offline
    project: str = "moe-lst"  # the W&B project
    name: str | None = None  # the run's name (null: W&B picks one)
    entity: str | None = None  # the W&B team or user (null: your default entity)


@dataclass
class HFSourceConfig:
    """`model.hf.*`: which Hugging Face causal LM `model=hf` builds (moe_lst.models.hf)."""

    # a config.json, or a model directory holding one (null: train.init_from's); its model_type must be one the
    # adapter covers (moe_lst.models.hf.MODEL_TYPES)
    config: str | None = None
    # keys of that config.json replaced before the model is built, a mapping such as model.hf.overrides='{hidden_size:
    # 64, num_hidden_layers: 2}'; each must be a key of that config, with a value of its type (null: none; Any, not a
    # typed dict, so that the command line can set the whole mapping; checked by the family's hf_model_config)
    overrides: Any = None


@dataclass
class HFModelConfig:
    """`model=hf` (conf/model/hf.yaml): a Hugging Face transformers causal LM built from its config.json (vocabulary,
    sizes and positions are that config's), its decoder layers the blocks the runtime checkpoints, shards and
    tiles. Tensor and pipeline parallelism are not offered; data, sequence (Ulysses) and expert parallelism are."""

    hf: HFSourceConfig = field(default_factory=HFSourceConfig)
    attention: str = "dense"  # dense | sparse (block-sparse with the layout under model.sparse)
    sparse: SparseConfig = field(default_factory=SparseConfig)  # the layout of model.attention=sparse


#: ZeroConfig's fields the recipe fills itself, from its own keys, rather than from `zero.*`.
ZERO_FROM_RECIPE = {"grad_accum_steps": "train.grad_accum", "clip_grad_norm": "optim.grad_clip"}

# `zero.*` is zero.ZeroConfig itself (the meaning of each field is in its docstring), less the two fields above.
_zero_types = get_type_hints(ZeroConfig)
ZeroSection = make_dataclass(
    "ZeroSection",
    [(f.name, _zero_types[f.name], field(default=f.default))
     for f in fields(ZeroConfig) if f.name not in ZERO_FROM_RECIPE],
)
ZeroSection.__module__ = __name__
ZeroSection.__doc__ = ("`zero.*`: the ZeRO runtime, the fields of zero.ZeroConfig (see its docstring) but "
                       f"{' and '.join(ZERO_FROM_RECIPE)}, which come from {' and '.join(ZERO_FROM_RECIPE.values())}.")

#: The one translation of the library's names into the recipe's keys ("<owner>.<name>" -> key, zero.config.key_name):
#: the recipe's checks call the library's own rules (ZeroConfig, OneBitAdam, DiLoCo and their refuse_layout,
#: replica_world, moe's check_expert_parallel) with it, so each rule is written once, beside what it protects, and
#: its refusal names the key to change. (A ZeroConfig field's key is zero.<field> unless listed here.)
RECIPE_KEYS = {
    **{f"ZeroConfig.{name}": key for name, key in ZERO_FROM_RECIPE.items()},
    **families.PARALLEL_KEYS,
    "ReplicaDims.replicas": "parallel.replicas",
    "MoELayer.ep": "parallel.ep",
    **{f"OneBitAdam.{a}": f"optim.onebit.{a}"
       for a in ("warmup_steps", "block", "precondition", "refresh_every", "refresh_dtype", "max_update")},
    **{f"DiLoCo.{a}": f"optim.diloco.{a}" for a in ("inner_steps", "outer_lr", "outer_momentum", "delta_dtype",
                                                     "warmup_steps")},
    "DiLoCo.inner": "optim.name",
    "RingAttention.cp": "parallel.cp", "RingAttention.sp": "parallel.sp", "RingAttention.seq_len": "train.seq_len",
    "RingAttention.attention": "model.attention", "RingAttention.block_size": "model.sparse.block_size",
    "RingAttention.packing": "data.packing",
}


def zero_config(cfg: DictConfig) -> ZeroConfig:
    """The run's zero.ZeroConfig: `zero.*` with train.grad_accum and optim.grad_clip; its own rules refuse a bad
    value in one line, naming the recipe's key."""
    return ZeroConfig(grad_accum_steps=cfg.train.grad_accum, clip_grad_norm=cfg.optim.grad_clip,
                      **OmegaConf.to_container(cfg.zero, resolve=True), keys=RECIPE_KEYS)

_store = ConfigStore.instance()
_store.store(group="train", name="base", node=TrainConfig)
_store.store(group="optim", name="base", node=OptimConfig)
_store.store(group="parallel", name="base", node=ParallelConfig)
_store.store(group="data", name="base_stdlib", node=StdlibDataConfig)
_store.store(group="data", name="base_bin", node=BinDataConfig)
_store.store(group="data", name="base_tokenized", node=TokenizedDataConfig)
_store.store(group="data", name="base_mixture", node=MixtureDataConfig)
_store.store(group="eval", name="base", node=EvalConfig)
_store.store(group="wandb", name="base", node=WandbConfig)
_store.store(group="zero", name="base", node=ZeroSection)
# The MoE, sparse-attention and NSA blocks of every model config (`defaults: [moe: base, sparse: base,
# nsa: base]` in conf/model/*.yaml) are the dataclasses themselves.
_store.store(group="model/moe", name="base", node=MoEConfig)
_store.store(group="model/sparse", name="base", node=SparseConfig)
_store.store(group="model/nsa", name="base", node=NSAConfig)
_store.store(group="model", name="hf_base", node=HFModelConfig)  # conf/model/hf.yaml

#: The keys of the config's root: one section per group, and run_dir.
ROOT_KEYS = ("model", "data", "parallel", "optim", "zero", "train", "eval", "wandb", "run_dir")
#: The other choices of a group whose choices have different keys. (The schema of the model section, a plain yaml
#: node whose `moe`, `sparse` and `nsa` blocks are typed, is its family's: moe_lst.models.spec.FamilySpec.schema.)
GROUP_CHOICES = {"data": {"stdlib": StdlibDataConfig, "bin": BinDataConfig, "tokenized": TokenizedDataConfig,
                          "mixture": MixtureDataConfig}}


_type_hints = functools.lru_cache(maxsize=None)(get_type_hints)


def _schema(node: DictConfig, path: str) -> type | None:
    """The dataclass that defines `node` (the config at `path`), or None where none does."""
    schema = OmegaConf.get_type(node)
    if is_dataclass(schema):
        return schema
    return families.get(node).schema if path == "model" else None


def _schema_keys(node: DictConfig, path: str) -> list[str] | None:
    """The keys `node` (the config at `path`) may hold, or None where no schema says."""
    if not path:
        return list(ROOT_KEYS)
    schema = _schema(node, path)
    if schema is None:
        return None
    return [f.name for f in fields(schema)] + ([families.FAMILY_KEY] if path == "model" else [])


def _closest(name: str, known: list[str]) -> list[str]:
    """The nearest of `known` to `name` as a list of at most one (difflib's closest; of equally close ones, the
    one that shares the longest start: dpp is dp, not pp)."""
    def score(key: str) -> tuple[float, int]:
        return round(difflib.SequenceMatcher(None, name, key).ratio(), 6), len(os.path.commonprefix([name, key]))

    return sorted(difflib.get_close_matches(name, known, n=5), key=score, reverse=True)[:1]


def _nearest(node: DictConfig, path: str, parts: list[str]) -> list[str]:
    """The nearest valid spelling of the key `parts` under `node` (difflib, part by part), as far as one is
    found."""
    fixed = []
    for part in parts:
        known = _schema_keys(node, path) or [k for k in node.keys() if k != "hydra"]
        close = [part] if part in known else _closest(part, known)
        if not close:
            break
        fixed.append(close[0])
        path = f"{path}.{close[0]}" if path else close[0]
        child = node._get_node(close[0]) if close[0] in node else None
        if not isinstance(child, DictConfig):
            break
        node = child
    return fixed


def unknown_key_error(key: str, node: DictConfig, path: str) -> ConfigError:
    """`key` (dotted, as the user wrote it) is not in the config: its part after `path` is not a key of `node`.
    One line naming it and the nearest valid key, else the keys there are."""
    parts = key[len(path) + 1:].split(".") if path else key.split(".")
    fixed = _nearest(node, path, parts)
    if fixed:
        return ConfigError(f"unknown config key {key}: did you mean {'.'.join([path, *fixed] if path else fixed)}?")
    for choice, schema in GROUP_CHOICES.get(path, {}).items():  # a key of another choice of the group?
        close = _closest(parts[0], [f.name for f in fields(schema)])
        if close:
            return ConfigError(f"unknown config key {key}: did you mean {path}.{close[0]} (with {path}={choice})?")
    known = _schema_keys(node, path) or list(node.keys())
    return ConfigError(f"unknown config key {key}: the keys {f'of {path} ' if path else ''}are {', '.join(known)}")


def check_keys(cfg: DictConfig, path: str = "") -> None:
    """Refuse a key that no section defines. Hydra refuses `train.stepz=5` itself while composing (see
    compose_command_line); a key appended with `+` (`+train.stepz=5`, `+model.moe.topk=2`) gets into the
    composed config, and is refused here."""
    known = _schema_keys(cfg, path)
    for key in cfg.keys():
        full = f"{path}.{key}" if path else str(key)
        if known is not None and key not in known and not (not path and key == "hydra"):
            value, written = cfg._get_node(key), full
            while isinstance(value, DictConfig) and len(value):  # +trian.steps=5 adds trian: {steps: 5}
                first = next(iter(value.keys()))
                value, written = value._get_node(first), f"{written}.{first}"
            raise unknown_key_error(written, cfg, path)
        value = cfg._get_node(key)
        if isinstance(value, DictConfig) and not value._is_missing() and not value._is_none():
            check_keys(value, full)
        elif path and (schema := _schema(cfg, path)) is not None and is_dataclass(_type_hints(schema).get(key)):
            block = fields(_type_hints(schema)[key])[0].name  # model.moe=3 replaces a block with a value
            raise ConfigError(f"{full}={value._value()!r} must be a block of keys: set them one by one "
                              f"({full}.{block}=...)")


CONFIG_DIR = Path(__file__).with_name("conf")


def compose_command_line(argv: list[str], config_name: str = "config") -> DictConfig | None:
    """Compose the config of a `python -m recipes.pretrain ...` command line, turning what Hydra refuses while
    composing (a misspelt key, `train.steps=abc`, `model=nosuch`, bad override syntax) into a one-line
    ConfigError. None where there is nothing to check: a Hydra mode other than a plain run (--help, --multirun,
    a relative --config-path, --config-dir, ...) or an argument Hydra's own parser will report."""
    from hydra import compose, initialize_config_dir
    from hydra._internal.utils import get_args_parser
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

    def refuse(message: str) -> None:
        raise ValueError(message)

    parser = get_args_parser()
    parser.error = refuse
    try:
        args = parser.parse_args(argv)
    except ValueError:
        return None
    config_dir = args.config_path or str(CONFIG_DIR)  # (tests/recipes/stall_rank.py passes this one, absolute)
    if (args.help or args.hydra_help or args.info or args.shell_completion or args.multirun or args.config_dir
            or args.experimental_rerun or not os.path.isabs(config_dir) or GlobalHydra.instance().is_initialized()):
        return None
    try:
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            return compose(args.config_name or config_name, overrides=args.overrides)
    except (HydraException, OmegaConfBaseException) as e:
        cause = e.__cause__ or e
        full_key = getattr(cause, "full_key", None)
        if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and full_key and \
                isinstance(cause.parent_node, DictConfig):
            written = full_key  # the key as the override spells it (its unknown part may be a parent)
            for override in OverridesParser.create().parse_overrides(args.overrides):
                if (override.key_or_group + ".").startswith(full_key + "."):
                    written = override.key_or_group
                    break
            raise unknown_key_error(written, cause.parent_node, full_key.rpartition(".")[0]) from None
        if isinstance(cause, ValidationError) and full_key:
            raise ConfigError(f"{full_key}={cause.value!r} is refused: {cause.msg.splitlines()[0]}") from None
        text = " ".join(line.strip() for line in str(e).split("Config search path:")[0].splitlines() if line.strip())
        if isinstance(e, OverrideParseException):  # name the override that does not parse
            for override in args.overrides:
                try:
                    OverridesParser.create().parse_override(override)
                except HydraException:
                    text = f"{override!r} is not a valid override: {text}"
                    break
        raise ConfigError(text) from None


def refuse_bad_command_line(hydra_main):
    """Wrap a `@hydra.main` entry point: compose its command line's config once before Hydra does, so a config
    that Hydra cannot compose ends the run as every other config error does (`error: ...` in one line, exit 2)
    rather than with Hydra's report and exit 1."""

    @functools.wraps(hydra_main)
    def main(*args, **kwargs):
        if not args and not kwargs:
            try:
                compose_command_line(sys.argv[1:])
            except ConfigError as e:
                print(f"error: {e}", file=sys.stderr, flush=True)
                sys.exit(2)
        return hydra_main(*args, **kwargs)

    return main


def _positive_int(cfg: DictConfig, key: str, minimum: int = 1) -> int:
    return int_at_least(key, OmegaConf.select(cfg, key), minimum)


def check_eval(cfg: DictConfig) -> None:
    """`eval.*`: cadence, retrieval lengths and depths that fit train.seq_len, hooks named module:function."""
    e = cfg.get("eval")
    if e is None:
        return
    if e.every is not None:
        _positive_int(cfg, "eval.every", minimum=0)
    r = e.retrieval
    _positive_int(cfg, "eval.retrieval.prompts")
    if not 1 <= r.digits <= 12:
        raise ConfigError(f"eval.retrieval.digits={r.digits} must be between 1 and 12")
    seq = cfg.train.seq_len
    for length in r.lengths or []:
        if not 8 * r.digits <= length <= seq:
            raise ConfigError(f"eval.retrieval.lengths has {length}: each length must be between {8 * r.digits} (room "
                              f"for the needle, the question and some text) and train.seq_len={seq}")
    if not r.depths or any(not 0 <= d <= 1 for d in r.depths):
        raise ConfigError(f"eval.retrieval.depths={list(r.depths)} must be fractions in [0, 1] (0: the needle "
                          "opens the text, 1: it closes it)")
    if r.enabled and cfg.parallel.pp > 1:
        raise ConfigError(f"eval.retrieval.enabled=true with parallel.pp={cfg.parallel.pp}: the retrieval evaluation "
                          "through pipeline stages is not implemented; set eval.retrieval.enabled=false or pp=1")
    for hook in e.hooks:
        if not isinstance(hook, str) or hook.count(":") != 1 or not all(hook.split(":")):
            raise ConfigError(f"eval.hooks has {hook!r}: name each hook package.module:function")


def check_config(cfg: DictConfig) -> None:
    """Validate the keys the recipe reads; raise ConfigError on the first bad value."""
    check_keys(cfg)
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(f"{missing[0]} is required (it has no default): set {missing[0]}=...")
    data = OmegaConf.get_type(cfg.data)
    if is_dataclass(data) and cfg.data.kind != data.kind:
        raise ConfigError(f"data.kind={cfg.data.kind!r} does not go with data={data.kind}: choose the corpus with "
                          f"data={' or data='.join(GROUP_CHOICES['data'])} (that sets data.kind)")
    if cfg.data.get("packing", "concat") not in ("document", "concat"):
        raise ConfigError(f"data.packing={cfg.data.packing!r} must be document (attention and loss stay inside each "
                          "document) or concat")
    if cfg.data.kind == "mixture":
        try:
            check_mixture_config(cfg.data)  # (the rule's home: moe_lst.data.mixture)
        except DataError as e:
            raise ConfigError(str(e)) from None
    check_eval(cfg)
    for key in ("train.steps", "train.micro_batch_size", "train.seq_len"):
        _positive_int(cfg, key)
    # zero.* is zero.ZeroConfig (with train.grad_accum and optim.grad_clip): its own rules, e.g. zero.quantize_weights
    # needs stage 3, train.grad_accum >= 1, before any process
    zero_config(cfg)
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
    families.get(cfg).check_model(cfg)  # the model's own rules and those it sets the run
    if not isinstance(cfg.train.seed, int):
        raise ConfigError(f"train.seed={cfg.train.seed!r} must be an integer")
    if not cfg.optim.lr > 0:
        raise ConfigError(f"optim.lr={cfg.optim.lr!r} must be > 0")
    if not 0 <= cfg.optim.min_lr_ratio <= 1:
        raise ConfigError(f"optim.min_lr_ratio={cfg.optim.min_lr_ratio!r} must be in [0, 1]")
    check_optimizer(cfg)
    check_activations(cfg)
    if cfg.wandb.mode not in ("offline", "online", "disabled"):
        raise ConfigError(f"wandb.mode={cfg.wandb.mode!r} must be one of offline, online, disabled")
    if not cfg.wandb.init_timeout_s > 0:
        raise ConfigError(f"wandb.init_timeout_s={cfg.wandb.init_timeout_s!r} must be > 0 (seconds)")
    check_stop(cfg)
    check_layout(cfg)
    check_hpz(cfg)


def check_optimizer(cfg: DictConfig) -> None:
    """optim.name and what it cannot be combined with, refused before any process starts work: the optimizer is
    built as the run builds it (its arguments checked by the library's rules) and asked to refuse the layout."""
    o = cfg.optim
    if o.name == "zero_one_adam":
        raise NotImplementedError("optim.name=zero_one_adam is not implemented: 0/1 Adam's local steps (momentum "
                                  "synchronised only at growing intervals) are missing; optim=onebit_adam with "
                                  "optim.onebit.refresh_every covers its variance updates at intervals")
    if o.name not in OPTIMIZERS:
        raise ConfigError(f"optim.name={o.name!r} must be one of {', '.join(OPTIMIZERS)}")
    check_diloco(cfg)
    factory = optimizer_factory(cfg)
    if isinstance(factory, BoundOptimizer):
        factory.refuse_layout(zero_config(cfg), cfg.parallel)


def check_diloco(cfg: DictConfig) -> None:
    """parallel.replicas against the processes, and replicas only with DiLoCo (optim.diloco.inner_steps > 0; 0 is
    off); DiLoCo's own rules run when check_optimizer builds it."""
    inner_steps = _positive_int(cfg, "optim.diloco.inner_steps", minimum=0)
    if cfg.parallel.replicas != 1 and not inner_steps:
        raise ConfigError(f"parallel.replicas={cfg.parallel.replicas} needs DiLoCo: set optim.diloco.inner_steps > 0 "
                          "(the optimizer steps each replica takes between synchronisations)")
    replica_world(cfg.parallel.replicas, world_size(), RECIPE_KEYS)


def optimizer_factory(cfg: DictConfig, dims: ParallelDims | None = None):
    """optim.name's optimizer: the fastest AdamW where the step runs (fused on CPU and CUDA), offloaded or not;
    onebit_adam: that AdamW for optim.onebit.warmup_steps, then 1-bit compressed momentum; with
    optim.diloco.inner_steps > 0 the inner steps of DiLoCo over `dims`' replicas. Its arguments are checked as it
    is built (the library's rules, naming the recipe's keys): check_optimizer builds it before any process group."""
    o = cfg.optim
    hyper = {"lr": o.lr, "betas": tuple(o.betas), "eps": o.eps, "weight_decay": o.weight_decay}
    optimizer = FastAdamW(**hyper)
    if o.name == "onebit_adam":
        optimizer = OneBitAdam(warmup_steps=o.onebit.warmup_steps, block=o.onebit.block,
                               precondition=o.onebit.precondition, refresh_every=o.onebit.refresh_every,
                               refresh_dtype=o.onebit.refresh_dtype, max_update=o.onebit.max_update, **hyper,
                               keys=RECIPE_KEYS)
    d = o.diloco
    if d.inner_steps:
        replica_group = dims.replica_group if isinstance(dims, ReplicaDims) else None  # (one replica: none)
        optimizer = DiLoCo(optimizer, replica_group, inner_steps=d.inner_steps, outer_lr=d.outer_lr,
                           outer_momentum=d.outer_momentum, delta_dtype=d.delta_dtype, warmup_steps=d.warmup_steps,
                           keys=RECIPE_KEYS)
    return optimizer


def stop_signal(name: str) -> signal.Signals:
    """The signal a train.stop_signals entry names (SIGTERM or TERM); ValueError if none can be caught."""
    if not isinstance(name, str):
        raise ValueError(name)
    full = name.upper() if name.upper().startswith("SIG") else f"SIG{name.upper()}"
    sig = getattr(signal.Signals, full, None)
    if sig is None or sig in (signal.SIGKILL, signal.SIGSTOP):
        raise ValueError(name)
    return sig


def check_stop(cfg: DictConfig) -> None:
    """train.stop_signals names signals a process can catch; train.stop_grace_s is a positive time."""
    for name in cfg.train.stop_signals:
        try:
            stop_signal(name)
        except ValueError:
            raise ConfigError(f"train.stop_signals: {name!r} is not a signal a process can catch; use names such as "
                              "SIGTERM, SIGINT, SIGUSR1 (or [] for none)") from None
    if not cfg.train.stop_grace_s > 0:
        raise ConfigError(f"train.stop_grace_s={cfg.train.stop_grace_s!r} must be > 0 (seconds)")


def world_size() -> int:
    """The number of processes of this run (torchrun's WORLD_SIZE; 1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def data_parallel_degree(cfg: DictConfig, world: int | None = None) -> int:
    """parallel.dp as a number: auto (or null) is what the `world` processes leave after tp x pp x sp; a number
    is checked against them. ConfigError in one line when they do not fit."""
    par, world = cfg.parallel, world_size() if world is None else world
    world = replica_world(par.replicas, world, RECIPE_KEYS)  # each replica's layout
    from zero.dist.topology import fill_data_parallel

    return fill_data_parallel(None if par.dp in (None, "auto") else par.dp, world, par.tp, par.pp, par.sp,
                              par.get("cp", 1), RECIPE_KEYS)


def check_activations(cfg: DictConfig) -> None:
    """train.offload_activations moves the layer inputs that activation checkpointing saves: without it there is
    nothing to offload."""
    t = cfg.train
    if t.offload_activations and not t.activation_checkpointing:
        raise ConfigError("train.offload_activations=true offloads the layer inputs that activation checkpointing "
                          "saves, and train.activation_checkpointing=false saves none: set "
                          "train.activation_checkpointing=true, or train.offload_activations=false")


def check_layout(cfg: DictConfig) -> None:
    """Tensor, sequence and pipeline parallel rules against the model (its family's, then those of any model),
    then the degrees against the number of processes (parallel.dp=auto fills them), before any process group
    exists."""
    from zero.parallel.pipeline import check_pipeline_layout

    par, family = cfg.parallel, families.get(cfg)
    for key in ("tp", "pp", "sp", "ep", "cp"):
        _positive_int(cfg, f"parallel.{key}")
    if par.dp is not None and par.dp != "auto" and (not isinstance(par.dp, int) or isinstance(par.dp, bool)
                                                     or par.dp < 1):
        raise ConfigError(f"parallel.dp={par.dp!r} must be auto or an integer >= 1")
    tp, sp, pp = par.tp, par.sp, par.pp
    check_context_parallel(cfg)
    family.check_layout(cfg)
    if tp > 1 and cfg.train.seq_len % (tp * sp):  # (sp alone pads the sequence to a multiple of sp)
        raise ConfigError(f"train.seq_len={cfg.train.seq_len} must be a multiple of tp x sp = {tp * sp} "
                          "(the sequence is split over both)")
    if pp > 1 and cfg.train.tiled_loss:
        raise ConfigError("train.tiled_loss with parallel.pp > 1 is not supported (the last stage computes the "
                          "loss from its logits); turn it off")
    # The recipe's tiles (recipes/losses.py's tiled loss over the head's weight, recipes/parallelize.py's MLP tiles)
    # know no tensor-parallel split: the loss would run over a tp rank's vocabulary slice alone (a wrong loss, no
    # error), the MLP tiles fail in the first forward; this holds for every family.
    for key in ("tiled_loss", "tiled_mlp"):
        if tp > 1 and cfg.train[key]:
            raise ConfigError(f"train.{key} with parallel.tp > 1 is not supported (the tensor-parallel MLP and "
                              "vocabulary-parallel loss already split that work); turn it off")
    if pp > 1:
        split = None if par.pp_split is None else list(par.pp_split)
        check_pipeline_layout(par.pp_schedule, pp, par.pp_virtual_stages, family.num_layers(cfg), cfg.train.grad_accum,
                              split)
    elif par.pp_split is not None:
        raise ConfigError("parallel.pp_split is set but parallel.pp=1; set pp to the number of stages")
    check_degrees(cfg)  # (after the rules against the model: they name what to change first)


def check_context_parallel(cfg: DictConfig) -> None:
    """parallel.cp (ring attention) against the sequence, the attention and the other degrees, before any process
    group exists."""
    par = cfg.parallel
    cp = par.get("cp", 1)
    if cp == 1:
        return
    from sequence_parallel.ring import check_ring

    for key, fix in (("pp", "pipeline stages"), ("replicas", "DiLoCo replicas")):
        if par[key] > 1:
            raise ConfigError(f"parallel.cp={cp} with parallel.{key}={par[key]} is not implemented (ring attention "
                              f"is not wired with {fix}); set parallel.{key}=1 or parallel.cp=1")
    attention = cfg.model.get("attention", "dense")
    check_ring(attention, cfg.train.seq_len, par.sp, cp, cfg.model.sparse.block_size if attention == "sparse" else None,
               cfg.data.get("packing", "concat") == "document", RECIPE_KEYS)


def check_degrees(cfg: DictConfig) -> None:
    """The degrees against the number of processes (parallel.dp=auto fills them), then as the runtime's
    ParallelDims takes them (its own rules: ep borrowed from dp x sp) and the experts over ep, on numbers alone."""
    par, dp, cp = cfg.parallel, data_parallel_degree(cfg), cfg.parallel.get("cp", 1)
    ParallelDims(dp=dp, tp=par.tp, pp=par.pp, sp=par.sp, ep=par.ep, cp=cp,
                 world_size=dp * par.tp * par.pp * par.sp * cp)  # (its own rules: a LayoutError is a ConfigError)
    experts = families.get(cfg).num_experts(cfg) if par.ep > 1 else 0
    check_expert_parallel(experts, par.ep, RECIPE_KEYS)


def check_hpz(cfg: DictConfig) -> None:
    """zero.hpz_partition_size is the devices per node: nodes are blocks of that many consecutive ranks."""
    from zero.dist.topology import check_node_size

    check_node_size(cfg.zero.hpz_partition_size, world_size(), RECIPE_KEYS)


def is_moe(cfg: DictConfig) -> bool:
    """Whether the run's model has MoE layers (its family's spec says)."""
    return families.get(cfg).is_moe(cfg)


def num_params(cfg: DictConfig) -> int:
    """Parameters of the full (unsharded) model, a tied embedding counted once."""
    return families.get(cfg).num_params(cfg)


def vocab_size(cfg: DictConfig) -> int:
    """The model's vocabulary size (its family's spec reads it from the model section or the model's own config)."""
    return families.get(cfg).vocab_size(cfg)


def model_config(cfg: DictConfig):
    """The run's model config as its family takes it (the Llama's ModelConfig, a transformers config, ...)."""
    return families.get(cfg).model_config(cfg)


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
