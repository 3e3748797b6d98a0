"""Hugging Face experts through transformers' ExpertsInterface, run by this project's MoE parts.

transformers 5 declares a model's routed experts with `@use_experts_implementation` (fused 3D weights
`gate_up_proj` / `up_proj` and `down_proj`, flags `has_gate`, `has_bias`, `is_transposed`, `is_concatenated`,
`has_post_expert_norm`) and dispatches their `forward(hidden_states [N, H], top_k_index [N, k], top_k_weights
[N, k])` through `config._experts_implementation`. `EXPERTS` ("moe_lst") is registered there: the model's own
router (and shared experts, scaling, jitter ...) stays as it is, and its choices run through this project's
sort-based dispatch (moe.dispatch: LocalDispatcher, or AllToAllDispatcher under expert parallelism), grouped
GEMMs over the fused weights as they are stored (moe.experts.grouped_matmul), the experts' own gate / activation
and biases, and the gate-weighted combine.

`adopt_experts(model)` turns each experts module's parent block into a `moe.MoELayer` (its class extended in place:
its forward, children and parameter names stay Hugging Face's), so `moe.apply_expert_parallel` shards the experts
along their first dimension and declares their placements and reduce group to the engine as for the project's
own MoE layers.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed import ProcessGroup
from transformers import PreTrainedModel
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from moe import MoELayer
from moe.dispatch import LocalDispatcher, assign_slots
from moe.experts import grouped_matmul
from zero.dist.topology import group_rank, group_size
from zero.parallel.tensor import Style, TensorSplit, reduce_scatter_sequence, substitute_parameters, sum_grad
from zero.plan import AttachedLossScale

#: The name the runtime's experts forward is registered under in transformers' ExpertsInterface.
EXPERTS = "moe_lst"
#: Names of the fused expert weights and biases transformers' experts classes use.
WEIGHTS = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias", "down_proj_bias")


def is_experts(module: nn.Module) -> bool:
    """Whether `module` is a routed-experts module declared with transformers' `use_experts_implementation`."""
    return hasattr(module, "_is_expert_parallel") and hasattr(module, "has_gate") and hasattr(module, "down_proj")


def _linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, counts: torch.Tensor,
            hf_transposed: bool) -> torch.Tensor:
    """Rows x [M, in] in per-expert segments through expert weights w: [E, out, in] (Hugging Face's default,
    moe.experts' transposed layout) or [E, in, out] (is_transposed), plus each row's expert bias."""
    y = grouped_matmul(x, w, counts, False, not hf_transposed)
    if bias is not None:
        y = y + bias.repeat_interleave(counts, dim=0, output_size=x.shape[0])
    return y


def expert_mlp(experts: nn.Module, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Every expert's MLP over its segment of `rows` [M, H] (segments sized by counts [E_local]), exactly as the
    experts module computes it per token: up (gated: gate_up and the module's own `_apply_gate`; else up and its
    activation), down, biases where it has them, its post-expert norm where it has one."""
    t = bool(experts.is_transposed)
    if experts.has_gate:
        h = _linear(rows, experts.gate_up_proj, getattr(experts, "gate_up_proj_bias", None) if experts.has_bias
                    else None, counts, t)
        h = experts._apply_gate(h)
    else:
        h = _linear(rows, experts.up_proj, getattr(experts, "up_proj_bias", None) if experts.has_bias else None,
                    counts, t)
        h = experts.act_fn(h)
    y = _linear(h, experts.down_proj, getattr(experts, "down_proj_bias", None) if experts.has_bias else None,
                counts, t)
    if experts.has_post_expert_norm:
        y = experts.post_expert_norm(y)
    return y


def experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """ExpertsInterface's forward: the router's choices through the layer's dispatcher and grouped experts."""
    layer = self.__dict__.get("moe_lst_layer")
    if layer is None:
        raise RuntimeError(f"{type(self).__name__} runs experts_implementation={EXPERTS!r} but was not adopted: "
                           "build the model with moe_lst.models.hf.HFCausalLM (or call adopt_experts)")
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    indices = top_k_index.reshape(x.shape[0], -1).long()
    weights = top_k_weights.reshape(x.shape[0], -1)
    plan = assign_slots(indices, weights, layer.num_experts)
    rows, state = layer.dispatcher.dispatch(x, plan, weights)
    y = expert_mlp(self, rows, state.tokens_per_local_expert)
    out = layer.dispatcher.combine(y, state)
    routed = plan.routed_per_expert.detach()
    slots = max(plan.num_slots, 1)
    zero_ = routed.new_zeros((), dtype=torch.float32)
    layer.last_stats = {"tokens_per_expert": routed, "tokens_per_local_expert": state.tokens_per_local_expert,
                        "load_max": routed.max() / slots, "load_min": routed.min() / slots, "dropped": zero_,
                        # the model's router owns its balancing loss (moe_lst.models.hf.balance): none here
                        "aux_loss": zero_, "z_loss": zero_}
    return out.reshape(shape).to(hidden_states.dtype)


ALL_EXPERTS_FUNCTIONS.register(EXPERTS, experts_forward)


class _AdoptedExperts:
    """What moe.GroupedExperts offers moe.parallel, for a Hugging Face experts module: the slice of experts
    kept (expert parallelism), and the switches moe.parallel sets (unused: its weights' gradients are autograd's)."""

    fuse_grad_accumulation = False
    repeatable_backward = False

    def keep_experts(self, start: int, stop: int) -> None:
        """Drop every expert outside [start, stop) (relative to the experts this module holds now)."""
        others = [n for n, _ in self.named_parameters() if n not in WEIGHTS]
        if others:  # (moe.parallel declares every parameter of the experts as one expert's, reduced over its replicas)
            raise NotImplementedError(f"expert parallelism of {type(self).__name__}: {others[0]} is a tensor of the "
                                      "experts module beside its fused weights, which is not sharded with them: not "
                                      "supported")
        for name in WEIGHTS:
            p = self._parameters.get(name)
            if p is not None:
                self.register_parameter(name, nn.Parameter(p.data[start:stop].clone(), requires_grad=p.requires_grad))
        base = self.expert_range[0]
        self.expert_range = (base + start, base + stop)
        self.num_experts = stop - start

    def hidden_units(self) -> int:
        """Each expert's hidden units (intermediate size)."""
        up = self.gate_up_proj if self.has_gate else self.up_proj
        fused = up.shape[2 if self.is_transposed else 1]
        return fused // 2 if self.has_gate else fused

    def keep_hidden(self, tp_group: ProcessGroup) -> dict[str, TensorSplit]:
        """Keep this tp rank's slice of every expert's hidden units (expert tensor parallelism): the up (or fused
        gate / up) weight and bias by their hidden rows (a [gate; up] concatenation as two halves sliced alike, an
        interleaved one as a contiguous run of (gate, up) pairs), the down weight by its input; the down bias stays
        whole, added as bias / tp with its gradient summed over tp (its sum over the ranks' partial outputs counts it
        once). Returns the split of each parameter, by name in this module."""
        tp, rank = group_size(tp_group), group_rank(tp_group)
        hidden = self.hidden_units()
        if hidden % tp:
            raise ValueError(f"expert tensor parallelism splits each expert's {hidden} hidden units over tp={tp}, "
                             "which does not divide them; pick a tp that divides the experts' intermediate size")
        t = bool(self.is_transposed)
        up_dim, down_dim = (2, 1) if t else (1, 2)  # the hidden dim of [E, ...] weights ([E, H, 2I] when transposed)
        halves = bool(self.has_gate and self.is_concatenated)
        up = "gate_up_proj" if self.has_gate else "up_proj"
        splits = {up: TensorSplit(up_dim, halves=halves), "down_proj": TensorSplit(down_dim)}
        if self.has_bias:
            splits[f"{up}_bias"] = TensorSplit(1, halves=halves)
            splits["down_proj_bias"] = TensorSplit(None, replicas=tp)
        for name, split in splits.items():
            p = self._parameters.get(name)
            if p is None or split.dim is None:
                continue
            self.register_parameter(name, nn.Parameter(split.local(p.data, rank, tp).clone(),
                                                       requires_grad=p.requires_grad))
        if self._parameters.get("down_proj_bias") is not None:
            substitute_parameters(self, {"down_proj_bias": lambda b: sum_grad(b, tp_group) / tp})
        return {n: s for n, s in splits.items() if self._parameters.get(n) is not None}


class _AdoptedLayer(MoELayer):
    """A Hugging Face sparse-MoE block as a moe.MoELayer (mixed into its class): its own forward and router,
    its `experts` child run through EXPERTS with this layer's dispatcher."""

    def set_expert_parallel(self, dispatcher, ep_group) -> None:
        # (under expert tensor parallelism the block's output is reduce-scattered by its own hook, after its shared
        # experts join it: the dispatcher only moves tokens, not wrapped as MoELayer wraps it)
        tp_group, self.tp_group = self.tp_group, None
        try:
            super().set_expert_parallel(dispatcher, ep_group)
        finally:
            self.tp_group = tp_group

    def output_norm(self) -> str | None:
        """The child norm the block's forward applies last, to its whole output (`return self.<norm>(hidden_states)`,
        read from its source), or None: under expert tensor parallelism it runs after the reduce-scatter, on the
        summed output's sequence shard, as it must (a norm of a partial sum is not the norm of the sum)."""
        try:
            lines = [line.strip() for line in inspect.getsource(type(self).forward).splitlines() if line.strip()]
        except (OSError, TypeError):
            return None
        match = re.fullmatch(r"return self\.(\w+)\(hidden_states\)", lines[-1]) if lines else None
        module = self._modules.get(match.group(1)) if match else None
        return match.group(1) if module is not None and "norm" in type(module).__name__.lower() else None

    def tensor_parallel_problem(self, tp: int, shared: dict[str, str]) -> str | None:
        """Why this block cannot be split over `tp` ranks by hidden units (None: it can), one line."""
        experts = self.experts
        if experts.has_post_expert_norm:
            return (f"{type(experts).__name__} applies a norm to each expert's output (has_post_expert_norm), which "
                    "a split of the hidden units does not survive")
        if experts.hidden_units() % tp:
            return f"tp={tp} does not divide its experts' {experts.hidden_units()} hidden units"
        identity = getattr(self, "zero_expert_num", 0)
        if isinstance(identity, int) and identity > 0:
            return (f"its {identity} zero-computation experts (zero_expert_num) add the block's own input to its "
                    "output on every tp rank, beside the partial sums of the split experts")
        last = self.output_norm()
        norms = [(n, m) for n, m in self.named_modules() if "norm" in type(m).__name__.lower()
                 and not n.startswith("experts.") and n != last]
        if norms:
            return (f"{norms[0][0]} ({type(norms[0][1]).__name__}) normalises inside the block, where each rank holds "
                    "a partial sum of its output over the split hidden units")
        for name, kind in shared.items():
            linear = self.get_submodule(name)
            if not isinstance(linear, nn.Linear):
                return f"{name} (a shared-expert projection) is a {type(linear).__name__}, not an nn.Linear"
            units = linear.weight.shape[1 if kind == "rowwise" else 0] // (2 if kind == "halves" else 1)
            if units % tp:
                return f"tp={tp} does not divide the {units} hidden units of its shared expert ({name})"
        return None

    def set_tensor_parallel(self, tp_group, shared: dict[str, str] | None = None) -> dict[str, TensorSplit]:
        """Expert tensor parallelism of this Hugging Face block over `tp_group` (Megatron's sequence-parallel form):
        it takes the full sequence (gathered by the norm before it) and routes it identically on every tp rank; each
        routed expert keeps this rank's slice of its hidden units (`_AdoptedExperts.keep_hidden`), and so does each
        shared-expert projection named in `shared` (relative name -> "colwise", "halves" (a fused [gate; up]
        projection) or "rowwise" (by input, a bias added as bias / tp)); so the block's output is a partial sum,
        reduce-scattered over tp to this rank's sequence shard once, by a hook on the block, which then applies the
        block's output norm (`output_norm`) there, on the summed shard. Every other parameter of the block (router
        weight and bias, shared-expert gate, the output norm's weight, ...) is replicated with its gradient summed
        over tp (each rank's partial output, or sequence shard, gives it a partial gradient). Returns how each
        parameter is split, by name in this block."""
        tp, rank = group_size(tp_group), group_rank(tp_group)
        if tp == 1:
            return {}
        if self.tp_group is not None:
            raise ValueError(f"{type(self).__name__} is already tensor-parallel")
        shared = dict(shared or {})
        problem = self.tensor_parallel_problem(tp, shared)
        if problem:
            raise NotImplementedError(f"expert tensor parallelism of {type(self).__name__}: {problem}")
        splits = {f"experts.{n}": s for n, s in self.experts.keep_hidden(tp_group).items()}
        for name, kind in shared.items():
            linear = self.get_submodule(name)
            split = TensorSplit(1 if kind == "rowwise" else 0, halves=kind == "halves")
            linear.weight = nn.Parameter(split.local(linear.weight.data, rank, tp).clone(),
                                         requires_grad=linear.weight.requires_grad)
            splits[f"{name}.weight"] = split
            if linear.bias is None:
                continue
            if kind == "rowwise":  # (added once: its share on every rank, the gradient summed)
                substitute_parameters(linear, {"bias": lambda b: sum_grad(b, tp_group) / tp})
                splits[f"{name}.bias"] = TensorSplit(None, replicas=tp)
            else:
                split = TensorSplit(0, halves=kind == "halves")
                linear.bias = nn.Parameter(split.local(linear.bias.data, rank, tp).clone(),
                                           requires_grad=linear.bias.requires_grad)
                splits[f"{name}.bias"] = split
            linear.in_features, linear.out_features = linear.weight.shape[1], linear.weight.shape[0]
        for module_name, module in self.named_modules():
            replicated = [n for n, p in module.named_parameters(recurse=False)
                          if p is not None and f"{module_name}.{n}".lstrip(".") not in splits]
            if replicated:
                substitute_parameters(module, {n: functools.partial(sum_grad, group=tp_group) for n in replicated})
                splits.update({f"{module_name}.{n}".lstrip("."): TensorSplit(None, replicas=tp) for n in replicated})
        self.tp_group = tp_group
        norm_name, after = self.output_norm(), None
        if norm_name is not None:  # (its forward, with its gradient sum, moves after the reduce-scatter)
            norm = self.get_submodule(norm_name)
            after, norm.forward = norm.forward, _identity
        self.register_forward_hook(functools.partial(_scatter_output, group=tp_group, after=after))
        return splits


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _scatter_output(block: nn.Module, args, output, group: ProcessGroup, after: Callable | None = None):
    """The block's output [b, s, H] (or a tuple led by it), a partial sum over tp: summed and cut to this rank's
    sequence shard [b, s/tp, H], then `after` (the block's output norm) applied to the shard."""
    first = output[0] if isinstance(output, tuple) else output
    if first.dim() != 3:
        raise ValueError(f"{type(block).__name__} returned hidden states of shape {tuple(first.shape)}; expert "
                         "tensor parallelism takes [batch, seq, hidden]")
    scattered = reduce_scatter_sequence(first, group, dim=1)
    if after is not None:
        scattered = after(scattered)
    return (scattered, *output[1:]) if isinstance(output, tuple) else scattered


class ExpertTensorParallelBlock(Style):
    """The tensor-parallel style of an adopted Hugging Face MoE block (`_AdoptedLayer.set_tensor_parallel`), with
    the shared-expert projections it slices and the model's balancing loss, whose gradient each of the tp ranks
    computing it from the same full-sequence router logits sends 1/tp of."""

    #: (the block's parameters inside its children are placed by this style too)
    places_submodules = True

    def __init__(self, shared: dict[str, str], balance=None) -> None:
        self.shared, self.balance = dict(shared), balance

    def apply(self, module, group):
        if not isinstance(module, _AdoptedLayer):
            raise TypeError(f"ExpertTensorParallelBlock applies to an adopted MoE block, not {type(module).__name__}")
        splits = module.set_tensor_parallel(group, self.shared)
        if self.balance is not None:
            self.balance.grad_share = 1.0 / group_size(group)
        return splits


#: Conventional names of a shared expert's projections: the first with its output feeding the activation, the
#: second (fused [gate; up]) cut as two halves, the last reduced over its input.
_SHARED_COLWISE, _SHARED_HALVES, _SHARED_ROWWISE = ("gate_proj", "up_proj"), ("gate_up_proj",), ("down_proj",)


def expert_tensor_parallel(model: nn.Module, styles: dict, tp: int, refuse: Callable[[str], Exception]) -> None:
    """Expert tensor parallelism of every adopted MoE block of `model` (an HFCausalLM) in `styles` (module name ->
    style, from the config's base_model_tp_plan): the plan's colwise / rowwise entries under a block (its shared
    experts) are taken out and given to the block's own style instead (sliced alike but not reduce-scattered on
    their own: their partial sums join the routed experts' before the block's one reduce-scatter), with any shared
    MLP the plan leaves out (its `gate_proj` / `up_proj` / `gate_up_proj` / `down_proj` projections); raises
    `refuse(why)` for a block the split of hidden units does not fit."""
    from zero.parallel.tensor import ColwiseParallel, RowwiseParallel

    for block_name in getattr(model, "moe_blocks", ()):
        block = model.get_submodule(block_name)
        shared: dict[str, str] = {}
        for name in [n for n in styles if n.startswith(block_name + ".")]:
            style, rel = styles.pop(name), name[len(block_name) + 1:]
            if not isinstance(style, (ColwiseParallel, RowwiseParallel)):
                raise refuse(f"{name} in MoE block {block_name} has style {type(style).__name__}, which expert "
                             "tensor parallelism does not map")
            shared[rel] = ("rowwise" if isinstance(style, RowwiseParallel) else
                           "halves" if rel.rpartition(".")[2] in _SHARED_HALVES else "colwise")
        for child, module in block.named_children():
            linears = {n for n, m in module.named_children() if isinstance(m, nn.Linear)}
            if child == "experts" or not linears & set(_SHARED_ROWWISE):
                continue
            for n in linears:
                kind = ("rowwise" if n in _SHARED_ROWWISE else "halves" if n in _SHARED_HALVES else
                        "colwise" if n in _SHARED_COLWISE else None)
                if kind is None:
                    raise refuse(f"{block_name}.{child}.{n} in a shared MLP is not a projection expert tensor "
                                 "parallelism knows how to split")
                shared.setdefault(f"{child}.{n}", kind)
        problem = block.tensor_parallel_problem(tp, shared)
        if problem:
            raise refuse(f"MoE block {block_name}: {problem}")
        styles[block_name] = ExpertTensorParallelBlock(shared, getattr(model, "balance", None))


@functools.cache
def _extended(cls: type, mixin: type) -> type:
    return type(cls.__name__, (cls, mixin), {"__module__": cls.__module__})


def adopt_experts(model: PreTrainedModel) -> list[str]:
    """Run every experts module of `model` (transformers' use_experts_implementation) through EXPERTS, its parent
    block made a moe.MoELayer in place; returns the blocks' names in module order ([] for a dense model or one
    adopted already). Parameters keep their names, shapes and tensors; build optimizers after this call (and after
    moe.apply_expert_parallel, which then keeps each rank's slice of the experts)."""
    found = [(name, m) for name, m in model.named_modules() if is_experts(m)]
    blocks = []
    for name, experts in found:
        parent_name, _, child = name.rpartition(".")
        if child != "experts":
            raise NotImplementedError(f"{name}: an experts module not named `experts` in its block is not supported")
        block = model.get_submodule(parent_name)
        if isinstance(block, MoELayer):
            continue
        if type(experts).forward is nn.Module.forward:
            raise NotImplementedError(f"{name}: {type(experts).__name__} has no forward")
        num = int(experts.gate_up_proj.shape[0] if experts.has_gate else experts.up_proj.shape[0])
        experts.__class__ = _extended(type(experts), _AdoptedExperts)
        experts.expert_range = (0, num)
        experts.num_experts = num
        block.__class__ = _extended(type(block), _AdoptedLayer)
        _init_layer(block, num)
        experts.__dict__["moe_lst_layer"] = block  # (not a child: the block is its parent)
        blocks.append(parent_name)
    if found:
        model.set_experts_implementation(EXPERTS)
    return blocks


def _init_layer(block: nn.Module, num_experts: int) -> None:
    """The attributes moe.MoELayer's users read, on a block that did not run MoELayer.__init__."""
    block.num_experts = num_experts
    block.dispatcher = LocalDispatcher(num_experts, fused=False)
    block.ep_group = block.tp_group = block.stats_group = None
    block.bias_update_rate = 0.0
    block.capacity_factor = None
    block.balancing_loss_scale = AttachedLossScale()  # (unused: the model's router owns its balancing loss)
    block.last_stats = {}
    block.register_buffer("load_since_update", torch.zeros(num_experts, device=block.experts.down_proj.device),
                          persistent=False)
