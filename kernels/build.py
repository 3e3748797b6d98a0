"""Building JIT extensions safely: torch's loader (torch.utils.cpp_extension.load) waits for as long as a build's
lock file exists, and its builder keeps that file open while it builds. A builder killed mid-build (a timeout, a
signal) leaves a lock that nothing holds open, and every later load of that extension on the machine would wait
for it forever; `clear_stale_lock` removes such a lock (and only such a one)."""

from __future__ import annotations

import glob
import os
from pathlib import Path


def lock_holders(path: str | os.PathLike) -> list[int]:
    """The processes of this machine (that this user may inspect) that hold `path` open."""
    target = os.path.realpath(path)
    holders = []
    for fd_dir in glob.glob("/proc/[0-9]*/fd"):
        try:
            if any(os.readlink(os.path.join(fd_dir, fd)) == target for fd in os.listdir(fd_dir)):
                holders.append(int(fd_dir.split("/")[2]))
        except OSError:  # (gone meanwhile, or not ours to inspect)
            continue
    return holders


def clear_stale_lock(lock: str | os.PathLike) -> bool:
    """Remove torch's build lock `lock` when no process holds it open (its builder was killed); whether it did.
    Where processes cannot be inspected (no /proc) nothing is removed."""
    lock = Path(lock)
    if not lock.exists() or not os.path.isdir("/proc/self/fd") or lock_holders(lock):
        return False
    lock.unlink(missing_ok=True)
    return True


def build_lock(name: str) -> Path:
    """The lock file torch's loader uses for the extension `name` (in its build directory)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, False)) / "lock"
