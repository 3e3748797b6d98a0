"""Hugging Face sparse-MoE blocks run by this project's MoELayer: sort-based dispatch, grouped experts, expert
parallelism, balancing statistics, under Hugging Face's parameter names, shapes and routing semantics.

`adopt_moe_blocks(model)` swaps every covered block in place (Mixtral, Qwen3-MoE, OLMoE); the model's state_dict,
logits, loss (with its `router_aux_loss_coef * load_balancing_loss_func(...)` term) and gradients stay
those of the unswapped model, and `moe.apply_expert_parallel(model, dims)` then shards its experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
from transformers.utils.output_capturing import install_output_capuring_hook

from moe import GroupedExperts, MoELayer, TopKRouter
from moe.router import Routing

#: Config fields through which Hugging Face configs declare routed experts (any of them positive: an MoE model).
_EXPERT_COUNT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts",
                        "num_experts_per_tok")
#: Activations whose gated form is the SwiGLU of moe.GroupedExperts (F.silu(gate) * up).
_SILU = ("silu", "swish")


class RouterLogits(nn.Module):
    """Passes the router logits through unchanged: transformers' output recorder hooks it to collect the
    model's `router_logits` (from which the CausalLM forward computes its auxiliary loss)."""

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


class HFRouter(TopKRouter):
    """The router of a Hugging Face sparse-MoE block: logits in the input's dtype (F.linear as Hugging Face
    computes them), softmax over all experts in fp32, top-k, renormalised over the chosen k when
    `renormalize`; routing weights in fp32 (Mixtral) or, with `weights_in_logits_dtype`, cast to the
    logits' dtype (Qwen3-MoE, OLMoE). Its weight is the block's `gate.weight` [E, dim]."""

    def __init__(self, dim: int, num_experts: int, top_k: int, renormalize: bool,
                 weights_in_logits_dtype: bool) -> None:
        super().__init__(dim, num_experts, top_k, "softmax", renormalize=renormalize, fp32_logits=False)
        self.weights_in_logits_dtype = weights_in_logits_dtype
        self.logits_out = RouterLogits()

    def forward(self, x: torch.Tensor) -> Routing:
        routing = super().forward(x)
        self.logits_out(routing.logits)
        if self.weights_in_logits_dtype:
            routing.weights = routing.weights.to(routing.logits.dtype)
        return routing


class HFGroupedExperts(GroupedExperts):
    """GroupedExperts holding Hugging Face's fused expert tensors as they are: `gate_up_proj` [E, 2I, H]
    (gate rows, then up) and `down_proj` [E, H, I], the transposed layout of moe.GroupedExperts."""

    weight_names = ("gate_up_proj", "down_proj")

    @property
    def w_in(self) -> nn.Parameter:
        return self.gate_up_proj

    @property
    def w_out(self) -> nn.Parameter:
        return self.down_proj


@dataclass(frozen=True)
class BlockSemantics:
    """What a Hugging Face block's routing does, read from the block it replaces."""

    top_k: int
    renormalize: bool  # gate weights renormalised over the chosen k
    jitter: float  # training-only multiplicative noise on the block input (router and experts both see it)
    weights_in_logits_dtype: bool  # routing weights cast to the logits' dtype before weighting the experts


class HFMoEBlock(MoELayer):
    """A Hugging Face sparse-MoE block as a moe.MoELayer: its children are Hugging Face's (`gate`, an HFRouter
    holding `gate.weight`; `experts`, an HFGroupedExperts holding `gate_up_proj` and `down_proj`, the very
    parameter tensors of the block it replaces), so state_dict names and shapes do not change, while routing,
    dispatch (dropless), experts, expert parallelism and `last_stats` are moe's.

    The auxiliary loss stays Hugging Face's: the router logits reach the model's `router_logits` output and
    the CausalLM forward adds `router_aux_loss_coef * load_balancing_loss_func(...)` over all layers when
    `output_router_logits` is set; the layer itself attaches no balancing loss (its `last_stats` still report
    moe's per-layer aux and z values, unscaled).
    """

    def __init__(self, gate_weight: nn.Parameter, gate_up_proj: nn.Parameter, down_proj: nn.Parameter,
                 semantics: BlockSemantics, child_order: tuple[str, ...] = ("gate", "experts")) -> None:
        num_experts, dim = gate_weight.shape
        ffn_dim = down_proj.shape[2]
        _check_shapes(gate_weight, gate_up_proj, down_proj)
        s = semantics
        with torch.device("meta"):  # the weights are the Hugging Face block's: allocate none here
            super().__init__(dim, ffn_dim, num_experts, s.top_k, capacity_factor=None, router="softmax",
                             aux_loss_coef=0.0, z_loss_coef=0.0, renormalize=s.renormalize)
            gate = HFRouter(dim, num_experts, s.top_k, s.renormalize, s.weights_in_logits_dtype)
            experts = HFGroupedExperts(dim, ffn_dim, num_experts, "swiglu", transposed=True)
        gate.register_parameter("weight", gate_weight)
        experts.register_parameter("gate_up_proj", gate_up_proj)
        experts.register_parameter("down_proj", down_proj)
        # Not in Hugging Face's state_dict (the aux-loss-free bias is unused: bias_update_rate is 0).
        gate.register_buffer("expert_bias", torch.zeros(num_experts, device=gate_weight.device), persistent=False)
        del self._modules["router"], self._modules["experts"]
        children = {"gate": gate, "experts": experts}
        for name in child_order:
            self.register_module(name, children[name])
        for name, buf in self._buffers.items():  # MoELayer's own buffers are counters that start at zero
            if buf is not None and buf.is_meta:
                self._buffers[name] = torch.zeros(buf.shape, dtype=buf.dtype, device=gate_weight.device)
        self.jitter = s.jitter

    @property
    def router(self) -> HFRouter:
        """MoELayer's name for the router (Hugging Face's: `gate`)."""
        return self.gate

    def extra_repr(self) -> str:
        return f"jitter={self.jitter}" if self.jitter else ""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.jitter > 0:
            # Mixtral's router_jitter_noise: the same draw as Hugging Face's block, seen by router and experts.
            x = x * torch.empty_like(x).uniform_(1.0 - self.jitter, 1.0 + self.jitter)
        return super().forward(x)

    def set_tensor_parallel(self, tp_group):
        raise NotImplementedError("expert tensor parallelism of Hugging Face MoE blocks swapped by adopt_moe_blocks "
                                  "is not supported; build the model with moe_lst.models.hf.HFCausalLM, whose "
                                  "tensor_parallel_styles split its experts by hidden units")


def _check_shapes(gate_weight: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> None:
    num_experts, dim = gate_weight.shape
    ffn_dim = down_proj.shape[-1]
    want = {"gate.weight": (num_experts, dim), "experts.gate_up_proj": (num_experts, 2 * ffn_dim, dim),
            "experts.down_proj": (num_experts, dim, ffn_dim)}
    got = {"gate.weight": gate_weight.shape, "experts.gate_up_proj": gate_up_proj.shape,
           "experts.down_proj": down_proj.shape}
    bad = [f"{k} {tuple(got[k])} (expected {want[k]})" for k in want if tuple(got[k]) != want[k]]
    if bad:
        raise ValueError(f"a Hugging Face MoE block with unexpected weight shapes: {', '.join(bad)}; "
                         "adopt_moe_blocks takes whole (unsharded) fused expert tensors")


def _mixtral(block: MixtralSparseMoeBlock) -> BlockSemantics:
    # MixtralTopKRouter renormalises the top-k always and keeps the weights fp32.
    return BlockSemantics(block.top_k, True, float(block.jitter_noise), False)


def _norm_topk_prob(block: Qwen3MoeSparseMoeBlock | OlmoeSparseMoeBlock) -> BlockSemantics:
    # Qwen3MoeTopKRouter and OlmoeTopKRouter renormalise per config.norm_topk_prob and cast the weights to
    # the logits' dtype.
    return BlockSemantics(block.gate.top_k, bool(block.gate.norm_topk_prob), 0.0, True)


#: The Hugging Face blocks covered (by exact class: a subclass may route differently) and their semantics.
BLOCKS = {MixtralSparseMoeBlock: _mixtral, Qwen3MoeSparseMoeBlock: _norm_topk_prob,
          OlmoeSparseMoeBlock: _norm_topk_prob}


def _is_moe(model: PreTrainedModel) -> bool:
    config = model.config.get_text_config()
    values = [getattr(config, name, None) for name in _EXPERT_COUNT_FIELDS]
    return any(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values)


def _refuse_uncovered(model: PreTrainedModel) -> None:
    config = model.config.get_text_config()
    covered = ", ".join(cls.__name__ for cls in BLOCKS)
    raise NotImplementedError(f"adopt_moe_blocks: {type(model).__name__} (model_type={config.model_type!r}) is a "
                              f"mixture-of-experts model whose MoE block is not covered (covered: {covered})")


def adopt_moe_blocks(model: PreTrainedModel) -> list[str]:
    """Replace every Hugging Face sparse-MoE block of `model` in place by an HFMoEBlock (a moe.MoELayer) and
    return the replaced modules' names, in module order.

    Parameters keep their names, shapes and tensors (the new blocks hold the old parameters), so state_dict,
    save_pretrained / from_pretrained and checkpoints need no mapping; build optimizers after this call (and
    after moe.apply_expert_parallel, which then shards `experts.gate_up_proj` / `experts.down_proj` along the
    expert dimension, their placements describing each rank's slice of the full Hugging Face tensors). A dense
    model, or one adopted already, gives []; an MoE model whose blocks are not covered raises.
    """
    config = model.config.get_text_config()
    found = [(name, m) for name, m in model.named_modules() if type(m) in BLOCKS]
    if not found:
        if _is_moe(model) and not any(isinstance(m, HFMoEBlock) for m in model.modules()):
            _refuse_uncovered(model)
        return []
    if config.hidden_act not in _SILU:
        raise NotImplementedError(f"adopt_moe_blocks: hidden_act={config.hidden_act!r} is not supported; the "
                                  f"grouped experts compute SwiGLU ({' or '.join(_SILU)})")
    for name, block in found:
        semantics = BLOCKS[type(block)](block)
        order = tuple(child for child, _ in block.named_children())
        new = HFMoEBlock(block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj, semantics, order)
        new.train(block.training)
        parent_name, _, child = name.rpartition(".")
        model.get_submodule(parent_name).register_module(child, new)
        # The CausalLM forward reads the router logits of every layer from this hook (output_router_logits).
        install_output_capuring_hook(new.gate.logits_out, "router_logits", 0)
    return [name for name, _ in found]
