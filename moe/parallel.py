"""Expert parallelism applied from outside the model: convert every MoELayer to hold only its experts,
and declare to the engine what that means (`apply_expert_parallel` returns a `zero.Plan`).

A model built with the same seed on every rank and then converted equals the single-rank model
exactly: each rank keeps its slice of the identically initialised full expert weights.
"""

from __future__ import annotations

from torch import nn
from torch.distributed import ProcessGroup

from zero.dist.topology import ParallelDims, group_rank, group_size
from zero.parallel.tensor import Style
from zero.plan import Placement, Plan, ReduceGroup, RuntimeFacts

from .dispatch import AllToAllDispatcher, LocalDispatcher
from .layer import MoELayer, loss_scale_hooks, moe_layers


class ExpertParallel(Plan):
    """What apply_expert_parallel declares to the engine for the MoE layers of a model: where each rank's
    experts lie in the full expert weights, that routed experts reduce over the expert-data-parallel
    group, the balancing losses' scale hooks, and (once the engine is built) fused gradient accumulation
    where `.grad` are flat-buffer views without hooks and repeatable backward under zero-bubble pipelines."""

    def __init__(self, model: nn.Module, dims: ParallelDims) -> None:
        self.model = model
        self.expert_data_parallel_group = dims.expert_data_parallel_group
        super().__init__("expert", placements=expert_placements(model), loss_scale_hooks=loss_scale_hooks(model),
                         on_initialize=[self._configure])

    def resolved(self) -> ExpertParallel:
        # the expert parameters as they are now (expert tensor parallelism replaces them by slices)
        self.reduce_groups = [expert_reduce_group(self.model, self.expert_data_parallel_group)]
        return self

    def _configure(self, facts: RuntimeFacts) -> None:
        # (Not under pp: a zero-bubble schedule's separate weight-gradient pass needs the gradients returned.)
        set_fused_grad_accumulation(self.model, facts.grads_accumulate_in_place and not facts.pipelined)
        # its input and weight passes both run the experts' backward over one forward
        set_repeatable_backward(self.model, facts.splits_backward)


def apply_expert_parallel(model: nn.Module, dims: ParallelDims) -> ExpertParallel:
    """Shard the experts of every MoELayer in `model` over `dims.ep_group` (in place) and sum their
    balancing statistics over `dims.sequence_group` (a sequence split over sp x cp ranks routes as a whole); returns
    the plan for `zero.initialize(..., plans=[...])`. Build optimizers after this call."""
    if not isinstance(dims, ParallelDims):
        raise TypeError(f"apply_expert_parallel takes the ParallelDims of the run, not a {type(dims).__name__}; "
                        "for a bare ep group use moe.shard_experts(model, ep_group)")
    shard_experts(model, dims.ep_group)
    set_stats_group(model, dims.sequence_group)
    return ExpertParallel(model, dims)


def shard_experts(module: nn.Module, ep_group: ProcessGroup | None) -> nn.Module:
    """Shard the experts of every MoELayer in `module` over `ep_group` (in place; returns `module`).

    Rank r of a group of size P keeps experts [r * E/P, (r + 1) * E/P); the expert parameters are
    replaced by their local slices.
    """
    size = group_size(ep_group)
    if size == 1:
        return module
    rank = group_rank(ep_group)
    for layer in moe_layers(module):
        if not isinstance(layer.dispatcher, LocalDispatcher):
            raise ValueError("shard_experts: a MoELayer is already expert-parallel; convert a "
                             "model built with ep_group=None")
        dispatcher = AllToAllDispatcher(ep_group, layer.num_experts)  # checks divisibility
        local = dispatcher.num_local
        layer.experts.keep_experts(rank * local, (rank + 1) * local)
        layer.set_expert_parallel(dispatcher, ep_group)
    return module


def expert_placements(module: nn.Module) -> dict[str, Placement]:
    """Where each rank's routed-expert weights lie in the full [num_experts, ...] weights, by parameter
    name in `module` (part of the plan apply_expert_parallel returns), so checkpoints load under another
    expert-parallel size."""
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
    `expert_data_parallel_group` (`ParallelDims.expert_data_parallel_group`; part of the plan
    apply_expert_parallel returns). Without it expert gradients would be averaged with those of other experts.
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
