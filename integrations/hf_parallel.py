"""A Hugging Face causal LM under the runtime's parallelism for the training loops of other frameworks (the Trainer,
Lightning, Accelerate): the model behind moe_lst.models.hf's adapter with expert, tensor and Ulysses sequence
parallelism applied as the recipe applies them, and the loss over its sequence shards and vocabulary slices."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import zero

IGNORE_INDEX = -100


def refuse_pipeline(pp: int) -> None:
    """Pipeline stages are not offered through these loops (one line, before anything is built)."""
    if pp > 1:
        raise NotImplementedError(f"pp={pp}: pipeline stages are not offered through the Trainer, Lightning or "
                                  "Accelerate loops, which run one micro-batch's forward and backward at a time while "
                                  "a pipeline's schedule runs all of a step's (zero.parallel.pipeline); train with "
                                  "python -m recipes.pretrain model=hf parallel.pp=...")


def check_layout(model: Any, *, tp: int = 1, ep: int = 1, pp: int = 1) -> None:
    """Refuse, in one line and before any process group or plan exists, what the adapter does not offer `model`
    (a transformers model, or its config) at these degrees: pipeline stages, ep for a dense model, and tp where
    the config's tensor-parallel plan does not map (moe_lst.models.hf.model.layout_problem)."""
    from moe_lst.models.hf import is_moe
    from moe_lst.models.hf.model import layout_problem

    config = getattr(model, "config", model)
    refuse_pipeline(pp)
    if ep > 1 and not is_moe(config):
        raise ValueError(f"ep={ep} needs an MoE model (model_type {config.model_type} is dense); use ep=1")
    problem = layout_problem(config, "tp", tp) if tp > 1 else None
    if problem:
        raise NotImplementedError(f"tp={tp} with model_type {config.model_type} is refused: {problem}; use tp=1")


def parallelize_hf(model: nn.Module, dims: zero.ParallelDims) -> tuple[nn.Module, list[zero.Plan]]:
    """(the adapter around `model`, sharing its modules and parameters, with experts over ep, the config's tensor-
    parallel plan over tp and Ulysses over sp applied; the plans, in order, for zero.initialize). `model` is a
    transformers causal LM of a covered model type (or the adapter itself, as moe_lst.models.hf.build gives it,
    built with `sp_group=dims.sequence_group`), identically initialised on every rank."""
    from moe_lst.models.hf import HFCausalLM

    from moe import apply_expert_parallel
    from sequence_parallel import apply_ulysses
    from zero.parallel.tensor import apply_tensor_parallel

    check_layout(model, tp=dims.tp, ep=dims.ep, pp=dims.pp)
    adapter = model if isinstance(model, HFCausalLM) else HFCausalLM(model, sp_group=dims.sequence_group)
    plans = [adapter.loss_plan()]
    if adapter.moe_blocks:
        plans.append(apply_expert_parallel(adapter, dims))
    plans.append(apply_tensor_parallel(adapter, dims.tp_group))  # (tp=1: changes nothing)
    apply_ulysses(adapter, dims.sp_group)
    return adapter, plans


def next_token_loss(adapter: nn.Module, tokens: torch.Tensor, labels: torch.Tensor | None, dims: zero.ParallelDims,
                    position_ids: torch.Tensor | None = None, shift: bool = True) -> torch.Tensor:
    """Mean next-token loss over the micro-batch's whole sequences: the labels shifted (a causal LM's labels are its
    inputs; `shift=False`: already the targets) before the sequence is split over sp, the logits' vocabulary
    slices reduced over tp (never gathered)."""
    from sequence_parallel import shard_sequence, sp_loss
    from zero.parallel.tensor import vocab_parallel_cross_entropy

    labels = tokens if labels is None else labels
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX) if shift else labels
    tokens, targets, positions = shard_sequence(tokens, targets, dims.sp_group, position_ids,
                                                ignore_index=IGNORE_INDEX)
    logits = adapter(tokens, positions)
    loss_sum, count = vocab_parallel_cross_entropy(logits.flatten(0, 1), targets.flatten(), dims.tp_group,
                                                   ignore_index=IGNORE_INDEX)
    return sp_loss(loss_sum, count, dims.sp_group)


def full_state_dict(engine: zero.Engine, plans: list[zero.Plan]) -> dict[str, torch.Tensor]:
    """The whole model's fp32 weights under the model's names: the engine's (gathered from ZeRO shards) with the
    tensor-parallel slices assembled (collective: every rank calls it)."""
    from zero.parallel.tensor import TensorParallel

    state = engine.full_state_dict()
    for plan in plans:
        if isinstance(plan, TensorParallel):
            state = plan.full_state_dict(state)
    return state

