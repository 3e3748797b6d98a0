"""A Hugging Face causal LM under the runtime's parallelism for the training loops of other frameworks (the Trainer,
Lightning, Accelerate): the model behind moe_lst.models.hf's adapter with expert, tensor, Ulysses sequence and
pipeline parallelism applied as the recipe applies them, and the loss over its sequence shards and vocabulary slices
(under pp: a whole batch's 1F1B schedule, forward and backward, in one call)."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import zero
from zero.parallel.pipeline import Pipeline

IGNORE_INDEX = -100
#: The pipeline schedule the loops run (the adapter's stages are one per rank: 1F1B, as model=hf's default).
SCHEDULE = "1f1b"


def pipeline_microbatches(pp: int, microbatches: int | None) -> int:
    """The micro-batches a batch is split into under `pp` stages (None: pp, the fewest a 1F1B schedule takes)."""
    return pp if microbatches is None else microbatches


#: How the refusals name the degrees: the loops' own arguments (ZeroTrainer(ep=...), --ep, ZeroStrategy(ep=...)).
DEGREE_KEYS = {"ep": "ep", "sp": "sp", "tp": "tp", "num_experts": "the config's experts per layer"}


def check_layout(model: Any, *, tp: int = 1, ep: int = 1, pp: int = 1, sp: int = 1,
                 microbatches: int | None = None) -> None:
    """Refuse, in one line and before any process group or plan exists, what the adapter does not offer `model`
    (a transformers model, or its config) at these degrees: ep for a dense model or one that does not divide its
    experts, tp and pp where the config's tensor- or pipeline-parallel plan does not map
    (moe_lst.models.hf.model.layout_problem), sp past the query heads a tp rank holds, fewer layers than stages, and
    fewer micro-batches per batch than stages (1F1B needs at least pp)."""
    from moe_lst.models.hf import is_moe, num_experts
    from moe_lst.models.hf.model import layout_problem

    from moe.dispatch import check_expert_parallel
    from sequence_parallel.ulysses import check_ulysses_heads

    config = getattr(model, "config", model)
    if ep > 1 and not is_moe(config):
        raise ValueError(f"ep={ep} needs an MoE model (model_type {config.model_type} is dense); use ep=1")
    if ep > 1:
        check_expert_parallel(num_experts(config), ep, DEGREE_KEYS)
    for key, degree in (("tp", tp), ("pp", pp)):
        problem = layout_problem(config, key, degree) if degree > 1 else None
        if problem:
            raise NotImplementedError(f"{key}={degree} with model_type {config.model_type} is refused: {problem}; "
                                      f"use {key}=1")
    heads = getattr(config, "num_attention_heads", None)
    if sp > 1 and isinstance(heads, int):  # (the heads a tp rank holds, split over sp)
        check_ulysses_heads(heads, sp, tp, DEGREE_KEYS)
    if pp > 1:
        layers, m = config.num_hidden_layers, pipeline_microbatches(pp, microbatches)
        if layers < pp:
            raise ValueError(f"pp={pp} stages but model_type {config.model_type} has {layers} layers: every stage "
                             f"needs one; use pp <= {layers}")
        if isinstance(m, bool) or not isinstance(m, int) or m < pp:
            raise ValueError(f"pp={pp} with {m!r} micro-batches per batch: a 1F1B schedule needs at least pp "
                             f"micro-batches; split each batch into pp={pp} or more (ZeroTrainer's pp_microbatches, "
                             "parallelize_hf's microbatches, the Accelerate example's --grad-accum)")


def trains_balancing_loss(model: Any) -> bool:
    """Whether `model` (a transformers causal LM, or its config) adds transformers' balancing loss to its loss: an MoE
    config with output_router_logits and router_aux_loss_coef > 0 of a model type the adapter covers. Its own forward
    adds that term once per call, so a loop that divides the loss per micro-batch by the accumulation (or sums it over
    the tokens of the whole step, the Trainer's num_items_in_batch) leaves the balancing term undivided: its weight in
    the objective would grow with the micro-batches and processes of a step. Through the adapter it is scaled like the
    next-token loss (HFCausalLM's loss_plan), at every layout."""
    from moe_lst.models.hf import MODEL_TYPES

    config = getattr(model, "config", model)
    coef = getattr(config, "router_aux_loss_coef", 0.0) or 0.0
    return bool(getattr(config, "output_router_logits", False) and coef > 0
                and MODEL_TYPES.get(getattr(config, "model_type", None), False))


def parallelize_hf(model: nn.Module, dims: zero.ParallelDims,
                   microbatches: int | None = None) -> tuple[nn.Module, list[zero.Plan]]:
    """(the module the engine wraps, the plans, in order, for zero.initialize): the adapter around `model`,
    sharing its modules and parameters, with experts over ep, the config's tensor-parallel plan over tp and Ulysses
    over sp applied; under pp, this rank's pipeline stages of it (the last plan is the `Pipeline`, running a batch
    split into `microbatches`, default pp, with 1F1B: `pipeline_loss`; the other stages' weights are released to
    the meta device). `model` is a transformers causal LM of a covered model type (or the adapter itself, as
    moe_lst.models.hf.build gives it, built with `sp_group=dims.sequence_group`), identically initialised on every
    rank."""
    from moe_lst.models.hf import HFCausalLM

    from moe import apply_expert_parallel
    from sequence_parallel import apply_ulysses
    from zero.parallel.pipeline import apply_pipeline
    from zero.parallel.tensor import apply_tensor_parallel

    check_layout(model, tp=dims.tp, ep=dims.ep, pp=dims.pp, sp=dims.sp, microbatches=microbatches)
    adapter = model if isinstance(model, HFCausalLM) else HFCausalLM(model, sp_group=dims.sequence_group)
    plans = [adapter.loss_plan()]
    if adapter.moe_blocks:
        plans.append(apply_expert_parallel(adapter, dims))
    plans.append(apply_tensor_parallel(adapter, dims.tp_group))  # (tp=1: changes nothing)
    apply_ulysses(adapter, dims.sp_group)
    if dims.pp == 1:
        return adapter, plans
    pipe = apply_pipeline(adapter, dims, SCHEDULE, microbatches=pipeline_microbatches(dims.pp, microbatches),
                          loss_fn=functools.partial(logits_loss, dims=dims))
    return pipe.module, [*plans, pipe]


def pipeline_of(plans: list[zero.Plan]) -> Pipeline | None:
    """The pipeline among `plans` (parallelize_hf's under pp), else None."""
    return next((plan for plan in plans if isinstance(plan, Pipeline)), None)


def shifted_shard(tokens: torch.Tensor, labels: torch.Tensor | None, dims: zero.ParallelDims,
                  position_ids: torch.Tensor | None = None, shift: bool = True):
    """(tokens, targets, position ids) of this rank's sequence shard: the labels shifted (a causal LM's labels are
    its inputs; `shift=False`: already the targets) before the sequence is split over sp."""
    from sequence_parallel import shard_sequence

    labels = tokens if labels is None else labels
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX) if shift else labels
    return shard_sequence(tokens, targets, dims.sp_group, position_ids, ignore_index=IGNORE_INDEX)


def logits_loss(logits: torch.Tensor, targets: torch.Tensor, dims: zero.ParallelDims) -> torch.Tensor:
    """Mean next-token loss over the whole sequences from this rank's logits [b, s/sp, vocab/tp] (the vocabulary
    slices reduced over tp, never gathered; the sequence shards over sp). Also the last pipeline stage's loss."""
    from sequence_parallel import sp_loss
    from zero.parallel.tensor import vocab_parallel_cross_entropy

    loss_sum, count = vocab_parallel_cross_entropy(logits.flatten(0, 1), targets.flatten(), dims.tp_group,
                                                   ignore_index=IGNORE_INDEX)
    return sp_loss(loss_sum, count, dims.sp_group)


def next_token_loss(adapter: nn.Module, tokens: torch.Tensor, labels: torch.Tensor | None, dims: zero.ParallelDims,
                    position_ids: torch.Tensor | None = None, shift: bool = True) -> torch.Tensor:
    """Mean next-token loss over the micro-batch's whole sequences: the labels shifted (a causal LM's labels are its
    inputs; `shift=False`: already the targets) before the sequence is split over sp, the logits' vocabulary
    slices reduced over tp (never gathered). Not under pp: `pipeline_loss` runs a pipeline's batch."""
    tokens, targets, positions = shifted_shard(tokens, labels, dims, position_ids, shift)
    return logits_loss(adapter(tokens, positions), targets, dims)


def pipeline_loss(pipe: Pipeline, engine: zero.Engine, tokens: torch.Tensor, labels: torch.Tensor | None,
                  dims: zero.ParallelDims, position_ids: torch.Tensor | None = None, shift: bool = True,
                  training: bool = True) -> torch.Tensor:
    """One batch through the pipeline: split into `pipe.microbatches` micro-batches of consecutive rows, forward and
    backward of each under the 1F1B schedule (the engine reduces the gradients, each micro-batch's loss scaled by
    1/microbatches as gradient accumulation over them would be); the mean of the micro-batches' losses, the same
    tensor (no graph) on every rank of the pipeline. Every rank of the pipeline passes the batch (the first stage
    reads the tokens, the last the targets). Call engine.step() after. `training=False`: forward only (evaluation),
    no gradients."""
    if tokens.shape[0] % pipe.microbatches:
        raise ValueError(f"a batch of {tokens.shape[0]} rows does not split into the pipeline's {pipe.microbatches} "
                         "micro-batches: make the batch size a multiple of them")
    tokens, targets, positions = shifted_shard(tokens, labels, dims, position_ids, shift)
    run = pipe.train_step if training else pipe.eval_step
    return torch.tensor(run(engine, tokens, targets, position_ids=positions))


def full_state_dict(engine: zero.Engine, plans: list[zero.Plan]) -> dict[str, torch.Tensor]:
    """The whole model's fp32 weights under the model's names: the engine's (gathered from ZeRO shards) with every
    rank's experts under ep, the tensor-parallel slices assembled and, under pp, every stage's (collective: every
    rank calls it)."""
    from moe.parallel import ExpertParallel
    from zero.dist import comm
    from zero.parallel.tensor import TensorParallel

    state = engine.full_state_dict()
    for plan in plans:
        if isinstance(plan, ExpertParallel):
            state = _with_all_experts(state, plan, engine.dims)
    for plan in plans:
        if isinstance(plan, TensorParallel):
            state = plan.full_state_dict(state)
    pipe = pipeline_of(plans)
    if pipe is not None:  # (a tied embedding and head: the same values on the first and the last stage)
        state = {name: value for stage in comm.all_gather_object(state, pipe.dims.pp_group)
                 for name, value in stage.items()}
    return state


def _with_all_experts(state: dict[str, torch.Tensor], plan: zero.Plan,
                      dims: zero.ParallelDims) -> dict[str, torch.Tensor]:
    """`state` with each routed-expert tensor (this rank's experts, `plan.placements`) replaced by every ep rank's, in
    expert order (collective over the ep group). Without it the whole model held only this rank's experts."""
    from zero.dist import comm
    from zero.dist.topology import group_rank

    rank, out = group_rank(dims.ep_group), dict(state)
    for name, placement in sorted(plan.placements.items()):
        if name not in state:
            continue
        local = state[name].contiguous()
        (piece,) = placement.pieces  # (rank r holds experts [r * n, (r + 1) * n), n = this rank's count)
        if piece.start[0] != rank * local.shape[0]:
            raise RuntimeError(f"{name}: this ep rank's experts start at {piece.start[0]}, not at rank {rank} x "
                               f"{local.shape[0]}")
        flat = torch.empty(dims.ep * local.numel(), dtype=local.dtype, device=local.device)
        comm.all_gather_into_tensor(flat, local.view(-1), dims.ep_group)
        out[name] = flat.view(dims.ep * local.shape[0], *local.shape[1:])
    return out


def save_pretrained(model: nn.Module, engine: zero.Engine, plans: list[zero.Plan], directory: str) -> None:
    """Write the trained model into `directory` as transformers' save_pretrained does, for from_pretrained: `model` the
    transformers causal LM parallelize_hf was given (or the adapter around it), its weights and persistent buffers
    (e.g. DeepSeek-V3's routing correction bias) from full_state_dict (every ZeRO shard, ep rank, tp slice and pp
    stage). Collective: every rank calls it; the first rank of the world writes."""
    from moe_lst.models.hf import HFCausalLM

    from zero.dist import comm

    state = full_state_dict(engine, plans)
    causal_lm = model.causal_lm if isinstance(model, HFCausalLM) else model
    problem = None
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        try:
            causal_lm.save_pretrained(directory, state_dict=state)
        except Exception as error:  # noqa: BLE001 - raised on every rank below, which would otherwise wait on
            problem = f"{type(error).__name__}: {error}"
    world = torch.distributed.group.WORLD if torch.distributed.is_initialized() else None
    problem = comm.all_gather_object(problem, world)[0]
    if problem is not None:
        raise RuntimeError(f"save_pretrained into {directory} failed on the first rank: {problem}")
