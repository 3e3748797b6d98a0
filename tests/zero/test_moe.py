"""MoE with expert parallelism (ep=2) under every ZeRO stage matches the single-process full model:
losses, gradient norms and every expert slice and replica on every rank (`tests.equivalence`).

One step routes every token to experts 0-1, so the ranks holding experts 2-3 get no tokens: their
reductions must still run, in the same order, with zero gradients, and nothing may hang.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

import zero
from tests.equivalence import Recorder, assert_equivalent
from tests.multirank import run_multirank
from tests.zero.models import SGD, STARVE_STEP, build_moe, global_batch, lm_loss, reference, starve_last_experts

STEPS, ROWS_PER_RANK = 8, 2


def _run(stages: list[int], ckpt: bool) -> dict:
    from moe import GroupedExperts, MoELayer, apply_expert_parallel

    rank, world = dist.get_rank(), dist.get_world_size()
    dims = zero.ParallelDims(dp=world, ep=2)
    out, starved = {}, []
    for stage in stages:
        model = build_moe(seed=0, ckpt=ckpt)
        ep = apply_expert_parallel(model, dims)
        config = zero.ZeroConfig(stage=stage, clip_grad_norm=0.5, reduce_bucket_size=500)
        engine = zero.initialize(model, SGD, config, dims, plans=[ep])
        # Stages 0-1 keep .grad preset to flat-buffer views: the plan lets experts add their weight
        # gradients in place there.
        assert engine.grads_accumulate_in_place == (stage < 2)
        fused = {m.fuse_grad_accumulation for m in engine.module.modules() if isinstance(m, GroupedExperts)}
        assert fused == {stage < 2}
        record = Recorder(engine, dims.dp_group)
        for step in range(STEPS):
            starve_last_experts(engine.module, step)
            rows = global_batch(step, 0, ROWS_PER_RANK * world)[
                rank * ROWS_PER_RANK : (rank + 1) * ROWS_PER_RANK
            ]
            loss = lm_loss(engine, rows)
            engine.backward(loss)
            assert engine.step()
            record.step(loss.item())
            if step == STARVE_STEP:  # the starvation really happened on the ranks holding experts 2-3
                local = [
                    m.last_stats["tokens_per_local_expert"]
                    for m in engine.module.modules()
                    if isinstance(m, MoELayer)
                ]
                starved.append(all(int(c.sum()) == 0 for c in local))
        out[stage] = record.result()
    out["starved"] = starved
    return out


def _check(results: list[dict], world: int, ckpt: bool, stages: list[int]) -> None:
    ref = reference(
        {"ckpt": ckpt},
        STEPS,
        ROWS_PER_RANK * world,
        clip=0.5,
        model_fn=build_moe,
        before_step=starve_last_experts,
    )
    ep_ranks = [r % 2 for r in range(world)]
    assert all(len(r["starved"]) == len(stages) for r in results)
    assert [all(r["starved"]) for r in results] == [e == 1 for e in ep_ranks]
    assert sorted(k for k in results[0] if k != "starved") == stages
    for stage in stages:
        assert_equivalent([r[stage] for r in results], ref, label=f"ep=2 dp={world} stage {stage}")


def test_moe_ep2_two_ranks_all_stages() -> None:
    _check(run_multirank(_run, 2, [0, 1, 2, 3], False), 2, False, [0, 1, 2, 3])


def test_moe_ep2_four_ranks_sharded_experts_with_checkpointing() -> None:
    # dp=4, ep=2: expert parameters are sharded over an expert-data-parallel group of 2.
    _check(run_multirank(_run, 4, [1, 3], True), 4, True, [1, 3])


# ---------------------------------------------------------------------------- balancing losses in fp16
ACCUM = 2
BALANCING = {"on": {"aux_loss_coef": 0.01, "z_loss_coef": 0.001}, "off": {"aux_loss_coef": 0.0, "z_loss_coef": 0.0}}


def _router_grads(dtype: str, balancing: str, stage: int) -> dict:
    """The mean gradient of every router after one step of SGD(lr=1): the change of its fp32 master."""
    from moe import apply_expert_parallel

    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_moe(seed=0, **BALANCING[balancing])
    config = zero.ZeroConfig(stage=stage, dtype=dtype, grad_accum_steps=ACCUM, initial_loss_scale=1024.0)
    dims = zero.ParallelDims(dp=world)
    engine = zero.initialize(model, functools.partial(torch.optim.SGD, lr=1.0), config, dims,
                             plans=[apply_expert_parallel(model, dims)])
    before = engine.full_state_dict()
    for micro in range(ACCUM):
        rows = global_batch(0, micro, ROWS_PER_RANK * world)[rank * ROWS_PER_RANK : (rank + 1) * ROWS_PER_RANK]
        engine.backward(lm_loss(engine, rows))
    assert engine.step(), "the step was skipped (fp16 overflow)"
    after = engine.full_state_dict()
    return {"scale": engine.loss_scale, **{k: before[k] - after[k] for k in before if k.endswith("router.weight")}}


def _balancing_runs() -> dict:
    return {(dtype, bal, stage): _router_grads(dtype, bal, stage)
            for dtype in ("fp32", "fp16") for bal in ("on", "off") for stage in (1, 2)}


def test_balancing_loss_gradients_survive_fp16_loss_scaling() -> None:
    """dp=2, grad_accum=2, fp16 loss scale 1024: router gradients equal fp32's, aux and z terms included."""
    runs = run_multirank(_balancing_runs, 2)[0]
    for stage in (1, 2):
        assert runs[("fp16", "on", stage)]["scale"] == 1024.0
        keys = [k for k in runs[("fp32", "on", stage)] if k != "scale"]
        assert len(keys) == 2
        for k in keys:
            ref, half = runs[("fp32", "on", stage)][k], runs[("fp16", "on", stage)][k]
            without = runs[("fp32", "off", stage)][k]
            size = ref.norm().item()
            # fp16 matches fp32 to fp16 precision ...
            assert (half - ref).norm().item() < 1e-2 * size, (stage, k)
            # ... and that is a real test: at the default coefficients the balancing losses make up most
            # of a router's gradient at initialisation (the language-model loss adds the rest).
            assert (without - ref).norm().item() > 0.2 * size, (stage, k)
            assert (runs[("fp16", "off", stage)][k] - without).norm().item() < 1e-2 * without.norm().item()
