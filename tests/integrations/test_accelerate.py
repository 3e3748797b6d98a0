"""integrations/accelerate_example.py (Accelerate's processes and dataloader, this engine's model and optimizer) on 2
processes at ZeRO-3 with cpu offload: the same per-step losses as `python -m recipes.pretrain` with the same
settings, and a resume from its own checkpoint that continues bit for bit (losses and final parameters)."""

from __future__ import annotations

import json

import pytest

import zero
from tests.integrations.common import MAX_BYTES, assert_same_state, torchrun

# optional frameworks (pyproject's test extra): without them these tests are skipped
pytest.importorskip("accelerate")

EXAMPLE = ["-m", "moe_lst.integrations.accelerate_example", "--stage", "3", "--offload", "cpu", "--steps", "4",
           "--max-bytes", str(MAX_BYTES)]


def _metrics(path) -> dict[str, list[float]]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return {key: [r[key] for r in records] for key in ("loss", "grad_norm")}


def test_accelerate_example_equals_the_recipe_and_resumes_exactly(tmp_path, recipe_zero3):
    torchrun([*EXAMPLE, "--save-every", "2", "--ckpt-dir", str(tmp_path / "a"), "--metrics", str(tmp_path / "a.jsonl")])
    torchrun([*EXAMPLE, "--resume", str(tmp_path / "a" / "step_2"), "--ckpt-dir", str(tmp_path / "b"),
              "--metrics", str(tmp_path / "b.jsonl")])
    straight, resumed = _metrics(tmp_path / "a.jsonl"), _metrics(tmp_path / "b.jsonl")
    for key in ("loss", "grad_norm"):
        assert straight[key] == pytest.approx(recipe_zero3[key], rel=1e-5, abs=0), key
        assert resumed[key] == straight[key][2:], key
    final = [zero.consolidate(zero.open_checkpoint(str(tmp_path / run / "step_4"))) for run in ("a", "b")]
    assert_same_state(*final)
    assert_same_state(final[0], recipe_zero3["final"], rtol=1e-5, atol=1e-6)  # the recipe's final model
