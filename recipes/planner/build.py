"""One rank's part of a run, built from the runtime's own objects on the meta device under a fake process group.

`rank_model` builds the recipe's model on the meta device and applies expert, tensor, sequence and pipeline
parallelism with the recipe's own `apply_*` functions for one rank of a world that exists only as
torch's fake process group (collectives do nothing; `zero.dist.comm` still counts them). `bucket_specs`
lays that rank's parameters out as the engine would (`zero.engine.Engine._make_buckets` / `_build_stage3`,
with the runtime's own `split_into_buckets`, `find_units` and `assign_parameters`) without allocating them.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from omegaconf import DictConfig

import zero
from recipes.config import is_hf, is_moe, model_config
from zero.sharding import stage3
from zero.sharding.buckets import split_into_buckets
from zero.sharding.stage3 import assign_parameters, find_units

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
    from moe import MoELayer, apply_expert_parallel
    from recipes.losses import logits_loss
    from recipes.models.llama import Transformer
    from sequence_parallel import apply_activation_checkpointing, apply_tiled_mlp, apply_ulysses
    from zero.parallel.pipeline import apply_pipeline
    from zero.parallel.tensor import apply_tensor_parallel

    if is_hf(cfg):
        raise NotImplementedError("the planner covers the project's Llama family (model=hf is not planned yet)")
    dims = zero.ParallelDims(**{k: cfg.parallel[k] for k in ("dp", "tp", "pp", "sp", "ep")})
    with torch.device("meta"):
        model = Transformer(model_config(cfg), device="meta")
    plans = [apply_expert_parallel(model, dims)] if is_moe(cfg) else []
    plans.append(apply_tensor_parallel(model, dims.tp_group))
    apply_ulysses(model, dims.sp_group)
    if cfg.train.tiled_mlp:
        apply_tiled_mlp(model, num_tiles=cfg.train.tiled_mlp, exclude=(MoELayer,))
    if cfg.train.activation_checkpointing:
        apply_activation_checkpointing(model, offload=cfg.train.offload_activations)
    layers = list(range(cfg.model.n_layers))
    out = RankModel(dims, model, model, None, layers, True, True)
    if dims.pp > 1:
        p = cfg.parallel
        pipe = apply_pipeline(model, dims, p.pp_schedule, microbatches=cfg.train.grad_accum,
                              loss_fn=functools.partial(logits_loss, dims=dims), virtual_stages=p.pp_virtual_stages,
                              split=None if p.pp_split is None else list(p.pp_split))
        plans.append(pipe)
        out.module = pipe.module
        out.stage_layers = sorted(i for plan in pipe.plans for i in plan.layers)
        out.first = any(plan.first for plan in pipe.plans)
        out.last = any(plan.last for plan in pipe.plans)
        out.stages = len(pipe.plans)
        out.pipe = pipe
    out.plan = zero.Plan.merge(plans)
    return out


@dataclass
class BucketSpec:
    """One flat bucket as the engine builds it, sizes only: `world` ranks share it (1 when unsharded)."""

    names: list[str]
    numel: int
    world: int
    group: int  # ranks of its reduction group (gradients reduce over them, parameters gather over them)
    reduce_group: str
    trainable: bool
    resident: bool
    role: str  # "flat" (stages 0-2), "unit" / "root" / "persistent" (stage 3)
    unit: int | None = None
    tie_group: int = 1  # ranks holding a copy (a pipeline's tied embedding and head)
    replicas: int = 1
    secondary: int = 0  # hpZ: ranks of its gather group on this rank's node keeping a secondary copy (0: none)

    @property
    def padded(self) -> int:
        return math.ceil(self.numel / self.world) * self.world

    @property
    def shard(self) -> int:
        return self.padded // self.world


@dataclass
class Layout:
    """The engine's buckets for one rank, in reduction order, with the sizes of the groups involved."""

    buckets: list[BucketSpec] = field(default_factory=list)
    units: int = 0


def _reductions(rm: RankModel) -> tuple[list[tuple[str, int]], dict[int, int]]:
    """(name, group size) of each reduction, default first, and the reduction owning each parameter."""
    dims = rm.dims
    in_model = {id(p) for p in rm.module.parameters()}
    sizes = {"expert": dims.edp}
    out, owner = [("dense", dims.dp_sp)], {}
    for k, rg in enumerate(rm.plan.reduce_groups, start=1):
        out.append((rg.name, sizes.get(rg.name, zero.dist.comm.group_size(rg.group))))
        for p in rg.params:
            if id(p) in in_model:
                owner[id(p)] = k
    return out, owner


def _make(named, reductions, owner, rm: RankModel, stage: int, resident: bool, role: str,
          max_numel: int | None, unit: int | None = None) -> list[BucketSpec]:
    """Mirror of Engine._make_buckets: split by (reduction, trainable, tp replicas, tied), cut at max_numel."""
    replicas = {id(p): k for p, k in rm.plan.replicated_params.items() if k > 1}
    tied = {id(p): g for p, g in rm.plan.tied_params.items() if g is not None}
    tie_order = {id(p): k for k, (_, p) in enumerate(sorted(named, key=lambda x: x[0]), 1) if id(p) in tied}

    def kind(p):
        return replicas.get(id(p), 1), tie_order.get(id(p), 0)

    out = []
    for k, (name, size) in enumerate(reductions):
        for trainable, (tp_replicas, tie) in itertools.product((True, False), sorted({kind(p) for _, p in named})):
            sel = [(n, p) for n, p in named if owner.get(id(p), 0) == k and p.requires_grad == trainable
                   and kind(p) == (tp_replicas, tie)]
            if not sel:
                continue
            for chunk in split_into_buckets(sel, max_numel or sum(p.numel() for _, p in sel)):
                tie_size = zero.dist.comm.group_size(tied[id(chunk[0][1])]) if tie else 1
                out.append(BucketSpec([n for n, _ in chunk], sum(p.numel() for _, p in chunk),
                                      size if stage >= 1 else 1, size, name, trainable, resident, role, unit,
                                      tie_size, tp_replicas * tie_size))
    return out


def _secondary(rm: RankModel, buckets: list[BucketSpec], node_size: int) -> None:
    """hpZ: the ranks of each unit bucket's gather group on this rank's node, as the engine's
    ParallelDims.secondary_groups forms them (zero.dist.topology.node_partition)."""
    from zero.dist.topology import node_partition

    dims, rank = rm.dims, dist.get_rank()
    if dims.world_size % node_size:
        raise ValueError(f"zero.hpz_partition_size={node_size} does not divide the world size {dims.world_size}")
    axes = {"dense": ("pp", "tp"), "expert": ("pp", "tp", "ep")}
    for b in buckets:
        if b.reduce_group not in axes:
            raise NotImplementedError(f"planning hpZ for the {b.reduce_group!r} reduce group is not implemented")
        parts = node_partition(dims.group_members(rank, axes[b.reduce_group]), node_size, b.reduce_group)
        b.secondary = next((len(p) for p in parts if rank in p), 0)


def bucket_specs(rm: RankModel, config: zero.ZeroConfig) -> Layout:
    """The engine's buckets for this rank (same order, sizes, groups), nothing allocated."""
    reductions, owner = _reductions(rm)
    module = rm.module
    if config.stage < 3:
        named = list(module.named_parameters())[::-1]
        return Layout(_make(named, reductions, owner, rm, config.stage, True, "flat", config.reduce_bucket_size))
    units = find_units(module, config.stage3_unit_classes)
    per_unit, root, persistent = assign_parameters(module, units, config.param_persistence_threshold)
    unit_buckets = [_make(params, reductions, owner, rm, 3, False, "unit", None, unit=i)
                    for i, params in enumerate(per_unit)]
    if config.hpz_partition_size > 1:
        _secondary(rm, [b for bl in unit_buckets for b in bl], config.hpz_partition_size)
    persistent_buckets = _make(persistent[::-1], reductions, owner, rm, 3, True, "persistent",
                               config.reduce_bucket_size)
    split_root = getattr(stage3, "split_root", None)
    if split_root is None:  # one root bucket per kind, reduced after the blocks
        root_buckets = _make(root, reductions, owner, rm, 3, False, "root", None)
        return Layout([b for bl in unit_buckets[::-1] for b in bl] + root_buckets + persistent_buckets, len(units))
    # the root cut at reduce_bucket_size, a head reduced before the blocks and an embedding after (the engine's
    # own split_root)
    late, early = ([b for group in part for b in _make(group, reductions, owner, rm, 3, False, "root",
                                                         config.reduce_bucket_size)]
                   for part in split_root(module, root, per_unit, config.reduce_bucket_size))
    buckets = late + [b for bl in unit_buckets[::-1] for b in bl] + early + persistent_buckets
    return Layout(buckets, len(units))


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
