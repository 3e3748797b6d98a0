"""Transparent huge pages for the large host buffers stage 3 allocates afresh every step.

With glibc's mmap threshold pinned (zero.engine.pins_host_allocator), each unit-sized gather buffer and gradient
buffer is a fresh anonymous mapping that its first write faults in 4 KiB page by page (a 24 MB buffer: ~6000
faults), and is unmapped again when freed. Where the kernel's transparent huge pages are in `madvise` mode (or
`always`), advising the mapping's 2 MiB-aligned interior with MADV_HUGEPAGE before the first write lets it be
faulted in 2 MiB pages instead. Advice changes no value; it is given only while `enable_huge_pages(True)` is in
force (the engine sets it when it pins the threshold), to host tensors of at least one huge page, on Linux with
THP not `never`; anywhere else `advise_huge_pages` does nothing.
"""

from __future__ import annotations

import functools
import os

import torch

#: Transparent huge page size on x86-64 and arm64 with 4 KiB base pages.
HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"
_enabled = False


def thp_mode(path: str = _THP_MODE) -> str:
    """The kernel's transparent huge page mode (`always`, `madvise` or `never`); `never` where there is none."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return "never"
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else "never"


@functools.cache
def _madvise():
    """libc's madvise where advice can take effect (Linux, THP not `never`), else None."""
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux") or thp_mode() == "never":
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def enable_huge_pages(on: bool) -> bool:
    """Give huge page advice to the buffers passed to `advise_huge_pages` from now on (process-wide, like glibc's
    mmap threshold it accompanies); returns whether advice can take effect here."""
    global _enabled
    _enabled = bool(on) and _madvise() is not None
    return _enabled


def huge_pages_enabled() -> bool:
    return _enabled


def advise_huge_pages(t: torch.Tensor) -> int:
    """Advise the 2 MiB-aligned interior of `t`'s storage for huge pages before it is first written; returns the
    bytes advised (0: nothing done: advice off, not a host tensor, smaller than the aligned huge pages it spans)."""
    if not _enabled or t.device.type != "cpu":
        return 0
    storage = t.untyped_storage()
    addr, nbytes = storage.data_ptr(), storage.nbytes()
    start = -(-addr // HUGE_PAGE) * HUGE_PAGE
    end = (addr + nbytes) // HUGE_PAGE * HUGE_PAGE
    if end <= start:
        return 0
    madvise = _madvise()
    if madvise is None or madvise(start, end - start, _MADV_HUGEPAGE) != 0:
        return 0
    return end - start


def enable_torch_huge_pages() -> bool:
    """Have torch's own host allocator align every block of 2 MiB or more to 2 MiB and advise it for huge pages
    (torch's THP_MEM_ALLOC_ENABLE; an explicit value in the environment is left as it is), where advice can take
    effect. This reaches what the engine cannot advise itself (activations, autograd's gradients, gloo's copies,
    the optimizer's temporaries), but torch reads the setting once, at the process's first host allocation: call it
    before any tensor exists; later it changes nothing. Returns whether torch's large host blocks are advised in
    this process (a probe allocation, 2 MiB-aligned only when they are)."""
    if _madvise() is None:
        return False
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    return torch_huge_pages()


def torch_huge_pages() -> bool:
    """Whether torch's host allocator advises its large blocks for huge pages (see enable_torch_huge_pages);
    allocating the probe latches torch's setting if nothing was allocated before."""
    return advised(torch.empty(2 * HUGE_PAGE, dtype=torch.uint8))


def advised(t: torch.Tensor) -> bool:
    """Whether the first whole 2 MiB page inside `t`'s host storage lies in a mapping advised MADV_HUGEPAGE (the
    kernel's record of the advice: `hg` among the mapping's VmFlags in /proc/self/smaps); False where none is."""
    storage = t.untyped_storage()
    addr = -(-storage.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    if t.device.type != "cpu" or addr + HUGE_PAGE > storage.data_ptr() + storage.nbytes():
        return False
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    start, end = (int(x, 16) for x in head.split("-"))
                    inside = start <= addr < end
                elif inside and head == "VmFlags:":
                    return "hg" in line.split()[1:]
    except OSError:
        pass
    return False


def empty_advised(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.empty advised for huge pages (see `advise_huge_pages`): uninitialised, first written by the caller."""
    t = torch.empty(numel, dtype=dtype, device=device)
    advise_huge_pages(t)
    return t


def zeros_advised(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros advised for huge pages before it is zeroed (see `advise_huge_pages`)."""
    return empty_advised(numel, dtype, device).zero_()
