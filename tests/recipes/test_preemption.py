"""Preemption and restarts: a stop signal (SIGTERM, SIGINT, SIGUSR1) ends the run at the next step boundary
with a checkpoint, result.json `preempted` and exit code 128 + the signal's number, and the restart continues
bitwise; a run killed without a checkpoint restarts with one record per step; damaged run-directory files are
one-line errors; parallel.dp=auto fills the processes."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from recipes.config import ConfigError
from recipes.pretrain import train
from tests.recipes.test_pretrain import REPO, TINY, _cfg, _run_cli

# ZeRO-3 over the two ranks torchrun starts (parallel.dp=auto: 2); a checkpoint only when stopped or at the end.
COMMON = [*TINY, "train.steps=6", "train.eval_every=3", "zero.stage=3"]
KEYS = ("loss", "grad_norm", "val_loss", "lr")


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _same_run(run_dir: Path, reference: Path) -> None:
    """Each step once, and every loss, gradient norm, validation loss and lr equal to the reference's, bitwise."""
    mine, theirs = _records(run_dir), _records(reference)
    assert [r["step"] for r in mine] == [r["step"] for r in theirs] == list(range(1, len(theirs) + 1))
    for a, b in zip(mine, theirs):
        assert {k: a.get(k) for k in KEYS} == {k: b.get(k) for k in KEYS}, a["step"]


def _signal_run(run_dir: Path, rank: int, step: int, signame: str, *args: str, nproc: int = 2, save_s: float = 0):
    """The recipe with rank `rank` sending itself `signame` at the start of step `step` (tests/recipes/
    signal_rank.py); returns the process and the seconds from the signal to the end of the job."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    launcher = ["--nproc_per_node", str(nproc), "--standalone"]
    cmd = [sys.executable, *(["-m", "torch.distributed.run", *launcher] if nproc > 1 else []),
           "-m", "tests.recipes.signal_rank", str(rank), str(step), signame, str(save_s),
           *COMMON, f"run_dir={run_dir}", *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    ended = time.time()
    sent = re.search(rf"rank {rank} sends {signame} at step {step} at ([\d.]+)", proc.stdout)
    assert sent, proc.stdout + proc.stderr[-3000:]
    return proc, ended - float(sent.group(1))


def _rank_exit_codes(proc) -> list[int]:
    """Every rank's exit code, in rank order, as torchrun's failure report lists them."""
    codes = dict(re.findall(r"rank\s*: (\d+) \(local_rank: \d+\)\n\s*exitcode\s*: (-?\d+)", proc.stderr))
    return [int(codes[rank]) for rank in sorted(codes)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference: the same command under torchrun, 2 processes, no parallel.* key, never interrupted."""
    run_dir = tmp_path_factory.mktemp("whole")
    proc = _run_cli(*COMMON, f"run_dir={run_dir}", nproc=2, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir, proc


def test_torchrun_without_parallel_keys_trains_dp2(uninterrupted):
    run_dir, proc = uninterrupted
    assert "ParallelDims(dp=2, tp=1, pp=1, sp=1, ep=1, world=2)" in proc.stdout
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["parallel"]["dp"] == 2  # resolved, for resume
    assert [r["step"] for r in _records(run_dir)] == list(range(1, 7))


def test_explicit_dp_that_does_not_fill_the_processes_is_one_line(tmp_path):
    proc = _run_cli(*COMMON, f"run_dir={tmp_path}", "parallel.dp=3", nproc=2, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: parallel.dp=3 on 2 process(es): dp=3 x tp=1 x pp=1 x sp=1 = 3 does not match the "
                      "world size 2; leave parallel.dp=auto (here dp=2) or start 3 processes"], proc.stderr[-3000:]
    codes = _rank_exit_codes(proc)  # rank 1 exits 2 too (a second after rank 0, unless torchrun ends it first)
    assert codes[0] == 2 and set(codes) <= {2, -signal.SIGTERM}, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr.split("error:")[0]


@pytest.mark.parametrize("signame, rank, step", [("SIGTERM", 1, 3),
                                              pytest.param("SIGUSR1", 0, 5, marks=pytest.mark.slow)])
def test_signal_to_one_rank_checkpoints_at_the_next_boundary_and_resumes_bitwise(uninterrupted, tmp_path,
                                                                                  signame, rank, step):
    code = 128 + getattr(signal, signame)
    proc, took = _signal_run(tmp_path, rank, step, signame)
    print(f"{signame} to rank {rank} at step {step}: the job ended {took:.2f} s later")
    assert _rank_exit_codes(proc) == [code, code], proc.stderr[-3000:]  # every rank, the documented code
    ckpt = tmp_path / "checkpoints" / f"step_{step:07d}"  # the boundary right after the signal's step
    assert sorted(p.name for p in ckpt.iterdir()) == ["meta.json", "rank00000.safetensors", "rank00001.safetensors"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", ckpt.name]
    result = json.loads((tmp_path / "result.json").read_text())
    assert (result["status"], result["step"], result["signal"], result["exit_code"]) == ("preempted", step,
                                                                                         signame, code)
    assert f"stopped by {signame} at step {step} of 6" in proc.stderr
    assert took < 10  # (measured about 1 s: the step, the save, torchrun's teardown)
    restart = _run_cli(*COMMON, f"run_dir={tmp_path}", nproc=2, timeout=200)
    assert restart.returncode == 0, restart.stderr[-3000:]
    assert f"resuming from {ckpt}" in restart.stdout
    _same_run(tmp_path, uninterrupted[0])


def test_signal_during_a_save_past_the_grace_period_keeps_the_previous_checkpoint(uninterrupted, tmp_path):
    # Rank 1 gets SIGTERM in step 3; the stop's save of step 3 takes 3 s per shard (and rank 1 gets SIGTERM
    # again meanwhile) but train.stop_grace_s=1.5: every rank exits 143 mid-save, step 2's checkpoint intact.
    proc, took = _signal_run(tmp_path, 1, 3, "SIGTERM", "train.ckpt_every=2", "train.stop_grace_s=1.5", save_s=3)
    print(f"SIGTERM with a save that outlasts the grace period: the job ended {took:.2f} s after the signal")
    assert _rank_exit_codes(proc) == [143, 143], proc.stderr[-3000:]
    assert "SIGTERM received again: ignored, the run is already stopping (saving the checkpoint of step 3" \
        in proc.stderr
    assert re.search(r"error: SIGTERM came train.stop_grace_s=1.5 s ago and the run is still saving the checkpoint "
                     r"of step 3 \(the newest complete one, step 2, is intact\)", proc.stderr), proc.stderr[-3000:]
    assert 1.5 <= took < 1.5 + 5
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_0000002",
                                                                            "step_0000003.tmp"]
    result = json.loads((tmp_path / "result.json").read_text())
    assert (result["status"], result["step"], result["checkpoint"]) == ("preempted", 2, "checkpoints/step_0000002")
    restart = _run_cli(*COMMON, "train.ckpt_every=2", f"run_dir={tmp_path}", nproc=2, timeout=200)
    assert restart.returncode == 0, restart.stderr[-3000:]
    assert f"resuming from {tmp_path / 'checkpoints' / 'step_0000002'}" in restart.stdout
    _same_run(tmp_path, uninterrupted[0])


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference for one-process runs, in this process."""
    run_dir = tmp_path_factory.mktemp("one")
    train(_cfg(run_dir, *COMMON[len(TINY):]))
    return run_dir


def test_sigint_on_one_process_stops_with_130_and_resumes_bitwise(one_process, tmp_path):
    proc, took = _signal_run(tmp_path, 0, 4, "SIGINT", nproc=1)
    print(f"SIGINT to a single process at step 4: it exited {took:.2f} s later")
    assert proc.returncode == 130 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1] == ("stopped by SIGINT at step 4 of 6: checkpoint checkpoints/step_0000004 "
                                            "saved; the same command resumes the run (exit code 130)")
    assert json.loads((tmp_path / "result.json").read_text())["status"] == "preempted"
    train(_cfg(tmp_path, *COMMON[len(TINY):]))
    _same_run(tmp_path, one_process)
    assert json.loads((tmp_path / "result.json").read_text())["status"] == "complete"


def test_killed_without_a_checkpoint_restarts_with_each_step_once(one_process, tmp_path, capsys):
    proc, _ = _signal_run(tmp_path, 0, 4, "SIGKILL", nproc=1)
    assert proc.returncode == -signal.SIGKILL and not (tmp_path / "checkpoints").exists()
    assert [r["step"] for r in _records(tmp_path)] == [1, 2, 3]
    train(_cfg(tmp_path, *COMMON[len(TINY):]))
    assert "metrics.jsonl: dropped the records of steps 1-3 (no checkpoint holds them; they are trained again)" \
        in capsys.readouterr().out
    _same_run(tmp_path, one_process)


def test_torn_last_metrics_line_is_dropped_with_a_warning(one_process, tmp_path, capsys):
    args = [*COMMON[len(TINY):], "train.ckpt_every=4"]
    train(_cfg(tmp_path, *args))
    # As a kill would leave it: the checkpoint of step 4 the newest, steps 5-6 logged, then a line cut short.
    shutil.rmtree(tmp_path / "checkpoints" / "step_0000006")
    (tmp_path / "result.json").unlink()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "loss": 4.1')
    capsys.readouterr()
    train(_cfg(tmp_path, *args))
    captured = capsys.readouterr()
    assert re.search(r"metrics.jsonl line 7 is not a whole record \(a write cut short\): dropped", captured.err)
    assert "metrics.jsonl: dropped the records of steps 5-6 (past the checkpoint of step 4" in captured.out
    _same_run(tmp_path, one_process)


DAMAGE = {"config.yaml": "model: {dim: [unclosed\n", "run_id": "\x00\x17garbage", "result.json": '{"status": "comp'}


@pytest.mark.parametrize("name", DAMAGE)
def test_damaged_run_dir_file_is_one_line_naming_it(one_process, tmp_path, name):
    run = tmp_path / "run"
    shutil.copytree(one_process, run, ignore=shutil.ignore_patterns("wandb", ".lock"))
    (run / name).write_text(DAMAGE[name])
    with pytest.raises(ConfigError) as info:
        train(_cfg(run, *COMMON[len(TINY):]))
    message = str(info.value)
    assert message.startswith(f"{run / name} is damaged (") and "\n" not in message, message
    assert " restore it" in message or " remove it" in message  # what to do
    assert [r["step"] for r in _records(run)] == list(range(1, 7))  # nothing else touched


def test_damaged_run_dir_file_on_the_command_line_exits_2(one_process, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(one_process, run, ignore=shutil.ignore_patterns("wandb", ".lock"))
    (run / "config.yaml").write_text(DAMAGE["config.yaml"])
    proc = _run_cli(*COMMON, f"run_dir={run}", timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(f"error: {run / 'config.yaml'} is damaged ("), \
        proc.stderr


def test_damaged_lock_file_is_refused_by_name(tmp_path):
    (tmp_path / ".lock").mkdir()
    with pytest.raises(ConfigError, match=r"\.lock cannot be opened \(Is a directory\): it is this run_dir's lock"):
        train(_cfg(tmp_path, "train.steps=1"))


def test_wandb_resumes_the_same_run(tmp_path):
    first = _cfg(tmp_path, "train.steps=2", "train.eval_batches=0")
    first.wandb.mode = "offline"
    train(first)
    second = _cfg(tmp_path, "train.steps=3", "train.eval_batches=0")
    second.wandb.mode = "offline"
    train(second)
    run_id = (tmp_path / "run_id").read_text().strip()
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    # (W&B names a run's directory offline-run-<time>-<id>, adding -1, -2... when two start in the same second)
    assert len(runs) == 2 and all(re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{run_id}(-\d+)?", r.name) for r in runs)


def test_signal_during_setup_stops_before_the_first_step_and_handlers_are_restored(tmp_path, monkeypatch):
    import recipes.pretrain as pretrain
    from recipes.preempt import Preempted

    build_model = pretrain.build_model

    def signalled_while_building(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGUSR1)  # as if it came while the model was being built
        return build_model(*args, **kwargs)

    monkeypatch.setattr(pretrain, "build_model", signalled_while_building)
    before = signal.getsignal(signal.SIGUSR1)
    with pytest.raises(Preempted) as info:
        train(_cfg(tmp_path, *COMMON[len(TINY):]))
    assert info.value.exit_code == 138 and signal.getsignal(signal.SIGUSR1) is before
    assert str(info.value).startswith("stopped by SIGUSR1 at step 0 of 6: nothing trained yet, no checkpoint")
    result = json.loads((tmp_path / "result.json").read_text())
    assert (result["status"], result["step"], result["checkpoint"]) == ("preempted", 0, None)
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("overrides, message", [
    (["train.stop_signals=[SIGKILL]"], "train.stop_signals: 'SIGKILL' is not a signal a process can catch"),
    (["train.stop_signals=[SIGNOPE]"], "train.stop_signals: 'SIGNOPE' is not a signal a process can catch"),
    (["train.stop_grace_s=0"], "train.stop_grace_s=0.0 must be > 0"),
    (["parallel.dp=two"], "parallel.dp='two' must be auto or an integer >= 1"),
])
def test_stop_and_dp_settings_are_checked(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as info:
        train(_cfg(tmp_path, *overrides))
    assert str(info.value).startswith(message), str(info.value)
