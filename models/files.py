"""The modes of the weight files the model families write. safetensors' writer (its `save_file`, which transformers'
`save_pretrained` calls too) writes a private temporary file (mode 0600) and renames it into place; every other file
the project writes follows the umask, and `save_safetensors` / `follow_umask` give these the mode open() would."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def umask() -> int:
    """This process's umask (from /proc where it says, else set and restored at once)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(*paths: str | os.PathLike) -> None:
    """Give each file the mode a file created by open() gets: 0666 less the umask."""
    mode = 0o666 & ~umask()
    for path in paths:
        os.chmod(path, mode)


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike,
                     metadata: dict[str, str] | None = None) -> Path:
    """safetensors' save_file (written whole, then renamed into place), its file's mode following the umask."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    follow_umask(path)
    return Path(path)
