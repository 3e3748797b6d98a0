"""lightning.Trainer(strategy=ZeroStrategy(...), accelerator="cpu", devices=2) on the project's Llama: the same
per-step losses as `python -m recipes.pretrain` with the same settings, and a resume from Lightning's own
checkpoint that continues bit for bit (losses and final parameters)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.integrations.common import REPO, assert_same_state, launch, recipe_run

RUNS = {
    # ZeRO-3 with a meta-device build (the engine fills it through the model contract's init_parameter)
    "zero3": {"stage": 3, "meta": True},
    # an expert-parallel plan declared from configure_model, ZeRO-2 with the optimizer offloaded to the host
    "moe_ep2": {"stage": 2, "offload": "cpu", "moe": True, "ep": 2},
    # Ulysses over both processes (dp=1, so micro-batches of 8: the global batch of dp=2 x 4), ZeRO-3 with
    # parameters and optimizer offloaded
    "sp2": {"stage": 3, "offload": "cpu", "sp": 2, "micro": 8},
}


@pytest.fixture(scope="module")
def lightning_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("lightning")
    launch([sys.executable, str(REPO / "tests/integrations/lightning_run.py"), str(out), json.dumps(RUNS)])
    return out, json.loads((out / "losses.json").read_text())


def _check(out, runs: dict, reference: dict) -> None:
    straight, first, resumed = runs["straight"], runs["first"], runs["resumed"]
    for key in ("loss", "grad_norm"):
        assert straight[key] == pytest.approx(reference[key], rel=1e-5, abs=0), key
        assert first[key] == straight[key][:2], key  # the checkpointed run trained the same 2 steps
        assert resumed[key] == straight[key][2:], key  # and resuming continues bit for bit
    for rank in (0, 1):
        final = torch.load(out / f"final_rank{rank}.pt")
        assert_same_state(final["straight"], final["resumed"])


def test_zero3_equals_the_recipe_and_resumes_exactly(lightning_runs, recipe_zero3):
    out, losses = lightning_runs
    _check(out / "zero3", losses["zero3"], recipe_zero3)


def test_expert_parallel_plan_with_offload(lightning_runs, tmp_path):
    out, losses = lightning_runs
    reference = recipe_run(tmp_path / "run", ["model=moe_tiny", "parallel.dp=2", "parallel.ep=2", "zero.stage=2",
                                                 "zero.offload_optimizer=cpu"])
    _check(out / "moe_ep2", losses["moe_ep2"], reference)


def test_sequence_parallel_with_offload(lightning_runs, recipe_zero3):
    out, losses = lightning_runs
    # the same global batches as the recipe's dp=2 run (the data depend on the global batch, not the layout)
    _check(out / "sp2", losses["sp2"], recipe_zero3)
