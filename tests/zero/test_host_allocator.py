"""ZeRO-3 on the host pins glibc's mmap threshold (zero.host_mmap_threshold, 1 MiB by default; 0 leaves the
allocator alone): left to itself, glibc raises the threshold to the size of each large block it frees, so the unit
gathers, gradient buffers and collective copies that stage 3 allocates and frees every step come from heaps that
keep the freed pages, and resident memory grows step after step (benchmarks/hf_models.md: VmHWM 2151 MiB after 6
steps of a 75M DeepSeek-V3-style model, 1350 MiB with the pin). What a pinned threshold does is
checked on the allocator itself: a block the engine frees after it is pinned goes back to the operating system."""

from __future__ import annotations

import ctypes
import ctypes.util

import pytest
import torch

import zero
import zero.engine as engine_module
from tests.zero.models import SGD, build

MIB = 1 << 20


def _glibc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 - raises AttributeError where the C library is not glibc
        return libc
    except (OSError, AttributeError):
        return None


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _returned_bytes(nbytes: int) -> int:
    """Resident memory handed back when a touched block of `nbytes` is freed, after a larger block was allocated and
    freed first (which, with a dynamic threshold, raises glibc's mmap threshold above `nbytes`)."""
    big = torch.ones(3 * nbytes // 4)  # 3 x nbytes bytes: mapped on its own, then unmapped
    del big
    block = torch.ones(nbytes // 4)  # touched: resident
    before = _rss()
    del block
    return before - _rss()


def _pins(monkeypatch, **config) -> list[int]:
    """The thresholds the engine pins while it is built with `config` (the real pin runs)."""
    pinned: list[int] = []
    real = engine_module.pin_mmap_threshold
    monkeypatch.setattr(engine_module, "pin_mmap_threshold", lambda n: pinned.append(n) or real(n))
    zero.initialize(build(seed=0), SGD, zero.ZeroConfig(**config))
    return pinned


def test_stage3_on_the_host_pins_the_mmap_threshold(monkeypatch) -> None:
    assert zero.ZeroConfig().host_mmap_threshold == MIB
    assert _pins(monkeypatch, stage=3) == [MIB]
    assert _pins(monkeypatch, stage=3, host_mmap_threshold=4 * MIB) == [4 * MIB]
    # off: the allocator left alone; stages 0-2 gather nothing per step
    assert _pins(monkeypatch, stage=3, host_mmap_threshold=0) == []
    assert _pins(monkeypatch, stage=2) == []
    assert not engine_module.pins_host_allocator(zero.ZeroConfig(stage=3), torch.device("meta"))
    if _glibc() is None:
        pytest.skip("the C library is not glibc: the threshold's effect is glibc's")
    # pinned (last at 4 MiB, then 1 MiB): a freed 8 MiB block leaves resident memory, even after a 24 MiB one
    assert _returned_bytes(8 * MIB) >= 6 * MIB
