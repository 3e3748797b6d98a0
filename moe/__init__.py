"""Gated Mixture-of-Experts layers with sort-based dispatch, grouped experts and expert parallelism.

Routers, dispatch and experts are separate parts; MoELayer composes them; parallelism is applied
from outside with `apply_expert_parallel`.
"""

from .experts import GroupedExperts
from .layer import MoELayer, collect_moe_stats, set_aux_loss_scale, update_router_biases
from .parallel import apply_expert_parallel, set_stats_group
from .router import TopKRouter

__all__ = [
    "MoELayer", "TopKRouter", "GroupedExperts", "apply_expert_parallel", "update_router_biases",
    "collect_moe_stats", "set_aux_loss_scale", "set_stats_group",
]
