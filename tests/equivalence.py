"""The one equivalence check of every multi-rank training test: N ranks against one, step by step.

Each rank of a parallel run records, per step, the global-batch loss and the engine's global gradient
norm, and after the first step and at the end a snapshot of every parameter it holds: the fp32 master
(`Engine.full_state_dict`) and the compute-dtype values its forward reads, with the declared placement
of each split parameter. `assert_equivalent` then checks every rank, not rank 0 only, against a
reference trajectory (a plain PyTorch loop or a one-rank run): the losses and norms on every rank,
every replica of every parameter (each data-parallel copy, each tensor-parallel replica, each expert
slice cut from the reference by its placement), the compute-dtype values equal to the masters rounded
to that dtype, and every element of every reference parameter held by some rank.

Under plain SGD the parameters after step 1 are `initial - lr * gradient`, so their change over the first
step (recorded from a snapshot taken when the recorder is made) is the reduced gradient itself: it is
compared at rtol 1e-5 with an absolute floor of a few ulps of the parameter, so even a small gradient (an
expert's) shows a 0.1% error. Adam would hide a constant gradient scale.

Runs that round differently from their reference (bf16, where the ranks sum partial gradients in other orders)
are compared by `assert_within`: relative distances (`distances`) of the losses, the first step's gradient norm,
and each parameter's first-step update and whole change in L2, each within a stated tolerance, beside the same
exact structural checks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from zero.dist import quantized

RTOL, ATOL = 1e-5, 2e-6
# Rounding p1 = p0 - update to fp32 moves the recorded update by up to an ulp of p on either side.
ULPS = 4 * torch.finfo(torch.float32).eps


# ---------------------------------------------------------------------------------------- per rank
@torch.no_grad()
def compute_values(engine, decoded: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter's compute-dtype values as this rank's forward reads them (collective).

    Resident buckets (stages 0-2 and stage-3 persistent ones) are read from the rank's own full buffer,
    so a rank whose copy was not refreshed shows it; partitioned ones (stage 3) are gathered from the
    shards exactly as a forward would gather them, except that a quantized gather (zero.quantize_weights)
    is exact unless `decoded`, which sends it through its codec as the forward does.
    """
    out: dict[str, torch.Tensor] = {}
    for b in engine.buckets:
        if b.resident:
            flat = b.full
        else:
            shard = b.read_shard().to(b.device)
            flat = shard
            if b.world > 1:
                flat = torch.empty(b.padded, dtype=shard.dtype, device=shard.device)
                if decoded and b.weight_codec is not None:
                    quantized.all_gather(flat, shard, b.group, b.weight_codec, b.quant_block)
                else:
                    dist.all_gather_into_tensor(flat, shard.contiguous(), group=b.group)
        for name, view in zip(b.names, b.param_views(flat)):
            out[name] = view.detach().to("cpu", copy=True)
    return out


def read_values(engine) -> dict[str, torch.Tensor]:
    """The full weights this rank's next forward reads (collective): `compute_values` with quantized gathers
    decoded."""
    return compute_values(engine, decoded=True)


def snapshot(engine) -> dict[str, Any]:
    """This rank's parameters: fp32 masters, compute-dtype values and declared placements (collective)."""
    return {"master": engine.full_state_dict(), "compute": compute_values(engine),
            "placements": dict(engine.placements)}


class Recorder:
    """Collects one rank's trajectory: call `step(loss)` after each optimizer step.

    `loss` is this rank's mean loss over its part of the global batch; it is averaged over
    `data_group` (the ranks that split the batch rows; None = this rank alone) so every rank records the
    global-batch loss. The gradient norm is the engine's, which is global by construction.
    """

    def __init__(self, engine, data_group=None) -> None:
        self.engine = engine
        self.data_group = data_group
        self.losses: list[float] = []
        self.norms: list[float] = []
        self.initial = engine.full_state_dict()  # collective, like every snapshot
        self.first: dict | None = None

    def step(self, loss: float) -> None:
        t = torch.tensor([float(loss)], dtype=torch.float64)
        if self.data_group is not None and dist.get_world_size(self.data_group) > 1:
            dist.all_reduce(t, group=self.data_group)
            t /= dist.get_world_size(self.data_group)
        self.losses.append(float(t))
        self.norms.append(self.engine.global_grad_norm)
        if self.first is None:
            self.first = snapshot(self.engine)
            self.first["initial"] = self.initial

    def result(self) -> dict[str, Any]:
        return {"losses": self.losses, "norms": self.norms, "first": self.first, "final": snapshot(self.engine)}


# ---------------------------------------------------------------------------------------- references
def reference_trajectory(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int,
                         micro_losses: Callable[[torch.nn.Module, int], Iterable[torch.Tensor]],
                         clip: float | None = None,
                         before_step: Callable[[torch.nn.Module, int], None] | None = None) -> dict[str, Any]:
    """One process, the whole global batch, plain PyTorch: the trajectory every parallel run must equal.

    `micro_losses(model, step)` yields the loss of each micro-batch of the step; the step's gradient is
    their mean (as an engine with grad_accum_steps=k averages k backwards).
    """
    losses, norms, first = [], [], None
    initial = _detached(model.state_dict())
    for step in range(steps):
        if before_step is not None:
            before_step(model, step)
        values = list(micro_losses(model, step))
        assert values, "a step needs at least one micro-batch"
        total = 0.0
        for loss in values:
            (loss / len(values)).backward()
            total += loss.item() / len(values)
        params = [p for p in model.parameters() if p.grad is not None]
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip if clip else float("inf"))))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
        if first is None:
            first = _detached(model.state_dict())
    return {"losses": losses, "norms": norms, "initial": initial, "first": first,
            "final": _detached(model.state_dict())}


def as_reference(record: dict[str, Any]) -> dict[str, Any]:
    """A one-rank run's record (world of one: every master is whole) as a reference trajectory."""
    for key in ("first", "final"):
        assert not any(not p.is_whole for p in record[key]["placements"].values()), "a one-rank run is whole"
    return {"losses": record["losses"], "norms": record["norms"], "initial": record["first"]["initial"],
            "first": record["first"]["master"], "final": record["final"]["master"]}


def _detached(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", torch.float32 if v.is_floating_point() else v.dtype, copy=True)
            for k, v in state.items()}


# ---------------------------------------------------------------------------------------- the check
def _close(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, check_dtype=False, msg=lambda m: f"{what}: {m}")


def assert_snapshot(snap: dict[str, Any], reference: Mapping[str, torch.Tensor], rtol: float = RTOL,
                    atol: float = ATOL, where: str = "", covered: dict[str, torch.Tensor] | None = None,
                    initial: Mapping[str, torch.Tensor] | None = None) -> None:
    """One rank's snapshot against the reference's full parameters (cut by each declared placement); with
    the reference's `initial` parameters (and the snapshot's own), also the change since then: the update."""
    masters, compute, placements = snap["master"], snap["compute"], snap["placements"]
    assert masters, f"{where}: the rank holds no parameters"
    assert compute and set(compute) <= set(masters), f"{where}: compute values {sorted(set(compute) - set(masters))}"
    for name, master in masters.items():
        assert name in reference, f"{where}: {name} is not a parameter of the reference model"
        full = reference[name]
        placement = placements.get(name)
        if placement is None:
            assert master.shape == full.shape, (
                f"{where}: {name} has local shape {tuple(master.shape)}, the model's is {tuple(full.shape)}: "
                "a split parameter needs a declared placement")
            want = full
        else:
            assert tuple(placement.shape) == tuple(full.shape), f"{where}: {name} placement {placement.shape}"
            want = placement.take(full)
        if master.is_floating_point():
            _close(master, want, rtol, atol, f"{where} {name}")
            if initial is not None:
                start = initial[name] if placement is None else placement.take(initial[name])
                floor = ULPS * max(float(start.abs().max()), float(want.abs().max()), 1e-30)
                _close(master - snap["initial"][name], want - start, rtol, floor, f"{where} {name} update")
        else:
            assert torch.equal(master, want), f"{where} {name}"
        if covered is not None:
            mask = covered.setdefault(name, torch.zeros(full.shape, dtype=torch.bool))
            if placement is None:
                mask.fill_(True)
            else:
                placement.put(torch.ones(master.shape, dtype=torch.bool), torch.zeros(full.shape, dtype=torch.bool),
                              mask)
        if name in compute:
            # what the forward reads is the master rounded to the compute dtype, on every rank
            assert torch.equal(compute[name], master.to(compute[name].dtype)), (
                f"{where}: {name}: the compute-dtype weights are not the rounded fp32 master "
                f"(max difference {(compute[name].float() - master).abs().max().item():.3g})")


def assert_equivalent(results: list[dict[str, Any]], reference: dict[str, Any], rtol: float = RTOL,
                      atol: float = ATOL, label: str = "") -> None:
    """Every rank's record equals the reference: losses, gradient norms, all replicas of all parameters."""
    steps = len(reference["losses"])
    assert results, f"{label}: no ranks reported"
    assert steps >= 1 and len(reference["norms"]) == steps, f"{label}: the reference has no steps"
    assert reference.get("initial") and all(r["first"].get("initial") for r in results), (
        f"{label}: the first-step update needs the initial parameters of the reference and of every rank")
    for key in ("first", "final"):
        covered: dict[str, torch.Tensor] = {}
        for rank, r in enumerate(results):
            where = f"{label} rank {rank} {key}"
            if key == "first":
                assert len(r["losses"]) == steps and len(r["norms"]) == steps, (
                    f"{where}: {len(r['losses'])} steps recorded, the reference has {steps}")
                _close(torch.tensor(r["losses"], dtype=torch.float64),
                       torch.tensor(reference["losses"], dtype=torch.float64), rtol, atol, f"{where} losses")
                _close(torch.tensor(r["norms"], dtype=torch.float64),
                       torch.tensor(reference["norms"], dtype=torch.float64), rtol, atol, f"{where} grad norms")
            assert_snapshot(r[key], reference[key], rtol, atol, where, covered,
                            initial=reference.get("initial") if key == "first" else None)
        missing = [n for n in reference[key] if n not in covered or not bool(covered[n].all())]
        assert not missing, f"{label} {key}: no rank holds (all of) {missing}"


# ---------------------------------------------------------------------------------------- within a tolerance
def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| (0 when both are zero, inf when only `want` is)."""
    err, size = float((got.double() - want.double()).norm()), float(want.double().norm())
    return err / size if size > 0 else (0.0 if err == 0 else float("inf"))


def distances(results: list[dict[str, Any]], reference: dict[str, Any]) -> dict[str, tuple[float, str]]:
    """How far every rank's record is from the reference's, as (the largest distance, where):

    loss: the largest relative difference of a step's global-batch loss; norm: the relative difference of the first
    step's gradient norm (later ones come from weights that already differ); update: the largest relative L2
    distance ||u - u_ref|| / ||u_ref|| of a parameter's (or a rank's slice's) first-step update u (the change from
    the initial parameters: the clipped gradient times lr under SGD); final: the same for the change over all steps
    (the final parameters minus the initial ones).
    """
    out: dict[str, tuple[float, str]] = {"loss": (0.0, ""), "norm": (0.0, ""), "update": (0.0, ""),
                                         "final": (0.0, "")}

    def worst(key: str, value: float, where: str) -> None:
        if not value <= out[key][0]:  # (a NaN is worst too)
            out[key] = (value, where)

    for rank, r in enumerate(results):
        for step, (got, want) in enumerate(zip(r["losses"], reference["losses"])):
            worst("loss", abs(got - want) / abs(want), f"rank {rank} step {step + 1}")
        worst("norm", abs(r["norms"][0] - reference["norms"][0]) / reference["norms"][0], f"rank {rank} step 1")
        for key, snap_key in (("update", "first"), ("final", "final")):
            snap = r[snap_key]
            initial = r["first"]["initial"]
            for name, master in snap["master"].items():
                placement = snap["placements"].get(name)
                cut = (lambda t: t) if placement is None else placement.take
                want = cut(reference[snap_key][name]) - cut(reference["initial"][name])
                worst(key, _relative(master - initial[name], want), f"rank {rank} {name}")
    return out


def assert_within(results: list[dict[str, Any]], reference: dict[str, Any], tolerance: Mapping[str, float],
                  label: str = "") -> dict[str, tuple[float, str]]:
    """Every rank's record is the reference's within `tolerance` (keys of `distances`; a key left out is not
    compared), for runs whose rounding differs from the reference's (bf16): losses, gradient norms, every replica
    and slice of every parameter's updates. Structure is checked exactly: the number of steps, every element of
    every reference parameter held by some rank, and the compute-dtype weights on every rank equal to its fp32
    masters rounded. Returns the distances."""
    steps = len(reference["losses"])
    assert results and steps >= 1, f"{label}: nothing to compare"
    for key in ("first", "final"):
        covered: dict[str, torch.Tensor] = {}
        for rank, r in enumerate(results):
            assert len(r["losses"]) == steps and len(r["norms"]) == steps, (
                f"{label} rank {rank}: {len(r['losses'])} steps recorded, the reference has {steps}")
            # the structural checks of assert_snapshot, with a tolerance no finite value can miss
            assert_snapshot(r[key], reference[key], rtol=0.0, atol=float("inf"),
                            where=f"{label} rank {rank} {key}", covered=covered)
        missing = [n for n in reference[key] if n not in covered or not bool(covered[n].all())]
        assert not missing, f"{label} {key}: no rank holds (all of) {missing}"
    found = distances(results, reference)
    beyond = [f"{key} differs by {found[key][0]:.3g} (relative) at {found[key][1]}, the tolerance is {limit:.3g}"
              for key, limit in tolerance.items() if not found[key][0] <= limit]
    assert not beyond, f"{label}: " + "; ".join(beyond)
    return found
