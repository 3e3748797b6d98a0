"""Quantized ZeRO-3 collectives (zero.quantize_weights / quantize_gradients / hpz_partition_size): the codecs'
error bounds, the collectives against one-process references (round trips of each chunk) bitwise (with exact byte counts), and the
engine against a plain engine given the decoded weights: the same losses and local gradients bitwise, every
quantized reduction equal to the simulation of the ranks' own gradients, at 2 and 4 ranks, dense and with
ep=2, with and without hpZ; and the refusals."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zero
import zero.sharding.optimizer as reducer_module
from tests.multirank import run_multirank
from tests.zero.models import SGD, build, build_moe, global_batch, lm_loss
from zero.dist import comm, quantized

BLOCK = 16
ROWS = 2


# ---------------------------------------------------------------------------------------- codecs
@pytest.mark.parametrize("codec,levels", [("int8", 127), ("int4", 7)])
def test_codec_error_is_at_most_half_a_step(codec: str, levels: int) -> None:
    x = torch.randn(4, 64) * torch.tensor([1e-3, 1.0, 30.0, 0.0])[:, None]
    payload = quantized.encode(x, codec, BLOCK)
    assert payload.shape == (4, quantized.payload_bytes(64, codec, BLOCK))
    assert quantized.payload_bytes(64, codec, BLOCK) == (64 if codec == "int8" else 32) + 4 * 4
    y = quantized.decode(payload, 64, codec, BLOCK)
    step = x.view(4, 4, BLOCK).abs().amax(-1, keepdim=True) / levels
    assert ((y - x).view(4, 4, BLOCK).abs() <= step / 2 * (1 + 1e-6)).all()
    assert torch.equal(y[3], torch.zeros(64))  # an all-zero block decodes to zeros
    # the largest value of each block is exact up to fp32 rounding
    top = x.view(4, 4, BLOCK).abs().argmax(-1, keepdim=True)
    torch.testing.assert_close(y.view(4, 4, BLOCK).gather(-1, top), x.view(4, 4, BLOCK).gather(-1, top))


def test_round_trip_pads_a_partial_block() -> None:
    x = torch.randn(21)
    y = quantized.round_trip(x, "int4", BLOCK)
    assert y.shape == (21,)
    padded = torch.cat([x, torch.zeros(11)])
    assert torch.equal(y, quantized.decode(quantized.encode(padded, "int4", BLOCK), 32, "int4", BLOCK)[:21])


# ---------------------------------------------------------------------------------------- collectives
def gather_reference(shards: list[torch.Tensor], codec: str) -> torch.Tensor:
    """What a quantized all-gather hands every rank: each shard's round trip, fp32."""
    return torch.cat([quantized.round_trip(s.float(), codec, BLOCK) for s in shards])


def reduce_reference(flats: list[torch.Tensor], codec: str) -> list[torch.Tensor]:
    """What a quantized reduce-scatter leaves on each rank j: the round trips of every rank's chunk j, added in
    rank order in fp32."""
    world = len(flats)
    out = []
    for j in range(world):
        chunks = [quantized.round_trip(f.float().view(world, -1)[j], codec, BLOCK) for f in flats]
        total = chunks[0].clone()
        for c in chunks[1:]:
            total += c
        out.append(total)
    return out


def _collectives(m: int, codec: str, async_op: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(7 + rank)
    shard = torch.randn(m, generator=g)
    flat = torch.randn(world * m, generator=g) * (rank + 1)
    full, out = torch.empty(world * m), torch.empty(m)
    with comm.counting() as stats:
        for handle in (quantized.all_gather(full, shard, dist.group.WORLD, codec, BLOCK, async_op=async_op),
                       quantized.reduce_scatter(out, flat, dist.group.WORLD, codec, BLOCK, async_op=async_op)):
            if handle is not None:
                handle.wait()
                handle.wait()  # a second wait decodes nothing twice
        sent = dict(stats.bytes)
    return {"shard": shard, "flat": flat, "full": full, "out": out, "sent": sent}


@pytest.mark.parametrize("world,codec,async_op", [(2, "int8", False), (2, "int4", True), (4, "int4", False),
                                                  pytest.param(4, "int8", True, marks=pytest.mark.slow)])
def test_collectives_equal_reference_bitwise(world: int, codec: str, async_op: bool) -> None:
    m = 37  # not a multiple of the block: every chunk padded
    got = run_multirank(_collectives, world, m, codec, async_op)
    full = gather_reference([r["shard"] for r in got], codec)
    sums = reduce_reference([r["flat"] for r in got], codec)
    payload = quantized.payload_bytes(quantized.padded_length(m, BLOCK), codec, BLOCK)
    for r in range(world):
        assert torch.equal(got[r]["full"], full)
        assert torch.equal(got[r]["out"], sums[r])
        assert got[r]["sent"] == {"all_gather": (world - 1) * payload, "all_to_all": (world - 1) * payload}
    # and they are what they claim: close to the exact collectives
    exact = torch.stack([r["flat"] for r in got]).sum(0).view(world, m)
    scale = torch.stack([r["flat"] for r in got]).abs().max()
    assert (torch.stack(sums) - exact).abs().max() <= world * scale / (254 if codec == "int8" else 14)


# ---------------------------------------------------------------------------------------- the engine
def _rows(step: int, rank: int, world: int) -> torch.Tensor:
    return global_batch(step, 0, ROWS * world)[rank * ROWS : (rank + 1) * ROWS]


def _decoded_state(engine, state: dict[str, torch.Tensor], codec: str) -> dict[str, torch.Tensor]:
    """`state` (full_state_dict) with every stage-3 gathered bucket's values as a quantized gather leaves them."""
    out = dict(state)
    for b in engine.buckets:
        if b.resident or b.world == 1:
            continue
        flat = torch.zeros(b.padded)
        for n, o, k in zip(b.names, b.offsets, b.numels):
            flat[o : o + k] = state[n].reshape(-1).float()
        flat = gather_reference(list(flat.view(b.world, -1)), codec)
        for n, o, k in zip(b.names, b.offsets, b.numels):
            out[n] = flat[o : o + k].view(state[n].shape).to(state[n].dtype)
    return out


class _Recorder:
    """Wraps the reducers' `_reduce`: what each bucket sent into its reduction and what came out."""

    def __init__(self) -> None:
        self.calls: list = []
        self.inner = reducer_module._reduce

    def __call__(self, bucket, flat, async_op):
        out, handle = self.inner(bucket, flat, async_op)
        self.calls.append((bucket, flat.detach().clone(), out))
        return out, handle


def _train_pair(moe: bool, weights: str, grads: str, hpz: int, steps: int) -> dict:
    """Engine A (quantized) against engine B (plain, same layout) loaded with the weights A gathers."""
    from moe import apply_expert_parallel

    rank, world = dist.get_rank(), dist.get_world_size()
    dims = zero.ParallelDims(dp=world, ep=2 if moe else 1)

    def make(**quant):
        model = build_moe(seed=0) if moe else build(seed=0)
        plans = [apply_expert_parallel(model, dims)] if moe else []
        config = zero.ZeroConfig(stage=3, quantize_block=BLOCK, prefetch_depth=1, **quant)
        return zero.initialize(model, SGD, config, dims, plans=plans)

    a = make(quantize_weights=weights, quantize_gradients=grads, hpz_partition_size=hpz)
    b = make()
    out = {"losses": [], "checked": 0, "sent": [],
           "layout": [(x.padded, x.world, x.resident, x.trainable, x in a.stage3.unit_of, x.secondary_group is not None)
                      for x in a.buckets]}
    for step in range(steps):
        state = a.full_state_dict()
        b.load_full_state_dict(_decoded_state(a, state, weights) if weights != "none" else state)
        losses, flats = [], []
        for engine in (a, b):
            recorder = _Recorder()
            reducer_module._reduce = recorder
            try:
                with comm.counting() as stats:
                    loss = lm_loss(engine, _rows(step, rank, world))
                    engine.backward(loss)
                    sent = dict(stats.bytes)
            finally:
                reducer_module._reduce = recorder.inner
            losses.append(loss.item())
            flats.append(recorder.calls)
            if engine is a:
                out["sent"].append(sent)
        assert losses[0] == losses[1], (step, losses)
        assert len(flats[0]) == len(flats[1])
        for (bucket, flat_a, got), (_, flat_b, _) in zip(*flats):
            assert torch.equal(flat_a, flat_b), "the local gradients differ from the plain engine's"
            if grads != "none" and bucket.world > 1:  # the reduction: the simulation of every rank's gradient
                group = bucket.grad_group
                every = [torch.empty_like(flat_a) for _ in range(bucket.world)]
                dist.all_gather(every, flat_a, group=group)
                want = reduce_reference(every, grads)[dist.get_rank(group)]
                assert torch.equal(got, want), "the quantized reduce-scatter differs from its reference"
                out["checked"] += 1
        for engine in (a, b):
            assert engine.step()
        out["losses"].append(losses[0])
    out["final"] = a.full_state_dict()
    return out


def _expected_sent(layout, weights: str, grads: str, hpz: int) -> dict:
    """Bytes one rank sends in a step's parameter gathers and gradient all-to-alls."""
    gather = all_to_all = 0
    for padded, w, resident, trainable, unit, secondary in layout:
        if w == 1:
            continue
        chunk = quantized.padded_length(padded // w, BLOCK)
        payload = quantized.payload_bytes(chunk, weights, BLOCK) if weights != "none" else 4 * (padded // w)
        if not resident:
            gather += (w - 1) * payload  # forward (the root stays gathered until the end of backward)
        if unit:  # backward: inside the hpZ group from the forward's decoded values (fp32), else as forward
            gather += (hpz - 1) * (padded // hpz) * 4 if secondary else (w - 1) * payload
        if trainable and grads != "none":
            all_to_all += (w - 1) * quantized.payload_bytes(chunk, grads, BLOCK)
    return {"all_gather": gather, "all_to_all": all_to_all}


@pytest.mark.parametrize("world,moe,weights,grads,hpz", [
    (2, False, "int8", "int4", 1),
    (4, False, "int8", "int8", 2),
    pytest.param(4, True, "int8", "int4", 1, marks=pytest.mark.slow),  # ep=2 (suite time: run with -m slow)
])
def test_engine_equals_plain_engine_on_decoded_weights(world: int, moe: bool, weights: str, grads: str,
                                                       hpz: int) -> None:
    got = run_multirank(_train_pair, world, moe, weights, grads, hpz, 2, timeout=300)
    for r in got:
        assert r["checked"] > 0
    if not moe:  # the root's buckets gather once a step, the units twice: every byte accounted for
        for r in got:
            want = _expected_sent(r["layout"], weights, grads, hpz)
            for sent in r["sent"]:
                assert {k: sent.get(k, 0) for k in want} == want, (sent, want)
    # the trained weights are the same on every rank of a data-parallel group
    for k, v in got[0]["final"].items():
        if "experts" not in k:
            assert all(torch.equal(v, r["final"][k]) for r in got), k


def _hpz_runs(steps: int, ckpt: bool | str) -> list:
    out = []
    for hpz in (1, 2):
        config = zero.ZeroConfig(stage=3, quantize_weights="int8", quantize_block=BLOCK, hpz_partition_size=hpz)
        engine = zero.initialize(build(seed=0, ckpt=ckpt), SGD, config, zero.ParallelDims(dp=dist.get_world_size()))
        losses = []
        for step in range(steps):
            with comm.counting() as stats:
                loss = lm_loss(engine, _rows(step, dist.get_rank(), dist.get_world_size()))
                engine.backward(loss)
                sent = dict(stats.bytes)
            engine.step()
            losses.append(loss.item())
        kept = [b.secondary for b in engine.buckets]
        layout = [(b.padded, b.world, b.resident, b.trainable, b in engine.stage3.unit_of,
                   b.secondary_group is not None) for b in engine.buckets]
        out.append((losses, engine.full_state_dict(), kept, sent, layout))
    return out


@pytest.mark.parametrize("ckpt", [True, pytest.param("reentrant", marks=pytest.mark.slow)])
def test_hpz_changes_no_value_and_keeps_nothing_after_the_step(ckpt) -> None:
    """hpZ (2 nodes of 2 ranks) with activation checkpointing (non-reentrant, and torch's reentrant one, whose
    forward runs without gradients) over 3 steps: bitwise the run without it, so backward never computed with a
    stale or differently rounded secondary copy; every unit's backward re-gather came from the copies inside the
    node (the bytes say so), and no copy is left after the step."""
    for (plain, hpz) in run_multirank(_hpz_runs, 4, 3, ckpt):
        assert plain[0] == hpz[0]
        assert all(torch.equal(plain[1][k], hpz[1][k]) for k in plain[1])
        assert all(s is None for s in hpz[2])
        assert sum(secondary for *_, secondary in hpz[4]) == 3  # the three blocks
        assert hpz[3]["all_gather"] == _expected_sent(hpz[4], "int8", "none", 2)["all_gather"]


def _secondary_ranks(ep: int, node: int) -> dict:
    from moe import apply_expert_parallel

    dims = zero.ParallelDims(dp=dist.get_world_size(), ep=ep)
    model = build_moe(seed=0)
    config = zero.ZeroConfig(stage=3, quantize_weights="int8", quantize_block=BLOCK, hpz_partition_size=node)
    engine = zero.initialize(model, SGD, config, dims, plans=[apply_expert_parallel(model, dims)])
    return {b.reduce_group: None if b.secondary_group is None else dist.get_process_group_ranks(b.secondary_group)
            for b in engine.buckets if b in engine.stage3.unit_of}


@pytest.mark.slow  # (suite time: 4 ranks with ep=2, ~14 s)
def test_hpz_groups_are_the_gather_groups_ranks_on_each_node() -> None:
    """4 ranks, ep=2, nodes of 2: the dense group keeps copies inside each node; the expert-data-parallel groups
    ([0, 2], [1, 3]) have one rank per node and keep none; nodes of 4 hold whole groups: no copy anywhere."""
    got = run_multirank(_secondary_ranks, 4, 2, 2)
    for rank, groups in enumerate(got):
        dense, experts = (groups[k] for k in sorted(groups))  # "dense" sorts before the expert group's name
        assert dense == ([0, 1] if rank < 2 else [2, 3]) and experts is None, groups
    assert all(v is None for groups in run_multirank(_secondary_ranks, 4, 2, 4) for v in groups.values())


# ---------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("kw,words", [
    ({"stage": 2, "quantize_weights": "int8"}, "needs zero.stage=3"),
    ({"stage": 0, "quantize_gradients": "int8"}, "needs zero.stage >= 1"),
    ({"stage": 3, "quantize_weights": "int4"}, "quantize_weights='int4' is invalid"),
    ({"stage": 3, "quantize_gradients": "fp8"}, "quantize_gradients='fp8' is invalid"),
    ({"stage": 3, "quantize_block": 12}, "multiple of 8"),
    ({"stage": 2, "hpz_partition_size": 2}, "hpz_partition_size=2 needs zero.stage=3"),
])
def test_bad_quantization_settings_are_refused(kw: dict, words: str) -> None:
    with pytest.raises(zero.ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        zero.ZeroConfig(**kw)


def _hpz_not_dividing() -> str:
    config = zero.ZeroConfig(stage=3, hpz_partition_size=4)  # nodes of 4 on 2 processes
    try:
        zero.initialize(build(seed=0), SGD, config, zero.ParallelDims(dp=2))
    except zero.LayoutError as e:
        return str(e)
    return "no error"


def test_hpz_that_does_not_divide_the_group_is_refused() -> None:
    assert run_multirank(_hpz_not_dividing, 2)[0] == ("zero.hpz_partition_size=4 does not divide the 2 process(es): set "
                                                      "it to the devices per node")
