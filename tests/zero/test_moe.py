"""MoE with expert parallelism (ep=2) under every ZeRO stage matches the single-process full model.

One step routes every token to experts 0-1, so the ranks holding experts 2-3 get no tokens: their
reductions must still run, in the same order, with zero gradients, and nothing may hang.
"""

from __future__ import annotations

import torch.distributed as dist

import zero
from tests.multirank import run_multirank
from tests.zero.models import (
    OPT,
    STARVE_STEP,
    assert_rank_mean_close,
    build_moe,
    global_batch,
    lm_loss,
    reference_losses,
    starve_last_experts,
)

STEPS, ROWS_PER_RANK = 8, 2


def _run(stages: list[int], ckpt: bool) -> dict:
    from moe import GroupedExperts, MoELayer, apply_expert_parallel

    rank, world = dist.get_rank(), dist.get_world_size()
    dims = zero.ParallelDims(dp=world, ep=2)
    out, starved = {}, []
    for stage in stages:
        model = apply_expert_parallel(build_moe(seed=0, ckpt=ckpt), dims.ep_group)
        config = zero.ZeroConfig(stage=stage, clip_grad_norm=0.5, reduce_bucket_size=500)
        engine = zero.initialize(model, OPT, config, dims)
        # Stages 0-1 keep .grad preset to flat-buffer views: experts add their weight gradients in place.
        fused = {m.fuse_grad_accumulation for m in engine.module.modules() if isinstance(m, GroupedExperts)}
        assert fused == {stage < 2}
        losses = []
        for step in range(STEPS):
            starve_last_experts(engine.module, step)
            rows = global_batch(step, 0, ROWS_PER_RANK * world)[
                rank * ROWS_PER_RANK : (rank + 1) * ROWS_PER_RANK
            ]
            loss = lm_loss(engine, rows)
            engine.backward(loss)
            assert engine.step()
            losses.append(loss.item())
            if step == STARVE_STEP:  # the starvation really happened on the ranks holding experts 2-3
                local = [
                    m.last_stats["tokens_per_local_expert"]
                    for m in engine.module.modules()
                    if isinstance(m, MoELayer)
                ]
                starved.append(all(int(c.sum()) == 0 for c in local))
        out[stage] = losses
    out["starved"] = starved
    return out


def _check(results: list[dict], world: int, ckpt: bool) -> None:
    ref = reference_losses(
        {"ckpt": ckpt},
        STEPS,
        ROWS_PER_RANK * world,
        clip=0.5,
        model_fn=build_moe,
        before_step=starve_last_experts,
    )
    ep_ranks = [r % 2 for r in range(world)]
    assert [all(r["starved"]) for r in results] == [e == 1 for e in ep_ranks]
    for stage in (k for k in results[0] if k != "starved"):
        assert_rank_mean_close(results, stage, ref, world)


def test_moe_ep2_two_ranks_all_stages() -> None:
    _check(run_multirank(_run, 2, [0, 1, 2, 3], False), 2, False)


def test_moe_ep2_four_ranks_sharded_experts_with_checkpointing() -> None:
    # dp=4, ep=2: expert parameters are sharded over an expert-data-parallel group of 2.
    _check(run_multirank(_run, 4, [1, 3], True), 4, True)
