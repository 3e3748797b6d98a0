"""`python -m recipes.pretrain model=hf` at every layout a family passed in the coverage sweep (docs/hf_coverage.md:
dp2_zero3, sp2, ep2, tp2, pp2) equals one process of the same run: the losses and gradient norms of every step and
the final weights, at the equivalence tolerance (tests/equivalence.py). The run's config is the sweep's tiny config
of the family, written as a config.json; the ranks run the recipe's train() (tests.recipes.cli.train_on_ranks).

The default suite runs two representatives in one spawn (a tensor-parallel dense model, a pipeline of a model with
a tied head); every passing family x layout runs under -m slow."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from moe_lst.models.hf.config import coverage

import zero
from tests.equivalence import RTOL
from tests.multirank import run_multirank
from tests.recipes.cli import train_on_ranks

#: The recipe's keys of each layout of the sweep on 2 processes. The global batch is the same everywhere: 2
#: micro-batches of 4 on one process (and on tensor-, sequence- and pipeline-parallel ranks, the pipeline's
#: micro-batches), one per rank where the ranks split the data (dp2_zero3, ep2 over dp=2).
LAYOUTS = {
    "dp2_zero3": ["parallel.dp=2", "zero.stage=3", "train.grad_accum=1"],
    "sp2": ["parallel.sp=2"],
    "ep2": ["parallel.dp=2", "parallel.ep=2", "train.grad_accum=1"],
    "tp2": ["parallel.tp=2"],
    "pp2": ["parallel.pp=2"],
}
#: AdamW with a large epsilon and neither clipping nor decay: its update is then close to linear in the gradient
#: (lr / eps times it, for the small gradients of a tiny model), so the final weights compare the gradients too,
#: where the usual epsilon would make each first update lr * sign(gradient), flipped by rounding near zero.
COMMON = ["model=hf", "train.seq_len=16", "train.micro_batch_size=4", "train.grad_accum=2", "train.steps=2",
          "train.eval_batches=0", "train.eval_every=0", "train.sample_tokens=0", "train.progress=false",
          "optim.warmup_steps=1", "optim.eps=0.01", "optim.grad_clip=0", "optim.weight_decay=0",
          "data.max_bytes=1000000", "wandb.mode=disabled"]
#: The default suite's cases: small, and the two layouts the recipe took last.
DEFAULT = (("llama", "tp2"), ("gemma", "pp2"))


def passing_cases() -> list[tuple[str, str]]:
    """(family, layout) for every family passing the sweep's core checks and every layout it passed."""
    from moe_lst.models.hf.coverage import passes

    return [(kind, layout) for kind, record in sorted(coverage().items()) if passes(record)
            for layout in LAYOUTS if record["features"][layout] == "pass"]


def _config_dir(root: Path, kind: str) -> Path:
    from moe_lst.models.hf.coverage import tiny_config

    directory = root / kind / "config"
    if not (directory / "config.json").is_file():
        tiny_config(kind).save_pretrained(directory)
    return directory


def _overrides(root: Path, kind: str, name: str, layout: list[str]) -> list[str]:
    return [*COMMON, f"model.hf.config={_config_dir(root, kind)}", f"run_dir={root / kind / name}", *layout]


def _train_each(runs: list[list[str]]) -> None:
    """Several recipe runs on this rank, in order (one spawn for all of them)."""
    for overrides in runs:
        train_on_ranks(1, overrides)


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from recipes.config import checkpoints

    return zero.consolidate(zero.open_checkpoint(checkpoints(run_dir)[-1]))


def assert_same_run(got: Path, want: Path, label: str) -> None:
    """Per-step losses and gradient norms, then every final weight, equal the one-process run's."""
    a, b = _records(got), _records(want)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2], label
    for x, y in zip(a, b):
        for key in ("loss", "grad_norm"):
            assert math.isclose(x[key], y[key], rel_tol=RTOL), f"{label} step {x['step']} {key}: {x[key]} != {y[key]}"
    mine, ref = _weights(got), _weights(want)
    assert mine.keys() == ref.keys(), label
    for name, value in ref.items():
        torch.testing.assert_close(mine[name].reshape(value.shape), value, rtol=RTOL, atol=1e-6,
                                   msg=lambda m, n=name: f"{label} {n}: {m}")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf_layouts")


def _reference(root: Path, kind: str) -> Path:
    """The one-process run of `kind` (once per family for the module)."""
    run_dir = root / kind / "one"
    if not (run_dir / "metrics.jsonl").is_file():
        train_on_ranks(1, _overrides(root, kind, "one", []))
    return run_dir


def test_the_default_cases_are_passing_layouts():
    cases = passing_cases()
    assert set(DEFAULT) <= set(cases)
    assert {layout for _, layout in cases} == set(LAYOUTS)


def test_tensor_and_pipeline_parallel_runs_equal_one_process(root):
    runs = [_overrides(root, kind, layout, LAYOUTS[layout]) for kind, layout in DEFAULT]
    run_multirank(_train_each, 2, runs, timeout=300)
    for kind, layout in DEFAULT:
        assert_same_run(root / kind / layout, _reference(root, kind), f"{kind} {layout}")


#: MoE families the recipe trains at tp=2 with their experts split by hidden units (expert tensor parallelism): routed
#: experts alone with transformers' balancing loss (mixtral), DeepSeek-V3's grouped sigmoid routing with shared
#: experts, a first dense layer and latent attention, GPT-OSS's interleaved gate / up pairs with expert biases beside
#: its attention with sinks (run whole on the gathered sequence).
MOE_TP = ("mixtral", "deepseek_v3", "gpt_oss")


@pytest.mark.slow
def test_moe_families_at_tp2_equal_one_process(root):
    assert {(kind, "tp2") for kind in MOE_TP} <= set(passing_cases())
    run_multirank(_train_each, 2, [_overrides(root, kind, "tp2", LAYOUTS["tp2"]) for kind in MOE_TP], timeout=600)
    for kind in MOE_TP:
        assert_same_run(root / kind / "tp2", _reference(root, kind), f"{kind} tp2")


@pytest.mark.slow
def test_moe_at_ep2_and_tp2_on_four_processes_equals_one_process(root):
    # (experts split by ep over the data-parallel ranks and by hidden units over tp; the balancing loss per dp rank's
    # micro-batch, as one process computes it per micro-batch)
    run_multirank(_train_each, 4, [_overrides(root, "mixtral", "ep2_tp2", [*LAYOUTS["ep2"], "parallel.tp=2"])],
                  timeout=600)
    assert_same_run(root / "mixtral" / "ep2_tp2", _reference(root, "mixtral"), "mixtral ep2 x tp2")


@pytest.mark.slow
@pytest.mark.parametrize("kind,layout", passing_cases())
def test_every_passing_family_and_layout_equals_one_process(root, kind, layout):
    run_multirank(_train_each, 2, [_overrides(root, kind, layout, LAYOUTS[layout])], timeout=300)
    assert_same_run(root / kind / layout, _reference(root, kind), f"{kind} {layout}")
