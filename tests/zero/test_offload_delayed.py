"""ZeRO-Offload's overlap and delayed parameter update, on the CPU.

The delayed update (`zero.offload_delayed_update`) is checked for the exact one-step lag against a plain loop
that applies it by hand; the overlap logic (per-bucket host steps, copies in flight, the host step on a worker)
runs through a stream-free executor that holds every copy and every submitted step back until the code waits
for it, so a step that read a gradient before waiting, a value never sent back, or a delayed step that read
the next step's gradients or hyperparameters gives different numbers.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import zero
import zero.offload.masters as masters_mod
from tests.equivalence import compute_values
from tests.zero.models import build, global_batch, lm_loss
from zero.offload.overlap import InlineExecutor, pipelined_step

ADAMW = functools.partial(torch.optim.AdamW, lr=2e-2, betas=(0.9, 0.95), weight_decay=0.1)
CLIP, ROWS, STEPS, WARMUP = 0.5, 3, 6, 2


def _schedule(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))  # a new lr every step


def _reference(steps: int, warmup: int | None) -> dict:
    """The plain loop: the device model runs forward/backward, the master model steps; from step `warmup` on,
    the device gets the masters as they were before the step (update t-1), else after it."""
    device = build(seed=0)
    master = copy.deepcopy(device)
    optimizer = ADAMW(master.parameters())
    scheduler = _schedule(optimizer)
    losses, compute = [], []
    for t in range(steps):
        loss = lm_loss(device, global_batch(t, 0, ROWS))
        loss.backward()
        grads = [p.grad for p in device.parameters()]
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
        coef = min(1.0, CLIP / (float(norm) + 1e-6))
        for pm, g in zip(master.parameters(), grads):
            pm.grad = g * coef
        device.zero_grad(set_to_none=True)
        delayed = warmup is not None and t >= warmup
        if delayed:
            device.load_state_dict(master.state_dict())
        optimizer.step()
        scheduler.step()
        if not delayed:
            device.load_state_dict(master.state_dict())
        losses.append(loss.item())
        compute.append({n: p.detach().clone() for n, p in device.named_parameters()})
    return {"losses": losses, "compute": compute, "master": {n: p.detach() for n, p in master.named_parameters()}}


def _train(steps: int, stage: int, device: str = "cpu", **zero_kw) -> dict:
    config = zero.ZeroConfig(stage=stage, offload_optimizer="cpu", clip_grad_norm=CLIP, reduce_bucket_size=300,
                             **zero_kw)
    engine = zero.initialize(build(seed=0).to(device), ADAMW, config, lr_scheduler=_schedule)
    losses, compute = [], []
    for t in range(steps):
        loss = lm_loss(engine, global_batch(t, 0, ROWS).to(device))
        engine.backward(loss)
        assert engine.step()
        losses.append(loss.item())
        compute.append(compute_values(engine))
    out = {"losses": losses, "compute": compute, "master": engine.full_state_dict(),
           "buckets": len(engine.zero_optimizer.trainable)}
    engine.close()
    return out


def _assert_trajectory(got: dict, want: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=rtol, atol=0)
    for t, (g, w) in enumerate(zip(got["compute"], want["compute"])):
        for name, value in w.items():
            torch.testing.assert_close(g[name].cpu(), value, rtol=rtol, atol=atol, msg=f"step {t} {name}")
    for name, value in want["master"].items():
        torch.testing.assert_close(got["master"][name].cpu(), value, rtol=rtol, atol=atol, msg=name)


class HeldBackExecutor(InlineExecutor):
    """A stream-free stand-in for the CUDA executor: a copy to the host lands only when waited for, a copy to
    the device only at device_ready, a submitted step runs only when its result is asked for; every move is logged."""

    per_bucket = True

    def __init__(self) -> None:
        self.log: list[str] = []
        self.to_host_queue: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.to_device_queue: list[tuple[torch.Tensor, torch.Tensor]] = []

    def to_host(self, index, src, dst):
        self.log.append(f"to_host {index}")
        self.to_host_queue[index] = (src.clone(), dst)  # the source may be reused once the copy "ran"

    def wait_host(self, index):
        self.log.append(f"wait_host {index}")
        if index in self.to_host_queue:
            src, dst = self.to_host_queue.pop(index)
            dst.copy_(src)

    def to_device(self, index, src, dst):
        self.log.append(f"to_device {index}")
        self.to_device_queue.append((src.clone(), dst))

    def device_ready(self):
        self.log.append("device_ready")
        for src, dst in self.to_device_queue:
            dst.copy_(src)
        self.to_device_queue = []

    def submit(self, fn):
        self.log.append("submit")
        log = self.log

        class Lazy:
            def result(self):
                log.append("run")
                fn()

        return Lazy()


@pytest.mark.parametrize("stage", [1, 2])
def test_delayed_update_lags_exactly_one_step(stage):
    want = _reference(STEPS, warmup=WARMUP)
    got = _train(STEPS, stage, offload_delayed_update=True, offload_delayed_warmup_steps=WARMUP)
    _assert_trajectory(got, want)
    # the lag is visible: without it the trajectory is the ordinary one, which the delayed run leaves
    ordinary = _reference(STEPS, warmup=None)
    assert abs(ordinary["losses"][-1] - got["losses"][-1]) > 1e-4
    _assert_trajectory(_train(STEPS, stage), ordinary)


@pytest.mark.parametrize("delayed", [False, True])
def test_overlap_logic_with_a_held_back_executor(monkeypatch, delayed):
    executors = []

    def make(num_buckets, device):
        executors.append(HeldBackExecutor())
        return executors[-1]

    monkeypatch.setattr(masters_mod, "make_executor", make)
    kw = dict(offload_delayed_update=True, offload_delayed_warmup_steps=WARMUP) if delayed else {}
    got = _train(STEPS, 2, **kw)
    _assert_trajectory(got, _reference(STEPS, warmup=WARMUP if delayed else None))
    log, n = executors[0].log, got["buckets"]
    assert n >= 3  # several buckets, or the pipeline is not exercised
    assert log.count("device_ready") == STEPS and all(log.count(f"to_host {i}") == STEPS for i in range(n))
    first_step = log[log.index("wait_host 0"):log.index("device_ready") + 1]
    waits = [f"wait_host {i}" for i in range(n)]
    # collect: every gradient waited for (the caller takes the norm), then each bucket stepped and sent back
    # before the next is stepped: bucket i's copy back is in flight while the host steps bucket i+1
    assert first_step == waits + [e for i in range(n) for e in (f"wait_host {i}", f"to_device {i}")] + ["device_ready"]
    if delayed:  # from the warm-up on: the values of update t-1 go back, then update t starts on the worker
        assert log.count("submit") == STEPS - WARMUP and log.count("run") == STEPS - WARMUP  # the last: at close


def test_pipelined_step_orders_each_bucket():
    log = []
    executor = HeldBackExecutor()
    pipelined_step(executor, [torch.zeros(1)] * 3, lambda i, g: log.append(f"step {i}"),
                   lambda i: executor.to_device(i, torch.zeros(1), torch.zeros(1)))
    assert executor.log == ["wait_host 0", "to_device 0", "wait_host 1", "to_device 1", "wait_host 2", "to_device 2",
                      "device_ready"]
    assert log == ["step 0", "step 1", "step 2"]


def test_delayed_update_config_is_checked():
    with pytest.raises(zero.ConfigError, match="offload_delayed_update=true needs zero.offload_optimizer=cpu"):
        zero.ZeroConfig(stage=1, offload_delayed_update=True)
    with pytest.raises(zero.ConfigError, match="offload_delayed_warmup_steps=0"):
        zero.ZeroConfig(stage=1, offload_optimizer="cpu", offload_delayed_update=True, offload_delayed_warmup_steps=0)


@pytest.mark.parametrize("held_back", [False, True])
def test_checkpoint_of_a_delayed_run_holds_the_newest_masters_and_resumes_from_them(tmp_path, monkeypatch,
                                                                                   held_back):
    if held_back:  # the pending update has not run when the checkpoint is asked for
        monkeypatch.setattr(masters_mod, "make_executor", lambda n, device: HeldBackExecutor())
    config = zero.ZeroConfig(stage=1, offload_optimizer="cpu", clip_grad_norm=CLIP, reduce_bucket_size=300,
                             offload_delayed_update=True, offload_delayed_warmup_steps=1)
    engine = zero.initialize(build(seed=0), ADAMW, config, lr_scheduler=_schedule)
    for t in range(3):
        engine.backward(lm_loss(engine, global_batch(t, 0, ROWS)))
        assert engine.step()
    lagging = compute_values(engine)  # the device: update 1 (update 2 pending)
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    newest = engine.full_state_dict()  # update 2
    assert any(not torch.equal(lagging[n], newest[n]) for n in newest)
    want = _reference(3, warmup=1)["master"]
    for name, value in want.items():
        torch.testing.assert_close(newest[name], value, rtol=1e-5, atol=1e-6, msg=name)
    engine.close()
    resumed = zero.initialize(build(seed=1), ADAMW, config)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    for name, value in resumed.full_state_dict().items():  # the masters: the pending update applied
        torch.testing.assert_close(value, newest[name], rtol=0, atol=0, msg=name)
    for name, value in compute_values(resumed).items():  # the device: still one update behind, as it was
        torch.testing.assert_close(value, lagging[name], rtol=0, atol=0, msg=name)
    resumed.close()


@pytest.mark.parametrize("stop", [1, 2, 4])  # in the warm-up, at its last step, in the delayed regime
def test_a_resumed_delayed_run_is_the_uninterrupted_run(tmp_path, monkeypatch, stop):
    """Saved after `stop` steps and resumed by a fresh engine, a delayed run neither repeats the warm-up nor starts
    the device from the newest masters: its losses, device values, masters and host steps are the uninterrupted
    run's."""
    executors = []
    monkeypatch.setattr(masters_mod, "make_executor", lambda n, device: executors.append(HeldBackExecutor())
                        or executors[-1])
    config = zero.ZeroConfig(stage=2, offload_optimizer="cpu", clip_grad_norm=CLIP, reduce_bucket_size=300,
                             offload_delayed_update=True, offload_delayed_warmup_steps=WARMUP)

    def run(engine, steps):
        losses, compute = [], []
        for t in steps:
            loss = lm_loss(engine, global_batch(t, 0, ROWS))
            engine.backward(loss)
            assert engine.step()
            losses.append(loss.item())
            compute.append(compute_values(engine))
        return losses, compute

    whole = zero.initialize(build(seed=0), ADAMW, config, lr_scheduler=_schedule)
    want_losses, want_compute = run(whole, range(STEPS))
    want = {"losses": want_losses, "compute": want_compute, "master": whole.full_state_dict()}
    whole.close()
    first = zero.initialize(build(seed=0), ADAMW, config, lr_scheduler=_schedule)
    losses, compute = run(first, range(stop))
    first.save_checkpoint(str(tmp_path / "ckpt"))
    first.close()
    resumed = zero.initialize(build(seed=1), ADAMW, config, lr_scheduler=_schedule)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert resumed.zero_optimizer.masters.steps_done == stop
    more_losses, more_compute = run(resumed, range(stop, STEPS))
    got = {"losses": losses + more_losses, "compute": compute + more_compute, "master": resumed.full_state_dict()}
    resumed.close()
    _assert_trajectory(got, want, rtol=0, atol=0)
    # the warm-up ran once over both halves: every step after it went to the worker
    assert executors[0].log.count("submit") == STEPS - WARMUP
    assert executors[1].log.count("submit") + executors[2].log.count("submit") == STEPS - WARMUP


def test_metrics_do_not_wait_for_the_pending_update(monkeypatch):
    """metrics() (logged every step) reads sizes only: the update submitted by step() is still pending after it,
    so the host step overlaps the next forward and backward."""
    executors = []
    monkeypatch.setattr(masters_mod, "make_executor", lambda n, device: executors.append(HeldBackExecutor())
                        or executors[-1])
    config = zero.ZeroConfig(stage=1, offload_optimizer="cpu", clip_grad_norm=CLIP, reduce_bucket_size=300,
                             offload_delayed_update=True, offload_delayed_warmup_steps=1)
    engine = zero.initialize(build(seed=0), ADAMW, config)
    sizes = []
    for t in range(3):
        engine.backward(lm_loss(engine, global_batch(t, 0, ROWS)))
        assert engine.step()
        metrics = engine.metrics()
        sizes.append((metrics["master_bytes"], metrics["optimizer_state_bytes"]))
        if t >= 1:  # past the warm-up: the update of this step was submitted and must not have run yet
            assert engine.zero_optimizer.masters.pending is not None
            assert executors[0].log.count("run") == executors[0].log.count("submit") - 1
    assert sizes[0] == sizes[1] == sizes[2] and sizes[0][0] > 0 and sizes[0][1] == 2 * sizes[0][0]
    engine.close()


def test_steps_done_of_a_state_dict_without_the_record():
    """A checkpoint resharded to another layout carries the torch optimizer state only: the steps come from the
    optimizer's own count, and a state without one is taken as past the warm-up (an empty one as no step)."""
    from zero.offload.masters import _steps_done

    assert _steps_done({"state": {0: {"step": torch.tensor(5.0)}}, "param_groups": []}, 2) == 5
    assert _steps_done({"state": {0: {"momentum_buffer": torch.zeros(2)}}, "param_groups": []}, 2) == 2
    assert _steps_done({"state": {}, "param_groups": []}, 2) == 0
    assert _steps_done({"state": {0: {"step": torch.tensor(5.0)}}, "offload_steps_done": 7}, 2) == 7


def test_hyperparameter_snapshot_clones_tensor_values():
    """A tensor lr set in place (as a scheduler may) after the snapshot does not reach the snapshot's step."""
    from zero.offload.overlap import hyperparameter_snapshot, step_view

    def run(change_lr):
        master = torch.nn.Parameter(torch.ones(4))
        optimizer = torch.optim.AdamW([master], lr=torch.tensor(0.1), betas=(torch.tensor(0.9), torch.tensor(0.95)))
        view = hyperparameter_snapshot(optimizer)
        assert view.param_groups[0]["params"][0] is master
        if change_lr:
            optimizer.param_groups[0]["lr"].fill_(0.5)  # the next step's value, written in place
            optimizer.param_groups[0]["betas"][0].fill_(0.1)
        step_view(view, [master], [torch.full((4,), 2.0)])
        return master.detach().clone()

    torch.testing.assert_close(run(True), run(False), rtol=0, atol=0)
