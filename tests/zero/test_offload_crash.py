"""A process SIGKILLed while writing a checkpoint of nvme-offloaded state leaves the previous one loadable.

A child process trains at stage 3 with the optimizer and the parameters offloaded to nvme files, saves
checkpoint A and records what A holds, trains one more step and saves to the same path again; it is
killed in the middle of writing an optimizer-state tensor that was read back from its nvme files. A
fresh engine (another seed, another process) then loads the path next to the killed run's leftover
nvme files and must get exactly A: the same state, RNG and next loss.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

import zero
import zero.offload.nvme
import zero.state.checkpoint
from tests.zero.models import build, global_batch, lm_loss

ROOT = Path(__file__).resolve().parents[2]
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
SHARD = "rank00000.safetensors"


def _engine(tmp: Path, seed: int) -> zero.Engine:
    # Small chunks and ring: the offloaded step streams many chunks through reused buffers.
    config = zero.ZeroConfig(stage=3, offload_optimizer="nvme", offload_params="nvme", nvme_path=str(tmp / "nvme"),
                             offload_chunk_size=97, offload_buffer_count=3)
    return zero.initialize(build(seed=seed, tie=True), ADAMW, config)


def _step(engine: zero.Engine, step: int) -> float:
    loss = lm_loss(engine, global_batch(step, 0, 4))
    engine.backward(loss)
    assert engine.step()
    return loss.item()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class _DyingFile:
    """A file that, when asked to write `target` (one tensor's bytes), writes half of it and is SIGKILLed."""

    def __init__(self, f, target: bytes, marker: Path) -> None:
        self.f, self.target, self.marker, self.written = f, target, marker, 0

    def write(self, data) -> int:
        data = bytes(data)
        if data == self.target:
            self.f.write(data[: len(data) // 2])
            self.f.flush()
            os.fsync(self.f.fileno())
            self.marker.write_text(json.dumps({"written": self.written + len(data) // 2, "tensor": len(data)}))
            os.kill(os.getpid(), signal.SIGKILL)
        self.written += len(data)
        return self.f.write(data)

    def __getattr__(self, name: str):
        return getattr(self.f, name)


def _child(tmp: str) -> None:
    """Save A after 2 steps and record it; train a third step; die while writing B over A."""
    tmp = Path(tmp)
    engine = _engine(tmp, seed=0)
    for step in range(2):
        _step(engine, step)
    engine.save_checkpoint(str(tmp / "ckpt"))
    reference = {"state": engine.state_dict(), "full": engine.full_state_dict(), "rng": torch.get_rng_state(),
                 "sha256": _sha256(tmp / "ckpt" / SHARD)}
    reference["next_loss"] = _step(engine, 2)
    torch.save(reference, tmp / "reference.pt")

    real_dump = zero.state.checkpoint.dump

    def dump(obj, f):
        # The largest exp_avg_sq shard, as NvmeMasters.state_dict read it from the nvme file.
        state = obj["engine"]["optimizer"]["state"]
        target = max((s["exp_avg_sq"] for s in state.values()), key=torch.Tensor.numel)
        return real_dump(obj, _DyingFile(f, target.numpy().tobytes(), tmp / "killed.json"))

    zero.state.checkpoint.dump = dump
    engine.save_checkpoint(str(tmp / "ckpt"))
    raise AssertionError("the second save returned: the kill inside its write never happened")


def _assert_equal(got, expected, where: str = "state") -> None:
    assert type(got) is type(expected), where
    if isinstance(expected, dict):
        assert got.keys() == expected.keys(), where
        for k in expected:
            _assert_equal(got[k], expected[k], f"{where}[{k!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), where
        for i, (g, e) in enumerate(zip(got, expected)):
            _assert_equal(g, e, f"{where}[{i}]")
    elif isinstance(expected, torch.Tensor):
        assert got.dtype == expected.dtype and torch.equal(got, expected), where
    else:
        assert got == expected, where


def test_sigkill_while_writing_offloaded_state_leaves_the_previous_checkpoint(tmp_path):
    nvme, ckpt = tmp_path / "nvme", tmp_path / "ckpt"
    nvme.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    code = "import sys; from tests.zero.test_offload_crash import _child; _child(sys.argv[1])"
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]

    # The kill landed half-way through an nvme-read tensor of B: a partial shard, never completed.
    killed = json.loads((tmp_path / "killed.json").read_text())
    partial = ckpt.with_name("ckpt.tmp") / SHARD
    assert partial.stat().st_size == killed["written"] > killed["tensor"] // 2 > 0
    assert not (partial.parent / "meta.json").exists()
    reference = torch.load(tmp_path / "reference.pt", weights_only=False)
    assert _sha256(ckpt / SHARD) == reference["sha256"]  # A's file is untouched

    # SIGKILL runs no finalizer: the killed run's nvme files stay. Poison them, so reading one would show.
    leftovers = sorted(nvme.glob("zero-*.bin"))
    assert leftovers and all(f"zero-{zero.offload.nvme.RUN_TOKEN}-" not in p.name for p in leftovers)
    for p in leftovers:
        p.write_bytes(b"\xff" * p.stat().st_size)  # NaN in every fp32 element

    engine = _engine(tmp_path, seed=7)
    engine.load_checkpoint(str(ckpt))
    _assert_equal(engine.state_dict(), reference["state"])
    _assert_equal(engine.full_state_dict(), reference["full"])
    assert torch.equal(torch.get_rng_state(), reference["rng"])
    assert engine.global_steps == 2
    torch.testing.assert_close(_step(engine, 2), reference["next_loss"], rtol=1e-6, atol=0)
    engine.close()

    assert sorted(nvme.glob("zero-*.bin")) == leftovers  # the new run removed its own files, not the old
    assert all(set(p.read_bytes()) == {0xFF} for p in leftovers)
