"""ZeRO-Offload (host) and ZeRO-Infinity (nvme) train exactly as no offload does; bad targets fail early.

In fp32 every run is checked against the single-process reference (`tests.equivalence`: losses, gradient
norms, every parameter on every rank after the first step and at the end); in bf16 each offloaded run
against the same run without offload, whose compute weights must be the rounded masters.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed as dist

import zero
import zero.offload.nvme
from tests.equivalence import Recorder, as_reference, assert_equivalent
from tests.multirank import run_multirank
from tests.zero.models import build, global_batch, lm_loss, reference

ROWS, STEPS = 2, 4
# AdamW whose state is streamed: two per-element tensors and a scalar step.
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
# SGD with momentum: one per-element state tensor to stream, and after the first step the parameters are
# the initial values minus lr times the gradient, so equivalence checks the offloaded gradient path itself.
MOMENTUM = functools.partial(torch.optim.SGD, lr=0.5, momentum=0.9)


def _engine(stage: int, dtype: str, root: str | None, seed: int = 0, optimizer=ADAMW, **offload) -> zero.Engine:
    if offload.get("offload_optimizer") == "nvme" or offload.get("offload_params") == "nvme":
        offload["nvme_path"] = root
    # Tiny chunks and a small ring: many chunks, an uneven tail, every buffer reused.
    config = zero.ZeroConfig(stage=stage, dtype=dtype, grad_accum_steps=2, clip_grad_norm=0.5,
                             reduce_bucket_size=500, offload_chunk_size=97, offload_buffer_count=3, **offload)
    return zero.initialize(build(seed=seed, tie=True), optimizer, config)


def _train(engine: zero.Engine, steps: range, record: Recorder | None = None) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in steps:
        total = 0.0
        for micro in range(2):
            rows = global_batch(step, micro, ROWS * world)[rank * ROWS : (rank + 1) * ROWS]
            loss = lm_loss(engine, rows)
            engine.backward(loss)
            total += loss.item() / 2
        assert engine.step()
        losses.append(total)
        if record is not None:
            record.step(total)
    return losses


def _record(engine: zero.Engine) -> dict:
    record = Recorder(engine, engine.dims.dp_group)
    _train(engine, range(STEPS), record)
    return record.result()


OFFLOADS = {"cpu": {"offload_optimizer": "cpu"}, "nvme": {"offload_optimizer": "nvme"}}
# Stage 3 only: parameter shards offloaded too (alone, and with the optimizer).
PARAM_OFFLOADS = {
    "params_nvme": {"offload_params": "nvme"},
    "params_cpu+opt_cpu": {"offload_params": "cpu", "offload_optimizer": "cpu"},
    "params_nvme+opt_nvme": {"offload_params": "nvme", "offload_optimizer": "nvme"},
}


def _equivalence(root: str) -> dict:
    out = {}
    for dtype in ("fp32", "bf16"):
        for stage in (1, 2, 3):
            for name, offload in {"none": {}, **OFFLOADS, **(PARAM_OFFLOADS if stage == 3 else {})}.items():
                engine = _engine(stage, dtype, root, optimizer=MOMENTUM, **offload)
                out[(dtype, stage, name)] = _record(engine)
                engine.close()
    dist.barrier()  # every rank has closed its engines
    out["files_left"] = sorted(os.listdir(root))
    return out


def test_offload_trains_as_no_offload_at_every_stage(tmp_path):
    results = run_multirank(_equivalence, 2, str(tmp_path), timeout=400)
    for r in results:
        assert r.pop("files_left") == []  # every offload file is removed when its engine closes
    fp32 = reference({"tie": True}, STEPS, ROWS * 2, accum=2, clip=0.5, optimizer=MOMENTUM)
    runs = sorted(results[0])
    assert len(runs) == 2 * (3 * 3 + 3) and all(set(r) == set(runs) for r in results)
    for key in runs:
        dtype, stage, name = key
        per_rank = [r[key] for r in results]
        if dtype == "fp32":
            assert_equivalent(per_rank, fp32, label=str(key))
        else:  # the same arithmetic in another place: equal to fp32 rounding of the update order
            assert_equivalent(per_rank, as_reference(results[0][(dtype, stage, "none")]), rtol=1e-6, atol=1e-7,
                              label=str(key))


def _checkpoint_round_trip(root: str) -> dict:
    """Save under one offload, resume under each other: the same next losses as not stopping."""
    out = {}
    every = {**OFFLOADS, **PARAM_OFFLOADS}
    cases = [(2, "nvme", ("none", "cpu", "nvme")), (2, "none", ("cpu", "nvme")),
             (3, "params_nvme+opt_nvme", ("none", "params_cpu+opt_cpu")), (3, "none", ("params_nvme+opt_nvme",))]
    for stage, saved_with, loaders in cases:
        a = _engine(stage, "fp32", root, **every.get(saved_with, {}))
        _train(a, range(3))
        path = os.path.join(root, f"ckpt_{stage}_{saved_with}")
        a.save_checkpoint(path)
        expected = _train(a, range(3, 6))
        a.close()
        for load_with in loaders:
            b = _engine(stage, "fp32", root, seed=7 + dist.get_rank(), **every.get(load_with, {}))
            b.load_checkpoint(path)
            out[(stage, saved_with, load_with)] = (_train(b, range(3, 6)), expected)
            b.close()
    return out


def test_checkpoints_move_between_offload_targets(tmp_path):
    for r in run_multirank(_checkpoint_round_trip, 2, str(tmp_path), timeout=300):
        for key, (got, expected) in r.items():
            torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-6, atol=0,
                                       msg=lambda m, k=key: f"saved/loaded {k}: {m}")


# ---------------------------------------------------------------------------- bad targets, in-process
def test_nvme_target_errors_come_before_training(tmp_path, monkeypatch):
    def engine(path):
        config = zero.ZeroConfig(stage=1, offload_optimizer="nvme", nvme_path=str(path))
        return zero.initialize(build(), ADAMW, config)

    with pytest.raises(zero.ConfigError, match="does not exist"):
        engine(tmp_path / "missing")
    with pytest.raises(zero.ConfigError, match="not writable"):
        engine("/proc")
    monkeypatch.setattr(zero.offload.nvme, "disk_free_bytes", lambda path: 1000)
    numel = sum(p.numel() for p in build().parameters())
    with pytest.raises(zero.ConfigError, match=f"needs .* GiB \\({3 * 4 * numel} bytes\\)"):
        engine(tmp_path)  # master + exp_avg + exp_avg_sq, fp32, world 1
    assert os.listdir(tmp_path) == []
    with pytest.raises(zero.ConfigError, match="nvme_path is missing"):
        zero.ZeroConfig(stage=2, offload_optimizer="nvme")
    with pytest.raises(zero.ConfigError, match="needs zero.stage=3"):
        zero.ZeroConfig(stage=2, offload_params="cpu")
    with pytest.raises(zero.ConfigError, match="needs zero.stage >= 1"):
        zero.ZeroConfig(stage=0, offload_optimizer="cpu")


def test_two_engines_share_an_nvme_directory(tmp_path):
    def engine(seed):
        config = zero.ZeroConfig(stage=3, offload_optimizer="nvme", offload_params="nvme", nvme_path=str(tmp_path))
        return zero.initialize(build(seed=seed, tie=True), ADAMW, config)

    a = engine(0)
    before = a.full_state_dict()
    b = engine(1)  # same names, same directory: it must not truncate a's files
    after = a.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    b_state = b.full_state_dict()
    a.close()  # removes a's files only
    assert all(torch.equal(b_state[k], v) for k, v in b.full_state_dict().items())
    b.close()
    assert os.listdir(tmp_path) == []
