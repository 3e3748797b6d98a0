"""The bucket policy (zero.sharding.policy): its order and cuts on hand-made parameter descriptions, and the planner's
layout equal to the buckets the engine builds (names, sizes, groups, roles, reduction order) on every rank of real
4-rank recipe layouts: MoE ep=2 at ZeRO-1 and at ZeRO-3 with hpZ, pp=2 (a tied embedding and head, meta-built),
tp=2 (replicated norms) and an MoE pipeline."""

from __future__ import annotations

import copy

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from recipes.config import CONFIG_DIR
from tests.multirank import run_multirank
from zero.sharding.policy import ParamSpec, Reduction, bucket_layout

WORLD = 4
TINY = ["model=tiny", "train.micro_batch_size=2", "train.seq_len=64"]
MOE = ["model=moe_tiny", "train.micro_batch_size=2", "train.seq_len=64"]
LAYOUTS = {
    # several flat buckets per reduction (the model has 300k parameters), the experts' over their 2 replicas
    "moe ep2 z1": MOE + ["parallel.dp=4", "parallel.ep=2", "zero.stage=1", "zero.reduce_bucket_size=20000"],
    # units, a root in two parts (the untied head reduced first), persistent norms, secondary partitions over
    # 2-rank nodes: the dense group's, none for the expert group (one rank per node)
    "moe ep2 z3 hpz": MOE + ["parallel.dp=4", "parallel.ep=2", "zero.stage=3", "zero.hpz_partition_size=2",
                             "zero.param_persistence_threshold=64", "zero.reduce_bucket_size=5000",
                             "model.tie_embeddings=false"],
    # the embedding and the head tied across the stages, built on the meta device
    "dense pp2 dp2 z3": TINY + ["parallel.dp=2", "parallel.pp=2", "train.grad_accum=2", "zero.stage=3"],
    "dense tp2 dp2 z1": TINY + ["parallel.dp=2", "parallel.tp=2", "zero.stage=1"],  # replicated norms
    # expert reduce groups that list the other stage's experts too
    "moe pp2 ep2 z1": MOE + ["parallel.dp=2", "parallel.pp=2", "parallel.ep=2", "train.grad_accum=2",
                             "zero.stage=1"],
}


def _config(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose("config", overrides=overrides)


def _engine_buckets(layouts: dict[str, DictConfig]) -> dict[str, list[tuple]]:
    """On each rank: every layout's engine, built by the recipe's own functions, and its flat buckets as built."""
    from recipes.pretrain import build_dims, build_engine, build_model
    from zero.dist.comm import group_size

    out = {}
    for name, composed in layouts.items():
        cfg = copy.deepcopy(composed)
        dims = build_dims(cfg)
        model, parallel = build_model(cfg, dims)
        engine = build_engine(cfg, model, dims, parallel)
        role = {}
        if engine.stage3 is not None:
            role.update({id(b): ("unit", i) for i, bl in enumerate(engine.stage3.unit_buckets) for b in bl})
            role.update({id(b): ("root", None) for b in engine.stage3.root_buckets})
        other = ("flat", None) if engine.config.stage < 3 else ("persistent", None)
        out[name] = [(tuple(b.names), tuple(b.numels), b.world, group_size(b.group), group_size(b.grad_group),
                      b.reduce_group, b.trainable, b.resident, *role.get(id(b), other),
                      b.replicas // (group_size(b.group) // b.world), group_size(b.tie_group),
                      0 if b.secondary_group is None else group_size(b.secondary_group))
                     for b in engine.buckets]  # in the order the reducer reduces them
        engine.close()
    return out


def _planned_buckets(composed: DictConfig, rank: int) -> list[tuple]:
    """Rank `rank`'s layout as the planner predicts it (its own model, plans and config, under its fake world)."""
    from recipes.planner.build import bucket_specs, fake_world, rank_model, zero_config

    cfg = copy.deepcopy(composed)
    with fake_world(WORLD, rank):
        layout = bucket_specs(rank_model(cfg, rank), zero_config(cfg))
    return [(tuple(b.names), tuple(b.numels), b.world, b.group, b.group, b.reduce_group, b.trainable, b.resident,
             b.role, b.unit, b.replicas, b.tie_group, b.secondary) for b in layout.buckets]


def test_planner_layout_is_the_engines_built_buckets():
    # Each layout's config composed once (Hydra's composition costs more than the rest of the test), a copy of it
    # for each engine and each of the planner's ranks.
    composed = {name: _config(overrides) for name, overrides in LAYOUTS.items()}
    built = run_multirank(_engine_buckets, WORLD, composed, timeout=300)
    for name, cfg in composed.items():
        for rank in range(WORLD):
            assert _planned_buckets(cfg, rank) == built[rank][name], f"{name}, rank {rank}"
    # the layouts exercise every part of the policy
    rows = [row for per_rank in built for layout in per_rank.values() for row in layout]
    assert {"flat", "unit", "root", "persistent"} <= {row[8] for row in rows}
    assert {"dense", "expert"} == {row[5] for row in rows}
    assert any(row[10] == 2 and row[11] == 1 for row in rows)  # tensor-parallel replicas
    assert any(row[11] == 2 for row in rows)  # a tied copy on the other pipeline stage
    assert any(row[12] == 2 for row in rows) and any(row[12] == 0 and row[8] == "unit" for row in rows)  # hpZ
    assert len([r for r in built[0]["moe ep2 z1"] if r[5] == "dense"]) > 2  # cut at reduce_bucket_size
    assert any(r[2] == 2 and r[5] == "expert" for r in built[0]["moe ep2 z1"])  # experts over their 2 replicas
    assert built[0]["moe ep2 z3 hpz"][0][:1] == (("output.weight",),)  # the head's reduction first


def _p(name: str, numel: int, **kw) -> ParamSpec:
    return ParamSpec(name, numel, True, **kw)


def test_stage3_reduction_order_and_cuts():
    # registration order: embedding, two units, a final norm (persistent) and a head; a tied parameter and an
    # expert reduction inside unit 1
    params = [_p("emb", 100), _p("u0.a", 10, unit=0), _p("u0.b", 20, unit=0), _p("u1.a", 10, unit=1),
              _p("u1.e", 40, unit=1, reduction=1), _p("u1.t", 30, unit=1, tie_ranks=2), _p("norm", 4, persistent=True),
              _p("head.a", 8), _p("head.b", 8), _p("head.c", 60)]
    reductions = [Reduction("dense", None, (0, 1, 2, 3)), Reduction("expert", None, (0, 2))]
    layout = bucket_layout(params, reductions, stage=3, reduce_bucket_size=40, units=2, hpz_partition_size=2,
                           rank=0)
    got = [(b.role, b.unit, b.names, b.reduce_group, b.world, b.tie_group, b.secondary) for b in layout.buckets]
    assert got == [
        # the root registered after the units, last first: head.c (>= a quarter of 40) alone, then head.b + head.a
        ("root", None, ["head.c"], "dense", 4, 1, 0), ("root", None, ["head.b", "head.a"], "dense", 4, 1, 0),
        # units last to first; in each the untied dense parameters, then each tied one alone, then the experts
        ("unit", 1, ["u1.a"], "dense", 4, 1, 2), ("unit", 1, ["u1.t"], "dense", 4, 2, 2),
        ("unit", 1, ["u1.e"], "expert", 2, 1, 0),
        ("unit", 0, ["u0.a", "u0.b"], "dense", 4, 1, 2),
        ("root", None, ["emb"], "dense", 4, 1, 0), ("persistent", None, ["norm"], "dense", 4, 1, 0)]
    assert [b.resident for b in layout.buckets] == [False] * 7 + [True]


@pytest.mark.parametrize("stage,world", [(0, 1), (1, 4)])
def test_flat_buckets_last_registered_first_cut_at_the_bucket_size(stage, world):
    # last registered first; a bucket takes parameters while they fit (b + a exactly), a larger one stands alone
    params = [_p("a", 10), _p("b", 20), _p("c", 10), _p("d", 10), _p("e", 35), ParamSpec("frozen", 5, False)]
    layout = bucket_layout(params, [Reduction("dense", None, (0, 1, 2, 3))], stage=stage, reduce_bucket_size=30)
    assert [(b.names, b.trainable, b.world, b.resident) for b in layout.buckets] == [
        (["e"], True, world, True), (["d", "c"], True, world, True), (["b", "a"], True, world, True),
        (["frozen"], False, world, True)]
