"""Which features of the recipe combine: `python -m recipes.compat` composes every feature and every pair of
features as a run would, asks the recipe's own up-front check (recipes.config.check_config, what
`python -m recipes.pretrain` runs before any process group or model exists) and writes docs/compatibility.md;
`--check` exits 1 where that file is not what the check says today."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import functools
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

import zero
from recipes.config import CONFIG_DIR, ConfigError, check_config, compose_command_line, unknown_key_error
from recipes.planner.layouts import world_env

#: The refusals `python -m recipes.pretrain` reports in one line with exit 2 (its main's config errors).
REFUSALS = (ConfigError, zero.LayoutError, NotImplementedError)
#: The documentation page this command writes.
DOC = Path(__file__).resolve().parents[1] / "docs" / "compatibility.md"
#: Every feature is composed on this: the small dense Llama, one process unless a feature asks for more.
BASE = ("model=tiny", "parallel.dp=1")
#: Config groups (a `group=choice` override picks a file); any other override sets a key.
GROUPS = tuple(sorted(p.name for p in CONFIG_DIR.iterdir() if p.is_dir()))


@dataclass(frozen=True)
class Feature:
    """A named configuration: `overrides` make the feature; `needs` is the least it needs to be valid alone
    (applied first, so another feature's own overrides win over it)."""

    name: str
    title: str
    overrides: tuple[str, ...]
    needs: tuple[str, ...] = ()


#: The tiny Hugging Face configs the model=hf features train (written to a temporary directory): a Llama and a
#: Mixtral of the byte vocabulary, positions for the recipe's default train.seq_len.
HF_CONFIGS = {
    "hf_llama": dict(model_type="llama", vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512),
    "hf_mixtral": dict(model_type="mixtral", vocab_size=256, hidden_size=32, intermediate_size=48,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=512, num_local_experts=4, num_experts_per_tok=2,
                       sliding_window=None),
}

FEATURES = (
    Feature("zero1", "ZeRO stage 1", ("zero.stage=1",)),
    Feature("zero2", "ZeRO stage 2", ("zero.stage=2",)),
    Feature("zero3", "ZeRO stage 3", ("zero.stage=3",)),
    Feature("bf16", "bf16 compute", ("zero.dtype=bf16",)),
    Feature("fp16", "fp16 compute with loss scaling", ("zero.dtype=fp16",)),
    Feature("opt_cpu", "optimizer offload to CPU", ("zero.offload_optimizer=cpu",), ("zero.stage=1",)),
    Feature("opt_nvme", "optimizer offload to NVMe", ("zero.offload_optimizer=nvme", "zero.nvme_path=nvme"),
            ("zero.stage=1",)),
    Feature("delayed", "delayed parameter update (CPU offload)", ("zero.offload_delayed_update=true",),
            ("zero.stage=1", "zero.offload_optimizer=cpu")),
    Feature("param_cpu", "parameter offload to CPU", ("zero.offload_params=cpu",), ("zero.stage=3",)),
    Feature("param_nvme", "parameter offload to NVMe", ("zero.offload_params=nvme", "zero.nvme_path=nvme"),
            ("zero.stage=3",)),
    Feature("qwz", "int8 weight all-gathers (qwZ)", ("zero.quantize_weights=int8",), ("zero.stage=3",)),
    Feature("qgz", "int8 gradient reduce-scatter (qgZ)", ("zero.quantize_gradients=int8",), ("zero.stage=1",)),
    Feature("hpz", "hpZ secondary partition", ("zero.hpz_partition_size=2",), ("zero.stage=3", "parallel.dp=2")),
    Feature("dp2", "data parallel, dp=2", ("parallel.dp=2",)),
    Feature("tp2", "tensor parallel, tp=2", ("parallel.tp=2",)),
    Feature("pp2", "pipeline parallel, pp=2", ("parallel.pp=2",), ("train.grad_accum=2",)),
    Feature("sp2", "Ulysses sequence parallel, sp=2", ("parallel.sp=2",)),
    Feature("ep2", "expert parallel, ep=2", ("parallel.ep=2",), ("model=moe_tiny", "parallel.dp=2")),
    Feature("diloco", "DiLoCo, 2 replicas", ("parallel.replicas=2", "optim.diloco.inner_steps=2")),
    Feature("onebit", "1-bit Adam", ("optim=onebit_adam",)),
    Feature("moe", "MoE model (Llama)", ("model=moe_tiny",)),
    Feature("hf", "Hugging Face model (Llama)", ("model=hf", "model.hf.config=hf_llama")),
    Feature("hf_moe", "Hugging Face MoE model (Mixtral)", ("model=hf", "model.hf.config=hf_mixtral")),
    Feature("sparse", "block-sparse attention (sliding window)",
            ("model.attention=sparse", "model.sparse.layout=sliding_window")),
    Feature("nsa", "native sparse attention", ("model.attention=nsa",)),
    Feature("packed", "packed documents", ("data=tokenized", "data.path=prepared", "data.packing=document")),
    Feature("ckpt", "activation checkpointing", ("train.activation_checkpointing=true",)),
    Feature("offload_act", "activation offload", ("train.offload_activations=true",),
            ("train.activation_checkpointing=true",)),
    Feature("tiled_mlp", "tiled MLP", ("train.tiled_mlp=2",)),
    Feature("tiled_loss", "tiled loss", ("train.tiled_loss=true",)),
    Feature("million", "million-token preset (+experiment=million)", ("+experiment=million",)),
)


@functools.cache
def _parse_one(override: str):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_override(override)


def _parse(overrides: tuple[str, ...]) -> list:
    """Hydra's reading of command-line overrides (each parsed once: Hydra's parser is slow)."""
    return [_parse_one(o) for o in overrides]


def _key(override) -> str:
    return override.key_or_group


def _is_group(override) -> bool:
    return "." not in override.key_or_group and override.key_or_group in GROUPS


@dataclass
class Outcome:
    """What the recipe's check says of a composition: None (supported) or its one-line refusal."""

    refusal: str | None
    overrides: tuple[str, ...]


class Deriver:
    """Composes feature sets and runs the recipe's check. Each distinct choice of config groups is composed once,
    by Hydra as the command line composes it; the keys are then set on it with OmegaConf, as Hydra sets them, and
    put back after the check (a copy per composition would take most of the time)."""

    def __init__(self, hf_dir: Path) -> None:
        self.hf_dir = hf_dir
        self.composed: dict[tuple[str, ...], DictConfig | ConfigError] = {}

    def _value(self, text: str) -> str:
        for name in HF_CONFIGS:
            if text == f"model.hf.config={name}":
                return f"model.hf.config={self.hf_dir / name}"
        return text

    @contextlib.contextmanager
    def compose(self, overrides: tuple[str, ...]) -> Iterator[DictConfig]:
        """The config of `python -m recipes.pretrain <overrides>` while the block runs; ConfigError in one line
        where it does not compose."""
        parsed = _parse(tuple(self._value(o) for o in overrides))
        groups = {}
        for o in parsed:  # the last choice of a group wins, as on a command line
            if _is_group(o):
                groups[("+" if o.is_add() else "") + _key(o)] = o.input_line
        key = tuple(sorted(groups.values()))
        if key not in self.composed:
            try:
                self.composed[key] = compose_command_line(list(key))
            except ConfigError as e:
                self.composed[key] = e
        cfg = self.composed[key]
        if isinstance(cfg, ConfigError):
            raise cfg
        saved: list[tuple[DictConfig, str, object]] = []
        try:
            for o in parsed:
                if _is_group(o):
                    continue
                name = _key(o)
                parent, _, leaf = name.rpartition(".")
                node = OmegaConf.select(cfg, parent) if parent else cfg
                if not isinstance(node, DictConfig) or leaf not in node.keys():
                    raise unknown_key_error(name, *_deepest(cfg, name))
                saved.append((node, leaf, node._get_node(leaf)._value()))  # (an interpolation stays one)
                try:
                    node[leaf] = o.value()
                except Exception as e:  # a wrongly typed value: what Hydra says while composing
                    raise ConfigError(f"{name}={o.value()!r} is refused: {str(e).splitlines()[0]}") from None
            yield cfg
        finally:
            for node, leaf, value in reversed(saved):
                node[leaf] = value

    def check(self, overrides: tuple[str, ...]) -> str | None:
        """The recipe's refusal of `overrides` in one line, or None where it accepts them."""
        try:
            with self.compose(overrides) as cfg, world_env(cfg):
                check_config(cfg)
        except REFUSALS as e:
            return str(e).replace(str(self.hf_dir) + os.sep, "")
        return None


def _deepest(cfg: DictConfig, name: str) -> tuple[DictConfig, str]:
    """The deepest node on the path `name` that exists, and its path (for unknown_key_error)."""
    node, path = cfg, ""
    for part in name.split(".")[:-1]:
        if not isinstance(node, DictConfig) or part not in node.keys():
            break
        node, path = node[part], f"{path}.{part}" if path else part
    return node, path




@functools.cache
def _settings(overrides: tuple[str, ...]) -> dict[str, str]:
    """key (or group) -> the value each override sets."""
    return {("+" if o.is_add() else "") + _key(o): o.input_line.split("=", 1)[1] for o in _parse(overrides)}


def alternatives(a: Feature, b: Feature) -> str | None:
    """The key both features set to different values (they are two choices of one setting), or None."""
    mine, theirs = _settings(a.overrides), _settings(b.overrides)
    for key in mine:
        if key in theirs and mine[key] != theirs[key]:
            return key
    return None


def compositions(a: Feature, b: Feature) -> list[tuple[str, ...]]:
    """The configurations that hold both features: the base, what each needs, then both features' own
    overrides; where their needs set one key differently, each order is tried (the pair works if one does)."""
    if a == b:
        return [BASE + a.needs + a.overrides]
    first = BASE + a.needs + b.needs + a.overrides + b.overrides
    second = BASE + b.needs + a.needs + a.overrides + b.overrides
    return [first] if first == second or not set(_settings(a.needs)) & set(_settings(b.needs)) else [first, second]


#: Equivalence tests: each node id with the runs it checks against a reference (a single process, or the same run
#: without the feature where that is the claim: offload, hpZ, quantized collectives against the plain engine on the
#: decoded weights, packed documents against each document alone), every run as the features it combines. A
#: supported pair is covered where one run of one test holds both features. (dp2 stands for any dp > 1.)
EQUIVALENCE: dict[str, tuple[tuple[str, ...], ...]] = {
    # the layout harness (tests/parallel/harness.py): the tiny Llama through the recipe's parallelize steps
    "tests/parallel/test_layouts.py::test_pp2_every_schedule_with_dp2": (("pp2", "dp2"),),
    "tests/parallel/test_layouts.py::test_pp2_schedules_on_two_ranks_untied_and_zero_stages":
        (("pp2",), ("pp2", "zero1"), ("pp2", "zero2"), ("pp2", "zero3")),
    "tests/parallel/test_layouts.py::test_tp2_tied_and_untied": (("tp2",), ("tp2", "zero3")),
    "tests/parallel/test_layouts.py::test_tp4_and_tp_composed_with_dp_pp_sp":
        (("tp2", "dp2", "zero2"), ("tp2", "pp2"), ("tp2", "sp2", "zero1")),
    "tests/parallel/test_layouts.py::test_moe_with_pp2_and_tp2":
        (("moe", "pp2"), ("moe", "tp2"), ("moe", "tp2", "zero2")),
    "tests/parallel/test_layouts.py::test_moe_ep2_pp2":
        (("moe", "ep2", "dp2", "pp2"), ("moe", "ep2", "dp2", "pp2", "zero2")),
    "tests/parallel/test_layouts.py::test_zero3_moe_zero_bubble_and_offload_with_virtual_stages":
        (("pp2", "moe", "zero3"), ("pp2", "zero2", "opt_nvme"), ("pp2", "zero2", "opt_cpu")),
    # bf16 on 4 ranks against the bf16 one-rank run, within a tolerance an lr=0 control falls outside
    **{f"tests/parallel/test_bf16_layouts.py::test_bf16_layout_equals_one_rank[{case}]": (("bf16", *run),)
       for case, run in (("tp2_sp2", ("tp2", "sp2", "zero1")),
                         ("pp2_ep2_dp2_moe", ("pp2", "ep2", "dp2", "moe", "zero2")),
                         ("hf_mixtral_zero3_ep2_sp2_packed", ("hf_moe", "zero3", "ep2", "dp2", "sp2", "packed")),
                         ("packed_pp2_tp2", ("packed", "pp2", "tp2")),
                         ("packed_moe_zero3_ep2_sp2", ("packed", "moe", "zero3", "ep2", "dp2", "sp2")),
                         ("int8_weights_zero3", ("zero3", "dp2", "qwz")),
                         ("int8_weights_and_gradients_zero3", ("zero3", "dp2", "qwz", "qgz")))},
    # the recipe itself under torchrun against one process
    "tests/recipes/test_pretrain.py::test_torchrun_dp2_and_sp2_match_single_process":
        (("dp2",), ("sp2", "tiled_loss", "tiled_mlp", "ckpt", "offload_act")),
    "tests/recipes/test_pretrain.py::test_torchrun_moe_ep2_and_sp2_match_ep1":
        (("moe", "dp2", "ep2"), ("moe", "dp2", "ep2", "zero3"), ("moe", "dp2", "ep2", "sp2")),
    "tests/recipes/test_pretrain.py::test_torchrun_moe_pp2_stats_and_resume": (("moe", "pp2"),),
    "tests/recipes/test_pretrain.py::test_torchrun_pp_and_tp_layouts_match_single_process":
        (("dp2", "pp2"), ("dp2", "tp2", "zero2"), ("pp2", "tp2", "zero1")),
    # the ZeRO engine
    "tests/zero/test_stages.py::test_stage0_two_ranks_first_then_1_2_3":
        tuple((stage, "dp2", *ckpt) for stage in ("zero1", "zero2", "zero3") for ckpt in ((), ("ckpt",))),
    "tests/zero/test_stages.py::test_all_stages_four_ranks": (("zero1", "dp2"), ("zero2", "dp2"), ("zero3", "dp2")),
    "tests/zero/test_moe.py::test_moe_ep2_two_ranks_all_stages":
        tuple(("moe", "ep2", "dp2", *stage) for stage in ((), ("zero1",), ("zero2",), ("zero3",))),
    "tests/zero/test_moe.py::test_moe_ep2_four_ranks_sharded_experts_with_checkpointing":
        (("moe", "ep2", "dp2", "zero1", "ckpt"), ("moe", "ep2", "dp2", "zero3", "ckpt")),
    "tests/zero/test_offload.py::test_offload_trains_as_no_offload_at_every_stage": tuple(
        (stage, "dp2", *offload, *dtype) for dtype in ((), ("bf16",))
        for stage, offload in [(s, (o,)) for s in ("zero1", "zero2", "zero3") for o in ("opt_cpu", "opt_nvme")]
        + [("zero3", ("param_nvme",)), ("zero3", ("param_cpu", "opt_cpu")), ("zero3", ("param_nvme", "opt_nvme"))]),
    **{f"tests/zero/test_offload_delayed.py::test_delayed_update_lags_exactly_one_step[{stage}]":
       (("delayed", "opt_cpu", f"zero{stage}"),) for stage in (1, 2)},
    **{f"tests/zero/test_features.py::test_mixed_precision_loss_falls_and_tracks_fp32[{dtype}-stage{stage}]":
       ((dtype, "dp2", *((f"zero{stage}",) if stage else ())),) for dtype in ("bf16", "fp16") for stage in range(4)},
    "tests/zero/test_features.py::test_mixed_precision_loss_falls_and_tracks_fp32[bf16-stage2-offload_cpu]":
        (("bf16", "dp2", "zero2", "opt_cpu"),),
    "tests/zero/test_features.py::test_mixed_precision_loss_falls_and_tracks_fp32[fp16-stage3-offload_cpu]":
        (("fp16", "dp2", "zero3", "opt_cpu"),),
    "tests/zero/test_features.py::test_mixed_precision_loss_falls_and_tracks_fp32[bf16-stage3-offload_nvme]":
        (("bf16", "dp2", "zero3", "opt_nvme"),),
    "tests/zero/test_quantized_collectives.py::test_engine_equals_plain_engine_on_decoded_weights[2-False-int8-int4-1]":
        (("zero3", "dp2", "qwz", "qgz"),),
    "tests/zero/test_quantized_collectives.py::test_engine_equals_plain_engine_on_decoded_weights[4-False-int8-int8-2]":
        (("zero3", "dp2", "qwz", "qgz", "hpz"),),
    "tests/zero/test_quantized_collectives.py::test_engine_equals_plain_engine_on_decoded_weights[4-True-int8-int4-1]":
        (("zero3", "dp2", "qwz", "qgz", "moe", "ep2"),),
    "tests/zero/test_quantized_collectives.py::test_hpz_changes_no_value_and_keeps_nothing_after_the_step[True]":
        (("zero3", "dp2", "qwz", "hpz", "ckpt"),),
    "tests/zero/test_onebit.py::test_compressed_phase_equals_simulation[2-0-1-True-0-None]": (("onebit", "dp2"),),
    "tests/zero/test_onebit.py::test_compressed_phase_equals_simulation[2-1-2-True-0-None]":
        (("onebit", "dp2", "zero1"),),
    "tests/zero/test_diloco.py::test_diloco_equals_reference_of_simulated_replicas[2-2-1-0-sgd-0]": (("diloco",),),
    "tests/zero/test_diloco.py::test_diloco_equals_reference_of_simulated_replicas[4-2-2-2-sgd-0]":
        (("diloco", "dp2", "zero2"),),
    "tests/zero/test_diloco.py::test_replicas_with_expert_parallelism_match_ep1": (("diloco", "dp2", "moe", "ep2"),),
    "tests/recipes/test_diloco_recipe.py::test_torchrun_replicas_of_dp2_zero2_equal_simulated_replicas":
        (("diloco", "dp2", "zero2"),),
    # Ulysses and the long-sequence pieces
    "tests/sequence_parallel/test_sp_multirank.py::test_sharded_model_loss_and_grads_match_sp1[sp2]":
        (("sp2", "zero1"), ("sp2", "zero3", "tiled_mlp", "tiled_loss", "ckpt", "offload_act")),
    **{f"tests/sequence_parallel/test_sparse_ulysses.py::test_sparse_attention_sp2_equals_sp1[{attention}]":
       ((attention, "sp2", "zero1"), (attention, "sp2", "zero3", "tiled_mlp", "tiled_loss", "ckpt"))
       for attention in ("sparse", "nsa")},
    **{f"tests/sequence_parallel/test_packed_documents.py::test_packed_documents_equal_documents_alone[{attention}]":
       (("packed", *extra),) for attention, extra in (("dense", ()), ("sparse", ("sparse",)), ("nsa", ("nsa",)))},
    **{f"tests/sequence_parallel/test_packed_documents.py::test_packed_documents_under_ulysses_sp2[{attention}]":
       (("packed", "sp2", "tiled_loss", *extra),) for attention, extra in (("dense", ()), ("sparse", ("sparse",)),
                                                                          ("nsa", ("nsa",)))},
    "tests/sequence_parallel/test_checkpointing.py::test_checkpointing_gives_identical_gradients[True-True]":
        (("ckpt", "offload_act", "tiled_mlp"),),
    # the preset at 64k tokens: the last tokens as training computes them against a plain forward over their crop
    "tests/recipes/test_million.py::test_million_preset_at_64k_tokens_trains_and_matches_a_plain_crop":
        (("million", "sparse", "ckpt", "tiled_mlp", "tiled_loss"),),
    # the Hugging Face adapter (a Llama / Qwen3 and the MoE types)
    **{f"tests/hf/test_multirank.py::test_zero3_data_parallel_and_ulysses_equal_one_process[{kind}-{layout}]":
       ((model, *extra),) for kind, model in (("llama", "hf"), ("qwen3", "hf"), ("mixtral", "hf_moe"))
       for layout, extra in (("dp2_zero3", ("dp2", "zero3")), ("sp2", ("sp2",)))},
    # (the Qwen3-MoE run tiles its one dense MLP layer; hf_moe here is a Mixtral, which has none: not claimed)
    **{f"tests/hf/test_recipe.py::test_zero3_offloaded_tiled_checkpointed_run_and_a_resharded_resume_equal_the_plain_"
       f"run[{kind}]": ((model, "zero3", "param_cpu", "opt_cpu", *tiled, "tiled_loss", "ckpt"),)
       for kind, model, tiled in (("qwen3", "hf", ("tiled_mlp",)), ("qwen3_moe", "hf_moe", ()))},
    **{f"tests/hf/test_packing.py::test_packed_documents_equal_documents_alone[{kind}]": ((model, "packed"),)
       for kind, model in (("llama", "hf"), ("mixtral", "hf_moe"))},
}


@dataclass
class Table:
    """The derived table: per (feature, feature) with a <= b in FEATURES order, 'alt:<key>', None (supported) or
    a refusal."""

    features: tuple[Feature, ...]
    cells: dict[tuple[str, str], str | None]

    def cell(self, a: str, b: str) -> str | None:
        return self.cells[(a, b)] if (a, b) in self.cells else self.cells[(b, a)]

    def supported(self, a: str, b: str) -> bool:
        return self.cell(a, b) is None

    def pairs(self) -> list[tuple[str, str]]:
        """Every (feature, other feature) in FEATURES order, a before b."""
        names = [f.name for f in self.features]
        return [(a, b) for i, a in enumerate(names) for b in names[i + 1:]]

    def refusals(self) -> list[str]:
        """The distinct refusals, in order of first appearance (feature alone first, then pairs row by row)."""
        seen: dict[str, None] = {}
        for f in self.features:
            seen.update({r: None for r in [self.cell(f.name, f.name)] if r is not None})
        for a, b in self.pairs():
            r = self.cell(a, b)
            if r is not None and not r.startswith("alt:"):
                seen.setdefault(r)
        return list(seen)


# ------------------------------------------------------------------------------------------- pairwise runs
#: The settings that only place a run's computation on processes and memories: the degrees, ZeRO's sharding and
#: offload, hpZ. A run differs from the same run on one process without them only by rounding, so
#: tests/recipes/test_pairwise.py compares each pairwise run with that one-process run.
LAYOUT_KEYS = frozenset({"parallel.dp", "parallel.tp", "parallel.pp", "parallel.sp", "parallel.ep", "zero.stage",
                         "zero.offload_optimizer", "zero.offload_params", "zero.nvme_path",
                         "zero.hpz_partition_size"})
#: The features whose numbers depend on the layout, so that the plain one-process run is not their reference: the
#: pairwise runs leave them out; LAYOUT_RUNS hold them with the others, each compared with the reference said here.
LAYOUT_DEPENDENT = {
    "qwz": "the int8 weight all-gather rounds each rank's shard to its block scales, so the weights a step computes "
           "with depend on the sharding (one process gathers and rounds nothing): its runs are compared with the same "
           "run without it on one process within a tolerance for int8 rounding that a run which does not train "
           "(lr=1e-12) falls outside (`tests/recipes/test_layout_features.py`, QUANTIZED_TOLERANCE), and its engine "
           "tests with a plain engine given the decoded weights",
    "qgz": "the int8 gradient reduce-scatter rounds each rank's gradient before the sum, so the gradient depends on "
           "the ranks (one process reduces and rounds nothing): its runs are compared as qwz's are, and its engine "
           "tests with the codec's simulation",
    "onebit": "1-bit Adam compresses each rank's momentum with its own error feedback, so its compressed steps depend "
              "on the data-parallel ranks: its runs train 3 steps of its warm-up (AdamW over the exactly averaged "
              "gradient), compared with one process, then freeze and take one compressed step, whose every "
              "compressed all-reduce (each bucket, on the engine's group for it) is compared bitwise with the "
              "codec's one-process simulation over that group's ranks (the masters' update from the average is "
              "compared with a simulation by `tests/zero/test_onebit.py` only, at dp=2 with ZeRO stages 0-1)",
    "diloco": "DiLoCo's replicas train apart between synchronisations: another algorithm than one process over the "
              "global batch: its runs are compared with the replicas simulated in one process (each replica the "
              "run's other features on one process, on its replica's rows, and the outer step of "
              "`tests.zero.test_diloco.outer_step` on their masters every `optim.diloco.inner_steps` steps)",
    "million": "the preset's point is its size (a 1,048,576-token sequence), far beyond a test's runs: its runs "
               "train it at 128 tokens (a sliding window of 3 blocks of 16 tokens; fp32, which its crop check needs) "
               "against one process without the layout (the gradient norm within 5e-5, the preset's model rounding "
               "its gradient sums further than the tiny models), and `tests/recipes/test_million.py` at 64k tokens "
               "against a plain forward over the crop",
}
#: Features the pairwise runs never hold all together although the check accepts them (their pairs are held by other
#: runs), and why.
APART = {
    frozenset({"bf16", "moe", "tp2"}):
        "under tp the MoE router's input carries the bf16 all-reduce's rounding, so a token near a top-k tie can "
        "take another expert: by step 3 the gradient norm had drifted 1.7 bf16 roundoffs from one process's (the "
        "dense model on the same layout 0.46), beyond what rounding explains (tests/parallel/test_bf16_layouts.py "
        "leaves MoE under tp to fp32 for the same reason)",
}
#: The test that runs each pairwise run through the recipe under torchrun against one process.
PAIRWISE_TEST = "tests/recipes/test_pairwise.py::test_run_equals_one_process"
#: The runs that hold the features of LAYOUT_DEPENDENT with the others (each on at most MAX_PROCESSES processes, the
#: check accepting it whole), which LAYOUT_TEST trains through the recipe against the reference LAYOUT_DEPENDENT
#: names for the feature; together they hold every supported pair of such a feature.
LAYOUT_RUNS: tuple[tuple[str, ...], ...] = (
    # DiLoCo's 2 replicas, each of 2 processes or of one (4 processes at most); in bf16 but where another dtype is
    # the point (fp16) or the preset refuses it (million: its crop check compares with an fp32 forward)
    ("zero3", "bf16", "opt_cpu", "param_cpu", "hpz", "dp2", "diloco", "hf", "sparse", "packed", "ckpt", "offload_act",
     "tiled_mlp", "tiled_loss"),
    ("zero1", "fp16", "opt_cpu", "delayed", "tp2", "diloco"),
    ("zero3", "bf16", "opt_nvme", "param_nvme", "sp2", "diloco", "hf_moe"),
    ("bf16", "diloco", "nsa"),
    ("diloco", "million"),
    # the quantized collectives (qgZ alone at the stages below 3, which qwZ does not take)
    ("zero3", "bf16", "qwz", "qgz", "dp2", "diloco"),
    ("zero3", "fp16", "opt_cpu", "delayed", "param_cpu", "qwz", "qgz", "dp2", "hf", "sparse", "packed", "ckpt",
     "offload_act", "tiled_mlp", "tiled_loss"),
    ("zero3", "bf16", "opt_nvme", "param_nvme", "qwz", "qgz", "dp2", "sp2", "hf_moe"),
    ("zero3", "bf16", "qwz", "qgz", "dp2", "tp2"),
    ("zero3", "bf16", "qwz", "qgz", "dp2", "pp2", "nsa"),
    ("zero3", "qwz", "qgz", "dp2", "million"),
    ("zero1", "bf16", "qgz", "dp2"),
    ("zero2", "bf16", "qgz", "dp2"),
    # the million-token preset at 128 tokens (fp32 only)
    ("zero3", "opt_cpu", "param_cpu", "hpz", "dp2", "sp2", "packed", "offload_act", "million"),
    ("zero1", "opt_cpu", "delayed", "dp2", "moe", "million"),
    ("zero2", "opt_nvme", "dp2", "million"),
    ("zero3", "param_nvme", "sp2", "million"),
    # 1-bit Adam
    ("bf16", "dp2", "onebit", "hf", "sparse", "packed", "ckpt", "offload_act", "tiled_mlp", "tiled_loss"),
    ("bf16", "dp2", "sp2", "onebit", "hf_moe"),
    ("bf16", "dp2", "ep2", "onebit", "moe", "nsa"),
    ("dp2", "onebit", "million"),
)
#: The runs of LAYOUT_RUNS in the default suite (the others are slow), on 2 processes each: together they hold every
#: feature of LAYOUT_DEPENDENT.
LAYOUT_DEFAULT = (("bf16", "diloco", "nsa"), ("zero3", "qwz", "qgz", "dp2", "million"),
                  ("bf16", "dp2", "ep2", "onebit", "moe", "nsa"))
#: The test that trains each run of LAYOUT_RUNS against its reference.
LAYOUT_TEST = "tests/recipes/test_layout_features.py::test_layout_dependent_run_equals_its_reference"
#: Processes a pairwise run may use (a test machine's budget): a layout needing more is not built.
MAX_PROCESSES = 4
#: Greedy orderings tried (ties broken by a generator seeded with the trial's number); the fewest runs win.
TRIALS = 20


def command_line(run: tuple[str, ...], features: tuple[Feature, ...] = FEATURES) -> tuple[str, ...]:
    """The overrides of a run of several features, composed as a pair is: the base, what each feature needs, then
    every feature's own overrides (features in FEATURES order, so the later of two needs wins)."""
    chosen = [f for f in features if f.name in run]
    return BASE + tuple(o for f in chosen for o in f.needs) + tuple(o for f in chosen for o in f.overrides)


def processes(run: tuple[str, ...], features: tuple[Feature, ...] = FEATURES) -> int:
    """The processes torchrun starts for a run: the product of its degrees (replicas x dp x tp x pp x sp)."""
    settings = _settings(command_line(run, features))
    count = 1
    for key in ("parallel.replicas", "parallel.dp", "parallel.tp", "parallel.pp", "parallel.sp"):
        count *= int(settings.get(key, 1))
    return count


def layout_only(feature: Feature) -> bool:
    """Whether every key a feature sets is a layout key (what it needs may set others: ep2 needs an MoE model)."""
    return all(key in LAYOUT_KEYS for key in _settings(feature.overrides))


def pairwise_test_id(run: tuple[str, ...]) -> str:
    return "-".join(run)


def _joins(mask: int, i: int, fits: list[int]) -> bool:
    """Whether feature i goes with every feature of `mask` (bit masks over the pairwise features)."""
    return mask & ~fits[i] & ~(1 << i) == 0


def _greedy(fits: list[int], fine, rng) -> list[int]:
    """One greedy covering of every pair that `fits` holds (fits[i]: the features that go with feature i): each run
    starts from the uncovered pair whose features have the most uncovered pairs left, then takes the feature that
    covers the most new pairs with the run's features while every pair stays supported and `fine` (the run's
    processes and refused sets) holds; ties are broken by `rng`."""
    n, left, runs = len(fits), list(fits), []
    while any(left):
        counts = [m.bit_count() for m in left]
        a, b = max(((i, j) for i in range(n) for j in range(i + 1, n) if left[i] >> j & 1),
                   key=lambda p: (counts[p[0]] + counts[p[1]], rng.random()))
        run = 1 << a | 1 << b
        while True:
            best, best_score = None, None
            for i in range(n):
                if run >> i & 1 or not _joins(run, i, fits) or not fine(run | 1 << i):
                    continue
                gain = (left[i] & run).bit_count()
                score = (gain, rng.random())
                if gain and (best_score is None or score > best_score):
                    best, best_score = i, score
            if best is None:
                break
            run |= 1 << best
        for i in range(n):
            if run >> i & 1:
                left[i] &= ~run
        runs.append(run)
    return runs


def _pairs_of(run: int) -> list[tuple[int, int]]:
    members = [i for i in range(run.bit_length()) if run >> i & 1]
    return [(a, b) for k, a in enumerate(members) for b in members[k + 1:]]


def _drop_runs(runs: list[int], fits: list[int], fine) -> list[int]:
    """Fewer runs holding the same pairs: a run (the smallest first) goes where each pair that no other run holds
    can be added to another run (both its features, every pair of the grown run supported and `fine`); repeated
    while one goes."""
    runs = list(runs)
    while True:
        for r in sorted(range(len(runs)), key=lambda k: (runs[k].bit_count(), k)):
            rest = runs[:r] + runs[r + 1:]
            for a, b in _pairs_of(runs[r]):
                if any(x >> a & 1 and x >> b & 1 for x in rest):
                    continue
                for k, x in enumerate(rest):
                    grown = x | 1 << a | 1 << b
                    if _joins(grown, a, fits) and _joins(grown, b, fits) and fine(grown):
                        rest[k] = grown
                        break
                else:
                    break
            else:
                runs = rest
                break
        else:
            return runs


_RUNS: dict[tuple, list[tuple[str, ...]]] = {}


def pairwise_runs(table: Table) -> list[tuple[str, ...]]:
    """A small set of runs, each a set of features the recipe's check accepts together on at most MAX_PROCESSES
    processes and holding no set of APART, that holds every supported pair of the features not in LAYOUT_DEPENDENT:
    of TRIALS greedy coverings, each followed by dropping the runs whose pairs fit into the others, the one with the
    fewest runs (then the fewest processes); deterministic. A run the check refuses as a whole (three features
    together) is cut down to the smallest set it still refuses, which no run may then hold, and the covering is
    redone."""
    import random

    key = (tuple(f.name for f in table.features), tuple(sorted(table.cells.items(), key=str)))
    if key in _RUNS:
        return list(_RUNS[key])
    names = [f.name for f in table.features if f.name not in LAYOUT_DEPENDENT and table.supported(f.name, f.name)]
    fits = [sum(1 << j for j, b in enumerate(names) if b != a and table.supported(a, b)) for a in names]
    sizes: dict[int, int] = {}
    refused = [sum(1 << names.index(n) for n in apart) for apart in APART if apart <= set(names)]

    def as_run(mask: int) -> tuple[str, ...]:
        return tuple(name for i, name in enumerate(names) if mask >> i & 1)

    def size(mask: int) -> int:
        if mask not in sizes:
            sizes[mask] = processes(as_run(mask), table.features)
        return sizes[mask]

    def fine(mask: int) -> bool:
        return size(mask) <= MAX_PROCESSES and not any(r & mask == r for r in refused)

    with _hf_configs() as hf_dir:
        deriver = Deriver(hf_dir)
        while True:
            for r in refused:  # (a refused pair: no run can hold it)
                if r.bit_count() == 2:
                    a, b = _pairs_of(r)[0]
                    fits[a] &= ~(1 << b)
                    fits[b] &= ~(1 << a)
            coverings = [_drop_runs(_greedy(fits, fine, random.Random(trial)), fits, fine) for trial in range(TRIALS)]
            best = min(coverings, key=lambda runs: (len(runs), sum(map(size, runs))))
            bad = [run for run in best if deriver.check(command_line(as_run(run), table.features)) is not None]
            if not bad:
                _RUNS[key] = [as_run(run) for run in best]
                return list(_RUNS[key])
            for run in bad:  # drop features while the rest is still refused
                for i in range(len(names)):
                    rest = run & ~(1 << i)
                    if rest != run and rest.bit_count() >= 2 and \
                            deriver.check(command_line(as_run(rest), table.features)) is not None:
                        run = rest
                refused.append(run)


def declared(table: Table, runs: list[tuple[str, ...]] | None = None) -> dict[str, tuple[tuple[str, ...], ...]]:
    """EQUIVALENCE and the pairwise runs (by default pairwise_runs(table)), each under its test id."""
    runs = pairwise_runs(table) if runs is None else runs
    return {**EQUIVALENCE, **{f"{PAIRWISE_TEST}[{pairwise_test_id(run)}]": (run,) for run in runs},
            **{f"{LAYOUT_TEST}[{pairwise_test_id(run)}]": (run,) for run in LAYOUT_RUNS}}


def runs_on_page(text: str) -> list[tuple[str, ...]]:
    """The pairwise runs listed on the page `render` writes (the test parametrizes over them: deriving them
    takes the check's whole table, too long for collecting tests; tests/recipes/test_compat.py keeps the page
    current)."""
    lines = text.split(PAIRWISE_HEADING + "\n", 1)[1].split("\n## ", 1)[0].splitlines()
    return [tuple(cells[2].strip(" `").split()) for cells in (line.split("|") for line in lines)
            if len(cells) > 3 and cells[1].strip().isdigit()]


PAIRWISE_HEADING = "## Pairwise runs"


def coverage(table: Table, equivalence: dict | None = None) -> dict[tuple[str, str], list[str]]:
    """Per feature (a, a) and pair (a, b) the equivalence tests with a run that holds it (by default every declared
    test: EQUIVALENCE and the pairwise runs)."""
    equivalence = declared(table) if equivalence is None else equivalence
    order = {f.name: i for i, f in enumerate(table.features)}
    out: dict[tuple[str, str], list[str]] = {}
    for test, runs in equivalence.items():
        for run in runs:
            names = sorted(set(run) & set(order), key=order.__getitem__)  # (a table of some features: theirs)
            for i, a in enumerate(names):
                for b in names[i:]:
                    tests = out.setdefault((a, b), [])
                    if test not in tests:
                        tests.append(test)
    return out


def _anchor(index: int) -> str:
    return f"r{index}"


def render(table: Table, runs: list[tuple[str, ...]] | None = None) -> str:
    """docs/compatibility.md: the features, the matrix, the refusals, the pairwise runs (`runs`, by default
    pairwise_runs(table)), the equivalence tests of each supported pair and the supported pairs no equivalence test
    covers yet, with why."""
    runs = pairwise_runs(table) if runs is None else runs
    covered = coverage(table, declared(table, runs))
    code = {r: i + 1 for i, r in enumerate(table.refusals())}
    lines = _render_features(table) + _render_matrix(table, covered, code) + _render_refusals(table, code)
    lines += _render_runs(table, runs) + _render_layout_runs(table) + _render_covered(table, covered)
    return "\n".join(lines) + "\n"


def _render_features(table: Table) -> list[str]:
    features = table.features
    lines = [
        "# Which features combine",
        "",
        "Generated by `python -m recipes.compat` from the recipe's own check, `recipes.config.check_config`, the one "
        "`python -m recipes.pretrain` runs before any process group or model exists: do not edit by hand. "
        "`python -m recipes.compat --check` (run by `tests/recipes/test_compat.py`) fails when this page is not what "
        "the check says today.",
        "",
        "Each feature is a few overrides on `" + " ".join(BASE) + "`. A pair is composed as one command line: the "
        "base, what each feature needs to be valid alone, then both features' own overrides (so a feature's own "
        "setting wins over what the other needs; where their needs set one key differently both orders are tried, "
        "and the pair is supported if one passes), checked with `WORLD_SIZE` the product of the degrees "
        "(replicas x dp x tp x pp x sp) as torchrun would set it. Every refusal is the one line the recipe prints "
        "before exiting 2. What the check accepts can still fail later (three features together, a GPU-only path, "
        "memory); the equivalence tests below are what shows a pair trains correctly.",
        "",
        "## Features",
        "",
        "| # | feature | overrides | needs |",
        "|---|---|---|---|",
    ]
    for i, f in enumerate(features, 1):
        needs = " ".join(f"`{o}`" for o in f.needs)
        lines.append(f"| {i} | **{f.name}**: {f.title} | {' '.join(f'`{o}`' for o in f.overrides)} | {needs} |")
    return lines


def _render_matrix(table: Table, covered: dict, code: dict[str, int]) -> list[str]:
    features = table.features
    lines: list[str] = []
    lines += [
        "",
        "`hf_llama` and `hf_mixtral` are tiny config.json files `recipes.compat` writes (`HF_CONFIGS`); "
        "`data.path=prepared` stands for any directory `python -m recipes.prepare_data` wrote (the check does not "
        "read it).",
        "",
        "## Matrix",
        "",
        "✓ supported, with an equivalence test; ○ supported, not yet covered by an equivalence test; "
        "**Rn** refused (the reason is [below](#refusals)); = two values of one setting (e.g. zero.stage). "
        "The diagonal is the feature alone. Columns are numbered as the rows.",
        "",
        "| | " + " | ".join(str(i) for i in range(1, len(features) + 1)) + " |",
        "|---|" + "---|" * len(features),
    ]
    for i, a in enumerate(features, 1):
        row = []
        for b in features:
            result = table.cell(a.name, b.name)
            key = (a.name, b.name) if (a.name, b.name) in table.cells else (b.name, a.name)
            if result is None:
                row.append("✓" if key in covered else "○")
            elif result.startswith("alt:"):
                row.append("=")
            else:
                row.append(f"[R{code[result]}](#{_anchor(code[result])})")
        lines.append(f"| {i} {a.name} | " + " | ".join(row) + " |")
    return lines


def _render_refusals(table: Table, code: dict[str, int]) -> list[str]:
    features, lines = table.features, []
    lines += ["", "## Refusals", ""]
    for r in table.refusals():
        where = [f"{a}" if a == b else f"{a} + {b}" for a, b in
                 [(f.name, f.name) for f in features] + table.pairs() if table.cell(a, b) == r]
        lines.append(f'<a id="{_anchor(code[r])}"></a>**R{code[r]}** ({len(where)}: {", ".join(where)}): {r}')
        lines.append("")
    return lines


def _render_runs(table: Table, runs: list[tuple[str, ...]]) -> list[str]:
    features, lines = table.features, []
    names = [f.name for f in features]
    comparable = [n for n in names if n not in LAYOUT_DEPENDENT and table.supported(n, n)]
    held = {(a, b) for run in runs for i, a in enumerate(run) for b in run[i + 1:]}
    lines += [PAIRWISE_HEADING, "",
              f"`{PAIRWISE_TEST.split('::')[0]}` trains each run below through the recipe, `torchrun "
              "--nproc_per_node N -m recipes.pretrain` with the run's overrides (composed as a pair's are) on the tiny "
              "model for a few steps, and compares every step's loss and gradient norm with the same run on one "
              "process without its layout settings (`recipes.compat.LAYOUT_KEYS`: the degrees, ZeRO's stage, "
              "offload and hpZ; `train.grad_accum` times dp, so that the global batch and its micro-batches are the "
              "same), at the tolerances that test states for fp32, bf16 and fp16. The runs are a greedy pairwise "
              f"covering (`recipes.compat.pairwise_runs`) of the {len(held)} supported pairs of the "
              f"{len(comparable)} features whose numbers do not depend on the layout, each run accepted as a whole "
              f"by the check and on at most {MAX_PROCESSES} processes: {len(runs)} runs. The features left out "
              "(`recipes.compat.LAYOUT_DEPENDENT`) are held by the runs of the [next section]"
              "(#runs-of-the-features-that-depend-on-the-layout), each against its own reference."
              + "".join(f" No run holds {' + '.join(n for n in names if n in apart)} together (`recipes.compat.APART`):"
                        f" {why}." for apart, why in APART.items()), "",
              "| # | features | processes | pairs |", "|---|---|---|---|"]
    for i, run in enumerate(runs, 1):
        lines.append(f"| {i} | `{' '.join(run)}` | {processes(run, features)} | {len(run) * (len(run) - 1) // 2} |")
    return lines


LAYOUT_HEADING = "## Runs of the features that depend on the layout"


def _render_layout_runs(table: Table) -> list[str]:
    names = [f.name for f in table.features]
    held = {(a, b) for run in LAYOUT_RUNS for i, a in enumerate(run) for b in run[i + 1:]
            if a in LAYOUT_DEPENDENT or b in LAYOUT_DEPENDENT}
    lines = ["", LAYOUT_HEADING, "",
             f"`{LAYOUT_TEST.split('::')[0]}` trains each run below through the recipe (its `train()` on as many "
             "gloo ranks as torchrun would start, with the pairwise runs' settings, `tests/recipes/pairwise.py`) and "
             "compares every step's loss and gradient norm with the reference of the layout-dependent feature it "
             "holds, at the pairwise runs' tolerance for its dtype (`recipes.compat.LAYOUT_RUNS`; "
             f"{len(LAYOUT_RUNS)} runs on at most {MAX_PROCESSES} processes, each accepted whole by the check, "
             f"holding {len(held)} pairs with such a feature; the runs marked * are in the default suite, the others "
             "slow). The references, and why the plain one-process run is not one:", ""]
    lines += [f"- **{name}**: {why}." for name, why in LAYOUT_DEPENDENT.items() if name in names]
    lines += ["", "| # | features | processes | reference |", "|---|---|---|---|"]
    for i, run in enumerate(LAYOUT_RUNS, 1):
        if "diloco" in run:
            reference = "replicas simulated in one process"
        elif "onebit" in run:
            reference = "one process (warm-up); the codec's simulation (compressed all-reduces)"
        else:
            reference = "one process"
        if set(run) & {"qwz", "qgz"}:
            reference += ", without the int8 collectives, at the int8 tolerance"
        mark = "*" if run in LAYOUT_DEFAULT else ""
        lines.append(f"| {i}{mark} | `{' '.join(run)}` | {processes(run, table.features)} | {reference} |")
    return lines


def _render_covered(table: Table, covered: dict) -> list[str]:
    names, lines = [f.name for f in table.features], []
    lines += ["", "## Equivalence tests", "",
              "The supported features and pairs an equivalence test trains against a reference (one process, or the "
              "same run without the feature where the feature's claim is that it changes nothing). The runs each "
              "test makes are declared in `recipes.compat.EQUIVALENCE`, and the pairwise runs above under "
              f"`{PAIRWISE_TEST}[<features>]`, the runs of the layout-dependent features under "
              f"`{LAYOUT_TEST}[<features>]`; `tests/recipes/test_compat.py` checks that every test named in "
              "EQUIVALENCE exists.", "",
              "| features | tests |", "|---|---|"]
    for a, b in [(n, n) for n in names] + table.pairs():
        if (a, b) in covered and table.supported(a, b):
            tests = "<br>".join(f"`{t}`" for t in covered[(a, b)])
            lines.append(f"| {a if a == b else f'{a} + {b}'} | {tests} |")
    missing = [(a, b) for a, b in table.pairs() if table.supported(a, b) and (a, b) not in covered]
    alone = [n for n in names if table.supported(n, n) and (n, n) not in covered]
    lines += ["", "## Not yet covered by an equivalence test", "",
              f"Supported by the check, with no equivalence test holding both: {len(missing)} of "
              f"{sum(table.supported(a, b) for a, b in table.pairs())} supported pairs"
              + (f"; features with none at all: {', '.join(alone)}." if alone else ".")
              + (" By the feature that keeps each out of the pairwise runs (its numbers depend on the layout; the "
                 "pairs its own tests hold are above), with why:" if missing else ""), ""]
    for name, why in LAYOUT_DEPENDENT.items():
        others = [b if a == name else a for a, b in missing if name in (a, b)
                  and next(n for n in (a, b) if n in LAYOUT_DEPENDENT) == name]
        if others:
            lines.append(f"- **{name}** with {', '.join(others)} ({len(others)}): {why}.")
    rest = [f"{a} + {b}" for a, b in missing if a not in LAYOUT_DEPENDENT and b not in LAYOUT_DEPENDENT]
    if rest:
        lines.append(f"- {', '.join(rest)} ({len(rest)}): no pairwise run holds them (the check refuses them "
                     "composed as a run).")
    return lines


@contextlib.contextmanager
def _hf_configs() -> Iterator[Path]:
    """A temporary directory holding HF_CONFIGS, each as <name>/config.json."""
    with tempfile.TemporaryDirectory() as directory:
        hf_dir = Path(directory)
        for name, values in HF_CONFIGS.items():
            (hf_dir / name).mkdir()
            (hf_dir / name / "config.json").write_text(json.dumps(values))
        yield hf_dir


def derive(features: tuple[Feature, ...] = FEATURES) -> Table:
    """Every feature alone and every pair, as the recipe's check sees them."""
    with _hf_configs() as hf_dir:
        deriver = Deriver(hf_dir)
        cells: dict[tuple[str, str], str | None] = {}
        for i, a in enumerate(features):
            for b in features[i:]:
                alt = alternatives(a, b) if a != b else None
                if alt is not None:
                    cells[(a.name, b.name)] = f"alt:{alt}"
                    continue
                refusals = [deriver.check(c) for c in compositions(a, b)]
                cells[(a.name, b.name)] = None if None in refusals else refusals[0]
    return Table(features, cells)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipes.compat", description=__doc__)
    parser.add_argument("--check", action="store_true", help=f"exit 1 if {DOC.name} differs from what the check "
                        "says today (writes nothing)")
    parser.add_argument("--out", type=Path, default=DOC, help="the page to write or check (default: %(default)s)")
    args = parser.parse_args(argv)
    text = render(derive())
    if not args.check:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"wrote {args.out}")
        return 0
    old = args.out.read_text() if args.out.exists() else ""
    if old == text:
        return 0
    diff = difflib.unified_diff(old.splitlines(), text.splitlines(), str(args.out), "derived now", lineterm="", n=0)
    print("\n".join(list(diff)[:40]), file=sys.stderr)
    print(f"error: {args.out} is out of date: run python -m recipes.compat and commit it", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
