"""The one door for collectives: thin wrappers over torch.distributed that count bytes per kind.

A group of None means a single rank: every wrapper then does the local equivalent without any
communication, so layers written against this module run unchanged without torch.distributed.
Byte counts are what this rank puts on the wire under the usual ring / pairwise algorithms, so
benchmarks can compare measured volume with the theory (e.g. 2 * params for data-parallel all-reduce).

Hang watchdog: every wrapper records, per thread, which collective is in flight (kind, group size,
since when); `start_watchdog(timeout_s, on_hang)` starts a daemon thread that ends the process
(exit code 4) with one line naming the rank, the step (`set_step`) and the collective once one has
been in flight longer than `timeout_s`, whatever the backend's own timeout does. Asynchronous
collectives are watched while their handle's `wait()` blocks; `watched(kind, group)` covers
communication made elsewhere (a pipeline schedule's point-to-point sends and receives) and
`unwatched()` the local computation inside such a section.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

# Whether this process has issued a collective (the exit hook below then waits for the backend's threads).
_issued = False


@atexit.register
def _let_backend_threads_finish() -> None:
    """Give the backend's worker threads the interpreter lock once more before the interpreter finalizes.

    A collective's work object is released by the backend thread that ran it (gloo's `runLoop`), just
    after `wait()` has returned to Python; releasing it drops the thread's references to the tensors it
    ran on, and a tensor that Python also knows needs the interpreter lock for that. A thread that asks
    for the lock while the interpreter finalizes is ended by Python, and ending a C++ worker thread
    aborts the whole process ("terminate called without an active exception", SIGABRT after the last
    step). Sleeping here (atexit runs before finalization) lets those releases happen first."""
    if _issued or (dist.is_available() and dist.is_initialized()):
        time.sleep(0.05)


def group_size(group: ProcessGroup | None) -> int:
    """Size of a group, where None means a single rank (no communication needed)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


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


# ---------------------------------------------------------------------------- hang watchdog
# Thread id -> what that thread waits on, innermost last: [kind, ranks, since] entries, or None while a
# watched section computes locally. Each collective pushes and pops one entry: no lock, no thread.
_waiting: dict[int, list] = {}
_step: int | None = None
_watchdog: _Watchdog | None = None


def set_step(step: int | None) -> None:
    """The training step this process is in (None: outside the steps), named by hang reports."""
    global _step
    _step = step


class _Waiting:
    """Context: this thread waits on collective `kind` over `ranks` ranks (kind None: computes locally)."""

    __slots__ = ("entry", "stack")

    def __init__(self, kind: str | None, ranks: int) -> None:
        self.entry = None if kind is None else [kind, ranks, 0.0]

    def __enter__(self) -> None:
        ident = threading.get_ident()
        self.stack = _waiting.get(ident)
        if self.stack is None:
            self.stack = _waiting[ident] = []
        if self.entry is not None:
            self.entry[2] = time.monotonic()
        self.stack.append(self.entry)

    def __exit__(self, *exc) -> None:
        self.stack.pop()
        if self.stack and self.stack[-1] is not None:
            self.stack[-1][2] = time.monotonic()  # the enclosing section starts waiting anew


def watched(kind: str, group: ProcessGroup | None) -> contextlib.AbstractContextManager:
    """`with comm.watched("pipeline send/recv", pp_group): ...`: communication made outside this module
    (torch's pipeline schedules send and receive by themselves) watched as one collective over `group`."""
    return _Waiting(kind, group_size(group))


def unwatched() -> contextlib.AbstractContextManager:
    """Local computation inside a `watched` section (a pipeline stage's forward): not waiting on anyone."""
    return _Waiting(None, 0)


class WatchedWork:
    """The handle of an asynchronous collective: its `wait()` is watched like a synchronous collective."""

    __slots__ = ("work", "kind", "ranks")

    def __init__(self, work: dist.Work, kind: str, ranks: int) -> None:
        self.work, self.kind, self.ranks = work, kind, ranks

    def wait(self, *args) -> bool:
        with _Waiting(self.kind, self.ranks):
            return self.work.wait(*args)

    def __getattr__(self, name: str):
        return getattr(self.work, name)


def _issue(kind: str, ranks: int, collective: Callable, *args, async_op: bool = False, **kwargs):
    """Run a torch.distributed collective as watched (its handle too when asynchronous)."""
    global _issued
    _issued = True
    with _Waiting(kind, ranks):
        work = collective(*args, async_op=async_op, **kwargs)
    return WatchedWork(work, kind, ranks) if async_op else work


@dataclass
class Hang:
    """A collective in flight on `rank` for longer than the watchdog's timeout."""

    rank: int
    step: int | None
    kind: str
    ranks: int
    waited_s: float
    timeout_s: float
    setting: str

    def __str__(self) -> str:
        where = f"step {self.step}" if self.step is not None else "outside the training steps"
        ranks = f"{self.ranks} rank" + ("s" if self.ranks != 1 else "")
        return (f"rank {self.rank}, {where}: {self.kind} over {ranks} did not complete within "
                f"{self.setting}={self.timeout_s:g} s (waited {self.waited_s:.1f} s): another rank stopped "
                "answering")


class _Watchdog(threading.Thread):
    """Looks every `interval` seconds for a collective in flight longer than `timeout_s`."""

    def __init__(self, timeout_s: float, on_hang: Callable[[Hang], None] | None, setting: str,
                 exit_code: int) -> None:
        super().__init__(name="collective-watchdog", daemon=True)
        self.timeout_s, self.on_hang, self.setting, self.exit_code = timeout_s, on_hang, setting, exit_code
        self.interval = min(0.5, timeout_s / 4)
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            now = time.monotonic()
            for stack in list(_waiting.values()):
                entry = stack[-1] if stack else None  # (a pop may race with this read: then skip)
                if entry is not None and now - entry[2] > self.timeout_s:
                    self.report(entry, now - entry[2])

    def report(self, entry: list, waited_s: float) -> None:
        """Print the hang, let the caller record it, and end the process: its main thread is blocked
        inside the backend, so an exception could never reach it."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        hang = Hang(rank, _step, entry[0], entry[1], waited_s, self.timeout_s, self.setting)
        print(f"error: {hang}; exiting with code {self.exit_code}", file=sys.stderr, flush=True)
        # A callback that blocks (a dead file system) must not keep the process alive.
        threading.Timer(30.0, os._exit, (self.exit_code,)).start()
        try:
            if self.on_hang is not None:
                self.on_hang(hang)
        except BaseException as e:
            print(f"(recording the hang failed: {e!r})", file=sys.stderr, flush=True)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(self.exit_code)


def start_watchdog(timeout_s: float, on_hang: Callable[[Hang], None] | None = None, *,
                   setting: str = "timeout_s", exit_code: int = 4) -> None:
    """End this process with `exit_code` once any collective has been in flight for `timeout_s` seconds
    (checked every 0.5 s at most): one line on stderr names the rank, the step (`set_step`), the
    collective and `setting` (the name of the timeout's setting), then `on_hang(hang)` runs (e.g. to
    write a result file). Replaces a running watchdog; `stop_watchdog()` ends it."""
    global _watchdog
    stop_watchdog()
    _watchdog = _Watchdog(timeout_s, on_hang, setting, exit_code)
    _watchdog.start()


def stop_watchdog() -> None:
    global _watchdog
    if _watchdog is not None:
        _watchdog.stopped.set()
        _watchdog.join()
        _watchdog = None


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
    return _issue("all_reduce", n, dist.all_reduce, tensor, op=op, group=group, async_op=async_op)


#: gloo's all-gather and reduce-scatter of CPU tensors pass the whole buffer through a temporary of its size (measured
#: in torch 2.13: an all-gather's peak host memory +1x its output, a reduce-scatter's +1.5x its input, +1x when
#: asynchronous). Buffers of at least this many bytes take paths without one: an all-gather broadcasts each rank's
#: part into its slice of the output, and `reduce_scatter_scratch` all-reduces its input in place and copies this
#: rank's part out. The values are the same (an all-gather's bits exactly).
LEAN_GLOO_BYTES = 64 << 20


def _lean(t: torch.Tensor, group: ProcessGroup | None) -> bool:
    return t.device.type == "cpu" and _nbytes(t) >= LEAN_GLOO_BYTES and dist.get_backend(group) == "gloo"


class _AllOf:
    """One handle for several asynchronous collectives; `then` runs after they complete (once)."""

    def __init__(self, works: list, then: Callable[[], None] | None = None) -> None:
        self.works, self.then = works, then

    def wait(self, *args) -> bool:
        for w in self.works:
            w.wait(*args)
        self.works = []
        if self.then is not None:
            then, self.then = self.then, None
            then()
        return True


def _gather_by_broadcasts(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup | None,
                          async_op: bool = False):
    flat, size = output.view(-1), input.numel()
    me, world = dist.get_rank(group), group_size(group)
    mine = flat[me * size:(me + 1) * size]
    if mine.data_ptr() != input.data_ptr():
        mine.copy_(input.reshape(-1))
    whole = group if group is not None else dist.group.WORLD
    works = [dist.broadcast(flat[r * size:(r + 1) * size], src=dist.get_global_rank(whole, r), group=group,
                            async_op=True) for r in range(world)]
    work = _AllOf(works)
    if async_op:
        return work
    work.wait()
    return None


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup | None,
                           async_op: bool = False):
    n = group_size(group)
    if n == 1:
        output.copy_(input.reshape(output.shape))
        return None
    stats.record("all_gather", (n - 1) * _nbytes(input))
    if _lean(output, group) and output.is_contiguous():
        return _issue("all_gather", n, _gather_by_broadcasts, output, input, group=group, async_op=async_op)
    return _issue("all_gather", n, _all_gather_single, output, input, group=group, async_op=async_op)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup | None,
                          op=dist.ReduceOp.SUM, async_op: bool = False):
    n = group_size(group)
    if n == 1:
        output.copy_(input.reshape(output.shape))
        return None
    stats.record("reduce_scatter", (n - 1) / n * _nbytes(input))
    return _issue("reduce_scatter", n, _reduce_scatter_single, output, input, op=op, group=group,
                  async_op=async_op)


def reduce_scatter_scratch(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup | None,
                           async_op: bool = False):
    """`reduce_scatter_tensor` (a sum) of an input the caller no longer needs, which it may overwrite: a large CPU
    buffer on gloo is all-reduced in place and this rank's part copied out (no temporary of the input's size)."""
    n = group_size(group)
    if n == 1 or not (_lean(input, group) and input.is_contiguous()):
        return reduce_scatter_tensor(output, input, group, async_op=async_op)
    stats.record("all_reduce", 2 * (n - 1) / n * _nbytes(input))
    me, size = dist.get_rank(group), output.numel()
    work = _AllOf([_issue("all_reduce", n, dist.all_reduce, input, group=group, async_op=True)],
                  then=lambda: output.copy_(input.view(-1)[me * size:(me + 1) * size].view(output.shape)))
    if async_op:
        return work
    work.wait()
    return None


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
    return _issue("all_to_all", n, dist.all_to_all_single, output, input, output_split_sizes, input_split_sizes,
                  group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group: ProcessGroup | None, async_op: bool = False):
    """`src` is a global rank, as in torch.distributed."""
    n = group_size(group)
    if n == 1:
        return None
    stats.record("broadcast", _nbytes(tensor))
    return _issue("broadcast", n, dist.broadcast, tensor, src=src, group=group, async_op=async_op)


def send(tensor: torch.Tensor, dst: int, group: ProcessGroup | None) -> None:
    """Blocking point-to-point send to global rank `dst` (a pipeline's activations outside torch's schedules)."""
    global _issued
    _issued = True
    stats.record("p2p", _nbytes(tensor))
    with _Waiting("p2p", 2):
        dist.send(tensor, dst, group=group)


def recv(tensor: torch.Tensor, src: int, group: ProcessGroup | None) -> None:
    """Blocking point-to-point receive from global rank `src` into `tensor` (the sender counts the bytes)."""
    global _issued
    _issued = True
    with _Waiting("p2p", 2):
        dist.recv(tensor, src, group=group)


def send_recv(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]],
              group: ProcessGroup | None, tag: int = 0) -> list[WatchedWork]:
    """Start point-to-point sends (tensor, destination) and receives (buffer, source) at once, ranks given within
    `group`; returns the handles to `wait()` on (watched), so the transfers run while the caller computes (ring
    attention's next block). The sender counts the bytes, as p2p. Pairs exchanging several messages must post
    them in the same order on both sides, or pass distinct `tag`s."""
    global _issued
    if not sends and not recvs:
        return []
    _issued = True
    handles = []
    for tensor, dst in sends:
        stats.record("p2p", _nbytes(tensor))
        work = dist.isend(tensor, dist.get_global_rank(group, dst), group=group, tag=tag)
        handles.append(WatchedWork(work, "p2p", 2))
    for tensor, src in recvs:
        work = dist.irecv(tensor, dist.get_global_rank(group, src), group=group, tag=tag)
        handles.append(WatchedWork(work, "p2p", 2))
    return handles


def all_gather_object(obj, group: ProcessGroup | None) -> list:
    n = group_size(group)
    if n == 1:
        return [obj]
    out = [None] * n
    with _Waiting("all_gather_object", n):
        dist.all_gather_object(out, obj, group=group)
    return out


def barrier(group: ProcessGroup | None = None) -> None:
    if dist.is_initialized() and (group is not None or dist.get_world_size() > 1):
        with _Waiting("barrier", dist.get_world_size(group)):
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
