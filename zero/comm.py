"""The one door for collectives: thin wrappers over torch.distributed that count bytes per kind.

A group of None means a single rank: every wrapper then does the local equivalent without any
communication, so layers written against this module run unchanged without torch.distributed.
Byte counts are what this rank puts on the wire under the usual ring / pairwise algorithms, so
benchmarks can compare measured volume with the theory (e.g. 2 * params for data-parallel all-reduce).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from zero.topology import group_size


class CommStats:
    """Per-kind counters of calls and bytes sent by this rank."""

    def __init__(self) -> None:
        self.enabled = True
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)

    def record(self, kind: str, nbytes: float) -> None:
        if self.enabled:
            self.bytes[kind] += int(nbytes)
            self.calls[kind] += 1

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def snapshot(self) -> dict[str, int]:
        return dict(self.bytes)


#: Process-wide counters; instrumentation only (no behaviour depends on them).
stats = CommStats()


@contextlib.contextmanager
def counting(reset: bool = True) -> Iterator[CommStats]:
    """`with comm.counting() as s: ...` then read `s.bytes` / `s.total_bytes`."""
    if reset:
        stats.reset()
    yield stats


# Newer torch renames the single-tensor collectives; older releases (>= 2.6) only have the old names.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(tensor: torch.Tensor, group: ProcessGroup | None, op=dist.ReduceOp.SUM, async_op: bool = False):
    n = group_size(group)
    if n == 1:
        return None
    stats.record("all_reduce", 2 * (n - 1) / n * _nbytes(tensor))
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup | None,
                           async_op: bool = False):
    n = group_size(group)
    if n == 1:
        output.copy_(input.reshape(output.shape))
        return None
    stats.record("all_gather", (n - 1) * _nbytes(input))
    return _all_gather_single(output, input, group=group, async_op=async_op)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup | None,
                          op=dist.ReduceOp.SUM, async_op: bool = False):
    n = group_size(group)
    if n == 1:
        output.copy_(input.reshape(output.shape))
        return None
    stats.record("reduce_scatter", (n - 1) / n * _nbytes(input))
    return _reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup | None,
                      output_split_sizes: list[int] | None = None, input_split_sizes: list[int] | None = None,
                      async_op: bool = False):
    n = group_size(group)
    if n == 1:
        output.copy_(input.reshape(output.shape))
        return None
    if input_split_sizes is None:
        sent = _nbytes(input) * (n - 1) / n
    else:
        me = dist.get_rank(group)
        row = input[0].numel() * input.element_size() if input.dim() > 0 and input.shape[0] else 0
        sent = row * (sum(input_split_sizes) - input_split_sizes[me])
    stats.record("all_to_all", sent)
    return dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group,
                                  async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group: ProcessGroup | None, async_op: bool = False):
    """`src` is a global rank, as in torch.distributed."""
    n = group_size(group)
    if n == 1:
        return None
    stats.record("broadcast", _nbytes(tensor))
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def all_gather_object(obj, group: ProcessGroup | None) -> list:
    n = group_size(group)
    if n == 1:
        return [obj]
    out = [None] * n
    dist.all_gather_object(out, obj, group=group)
    return out


def barrier(group: ProcessGroup | None = None) -> None:
    if dist.is_initialized() and (group is not None or dist.get_world_size() > 1):
        dist.barrier(group=group)


# ---------------------------------------------------------------------------- differentiable
class _AllToAll(torch.autograd.Function):
    """all_to_all_single along dim 0 whose backward is the opposite all-to-all."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, output_splits, input_splits):
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        x = x.contiguous()
        if output_splits is None:
            out = torch.empty_like(x)
        else:
            out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
        all_to_all_single(out, x, group, output_splits, input_splits)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        if ctx.input_splits is None:
            out = torch.empty_like(grad)
        else:
            out = grad.new_empty((sum(ctx.input_splits),) + tuple(grad.shape[1:]))
        all_to_all_single(out, grad, ctx.group, ctx.input_splits, ctx.output_splits)
        return out, None, None, None


def all_to_all(x: torch.Tensor, group: ProcessGroup | None, output_splits: list[int] | None = None,
               input_splits: list[int] | None = None) -> torch.Tensor:
    """Differentiable all-to-all over dim 0 (even splits when the split lists are None)."""
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, group, output_splits, input_splits)


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group in forward; identity gradient in backward (each rank owns its own term)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group):
        x = x.clone()
        all_reduce(x, group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def all_reduce_sum_autograd(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Differentiable sum over ranks where every rank's gradient flows only into its own term.

    Used for losses that are summed across a group and then backpropagated on every rank: each
    rank's local term receives the gradient of the total once.
    """
    if group_size(group) == 1:
        return x
    return _AllReduceSum.apply(x, group)
