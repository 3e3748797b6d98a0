"""Expert parallelism applied from outside the model: convert every MoELayer to hold only its experts.

A model built with the same seed on every rank and then converted equals the single-rank model
exactly: each rank keeps its slice of the identically initialised full expert weights.
"""

from __future__ import annotations

from torch import nn
from torch.distributed import ProcessGroup

from zero.dist.topology import group_rank, group_size
from zero.parallel.tensor import Style
from zero.plan import Placement, ReduceGroup

from .dispatch import AllToAllDispatcher, LocalDispatcher
from .layer import MoELayer, moe_layers


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
        if not isinstance(layer.dispatcher, LocalDispatcher):
            raise ValueError("apply_expert_parallel: a MoELayer is already expert-parallel; convert a "
                             "model built with ep_group=None")
        dispatcher = AllToAllDispatcher(ep_group, layer.num_experts)  # checks divisibility
        local = dispatcher.num_local
        layer.experts.keep_experts(rank * local, (rank + 1) * local)
        layer.set_expert_parallel(dispatcher, ep_group)
    return module


def expert_placements(module: nn.Module) -> dict[str, Placement]:
    """Where each rank's routed-expert weights lie in the full [num_experts, ...] weights, by parameter
    name in `module`: pass them to `zero.initialize(placements=...)` (composed with tensor parallelism's,
    `zero.plan.compose`) so checkpoints load under another expert-parallel size."""
    out = {}
    for prefix, layer in module.named_modules():
        if not isinstance(layer, MoELayer):
            continue
        start, stop = layer.experts.expert_range
        for pname, p in layer.experts.named_parameters(recurse=False):
            if stop - start != layer.num_experts:
                out[f"{prefix}.experts.{pname}".lstrip(".")] = Placement.along(p.shape, 0, layer.num_experts,
                                                                                 [(0, start, stop - start)])
    return out


def expert_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The routed-expert weights of every MoELayer in `module` (not routers, not shared experts)."""
    return [p for layer in moe_layers(module) for p in layer.experts.parameters()]


def expert_reduce_group(module: nn.Module, expert_data_parallel_group: ProcessGroup | None) -> ReduceGroup:
    """Declare to the ZeRO engine that the routed experts reduce over the expert-data-parallel group.

    With expert parallelism each rank holds different experts, replicated only across the ranks of
    `expert_data_parallel_group` (`ParallelDims.expert_data_parallel_group`): pass the result to
    `zero.initialize(..., reduce_groups=[...])`. Without it expert gradients would be averaged with
    those of other experts.
    """
    return ReduceGroup("expert", expert_parameters(module), expert_data_parallel_group)


def set_fused_grad_accumulation(module: nn.Module, enabled: bool) -> nn.Module:
    """Let the experts of every MoELayer add weight gradients into an existing `.grad` in place.

    Only where nothing needs autograd's gradient hooks on them, e.g. when the ZeRO engine reports
    `engine.grads_accumulate_in_place` (stages 0-1); see GroupedExperts. Returns `module`.
    """
    for layer in moe_layers(module):
        layer.experts.fuse_grad_accumulation = bool(enabled)
    return module


def set_repeatable_backward(module: nn.Module, enabled: bool) -> nn.Module:
    """Let backward run more than once over the same forward (every MoELayer in `module` keeps its saved
    activations until the graph is freed instead of releasing them chunk by chunk): needed by pipeline
    schedules that split backward into input- and weight-gradient passes (`Pipeline.splits_backward`)."""
    for layer in moe_layers(module):
        layer.experts.repeatable_backward = bool(enabled)
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


class ExpertTensorParallel(Style):
    """Tensor-parallel plan style for an MoELayer: split every expert's hidden units over tp
    (see MoELayer.set_tensor_parallel)."""

    def apply(self, module, group):
        from .layer import MoELayer

        if not isinstance(module, MoELayer):
            raise TypeError(f"ExpertTensorParallel applies to MoELayer, not {type(module).__name__}")
        return module.set_tensor_parallel(group)
