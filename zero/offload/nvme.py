"""Per-rank files for offloaded tensors (ZeRO-Infinity): the directory checks and the flat file itself.

A `TensorFile` holds named fields of `numel` elements each, end to end, read and written in place
with pread/pwrite (the GIL is released, so background threads overlap IO with compute). Files are
created per run under a random name and removed when closed or at exit: a file left by a crash is
never read again (a restart starts from a checkpoint, which is written atomically).
"""

from __future__ import annotations

import atexit
import functools
import itertools
import os
import secrets
import shutil
import tempfile
import weakref

import torch

from zero.config import ConfigError

#: One name per process: every file this process creates carries it.
RUN_TOKEN = secrets.token_hex(4)
_SERIAL = itertools.count()


class OffloadError(ConfigError):
    """An offload target that cannot be used (missing, unwritable or too small a directory)."""


def disk_free_bytes(path: str) -> int:
    """Free bytes of the filesystem holding `path` (tests replace it to simulate a small disk)."""
    return shutil.disk_usage(path).free


def check_nvme_path(path: str, needed_bytes: int, what: str) -> None:
    """Refuse, before any training, a directory that is missing, unwritable or too small for `what`."""
    if not os.path.isdir(path):
        raise OffloadError(f"zero.nvme_path={path!r} does not exist or is not a directory: create it first "
                           "(nvme offload needs a directory on a fast local disk)")
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".zero-write-test-"):
            pass
    except OSError as e:
        raise OffloadError(
            f"zero.nvme_path={path!r} is not writable ({e.strerror}); choose another directory"
        ) from None
    free = disk_free_bytes(path)
    if free < needed_bytes:
        raise OffloadError(
            f"zero.nvme_path={path!r} has {free / 2**30:.2f} GiB free but this rank's offloaded {what} needs "
            f"{needed_bytes / 2**30:.2f} GiB ({needed_bytes} bytes): free space or use a larger disk"
        )


def pin_mmap_threshold(nbytes: int) -> bool:
    """Fix glibc's mmap threshold at `nbytes` (blocks this large are returned to the OS when freed);
    False where the C library is not glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(-3, int(nbytes)))  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def _bytes_view(t: torch.Tensor) -> memoryview:
    # Through uint8: numpy has no bfloat16, and the file only moves bytes.
    return memoryview(t.detach().contiguous().view(torch.uint8).numpy()).cast("B")


class TensorFile:
    """Fields of `numel` elements of `dtype` laid end to end in one file, space reserved up front."""

    def __init__(self, directory: str, name: str, numel: int, fields: list[str], dtype: torch.dtype) -> None:
        # The serial keeps two live engines of one process (same name, same directory) apart.
        self.path = os.path.join(directory, f"zero-{RUN_TOKEN}-{next(_SERIAL)}-{name}.bin")
        self.numel, self.fields, self.dtype = numel, list(fields), dtype
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        size = numel * self.itemsize * len(self.fields)
        try:
            if size and hasattr(os, "posix_fallocate"):
                os.posix_fallocate(self.fd, 0, size)  # no ENOSPC in the middle of a step
            else:
                os.ftruncate(self.fd, size)
        except OSError as e:
            TensorFile._remove(self.fd, self.path)
            # The up-front check saw enough space, but other processes (ranks sharing the disk) took it since.
            raise OffloadError(f"zero.nvme_path={directory!r}: cannot reserve {size} bytes for {name} "
                               f"({e.strerror}); {disk_free_bytes(directory)} bytes are free now. Ranks of one "
                               "machine that share a disk need the sum of their files: free space, or give "
                               "them separate disks") from None
        self._finalizer = weakref.finalize(self, TensorFile._remove, self.fd, self.path)
        atexit.register(self._finalizer)

    def _offset(self, field: str, start: int) -> int:
        return (self.fields.index(field) * self.numel + start) * self.itemsize

    def read(self, field: str, start: int, out: torch.Tensor) -> torch.Tensor:
        """Fill `out` (host memory, this file's dtype) with elements [start, start + out.numel())."""
        if out.numel():
            view = memoryview(out.view(torch.uint8).numpy()).cast("B")
            done = os.preadv(self.fd, [view], self._offset(field, start))
            if done != view.nbytes:
                raise OSError(f"short read of {self.path} ({done} of {view.nbytes} bytes)")
        return out

    def write(self, field: str, start: int, values: torch.Tensor) -> None:
        """Store `values` (cast to this file's dtype) at elements [start, start + values.numel())."""
        if values.numel():
            view = _bytes_view(values.to("cpu", self.dtype))
            offset, done = self._offset(field, start), 0
            while done < view.nbytes:
                done += os.pwrite(self.fd, view[done:], offset + done)

    def mapped(self, field: str) -> torch.Tensor:
        """The field as a read-only tensor backed by the file's pages (no copy in anonymous memory: the
        kernel can drop the pages again, so saving a larger-than-memory state does not need the memory).
        Valid until the file is written again; callers serialise it at once. Its `release_after_write()`
        (called by zero.state.shardfile.dump once the tensor is written) drops the pages it touched from the
        process, so a shard's writer holds one mapped tensor's pages at a time, not all of them."""
        import mmap
        import warnings

        import numpy as np

        if not self.numel:
            return torch.empty(0, dtype=self.dtype)
        os.fsync(self.fd)
        offset = self._offset(field, 0)
        skip = offset % mmap.ALLOCATIONGRANULARITY
        nbytes = self.numel * self.itemsize
        pages = mmap.mmap(self.fd, nbytes + skip, mmap.MAP_SHARED, mmap.PROT_READ, offset=offset - skip)
        array = np.frombuffer(pages, dtype=np.uint8, count=nbytes, offset=skip)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only numpy memory: we never write to it
            tensor = torch.from_numpy(array).view(self.dtype)
        # A shared read-only file mapping: dropped pages are read again from the file if touched again.
        tensor.release_after_write = functools.partial(pages.madvise, mmap.MADV_DONTNEED)
        return tensor

    def chunks(self, field: str, size: int):
        """The field's elements in order, `size` at a time, read into one buffer that each chunk reuses (a
        chunk is valid until the next is asked for): a whole field streams through `size` elements of memory."""
        buf = torch.empty(max(1, min(size, self.numel)), dtype=self.dtype)
        for start in range(0, self.numel, size):
            yield self.read(field, start, buf[: min(size, self.numel - start)])

    def read_all(self, field: str) -> torch.Tensor:
        return self.read(field, 0, torch.empty(self.numel, dtype=self.dtype))

    def size_bytes(self) -> int:
        return os.path.getsize(self.path) if os.path.exists(self.path) else 0

    @staticmethod
    def _remove(fd: int, path: str) -> None:
        try:
            os.close(fd)
        except OSError:
            pass
        if os.path.exists(path):
            os.remove(path)

    def close(self) -> None:
        self._finalizer()
