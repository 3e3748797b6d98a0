"""End-to-end recipe tests: short runs, resume, multi-process equivalence, bad input, W&B records."""

import glob
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import zero
from recipes.config import ConfigError
from recipes.pretrain import train
from tests.recipes.cli import run_command_lines, train_on_ranks

REPO = Path(__file__).resolve().parents[2]
TINY = ["model=tiny", "train.seq_len=32", "train.micro_batch_size=4", "train.eval_batches=2",
        "train.sample_tokens=0", "train.progress=false", "optim.warmup_steps=2", "data.max_bytes=2000000"]


def _cfg(run_dir, *overrides):
    with initialize_config_dir(version_base=None, config_dir=str(REPO / "recipes" / "conf")):
        return compose("config", overrides=[*TINY, f"run_dir={run_dir}", "wandb.mode=disabled", *overrides])


def _losses(run_dir, key="loss"):
    lines = Path(run_dir, "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r[key] for r in map(json.loads, lines) if key in r}


def _train_ranks(world, run_dir, *overrides, timeout=400):
    """`_cfg`'s run on `world` ranks of the tests' process pool, as torchrun's ranks would run it (tests.recipes.cli's
    train_on_ranks; one rank: in this process). The launcher's and the command line's own path are checked by the
    runs through `_run_cli`."""
    train_on_ranks(world, [*TINY, f"run_dir={run_dir}", "wandb.mode=disabled", *overrides], timeout=timeout)


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
    want, want_val = _losses(full), _losses(full, "val_loss")
    assert sorted(want) == list(range(1, 11)) and sorted(want_val) == [5, 10]
    assert _losses(cut) == want  # exactly, not approximately
    assert _losses(cut, "val_loss") == want_val
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
    with pytest.raises(zero.LayoutError, match="every stage needs a layer"):
        train(_cfg(tmp_path, "parallel.pp=4"))


BAD_INPUT = [
    (["train.no_such_key=1"], "no_such_key"),
    (["parallel.dp=2"], "does not match the world size 1"),
    (["data=bin", "data.train_path=/nonexistent/train.bin", "data.val_path=/nonexistent/val.bin"],
     "does not exist"),
]
BAD_LAYOUT = [
    (["parallel.pp=4"], "parallel.pp=4 x 1 stage(s) per rank = 4 stages but the model has 2 layers"),
    (["parallel.tp=3"], "tp=3 must divide model.n_heads=4"),
    (["parallel.tp=2", "train.tiled_loss=true"], "train.tiled_loss with parallel.tp > 1 is not supported"),
    (["parallel.pp=2", "parallel.pp_schedule=zbv", "parallel.pp_virtual_stages=3"], "runs exactly 2 stage(s)"),
    (["parallel.tp=2", "parallel.sp=4"], "parallel.sp=4 cannot exceed the number of query heads (4 / parallel.tp=2 = 2 "
                                         "per rank): the rule is sp <= n_heads / tp; use parallel.sp <= 2"),
]


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """The command lines of the two tests below, each as `python -m recipes.pretrain` runs it, all in one process
    (tests.recipes.cli): {(test, args): CompletedProcess}."""
    cases = {}
    for args, _ in BAD_INPUT:
        base = [a for a in TINY if not (a.startswith("data.") and "data=bin" in args)]
        cases["input", tuple(args)] = [*base, f"run_dir={tmp_path_factory.mktemp('cli')}", *args]
    for args, _ in BAD_LAYOUT:
        cases["layout", tuple(args)] = [*TINY, f"run_dir={tmp_path_factory.mktemp('cli')}", *args]
    return dict(zip(cases, run_command_lines(list(cases.values()))))


@pytest.mark.parametrize("args, message", BAD_INPUT)
def test_cli_bad_input_is_one_clear_error(refused, args, message):
    proc = refused["input", tuple(args)]
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


@pytest.mark.parametrize("args, message", BAD_LAYOUT)
def test_cli_bad_layout_is_one_line_and_exit_2(refused, args, message):
    # Checked against the model before any process group exists: a single process reports it.
    proc = refused["layout", tuple(args)]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.slow
def test_torchrun_pp_and_tp_layouts_match_single_process(tmp_path):
    # Four layers so interleaved 1F1B has two stages per rank; the pipeline's micro-batches are the
    # grad_accum micro-batches, so every layout trains on the same tokens in the same grouping.
    common = [*TINY, "model.n_layers=4", "train.steps=10", "train.eval_every=5", "optim.lr=3e-3",
              "train.grad_accum=2", "train.sample_tokens=6"]
    layouts = {
        "base": ([*common, "train.micro_batch_size=4"], 1),
        "dp2_pp2": ([*common, "parallel.dp=2", "parallel.pp=2", "train.micro_batch_size=2"], 4),
        "dp2_tp2": ([*common, "parallel.dp=2", "parallel.tp=2", "train.micro_batch_size=2", "zero.stage=2"], 4),
        "pp2_tp2": ([*common, "parallel.pp=2", "parallel.tp=2", "train.micro_batch_size=4",
                     "parallel.pp_schedule=interleaved_1f1b", "zero.stage=1"], 4),
    }
    procs = {name: _run_cli(*args, f"run_dir={tmp_path / name}", nproc=nproc, timeout=400)
             for name, (args, nproc) in layouts.items()}
    for proc in procs.values():
        assert proc.returncode == 0, proc.stderr[-3000:]
    base = tmp_path / "base"
    steps = {"loss": list(range(1, 11)), "grad_norm": list(range(1, 11)), "val_loss": [5, 10]}
    for name in ("dp2_pp2", "dp2_tp2", "pp2_tp2"):
        for key in ("loss", "grad_norm", "val_loss"):
            a, b = _losses(base, key), _losses(tmp_path / name, key)
            assert sorted(a) == sorted(b) == steps[key], (name, key)
            for step in a:
                assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), (name, key, step)
    # Generation under tp pads the context and gathers the vocabulary slices: the same text.
    assert (tmp_path / "dp2_tp2" / "sample.txt").read_text() == (base / "sample.txt").read_text()
    assert "generation through pipeline stages is not implemented" in procs["dp2_pp2"].stdout


def test_torchrun_moe_pp2_stats_and_resume(tmp_path):
    # MoE layers on both stages: balancing losses reach backward on their own stage; every stage's
    # router statistics reach rank 0's log under the model's layer numbering; resume continues exactly.
    common = ["model=moe_tiny", *TINY[1:], "train.steps=6", "train.eval_every=3", "train.grad_accum=2",
              "model.moe.bias_update_rate=1e-3"]
    base, pp = tmp_path / "base", tmp_path / "pp2"
    _train_ranks(1, base, *common)
    _train_ranks(2, pp, *common, "parallel.pp=2", "train.ckpt_every=3")
    for key in ("loss", "grad_norm", "moe/layer0/aux_loss", "moe/layer1/aux_loss", "moe/layer1/z_loss",
                "moe/layer1/load_max", "val_loss"):
        a, b = _losses(base, key), _losses(pp, key)
        assert sorted(a) == sorted(b) == ([3, 6] if key == "val_loss" else list(range(1, 7))), key
        for step in a:
            assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), (key, step)
    assert (pp / "expert_load.txt").read_text() == (base / "expert_load.txt").read_text()
    full = _losses(pp)
    assert sorted(full) == list(range(1, 7))
    shutil.rmtree(pp / "checkpoints" / "step_0000006")
    (pp / "checkpoints" / "latest").write_text("step_0000003")
    _train_ranks(2, pp, *common, "parallel.pp=2", "train.ckpt_every=3")
    assert _losses(pp) == full


def test_torchrun_dp2_and_sp2_match_single_process(tmp_path):
    # seq_len 31 is not divisible by sp=2: the sequence shards are padded and masked internally.
    common = [*TINY, "train.steps=20", "train.eval_every=10", "optim.lr=3e-3", "train.seq_len=31",
              "train.sample_tokens=6"]
    layouts = {
        "dp1": ([*common, "train.micro_batch_size=8"], 1),
        "dp2": ([*common, "parallel.dp=2", "train.micro_batch_size=4"], 2),
        "sp2": ([*common, "parallel.sp=2", "train.micro_batch_size=8", "train.tiled_loss=true",
                 "train.tiled_mlp=2", "train.activation_checkpointing=true", "train.offload_activations=true"], 2),
    }
    for name, (args, nproc) in layouts.items():
        if name == "dp2":  # (through torchrun and the command line: the launcher's path of this file's runs)
            proc = _run_cli(*args, f"run_dir={tmp_path / name}", nproc=nproc)
            assert proc.returncode == 0, proc.stderr[-3000:]
        else:
            _train_ranks(nproc, tmp_path / name, *args)
    base = tmp_path / "dp1"
    steps = {"loss": list(range(1, 21)), "grad_norm": list(range(1, 21)), "val_loss": [10, 20]}
    for name in ("dp2", "sp2"):
        for key in ("loss", "grad_norm", "val_loss"):
            a, b = _losses(base, key), _losses(tmp_path / name, key)
            assert sorted(a) == sorted(b) == steps[key], (name, key)
            for step in a:
                assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), (name, key, step)
    assert (tmp_path / "sp2" / "sample.txt").read_text() == (base / "sample.txt").read_text()


def test_torchrun_fp16_dp2_skips_no_step_one_process_takes(tmp_path):
    # At the default loss scale 2^16 the sum over dp ranks of loss-scaled fp16 gradients overflowed where one
    # process's gradient does not (step 3 here was skipped at dp=2): the engine divides by dp before reducing.
    common = [*TINY, "train.steps=4", "train.eval_batches=0", "train.seq_len=64", "zero.dtype=fp16"]
    for name, args, nproc in (("one", ["train.grad_accum=2"], 1), ("dp2", ["parallel.dp=2"], 2)):
        _train_ranks(nproc, tmp_path / name, *common, *args)
    for key in ("loss", "grad_norm"):
        a, b = _losses(tmp_path / "one", key), _losses(tmp_path / "dp2", key)
        assert sorted(a) == sorted(b) == [1, 2, 3, 4], key
        assert all(math.isfinite(v) for v in (*a.values(), *b.values())), (key, a, b)
        for step in a:
            assert b[step] == pytest.approx(a[step], rel=1e-4), (key, step)


def test_torchrun_moe_ep2_and_sp2_match_ep1(tmp_path):
    common = ["model=moe_tiny", *TINY[1:], "train.steps=8", "train.eval_every=4", "parallel.dp=2",
              "model.moe.bias_update_rate=1e-3"]
    layouts = {"ep1": (["parallel.ep=1"], 2), "ep2": (["parallel.ep=2"], 2),
               "ep2_zero3": (["parallel.ep=2", "zero.stage=3"], 2),
               "dp2_sp2_ep2": (["parallel.sp=2", "parallel.ep=2"], 4)}
    for name, (args, nproc) in layouts.items():
        _train_ranks(nproc, tmp_path / name, *common, *args)
    base = tmp_path / "ep1"
    assert sorted(_losses(base)) == list(range(1, 9))
    for name in ("ep2", "ep2_zero3", "dp2_sp2_ep2"):
        for key in ("loss", "grad_norm", "moe/layer0/aux_loss", "moe/layer1/z_loss", "val_loss"):
            a, b = _losses(base, key), _losses(tmp_path / name, key)
            assert sorted(a) == sorted(b) == ([4, 8] if key == "val_loss" else list(range(1, 9))), (name, key)
            for step in a:
                assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), (name, key, step)
    # Every rank's peak memory is recorded; ZeRO-3 gathers parameters, so it sends more than stage 0.
    last = json.loads(Path(tmp_path / "ep2_zero3" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["peak_rss_mb"] == max(last["peak_rss_mb/rank0"], last["peak_rss_mb/rank1"]) > 0
    assert last["comm_bytes"] > _losses(tmp_path / "ep2", "comm_bytes")[8] > 0
    assert (tmp_path / "ep2" / "expert_load.png").stat().st_size > 0
    assert "layer1" in (tmp_path / "ep2" / "expert_load.txt").read_text()


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
    # The wandb service may still be flushing the file after finish(): wait for its exit record.
    deadline = time.monotonic() + 60
    records = _read_wandb_records(files[0])
    while "exit" not in [r.WhichOneof("record_type") for r in records] and time.monotonic() < deadline:
        time.sleep(0.5)
        records = _read_wandb_records(files[0])
    history = []
    for rec in records:
        if rec.WhichOneof("record_type") == "history":
            history.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item})
    expected = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in expected] == [1, 2, 3, 4]
    assert [h["_step"] for h in history] == [e["step"] for e in expected]
    for h, e in zip(history, expected):
        assert h["loss"] == pytest.approx(e["loss"])
        assert h.get("val_loss") == e.get("val_loss")
