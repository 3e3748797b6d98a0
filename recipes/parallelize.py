"""The one place a model is parallelised: `parallelize(model, cfg, dims)` applies, from outside and in this order,
the model family's own plans, expert parallelism (when the model has MoE layers), tensor parallelism, Ulysses
sequence parallelism, MLP tiling, activation checkpointing and the pipeline split, and returns the plans the engine
takes. The recipe (recipes.pretrain.build_model), the planner's per-rank model (recipes.planner.build.rank_model) and
the multi-rank test harness (tests/parallel/harness.py) all call it, so the model the planner predicts and the tests
check is the one that trains."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from moe_lst.models import spec as families

import zero
from moe import MoELayer, apply_expert_parallel
from moe.layer import moe_layers
from recipes.losses import logits_loss
from sequence_parallel import apply_activation_checkpointing, apply_tiled_mlp, apply_ulysses
from sequence_parallel.ring import apply_context_parallel
from zero.parallel.pipeline import Pipeline, apply_pipeline
from zero.parallel.tensor import apply_tensor_parallel

__all__ = ["Parallelism", "parallelize"]


@dataclass
class Parallelism:
    """What was applied to the model from outside: the plans the engine takes, in the order they were
    applied, and this rank's pipeline (one of the plans) when there is one."""

    plans: list[zero.Plan] = field(default_factory=list)
    pipe: Pipeline | None = None


def parallelize(model: nn.Module, cfg: Any, dims: zero.ParallelDims,
                loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> Parallelism:
    """Parallelise the full, identically initialised `model` (in place) over `dims` as the run's config says:

    - the plans the model itself hands the engine (its family's spec: e.g. a balancing loss inside it);
    - experts over ep (`moe.apply_expert_parallel`), when the model holds MoE layers;
    - tensor parallelism over tp (slices heads; Ulysses then splits the rest) and Ulysses over sp;
    - `train.tiled_mlp` tiles of every dense MLP (MoE layers stay whole: tiling would make router statistics per
      tile), `train.activation_checkpointing` (with `train.offload_activations`);
    - under pp, this rank's pipeline stages (`parallel.pp_schedule`, `pp_virtual_stages`, `pp_split`) over
      `train.grad_accum` micro-batches, the last stage's loss `loss_fn` (default: the recipe's logits_loss).

    Each keeps its slice of the values the full model holds. `cfg` needs `model` (its family), `train` and
    `parallel` with those keys. Nothing is moved between devices: under pp the other stages' weights stay on
    the meta device (apply_pipeline), and the caller places what this rank keeps."""
    t = cfg.train
    parallel = Parallelism(plans=families.get(cfg).plans(model, dims))
    if moe_layers(model):
        parallel.plans.append(apply_expert_parallel(model, dims))
    parallel.plans.append(apply_tensor_parallel(model, dims.tp_group))
    if dims.cp > 1:  # ring attention over cp, Ulysses over sp inside it
        apply_context_parallel(model, dims.cp_group, dims.sp_group)
    else:
        apply_ulysses(model, dims.sp_group)
    if t.tiled_mlp:
        apply_tiled_mlp(model, num_tiles=t.tiled_mlp, exclude=(MoELayer,))
    if t.activation_checkpointing:
        apply_activation_checkpointing(model, offload=t.offload_activations)
    if dims.pp > 1:
        p = cfg.parallel
        parallel.pipe = apply_pipeline(model, dims, p.pp_schedule, microbatches=t.grad_accum,
                                       loss_fn=loss_fn or functools.partial(logits_loss, dims=dims),
                                       virtual_stages=p.pp_virtual_stages,
                                       split=None if p.pp_split is None else list(p.pp_split))
        parallel.plans.append(parallel.pipe)
    return parallel
