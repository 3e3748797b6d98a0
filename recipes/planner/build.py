"""One rank's part of a run, built from the runtime's own objects on the meta device under a fake process group.

`rank_model` builds the recipe's model on the meta device (its family's spec) and parallelises it with the recipe's
own `recipes.parallelize` for one rank of a world that exists only as torch's fake process group (collectives do
nothing; `zero.dist.comm` still counts them). `bucket_specs` lays that rank's parameters out with the engine's own
bucket policy (`zero.sharding.policy.module_bucket_layout`, given the plans the engine would get) without allocating
them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from moe_lst.models import spec as families
from omegaconf import DictConfig

import zero
from zero.sharding.policy import BucketSpec, Layout, module_bucket_layout

__all__ = ["BucketSpec", "Layout", "RankModel", "bucket_specs", "fake_world", "gradient_passes", "rank_model",
           "zero_config"]

ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}


@contextlib.contextmanager
def fake_world(world: int, rank: int) -> Iterator[None]:
    """torch.distributed initialised as a fake world of `world` ranks in which this process is `rank`."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("the planner builds ranks under a fake process group of its own: call it from a process "
                           "without torch.distributed initialised (e.g. python -m recipes.plan)")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


@dataclass
class RankModel:
    """The model as one rank holds it: `module` (its pipeline stages under pp), the plans, the dims."""

    dims: zero.ParallelDims
    model: nn.Module  # the whole model with ep / tp / sp applied (before the pipeline split)
    module: nn.Module  # what the engine wraps: `model`, or this rank's stages
    plan: zero.Plan
    stage_layers: list[int]  # the block indices this rank runs
    first: bool
    last: bool
    stages: int = 1  # pipeline stages per rank
    pipe: object = None  # this rank's zero.parallel.pipeline.Pipeline under pp


def rank_model(cfg: DictConfig, rank: int) -> RankModel:
    """Build rank `rank`'s model (call inside `fake_world`)."""
    from recipes.parallelize import parallelize

    family = families.get(cfg)
    family.check_plannable(cfg)
    dims = zero.ParallelDims(**{k: cfg.parallel[k] for k in ("dp", "tp", "pp", "sp", "ep", "cp")})
    with torch.device("meta"):
        model = family.shape_model(cfg, dims)
    parallel = parallelize(model, cfg, dims)  # (the recipe's: the model predicted is the one that trains)
    layers = list(range(family.num_layers(cfg)))
    out = RankModel(dims, model, model, None, layers, True, True)
    pipe = parallel.pipe
    if pipe is not None:
        out.module = pipe.module
        out.stage_layers = sorted(i for span in pipe.spans for i in span.layers)
        out.first = any(span.first for span in pipe.spans)
        out.last = any(span.last for span in pipe.spans)
        out.stages = len(pipe.spans)
        out.pipe = pipe
    out.plan = zero.Plan.merge(parallel.plans)
    return out


def zero_config(cfg: DictConfig) -> zero.ZeroConfig:
    """The runtime settings of the recipe's zero section that the planner's layout and trace depend on."""
    keys = ("stage", "dtype", "reduce_bucket_size", "param_persistence_threshold", "stage3_unit_classes",
            "prefetch_depth", "hpz_partition_size")
    return zero.ZeroConfig(**{k: v for k, v in cfg.zero.items() if k in keys})


def bucket_specs(rm: RankModel, config: zero.ZeroConfig) -> Layout:
    """The engine's buckets for this rank (same order, sizes, groups), nothing allocated: the engine's own policy
    applied to this rank's module and plans."""
    return module_bucket_layout(rm.module, rm.plan, rm.dims, config)


def gradient_passes(rm: RankModel, cfg: DictConfig) -> list[int] | None:
    """The stage of each gradient-producing pass (full or weight backward) this rank runs per step, in the
    order of the schedule's own action list (torch's pipeline_order, built by the Pipeline on meta tensors);
    None for single-stage schedules, whose passes are one per micro-batch."""
    import types

    if rm.pipe is None or rm.stages == 1:
        return None
    m = cfg.train.grad_accum
    dims = rm.dims
    engine = types.SimpleNamespace(config=types.SimpleNamespace(grad_accum_steps=m, torch_dtype=torch.float32),
                                   device=torch.device("meta"))
    b = cfg.train.micro_batch_size
    rm.pipe._build(engine, torch.zeros(m * b, -(-cfg.train.seq_len // dims.sp), dtype=torch.long, device="meta"))
    actions = rm.pipe._schedule.pipeline_order[dims.coordinate()["pp"]]
    kinds = {"FULL_BACKWARD", "BACKWARD_WEIGHT"}
    return [a.stage_index for a in actions if a is not None and a.computation_type.name in kinds]
