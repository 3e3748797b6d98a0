"""A recipe run resumes under another layout: its checkpoint is resharded and the run continues the
same loss trajectory (tests/parallel/test_reshard.py covers every axis at the engine level)."""

import json
import shutil

import pytest

from tests.recipes.test_pretrain import TINY, _losses, _run_cli

COMMON = [*TINY, "train.steps=6", "train.eval_every=3", "train.ckpt_every=2", "train.keep_checkpoints=0",
          "optim.lr=3e-3"]


def _crash_after(run_dir, step: int) -> None:
    """Leave run_dir as a run that died right after saving step `step` (later checkpoints gone)."""
    for later in sorted((run_dir / "checkpoints").glob("step_*")):
        if int(later.name.split("_")[1]) > step:
            shutil.rmtree(later)
    (run_dir / "checkpoints" / "latest").write_text(f"step_{step:07d}")


@pytest.mark.slow
def test_dp2_stage3_to_one_process_stage1_to_dp4_stage2(tmp_path):
    base, run = tmp_path / "base", tmp_path / "run"
    assert _run_cli(*COMMON, "train.micro_batch_size=8", f"run_dir={base}").returncode == 0
    legs = [(["parallel.dp=2", "train.micro_batch_size=4", "zero.stage=3"], 2),
            (["train.micro_batch_size=8", "zero.stage=1"], 1),
            (["parallel.dp=4", "train.micro_batch_size=2", "zero.stage=2"], 4)]
    for k, (args, nproc) in enumerate(legs):
        if k:
            _crash_after(run, 2 * k)
        proc = _run_cli(*COMMON, *args, f"run_dir={run}", nproc=nproc, timeout=400)
        assert proc.returncode == 0, proc.stderr[-3000:]
        if k:
            assert f"resuming from {run / 'checkpoints' / f'step_{2 * k:07d}'} (resharded: written with dp=" \
                   in proc.stdout, proc.stdout[-2000:]
    for key in ("loss", "grad_norm", "val_loss"):
        a, b = _losses(base, key), _losses(run, key)
        assert sorted(a) == sorted(b) and a, key
        for step in a:
            assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), (key, step)
    # The layout changes are recorded, the run's identity is in every shard.
    changes = [json.loads(line)["changes"] for line in (run / "config_changes.jsonl").read_text().splitlines()]
    assert changes[0]["parallel.dp"] == [2, 1] and changes[1]["parallel.dp"] == [1, 4]
    meta = json.loads((run / "checkpoints" / "step_0000006" / "meta.json").read_text())
    assert meta["run_id"] == (run / "run_id").read_text().strip() and meta["layout"]["dp"] == 4
