"""Runs that survive faults: verified checkpoints with fallback, no silent restart, divergence stops,
one run per run_dir, finished runs kept, model errors in one line."""

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import zero
from recipes.config import ConfigError
from recipes.pretrain import DivergenceError, train
from tests.recipes.cli import run_command_lines
from tests.recipes.test_pretrain import REPO, TINY, _cfg, _losses


def _ckpt(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:07d}"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("whole")
    train(_cfg(run_dir, "train.steps=8", "train.eval_every=4", "train.ckpt_every=2", "train.keep_checkpoints=0"))
    # what the tests below compare against and damage: 8 logged steps, every checkpoint kept
    assert sorted(_losses(run_dir)) == list(range(1, 9))
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == [
        f"step_{s:07d}" for s in (2, 4, 6, 8)]
    return run_dir


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("wandb", ".lock"))
    return dst


def test_latest_pointing_at_a_missing_checkpoint_resumes_from_the_newest_intact_one(uninterrupted, tmp_path, capsys):
    run = _copy(uninterrupted, tmp_path / "run")
    shutil.rmtree(_ckpt(run, 8))  # `latest` still names step 8
    train(_cfg(run, "train.steps=8", "train.eval_every=4", "train.ckpt_every=2"))
    assert "resuming from" in capsys.readouterr().out
    assert _losses(run) == _losses(uninterrupted)  # steps 7-8 retrained exactly, none twice
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 8


@pytest.mark.parametrize("damage", ["truncate", "garbage", "foreign"])
def test_damaged_newest_checkpoint_is_skipped_by_name(uninterrupted, tmp_path, capsys, damage):
    run = _copy(uninterrupted, tmp_path / "run")
    shard = _ckpt(run, 8) / "rank00000.safetensors"
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif damage == "garbage":
        shard.write_bytes(b"\x00garbage" * 100)
    else:  # a shard of another step mixed in
        shutil.copy(_ckpt(run, 4) / "rank00000.safetensors", shard)
    train(_cfg(run, "train.steps=8", "train.eval_every=4", "train.ckpt_every=2"))
    out = capsys.readouterr().out
    assert f"resuming from {_ckpt(run, 6)}" in out and "rank00000.safetensors" in out
    assert _losses(run) == _losses(uninterrupted)


def test_no_usable_checkpoint_is_an_error_not_a_restart(uninterrupted, tmp_path):
    run = _copy(uninterrupted, tmp_path / "run")
    for step in (2, 4, 6, 8):
        (_ckpt(run, step) / "rank00000.safetensors").write_bytes(b"not a checkpoint")
    with pytest.raises(zero.CheckpointError, match="none of the 4 checkpoints"):
        train(_cfg(run, "train.steps=10"))
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 8  # nothing overwritten
    with pytest.raises(ConfigError, match="train.resume=false would train over them"):
        train(_cfg(run, "train.steps=10", "train.resume=false"))


def test_keep_checkpoints_and_finished_run_kept(tmp_path, capsys):
    cfg = _cfg(tmp_path, "train.steps=6", "train.eval_every=3", "train.ckpt_every=1", "train.keep_checkpoints=2")
    first = train(cfg)
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_0000005", "step_0000006"]
    before = (tmp_path / "result.json").read_text()
    again = train(cfg)  # the same command once more: nothing retrained, nothing rewritten
    assert "is complete (6 steps)" in capsys.readouterr().out
    assert (tmp_path / "result.json").read_text() == before and again["val_loss"] == first["val_loss"] is not None


def test_divergence_stops_with_valid_result_and_finite_checkpoints(tmp_path):
    with pytest.raises(DivergenceError, match="consecutive steps"):
        train(_cfg(tmp_path, "train.steps=30", "optim.lr=1e6", "optim.warmup_steps=0", "train.ckpt_every=1",
                   "train.max_nonfinite_steps=2"))
    result = json.loads((tmp_path / "result.json").read_text())  # valid JSON, says what happened
    assert result["status"] == "diverged" and result["step"] < 30
    import torch

    from zero.state.shardfile import load

    # one checkpoint after each step before the stop (measured: diverged at step 4, checkpoints 1-3), the
    # newest train.keep_checkpoints=3 of them kept; the stopping step saves none
    ckpts = sorted((tmp_path / "checkpoints").glob("step_*"))
    assert ckpts and [c.name for c in ckpts] == [f"step_{s:07d}" for s in range(1, result["step"])][-3:]
    for ckpt in ckpts:
        state = load(ckpt / "rank00000.safetensors")
        assert all(torch.isfinite(s).all() for s in state["engine"]["shards"]), ckpt
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["skipped_steps"] >= 2  # the refused steps are in the metrics


DIVERGES = ["train.steps=30", "optim.lr=1e6", "optim.warmup_steps=0", "train.max_nonfinite_steps=2"]
BAD_VALUES = [
    (["model.n_heads=3"], "model.dim=64 must be divisible by model.n_heads=3"),
    (["model=moe_tiny", "model.moe.top_k=9"], "model.moe.top_k=9 must be in [1, model.moe.num_experts=8]"),
    (["model=moe_tiny", "model.moe.router=relu"], "model.moe.router='relu' must be softmax or sigmoid"),
    (["optim.betas=[0.9,1.5]"], "optim.betas=[0.9, 1.5] must be two values in [0, 1)"),
]


@pytest.fixture(scope="module")
def command_lines(tmp_path_factory):
    """The command lines of this file's exit-status tests, each as `python -m recipes.pretrain` runs it, all in one
    process (tests.recipes.cli): {args: CompletedProcess}."""
    cases = [DIVERGES, *(args for args, _ in BAD_VALUES)]
    argvs = [[*TINY, f"run_dir={tmp_path_factory.mktemp('cli')}", *args] for args in cases]
    return dict(zip(map(tuple, cases), run_command_lines(argvs)))


def test_divergence_exit_code_on_the_command_line(command_lines):
    proc = command_lines[tuple(DIVERGES)]
    assert proc.returncode == 3 and "training diverged" in proc.stderr


def test_second_run_on_the_same_run_dir_is_refused(tmp_path):
    tmp_path.mkdir(exist_ok=True)
    with open(tmp_path / ".lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("4242")
        held.flush()
        with pytest.raises(ConfigError, match="in use by another run"):
            train(_cfg(tmp_path, "train.steps=2"))


@pytest.mark.parametrize("args, message", BAD_VALUES)
def test_model_and_optimizer_values_are_one_line_errors(command_lines, args, message):
    proc = command_lines[tuple(args)]
    assert proc.returncode == 2 and message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_bucket_mismatch_names_what_differs(tmp_path):
    import functools

    import torch

    def engine(width: int):
        model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Linear(width, 2))
        return zero.initialize(model, functools.partial(torch.optim.SGD, lr=0.1))

    engine(4).save_checkpoint(tmp_path / "ckpt")
    with pytest.raises(zero.ReshardError, match=r"ckpt holds 1.weight of shape \(2, 4\) but this model's is "
                                                   r"\(2, 5\): it was written for another model"):
        engine(5).load_checkpoint(tmp_path / "ckpt")


def test_resuming_with_a_config_that_breaks_the_run_is_refused(uninterrupted, tmp_path, capsys):
    run = _copy(uninterrupted, tmp_path / "run")
    with pytest.raises(ConfigError, match="started with another model.dim"):
        train(_cfg(run, "train.steps=10", "model.dim=32"))
    with pytest.raises(ConfigError, match=r"global batch \(4 -> 8 sequences\)"):
        train(_cfg(run, "train.steps=10", "train.micro_batch_size=8"))
    train(_cfg(run, "train.steps=9", "train.eval_every=3", "train.ckpt_every=2"))  # harmless: recorded
    assert "train.steps: 8 -> 9" in capsys.readouterr().out
    assert "train.steps" in (run / "config_changes.jsonl").read_text()
    assert sorted(_losses(run)) == list(range(1, 10))


def test_a_rank_that_sleeps_inside_a_step_ends_the_run_within_the_timeout(tmp_path):
    """Rank 1 stops answering at the start of step 3 (tests/recipes/stall_rank.py); rank 0, waiting in that
    step's first collective, exits with code 4 naming the step and the collective once
    train.collective_timeout_s has passed, and torchrun ends the sleeping rank with it."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
           "-m", "tests.recipes.stall_rank", "1", "3", "120", *TINY, f"run_dir={tmp_path}", "parallel.dp=2",
           "train.steps=20", "train.collective_timeout_s=5"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=90)
    ended = time.time()
    stalled = float(re.search(r"rank 1 stalls at step 3 from ([\d.]+)", proc.stdout).group(1))
    assert re.search(r"^error: rank 0, step 3: (all_reduce|reduce_scatter|all_gather) over 2 ranks did not complete "
                     r"within train.collective_timeout_s=5 s", proc.stderr, re.MULTILINE), proc.stderr
    assert re.search(r"rank\s*: 0 .*\n\s*exitcode\s*: 4", proc.stderr), proc.stderr
    print(f"the job ended {ended - stalled:.1f} s after rank 1 stopped answering")
    assert 5 <= ended - stalled < 5 + 4  # checks every 0.5 s; torchrun's teardown of the sleeper
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "hung" and result["step"] == 3 and result["rank"] == 0


def test_a_full_disk_during_a_checkpoint_is_one_line_with_a_result_and_the_previous_checkpoint_intact(tmp_path):
    """The disk fills up while step 4's checkpoint is written (tests/recipes/full_disk.py: ENOSPC after 4 KiB of
    the shard): one line naming the checkpoint, the bytes it needs and those free, exit 5, result.json saying so,
    and step 2's checkpoint (the newest complete one) intact and still the one a resume takes."""
    cmd = [sys.executable, "-m", "tests.recipes.full_disk", "4", *TINY, f"run_dir={tmp_path}", "train.steps=6",
           "train.ckpt_every=2", "train.eval_every=0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 5, proc.stderr[-3000:]
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    line = proc.stderr.strip()
    path = _ckpt(tmp_path, 4)
    match = re.fullmatch(rf"error: checkpoint {re.escape(str(path))} could not be written: No space left on device "
                         r"\(it needs about ([\d,]+) bytes \([\d.]+ [KMG]iB\), ([\d,]+) bytes \([\d.]+ [KMG]iB\) are "
                         r"free there\); the previous checkpoints are intact: free at least .+ or lower "
                         r"train.keep_checkpoints, then run the same command to resume", line)
    assert match, line
    needed, free = (int(g.replace(",", "")) for g in match.groups())
    shard = _ckpt(tmp_path, 2) / "rank00000.safetensors"
    assert 0.9 * shard.stat().st_size < needed <= shard.stat().st_size  # the tensors: the shard less its header
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "checkpoint_failed" and result["step"] == 4 and result["message"] == line[7:]
    assert (result["checkpoint"], result["resume_from"]) == ("checkpoints/step_0000004", "checkpoints/step_0000002")
    assert (result["bytes_needed"], result["bytes_free"]) == (needed, free)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_0000002"]
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_0000002"
    assert zero.verify_checkpoint(None, _ckpt(tmp_path, 2))["global_steps"] == 2


_LOGGER = """
import sys, time
from pathlib import Path
from recipes.tracking import MetricsLogger
start = time.monotonic()
logger = MetricsLogger(Path(sys.argv[1]), True, {"mode": "online", "project": "p", "init_timeout_s": 2}, {"a": 1},
                       run_id="5" * 32)
print(f"started in {time.monotonic() - start:.1f} s", flush=True)
logger.log(1, {"loss": 1.5})
logger.finish()
"""


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens on it once closed


def _offline_fallback(tmp_path: Path, why: str, key: str | None, server: str | None, cmd: list[str]):
    """`cmd` (W&B online) with no W&B key and a fresh W&B home, or with `key` and the W&B server `server`: exit 0,
    one line on stderr saying why W&B is offline and the `wandb sync` command, and that run directory offline."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(OMP_NUM_THREADS="1", HOME=str(tmp_path / "home"), WANDB_CONFIG_DIR=str(tmp_path / "wandb_config"))
    env.update({"WANDB_API_KEY": key} if key else {})
    env.update({"WANDB_BASE_URL": server} if server else {})
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    match = re.fullmatch(r"warning: wandb.mode=online could not start \((.+)\): the run logs offline to (\S+); "
                         r"upload it later with `wandb sync (\S+)`", proc.stderr.strip())
    assert match and match.group(2) == match.group(3), proc.stderr
    assert why in match.group(1), match.group(1)
    synced = Path(match.group(2))
    assert synced.name.startswith("offline-run-") and list(synced.glob("run-*.wandb")), list(synced.iterdir())
    return proc, synced


@pytest.mark.parametrize("case", ["no key", "no server"])
def test_wandb_online_without_a_key_or_a_server_logs_offline_and_says_how_to_sync(tmp_path, case):
    """The run's logger (what the recipe starts on rank 0) with wandb.mode=online on a node without a W&B key, or
    with a key but no W&B server answering (a closed local port): it logs offline within wandb.init_timeout_s
    (2 s here) plus W&B's own start, never W&B's 90 s default."""
    key, server, why = (None, None, "No API key configured") if case == "no key" else (
        "a" * 40, f"http://127.0.0.1:{_closed_port()}", "no answer from http://127.0.0.1:")
    proc, synced = _offline_fallback(tmp_path, why, key, server, [sys.executable, "-c", _LOGGER, str(tmp_path)])
    assert synced.parent == tmp_path / "wandb" and synced.name.endswith("5" * 32)  # the run's own id
    started = float(re.search(r"started in ([\d.]+) s", proc.stdout).group(1))
    print(f"{case}: W&B offline after {started:.1f} s")
    assert started < 60


@pytest.mark.slow
def test_a_recipe_run_with_wandb_online_and_no_server_trains_and_logs_offline(tmp_path):
    """The same from the command line: the run trains, its only line on stderr is the fallback's."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "recipes.pretrain", *TINY, f"run_dir={run}", "train.steps=2", "wandb.mode=online",
           "wandb.init_timeout_s=2"]
    _, synced = _offline_fallback(tmp_path, "no answer from", "a" * 40, f"http://127.0.0.1:{_closed_port()}", cmd)
    assert synced.parent == run / "wandb" and sorted(_losses(run)) == [1, 2]
    assert json.loads((run / "result.json").read_text())["status"] == "complete"


@pytest.mark.slow
def test_a_full_disk_under_two_ranks_names_the_whole_checkpoints_size(tmp_path):
    """Both ranks' shards go to the full disk: each rank says so in its line, the size needed is both shards'
    (gathered from the ranks), and rank 0's result.json records it."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
           "-m", "tests.recipes.full_disk", "4", *TINY, f"run_dir={tmp_path}", "parallel.dp=2", "train.steps=6",
           "train.ckpt_every=2", "train.eval_every=0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0 and re.search(r"exitcode\s*: 5", proc.stderr), proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("error: checkpoint")]
    assert len(lines) == 2 and all(" could not be written on rank 0: No space left on device" in x for x in lines)
    needed = int(re.search(r"it needs about ([\d,]+) bytes", lines[0]).group(1).replace(",", ""))
    shards = sum(f.stat().st_size for f in _ckpt(tmp_path, 2).glob("rank*.safetensors"))
    assert len(list(_ckpt(tmp_path, 2).glob("rank*.safetensors"))) == 2 and 0.9 * shards < needed <= shards
    result = json.loads((tmp_path / "result.json").read_text())
    assert (result["status"], result["bytes_needed"], result["resume_from"]) == (
        "checkpoint_failed", needed, "checkpoints/step_0000002")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_0000002"]
