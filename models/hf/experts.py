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

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from moe import MoELayer
from moe.dispatch import LocalDispatcher, assign_slots
from moe.experts import grouped_matmul
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
        for name in WEIGHTS:
            p = self._parameters.get(name)
            if p is not None:
                self.register_parameter(name, nn.Parameter(p.data[start:stop].clone(), requires_grad=p.requires_grad))
        base = self.expert_range[0]
        self.expert_range = (base + start, base + stop)
        self.num_experts = stop - start


class _AdoptedLayer(MoELayer):
    """A Hugging Face sparse-MoE block as a moe.MoELayer (mixed into its class): its own forward and router,
    its `experts` child run through EXPERTS with this layer's dispatcher."""

    def set_tensor_parallel(self, tp_group):
        raise NotImplementedError("expert tensor parallelism of Hugging Face experts is not supported (their "
                                  "weights keep Hugging Face's names); use expert parallelism (parallel.ep)")


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
