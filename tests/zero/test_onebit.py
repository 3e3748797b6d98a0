"""1-bit Adam: the compressed all-reduce equals its one-process simulation bitwise, the warm-up is AdamW
bitwise, the compressed phase equals a one-process simulation of R workers bitwise (stages 0-1, gradient
accumulation), checkpoints resume inside the compressed phase bitwise, experts compress over their
expert-data-parallel group, and what cannot work is refused."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import zero
from tests.multirank import run_multirank
from tests.zero.models import build, build_moe, global_batch, lm_loss
from zero.dist import comm
from zero.optim import OneBitAdam
from zero.optim.compression import ChunkLayout, compressed_all_reduce, simulate_all_reduce, simulate_quantized_all_reduce
from zero.optim.onebit import REFRESH_BLOCK

HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
BLOCK = 16
ROWS = 2  # rows per rank and micro-batch


def _inputs(rank: int, layout: ChunkLayout, rounds: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [layout.to_chunks(torch.randn(layout.numel, generator=g) * (k + 1)) for k in range(rounds)]


def _all_reduce_rounds(numel: int, rounds: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = ChunkLayout(numel, world, BLOCK)
    worker = torch.zeros(world, layout.padded_chunk)
    server = torch.zeros(layout.padded_chunk)
    outs = []
    with comm.counting() as stats:
        for x in _inputs(rank, layout, rounds):
            outs.append(compressed_all_reduce(x, worker, server, layout, dist.group.WORLD))
        sent = dict(stats.bytes)
    return {"outs": outs, "worker": worker, "server": server, "sent": sent}


@pytest.mark.parametrize("world", [2, 4])
def test_compressed_all_reduce_equals_simulation_bitwise(world: int) -> None:
    numel, rounds = 203, 3  # odd: chunks and blocks padded
    got = run_multirank(_all_reduce_rounds, world, numel, rounds)
    layout = ChunkLayout(numel, world, BLOCK)
    xs = [_inputs(r, layout, rounds) for r in range(world)]
    workers = [torch.zeros(world, layout.padded_chunk) for _ in range(world)]
    servers = [torch.zeros(layout.padded_chunk) for _ in range(world)]
    for k in range(rounds):
        want = simulate_all_reduce([x[k] for x in xs], workers, servers, layout)
        for r in range(world):
            assert torch.equal(got[r]["outs"][k], want), (k, r)
    for r in range(world):
        assert torch.equal(got[r]["worker"], workers[r]) and torch.equal(got[r]["server"], servers[r])
        # 1 bit per element plus one fp32 scale per block, (world - 1) / world of it twice: the compressed volume.
        assert got[r]["sent"] == {"all_to_all": rounds * (world - 1) * layout.payload_bytes,
                                  "all_gather": rounds * (world - 1) * layout.payload_bytes}


def test_compression_error_feedback_is_exact_bookkeeping() -> None:
    layout = ChunkLayout(64, 2, 16)
    xs = [layout.to_chunks(torch.randn(64)) for _ in range(2)]
    workers = [torch.zeros(2, 32) for _ in range(2)]
    servers = [torch.zeros(32) for _ in range(2)]
    out = simulate_all_reduce([x.clone() for x in xs], workers, servers, layout)
    # what was sent plus what was kept back is what there was: mean(x) = out + mean(worker errors) + server errors
    kept = sum(workers) / 2 + torch.stack(servers)
    assert torch.allclose(out + kept, sum(xs) / 2, atol=1e-6)


# ---------------------------------------------------------------------------------------- training
def _rows(step: int, micro: int, rank: int, world: int) -> torch.Tensor:
    return global_batch(step, micro, ROWS * world)[rank * ROWS : (rank + 1) * ROWS]


def _engine(stage: int, dtype: str, accum: int, optimizer, world: int):
    config = zero.ZeroConfig(stage=stage, dtype=dtype, grad_accum_steps=accum, reduce_bucket_size=10**6)
    return zero.initialize(build(seed=0), optimizer, config, zero.ParallelDims(dp=world))


def _train(engine, steps: range, accum: int) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in steps:
        total = 0.0
        for micro in range(accum):
            loss = lm_loss(engine, _rows(step, micro, rank, world))
            engine.backward(loss)
            total += loss.item() / accum
        assert engine.step()
        losses.append(total)
    return losses


def _flat_state(engine) -> dict[str, torch.Tensor]:
    """The one trainable bucket's master, exp_avg and exp_avg_sq, whole ([padded]) on every rank."""
    (b,) = [b for b in engine.buckets if b.trainable]
    master = engine.zero_optimizer.masters.masters[0]
    out = {}
    for key, t in [("master", master.detach()), *engine.optimizer.state[master].items()]:
        if key == "step":
            continue
        full = torch.empty(b.padded)
        comm.all_gather_into_tensor(full, t.float().contiguous(), b.group) if b.world > 1 else full.copy_(t)
        out[key] = full
    return out


def _warmup_then_compressed(stage: int, accum: int, warmup: int, steps: int, precondition: bool,
                            refresh: int = 0, bound: float | None = None) -> dict:
    world = dist.get_world_size()
    engine = _engine(stage, "fp32", accum, OneBitAdam(warmup_steps=warmup, block=BLOCK, precondition=precondition,
                                                      refresh_every=refresh, max_update=bound, **HYPER), world)
    _train(engine, range(warmup), accum)
    frozen = _flat_state(engine)
    with comm.counting() as stats:
        losses = _train(engine, range(warmup, steps), accum)
        sent = dict(stats.bytes)
    return {"frozen": frozen, "final": _flat_state(engine), "losses": losses, "sent": sent,
            "names": engine.buckets[0].names, "padded": engine.buckets[0].padded}


def _simulate_compressed(start: dict, world: int, stage: int, accum: int, warmup: int, steps: int,
                         precondition: bool, refresh: int = 0, bound: float | None = None):
    """R workers of 1-bit Adam in one process (the same flat layout as the engine's bucket), from the state the
    warm-up left: returns the mean losses and the final master. precondition: what travels is the momentum over
    the frozen denominator, multiplied back after the average. refresh: every refresh-th step after the warm-up
    is AdamW on the averaged gradient, after which the variance and momentum freeze afresh, errors cleared; the
    variance's bias correction counts only the AdamW steps (those that updated it), as does AdamW's own step count."""
    model = build(seed=0)
    params = dict(model.named_parameters())
    named = [(n, params[n]) for n in start["names"]]
    master, m, v = start["frozen"]["master"].clone(), start["frozen"]["exp_avg"].clone(), start["frozen"]["exp_avg_sq"]
    layout = ChunkLayout(start["padded"], world, BLOCK)
    workers = [torch.zeros(world, layout.padded_chunk) for _ in range(world)]
    servers = [torch.zeros(layout.padded_chunk) for _ in range(world)]
    beta1, beta2 = HYPER["betas"]
    denom = (v.sqrt() / math.sqrt(1 - beta2**warmup)).add_(HYPER["eps"])
    adam_steps = warmup
    losses = []
    for t, step in enumerate(range(warmup, steps), start=warmup + 1):
        grads, total = [], 0.0
        for r in range(world):
            flat_grad = torch.zeros(start["padded"])
            offset = 0
            for _, p in named:
                p.data = master[offset : offset + p.numel()].view(p.shape).clone()
                p.grad = flat_grad[offset : offset + p.numel()].view(p.shape)
                offset += p.numel()
            for micro in range(accum):
                loss = lm_loss(model, _rows(step, micro, r, world))
                (loss / accum).backward()
                total += loss.item() / accum / world
            grads.append(flat_grad)
        if refresh and step > warmup and (step - warmup) % refresh == 0:
            qlayout = ChunkLayout(start["padded"], world, REFRESH_BLOCK)
            g = qlayout.from_chunks(simulate_quantized_all_reduce([qlayout.to_chunks(x) for x in grads], qlayout,
                                                                  "int8")).clone()
            m = m * beta1 + g * (1 - beta1)
            v = v * beta2 + g * g * (1 - beta2)
            adam_steps += 1
            fresh = (v.sqrt() / math.sqrt(1 - beta2**adam_steps)).add_(HYPER["eps"])
            if precondition:  # the errors into the new denominator's coordinates
                ratio = layout.to_chunks(denom / fresh)
                workers = [e * ratio for e in workers]
                servers = [e * ratio[j] for j, e in enumerate(servers)]
            denom = fresh
            master.mul_(1 - HYPER["lr"] * HYPER["weight_decay"])
            if bound is None:
                master.addcdiv_(m, denom, value=-HYPER["lr"] / (1 - beta1 ** float(t)))
            else:
                master.add_((m / denom / (1 - beta1 ** float(t))).clamp_(-bound, bound), alpha=-HYPER["lr"])
            losses.append(total)
            continue
        local = [g.mul_(1 - beta1).add_(m, alpha=beta1) for g in grads]
        if precondition:
            local = [x / denom for x in local]
        average = layout.from_chunks(simulate_all_reduce([layout.to_chunks(x) for x in local], workers, servers,
                                                         layout)).clone()
        master.mul_(1 - HYPER["lr"] * HYPER["weight_decay"])
        bias1 = 1 - beta1 ** float(t)
        if precondition:
            m = average * denom
            if bound is None:
                master.add_(average, alpha=-HYPER["lr"] / bias1)
            else:
                master.add_((average / bias1).clamp_(-bound, bound), alpha=-HYPER["lr"])
        else:
            m = average
            if bound is None:
                master.addcdiv_(m, denom, value=-HYPER["lr"] / bias1)
            else:
                master.add_((m / denom / bias1).clamp_(-bound, bound), alpha=-HYPER["lr"])
        losses.append(total)
    return losses, master


@pytest.mark.parametrize("world,stage,accum,precondition,refresh,bound", [
    (2, 0, 1, True, 0, None), (2, 1, 2, True, 0, None), pytest.param(4, 1, 1, True, 0, None, marks=pytest.mark.slow),
    (2, 1, 1, False, 0, None), (2, 1, 1, True, 2, 0.5), (2, 0, 1, False, 3, 0.5)])
# (4 ranks: the compressed all-reduce's own test; this one -m slow)
def test_compressed_phase_equals_simulation(world: int, stage: int, accum: int, precondition: bool,
                                            refresh: int, bound: float | None) -> None:
    warmup, steps = 2, 7 if refresh else 5  # (refresh=2: steps 4 and 6 refresh, 2, 3 and 5 are compressed)
    got = run_multirank(_warmup_then_compressed, world, stage, accum, warmup, steps, precondition, refresh, bound)
    losses, master = _simulate_compressed(got[0], world, stage, accum, warmup, steps, precondition, refresh, bound)
    if bound is not None:  # (the bound must bind somewhere, or this case proves nothing about it)
        _, free = _simulate_compressed(got[0], world, stage, accum, warmup, steps, precondition, refresh, None)
        assert not torch.allclose(free, master, rtol=1e-5, atol=1e-7)
    for r in range(world):
        assert torch.equal(got[r]["final"]["master"], got[0]["final"]["master"])  # every rank the same model
    moved = got[0]["final"]["master"] - got[0]["frozen"]["master"]
    want = master - got[0]["frozen"]["master"]
    torch.testing.assert_close(moved, want, rtol=1e-5, atol=1e-7)
    mean = torch.tensor([r["losses"] for r in got]).mean(0)  # each rank's loss is of its own rows
    torch.testing.assert_close(mean, torch.tensor(losses, dtype=mean.dtype), rtol=1e-6, atol=0)
    # bytes sent, exactly: per compressed step the 1-bit payloads twice and an 8-byte squared norm; at stage 1
    # also the fp32 parameter all-gather, and once (entering the compressed phase) the momentum all-gather and,
    # preconditioned, the variance's
    n, layout = got[0]["padded"], ChunkLayout(got[0]["padded"], world, BLOCK)
    per_step = 2 * (world - 1) * layout.payload_bytes + int(2 * (world - 1) / world * 8)
    gather = (world - 1) * n // world * 4 if stage else 0
    entering = gather * (2 if precondition or refresh else 1)  # (the variance is gathered whole where it is used)
    # a refresh sends the int8 gradient payloads (one fp32 scale per REFRESH_BLOCK) twice instead
    refreshes = len([s for s in range(warmup + 1, steps) if refresh and (s - warmup) % refresh == 0])
    qlayout = ChunkLayout(n, world, REFRESH_BLOCK)
    per_refresh = 2 * (world - 1) * (qlayout.padded_chunk + 4 * qlayout.blocks) + int(2 * (world - 1) / world * 8)
    assert sum(got[0]["sent"].values()) == ((steps - warmup - refreshes) * per_step + refreshes * per_refresh
                                            + (steps - warmup) * gather + entering)


def _warmup_pair(stage: int, dtype: str) -> list:
    world = dist.get_world_size()
    out = []
    for optimizer in (zero.FastAdamW(**HYPER), OneBitAdam(warmup_steps=3, block=BLOCK, **HYPER)):
        engine = _engine(stage, dtype, 2, optimizer, world)
        losses = _train(engine, range(3), 2)
        out.append((losses, engine.full_state_dict(), engine.buckets[0].full.clone()))
    return out


@pytest.mark.parametrize("stage,dtype", [(0, "fp32"), (1, "bf16")])
def test_warmup_equals_adamw_bitwise(stage: int, dtype: str) -> None:
    for (adamw, onebit) in run_multirank(_warmup_pair, 2, stage, dtype):
        assert adamw[0] == onebit[0]
        assert all(torch.equal(adamw[1][k], onebit[1][k]) for k in adamw[1])
        assert torch.equal(adamw[2], onebit[2])


def _resume(stage: int, dtype: str, path: str, refresh: int) -> dict:
    world = dist.get_world_size()

    def make(precondition=True):
        return _engine(stage, dtype, 1, OneBitAdam(warmup_steps=2, block=BLOCK, precondition=precondition,
                                                   refresh_every=refresh, **HYPER), world)

    engine = make()
    straight = _train(engine, range(4), 1)
    engine.save_checkpoint(path)
    straight += _train(engine, range(4, 7), 1)
    resumed = make()
    resumed.load_checkpoint(path)
    again = _train(resumed, range(4, 7), 1)
    same = all(torch.equal(a, b) for a, b in zip(engine.full_state_dict().values(), resumed.full_state_dict().values()))
    other = make(precondition=False)
    try:  # error feedback kept in the preconditioned coordinates cannot continue raw momentum compression
        other.load_checkpoint(path)
        refused = ""
    except ValueError as e:
        refused = str(e)
    return {"straight": straight[4:], "again": again, "same": same, "refused": refused}


@pytest.mark.parametrize("stage,dtype,refresh", [(0, "bf16", 0), (1, "fp32", 2)])
def test_resume_inside_compressed_phase_is_bitwise(tmp_path, stage: int, dtype: str, refresh: int) -> None:
    # refresh=2: the checkpoint (after step 4) comes right before a refresh step, the run re-freezes after it
    for r in run_multirank(_resume, 2, stage, dtype, str(tmp_path / "ckpt"), refresh):
        assert r["straight"] == r["again"] and r["same"]
        assert "precondition=True differs from precondition=False" in r["refused"]


def _experts(stage: int) -> dict:
    from moe import apply_expert_parallel

    rank, world = dist.get_rank(), dist.get_world_size()
    dims = zero.ParallelDims(dp=world, ep=2)
    model = build_moe(seed=0)
    plan = apply_expert_parallel(model, dims)
    config = zero.ZeroConfig(stage=stage, dtype="bf16", reduce_bucket_size=10**6)
    engine = zero.initialize(model, OneBitAdam(warmup_steps=2, block=BLOCK, **HYPER), config, dims, plans=[plan])
    losses = _train(engine, range(6), 1)
    worlds = {b.reduce_group: f.layout.world for b, f in
              zip(engine.zero_optimizer.trainable, engine.step_override.feedback)}
    # experts' momenta agree within their expert-data-parallel group, dense momenta everywhere
    moms = {b.reduce_group: f.momentum for b, f in zip(engine.zero_optimizer.trainable, engine.step_override.feedback)}
    return {"worlds": worlds, "losses": losses, "moms": moms, "ep_rank": dims.coordinate()["ep"], "rank": rank}


@pytest.mark.slow
def test_expert_momenta_compress_over_expert_data_parallel_group() -> None:
    got = run_multirank(_experts, 4, 1)
    dense = [k for k in got[0]["worlds"] if k == "dense"][0]
    (expert,) = [k for k in got[0]["worlds"] if k != dense]
    assert got[0]["worlds"] == {dense: 4, expert: 2}
    assert all(math.isfinite(x) for r in got for x in r["losses"])
    assert all(torch.equal(r["moms"][dense], got[0]["moms"][dense]) for r in got)
    for r in got:  # the rank holding the same experts (same ep coordinate) has the same expert momentum
        twin = [o for o in got if o["ep_rank"] == r["ep_rank"] and o["rank"] != r["rank"]][0]
        assert torch.equal(r["moms"][expert], twin["moms"][expert])


@pytest.mark.parametrize("kw,words", [
    ({"stage": 2}, "zero.stage=2 is not supported"),
    ({"stage": 3}, "zero.stage=3 is not supported"),
    ({"dtype": "fp16"}, "fp16 is not supported"),
    ({"clip_grad_norm": 1.0}, "clip_grad_norm=1.0 is not supported"),
    ({"stage": 1, "quantize_gradients": "int8"}, "zero.quantize_gradients=int8 is not supported"),
])
def test_refusals(kw: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        zero.initialize(build(seed=0), OneBitAdam(warmup_steps=2, **HYPER), zero.ZeroConfig(**kw))
    with pytest.raises(ValueError, match="warmup_steps=0 must be"):
        OneBitAdam(warmup_steps=0)
    with pytest.raises(ValueError, match="multiple of 8"):
        OneBitAdam(warmup_steps=1, block=12)
