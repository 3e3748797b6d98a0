"""ZeRO stages 0-3 on 2 and 4 gloo ranks reproduce the single-process trajectory: losses, global
gradient norms and every parameter on every rank after the first SGD step (the gradient itself) and at
the end (`tests.equivalence`)."""

from __future__ import annotations

import torch.distributed as dist

import zero
from tests.equivalence import Recorder, assert_equivalent
from tests.multirank import run_multirank
from tests.zero.models import SGD, build, global_batch, lm_loss, reference

STEPS, ROWS_PER_RANK = 4, 2

CASES = {
    "plain": dict(model={}, accum=1, clip=None),
    "accum_clip": dict(model={}, accum=2, clip=0.05),
    "tied": dict(model={"tie": True}, accum=1, clip=0.05),
    "ckpt_reuse": dict(model={"ckpt": True, "reuse_block": True}, accum=2, clip=None),
    # the reused block's gradient arrives twice (inner checkpoint backward and outer graph)
    "reentrant_reuse": dict(model={"ckpt": "reentrant", "reuse_block": True}, accum=1, clip=0.05),
    "tied_accum_clip": dict(model={"tie": True}, accum=2, clip=0.05),
}


def _train(case: dict, stage: int, world: int, rank: int, **cfg) -> dict:
    # Each rank starts from a different init: the engine must broadcast rank 0's values.
    model = build(seed=rank, **case["model"])
    config = zero.ZeroConfig(
        stage=stage,
        grad_accum_steps=case["accum"],
        clip_grad_norm=case["clip"],
        reduce_bucket_size=300,
        **cfg,
    )
    dims = zero.ParallelDims(dp=world)
    engine = zero.initialize(model, SGD, config, dims)
    record = Recorder(engine, dims.dp_group)
    for step in range(STEPS):
        total = 0.0
        for micro in range(case["accum"]):
            rows = global_batch(step, micro, ROWS_PER_RANK * world)[
                rank * ROWS_PER_RANK : (rank + 1) * ROWS_PER_RANK
            ]
            loss = lm_loss(engine, rows)
            engine.backward(loss)
            total += loss.item() / case["accum"]
            stepped = engine.step()
            assert stepped == (micro == case["accum"] - 1)
        record.step(total)
    return record.result()


def _run_stages(stages: list[int], cases: list[str]) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    return {(s, c): _train(CASES[c], s, world, rank) for s in stages for c in cases}


def _check(results: list[dict], world: int, expected: int) -> None:
    assert len(results) == world and len(results[0]) == expected
    for key in results[0]:
        case = CASES[key[1]]
        ref = reference(case["model"], STEPS, ROWS_PER_RANK * world, case["accum"], case["clip"])
        assert_equivalent([r[key] for r in results], ref, label=f"stage {key[0]} {key[1]}")


def test_stage0_two_ranks_first_then_1_2_3() -> None:
    cases = ["plain", "accum_clip", "tied", "ckpt_reuse", "reentrant_reuse"]
    _check(run_multirank(_run_stages, 2, [0, 1, 2, 3], cases), 2, 4 * len(cases))


def test_all_stages_four_ranks() -> None:
    _check(run_multirank(_run_stages, 4, [0, 1, 2, 3], ["tied_accum_clip"]), 4, 4)


def _train_without_dims() -> dict:
    """What a user writes under torchrun: no ParallelDims at all."""
    rank, world = dist.get_rank(), dist.get_world_size()
    engine = zero.initialize(build(seed=rank), SGD, zero.ZeroConfig(stage=2))
    assert engine.dims.dp == world
    record = Recorder(engine, engine.dims.dp_group)
    for step in range(4):
        loss = lm_loss(engine, global_batch(step, 0, ROWS_PER_RANK * world)[rank * ROWS_PER_RANK :][:ROWS_PER_RANK])
        engine.backward(loss)
        engine.step()
        record.step(loss.item())
    return record.result()


def test_initialize_without_dims_trains_data_parallel() -> None:
    results = run_multirank(_train_without_dims, 2)
    assert_equivalent(results, reference({}, 4, ROWS_PER_RANK * 2))
