"""Saving a checkpoint streams the state: no copy of the whole shard or optimizer state is ever in memory.

A census of tensor storages (every storage an op allocates while the save runs, counted until it is freed) bounds
what a save holds beyond the engine's own memory by the largest one tensor of its state (a bucket's fp32 shard,
compute-dtype shard or optimizer moment), for each offload mode at stage 3 and for stage 1. Memory that file
mappings touch is not an allocation: the nvme moments written from their mappings drop their pages after the
write (zero.offload.nvme.TensorFile.mapped), which the RSS measurement in benchmarks/big_model.md covers. A
save, one more step, and a load into a fresh engine that repeats that step give bitwise the same loss and
parameters (nvme offload of parameters and optimizer state at stage 3).
"""

from __future__ import annotations

import functools
import os
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import zero
import zero.state.checkpoint
from tests.zero.models import build, global_batch, lm_loss

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
SLACK = 8 << 10  # small temporaries of a save: the RNG state (5 KiB), scalar optimizer state


class _StorageCensus(TorchDispatchMode):
    """The bytes of storages allocated by ops inside the mode and still alive, and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live, self.peak, self._seen = 0, 0, set()

    def _freed(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in inputs or key in self._seen or not storage.nbytes():
                continue  # a view or an in-place result: no new memory
            self._seen.add(key)
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, key, storage.nbytes())
        return out


def _mapped_rss(directory: str) -> int:
    """Bytes of this process's RSS in mappings of files under `directory` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's header line
                inside = len(fields) >= 6 and fields[5].startswith(directory)
            elif inside and fields[0] == "Rss:":
                total += int(fields[1]) << 10
    return total


class _MappedRssProbe:
    """A shard file that records, after each write, the RSS of mappings of the nvme files (its peak)."""

    def __init__(self, f, directory: str) -> None:
        self.f, self.directory, self.peak = f, directory, 0

    def write(self, data) -> int:
        n = self.f.write(data)
        self.peak = max(self.peak, _mapped_rss(self.directory))
        return n

    def __getattr__(self, name: str):
        return getattr(self.f, name)


def _engine(tmp_path, stage: int, offload: str, seed: int = 0) -> zero.Engine:
    nvme = tmp_path / "nvme"
    nvme.mkdir(exist_ok=True)
    config = zero.ZeroConfig(stage=stage, offload_optimizer=offload,
                             offload_params="nvme" if offload == "nvme" and stage == 3 else "none",
                             nvme_path=str(nvme), offload_chunk_size=256, reduce_bucket_size=500,
                             stage3_unit_classes=("Block",) if stage == 3 else None)
    return zero.initialize(build(seed=seed, tie=True, n_layers=6), ADAMW, config)


def _step(engine: zero.Engine, step: int) -> float:
    loss = lm_loss(engine, global_batch(step, 0, 4))
    engine.backward(loss)
    assert engine.step()
    return loss.item()


def _largest_tensor_bytes(engine: zero.Engine) -> int:
    """The largest single tensor a checkpoint shard holds: a bucket's fp32 master or moment, or its shard."""
    return max(b.shard_size * 4 for b in engine.buckets)


@pytest.mark.parametrize("stage,offload", [(3, "nvme"), (3, "cpu"), (3, "none"), (1, "none")])
def test_save_holds_at_most_one_tensor_beyond_the_engine(tmp_path, monkeypatch, stage, offload):
    engine = _engine(tmp_path, stage, offload)
    try:
        _step(engine, 0)
        assert len(engine.buckets) >= 3, "the bound needs a state of several buckets to tell streaming apart"
        total = sum(b.shard_size * 4 for b in engine.buckets)
        bound = _largest_tensor_bytes(engine) + SLACK
        assert total > bound, "the state must be larger than the bound, or the check cannot fail"
        census, probes = _StorageCensus(), []
        real_dump = zero.state.checkpoint.dump

        def dump(obj, f):
            probes.append(_MappedRssProbe(f, str(tmp_path / "nvme")))
            return real_dump(obj, probes[-1])

        monkeypatch.setattr(zero.state.checkpoint, "dump", dump)
        with census:
            engine.save_checkpoint(str(tmp_path / "ckpt"))
        assert census.peak <= bound, (f"a save held {census.peak} bytes of new tensors at once; streaming holds "
                                      f"at most the largest tensor ({bound - SLACK} bytes) plus {SLACK}; the "
                                      f"masters alone are {total} bytes")
        # nvme moments are written from file mappings: one tensor's pages (and a page on each side) at a time
        page = os.sysconf("SC_PAGE_SIZE")
        assert probes[0].peak <= _largest_tensor_bytes(engine) + 2 * page, (
            f"{probes[0].peak} bytes of nvme file mappings resident during a save; the pages of each written "
            f"tensor are dropped, so at most one tensor's ({_largest_tensor_bytes(engine)} bytes) plus two pages")
    finally:
        engine.close()


def test_nvme_save_then_load_continues_bitwise(tmp_path):
    engine = _engine(tmp_path, 3, "nvme", seed=0)
    try:
        for step in range(2):
            _step(engine, step)
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        expected = [_step(engine, step) for step in (2, 3)]
        expected_params = engine.full_state_dict()
    finally:
        engine.close()
    resumed = _engine(tmp_path, 3, "nvme", seed=1)  # other initial values: everything comes from the checkpoint
    try:
        resumed.load_checkpoint(str(tmp_path / "ckpt"))
        assert [_step(resumed, step) for step in (2, 3)] == expected
        got = resumed.full_state_dict()
        assert got.keys() == expected_params.keys()
        for name, value in expected_params.items():
            assert torch.equal(got[name], value), name
    finally:
        resumed.close()


def test_nvme_load_holds_one_tensor_of_the_shard_file_at_a_time(tmp_path, monkeypatch):
    """Loading copies each tensor of the (memory-mapped) shard where it lives and drops its pages at once: once
    every bucket shard and nvme moment is in place, the shard file's pages left in the process are within one
    tensor's and the pages that tensors share at their boundaries (kept: they are not wholly one tensor's), not the
    whole file. (The reader may map a small file whole up front, so
    the check is after the copies, where an unreleased load still holds every page it touched.)"""
    import zero.engine
    import zero.offload.masters

    (tmp_path / "nvme").mkdir()
    config = zero.ZeroConfig(stage=3, offload_optimizer="nvme", offload_params="nvme", nvme_path=str(tmp_path / "nvme"),
                             offload_chunk_size=4096, stage3_unit_classes=("Linear",))

    def engine(seed: int) -> zero.Engine:
        torch.manual_seed(seed)
        return zero.initialize(torch.nn.Sequential(*[torch.nn.Linear(96, 96) for _ in range(6)]), ADAMW, config)

    first = engine(0)
    try:
        loss = first(torch.randn(4, 96)).square().mean()
        first.backward(loss)
        assert first.step()
        first.save_checkpoint(str(tmp_path / "ckpt"))
        largest = max(b.shard_size * 4 for b in first.buckets)
        shard_file = (tmp_path / "ckpt" / "rank00000.safetensors").stat().st_size
    finally:
        first.close()
    page = os.sysconf("SC_PAGE_SIZE")
    assert largest > 4 * page and shard_file > 3 * (largest + 22 * page), "tensors of several pages, many of them"
    resident = []
    for module in (zero.engine, zero.offload.masters):
        real = module.done_reading

        def probe(t, real=real):
            real(t)
            resident.append(_mapped_rss(str(tmp_path / "ckpt")))

        monkeypatch.setattr(module, "done_reading", probe)
    second = engine(1)
    try:
        second.load_checkpoint(str(tmp_path / "ckpt"))
    finally:
        second.close()
    assert len(resident) == 6 + 6 * 2, "every bucket shard and both moments of every bucket are released"
    bound = largest + (len(resident) + 4) * page  # a boundary page per tensor, the header's, the RNG state's
    assert resident[-1] <= bound, (f"{resident[-1]} bytes of the {shard_file}-byte shard file still resident after "
                                   f"a load; at most one tensor ({largest} bytes) and a page per tensor: {bound}")
