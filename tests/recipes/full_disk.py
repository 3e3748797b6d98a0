"""The pretraining recipe on a disk that fills up while it writes one checkpoint (for the full-disk test):

    python -m tests.recipes.full_disk <step> [key=value ...]

The checkpoint of step <step> gets 4096 bytes of each shard it writes and then OSError(ENOSPC), as a file system
with no space left answers; every other file is written as usual. The shards are opened by zero.state.checkpoint,
whose `open` is replaced here, so the whole save path (collective failure, cleanup, the recipe's report) runs.
"""

import builtins
import errno
import os
import sys
from pathlib import Path

import recipes.pretrain as pretrain
import zero.state.checkpoint as checkpoint

ROOM = 4096  # bytes of a shard that fit before the disk is full


class FullFile:
    """A binary file that takes ROOM bytes, then raises ENOSPC (writing what fitted, as write(2) does)."""

    def __init__(self, f, path: str) -> None:
        self.f, self.path, self.written = f, path, 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        fits = max(ROOM - self.written, 0)
        self.f.write(view[:fits])
        self.written += min(fits, len(view))
        if len(view) > fits:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)
        return len(view)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.f.close()


def main() -> None:
    step = int(sys.argv[1])
    sys.argv[1:2] = [f"--config-path={Path(pretrain.__file__).parent / 'conf'}"]
    full = f"step_{step:07d}.tmp"

    def open_on_a_full_disk(path, mode="r", *args, **kwargs):
        f = builtins.open(path, mode, *args, **kwargs)
        return FullFile(f, str(path)) if Path(path).parent.name == full and "w" in mode else f

    checkpoint.open = open_on_a_full_disk  # (module global: shadows the builtin inside zero.state.checkpoint)
    pretrain.main()


if __name__ == "__main__":
    main()
