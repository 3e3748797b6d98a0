"""The adapter: any transformers causal LM behind the model contract (zero.contract), with its own module and
parameter names (the causal LM's children under their names: `model.layers.{i}...`, `lm_head.weight`), so its
state dict is Hugging Face's.

It works through transformers' own interfaces rather than per model type:
- attention through AttentionInterface (moe_lst.models.hf.attention): every module whose forward dispatches
  through it calls its own swappable contract function (dense attention, Ulysses, block-sparse), sliding windows
  and sinks honoured, anything else refused by name; Hugging Face's rotary embedding is applied before it, from
  the position ids the forward is given (global ones under Ulysses), and packed documents reach it as `documents`;
- experts through ExpertsInterface (moe_lst.models.hf.experts): the model's router kept, this project's dispatch,
  grouped GEMMs and expert parallelism behind it;
- the blocks (ZeRO-3 units, checkpointing) are the modules of the classes its `_no_split_modules` names;
- the balancing loss is the model's own (`router_aux_loss_coef * load_balancing_loss_func` over its routers'
  logits, moe_lst.models.hf.balance) where its config asks for it.
"""

from __future__ import annotations

import copy
import inspect
import math
import re
import zlib
from collections.abc import Callable
from unittest import mock

import torch
import torch.nn as nn
from moe_lst.kernels.attention import attention
from moe_lst.kernels.documents import Documents
from moe_lst.kernels.positions import position_ids_for
from moe_lst.models.hf import attention as hf_attn
from moe_lst.models.hf.attention import ATTENTION, attention_of, hf_attention, hf_dense_attention, set_attention
from moe_lst.models.hf.balance import (BalancingLoss, balancing_coefficient, balancing_num_experts, balancing_top_k,
                                       forward_adds_balancing_loss, records_router_logits, router_modules)
from moe_lst.models.hf.experts import adopt_experts, expert_tensor_parallel, is_experts
from moe_lst.models.hf.structure import (attention_modules, blocks_outside_attention, decoder_blocks,
                                        positions_from_length)
from moe_lst.models.init_replay import Fill, Replay
from torch.distributed import ProcessGroup
from transformers import AutoModelForCausalLM, PreTrainedConfig, PreTrainedModel

import zero
from zero.contract import AttentionSite, ContractError, ModelContract
from zero.plan import Placement

__all__ = ["ATTENTION", "HFCausalLM", "build", "hf_attention", "moe_supported"]


def moe_supported() -> bool:
    """Whether MoE configs can be built: their experts run through moe_lst.models.hf.experts (always)."""
    return True


#: A causal LM forward whose logits are the head applied to the last hidden states, nothing after it (no
#: softcapping or scaling): only then is `return_hidden=True` (tiled losses apply `output_weight`) offered.
_PLAIN_HEAD = re.compile(r"logits\s*=\s*self\.lm_head\(hidden_states(\[:, slice_indices, :\])?\)\s*\n"
                         r"(\s*\n)*\s*loss\s*=\s*None")


def plain_head(causal_lm: PreTrainedModel) -> bool:
    """Whether `causal_lm`'s logits are lm_head(last hidden states) and nothing more."""
    try:
        return bool(_PLAIN_HEAD.search(inspect.getsource(type(causal_lm).forward)))
    except (OSError, TypeError):
        return False


#: The statements a causal LM forward runs on its logits after the head (comments and blank lines dropped, spaces
#: collapsed; `{head}` the head's call) that the adapter repeats elementwise (on a stage's or a vocabulary slice's
#: logits), each with the transform of (causal_lm, logits): the scales and softcappings transformers' families use.
_LOGIT_FORMS: dict[tuple[str, ...], Callable[[PreTrainedModel, torch.Tensor], torch.Tensor]] = {
    ("logits = {head}",): lambda lm, x: x,
    ("logits = {head}.contiguous()",): lambda lm, x: x,
    ("logits = {head}", "logits = logits * self.logit_scale"): lambda lm, x: x * lm.logit_scale,
    ("logits = {head}", "logits = logits / self.config.logits_scaling"): lambda lm, x: x / lm.config.logits_scaling,
    ("logits = {head} * self.config.logits_scaling",): lambda lm, x: x * lm.config.logits_scaling,
    ("logits = {head}", "if self.config.final_logit_softcapping is not None:",
     "logits = logits / self.config.final_logit_softcapping", "logits = torch.tanh(logits)",
     "logits = logits * self.config.final_logit_softcapping"): lambda lm, x: _softcap(x, lm.config, False),
    ("logits = {head}", "if self.config.final_logit_softcapping is not None:",
     "logits = logits.float() / self.config.final_logit_softcapping", "logits = torch.tanh(logits)",
     "logits = logits * self.config.final_logit_softcapping"): lambda lm, x: _softcap(x, lm.config, True),
}
_HEAD_CALL = re.compile(r"self\.lm_head\(hidden_states(\[:, slice_indices, :\])?\)")


def _softcap(logits: torch.Tensor, config: PreTrainedConfig, to_float: bool) -> torch.Tensor:
    cap = config.final_logit_softcapping
    if cap is None:
        return logits
    return torch.tanh((logits.float() if to_float else logits) / cap) * cap


def _forward_lines(causal_lm: PreTrainedModel) -> list[str] | None:
    """The lines of `causal_lm`'s forward, comments and blank lines dropped and spaces collapsed (None where its
    source cannot be read)."""
    try:
        source = inspect.getsource(type(causal_lm).forward)
    except (OSError, TypeError):
        return None
    lines = [re.sub(r"\s+", " ", line.split("#", 1)[0]).strip() for line in source.splitlines()]
    return [line for line in lines if line]


def logit_transform(causal_lm: PreTrainedModel) -> tuple[Callable[[torch.Tensor], torch.Tensor] | None, str]:
    """(what `causal_lm`'s forward does to the head's logits, as a function of them, or None where it is none of the
    known elementwise forms; the statements it runs after the head, as read, for a refusal)."""
    lines = _forward_lines(causal_lm)
    if lines is None:
        return None, "its forward's source cannot be read"
    at = next((k for k, line in enumerate(lines) if _HEAD_CALL.search(line) and line.startswith("logits =")), None)
    if at is None:
        return None, "no `logits = self.lm_head(hidden_states)` in its forward"
    end = next((k for k in range(at, len(lines)) if lines[k] == "loss = None"), None)
    if end is None:
        return None, "no `loss = None` after its head in its forward"
    statements = (_HEAD_CALL.sub("{head}", lines[at]), *lines[at + 1:end])
    form = _LOGIT_FORMS.get(statements)
    if form is None:
        return None, "; ".join(statements[1:] or statements)
    return (lambda logits: form(causal_lm, logits)), "; ".join(statements)


#: Statements a causal LM forward runs on the base model's hidden states before its head that the adapter repeats
#: (spaces collapsed), each with the transform of (causal_lm, hidden states); the slicing to `logits_to_keep` (all
#: positions here) is left out.
_HEAD_INPUT_FORMS: dict[str, Callable[[PreTrainedModel, torch.Tensor], torch.Tensor]] = {
    "hidden_states = hidden_states / self.config.logits_scaling": lambda lm, h: h / lm.config.logits_scaling,
}
_KEEP_SLICE = re.compile(r"hidden_states = slice_logits_to_keep\(hidden_states, logits_to_keep\)|"
                         r"slice_indices = .*|if hidden_states\.shape\[1\] == .*:")
#: Where a causal LM forward takes the base model's last hidden states (`outputs.last_hidden_state`,
#: `transformer_outputs[0]`, sliced to logits_to_keep or not).
_LAST_HIDDEN = re.compile(r"hidden_states = (slice_logits_to_keep\()?\w+(\.last_hidden_state|\[0\])")


def head_input_transform(causal_lm: PreTrainedModel) -> tuple[Callable[[torch.Tensor], torch.Tensor] | None, str]:
    """(what `causal_lm`'s forward does to the base model's last hidden states before its head, as a function of
    them (the identity where nothing), or None where it is not one of _HEAD_INPUT_FORMS; those statements, for a
    refusal)."""
    lines = _forward_lines(causal_lm)
    if lines is None:
        return None, "its forward's source cannot be read"
    head = next((k for k, line in enumerate(lines) if _HEAD_CALL.search(line)), None)
    start = max((k for k, line in enumerate(lines[:head or 0]) if _LAST_HIDDEN.match(line)), default=None)
    if start is None:
        return None, "no `hidden_states = outputs.last_hidden_state` before its head in its forward"
    statements = [line for line in lines[start + 1:head] if not _KEEP_SLICE.fullmatch(line)]
    unknown = [line for line in statements if line not in _HEAD_INPUT_FORMS]
    if unknown:
        return None, "; ".join(unknown)
    forms = [_HEAD_INPUT_FORMS[line] for line in statements]

    def transform(hidden: torch.Tensor) -> torch.Tensor:
        for form in forms:
            hidden = form(causal_lm, hidden)
        return hidden

    return transform, "; ".join(statements)


def head_problem(causal_lm: PreTrainedModel) -> str | None:
    """None where `causal_lm`'s logits are its head applied to the base model's last hidden states and nothing more
    under its config (what a tiled loss computes from the hidden states: a known logit transform that leaves the
    logits as they are counts, e.g. Gemma's softcapping with final_logit_softcapping=None), else what it does
    beyond that (one phrase, for a refusal)."""
    head_fn, head_statements = head_input_transform(causal_lm)
    if head_fn is None or head_statements:
        return f"it changes the hidden states before its head ({head_statements})"
    if plain_head(causal_lm):
        return None
    logit_fn, statements = logit_transform(causal_lm)
    if logit_fn is not None:
        probe = torch.linspace(-3.0, 3.0, 13)
        try:
            if torch.equal(logit_fn(probe), probe):
                return None
        except (RuntimeError, TypeError, NotImplementedError):  # (a transform by a parameter on the meta device)
            pass
    return f"it changes its logits after the head ({statements})"


def chunked_layers_problem(causal_lm: PreTrainedModel) -> str | None:
    """None where the config sets no attention_chunk_size, or where the attention modules of exactly the layers its
    `layer_types` calls "chunked_attention" (transformers builds those layers' chunked mask) read it
    (moe_lst.models.hf.attention.chunk_size_of); else why not (one phrase)."""
    config = causal_lm.config
    if not getattr(config, "attention_chunk_size", None):
        return None
    types = getattr(config, "layer_types", None)
    if not isinstance(types, (list, tuple)):
        return "its config has no layer_types to say which layers are chunked"
    chunked = {i for i, kind in enumerate(types) if kind == "chunked_attention"}
    read = {m.layer_idx for _, m in attention_modules(causal_lm) if hf_attn.chunk_size_of(m) is not None}
    if read != chunked:
        return (f"its attention modules read chunks for layers {sorted(read)}, but layer_types makes layers "
                f"{sorted(chunked)} chunked")
    return None


def _fix_base_model_prefix(causal_lm: PreTrainedModel) -> None:
    """Name the base model where the class's base_model_prefix names no child (Llama4ForCausalLM says
    "language_model", the prefix of the multimodal model, and holds its text model as `model`): the one child that
    is a PreTrainedModel, set on this instance only, so everything reading the prefix finds it."""
    prefix = causal_lm.base_model_prefix
    if prefix in causal_lm._modules:
        return
    bases = [n for n, child in causal_lm.named_children() if isinstance(child, PreTrainedModel)]
    if len(bases) == 1:
        causal_lm.base_model_prefix = bases[0]


def structure_problems(causal_lm: PreTrainedModel) -> list[str]:
    """What keeps the adapter from running `causal_lm` (empty when nothing does), each a short phrase."""
    problems = []
    blocks = decoder_blocks(causal_lm)
    if not blocks:
        kinds = getattr(causal_lm, "_no_split_modules", None)
        problems.append(f"no repeated layers named by _no_split_modules ({kinds})")
    sites = attention_modules(causal_lm)
    if not sites:
        problems.append("no attention module dispatches through transformers' AttentionInterface")
    inside = [n for n, _ in sites if not any(n.startswith(b + ".") for b, _ in blocks)]
    if blocks and inside:
        problems.append(f"attention {inside[0]} is outside the repeated layers")
    if causal_lm.get_output_embeddings() is None:
        problems.append("no output embedding (lm head)")
    return problems


#: Routers whose choice of experts in training is a random draw per call (not a function of the weights and input).
SAMPLED_ROUTING = {"PhimoeTopKRouter": "samples its experts in training (sparsemixer's Gumbel draws, new per call)"}


def _refuse_uncovered(causal_lm: PreTrainedModel) -> None:
    """NotImplementedError in one line naming what of `causal_lm` the adapter does not cover: its structure, routing
    that samples, chunked attention it cannot place, a sparse attention's indexer."""
    config = causal_lm.config
    problems = structure_problems(causal_lm)
    if problems:
        raise NotImplementedError(f"model_type={config.model_type!r} ({type(causal_lm).__name__}) is not covered "
                                  f"by the Hugging Face adapter: {'; '.join(problems)}")
    sampled = next((m for m in causal_lm.modules() if type(m).__name__ in SAMPLED_ROUTING), None)
    if sampled is not None:
        raise NotImplementedError(f"model_type={config.model_type!r}: {type(sampled).__name__} "
                                  f"{SAMPLED_ROUTING[type(sampled).__name__]}: not supported")
    chunk_problem = chunked_layers_problem(causal_lm)
    if chunk_problem:
        raise NotImplementedError(f"model_type={config.model_type!r}: attention_chunk_size="
                                  f"{config.attention_chunk_size} (chunked attention, through the mask): "
                                  f"{chunk_problem}: not supported")
    indexer = next((m for m in causal_lm.modules() if type(m).__name__.endswith("Indexer")), None)
    if indexer is not None:
        raise NotImplementedError(f"model_type={config.model_type!r}: {type(indexer).__name__} (a sparse "
                                  "attention's top-k indexer) needs an attention mask: not supported")


def _balancing_loss(causal_lm: PreTrainedModel, adopted: bool, sp_group: ProcessGroup | None) -> BalancingLoss | None:
    """The balancing loss where the causal LM's forward adds one: its routers' logits recorded, scaled by the factor
    the causal LM reads, for adopted ExpertsInterface experts (`adopted`) or, where the forward computes
    load_balancing_loss_func, the model's own (JetMoE's); None for a model that holds no such factor (DeepSeek-V3)
    or computes none (Llama 4)."""
    config = causal_lm.config
    if not (getattr(config, "output_router_logits", False) and records_router_logits(causal_lm)
            and (adopted or forward_adds_balancing_loss(causal_lm))):
        return None
    try:
        coef = balancing_coefficient(causal_lm)
    except NotImplementedError:
        return None
    if coef <= 0:
        return None
    routers, index = router_modules(causal_lm)
    experts = _num_experts(config, causal_lm) if adopted else balancing_num_experts(causal_lm)
    return BalancingLoss(routers, experts, balancing_top_k(causal_lm), coef, sp_group, logits_index=index)


class HFCausalLM(nn.Module, ModelContract):
    """A transformers causal LM under the model contract: blocks are its `_no_split_modules` layers, attention
    sites its AttentionInterface modules, MLP sites the blocks' dense `mlp` children; `init_parameter` is the
    model's own `_init_weights`, seeded per parameter name. Experts declared through ExpertsInterface run this
    project's dispatch and grouped GEMMs (moe_lst.models.hf.experts), their parent blocks moe.MoELayers for expert
    parallelism, keeping their names. Tensor parallelism maps the config's base_model_tp_plan, pipeline stages its
    base_model_pp_plan (moe_lst.models.hf.pipeline); each raises ContractError naming what a model lacks.

    An MoE config with `output_router_logits` trains with transformers' balancing loss, as its CausalLM forward
    adds it with labels (`router_aux_loss_coef * load_balancing_loss_func(...)`; moe_lst.models.hf.balance):
    its gradient joins the main loss's in training, scaled like it through `loss_plan()`'s hook, its statistics
    summed over `sp_group` (the ranks holding shards of the same sequences).

    forward(tokens [b, s], position_ids=None, return_hidden=False, packed=False) -> logits [b, s, vocab] (or the
    final-normed hidden states [b, s, dim], for losses that apply `output_weight` themselves, e.g. tiled)."""

    def __init__(self, causal_lm: PreTrainedModel, attention_fn: Callable[..., torch.Tensor] = attention,
                 init_seed: int | None = None, sp_group: ProcessGroup | None = None) -> None:
        super().__init__()
        config = causal_lm.config
        _fix_base_model_prefix(causal_lm)
        _refuse_uncovered(causal_lm)
        self.__dict__["causal_lm"] = causal_lm  # not a child: its children are ours, under the same names
        self.config = config
        for name, child in causal_lm.named_children():
            self.add_module(name, child)
        self.__dict__["base"] = causal_lm.get_submodule(causal_lm.base_model_prefix)  # (not a second child)
        #: what its forward does to the head's logits (None: not a known elementwise form), and those statements
        self.logit_fn, self.logit_statements = logit_transform(causal_lm)
        #: what it does to the last hidden states before the head (None: not a known form), and those statements
        self.head_input_fn, self.head_input_statements = head_input_transform(causal_lm)
        # (tiled losses get the base model's hidden states: only where the head is applied to them as they are)
        self.plain_head = head_problem(causal_lm) is None
        self.init_seed = torch.initial_seed() if init_seed is None else init_seed
        self.moe_blocks: tuple[str, ...] = ()
        #: (a meta build of an MoE model: the eager build's fills, replayed per parameter by init_parameter)
        self.replay: Replay | None = None
        self.fills: dict[str, Fill | None] = {}
        if any(is_experts(m) for m in causal_lm.modules()):
            self.moe_blocks = tuple(adopt_experts(causal_lm))
        self.balance = _balancing_loss(causal_lm, bool(self.moe_blocks), sp_group)
        causal_lm.set_attn_implementation(ATTENTION)
        if attention_fn is attention:
            attention_fn = hf_dense_attention  # the same, with sliding windows, sinks, softcaps and chunks
        self._sites = [n for n, _ in attention_modules(causal_lm)]
        self.outside_attention = blocks_outside_attention(causal_lm)
        self.positions_from_length = positions_from_length(causal_lm)
        for name in self._sites:
            set_attention(self.get_submodule(name), attention_fn)

    def loss_plan(self) -> zero.Plan:
        """For zero.initialize(plans=[...]): the balancing loss's gradient scaled like the main loss."""
        return zero.Plan("hf_balancing_loss", loss_scale_hooks=[self.balance.scale] if self.balance else [])

    @property
    def output_weight(self) -> torch.Tensor:
        """The head's weight [vocab, dim] (the embedding's when they are tied)."""
        return self.causal_lm.get_output_embeddings().weight

    # ------------------------------------------------------------------ the model contract (zero.contract)
    def tensor_parallel_styles(self, tp: int) -> dict:
        """The config's `base_model_tp_plan` on this runtime's tensor parallelism (zero.parallel.tensor, Megatron's
        sequence-parallel form): `colwise` projections split by output rows (whole heads: their units are the
        heads), `rowwise` ones by input columns with the output reduce-scattered to sequence shards,
        `replicated_with_grad_allreduce` modules (q / k norms over heads) replicated with their gradient summed,
        `colwise_gather_output` / `rowwise_split_input` with what runs between them replicated (see _plan_styles).
        Between blocks the hidden states are sequence shards: each layer child the plan splits gathers them at its
        entry; the layers' norms (wherever they sit: before, after or around attention and MLP) and the final norm
        run on the shards with their gradients summed, the final norm gathering the sequence for the head; a layer
        child the plan leaves whole (an attention with sinks, a linear attention, a short convolution) runs
        replicated on the gathered sequence, keeps its own shard of the output and sums its gradients. Inside a
        split child the modules the plan leaves out (e.g. MLA's latent projections and norms before the heads'
        split) run replicated on the gathered sequence, their gradients summed (or, between gathered and split
        features, whole on every rank). The embedding is vocabulary-parallel; the head column-parallel (an untied
        one) or the embedding's own local slice (a tied one), so the logits are vocabulary-sliced, the model's own
        elementwise transform (scaling, softcapping) applied to them; a head's own per-token parameters (a logit
        scale) take the same vocabulary slice, a layer's own per-channel parameters run on the shards with their
        gradients summed. Gemma's per-layer inputs are made over the whole sequence on every rank, each layer
        cutting its shard (_per_layer_input_styles). ContractError naming what is missing where a model does not fit
        this form."""
        config, kind = self.config, self.config.model_type
        plan = getattr(config, "base_model_tp_plan", None) or {}

        def refuse(why: str) -> ContractError:
            return ContractError(f"tensor_parallel_styles: {kind} declares base_model_tp_plan ({len(plan)} entries: "
                                 f"{', '.join(sorted(set(map(str, plan.values())))) or 'none'}), but {why}")

        if not plan:
            raise refuse("there is no plan to map")
        if self.logit_fn is None:
            raise refuse(f"its forward changes the logits after the head ({self.logit_statements}), which is not "
                         "known to be elementwise on a vocabulary slice")
        for key in ("num_attention_heads", "vocab_size", "intermediate_size"):
            value = getattr(config, key, None)
            if isinstance(value, int) and value % tp:
                raise refuse(f"tp={tp} does not divide {key}={value}")
        modules = dict(self.named_modules())
        styles = _plan_styles(self, plan, refuse)
        expert_tensor_parallel(self, styles, tp, refuse)  # (MoE blocks split by hidden units, shared experts inside)
        _layer_styles(self, styles, refuse)
        _end_styles(self, styles, tp, refuse)
        placed = {f"{n}.{p}" for n in styles
                  for p, _ in modules[n].named_parameters(recurse=getattr(styles[n], "places_submodules", False))}
        loose = [n for n, _ in self.named_parameters() if n not in placed]
        if loose:
            raise refuse(f"{loose[0]} is not placed by it")
        return styles

    def pipeline_stage(self, layers: range, first: bool, last: bool) -> nn.Module:
        """Layers `layers` as a stage from the config's base_model_pp_plan (moe_lst.models.hf.pipeline); a
        ContractError names what keeps a model from it."""
        from moe_lst.models.hf.pipeline import HFPipelineStage

        return HFPipelineStage(self, layers, first, last)

    def pipeline_shapes(self, tokens_shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        from moe_lst.models.hf.pipeline import pipeline_shapes

        return pipeline_shapes(self, tokens_shape)

    def blocks(self) -> list[tuple[str, nn.Module]]:
        return decoder_blocks(self.causal_lm)  # (the same modules, under the same names)

    def attention_sites(self) -> list[AttentionSite]:
        return [_site(name, self.get_submodule(name)) for name in self._sites]

    def mlp_sites(self) -> list[tuple[str, nn.Module]]:
        """The blocks' dense `mlp` children (the MoE blocks are not token-wise in the TiledMLP sense: their router
        statistics)."""
        sites = [(f"{name}.mlp", block.mlp) for name, block in self.blocks() if isinstance(getattr(block, "mlp", None),
                                                                                         nn.Module)]
        return [(name, module) for name, module in sites
                if name not in self.moe_blocks and not any(is_experts(m) for m in module.modules())]

    @torch.no_grad()
    def init_parameter(self, name: str, tensor: torch.Tensor, placement: Placement | None = None) -> None:
        """Fill `tensor` with parameter `name`'s initial values (with `placement`: its local slice of them). A
        dense model's: the model's `_init_weights` applied to a stand-in of the parameter's module that holds
        `tensor` (its other parameters on the meta device), on the CPU with the random generator seeded by
        (init_seed, name), so the order of calls and the device do not matter. An MoE model built on the meta
        device: the eager build's values, its random fill replayed (only the slice's rows where the fill allows)
        from where the global generator stood, or, for a parameter no fill gave its values, the stand-in's."""
        fill = self.fills.get(name) if self.replay is not None else None
        if fill is not None and not fill.patches:
            self.replay.values(fill.index, tensor, placement)
            return
        if fill is not None:  # (constants over parts of the fill, e.g. a padding row: the whole, patched, cut)
            whole = torch.empty(self.replay.draws[fill.index].shape)
            self.replay.values(fill.index, whole)
            fill.apply_patches(whole)
            tensor.copy_(whole if placement is None or placement.is_whole else placement.take(whole))
            return
        if placement is not None and not placement.is_whole:
            placement.fill_from_whole(tensor, lambda whole: self.init_parameter(name, whole))
            return
        if self.moe_blocks and self.replay is None and any(name.startswith(b + ".experts.") for b in self.moe_blocks):
            raise NotImplementedError(f"{name}: per-parameter init of the experts of an MoE model built on a real "
                                      "device is not implemented; build it on the meta device (build(meta=True))")
        owner, _, leaf = name.rpartition(".")
        module = self.get_submodule(owner)
        values = torch.full(tensor.shape, math.nan, dtype=torch.float32)
        stand_in = copy.copy(module)  # the same class and settings, its own parameter table
        stand_in._parameters = {k: None if p is None else values if k == leaf else torch.empty_like(p, device="meta")
                                for k, p in module._parameters.items()}
        seed = (self.init_seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            initialiser = self._initialiser(owner)
            initialiser._init_weights(stand_in)
        if values.isnan().all():  # (left alone by the init: what its module's constructor made, as in eager builds)
            made = self._constructed().get(name)
            if made is not None and made.shape == values.shape:
                values = made.float()
        if values.isnan().any():
            raise NotImplementedError(f"{name}: {type(initialiser).__name__}._init_weights does not initialise "
                                      f"{type(module).__name__}.{leaf}; build this model on a real device")
        tensor.copy_(values)

    def _initialiser(self, name: str) -> PreTrainedModel:
        """The model whose `_init_weights` initialises module `name`: as transformers' own init dispatches it, the
        innermost PreTrainedModel holding the module (itself, if it is one: Gemma 3n's text model reads its own
        hidden_size there, which the causal LM around it lacks)."""
        owner: PreTrainedModel = self.causal_lm
        module: nn.Module = self.causal_lm
        for part in name.split(".") if name else ():
            module = module.get_submodule(part)
            if isinstance(module, PreTrainedModel):
                owner = module
        return owner

    def _constructed(self) -> dict[str, torch.Tensor]:
        """The constructor's values of the model's buffers and small parameters (_constructor_values), made once."""
        if self.__dict__.get("_constructor_values") is None:
            self.__dict__["_constructor_values"] = _constructor_values(self.config)
        return self.__dict__["_constructor_values"]

    def continue_global_generator(self) -> None:
        """After a meta build of an MoE model: torch's global generator where the eager build would leave it."""
        if self.replay is not None:
            torch.default_generator.set_state(self.replay.end_state())

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Every parameter but those of MoE blocks through init_parameter (what a meta-device build gets)."""
        for name, p in self.named_parameters():
            if not any(name.startswith(block + ".experts.") for block in self.moe_blocks):
                self.init_parameter(name, p)

    @torch.no_grad()
    def materialise_buffers(self, device: torch.device | str | None = None) -> None:
        """Give meta-device buffers (the rotary embedding's frequencies) their values on `device`, through the
        model's `_init_weights` of their module; one the init leaves alone, through its module's constructor."""
        names = {id(m): n for n, m in self.named_modules()}
        for module in self.modules():
            meta = [n for n, b in module._buffers.items() if b is not None and b.is_meta]
            if not meta:
                continue
            # A module that also holds parameters (a scaled embedding) is initialised as a stand-in: the same class
            # and settings with scratch parameters, so only its buffers are kept.
            target = copy.copy(module) if module._parameters else module
            if target is not module:
                target._parameters = {k: None if p is None else torch.empty(p.shape, dtype=p.dtype)
                                      for k, p in module._parameters.items()}
                target._buffers = dict(module._buffers)
            # Filled with a value the init must overwrite (NaN; an integer or bool buffer is initialised again from
            # a second fill, and must come out the same), so an unset buffer shows.
            fills = {n: _unset_values(module._buffers[n].dtype, f"{type(module).__name__}.{n}") for n in meta}
            initialiser = self._initialiser(names[id(module)])
            done = _init_buffers(initialiser, target, {n: (module._buffers[n].shape, module._buffers[n].dtype,
                                                             fills[n][0]) for n in meta}, device)
            # (a second init, from where the first left the generator: an init that draws the buffer gives it
            # values other than the eager build's, and is refused)
            with torch.random.fork_rng(devices=[]):
                again = _init_buffers(initialiser, target, {n: (module._buffers[n].shape, module._buffers[n].dtype,
                                                                fills[n][-1]) for n in meta}, device)
            unset = [n for n in meta if done[n].isnan().any() or not torch.equal(done[n], again[n])]
            for n in meta:
                module._buffers[n] = done[n]
            # A buffer the init leaves alone keeps what its module's constructor made (XIELU's beta, Falcon-H1's
            # mup_vector), as in an eager build: that value, from a build with real buffers, where the init left
            # the whole of it as it found it and the constructor gives it without drawing from the generator.
            left = [n for n in unset if _left_alone(done[n], again[n], fills[n])]
            if left:
                owner = names[id(module)]
                for n in left:
                    value = self._constructed().get(f"{owner}.{n}" if owner else n)
                    if value is not None:
                        module._buffers[n] = value.to(device)
                        unset.remove(n)
            if unset:
                raise NotImplementedError(f"{type(module).__name__}: its buffers have no init in "
                                          f"{type(initialiser).__name__}._init_weights; build it on a real device")

    @torch.no_grad()
    def materialise_parameters(self, device: torch.device | str | None = None) -> None:
        """Replace meta-device parameters by uninitialised ones on `device` (tied ones stay tied)."""
        made: dict[int, nn.Parameter] = {}
        for module in self.modules():
            for n, p in list(module._parameters.items()):
                if p is None or not p.is_meta:
                    continue
                if id(p) not in made:
                    made[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                               requires_grad=p.requires_grad)
                module._parameters[n] = made[id(p)]

    # ------------------------------------------------------------------ forward
    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None,
                return_hidden: bool = False, packed: bool = False) -> torch.Tensor:
        positions = position_ids_for(tokens, position_ids)
        if self.balance is not None:
            self.balance.begin(self.training and torch.is_grad_enabled())
        # packed: the position ids restart at each packed document, and attention stays inside each of them.
        documents = Documents(positions) if packed else None
        if return_hidden and not self.plain_head:
            raise NotImplementedError(f"{type(self.causal_lm).__name__}: {head_problem(self.causal_lm)}: "
                                      "return_hidden (tiled loss) is not supported")
        if self.outside_attention and (packed or self._sequence_split()):
            raise NotImplementedError(
                f"{type(self.causal_lm).__name__}: layers {', '.join(self.outside_attention[:2])} mix tokens outside "
                f"transformers' AttentionInterface, so {'packed documents' if packed else 'Ulysses sequence shards'} "
                "do not reach them: train it unpacked and without sequence parallelism")
        if self.positions_from_length and (packed or self._sequence_split()):
            what = "packed documents" if packed else "Ulysses sequence shards"
            raise NotImplementedError(
                f"{type(self.causal_lm).__name__}: {self.positions_from_length} takes no position_ids (it numbers the "
                f"positions of the sequence it is given from 0), so {what} would get other positions: train it "
                "unpacked and without sequence parallelism")
        kwargs = dict(input_ids=tokens, position_ids=positions, use_cache=False)
        if documents is not None:
            kwargs["documents"] = documents
        token = hf_attn.PACKED.set(documents is not None)
        try:
            if return_hidden:
                out = self.base(**kwargs).last_hidden_state
            else:
                out = self.causal_lm(**kwargs).logits
        finally:
            hf_attn.PACKED.reset(token)
        if self.balance is not None:
            self.balance.finish()
        return out

    def _sequence_split(self) -> bool:
        """Whether an attention site runs over sequence shards (Ulysses over more than one rank)."""
        return any(getattr(attention_of(self.get_submodule(n)), "sp", 1) > 1 for n in self._sites)

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 0.8,
                 top_k: int | None = 40, generator: torch.Generator | None = None, forward=None) -> torch.Tensor:
        """Sample continuation tokens for prompt [b, s] (no KV cache: for short samples at the end of a run);
        `forward` replaces `self` as the logits function, e.g. a runtime engine wrapping this model."""
        forward = forward or self
        tokens = prompt
        limit = getattr(self.config, "max_position_embeddings", None) or tokens.shape[1] + max_new_tokens
        for _ in range(max_new_tokens):
            context = tokens[:, -limit:]
            logits = forward(context)[:, -1, :].float() / max(temperature, 1e-5)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            tokens = torch.cat([tokens, torch.multinomial(logits.softmax(-1), 1, generator=generator)], dim=1)
        return tokens[:, prompt.shape[1]:]


def _plan_styles(model: HFCausalLM, plan: dict, refuse: Callable[[str], ContractError]) -> dict:
    """The runtime's styles of the modules `plan` (base_model_tp_plan: patterns under the base model, `*` a layer
    index) names: colwise (whole heads as units inside attention), rowwise, replicated_with_grad_allreduce (and
    mla_kv_a_proj, MLA's shared latent projection: replicated on the gathered sequence before the heads' split, its
    gradient summed), colwise_gather_output / rowwise_split_input (the features gathered after the first, what runs
    between them replicated, this rank's slice of them into the second), colwise on a bare parameter (attention
    sinks, a per-head gate bias: this rank's heads; `local_params` on its owner needs nothing more here, where
    parameters are local tensors); embedding_rowwise on the input embedding is left to tensor_parallel_styles
    (vocabulary-parallel: the same lookup, split by rows)."""
    from zero.parallel.tensor import ColwiseParallel, ColwiseParams, RowwiseParallel, SequenceParallelNorm

    prefix = model.causal_lm.base_model_prefix
    modules = dict(model.named_modules())
    embedding = model.base.get_input_embeddings()
    styles: dict = {}
    sliced: dict[str, list[str]] = {}  # owner -> its direct parameters the plan splits by heads (sinks, gate biases)
    for pattern, style in plan.items():
        regex = re.compile("^" + re.escape(f"{prefix}.{pattern}").replace(r"\*", r"\d+") + "$")
        for owner, module in modules.items():
            for leaf in [n for n, _ in module.named_parameters(recurse=False) if regex.match(f"{owner}.{n}")]:
                if style != "colwise":
                    raise refuse(f"its style {style!r} of the parameter {owner}.{leaf} ({pattern}) is not mapped")
                sliced.setdefault(owner, []).append(leaf)
        for name in [n for n in modules if regex.match(n)]:
            if style == "local_params":
                continue
            if style in ("colwise", "unit_colwise"):  # (unit_colwise: whole heads, replicated below tp of them)
                head_dim = getattr(model.get_submodule(name.rpartition(".")[0]), "head_dim", None)
                rows = modules[name].weight.shape[0]
                styles[name] = ColwiseParallel(units=rows // head_dim if head_dim and not rows % head_dim else None)
            elif style == "rowwise":
                styles[name] = RowwiseParallel()
            elif style in ("replicated_with_grad_allreduce", "mla_kv_a_proj"):
                styles[name] = SequenceParallelNorm(gather_output=False)
            elif style == "colwise_gather_output" and isinstance(modules[name], nn.Linear):
                styles[name] = ColwiseParallel(gather_output=True)
            elif style == "rowwise_split_input" and isinstance(modules[name], nn.Linear):
                styles[name] = RowwiseParallel(split_input=True)
            elif style == "embedding_rowwise" and modules[name] is embedding:
                continue
            else:
                raise refuse(f"its style {style!r} ({pattern}, {type(modules[name]).__name__}) is not mapped")
    for owner, names in sliced.items():
        if owner in styles:
            raise refuse(f"{owner} has a style and parameters ({', '.join(names)}) split by heads")
        styles[owner] = ColwiseParams(names)
    return styles  # (`local_params` marks the owners of such parameters: ours are local tensors already)


#: The forward of a scaled word embedding (gemma's): the lookup times its `embed_scale`, elementwise.
_SCALED_EMBEDDING = "return super().forward(input_ids) * self.embed_scale.to(self.weight.dtype)"


def _embedding_scale(embedding: nn.Embedding,
                     refuse: Callable[[str], ContractError]) -> Callable[[nn.Module], torch.Tensor] | None:
    """What the input embedding's lookup is multiplied by, as a function of the module (None: a plain nn.Embedding
    forward)."""
    forward = type(embedding).forward
    if forward is nn.Embedding.forward:
        return None
    try:
        lines = [line.strip() for line in inspect.getsource(forward).splitlines()[1:] if line.strip()]
    except (OSError, TypeError):
        lines = []
    if lines == [_SCALED_EMBEDDING]:
        return lambda module: module.embed_scale
    raise refuse(f"its input embedding {type(embedding).__name__} has a forward of its own that the "
                 "vocabulary-parallel lookup does not repeat")


def _layer_styles(model: HFCausalLM, styles: dict, refuse: Callable[[str], ContractError]) -> None:
    """The styles of every layer's children (see HFCausalLM.tensor_parallel_styles), into `styles`."""
    from zero.parallel import tensor as ztp

    hidden = getattr(model.config, "hidden_size", None)
    for name, block in model.blocks():
        own = [(n, p) for n, p in block.named_parameters(recurse=False)]
        if own and all(p.dim() == 1 and p.shape[0] == hidden for _, p in own):
            # (per-channel scales the layer applies itself, e.g. nGPT's interpolation rates: on the hidden states'
            # sequence shards, as a norm's weight)
            styles[name] = ztp.SequenceParallelNorm(gather_output=False)
        for key, module in _layer_children(name, block):
            inner = {n: s for n, s in styles.items() if n == key or n.startswith(key + ".")}
            if inner and all(isinstance(s, ztp.ColwiseParallel) and s.gather_output for s in inner.values()):
                for n in inner:  # (all its projections gathered: all of it replicated, as one whole module)
                    del styles[n]
                styles[key] = ztp.ReplicatedSequence()
            elif inner:
                _inside_split_child(key, module, styles, refuse)
                gather = ztp.SequenceGather()  # (the whole sequence into it)
                styles[key] = ztp.Chain(styles[key], gather) if key in styles else gather
            elif _norm_like(module):
                styles[key] = ztp.SequenceParallelNorm(gather_output=False)  # (on the sequence shards)
            elif any(True for _ in module.parameters()):  # (unsplit: whole, on the gathered sequence)
                styles[key] = ztp.ReplicatedSequence()


def _per_layer_input_styles(model: HFCausalLM, per_layer: list[str], styles: dict, tp: int,
                            refuse: Callable[[str], ContractError]) -> None:
    """Styles for Gemma's per-layer inputs (moe_lst.models.hf.pipeline.per_layer_input_modules): its forward adds a
    lookup of the token ids, reshaped to their shape, to a projection of the embedding's output, reshaped to that
    output's, so both are made over the whole sequence on every rank: the embeddings' outputs gathered
    (VocabParallelEmbedding(gather_output)), the projection and its norm replicated on them with their gradients
    summed (each rank's is its own positions'); every layer cuts its per-layer input, and the first its hidden
    states too, to its sequence shard (SequenceShardArguments)."""
    from zero.parallel import tensor as ztp

    if not per_layer:
        return
    prefix = model.causal_lm.base_model_prefix
    for name in per_layer:
        module = getattr(model.base, name)
        if isinstance(module, nn.Embedding):
            if module.num_embeddings % tp:
                raise refuse(f"tp={tp} does not divide the {module.num_embeddings} rows of {prefix}.{name}")
            styles[f"{prefix}.{name}"] = ztp.VocabParallelEmbedding(scale=_embedding_scale(module, refuse),
                                                                    gather_output=True)
        elif isinstance(module, nn.Linear) or _norm_like(module):
            styles[f"{prefix}.{name}"] = ztp.SequenceParallelNorm(gather_output=False)
        else:
            raise refuse(f"its per-layer inputs' module {prefix}.{name} ({type(module).__name__}) is not an "
                         "embedding, a linear projection or a norm")
    for k, (block, _) in enumerate(model.blocks()):
        cut = ztp.SequenceShardArguments((0, 1) if k == 0 else (1,))
        styles[block] = ztp.Chain(styles[block], cut) if block in styles else cut


def _end_styles(model: HFCausalLM, styles: dict, tp: int, refuse: Callable[[str], ContractError]) -> None:
    """The styles of the embedding, the final norm and the head (see HFCausalLM.tensor_parallel_styles)."""
    from zero.parallel import tensor as ztp

    modules = dict(model.named_modules())
    names = {id(m): n for n, m in modules.items()}
    embeddings = model.base.get_input_embeddings()
    head = model.causal_lm.get_output_embeddings()
    if not isinstance(embeddings, nn.Embedding) or not isinstance(head, nn.Linear):
        raise refuse(f"its embedding ({type(embeddings).__name__}) or head ({type(head).__name__}) is not an "
                     "nn.Embedding / nn.Linear")
    from moe_lst.models.hf.pipeline import per_layer_input_modules

    per_layer = per_layer_input_modules(model.base) or []
    # (with per-layer inputs the embedding's output is the whole sequence: see _per_layer_input_styles)
    styles[names[id(embeddings)]] = ztp.VocabParallelEmbedding(scale=_embedding_scale(embeddings, refuse),
                                                               gather_output=bool(per_layer))
    _per_layer_input_styles(model, per_layer, styles, tp, refuse)
    blocks = {id(m) for _, m in model.blocks()}
    rest = [(n, m) for n, m in model.base.named_children()
            if m is not embeddings and n not in per_layer and (any(True for _ in m.parameters()) or _norm_like(m))
            and not (isinstance(m, nn.ModuleList) and all(id(b) in blocks for b in m))]
    if len(rest) != 1 or not _norm_like(rest[0][1]):  # (the final norm: on shards, gathering for the head)
        found = ", ".join(f"{n} ({type(m).__name__})" for n, m in rest) or "none"
        raise refuse(f"the base model's modules outside the embedding and layers are not one final norm ({found})")
    try:
        calls = len(re.findall(rf"self\.{rest[0][0]}\(", inspect.getsource(type(model.base).forward)))
    except (OSError, TypeError):
        calls = 0
    # (a norm also applied before the layers, to the embedding's shards: the head gathers its own input instead)
    styles[names[id(rest[0][1])]] = ztp.SequenceParallelNorm(gather_output=calls <= 1)
    tied = head.weight is embeddings.weight
    head_style = ztp.TiedHead(embeddings) if tied else ztp.ColwiseParallel()
    extra = [(n, p) for n, p in head.named_parameters(recurse=False) if n not in ("weight", "bias")]
    if extra:  # (a head's own per-token parameters, e.g. a logit scale [vocab]: this rank's vocabulary slice of them)
        if not all(p.dim() >= 1 and p.shape[0] == head.out_features for _, p in extra):
            raise refuse(f"its head {type(head).__name__} holds parameters ({', '.join(n for n, _ in extra)}) that "
                         "are not per token of the vocabulary")
        head_style = ztp.Chain(head_style, ztp.ColwiseParams([n for n, _ in extra]))
    styles[names[id(head)]] = head_style if calls <= 1 else ztp.Chain(head_style, ztp.SequenceGather())


def _layer_children(name: str, block: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules a layer calls on its hidden states: its children, those of a ModuleList / ModuleDict child (a
    layer with two attentions or a list of norms) in its place."""
    out = []
    for child, module in block.named_children():
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            out.extend((f"{name}.{child}.{n}", m) for n, m in module.named_children())
        else:
            out.append((f"{name}.{child}", module))
    return out


def _norm_like(module: nn.Module) -> bool:
    """Whether `module` is a token-wise norm: a class named like one, holding 1-D parameters only."""
    return "norm" in type(module).__name__.lower() and all(p.dim() == 1 for p in module.parameters())


def _inside_split_child(key: str, child: nn.Module, styles: dict, refuse: Callable[[str], ContractError]) -> None:
    """Styles for the modules of layer child `key` that the plan splits inside but leaves out themselves: run on the
    gathered sequence, replicated; their gradients summed over tp where what follows them is split (partial per
    rank), left whole where the child's projections gather their output features (all that follows replicated)."""
    from zero.parallel.tensor import ColwiseParallel, Replicated, SequenceParallelNorm

    inner = {n: s for n, s in styles.items() if n == key or n.startswith(key + ".")}
    gathered = [n for n, s in inner.items() if isinstance(s, ColwiseParallel) and s.gather_output]
    split = [n for n, s in inner.items() if isinstance(s, ColwiseParallel) and not s.gather_output]
    if gathered and split:
        raise refuse(f"{key} mixes colwise_gather_output ({gathered[0]}) and colwise ({split[0]}) projections")
    if gathered and any(isinstance(s, SequenceParallelNorm) for s in inner.values()):
        raise refuse(f"{key} has replicated_with_grad_allreduce modules between gathered features")
    covering = [n for n, s in inner.items() if getattr(s, "places_submodules", False)]  # (e.g. an MoE block's)
    for sub, module in child.named_modules(prefix=key):
        own = [p for p, _ in module.named_parameters(recurse=False)]
        if not own or sub in styles or any(sub == n or sub.startswith(n + ".") for n in covering):
            continue
        if sub == key:
            raise refuse(f"{key} holds parameters of its own ({', '.join(own)}) the plan does not place")
        if gathered:
            if not _norm_like(module):
                raise refuse(f"{sub} ({type(module).__name__}) sits between gathered features and is not a norm")
            styles[sub] = Replicated()
        elif isinstance(module, nn.Linear) or _norm_like(module):
            styles[sub] = SequenceParallelNorm(gather_output=False)
        else:
            raise refuse(f"{sub} ({type(module).__name__}) holds parameters the plan does not place")


def layout_problem(config: PreTrainedConfig, key: str, degree: int) -> str | None:
    """Why the adapter cannot run `config` at tensor (key "tp") or pipeline ("pp") parallelism of `degree` (None:
    it can): the coverage sweep's tp2 / pp2 result for the model type, then this config's own plan against the
    degree (on a meta-device model: nothing is allocated). One line naming what is missing."""
    from moe_lst.models.hf.config import coverage

    feature = f"{key}2"
    swept = coverage().get(config.model_type, {}).get("features", {}).get(feature, "not run")
    if swept != "pass":
        return f"the coverage sweep's {feature} check of model_type {config.model_type}: {swept}"
    if key == "pp":  # (the split against its layers is the recipe's check)
        return None
    with torch.device("meta"):  # (its structure only: no values, nor the replay of an MoE build's fills)
        causal_lm = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32)
    try:
        HFCausalLM(causal_lm).tensor_parallel_styles(degree)
    except ContractError as e:
        return str(e).split(", but ", 1)[-1]
    return None


def _num_experts(config: PreTrainedConfig, causal_lm: nn.Module) -> int:
    return next(int(m.expert_range[1] - m.expert_range[0]) for m in causal_lm.modules() if is_experts(m))


def _unset_values(dtype: torch.dtype, name: str) -> tuple:
    """What a meta-device buffer of `dtype` is filled with before its init, to tell afterwards whether the init set
    it: NaN for floating point; for integers and bools two fills (the dtype's least and greatest value, True and
    False), initialised in turn, which give the same values only if the init set them."""
    if dtype.is_floating_point:
        return (math.nan,)
    if dtype.is_complex:
        raise NotImplementedError(f"{name}: a {dtype} buffer, whose init a meta-device build cannot check; build "
                                  "this model on a real device")
    if dtype == torch.bool:
        return (True, False)
    return (torch.iinfo(dtype).min, torch.iinfo(dtype).max)


def _left_alone(done: torch.Tensor, again: torch.Tensor, fills: tuple) -> bool:
    """Whether the init left a buffer filled with `fills` (NaN; or the two integer / bool fills) wholly as it was."""
    if len(fills) == 1:
        return bool(done.isnan().all())
    return bool((done == fills[0]).all() and (again == fills[1]).all())


#: The most elements a parameter may have to be made on the CPU (with its constructor's values) by _constructor_values.
SMALL_PARAMETER = 1 << 16


def _constructor_values(config: PreTrainedConfig) -> dict[str, torch.Tensor]:
    """The buffers and small parameters (by name) as the modules of `config`'s causal LM make them in their
    constructors, from a build whose larger parameters go to the meta device as each is registered (so nothing of
    their size is made) and whose buffers and small parameters (at most SMALL_PARAMETER elements) are made on the
    CPU; built twice from different generator states, a value that comes out differently (drawn from the
    generator, so not the eager build's) is left out."""
    register = nn.Module.register_parameter

    def register_large_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta and param.numel() > SMALL_PARAMETER:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    builds = []
    for seed in (0, 1):
        with torch.random.fork_rng(devices=[]), torch.device("cpu"), torch.no_grad(), \
                mock.patch.object(nn.Module, "register_parameter", register_large_on_meta):
            torch.manual_seed(seed)
            causal_lm = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32)
        made = dict(causal_lm.named_buffers())
        made.update(causal_lm.named_parameters())
        builds.append({n: t.detach() for n, t in made.items() if not t.is_meta})
    return {n: t for n, t in builds[0].items() if n in builds[1] and torch.equal(t, builds[1][n])}


def _init_buffers(causal_lm: nn.Module, target: nn.Module, buffers: dict, device) -> dict[str, torch.Tensor]:
    """`target`'s buffers (name -> shape, dtype, fill) filled and then initialised by the model's `_init_weights`."""
    for n, (shape, dtype, fill) in buffers.items():
        target._buffers[n] = torch.full(shape, fill, dtype=dtype, device=device)
    causal_lm._init_weights(target)
    return {n: target._buffers[n] for n in buffers}


def _site(name: str, module: nn.Module) -> AttentionSite:
    return AttentionSite(name, lambda: attention_of(module), lambda fn: set_attention(module, fn))


def build(config: PreTrainedConfig, meta: bool = False, device: torch.device | str | None = None,
          attention_fn: Callable[..., torch.Tensor] = attention, sp_group: ProcessGroup | None = None) -> HFCausalLM:
    """The adapted model of `config`, in fp32. Dense models are built on the meta device; with `meta` their
    parameters stay there (the engine materialises them through init_parameter), else they are made on the CPU
    and initialised by name (the same values); buffers get their values on `device` (default: the CPU). MoE
    models, and dense ones whose modules the per-name init cannot fill, are built whole on the CPU with
    transformers' own init (MoE experts then adopted)."""
    config = copy.deepcopy(config)
    from moe_lst.models.hf.config import is_moe

    if is_moe(config):
        if not meta:
            causal_lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            return HFCausalLM(causal_lm, attention_fn, sp_group=sp_group)
        return _meta_moe(config, device, attention_fn, sp_group)
    with torch.device("meta"):
        causal_lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _to_meta(causal_lm)
    model = HFCausalLM(causal_lm, attention_fn, sp_group=sp_group)
    try:
        model.materialise_buffers(device)
        if not meta:
            model.materialise_parameters("cpu")
            model.reset_parameters()
    except NotImplementedError:
        if meta:
            raise
        # (a module the per-name init cannot fill: transformers' own init of the whole model, on the CPU)
        return HFCausalLM(AutoModelForCausalLM.from_config(config, dtype=torch.float32), attention_fn,
                          sp_group=sp_group)
    return model


def _to_meta(module: nn.Module) -> None:
    """Parameters a module made on the CPU despite the meta device (torch.normal with float arguments, e.g.
    DiffLlama's lambdas) onto the meta device, tied ones staying tied: every parameter then gets its value by name
    (init_parameter), as on the CPU build."""
    moved: dict[int, nn.Parameter] = {}
    for sub in module.modules():
        for name, p in sub._parameters.items():
            if p is not None and not p.is_meta:
                if id(p) not in moved:
                    moved[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                sub._parameters[name] = moved[id(p)]


def _meta_moe(config: PreTrainedConfig, device, attention_fn, sp_group) -> HFCausalLM:
    """An MoE model on the meta device whose init_parameter gives each parameter (or slice) the value the eager
    build (`from_config`: its modules' own init, then transformers' `_init_weights`) draws for it from the global
    generator: the same build and init run on meta tensors under a DrawRecorder, which notes every fill."""
    from unittest import mock

    from moe_lst.models.init_replay import DrawRecorder
    from transformers import modeling_utils

    # transformers skips its init on the meta device: made to run it there, each (sub)model's post_init fills
    # what an eager build's does, in the same order (the base model's before the head is even made)
    recorder = DrawRecorder()
    with recorder, torch.device("meta"), mock.patch.object(modeling_utils, "get_torch_context_manager_or_global_device",
                                                           lambda: None):
        causal_lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fills = recorder.parameter_fills(causal_lm)
    model = HFCausalLM(causal_lm, attention_fn, sp_group=sp_group)
    model.replay, model.fills = Replay(recorder.draws, recorder.start_state), fills
    for block in model.moe_blocks:  # (the adopted layers' own counters: zeros, as an eager build makes them)
        m = model.get_submodule(block)
        m.register_buffer("load_since_update", torch.zeros(m.load_since_update.shape, device=device),
                          persistent=False)
    model.materialise_buffers(device)
    return model
