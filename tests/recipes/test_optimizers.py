"""optim.name in the recipe: 1-bit Adam trains, resumes inside its compressed phase bitwise, writes the bytes it
sends per step to metrics.jsonl, and every combination that cannot work is refused before training, in one line."""

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from recipes.config import ConfigError, check_config
from recipes.pretrain import train
from tests.recipes.test_pretrain import TINY, _losses, _run_cli, _train_ranks

REPO = Path(__file__).resolve().parents[2]
ONEBIT = ["optim=onebit_adam", "optim.onebit.warmup_steps=3", "optim.onebit.block=64"]


def _cfg(run_dir, *overrides):
    with initialize_config_dir(version_base=None, config_dir=str(REPO / "recipes" / "conf")):
        return compose("config", overrides=[*TINY, f"run_dir={run_dir}", "wandb.mode=disabled", *overrides])


#: (overrides, what is raised, the start of its text): the library's rules (zero.optim.onebit), naming the recipe's keys
REFUSED = [
    (["optim.name=lion"], ConfigError, "optim.name='lion' must be one of adamw, onebit_adam"),
    ([*ONEBIT, "zero.stage=2"], ConfigError, "1-bit Adam at zero.stage=2 is not supported: stages 2-3 reduce-scatter "
     "every gradient during backward"),
    ([*ONEBIT, "zero.stage=3"], ConfigError, "1-bit Adam at zero.stage=3 is not supported"),
    ([*ONEBIT, "zero.dtype=fp16"], ConfigError, "1-bit Adam with zero.dtype=fp16 is not supported"),
    ([*ONEBIT, "optim.grad_clip=1.0"], ConfigError, "1-bit Adam with optim.grad_clip=1.0 is not supported: the "
     "compressed phase never reduces gradients, so their global norm is unknown; set optim.grad_clip=0"),
    ([*ONEBIT, "zero.stage=1", "zero.quantize_gradients=int8"], ConfigError,
     "1-bit Adam with zero.quantize_gradients=int8 is not supported"),
    ([*ONEBIT, "zero.stage=1", "zero.offload_optimizer=cpu"], NotImplementedError,
     "1-bit Adam with zero.offload_optimizer=cpu is not implemented"),
    ([*ONEBIT, "parallel.tp=2"], NotImplementedError,
     "1-bit Adam with parallel.tp=2, parallel.pp=1 is not implemented"),
    ([*ONEBIT, "optim.onebit.block=12"], ConfigError,
     "optim.onebit.block=12 must be a positive multiple of 8 (signs pack 8 to a byte)"),
    ([*ONEBIT, "optim.onebit.warmup_steps=0"], ConfigError, "optim.onebit.warmup_steps=0 must be an integer >= 1"),
    ([*ONEBIT, "optim.onebit.refresh_every=-1"], ConfigError,
     "optim.onebit.refresh_every=-1 must be an integer >= 0 (0: the variance stays frozen)"),
    ([*ONEBIT, "optim.onebit.refresh_dtype=int4"], ConfigError,
     "optim.onebit.refresh_dtype='int4' must be one of int8, bf16, fp32"),
    ([*ONEBIT, "optim.onebit.max_update=0"], ConfigError,
     "optim.onebit.max_update=0.0 must be a number > 0, or null (no bound)"),
]


@pytest.mark.parametrize("overrides, error, message", REFUSED)
def test_refused_before_training(tmp_path, overrides, error, message):
    with pytest.raises(error) as refused:
        check_config(_cfg(tmp_path, *overrides))
    assert str(refused.value).startswith(message), str(refused.value)


def test_zero_one_adam_is_named_as_missing(tmp_path):
    with pytest.raises(NotImplementedError, match="optim.name=zero_one_adam is not implemented: 0/1 Adam's local"):
        check_config(_cfg(tmp_path, "optim.name=zero_one_adam"))


def test_onebit_resume_inside_compressed_phase_is_bitwise(tmp_path):
    full, cut = tmp_path / "full", tmp_path / "cut"
    refresh = "optim.onebit.refresh_every=2"  # (steps 6 and 8 are variance refreshes)
    train(_cfg(full, *ONEBIT, refresh, "train.steps=8", "train.eval_every=4", "zero.dtype=bf16"))
    train(_cfg(cut, *ONEBIT, refresh, "train.steps=8", "train.eval_every=4", "zero.dtype=bf16", "train.ckpt_every=5"))
    # a crash after step 5 (two compressed steps in): the last checkpoint and the records after it dropped
    for d in (cut / "checkpoints").glob("step_*"):
        if d.name != "step_0000005":
            import shutil

            shutil.rmtree(d)
    (cut / "checkpoints" / "latest").write_text("step_0000005")
    train(_cfg(cut, *ONEBIT, refresh, "train.steps=8", "train.eval_every=4", "zero.dtype=bf16", "train.ckpt_every=5"))
    assert _losses(cut) == _losses(full)  # exactly
    assert _losses(full)[8] < _losses(full)[1]


def test_torchrun_onebit_comm_bytes_per_step(tmp_path):
    """Two ranks at stage 0: after the warm-up each step sends 1-bit momenta (and an 8-byte norm), not fp32
    gradients; metrics.jsonl's comm_bytes says so."""
    args = [*TINY, *ONEBIT, "train.steps=6", "train.eval_every=0", "parallel.dp=2", "train.micro_batch_size=2",
            f"run_dir={tmp_path}"]
    proc = _run_cli(*args, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    sent = {r["step"]: r["comm_bytes"] for r in records if "comm_bytes" in r}
    warm, compressed = sent[2], sent[5]
    assert sent[4] == sent[5] == sent[6]
    assert warm / compressed > 15, sent  # fp32 gradients vs 1 bit + a scale per 64 elements (~1.5 bits)


DILOCO = ["optim.diloco.inner_steps=3", "optim.diloco.delta_dtype=int8"]


@pytest.mark.parametrize("overrides, error, message", [
    (["parallel.replicas=2"], ConfigError, "parallel.replicas=2 needs DiLoCo: set optim.diloco.inner_steps > 0"),
    ([*DILOCO, "optim.diloco.delta_dtype=fp8"], ConfigError,
     "optim.diloco.delta_dtype='fp8' must be one of fp32, bf16, int8"),
    ([*DILOCO, "optim.diloco.outer_momentum=1.0"], ConfigError,
     "optim.diloco.outer_lr=0.7 must be > 0 and optim.diloco.outer_momentum=1.0 in [0, 1)"),
    ([*DILOCO, *ONEBIT], ConfigError,
     "DiLoCo's inner optimizer (optim.name: OneBitAdam) takes over the engine's steps itself"),
    ([*DILOCO, "parallel.replicas=3"], ConfigError,
     "parallel.replicas=3 does not divide the 1 process(es): start a multiple of 3 processes"),
    ([*DILOCO, "optim.diloco.warmup_steps=-1"], ConfigError, "optim.diloco.warmup_steps=-1 must be an integer >= 0"),
    ([*DILOCO, "optim.diloco.warmup_steps=2", "zero.stage=1", "zero.offload_optimizer=cpu"], NotImplementedError,
     "DiLoCo's optim.diloco.warmup_steps=2 with zero.offload_optimizer=cpu is not implemented"),
    ([*DILOCO, "parallel.pp=2"], NotImplementedError, "DiLoCo with parallel.pp=2 is not implemented"),
])
def test_diloco_refused_before_training(tmp_path, overrides, error, message):
    with pytest.raises(error) as refused:
        check_config(_cfg(tmp_path, *overrides))
    assert str(refused.value).startswith(message), str(refused.value)


def test_diloco_resume_between_syncs_is_bitwise(tmp_path):
    full, cut = tmp_path / "full", tmp_path / "cut"
    args = [*DILOCO, "train.steps=8", "train.eval_every=4"]
    train(_cfg(full, *args))
    train(_cfg(cut, *args, "train.ckpt_every=4"))
    import shutil

    shutil.rmtree(cut / "checkpoints" / "step_0000008")  # a crash after step 4 (one step after the sync at 3)
    (cut / "checkpoints" / "latest").write_text("step_0000004")
    train(_cfg(cut, *args, "train.ckpt_every=4"))
    assert _losses(cut) == _losses(full)


def test_torchrun_diloco_two_replicas_talk_only_at_syncs(tmp_path):
    args = [*TINY, *DILOCO, "train.steps=6", "train.eval_every=0", "parallel.replicas=2", f"run_dir={tmp_path}"]
    proc = _run_cli(*args, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    sent = {r["step"]: r["comm_bytes"] for r in records if "comm_bytes" in r}
    assert [s for k, s in sent.items() if k % 3] == [0, 0, 0, 0] and sent[3] == sent[6] > 0, sent


def test_diloco_warm_start_is_data_parallel(tmp_path):
    """Two replicas warmed up for the whole run (4 steps) validate as AdamW over dp=2: the same gradients, and each
    replica evaluates its own shard of the validation batches; the warm-up steps send the gradient all-reduce.
    (The recipe on the tests' process pool: the test above runs DiLoCo's replicas under torchrun.)"""
    common = [*TINY, "train.steps=4", "train.eval_every=2", "optim.grad_clip=0"]
    _train_ranks(2, tmp_path / "plain", *common)
    _train_ranks(2, tmp_path / "warm", *common, *DILOCO, "parallel.replicas=2", "optim.diloco.warmup_steps=4")
    want, got = _losses(tmp_path / "plain", "val_loss"), _losses(tmp_path / "warm", "val_loss")
    assert sorted(got) == [2, 4] and got == pytest.approx(want, rel=1e-6, abs=0)
    sent = _losses(tmp_path / "warm", "comm_bytes")
    assert all(s >= 0.99 * _losses(tmp_path / "plain", "comm_bytes")[k] for k, s in sent.items()), sent
