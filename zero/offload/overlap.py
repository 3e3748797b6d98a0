"""How the host optimizer step overlaps the device: copies on a side stream, the step on a worker thread.

An executor does the three moves of ZeRO-Offload, each asynchronous where the hardware allows: gradients to the
host (during backward, bucket by bucket as their reductions finish), new values back to the device (bucket i
while the host steps bucket i+1), and the host step itself (on a worker thread when the update is delayed, so
it runs beside the next forward and backward). `StreamExecutor` is the CUDA one; `InlineExecutor` does every
move at once, in order (the CPU, where host and device are one memory: the overlap is a no-op).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class InlineExecutor:
    """Every move done when asked, in the calling thread: plain copies, a step that is finished when submitted."""

    #: Step bucket by bucket, publishing each before stepping the next (pays off only where copies overlap).
    per_bucket = False

    def to_host(self, index: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        dst.copy_(src)

    def wait_host(self, index: int) -> None:
        """Bucket `index`'s gradient is in host memory after this returns."""

    def to_device(self, index: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        dst.copy_(src)

    def device_ready(self) -> None:
        """Work queued on the compute stream from now on sees every value sent by to_device."""

    def submit(self, fn: Callable[[], None]) -> Future:
        done: Future = Future()
        try:
            done.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - re-raised by the caller's result()
            done.set_exception(e)
        return done

    def close(self) -> None:
        pass


class StreamExecutor(InlineExecutor):
    """CUDA: copies on one side stream, ordered against the compute stream by events, so neither the compute
    stream nor the host waits for a copy it does not need yet; the delayed host step on one worker thread."""

    per_bucket = True

    def __init__(self, num_buckets: int, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.host_events: list[torch.cuda.Event | None] = [None] * num_buckets
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero-offload-step")

    def to_host(self, index, src, dst):
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the reduced gradient is final there
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            src.record_stream(self.stream)  # its memory is not reused before the copy has read it
            event = torch.cuda.Event()
            event.record(self.stream)
        self.host_events[index] = event

    def wait_host(self, index):
        event, self.host_events[index] = self.host_events[index], None
        if event is not None:
            event.synchronize()  # this bucket only: the later ones may still be in flight

    def to_device(self, index, src, dst):
        # src is pinned; the host writes it again only after waiting for the next step's gradient copies, which
        # this stream runs after this one. dst is written only after the compute stream's work queued so far,
        # which may still read its old values.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)

    def device_ready(self):
        torch.cuda.current_stream(self.device).wait_stream(self.stream)  # the device waits, the host does not

    def submit(self, fn):
        return self.pool.submit(fn)

    def close(self):
        self.pool.shutdown(wait=True)


def make_executor(num_buckets: int, device: torch.device) -> InlineExecutor:
    """The CUDA executor for buckets on a CUDA device, else the inline one."""
    if device.type == "cuda":
        return StreamExecutor(num_buckets, device)
    return InlineExecutor()


def pipelined_step(executor: InlineExecutor, grads: list[torch.Tensor],
                   step_bucket: Callable[[int, torch.Tensor], None], publish: Callable[[int], None]) -> None:
    """Step the buckets one after another, each published as soon as it is stepped: bucket i's copy back to the
    device runs while the host steps bucket i+1, and bucket i+1's gradient may still be arriving while the host
    steps bucket i. The compute stream then waits for the copies (the host does not)."""
    for i, grad in enumerate(grads):
        executor.wait_host(i)
        step_bucket(i, grad)
        publish(i)
    executor.device_ready()


def hyperparameter_snapshot(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A view of `optimizer` that steps the same parameters and state with the hyperparameters of now (lr,
    betas, ...), so a step on a worker thread is not changed by an lr scheduler stepping meanwhile. Tensor values
    (a tensor lr, which a scheduler may set in place) are cloned; the parameter lists are shared."""
    view = copy.copy(optimizer)  # same state dict, same parameter lists
    view.param_groups = [{k: _frozen(v) if k != "params" else v for k, v in group.items()}
                         for group in optimizer.param_groups]
    return view


def _frozen(value):
    """A hyperparameter as it is now: tensors (also inside a tuple, e.g. betas) cloned, other values as they are."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, tuple):
        return tuple(_frozen(v) for v in value)
    return value


def step_view(view: torch.optim.Optimizer, masters: list[torch.nn.Parameter], grads: list[torch.Tensor]) -> None:
    """One optimizer step of `view` (a hyperparameter_snapshot) over every master with its gradient.

    Called through the optimizer's class: an lr scheduler wraps the instance's `step` (bound to the original,
    whose hyperparameters may have moved on)."""
    for m, g in zip(masters, grads):
        m.grad = g
    type(view).step(view)
    for m in masters:
        m.grad = None
