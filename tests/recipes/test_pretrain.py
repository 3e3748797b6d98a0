"""End-to-end recipe tests: short runs, resume, multi-process equivalence, bad input, W&B records."""

import glob
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from recipes.config import ConfigError
from recipes.pretrain import train

REPO = Path(__file__).resolve().parents[2]
TINY = ["model=tiny", "train.seq_len=32", "train.micro_batch_size=4", "train.eval_batches=2",
        "train.sample_tokens=0", "train.progress=false", "optim.warmup_steps=2", "data.max_bytes=2000000"]


def _cfg(run_dir, *overrides):
    with initialize_config_dir(version_base=None, config_dir=str(REPO / "recipes" / "conf")):
        return compose("config", overrides=[*TINY, f"run_dir={run_dir}", "wandb.mode=disabled", *overrides])


def _losses(run_dir, key="loss"):
    lines = Path(run_dir, "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r[key] for r in map(json.loads, lines) if key in r}


def _run_cli(*args, nproc=1, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    if nproc == 1:
        cmd = [sys.executable, "-m", "recipes.pretrain", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--standalone", "-m", "recipes.pretrain", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_short_run_writes_metrics_checkpoint_and_learns(tmp_path):
    result = train(_cfg(tmp_path, "train.steps=12", "train.eval_every=6", "train.sample_tokens=8"))
    losses = _losses(tmp_path)
    assert sorted(losses) == list(range(1, 13))
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s"} <= set(records[0])
    assert [r["step"] for r in records if "val_loss" in r] == [6, 12]
    assert losses[12] < losses[1] - 0.3  # it learns
    assert result["val_loss"] == records[-1]["val_loss"]
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_0000012"
    assert (tmp_path / "sample.txt").read_text().startswith("def ")
    assert (tmp_path / "config.yaml").exists()


def test_resume_reproduces_uninterrupted_run(tmp_path):
    full, cut = tmp_path / "full", tmp_path / "cut"
    train(_cfg(full, "train.steps=10", "train.eval_every=5"))
    train(_cfg(cut, "train.steps=10", "train.eval_every=5", "train.ckpt_every=4"))
    # Simulate a crash after step 8: drop the last checkpoint and the records after it.
    shutil.rmtree(cut / "checkpoints" / "step_0000010")
    (cut / "checkpoints" / "latest").write_text("step_0000008")
    train(_cfg(cut, "train.steps=10", "train.eval_every=5", "train.ckpt_every=4"))
    assert _losses(cut) == _losses(full)  # exactly, not approximately
    assert _losses(cut, "val_loss") == _losses(full, "val_loss")
    assert len((cut / "metrics.jsonl").read_text().splitlines()) == 10


def test_in_process_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not fit the model"):
        train(_cfg(tmp_path, "train.seq_len=4096"))
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match="cannot be written"):
        train(_cfg(blocker / "run"))
    with pytest.raises(ConfigError, match="train.steps=0 must be an integer >= 1"):
        train(_cfg(tmp_path, "train.steps=0"))
    with pytest.raises(NotImplementedError, match="pipeline parallelism"):
        train(_cfg(tmp_path, "parallel.pp=2"))


@pytest.mark.parametrize("args, message", [
    (["train.no_such_key=1"], "no_such_key"),
    (["parallel.dp=2"], "does not match the world size 1"),
    (["data=bin", "data.train_path=/nonexistent/train.bin", "data.val_path=/nonexistent/val.bin"],
     "does not exist"),
])
def test_cli_bad_input_is_one_clear_error(tmp_path, args, message):
    base = [a for a in TINY if not (a.startswith("data.") and "data=bin" in args)]
    proc = _run_cli(*base, f"run_dir={tmp_path}", *args, timeout=120)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_torchrun_dp2_matches_single_process(tmp_path):
    common = [*TINY, "train.steps=20", "train.eval_every=10", "optim.lr=3e-3"]
    single = _run_cli(*common, "train.micro_batch_size=8", f"run_dir={tmp_path / 'dp1'}")
    assert single.returncode == 0, single.stderr[-3000:]
    multi = _run_cli(*common, "parallel.dp=2", "train.micro_batch_size=4", f"run_dir={tmp_path / 'dp2'}", nproc=2)
    assert multi.returncode == 0, multi.stderr[-3000:]
    a, b = _losses(tmp_path / "dp1"), _losses(tmp_path / "dp2")
    assert sorted(a) == sorted(b) == list(range(1, 21))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), step
    assert _losses(tmp_path / "dp2", "val_loss") == pytest.approx(_losses(tmp_path / "dp1", "val_loss"), rel=1e-5)


def test_torchrun_moe_ep2_matches_ep1(tmp_path):
    common = ["model=moe_tiny", *TINY[1:], "train.steps=8", "train.eval_every=4", "parallel.dp=2",
              "model.moe.bias_update_rate=1e-3"]
    runs = {}
    for ep in (1, 2):
        proc = _run_cli(*common, f"parallel.ep={ep}", f"run_dir={tmp_path / f'ep{ep}'}", nproc=2)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[ep] = tmp_path / f"ep{ep}"
    a, b = _losses(runs[1]), _losses(runs[2])
    assert sorted(a) == list(range(1, 9))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), step
    for key in ("moe/layer0/aux_loss", "moe/layer1/load_max", "val_loss"):
        assert _losses(runs[2], key) == pytest.approx(_losses(runs[1], key), rel=1e-5)
    assert (runs[2] / "expert_load.png").stat().st_size > 0
    assert "layer1" in (runs[2] / "expert_load.txt").read_text()


def _read_wandb_records(path):
    """Records of an offline .wandb file (leveldb-style log of protobuf Records)."""
    from wandb.proto import wandb_internal_pb2

    buf, pos, block, records, partial = Path(path).read_bytes(), 7, 32768, [], b""
    while pos + 7 <= len(buf):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", buf[pos:pos + 7])
        pos += 7
        if kind == 0 and length == 0:
            pos += left - 7
            continue
        data, pos = buf[pos:pos + length], pos + length
        if kind == 1:
            records.append(data)
        elif kind == 2:
            partial = data
        elif kind == 3:
            partial += data
        elif kind == 4:
            records.append(partial + data)
    out = []
    for data in records:
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(data)
        out.append(rec)
    return out


def test_metrics_reach_offline_wandb_run(tmp_path):
    cfg = _cfg(tmp_path, "train.steps=4", "train.eval_every=2")
    cfg.wandb.mode = "offline"
    train(cfg)
    files = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1
    history = []
    for rec in _read_wandb_records(files[0]):
        if rec.WhichOneof("record_type") == "history":
            history.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item})
    expected = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [h["_step"] for h in history] == [e["step"] for e in expected]
    for h, e in zip(history, expected):
        assert h["loss"] == pytest.approx(e["loss"])
        assert h.get("val_loss") == e.get("val_loss")
