"""Pipeline stages of an adapted Hugging Face causal LM, from its config's `base_model_pp_plan`: the plan's modules
before `layers` (the embedding) on the first stage, a slice of the layers on each, the modules after `layers` (the
final norm) and the causal LM's head on the last (with what the model's forward does to the head's logits: its
scaling or softcapping, read from its source by moe_lst.models.hf.model.logit_transform), all under the model's own
names, for the runtime's pipeline (zero.parallel.pipeline)."""

from __future__ import annotations

import inspect
import math
import re

import torch
from moe_lst.kernels.documents import Documents
from moe_lst.models.hf import attention as hf_attn
from torch import nn

from zero.contract import ContractError, ModelContract
from zero.dist import comm
from zero.plan import AttachedLossScale, attach_loss

#: The plan's name for the repeated layers (every base_model_pp_plan of transformers names them so).
LAYERS = "layers"
#: Modules of the base model outside its pp plan that a stage may share: they hold buffers only (rotary tables).
ROTARY = "rotary_emb"


#: The keyword arguments a stage gives (or leaves at their defaults for) the layers it calls.
LAYER_ARGUMENTS = {"attention_mask", "position_ids", "cache", "past_key_values", "use_cache", "cache_position",
                   "position_embeddings"}


def layer_arguments(base_class: type) -> set[str]:
    """The keyword arguments `base_class`'s forward passes to its layers (`decoder_layer(...)`), read from its source
    (empty where it cannot be read)."""
    try:
        source = inspect.getsource(base_class.forward)
    except (OSError, TypeError):
        return set()
    start = source.find("decoder_layer(")
    if start < 0:
        return set()
    depth, end = 0, len(source)
    for k in range(start + len("decoder_layer"), len(source)):
        depth += {"(": 1, ")": -1}.get(source[k], 0)
        if depth == 0:
            end = k
            break
    return set(re.findall(r"(\w+)\s*=(?!=)", source[start:end]))


def stage_plan(model) -> tuple[list[str], list[str]]:
    """(the base model's modules before the layers, those after them) as the config's base_model_pp_plan orders
    them; ContractError in one line naming what keeps the model from being staged."""
    config = model.config
    plan = getattr(config, "base_model_pp_plan", None) or {}

    def refuse(why: str) -> ContractError:
        return ContractError(f"pipeline_stage: {config.model_type} declares base_model_pp_plan "
                             f"({', '.join(plan) or 'none'}), but {why}")

    if not plan:
        raise refuse("there is no plan to map")
    names = list(plan)
    if LAYERS not in names:
        raise refuse(f"it names no `{LAYERS}`")
    base, prefix = model.base, model.causal_lm.base_model_prefix
    layers = getattr(base, LAYERS, None)
    blocks = [m for _, m in model.blocks()]
    if not isinstance(layers, nn.ModuleList) or list(layers) != blocks:
        raise refuse(f"{prefix}.{LAYERS} is not the list of its repeated layers")
    if model.logit_fn is None:
        raise refuse(f"its forward changes the logits after the head ({model.logit_statements}) in a way the last "
                     "stage does not repeat")
    extra = sorted(layer_arguments(type(base)) - LAYER_ARGUMENTS)
    if extra:
        raise refuse(f"its base model gives its layers {', '.join(extra)}, which a stage does not")
    for name, child in base.named_children():
        if name not in names and name != ROTARY and any(True for _ in child.parameters()):
            raise refuse(f"{prefix}.{name} holds parameters outside the plan")
        if name not in names and name not in (ROTARY, LAYERS) and any(True for _ in child.buffers()):
            raise refuse(f"{prefix}.{name} holds buffers outside the plan (only {ROTARY} is shared by stages)")
    for name in names:
        if name != LAYERS and getattr(base, name, None) is None:
            raise refuse(f"{prefix}.{name} is not a module of the base model")
    at = names.index(LAYERS)
    return names[:at], names[at + 1:]


class HFPipelineStage(nn.Module, ModelContract):
    """Layers `layers` of an adapted causal LM (moe_lst.models.hf.HFCausalLM) as one pipeline stage, its modules
    under the model's names (`model.embed_tokens`, `model.layers.{i}`, `model.norm`, `lm_head`); the base model's
    rotary embedding (buffers only) on every stage. With a tied head the last stage also holds the embedding, so
    the pipeline keeps one copy per end and sums their gradients.

    forward(x, position_ids, packed=False): token ids on the first stage, else the hidden states from the stage
    before; returns hidden states, or logits (vocabulary-sliced under tensor parallelism, the model's own transform
    applied) on the last stage. The layers are called as the base model calls them: hidden states, no attention mask
    (the adapter's attention is causal, with each layer's window), position ids and, where the base model has one,
    the rotary embedding's tables of those positions.

    With a balancing loss (moe_lst.models.hf.balance) the activation sent on carries, after the hidden states,
    `stats_rows` more positions holding the micro-batch's per-expert sums over the layers so far (top-k counts,
    rows, and routing probabilities, these differentiable): each stage adds its own, and the last computes the
    loss over every layer from them, exactly as one process; the gradient of the probability sums comes back with
    the activation's."""

    def __init__(self, model, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        before, after = stage_plan(model)
        self.first, self.last, self.before, self.after = first, last, before, after
        self.balance = model.balance
        self.logit_fn = model.logit_fn  # (the model's own scaling / softcapping of the head's logits, elementwise)
        base, prefix = model.base, model.causal_lm.base_model_prefix
        self.prefix = prefix
        inner = nn.Module()  # holds the base model's modules of this stage, under their names
        head = model.causal_lm.get_output_embeddings()
        tied = head.weight is base.get_input_embeddings().weight
        for name in before if first or (last and tied) else ():
            inner.add_module(name, getattr(base, name))
        inner.add_module(LAYERS, nn.ModuleDict({str(i): base.layers[i] for i in layers}))
        for name in after if last else ():
            inner.add_module(name, getattr(base, name))
        rotary = getattr(base, ROTARY, None)
        self.layer_types: list[str] | None = None
        if isinstance(rotary, nn.Module):
            inner.add_module(ROTARY, rotary)
            if "layer_type" in inspect.signature(rotary.forward).parameters:
                self.layer_types = list(model.config.layer_types)
        self.add_module(prefix, inner)
        head_name = next(n for n, m in model.causal_lm.named_children() if m is head)
        self.head_name = head_name
        if last:
            self.add_module(head_name, head)

    def blocks(self) -> list[tuple[str, nn.Module]]:
        return [(f"{self.prefix}.{LAYERS}.{i}", layer) for i, layer in self._inner().layers.items()]

    def _rotary_tables(self, x: torch.Tensor, position_ids: torch.Tensor) -> dict:
        """The rotary embedding's tables of these positions: {None: table}, or {layer type: table} where its forward
        takes the layer type (as base models with per-type rope parameters call it); {} without one."""
        rotary = getattr(self._inner(), ROTARY, None)
        if rotary is None:
            return {}
        if not self.layer_types:
            return {None: rotary(x, position_ids=position_ids)}
        return {kind: rotary(x, position_ids, kind) for kind in set(self.layer_types)}

    def _inner(self) -> nn.Module:
        return getattr(self, self.prefix)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None, packed: bool = False) -> torch.Tensor:
        if position_ids is None:
            raise ValueError("pipeline stages need position_ids beside their input (pass them to every stage)")
        inner = self._inner()
        balance, incoming = self.balance, None
        if balance is not None:
            balance.begin(self.training and torch.is_grad_enabled())
            if balance.stats is not None and not self.last:  # (the gradient its sums get back is already scaled)
                balance.stats.scale = AttachedLossScale(1.0)
            if not self.first:
                x, incoming = unpack_stats(x, balance.num_experts)
        if self.first:
            for name in self.before:
                x = getattr(inner, name)(x)
        kwargs = dict(attention_mask=None, position_ids=position_ids, use_cache=False)
        tables = self._rotary_tables(x, position_ids)
        if packed:
            kwargs["documents"] = Documents(position_ids)  # attention stays inside each packed document
        token = hf_attn.PACKED.set(packed)
        try:
            for i, layer in inner.layers.items():
                if tables:  # (per layer type where the base model keeps a table for each)
                    kwargs["position_embeddings"] = tables[self.layer_types[int(i)] if self.layer_types else None]
                out = layer(x, **kwargs)
                x = out[0] if isinstance(out, tuple) else out
        finally:
            hf_attn.PACKED.reset(token)
        if self.last:
            for name in self.after:
                x = getattr(inner, name)(x)
            x = self.logit_fn(getattr(self, self.head_name)(x))
            if balance is not None:
                x = _finish_balance(balance, x, incoming)
        elif balance is not None:
            x = _pass_balance(balance, x, incoming)
        return x.contiguous()  # sent to the next stage as it is


# ---------------------------------------------------------------------------- the balancing loss over stages
def stats_rows(num_experts: int, batch: int, hidden: int) -> int:
    """Positions appended to a [batch, s, hidden] activation for the sums of `num_experts` experts: E probability
    sums (in the activation's dtype, differentiable), then E counts and the row count as float32 bits (two
    elements each in a 16-bit dtype, so they stay exact), zero-padded."""
    return math.ceil((3 * num_experts + 2) / (batch * hidden))


def pack_stats(x: torch.Tensor, prob_sum: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """`x` [b, s, h] with the sums appended as `stats_rows` positions: `prob_sum` [E] (its gradient flows back
    through the concatenation), `exact` [E + 1] float32 (counts, rows)."""
    b, _, h = x.shape
    e = prob_sum.numel()
    bits = exact.to(x.dtype) if x.element_size() >= 4 else exact.contiguous().view(x.dtype)
    flat = torch.cat([prob_sum.to(x.dtype), bits.detach()])
    k = stats_rows(e, b, h)
    flat = torch.cat([flat, flat.new_zeros(b * k * h - flat.numel())])
    return torch.cat([x, flat.view(b, k, h)], dim=1)


def unpack_stats(x: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """(hidden states, (probability sums [E] float32, differentiable; counts and rows [E + 1] float32)) from an
    activation `pack_stats` made."""
    b, n, h = x.shape
    k = stats_rows(num_experts, b, h)
    flat = x[:, n - k:].reshape(-1)
    prob_sum = flat[:num_experts].float()
    if x.element_size() >= 4:
        exact = flat[num_experts:2 * num_experts + 1].detach().float()
    else:
        exact = flat[num_experts:3 * num_experts + 2].detach().clone().view(torch.float32)
    return x[:, :n - k].contiguous(), (prob_sum, exact)


class _Carry(torch.autograd.Function):
    """(hidden, a copy of this stage's probability sums) in forward; backward hands the gradient those sums get
    (from the stages after) to this stage's routers (`stats.grad_weights`) and makes the micro-batch's statistics
    the balancing loss's current ones again, for the layers a checkpoint recomputes in this backward (micro-batches
    interleave under a pipeline schedule). It follows every layer of the stage, so its backward runs before
    theirs."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, prob_sum: torch.Tensor, stats, balance) -> tuple[torch.Tensor, ...]:
        ctx.stats, ctx.balance = stats, balance
        return hidden.view_as(hidden), prob_sum.clone()

    @staticmethod
    def backward(ctx, grad_hidden: torch.Tensor, grad_prob: torch.Tensor):
        ctx.stats.grad_weights = grad_prob.float()
        ctx.balance.stats = ctx.stats
        return grad_hidden, None, None, None


class _Resume(torch.autograd.Function):
    """The last stage's output unchanged; backward makes its micro-batch's statistics the balancing loss's current
    ones again (as _Carry), before any of its layers is recomputed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, stats, balance) -> torch.Tensor:
        ctx.stats, ctx.balance = stats, balance
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.balance.stats = ctx.stats
        return grad, None, None


def _pass_balance(balance, x: torch.Tensor, incoming) -> torch.Tensor:
    """A stage before the last: its sums added to those received, appended to its hidden states."""
    e = balance.num_experts
    s = balance.stats
    prob_sum = torch.zeros(e, dtype=torch.float32, device=x.device)
    exact = torch.zeros(e + 1, dtype=torch.float32, device=x.device)
    if s is not None:
        if s.rows:
            exact = torch.cat([s.counts, s.prob_sum.new_tensor([float(s.rows)])]).to(x.device)
        x, own = _Carry.apply(x, s.prob_sum.to(x.device), s, balance)
        prob_sum = prob_sum + own
    if incoming is not None:
        prob_sum, exact = prob_sum + incoming[0], exact + incoming[1]
    balance.stats = None  # (this micro-batch's forward is done; the next begins its own)
    return pack_stats(x, prob_sum, exact)


def _finish_balance(balance, logits: torch.Tensor, incoming) -> torch.Tensor:
    """The last stage: the loss over every stage's sums (as BalancingLoss.finish over one process's layers), its
    gradient to this stage's routers and, through the logits, into the sums received."""
    s, e = balance.stats, balance.num_experts
    balance.stats = None
    if s is None:
        return logits
    counts, prob_sum = s.counts.to(logits.device), s.prob_sum.to(logits.device)
    rows = torch.tensor([float(s.rows)], device=logits.device)
    if incoming is not None:
        counts, rows = counts + incoming[1][:e], rows + incoming[1][e:]
        prob_sum = prob_sum + incoming[0].detach()
    totals = torch.cat([counts, prob_sum, rows])
    comm.all_reduce(totals, balance.sp_group)
    counts, prob_sum, rows = totals[:e], totals[e:-1], totals[-1]
    if not float(rows):
        return logits
    s.grad_weights = balance.coef * e * counts / rows**2
    balance.last_value = float(torch.sum((counts / rows) * (prob_sum / rows)) * e)
    if incoming is not None and incoming[0].requires_grad:
        logits = attach_loss(logits, torch.sum(s.grad_weights * incoming[0]), balance.scale)
    return _Resume.apply(logits, s, balance) if logits.requires_grad else logits


def pipeline_shapes(model, tokens_shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(activation between stages, last stage's output) for a micro-batch of tokens [b, s]: hidden [b, s / tp,
    hidden_size] (sequence-parallel shards under tensor parallelism; with a balancing loss `stats_rows` more positions
    carry its sums) and logits [b, s, vocab / tp]."""
    b, s = tokens_shape
    local_vocab = model.output_weight.shape[0]
    tp = model.config.vocab_size // local_vocab
    hidden = model.config.hidden_size
    extra = 0 if model.balance is None else stats_rows(model.balance.num_experts, b, hidden)
    return (b, s // tp + extra, hidden), (b, s, local_vocab)
