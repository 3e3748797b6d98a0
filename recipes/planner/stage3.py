"""ZeRO-3's gathered parameters through a step, unit by unit, as `zero.sharding.stage3.Stage3Hooks` holds them.

A unit's buckets are gathered for its forward with the next `prefetch_depth` units (forward order) gathered ahead,
and gathered again for its backward with the `prefetch_depth` units before it; a unit whose backward does not
read its parameters (an embedding: only the indices) is not gathered again. A unit is freed once its gradients
have arrived (the hooks free it before its reduction runs). The root buckets stay gathered from the first
forward to the end of backward.

With `zero.offload_params=nvme` every gather first reads the rank's shard from its file into a tensor of its own
(`FlatBucket._shard_for_gather`: `TensorFile.read_all`, pread into anonymous memory: the page cache the read goes
through is the kernel's, not the process's resident memory), kept as the all-gather's source until the bucket
is freed: one shard beside each gathered bucket (on a GPU the shard is copied to the device, and the host read
buffer is dropped once copied: one at a time on the host). With gloo's collectives (`collective_copies`) each
gather in flight also holds a temporary of its whole output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn
from omegaconf import DictConfig

from recipes.planner.build import Layout


@dataclass
class Window:
    """What is gathered at one moment beyond the roots: full buffers, their nvme read buffers, the temporaries
    of the gathers in flight (prefetches)."""

    gathered: int = 0
    reads: int = 0
    in_flight: int = 0

    @property
    def total(self) -> int:
        return self.gathered + self.reads + self.in_flight


def _units(layout: Layout, cfg: DictConfig, isz: int, copies: bool) -> list[tuple[Window, bool]]:
    """Per unit (forward order): its window alone (`in_flight`: the temporary of its gathers across ranks, with
    `copies`) and whether backward gathers it again."""
    units = [Window() for _ in range(layout.units)]
    nvme = cfg.zero.offload_params == "nvme"
    for b in layout.buckets:
        if b.role == "unit":
            units[b.unit].gathered += b.padded * isz
            units[b.unit].reads += b.shard * isz if nvme and not b.resident else 0
            units[b.unit].in_flight += b.padded * isz if copies and b.world > 1 else 0
    return list(zip(units, gathered_again(layout)))


def gathered_again(layout: Layout) -> list[bool]:
    """Per unit (forward order): whether backward gathers it again (not an embedding, whose backward reads only
    the indices: `zero.sharding.stage3`)."""
    modules = [m for _, m in layout.unit_modules] if len(layout.unit_modules) == layout.units else []
    return [not isinstance(m, nn.Embedding) for m in modules] or [True] * layout.units


def _window(current: Window, ahead: list[Window]) -> Window:
    """A unit at work with `ahead` prefetched: their buffers and read buffers, the prefetches' gathers in flight."""
    return Window(current.gathered + sum(w.gathered for w in ahead), current.reads + sum(w.reads for w in ahead),
                  sum(w.in_flight for w in ahead))


def root_window(layout: Layout, cfg: DictConfig, isz: int) -> Window:
    """The roots: gathered for the whole forward and backward, with their nvme read buffers."""
    nvme = cfg.zero.offload_params == "nvme"
    roots = [b for b in layout.buckets if b.role == "root"]
    return Window(sum(b.padded * isz for b in roots), sum(b.shard * isz for b in roots if nvme and not b.resident))


def forward_windows(layout: Layout, cfg: DictConfig, isz: int, copies: bool) -> list[Window]:
    """Per unit in forward order: it and the units prefetched after it (their gathers in flight)."""
    units = [w for w, _ in _units(layout, cfg, isz, copies)]
    depth = cfg.zero.prefetch_depth
    return [_window(units[p], units[p + 1:p + 1 + depth]) for p in range(len(units))]


def backward_windows(layout: Layout, cfg: DictConfig, isz: int, copies: bool) -> dict[int, Window]:
    """Per unit backward gathers again (by forward position): it and the units before it prefetched for their
    backward (a unit backward does not gather is skipped, not replaced)."""
    units = _units(layout, cfg, isz, copies)
    depth = cfg.zero.prefetch_depth
    return {p: _window(w, [units[q][0] for q in range(p - 1, max(-1, p - 1 - depth), -1) if units[q][1]])
            for p, (w, again) in enumerate(units) if again}


def backward_gather(layout: Layout, cfg: DictConfig, isz: int, copies: bool) -> Window:
    """The largest unit gathered at the start of its backward with nothing prefetched yet (the first unit of
    backward): its buffers, read buffers and its own gather's temporary."""
    units = [w for w, again in _units(layout, cfg, isz, copies) if again]
    return max(units, key=lambda w: w.total, default=Window())


def after_first_reduction(layout: Layout, cfg: DictConfig, isz: int, copies: bool) -> Window:
    """The window once the first bucket of backward's reduction order is reduced: its unit is freed and the
    next unit backward gathers is at work, with its prefetches."""
    windows = backward_windows(layout, cfg, isz, copies)
    first = next((b for b in layout.buckets if b.trainable), None)
    if first is None or first.role != "unit":
        return max(windows.values(), key=lambda w: w.total, default=Window())
    later = [p for p in windows if p < first.unit]
    return windows[max(later)] if later else Window()


def largest_read(layout: Layout, cfg: DictConfig, isz: int) -> int:
    """The largest shard a gather reads from its nvme file (0 without nvme parameters)."""
    if cfg.zero.offload_params != "nvme":
        return 0
    return max((b.shard * isz for b in layout.buckets if b.role in ("unit", "root") and not b.resident), default=0)
