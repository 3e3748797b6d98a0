"""ZeRO-3 on the host pins glibc's mmap threshold (zero.host_mmap_threshold, 1 MiB by default; 0 leaves the
allocator alone): left to itself, glibc raises the threshold to the size of each large block it frees, so the unit
gathers, gradient buffers and collective copies that stage 3 allocates and frees every step come from heaps that
keep the freed pages, and resident memory grows step after step (benchmarks/hf_models.md: VmHWM 2151 MiB after 6
steps of a 75M DeepSeek-V3-style model, 1350 MiB with the pin). What a pinned threshold does is
checked on the allocator itself: a block the engine frees after it is pinned goes back to the operating system."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import zero
import zero.engine as engine_module
import zero.sharding.optimizer as optimizer_module
from tests.zero.models import SGD, build
from zero.offload import hugepages

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


def test_stage3_on_the_host_advises_its_fresh_buffers_for_huge_pages(monkeypatch) -> None:
    """With the threshold pinned every unit gather and gradient staging buffer is a fresh mapping; the engine advises
    each for transparent huge pages before its first write (2 MiB faults instead of 4 KiB ones: benchmarks/
    hf_models.md, run M). Checked on the kernel's own record of the advice, the mapping's VmFlags."""
    if hugepages.thp_mode() == "never" or not sys.platform.startswith("linux"):
        pytest.skip("no transparent huge pages here: the advice is a no-op")
    monkeypatch.setattr(hugepages, "_enabled", False)  # the engine turns it on, not an earlier test
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 2048), nn.GELU(), nn.Linear(2048, 8))  # one 8.5 MB unit
    engine = zero.initialize(model, SGD, zero.ZeroConfig(stage=3))
    seen: dict[str, bool] = {}

    def look(module, inputs, output) -> None:
        seen.setdefault("gathered", hugepages.advised(module.weight))

    model[0].register_forward_hook(look)
    reduce = optimizer_module._reduce

    def spy(bucket, flat, async_op):
        seen.setdefault("staged", hugepages.advised(flat))
        return reduce(bucket, flat, async_op)

    monkeypatch.setattr(optimizer_module, "_reduce", spy)
    engine.backward(engine(torch.randn(4, 1024)).square().mean())
    assert seen == {"gathered": True, "staged": True}


def test_huge_page_advice_is_a_no_op_where_it_does_not_apply(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(hugepages, "_enabled", True)
    assert hugepages.advise_huge_pages(torch.empty(4 << 20, device="meta")) == 0  # not a host tensor
    assert hugepages.advise_huge_pages(torch.empty(1024)) == 0  # no whole huge page inside
    monkeypatch.setattr(hugepages, "_enabled", False)
    assert hugepages.advise_huge_pages(torch.empty(4 << 20)) == 0  # advice off
    mode = tmp_path / "enabled"
    mode.write_text("always madvise [never]\n")
    assert hugepages.thp_mode(str(mode)) == "never"
    mode.write_text("always [madvise] never\n")
    assert hugepages.thp_mode(str(mode)) == "madvise"
    assert hugepages.thp_mode(str(tmp_path / "missing")) == "never"
    monkeypatch.setattr(hugepages, "thp_mode", lambda: "never")
    hugepages._madvise.cache_clear()
    try:
        assert not hugepages.enable_huge_pages(True) and not hugepages.huge_pages_enabled()
    finally:
        hugepages._madvise.cache_clear()


def test_torch_huge_pages_are_enabled_before_the_first_tensor_only(monkeypatch) -> None:
    """enable_torch_huge_pages() at a process's start has torch advise its own large host blocks (activations,
    autograd's gradients, the optimizer's temporaries: most of the pinned engine's page faults, run M); after the
    first tensor it changes nothing, and says so."""
    if hugepages.thp_mode() == "never" or not sys.platform.startswith("linux"):
        pytest.skip("no transparent huge pages here: the advice is a no-op")
    probe = ("import torch\n"
             "from zero.offload.hugepages import enable_torch_huge_pages, torch_huge_pages\n"
             "print(enable_torch_huge_pages(), torch_huge_pages())\n")
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    fresh = subprocess.run([sys.executable, "-c", probe], env=env, cwd=root, capture_output=True, text=True, check=True)
    assert fresh.stdout == "True True\n"
    if "THP_MEM_ALLOC_ENABLE" in os.environ:
        return  # this process started with torch's setting given: it is latched as given
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)  # (restored: later subprocesses start without it)
    assert not hugepages.enable_torch_huge_pages() and not hugepages.torch_huge_pages()  # tensors exist already
