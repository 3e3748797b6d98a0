"""The README's own-loop example, run as written on 2 ranks (MoE, ep=2, ZeRO stage 2): its losses and
gradient norms equal the recipe's for the same model, data and settings."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.doccommands import block_by
from tests.recipes.cli import train_on_ranks

REPO = Path(__file__).resolve().parents[1]


def _example() -> str:
    """The README block marked `<!-- doc-test: skip by=tests/test_readme_loop.py ... -->` (tests/doccommands.py)."""
    block = block_by("tests/test_readme_loop.py")
    assert block.fence == "python" and "plans=[ep]" in block.text, \
        f"{block.id}: the README's own-loop example is not a python block in plan form"
    return block.text


def _torchrun(args: list[str], cwd: Path) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(_port()), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _port() -> int:
    from tests.multirank import free_port

    return free_port()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_readme_own_loop_equals_the_recipe(tmp_path):
    script = tmp_path / "own_loop.py"
    script.write_text(_example())
    out = _torchrun([str(script)], tmp_path)
    # (the two ranks share one pipe: a line's text and its newline are separate writes, so lines may run
    # together; each record is matched on its own)
    lines = re.findall(r"rank (\d) step (\d) loss ([0-9.]+) norm ([0-9.]+)", out)
    assert sorted((int(r), int(s)) for r, s, _, _ in lines) == [(r, s) for r in (0, 1) for s in (1, 2, 3, 4)]
    by_step = {int(s): [] for _, s, _, _ in lines}
    for _, s, loss, norm in lines:
        by_step[int(s)].append((float(loss), float(norm)))
    run = tmp_path / "run"
    # The recipe's train() on the tests' process pool: what torchrun's two ranks of `python -m recipes.pretrain`
    # run, without starting Python and the project per rank (tests/recipes/test_pretrain.py launches the recipe).
    train_on_ranks(2, ["model=moe_tiny", "parallel.dp=2", "parallel.ep=2", "zero.stage=2", "train.steps=4",
                       "train.micro_batch_size=4", "train.grad_accum=2", "train.seq_len=64", "optim.warmup_steps=0",
                       "optim.min_lr_ratio=1.0", "train.eval_batches=0", "wandb.mode=disabled", f"run_dir={run}"])
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    for m in metrics:
        (loss0, norm0), (loss1, norm1) = by_step[m["step"]]
        assert norm0 == norm1 == pytest.approx(m["grad_norm"], rel=1e-5)  # the global norm, on every rank
        assert (loss0 + loss1) / 2 == pytest.approx(m["loss"], rel=1e-5)  # each rank's shard: their mean
