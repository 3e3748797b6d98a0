"""Expert parallelism applied from outside the model: convert every MoELayer to hold only its experts.

A model built with the same seed on every rank and then converted equals the single-rank model
exactly: each rank keeps its slice of the identically initialised full expert weights.
"""

from __future__ import annotations

from torch import nn
from torch.distributed import ProcessGroup

from zero.topology import group_rank, group_size

from .layer import moe_layers


def apply_expert_parallel(module: nn.Module, ep_group: ProcessGroup | None) -> nn.Module:
    """Shard the experts of every MoELayer in `module` over `ep_group` (in place; returns `module`).

    Rank r of a group of size P keeps experts [r * E/P, (r + 1) * E/P). Build optimizers after this
    call: the expert parameters are replaced by their local slices.
    """
    size = group_size(ep_group)
    if size == 1:
        return module
    rank = group_rank(ep_group)
    for layer in moe_layers(module):
        if layer.ep_group is not None:
            raise ValueError("apply_expert_parallel: a MoELayer is already expert-parallel; convert a "
                             "model built with ep_group=None")
        if layer.num_experts % size:
            raise ValueError(f"num_experts={layer.num_experts} is not divisible by the expert-parallel "
                             f"size {size}; choose num_experts as a multiple of ep")
        local = layer.num_experts // size
        layer.experts.keep_experts(rank * local, (rank + 1) * local)
        layer._set_ep_group(ep_group)
    return module


def set_stats_group(module: nn.Module, stats_group: ProcessGroup | None) -> nn.Module:
    """Set the group over which every MoELayer sums its balancing statistics (in place).

    Pass the sequence-parallel group when sequences are split across ranks: the aux and z losses
    then equal those of the unsplit sequences and each rank receives its exact share of their
    gradient. Without it each shard counts as its own sequence and the balancing gradient summed over
    the sp ranks is sp times too large.
    """
    for layer in moe_layers(module):
        layer.stats_group = stats_group
    return module
