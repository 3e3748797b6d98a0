"""Gated Mixture-of-Experts layers with sort-based dispatch, grouped experts and expert parallelism.

Routers, dispatch and experts are separate parts; MoELayer composes them; parallelism is applied
from outside with `apply_expert_parallel(model, dims)`, which returns the plan the ZeRO engine takes.
"""

from .dispatch import AllToAllDispatcher, LocalDispatcher, TokenDispatcher
from .experts import GroupedExperts
from .layer import MoELayer, collect_moe_stats, loss_scale_hooks, set_aux_loss_scale, update_router_biases
from .parallel import (
    ExpertParallel,
    ExpertTensorParallel,
    apply_expert_parallel,
    expert_parameters,
    expert_placements,
    expert_reduce_group,
    set_fused_grad_accumulation,
    set_repeatable_backward,
    set_stats_group,
    shard_experts,
)
from .router import TopKRouter

__all__ = [
    "MoELayer", "TopKRouter", "GroupedExperts", "TokenDispatcher", "LocalDispatcher", "AllToAllDispatcher",
    "ExpertParallel", "apply_expert_parallel", "shard_experts", "expert_parameters", "expert_placements",
    "expert_reduce_group",
    "set_fused_grad_accumulation",
    "loss_scale_hooks", "update_router_biases", "collect_moe_stats", "set_aux_loss_scale", "set_stats_group",
    "ExpertTensorParallel", "set_repeatable_backward",
]
