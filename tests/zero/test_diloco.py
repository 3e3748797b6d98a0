"""DiLoCo over replicas: the replica layout's groups, the fp32/bf16/int8 delta all-reduce against its one-process
simulation, training against a one-process reference of R simulated replicas (inner dp=1 and a dp=2 ZeRO-2
replica, with and without a synchronous warm start), R=1 with outer lr 1 and no momentum against ordinary training, a
warm start as long as the run against ordinary data parallelism, and resume between two syncs."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

import zero
from tests.multirank import run_multirank
from tests.zero.models import build, global_batch, lm_loss
from zero.diloco import DiLoCo, ReplicaDims
from zero.dist import comm
from zero.optim.compression import ChunkLayout, quantized_all_reduce, simulate_quantized_all_reduce

ROWS = 2  # rows per rank
INNER_SGD = functools.partial(torch.optim.SGD, lr=0.3)
INNER_ADAMW = zero.FastAdamW(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def _groups() -> dict:
    dims = ReplicaDims(replicas=2, dp=2)
    return {"dp": dist.get_process_group_ranks(dims.dp_sp_group), "replica": dist.get_process_group_ranks(
        dims.replica_group), "coordinate": dims.coordinate(), "dims": str(dims)}


def test_replica_groups() -> None:
    got = run_multirank(_groups, 4)
    assert [g["dp"] for g in got] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [g["replica"] for g in got] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [(g["coordinate"]["replica"], g["coordinate"]["dp"]) for g in got] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert got[0]["dims"].endswith("world=2, replicas=2)")


def _reduce(numel: int, dtype: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = ChunkLayout(numel, world, 16)
    x = layout.to_chunks(torch.randn(numel, generator=torch.Generator().manual_seed(rank)))
    with comm.counting() as stats:
        out = quantized_all_reduce(x, layout, dtype, dist.group.WORLD)
        sent = dict(stats.bytes)
    return {"out": out, "sent": sent}


@pytest.mark.parametrize("world,dtype", [(2, "fp32"), (4, "bf16"), (4, "int8"), (2, "int8")])
def test_delta_all_reduce_equals_simulation_bitwise(world: int, dtype: str) -> None:
    numel = 203
    got = run_multirank(_reduce, world, numel, dtype)
    layout = ChunkLayout(numel, world, 16)
    xs = [layout.to_chunks(torch.randn(numel, generator=torch.Generator().manual_seed(r))) for r in range(world)]
    want = simulate_quantized_all_reduce(xs, layout, dtype)
    per_row = {"fp32": 4 * layout.padded_chunk, "bf16": 2 * layout.padded_chunk,
               "int8": layout.padded_chunk + 4 * layout.blocks}[dtype]
    for r in got:
        assert torch.equal(r["out"], want)
        assert r["sent"] == {"all_to_all": (world - 1) * per_row, "all_gather": (world - 1) * per_row}
    exact = layout.from_chunks(sum(xs) / world)
    tol = {"fp32": 1e-6, "bf16": 2e-2, "int8": 5e-2}[dtype]
    assert (layout.from_chunks(want) - exact).abs().max() <= tol * max(x.abs().max() for x in xs)


# ---------------------------------------------------------------------------------------- training
def _rows(step: int, rank: int, world: int) -> torch.Tensor:
    return global_batch(step, 0, ROWS * world)[rank * ROWS : (rank + 1) * ROWS]


def _diloco_run(replicas: int, dp: int, stage: int, inner, h: int, steps: int, outer_lr: float, momentum: float,
                delta_dtype: str = "fp32", save: tuple[int, str] | None = None, warmup: int = 0) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    dims = ReplicaDims(replicas=replicas, dp=dp)
    optimizer = DiLoCo(inner, dims.replica_group, inner_steps=h, outer_lr=outer_lr, outer_momentum=momentum,
                       delta_dtype=delta_dtype, block=64, warmup_steps=warmup)

    def make():
        return zero.initialize(build(seed=0), optimizer, zero.ZeroConfig(stage=stage, reduce_bucket_size=500), dims)

    engine, losses, sent = make(), [], []
    for step in range(steps):
        with comm.counting() as stats:
            loss = lm_loss(engine, _rows(step, rank, world))
            engine.backward(loss)
            assert engine.step()
            sent.append(stats.total_bytes)
        losses.append(loss.item())
        if save is not None and step + 1 == save[0]:
            engine.save_checkpoint(save[1])
    out = {"losses": losses, "params": engine.full_state_dict(), "sent": sent}
    if save is not None:
        resumed = make()
        resumed.load_checkpoint(save[1])
        again = []
        for step in range(save[0], steps):
            loss = lm_loss(resumed, _rows(step, rank, world))
            resumed.backward(loss)
            resumed.step()
            again.append(loss.item())
        out["again"], out["resumed_params"] = again, resumed.full_state_dict()
    return out


def _reference(replicas: int, world: int, inner, h: int, steps: int, outer_lr: float, momentum: float,
               warmup: int = 0) -> dict:
    """R simulated replicas in one process, each training on its ranks' rows: for `warmup` steps on the mean of
    the replicas' gradients, then apart, synchronised every h steps from the parameters the warm-up ended at."""
    per = world // replicas
    models = [build(seed=0) for _ in range(replicas)]
    opts = [inner(m.parameters()) for m in models]
    for step in range(steps):
        if step == warmup:
            anchor = [p.detach().clone() for p in models[0].parameters()]
            buf = [torch.zeros_like(a) for a in anchor]
        for r, m in enumerate(models):
            rows = torch.cat([_rows(step, g, world) for g in range(r * per, (r + 1) * per)])
            lm_loss(m, rows).backward()
        if step < warmup:
            with torch.no_grad():
                for ps in zip(*(m.parameters() for m in models)):
                    mean = torch.stack([p.grad for p in ps]).mean(0)
                    for p in ps:
                        p.grad.copy_(mean)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        if step >= warmup and (step + 1 - warmup) % h == 0:
            with torch.no_grad():
                for i, a in enumerate(anchor):
                    average = torch.stack([a - list(m.parameters())[i] for m in models]).mean(0)
                    buf[i].mul_(momentum).add_(average)
                    a.sub_(average + momentum * buf[i], alpha=outer_lr)
                    for m in models:
                        list(m.parameters())[i].copy_(a)
    names = [n for n, _ in models[0].named_parameters()]
    return {n: p.detach().clone() for n, p in zip(names, models[0].parameters())}


@pytest.mark.parametrize("world,replicas,dp,stage,inner,warmup", [
    (2, 2, 1, 0, "sgd", 0), pytest.param(4, 4, 1, 1, "adamw", 0, marks=pytest.mark.slow),
    (4, 2, 2, 2, "sgd", 0),  # each replica is itself dp=2 ZeRO-2
    (2, 2, 1, 0, "adamw", 2),  # a synchronous warm start of 2 steps (stage 0; stage 2 with -m slow)
    pytest.param(4, 2, 2, 2, "sgd", 2, marks=pytest.mark.slow),
])
def test_diloco_equals_reference_of_simulated_replicas(world, replicas, dp, stage, inner, warmup) -> None:
    h, outer_lr, momentum = 3, 0.7, 0.9
    steps = warmup + 6
    opt = {"sgd": INNER_SGD, "adamw": INNER_ADAMW}[inner]
    got = run_multirank(_diloco_run, world, replicas, dp, stage, opt, h, steps, outer_lr, momentum, warmup=warmup)
    want = _reference(replicas, world, opt, h, steps, outer_lr, momentum, warmup)
    for r in got:  # after the last sync every rank of every replica holds the same model, the reference's
        for name, value in want.items():
            torch.testing.assert_close(r["params"][name], value, rtol=0, atol=1e-6)
    # only warm-up and sync steps talk across replicas (an all-reduce's volume of this rank's gradient or shard)
    sent = got[0]["sent"]
    inner_only = sent[warmup]
    assert all(s > inner_only for s in sent[:warmup])
    assert all(s == inner_only for k, s in enumerate(sent[warmup:]) if (k + 1) % h)
    assert all(s > inner_only for k, s in enumerate(sent[warmup:]) if (k + 1) % h == 0)


def _plain(steps: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    engine = zero.initialize(build(seed=0), INNER_ADAMW, zero.ZeroConfig(stage=1), zero.ParallelDims(dp=world))
    losses = []
    for step in range(steps):
        loss = lm_loss(engine, _rows(step, rank, world))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "params": engine.full_state_dict()}


def _one_replica(steps: int) -> dict:
    return _diloco_run(1, 2, 1, INNER_ADAMW, 3, steps, 1.0, 0.0)


def test_one_replica_outer_lr_one_no_momentum_is_ordinary_training() -> None:
    plain, diloco = run_multirank(_plain, 2, 7), run_multirank(_one_replica, 2, 7)
    for a, b in zip(plain, diloco):
        assert a["losses"] == pytest.approx(b["losses"], rel=1e-6, abs=0)
        for name in a["params"]:
            torch.testing.assert_close(b["params"][name], a["params"][name], rtol=0, atol=1e-6)


def _warm_only(steps: int) -> dict:
    return _diloco_run(2, 1, 1, INNER_ADAMW, 3, steps, 0.7, 0.9, warmup=steps)


def test_warm_start_is_ordinary_data_parallelism() -> None:
    """Two replicas of one rank each, warm-up as long as the run: AdamW over the ranks' averaged gradients."""
    plain, diloco = run_multirank(_plain, 2, 5), run_multirank(_warm_only, 2, 5)
    for a, b in zip(plain, diloco):
        assert b["losses"] == pytest.approx(a["losses"], rel=1e-6, abs=0)
        for name in a["params"]:
            torch.testing.assert_close(b["params"][name], a["params"][name], rtol=0, atol=1e-6)


@pytest.mark.parametrize("delta_dtype,warmup", [("fp32", 0), ("int8", 0), ("fp32", 2), ("fp32", 6)])
def test_resume_between_syncs_is_bitwise(tmp_path, delta_dtype: str, warmup: int) -> None:
    """Saved after step 4 of 8: between two syncs, after a warm-up of 2 steps, or inside one of 6."""
    got = run_multirank(_diloco_run, 2, 2, 1, 1, INNER_ADAMW, 3, 8, 0.7, 0.9, delta_dtype, (4, str(tmp_path / "c")),
                        warmup)
    for r in got:
        assert r["again"] == r["losses"][4:]
        assert all(torch.equal(r["params"][k], r["resumed_params"][k]) for k in r["params"])


def test_refusals() -> None:
    with pytest.raises(ValueError, match="delta_dtype='fp16' must be one of fp32, bf16, int8"):
        DiLoCo(INNER_SGD, None, inner_steps=2, delta_dtype="fp16")
    with pytest.raises(ValueError, match="inner_steps=0 must be"):
        DiLoCo(INNER_SGD, None, inner_steps=0)
    with pytest.raises(ValueError, match="warmup_steps=-1 must be an int >= 0"):
        DiLoCo(INNER_SGD, None, inner_steps=2, warmup_steps=-1)
    with pytest.raises(ValueError, match="binds to the engine itself"):
        DiLoCo(DiLoCo(INNER_SGD, None, inner_steps=1), None, inner_steps=2)


def _moe_run(ep: int, steps: int) -> dict:
    from moe import apply_expert_parallel
    from tests.zero.models import build_moe

    rank, world = dist.get_rank(), dist.get_world_size()
    dims = ReplicaDims(replicas=2, dp=2, ep=ep)
    model = build_moe(seed=0)
    plans = [apply_expert_parallel(model, dims)]
    optimizer = DiLoCo(INNER_SGD, dims.replica_group, inner_steps=2, outer_lr=0.7, outer_momentum=0.9)
    engine = zero.initialize(model, optimizer, zero.ZeroConfig(stage=1), dims, plans=plans)
    losses = []
    for step in range(steps):
        loss = lm_loss(engine, _rows(step, rank, world))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state = engine.full_state_dict()
    dense = {k: v for k, v in state.items() if "experts" not in k}
    return {"losses": losses, "dense": dense, "experts": {k: v for k, v in state.items() if "experts" in k}}


@pytest.mark.slow
def test_replicas_with_expert_parallelism_match_ep1() -> None:
    """R=2 replicas, each dp=2 with its experts split over ep=2, train as the same replicas with ep=1."""
    ep1, ep2 = run_multirank(_moe_run, 4, 1, 4), run_multirank(_moe_run, 4, 2, 4)
    for rank, r in enumerate(ep2):  # the run ends on a sync: both replicas hold the same experts
        peer = ep2[(rank + 2) % 4]
        assert r["experts"] and all(torch.equal(v, peer["experts"][k]) for k, v in r["experts"].items())
    for a, b in zip(ep1, ep2):
        assert b["losses"] == pytest.approx(a["losses"], rel=1e-5)
        for name, value in a["dense"].items():
            torch.testing.assert_close(b["dense"][name], value, rtol=1e-5, atol=1e-6)
