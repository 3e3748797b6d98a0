"""Where the fp32 master shards and the optimizer state live, and where the optimizer step runs.

`DeviceMasters` keeps them on the compute device (plain ZeRO). `HostMasters` keeps them in host memory
and steps there (ZeRO-Offload): gradients go to the host, updated values come back in the compute
dtype. `NvmeMasters` keeps them in per-rank files and streams the step through a bounded ring of
chunk buffers with background reads ahead and writes behind (ZeRO-Infinity), so resident memory does
not grow with the model. All three expose one interface to the ZeRO optimizer and one checkpoint
format (a torch optimizer state dict over one flat parameter per trainable bucket), so a checkpoint
written with one loads into any other.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.nn as nn

from zero.config import ZeroConfig
from zero.offload.nvme import TensorFile, check_nvme_path
from zero.offload.overlap import (
    InlineExecutor,
    hyperparameter_snapshot,
    make_executor,
    pipelined_step,
    step_view,
)
from zero.sharding.buckets import FlatBucket
from zero.state.shardfile import StreamedTensor, done_reading

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
_F32 = 4  # bytes per fp32 element


def _pin() -> bool:
    return torch.cuda.is_available()


class DeviceMasters:
    """fp32 masters and optimizer state on the compute device; in fp32 the master IS the shard."""

    kind = "none"
    #: True when reduced gradients leave memory as they arrive (accumulate_grad / grad_sq_sum replace the
    #: in-memory gradient list of step()).
    spills_grads = False

    def __init__(self, buckets: list[FlatBucket], config: ZeroConfig, factory: OptimizerFactory) -> None:
        self.buckets = buckets
        fp32 = config.torch_dtype == torch.float32
        # In fp32 the master IS the in-memory shard: no copy, nothing to write back after the step.
        self.aliased = [fp32 and b.shard_in_memory for b in buckets]
        self.masters = [
            nn.Parameter(b.shard_tensor() if alias else b.read_shard().detach().float().clone())
            for b, alias in zip(buckets, self.aliased)
        ]
        self.optimizer = factory(self.masters)

    def collect_grads(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors the step will read (where the optimizer runs); unscaling/clipping act on them."""
        return grads

    def grad_ready(self, index: int, grad: torch.Tensor) -> None:
        """A bucket's reduced gradient of the last micro-batch is final (an early-copy opportunity)."""

    def clear_grads(self) -> None:
        """Gradients of the current step are dropped (after a step, an overflow skip or zero_grad)."""

    def step(self, grads: list[torch.Tensor] | None, scale: float = 1.0, clip: float = 1.0) -> None:
        """Step with `grads` already multiplied by `scale` and `clip` (stores that spill apply them)."""
        for m, g in zip(self.masters, grads):
            m.grad = g
        self.optimizer.step()
        for m in self.masters:
            m.grad = None
        self._publish_shards()

    def _publish_shards(self) -> None:
        with torch.no_grad():
            for b, m, alias in zip(self.buckets, self.masters, self.aliased):
                if not alias:
                    b.write_shard(m)

    def read_master(self, index: int) -> torch.Tensor:
        return self.masters[index].detach()

    @torch.no_grad()
    def write_master(self, index: int, values: torch.Tensor, start: int = 0) -> None:
        """Set elements [start, start + len(values)) of master `index`."""
        self.masters[index][start : start + values.numel()].copy_(values)

    def streamed_master(self, index: int) -> StreamedTensor:
        """Master `index` for a checkpoint shard: read only while the shard is written (valid until the next
        step). In memory here, so its one chunk is the master itself (no copy)."""
        numel = self.masters[index].numel()
        return StreamedTensor(torch.float32, (numel,), lambda: iter([self.read_master(index)]))

    def state_dict(self, file_backed: bool = False, streamed: bool = False) -> dict:
        """The torch optimizer state dict (its tensors are the optimizer's own, not copies)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    def resident_bytes(self) -> dict[str, int]:
        master = sum(m.numel() * _F32 for m, alias in zip(self.masters, self.aliased) if not alias)
        state = sum(v.numel() * v.element_size() for s in self.optimizer.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0)
        return {"master": master, "optimizer_state": state}

    def close(self) -> None:
        pass


class HostMasters(DeviceMasters):
    """fp32 masters, optimizer state and the step in host memory (pinned on CUDA: overlapped copies).

    Gradients of the last micro-batch are copied to the host bucket by bucket as their reduction finishes
    (`grad_ready`; on CUDA on a side stream, beside the rest of backward), the rest at the step; updated
    values return in the compute dtype, on CUDA bucket by bucket while the host steps the next one
    (`zero.offload.overlap`). On a CPU-only machine the same path runs with host == device (every copy is
    then a plain copy, the overlap a no-op).

    With `config.offload_delayed_update` (after `offload_delayed_warmup_steps` ordinary steps) step t's update
    reaches the device at step t+1: step t publishes the masters as update t-1 left them, then starts update t
    on the host (on CUDA on a worker thread, beside step t+1's forward and backward, into which step t+1's
    gradients arrive in a second set of host buffers). The forward of step t+1 therefore runs on the
    parameters of update t-1: the gradient of step t+1 is one update stale. Reading or writing the masters
    (checkpoints, full_state_dict) first waits for the pending update, so they hold the newest values; the
    optimizer state dict also records the steps done (a resumed run does not repeat the warm-up) and, once the
    device lags, the device's (compute-dtype) shards of update t-1, which a load puts back on the device: a
    resumed run continues exactly as the uninterrupted one. (Metrics read sizes only and never wait.)
    """

    kind = "cpu"

    def __init__(self, buckets: list[FlatBucket], config: ZeroConfig, factory: OptimizerFactory,
                 executor: InlineExecutor | None = None) -> None:
        self.buckets = buckets
        self.stream_chunk = config.offload_chunk_size  # elements per read of a streamed checkpoint tensor
        self.aliased = [False] * len(buckets)  # the master never aliases the shard: values travel back
        pin = _pin()
        self.masters = []
        # delayed: the pending step reads one set of host gradients while the next backward fills the other
        grad_sets = 2 if config.offload_delayed_update else 1
        self.grad_sets: list[list[torch.Tensor]] = [[] for _ in range(grad_sets)]
        for b in buckets:
            shard = b.read_shard()
            self.masters.append(nn.Parameter(torch.empty(shard.numel(), pin_memory=pin).copy_(shard)))
            for grads in self.grad_sets:
                grads.append(torch.empty(shard.numel(), pin_memory=pin))
        self.host_grads = self.grad_sets[0]
        self.staged = [False] * len(buckets)
        self.optimizer = factory(self.masters)
        device = buckets[0].device if buckets else torch.device("cpu")
        self.executor = executor if executor is not None else make_executor(len(buckets), device)
        # compute-dtype pinned copies of the masters, the source of the asynchronous copies back (CUDA only)
        self.outbox: list[torch.Tensor | None] = [
            torch.empty(b.shard_size, dtype=config.torch_dtype, pin_memory=pin)
            if self.executor.per_bucket and b.shard_in_memory else None for b in buckets]
        self.delayed, self.warmup = config.offload_delayed_update, config.offload_delayed_warmup_steps
        self.steps_done = 0
        self.pending: Future | None = None

    def grad_ready(self, index: int, grad: torch.Tensor) -> None:
        self.executor.to_host(index, grad, self.host_grads[index])
        self.staged[index] = True

    def collect_grads(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        for i, g in enumerate(grads):
            if not self.staged[i]:
                self.executor.to_host(i, g, self.host_grads[i])
        for i in range(len(grads)):  # the caller reads them next (norm, clipping)
            self.executor.wait_host(i)
        self.staged = [False] * len(grads)
        return self.host_grads

    def step(self, grads: list[torch.Tensor] | None, scale: float = 1.0, clip: float = 1.0) -> None:
        self.finish_pending()
        if self.delayed and self.steps_done >= self.warmup:
            self._publish_all()  # update t-1 reaches the device now; update t waits for step t+1
            view, masters = hyperparameter_snapshot(self.optimizer), self.masters
            self.pending = self.executor.submit(lambda: step_view(view, masters, grads))
            spare = self.grad_sets[1] if grads is self.grad_sets[0] else self.grad_sets[0]
            self.host_grads = spare  # the next backward's gradients go where the pending step does not read
        elif self.executor.per_bucket:
            pipelined_step(self.executor, grads, self._step_bucket, self._publish)
        else:
            super().step(grads, scale, clip)
        self.steps_done += 1

    def _step_bucket(self, index: int, grad: torch.Tensor) -> None:
        """The optimizer step of one bucket's master (a per-element rule: the same as stepping all at once)."""
        master = self.masters[index]
        master.grad = grad
        self.optimizer.step()
        master.grad = None

    @torch.no_grad()
    def _publish(self, index: int) -> None:
        """Bucket `index`'s master into its compute-dtype shard: asynchronously through its pinned outbox."""
        outbox = self.outbox[index]
        if outbox is None:
            self.buckets[index].write_shard(self.masters[index])
        else:
            outbox.copy_(self.masters[index])  # the cast on the host; the device copy is queued
            self.executor.to_device(index, outbox, self.buckets[index].shard_tensor())

    def _publish_all(self) -> None:
        for i in range(len(self.buckets)):
            self._publish(i)
        self.executor.device_ready()

    def _publish_shards(self) -> None:  # DeviceMasters.step's publication, through the executor
        self._publish_all()

    def finish_pending(self) -> None:
        """Wait for the delayed host update, if one is running (its errors surface here)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()

    def read_master(self, index: int) -> torch.Tensor:
        self.finish_pending()
        return super().read_master(index)

    def write_master(self, index: int, values: torch.Tensor, start: int = 0) -> None:
        self.finish_pending()
        super().write_master(index, values, start)

    #: Keys this store adds to the torch optimizer state dict (ignored by the other stores and by torch).
    STEPS_KEY, LAGGED_KEY = "offload_steps_done", "offload_lagged_shards"

    def lagging(self) -> bool:
        """True when the device holds the values of the update before the masters' (the delayed regime)."""
        return self.delayed and self.steps_done > self.warmup

    def state_dict(self, file_backed: bool = False, streamed: bool = False) -> dict:
        self.finish_pending()
        state = dict(super().state_dict(file_backed, streamed))
        state[self.STEPS_KEY] = self.steps_done
        if self.lagging():  # what the next forward runs on: update t-1 (the masters hold update t)
            state[self.LAGGED_KEY] = [streamed_shard(b, self.stream_chunk) if streamed else
                                      b.read_shard().detach().clone() for b in self.buckets]
        return state

    def load_state_dict(self, state: dict) -> None:
        self.finish_pending()
        super().load_state_dict(state)
        self.steps_done = _steps_done(state, self.warmup)
        lagged = state.get(self.LAGGED_KEY)
        if self.delayed and lagged is not None:  # called after the masters (and shards) were loaded
            if len(lagged) != len(self.buckets):
                raise ValueError(f"{len(lagged)} lagged shards for {len(self.buckets)} offloaded buckets")
            with torch.no_grad():
                for b, values in zip(self.buckets, lagged):
                    b.write_shard(values)

    def resident_bytes(self) -> dict[str, int]:
        # Metrics, read every step: sizes only, never values, so the pending update is not waited for (its
        # buffers keep their sizes: the optimizer state exists from the first, never delayed, step on).
        out = super().resident_bytes()
        out["master"] = sum(m.numel() * _F32 for m in self.masters)
        return out

    def close(self) -> None:
        self.finish_pending()
        self.executor.close()


def _steps_done(state: dict, warmup: int) -> int:
    """Optimizer steps a state dict has seen: as recorded by HostMasters, else the optimizer's own `step` count
    (Adam's; a resharded checkpoint), else none if it has no state, else at least the warm-up."""
    if HostMasters.STEPS_KEY in state:
        return int(state[HostMasters.STEPS_KEY])
    entries = state.get("state") or {}
    for entry in entries.values():
        if "step" in entry:
            return int(entry["step"])
    return warmup if entries else 0


# ---------------------------------------------------------------------------------------------- nvme
def _probe_state_keys(factory: OptimizerFactory) -> tuple[list[str], list[str]]:
    """(per-element state keys, scalar state keys) of the optimizer, from one step on a 2-element probe."""
    probe = nn.Parameter(torch.zeros(2))
    opt = factory([probe])
    probe.grad = torch.zeros(2)
    opt.step()
    state = opt.state[probe]
    tensors = sorted(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == probe.shape)
    scalars = sorted(k for k in state if k not in tensors)
    return tensors, scalars


class _Slot:
    """One chunk's buffers: master, each optimizer-state tensor and the gradient (host memory)."""

    def __init__(self, chunk: int, keys: list[str]) -> None:
        pin = _pin()
        self.fields = {k: torch.empty(chunk, pin_memory=pin) for k in ["master", *keys]}
        self.grad = torch.empty(chunk, pin_memory=pin)
        self.pending: Future | None = None  # the write-behind of its last chunk


class NvmeMasters(DeviceMasters):
    """fp32 masters and optimizer state in per-rank files, stepped chunk by chunk through a ring of buffers.

    The user's optimizer (any elementwise one: AdamW, Adam, SGD, ...) is built over one chunk-sized
    window parameter; for each chunk the window and its state point at the chunk's buffers and the
    optimizer steps them. Reads of the next chunks and writes of the finished ones run in background
    threads. Files are per run (a random name) and removed at exit, so a file left by a crash is never
    read again: a restart starts from a checkpoint, which is written atomically.
    """

    kind = "nvme"

    def __init__(self, buckets: list[FlatBucket], config: ZeroConfig, factory: OptimizerFactory,
                 rank: int = 0) -> None:
        self.buckets = buckets
        self.aliased = [False] * len(buckets)
        self.state_keys, self.scalar_keys = _probe_state_keys(factory)
        # Stages 2-3 reduce gradients bucket by bucket in backward: each reduced shard goes to the file at
        # once (accumulated there over micro-batches), so no rank keeps the gradients in memory either.
        self.spills_grads = config.stage >= 2
        fields = ["master", *self.state_keys, *(["grad"] if self.spills_grads else [])]
        numels = [b.shard_size for b in buckets]
        check_nvme_path(config.nvme_path, sum(numels) * _F32 * len(fields), "optimizer state")
        self.files = [TensorFile(config.nvme_path, f"rank{rank}-optimizer{i}", n, fields, torch.float32)
                      for i, n in enumerate(numels)]
        self.chunk = min(config.offload_chunk_size, max(numels, default=1))
        self.slots = [_Slot(self.chunk, self.state_keys) for _ in range(config.offload_buffer_count)]
        self.io = ThreadPoolExecutor(config.offload_io_threads, thread_name_prefix="zero-nvme")
        self.window = nn.Parameter(torch.zeros(self.chunk))
        self.optimizer = factory([self.window])
        self.scalars: dict[str, object] | None = None  # scalar state (e.g. `step`) once the state exists
        self.max_in_flight = config.offload_buffer_count  # gradient writes queued before backward waits
        self.grad_jobs: list[Future] = []
        self.grad_last: dict[int, Future] = {}  # each bucket's latest gradient job
        self.grad_written = [False] * len(buckets)  # this step's gradient is in the file
        self.grad_sq = [0.0] * len(buckets)  # its sum of squares, from the last micro-batch's write
        for i, b in enumerate(buckets):
            self.write_master(i, b.read_shard())

    # ------------------------------------------------------------------ step
    def _jobs(self) -> list[tuple[int, int, int]]:
        return [(i, s, min(self.chunk, f.numel - s)) for i, f in enumerate(self.files)
                for s in range(0, f.numel, self.chunk)]

    # ------------------------------------------------------------------ spilled gradients
    def accumulate_grad(self, index: int, grad: torch.Tensor, final: bool) -> None:
        """Add a bucket's reduced gradient shard (fp32) into its file in the background; `final`: the
        last micro-batch of the step, so the sum of squares is taken for the gradient norm."""
        host = grad.to("cpu") if grad.is_cuda else grad  # the caller drops its reference
        first = not self.grad_written[index]
        self.grad_written[index] = True
        earlier = self.grad_last.get(index)
        if earlier is not None:
            earlier.result()  # the same bucket's previous contribution is in the file before we add to it
        self.grad_last[index] = self.io.submit(self._accumulate, index, host, first, final)
        self.grad_jobs.append(self.grad_last[index])
        while len(self.grad_jobs) > self.max_in_flight:
            self.grad_jobs.pop(0).result()

    def _accumulate(self, index: int, grad: torch.Tensor, first: bool, final: bool) -> None:
        f, sq = self.files[index], 0.0
        buf = None if first else torch.empty(min(self.chunk, f.numel))
        for start in range(0, f.numel, self.chunk):
            part = grad[start : start + self.chunk]
            if buf is not None:
                part = f.read("grad", start, buf[: part.numel()]).add_(part)
            if final:
                sq += float(part.double().square().sum())
            f.write("grad", start, part)
        if final:
            self.grad_sq[index] = sq

    def _wait_grads(self) -> None:
        for job in self.grad_jobs:
            job.result()
        self.grad_jobs.clear()
        self.grad_last.clear()

    def grad_sq_sum(self, weights: list[float]) -> float:
        """Sum over buckets of weight x (sum of squares of this step's gradient shard)."""
        self._wait_grads()
        return sum(w * sq for w, sq in zip(weights, self.grad_sq))  # 0 for a bucket without a gradient

    def clear_grads(self) -> None:
        self._wait_grads()
        self.grad_written = [False] * len(self.files)
        self.grad_sq = [0.0] * len(self.files)

    # ------------------------------------------------------------------ step
    def _read(self, slot: _Slot, job: tuple[int, int, int]) -> None:
        i, start, n = job
        if slot.pending is not None:
            slot.pending.result()  # its previous chunk must be on disk before the buffers are reused
            slot.pending = None
        fields = ["master", *self.state_keys] if self.scalars is not None else ["master"]
        for field in fields:
            self.files[i].read(field, start, slot.fields[field][:n])
        if self.spills_grads:
            if self.grad_written[i]:
                self.files[i].read("grad", start, slot.grad[:n])
            else:
                slot.grad[:n].zero_()  # no gradient this step (a bucket no micro-batch reached)

    def _write(self, slot: _Slot, job: tuple[int, int, int]) -> None:
        i, start, n = job
        for field, buf in slot.fields.items():
            self.files[i].write(field, start, buf[:n])

    @torch.no_grad()
    def _step_chunk(self, slot: _Slot, job: tuple[int, int, int], grad: torch.Tensor | None, scale: float,
                    clip: float) -> dict:
        i, start, n = job
        if grad is None:  # spilled: read with the chunk; unscale and clip here, as step() would have
            slot.grad[:n].mul_(scale)
            if clip < 1.0:
                slot.grad[:n].mul_(clip)
        else:
            slot.grad[:n].copy_(grad[start : start + n], non_blocking=True)
            if grad.is_cuda:
                torch.cuda.current_stream().synchronize()
        self.window.data = slot.fields["master"][:n]
        self.window.grad = slot.grad[:n]
        state: dict = {}
        if self.scalars is not None:  # fresh copies: every chunk starts from the same scalars
            state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in self.scalars.items()}
            state.update({k: slot.fields[k][:n] for k in self.state_keys})
        self.optimizer.state[self.window] = state
        self.optimizer.step()
        state = self.optimizer.state[self.window]
        for k in self.state_keys:
            if state[k].data_ptr() != slot.fields[k].data_ptr():  # created by the optimizer's first step
                slot.fields[k][:n].copy_(state[k])
        self.buckets[i].write_shard(slot.fields["master"][:n], start)
        return {k: state[k] for k in self.scalar_keys}

    def step(self, grads: list[torch.Tensor] | None, scale: float = 1.0, clip: float = 1.0) -> None:
        self._wait_grads()
        jobs = self._jobs()
        ahead = len(self.slots) - 1  # one slot is being stepped while the others read or write
        reads = {j: self.io.submit(self._read, self.slots[j % len(self.slots)], jobs[j])
                 for j in range(min(ahead, len(jobs)))}
        new_scalars = None
        for j, job in enumerate(jobs):
            slot = self.slots[j % len(self.slots)]
            reads.pop(j).result()
            new_scalars = self._step_chunk(slot, job, None if grads is None else grads[job[0]], scale, clip)
            slot.pending = self.io.submit(self._write, slot, job)
            if j + ahead < len(jobs):
                nxt = j + ahead
                reads[nxt] = self.io.submit(self._read, self.slots[nxt % len(self.slots)], jobs[nxt])
        for slot in self.slots:
            if slot.pending is not None:
                slot.pending.result()
                slot.pending = None
        self.optimizer.state.pop(self.window, None)
        self.window.data, self.window.grad = torch.zeros(self.chunk), None
        if new_scalars is not None:
            self.scalars = new_scalars

    # ------------------------------------------------------------------ values and state
    def read_master(self, index: int) -> torch.Tensor:
        return self.files[index].read_all("master")

    @torch.no_grad()
    def write_master(self, index: int, values: torch.Tensor, start: int = 0) -> None:
        self.files[index].write("master", start, values)

    def streamed_master(self, index: int) -> StreamedTensor:
        """Master `index` read from its file chunk by chunk while a checkpoint shard is written."""
        f = self.files[index]
        return StreamedTensor(torch.float32, (f.numel,), lambda: f.chunks("master", self.chunk))

    def state_dict(self, file_backed: bool = False, streamed: bool = False) -> dict:
        """The torch optimizer state dict the on-device optimizer would have (read from the files).

        file_backed=True gives tensors mapped from the files instead of copies: no memory is needed for
        them, but they follow the files, so they must be serialised before the next step (checkpoints).
        streamed=True maps them likewise (a shard writer drops each one's pages once it is written: one
        tensor's pages at a time); the masters stream chunk by chunk (streamed_master)."""
        group = {k: v for k, v in self.optimizer.param_groups[0].items() if k != "params"}
        state = {}
        if self.scalars is not None:
            for i, f in enumerate(self.files):
                entry = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in self.scalars.items()}
                entry.update({k: f.mapped(k) if file_backed or streamed else f.read_all(k) for k in self.state_keys})
                state[i] = entry
        return {"state": state, "param_groups": [{**group, "params": list(range(len(self.files)))}]}

    def load_state_dict(self, state: dict) -> None:
        groups = state["param_groups"]
        if len(groups) != 1 or len(groups[0]["params"]) != len(self.files):
            raise ValueError(f"optimizer state for {sum(len(g['params']) for g in groups)} parameters in "
                             f"{len(groups)} groups does not match the {len(self.files)} offloaded shards")
        self.optimizer.param_groups[0].update({k: v for k, v in groups[0].items() if k != "params"})
        entries = state["state"]
        if not entries:
            self.scalars = None
            return
        for i, f in enumerate(self.files):
            for k in self.state_keys:
                f.write(k, 0, entries[i][k])
                done_reading(entries[i][k])  # copied to the file: a loaded shard's pages leave the process
        self.scalars = {k: entries[0][k] for k in self.scalar_keys}
        if any(isinstance(v, torch.Tensor) for v in self.scalars.values()):
            self.scalars = {k: v.detach().to("cpu").clone() if isinstance(v, torch.Tensor) else v
                            for k, v in self.scalars.items()}

    def resident_bytes(self) -> dict[str, int]:
        per_slot = sum(t.numel() * _F32 for t in self.slots[0].fields.values()) + self.slots[0].grad.numel() * _F32
        return {"master": 0, "optimizer_state": per_slot * len(self.slots)}

    def file_bytes(self) -> int:
        return sum(f.size_bytes() for f in self.files)

    def close(self) -> None:
        self._wait_grads()
        self.io.shutdown(wait=True)
        for f in self.files:
            f.close()


def streamed_shard(b: FlatBucket, chunk: int) -> StreamedTensor:
    """Bucket `b`'s parameter shard (compute dtype) for a checkpoint shard: from its nvme file `chunk` elements
    at a time, else the in-memory shard itself (no copy). Valid until the next step."""
    if b.file is not None:
        return StreamedTensor(b.file.dtype, (b.file.numel,), lambda: b.file.chunks("shard", chunk))
    shard = b.shard_tensor()
    return StreamedTensor(shard.dtype, (shard.numel(),), lambda: iter([b.shard_tensor().detach()]))


def build_masters(buckets: list[FlatBucket], config: ZeroConfig, factory: OptimizerFactory,
                  rank: int = 0) -> DeviceMasters:
    """The master store `config.offload_optimizer` names."""
    if config.offload_optimizer == "cpu":
        return HostMasters(buckets, config, factory)
    if config.offload_optimizer == "nvme":
        return NvmeMasters(buckets, config, factory, rank)
    return DeviceMasters(buckets, config, factory)
