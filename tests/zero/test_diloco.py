"""DiLoCo over replicas: the replica layout's groups, the fp32/bf16/int8 delta all-reduce against its one-process
simulation, training against a one-process reference of R simulated replicas (inner dp=1 and a dp=2 ZeRO-2
replica, with and without a synchronous warm start), R=1 with outer lr 1 and no momentum against ordinary training, a
warm start as long as the run against ordinary data parallelism, and resume between two syncs. On one 4-rank spawn:
tp=2 replicas each clip by their own gradient norm and talk to no other replica between syncs, a step skipped on one
replica keeps every replica's sync schedule, and bf16 replicas of dp=2 equal the bf16 reference (an lr=0 control
does not)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

import zero
from tests.multirank import run_multirank
from tests.zero.models import build, global_batch, lm_loss
from zero.optim.diloco import DiLoCo, ReplicaDims
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


@torch.no_grad()
def outer_step(models: list, anchor: list, momentum: list, outer_lr: float, mu: float) -> None:
    """Average the replicas' deltas from `anchor`, Nesterov SGD on the anchor, every replica restarts from it."""
    for i, a in enumerate(anchor):
        average = torch.stack([a - list(m.parameters())[i] for m in models]).mean(0)
        momentum[i].mul_(mu).add_(average)
        a.sub_(average + mu * momentum[i], alpha=outer_lr)
        for m in models:
            list(m.parameters())[i].copy_(a)


def _reference(replicas: int, world: int, inner, h: int, steps: int, outer_lr: float, momentum: float,
               warmup: int = 0, skip: tuple[int, int] | None = None) -> dict:
    """R simulated replicas in one process, each training on its ranks' rows: for `warmup` steps on the mean of
    the replicas' gradients, then apart, synchronised every h steps from the parameters the warm-up ended at.
    skip=(replica, step): that replica takes no update at that step (a skipped step), which still counts."""
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
        for r, opt in enumerate(opts):
            if (r, step) != skip:
                opt.step()
            opt.zero_grad()
        if step >= warmup and (step + 1 - warmup) % h == 0:
            outer_step(models, anchor, buf, outer_lr, momentum)
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
    with pytest.raises(ValueError, match="warmup_steps=-1 must be an integer >= 0"):
        DiLoCo(INNER_SGD, None, inner_steps=2, warmup_steps=-1)
    with pytest.raises(ValueError, match="takes over the engine's steps itself"):
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


# ------------------------------------------------------------ replicas stay apart between syncs (4 ranks, one spawn)
HANG_S = 30.0  # a collective in flight this long ends the rank (zero.dist.comm's watchdog): a hang fails fast
CLIP = 0.1  # below every gradient norm of the tp run: each of its steps is clipped, by the norm it reports
SKIP_AT = (3, 1)  # (rank, step): rank 3 (replica 1) backpropagates a non-finite loss at its second step
BF16_LR, BF16_STEPS = 0.3, 5


def _group_spy(seen: list) -> object:
    """Record the global ranks of every collective's group that passes through zero.dist.comm (the one door)."""
    issue = comm._issue

    def spy(kind, ranks, collective, *args, group=None, **kwargs):
        seen.append((kind, tuple(dist.get_process_group_ranks(group))))
        return issue(kind, ranks, collective, *args, group=group, **kwargs)

    comm._issue = spy
    return issue


def _tp_tokens(step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    from tests.parallel.harness import batch

    tokens, labels = batch(step, 0)
    return tokens[2 * replica : 2 * replica + 2], labels[2 * replica : 2 * replica + 2]


def _tp_replicas(steps: int = 3) -> dict:
    """2 replicas of tp=2 (no dp), SGD clipped at CLIP, a sync after step 3: each step's gradient norm, the
    parameters not split by tp after the inner steps, and the groups of every collective of each step."""
    from moe_lst.models.llama import Transformer
    from sequence_parallel import sp_loss
    from tests.parallel.harness import model_config
    from zero.parallel.tensor import apply_tensor_parallel, vocab_parallel_cross_entropy

    dims = ReplicaDims(replicas=2, tp=2)
    torch.manual_seed(0)
    model = Transformer(model_config())
    plan = apply_tensor_parallel(model, dims.tp_group)
    optimizer = DiLoCo(INNER_SGD, dims.replica_group, inner_steps=steps, outer_lr=0.7, outer_momentum=0.9)
    engine = zero.initialize(model, optimizer, zero.ZeroConfig(stage=1, clip_grad_norm=CLIP), dims, plans=[plan])
    out = {"norms": [], "groups": [], "replica": dims.replica}
    for step in range(steps):
        tokens, labels = _tp_tokens(step, dims.replica)
        seen: list = []
        issue = _group_spy(seen)
        try:
            loss_sum, count = vocab_parallel_cross_entropy(engine(tokens).flatten(0, 1), labels.flatten(),
                                                           dims.tp_group)
            engine.backward(sp_loss(loss_sum, count, None))
            assert engine.step()
        finally:
            comm._issue = issue
        out["norms"].append(engine.global_grad_norm)
        out["groups"].append(sorted(set(seen)))
        if step == steps - 2:  # the last inner step before the sync
            state = engine.full_state_dict()
            out["whole"] = {k: v for k, v in state.items() if k not in engine.placements}
    return out


def _tp_reference(replica: int, steps: int) -> dict:
    """One replica alone, unsplit, in one process: its gradient norms and its parameters after `steps` clipped
    SGD steps."""
    from moe_lst.models.llama import Transformer
    from tests.parallel.harness import model_config

    torch.manual_seed(0)
    model = Transformer(model_config())
    opt = INNER_SGD(model.parameters())
    norms = []
    for step in range(steps):
        tokens, labels = _tp_tokens(step, replica)
        logits = model(tokens)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
    return {"norms": norms, "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _skipped_step(dims: ReplicaDims, dtype: str) -> dict:
    """2 replicas of dp=2 (ZeRO-2), a sync every 2 steps; rank SKIP_AT[0] backpropagates inf * loss at step
    SKIP_AT[1], so its replica skips that step. After each step: how many syncs this rank has taken."""
    rank, world = dist.get_rank(), dist.get_world_size()
    optimizer = DiLoCo(INNER_SGD, dims.replica_group, inner_steps=2, outer_lr=0.7, outer_momentum=0.9)
    config = zero.ZeroConfig(stage=2, reduce_bucket_size=500, dtype=dtype, initial_loss_scale=1024.0,
                             loss_scale_hysteresis=1)
    engine = zero.initialize(build(seed=0), optimizer, config, dims)
    out = {"syncs": [], "stepped": [], "scales": []}
    for step in range(6):
        loss = lm_loss(engine, _rows(step, rank, world))
        engine.backward(loss * (float("inf") if (rank, step) == SKIP_AT else 1.0))
        out["stepped"].append(engine.step())
        out["syncs"].append(engine.step_override.syncs)
        out["scales"].append(engine.loss_scale)
    out["params"] = engine.full_state_dict()
    return out


def _bf16_run(dims: ReplicaDims, lr: float) -> dict:
    """2 replicas of dp=2 (ZeRO-2) in bf16, inner SGD at `lr`, a sync every 2 steps, each rank on one fixed batch
    (the model memorises it, so the loss falls fast): each rank's losses and its replica's update of step 1."""
    rank, world = dist.get_rank(), dist.get_world_size()
    optimizer = DiLoCo(functools.partial(torch.optim.SGD, lr=lr), dims.replica_group, inner_steps=2,
                       outer_lr=0.7, outer_momentum=0.9)
    engine = zero.initialize(build(seed=0), optimizer, zero.ZeroConfig(stage=2, reduce_bucket_size=500,
                                                                       dtype="bf16"), dims)
    initial, rows, losses = engine.full_state_dict(), _rows(0, rank, world), []
    for step in range(BF16_STEPS):
        loss = lm_loss(engine, rows)
        engine.backward(loss)
        assert engine.step()
        losses.append(loss.item())
        if step == 0:
            update = {k: v - initial[k] for k, v in engine.full_state_dict().items()}
    return {"losses": losses, "update": update, "initial": initial}


def _four_ranks() -> dict:
    comm.start_watchdog(HANG_S, setting="the test's hang timeout")
    try:
        dp2 = ReplicaDims(replicas=2, dp=2)  # (its process groups serve every run below)
        return {"tp": _tp_replicas(), "bf16": {lr: _bf16_run(dp2, lr) for lr in (BF16_LR, 0.0)},
                "skip": {dtype: _skipped_step(dp2, dtype) for dtype in ("fp32", "fp16")}}
    finally:
        comm.stop_watchdog()


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return run_multirank(_four_ranks, 4, timeout=400)


def test_tp_replica_norm_is_its_own_and_inner_steps_stay_inside_it(four_ranks) -> None:
    """tp=2 x 2 replicas: the gradient norm each replica reports and clips by is the norm of that replica run alone
    (not summed over the replicas: sqrt(2) too large), and no collective of an inner step leaves the replica."""
    refs = {r: _tp_reference(r, 2) for r in (0, 1)}
    for rank, got in enumerate(four_ranks):
        tp = got["tp"]
        replica, want = tp["replica"], refs[tp["replica"]]
        assert replica == rank // 2
        assert tp["norms"][:2] == pytest.approx(want["norms"], rel=1e-5), (tp["norms"], want["norms"])
        assert min(want["norms"]) > CLIP  # (so the clipped update depends on the norm)
        for name, value in tp["whole"].items():  # after two clipped inner steps, the replica's parameters
            torch.testing.assert_close(value, want["params"][name], rtol=1e-5, atol=1e-6)
        mine = set(range(2 * replica, 2 * replica + 2))
        for step in (0, 1):
            assert tp["groups"][step] and all(set(ranks) <= mine for _, ranks in tp["groups"][step]), tp["groups"]
        assert any(not set(ranks) <= mine for _, ranks in tp["groups"][2])  # the sync crosses (the spy sees it)


def test_a_step_skipped_on_one_replica_keeps_the_sync_schedule(four_ranks) -> None:
    """A non-finite gradient on one replica (an fp16 overflow, or a spike) skips its update there only; the replicas
    still synchronise after the same attempted steps (2, 4, 6), so none waits on a peer in another collective (a
    hang ends the rank within HANG_S), and the skipped step is an inner step without an update: in fp32 the run
    equals the simulated replicas with replica 1's update of that step left out."""
    skip_rank, skip_step = SKIP_AT
    want = _reference(2, 4, INNER_SGD, 2, 6, 0.7, 0.9, skip=(skip_rank // 2, skip_step))
    for rank, got in enumerate(four_ranks):
        for dtype, run in got["skip"].items():
            assert run["syncs"] == [0, 1, 1, 2, 2, 3], (dtype, rank, run["syncs"])
            skipped = rank // 2 == skip_rank // 2
            assert run["stepped"] == [not (skipped and s == skip_step) for s in range(6)], (dtype, rank)
        fp16 = got["skip"]["fp16"]["scales"]  # the overflowing replica halves its loss scale, the other does not
        assert fp16[skip_step] == (512.0 if rank // 2 == skip_rank // 2 else 1024.0)
        for name, value in want.items():
            torch.testing.assert_close(got["skip"]["fp32"]["params"][name], value, rtol=0, atol=1e-6)


def _bf16_reference(lr: float) -> dict:
    """_bf16_run in one process: each replica's fp32 masters, weights rounded to bf16 for the forward and backward of
    each of its ranks' batches, the ranks' bf16 gradients averaged in fp32 (as one rank accumulating two micro
    batches does), SGD on the masters, the outer step every 2 steps on the masters."""
    world, replicas, per = 4, 2, 2
    compute = build(seed=0).to(torch.bfloat16)
    masters = [[torch.nn.Parameter(p.detach().float()) for p in compute.parameters()] for _ in range(replicas)]
    opts = [torch.optim.SGD(m, lr=lr) for m in masters]
    anchor = [p.detach().clone() for p in masters[0]]
    buf = [torch.zeros_like(a) for a in anchor]
    names = [n for n, _ in compute.named_parameters()]
    losses: list[list[float]] = [[] for _ in range(world)]
    update = {}
    for step in range(BF16_STEPS):
        for r in range(replicas):
            with torch.no_grad():
                for p, m in zip(compute.parameters(), masters[r]):
                    p.copy_(m)  # rounded to bf16
            grads = [torch.zeros_like(m) for m in masters[r]]
            for g in range(r * per, (r + 1) * per):
                loss = lm_loss(compute, _rows(0, g, world))
                loss.backward()
                losses[g].append(loss.item())
                for acc, p in zip(grads, compute.parameters()):
                    acc.add_(p.grad.float())
                compute.zero_grad()
            for m, acc in zip(masters[r], grads):
                m.grad = acc.mul_(1 / per)
            before = [m.detach().clone() for m in masters[r]]
            opts[r].step()
            if step == 0:
                update[r] = {n: m.detach() - b for n, m, b in zip(names, masters[r], before)}
        if (step + 1) % 2 == 0:
            with torch.no_grad():
                for i, a in enumerate(anchor):
                    average = torch.stack([a - m[i] for m in masters]).mean(0)
                    buf[i].mul_(0.9).add_(average)
                    a.sub_(average + 0.9 * buf[i], alpha=0.7)
                    for m in masters:
                        m[i].copy_(a)
    return {"losses": losses, "update": update}


# bf16 has an 8-bit significand: one rounding (to nearest) moves a value by at most u = 2^-8 of itself. The replicas'
# run and the reference compute every rank's forward and backward on the same bf16 weights (bitwise the same); they
# differ in the one reduction between: ZeRO-2's reduce-scatter sums the 2 ranks' bf16 gradients in bf16 (one
# rounding, <= u of the sum) where the reference sums them in fp32. So step 1's update (lr x that sum / 2, on fp32
# masters) is within u of the reference's, element by element, plus a few fp32 ulps of the parameter from the
# master's own rounding. Measured: 0.996 u at worst (the bound is attained), so the update is compared at 2u, room
# for a backend that rounds the sum twice. After step 1 a master that differs by that much can round to a
# neighbouring bf16 weight (one ulp, <= 2u of it), and each rank's loss is itself a bf16 value (spacing <= 2u of it):
# the losses are compared at 2 bf16 spacings, 4u = 2^-6 ~ 1.6% (measured: equal at all 5 steps, no weight crossed a
# rounding boundary). The lr=0 control is off by all of its update (256 u: 128x the tolerance) and by 20-28% in loss
# by step 5 (its loss stays at the first step's as the reference's falls 0.6-0.8 from ~3.8): both far outside.
BF16_U = 2.0**-8
BF16_UPDATE_RTOL, BF16_LOSS_RTOL = 2 * BF16_U, 4 * BF16_U


def _bf16_deviation(run: dict, ref: dict, rank: int) -> tuple[float, float]:
    """(the largest |update - reference| / its tolerance over every element of step 1's update, the largest relative
    loss difference over the steps) of one rank's run; the first > 1 means outside the tolerance."""
    want = ref["update"][rank // 2]
    worst = 0.0
    for name, value in run["update"].items():
        floor = 4 * torch.finfo(torch.float32).eps * run["initial"][name].abs()  # the fp32 master's rounding
        allowed = BF16_UPDATE_RTOL * want[name].abs() + floor + 1e-12
        worst = max(worst, float(((value - want[name]).abs() / allowed).max()))
    losses = ref["losses"][rank]
    return worst, max(abs(a - b) / abs(b) for a, b in zip(run["losses"], losses))


def test_bf16_replicas_of_dp2_equal_the_bf16_reference_and_lr0_does_not(four_ranks) -> None:
    ref = _bf16_reference(BF16_LR)
    for rank, got in enumerate(four_ranks):
        update, loss = _bf16_deviation(got["bf16"][BF16_LR], ref, rank)
        assert update <= 1.0 and loss <= BF16_LOSS_RTOL, (rank, update, loss)
        frozen_update, frozen_loss = _bf16_deviation(got["bf16"][0.0], ref, rank)
        assert frozen_update > 10 and frozen_loss > 2 * BF16_LOSS_RTOL, (rank, frozen_update, frozen_loss)
        assert ref["losses"][rank][0] - ref["losses"][rank][-1] > 0.1  # (the reference learns its batch)
