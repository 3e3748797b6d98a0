"""transformers' MoE balancing loss (`load_balancing_loss_func`: Switch Transformer's, over every layer's router
at once) for an adapted model, built from each router's logits (the output transformers records as
`router_logits`) as the layers run, so that it survives activation
checkpointing (a recomputed layer is not counted twice and still gets its gradient) and covers the whole
sequences of a Ulysses group.

The loss is E * sum_e (C_e / R) * (P_e / R): C_e the top-k choices of expert e and P_e its routing probabilities
summed over every layer's tokens, R the number of (layer, token) rows. C is not differentiable, so the gradient
into a layer's probability sums is coef * E * C / R^2, known once every layer has run: each layer's router input
carries a node whose backward sends exactly that (scaled like the main loss), whatever order backward takes: it
rides on the router's gate weights (the output its block uses), so it reaches the logits and the router's weight.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from zero.dist import comm
from zero.plan import AttachedLossScale, attach_loss


class _Statistics:
    """The counts of one training forward: per expert top-k choices and probability sums, and rows."""

    def __init__(self, num_experts: int, device: torch.device) -> None:
        self.counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
        self.prob_sum = torch.zeros(num_experts, dtype=torch.float32, device=device)
        self.rows = 0
        self.grad_weights: torch.Tensor | None = None  # d loss / d (one layer's probability sums), once finished
        #: the factor its routers' gradient nodes take (None: the loss's); a pipeline stage before the last sets 1,
        #: as the gradient it receives for its sums is already scaled (moe_lst.models.hf.pipeline)
        self.scale: AttachedLossScale | None = None


class _DeferredGrad(torch.autograd.Function):
    """Zero in forward; backward sends `grad * stats.grad_weights` into a layer's probability sums."""

    @staticmethod
    def forward(ctx, prob_sum: torch.Tensor, stats: _Statistics, share: float) -> torch.Tensor:
        ctx.stats, ctx.share = stats, share
        return prob_sum.new_zeros(())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.stats.grad_weights * ctx.share, None, None


def router_modules(causal_lm: nn.Module) -> tuple[list[nn.Module], int]:
    """(the modules whose output transformers records as `router_logits`, the index of the logits in it), from the
    model's `_can_record_outputs`; NotImplementedError where the model records none."""
    base = causal_lm.get_submodule(causal_lm.base_model_prefix)
    recorder = (getattr(base, "_can_record_outputs", None) or {}).get("router_logits")
    if recorder is None:
        raise NotImplementedError(f"{type(causal_lm).__name__} records no router_logits: its balancing loss "
                                  "(output_router_logits) is not supported; set router_aux_loss_coef=0")
    cls = getattr(recorder, "target_class", recorder)
    index = getattr(recorder, "index", 0) or 0
    routers = [m for m in causal_lm.modules() if isinstance(m, cls)] if isinstance(cls, type) else []
    if not routers:
        raise NotImplementedError(f"{type(causal_lm).__name__}: no router module records router_logits")
    return routers, index


#: The attributes a transformers causal LM's own __init__ sets to the factor its forward scales the balancing loss by
#: (from whichever config key holds it: router_aux_loss_coef, JetMoE's aux_loss_coef, DBRX's
#: ffn_config.moe_loss_weight), and to its routers' top-k.
COEFFICIENT_ATTRIBUTES = ("router_aux_loss_coef", "aux_loss_coef")
TOP_K_ATTRIBUTES = ("num_experts_per_tok",)


def _number(causal_lm: nn.Module, names: tuple[str, ...]) -> float | int | None:
    for name in names:
        for owner in (causal_lm, causal_lm.config):
            value = getattr(owner, name, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return value
    return None


def _required(causal_lm: nn.Module, names: tuple[str, ...], what: str) -> int | float:
    """The first of `names` the causal LM holds as a number (else its config's); NotImplementedError naming `what`
    is not known where it holds none of them."""
    value = _number(causal_lm, names)
    if value is None:
        raise NotImplementedError(f"{type(causal_lm).__name__} holds none of {', '.join(names)}: {what} is not "
                                  "known")
    return value


def balancing_coefficient(causal_lm: nn.Module) -> float:
    """The factor a causal LM's forward scales its balancing loss (`aux_loss`) by: the value its __init__ read into
    `router_aux_loss_coef` or `aux_loss_coef` (else the config's key of that name); NotImplementedError where it has
    none of them."""
    return float(_required(causal_lm, COEFFICIENT_ATTRIBUTES, "the factor its balancing loss is scaled by"))


def balancing_top_k(causal_lm: nn.Module) -> int:
    """The top-k a causal LM's balancing loss counts (its `num_experts_per_tok`, else the config's)."""
    return int(_required(causal_lm, TOP_K_ATTRIBUTES, "the top-k its balancing loss counts"))


def balancing_num_experts(causal_lm: nn.Module) -> int:
    """The number of experts a causal LM's balancing loss counts over (its `num_experts`, JetMoE's from
    num_local_experts, else the config's num_local_experts, num_experts or n_routed_experts)."""
    return int(_required(causal_lm, ("num_experts", "num_local_experts", "n_routed_experts"),
                         "the number of experts its balancing loss counts over"))


def records_router_logits(causal_lm: nn.Module) -> bool:
    """Whether the causal LM's base model records its routers' output as `router_logits` (what its forward's
    balancing loss is computed from)."""
    base = causal_lm.get_submodule(causal_lm.base_model_prefix)
    return (getattr(base, "_can_record_outputs", None) or {}).get("router_logits") is not None


def forward_adds_balancing_loss(causal_lm: nn.Module) -> bool:
    """Whether the causal LM's forward computes transformers' balancing loss (calls its load_balancing_loss_func):
    JetMoE's does; Llama 4's records its routers' logits and adds none."""
    try:
        source = inspect.getsource(type(causal_lm).forward)
    except (OSError, TypeError):  # (no source to read: not known to add one)
        return False
    return "load_balancing_loss_func(" in source


class BalancingLoss:
    """Hooks on the routers of a model's MoE blocks (their output holds the logits [N, E] at `logits_index`) that
    add `coef` times transformers' balancing loss to its training gradient. Call `begin()` before each forward
    and `finish()` after it; `scale` is the engine's loss-scale hook (zero.Plan.loss_scale_hooks)."""

    def __init__(self, routers: list[nn.Module], num_experts: int, top_k: int, coef: float,
                 sp_group: ProcessGroup | None = None, logits_index: int = 0) -> None:
        self.num_experts, self.top_k, self.coef, self.sp_group = num_experts, top_k, coef, sp_group
        self.scale = AttachedLossScale()
        self.stats: _Statistics | None = None
        self.last_value: float | None = None  # the loss (without coef) of the last training forward
        self.logits_index = logits_index
        #: the share of the loss's gradient this rank's routers take: 1/tp under expert tensor parallelism, where tp
        #: ranks compute the same loss from the same full-sequence logits and their router gradients are summed
        self.grad_share = 1.0
        for router in routers:
            router.register_forward_hook(self._after_router)

    def begin(self, training: bool) -> None:
        """A forward starts: a training one (gradient on) counts, any other leaves the routers alone."""
        self.stats = _Statistics(self.num_experts, torch.device("cpu")) if training else None

    def finish(self) -> None:
        """Every layer has run: sum the counts over the sequence's ranks and fix each layer's gradient."""
        s = self.stats
        if s is None or not s.rows:
            return
        device = s.counts.device
        totals = torch.cat([s.counts, s.prob_sum, torch.tensor([float(s.rows)], device=device)])
        comm.all_reduce(totals, self.sp_group)
        counts, prob_sum, rows = totals[:self.num_experts], totals[self.num_experts:-1], totals[-1]
        s.grad_weights = self.coef * self.num_experts * counts / rows**2
        self.last_value = float(torch.sum((counts / rows) * (prob_sum / rows)) * self.num_experts)

    def _after_router(self, router: nn.Module, args: tuple, output):
        """Count the router's choices (in the forward) and give its gate weights the node that brings the loss's
        gradient (whenever the router runs with gradient: the forward, or a checkpointed layer's recomputation)."""
        s = self.stats
        if s is None:
            return None
        outputs = list(output) if isinstance(output, tuple) else [output]
        logits = outputs[self.logits_index]
        probs = F.softmax(logits.reshape(-1, logits.shape[-1]), dim=-1)  # as load_balancing_loss_func
        if s.grad_weights is None:  # the forward (a checkpointed layer's recomputation in backward comes later)
            if s.counts.device != probs.device:
                s.counts, s.prob_sum = s.counts.to(probs.device), s.prob_sum.to(probs.device)
            chosen = torch.topk(probs, self.top_k, dim=-1).indices
            s.counts += torch.bincount(chosen.reshape(-1), minlength=self.num_experts).float()
            s.prob_sum += probs.detach().float().sum(dim=0)
            s.rows += probs.shape[0]
        if not (torch.is_grad_enabled() and probs.requires_grad):
            return None  # (a checkpointed layer's first pass: its recomputation carries the gradient)
        surrogate = _DeferredGrad.apply(probs.float().sum(dim=0), s, self.grad_share)
        carrier = next((i for i, t in enumerate(outputs) if i != self.logits_index and torch.is_tensor(t)
                        and t.is_floating_point() and t.requires_grad), self.logits_index)
        outputs[carrier] = attach_loss(outputs[carrier], surrogate, self.scale if s.scale is None else s.scale)
        return tuple(outputs) if isinstance(output, tuple) else outputs[0]
