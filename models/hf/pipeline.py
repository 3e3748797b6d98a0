"""Pipeline stages of an adapted Hugging Face causal LM, from its config's `base_model_pp_plan`: the plan's modules
before `layers` (the embedding) on the first stage, a slice of the layers on each, the modules after `layers` (the
final norm) and the causal LM's head on the last, all under the model's own names, for the runtime's pipeline
(zero.parallel.pipeline)."""

from __future__ import annotations

import inspect

import torch
from moe_lst.kernels.documents import Documents
from moe_lst.models.hf import attention as hf_attn
from torch import nn

from zero.contract import ContractError, ModelContract

#: The plan's name for the repeated layers (every base_model_pp_plan of transformers names them so).
LAYERS = "layers"
#: Modules of the base model outside its pp plan that a stage may share: they hold buffers only (rotary tables).
ROTARY = "rotary_emb"


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
    if model.balance is not None:
        raise refuse("its balancing loss (load_balancing_loss_func over every layer's router logits at once) does "
                     "not split over stages; set output_router_logits=false to stage it")
    if not model.plain_head:
        raise refuse("its logits are changed after the head (softcapping or scaling), which a stage does not repeat")
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
    before; returns hidden states, or logits (vocabulary-sliced under tensor parallelism) on the last stage. The
    layers are called as the base model calls them: hidden states, no attention mask (the adapter's attention is
    causal, with each layer's window), position ids and, where the base model has one, the rotary embedding's
    tables of those positions."""

    def __init__(self, model, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        before, after = stage_plan(model)
        self.first, self.last, self.before, self.after = first, last, before, after
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
            x = getattr(self, self.head_name)(x)
        return x.contiguous()  # sent to the next stage as it is


def pipeline_shapes(model, tokens_shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(activation between stages, last stage's output) for a micro-batch of tokens [b, s]: hidden [b, s / tp,
    hidden_size] (sequence-parallel shards under tensor parallelism) and logits [b, s, vocab / tp]."""
    b, s = tokens_shape
    local_vocab = model.output_weight.shape[0]
    tp = model.config.vocab_size // local_vocab
    return (b, s // tp, model.config.hidden_size), (b, s, local_vocab)
