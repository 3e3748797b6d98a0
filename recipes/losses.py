"""The recipe's losses: mean next-token cross-entropy of a data shard, over the whole sequence under sp
(sequence_parallel.shard_sequence and sp_loss are the identity and a plain mean on one rank), and its
mean over the data-parallel ranks for logging."""

from __future__ import annotations

import torch
from omegaconf import DictConfig

import zero
from sequence_parallel import shard_sequence, sp_loss, tiled_cross_entropy
from zero.dist import comm
from zero.dist.topology import default_device
from zero.parallel.tensor import vocab_parallel_cross_entropy

IGNORE_INDEX = -100


def lm_loss(engine, tokens: torch.Tensor, labels: torch.Tensor, cfg: DictConfig,
            dims: zero.ParallelDims, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy of this data shard (over the whole sequence when sp > 1).

    The model runs through the engine (`engine(...)`), which gathers sharded parameters when needed.
    `position_ids` (None: 0..seq-1, one document per row) restart at each packed document
    (recipes.data.DocumentStream.packed_batch): the model then keeps attention inside each document.
    """
    packed = {"packed": True} if position_ids is not None else {}  # (unpacked: the model's call is unchanged)
    tokens, labels, position_ids = shard_sequence(tokens, labels, dims.sp_group, position_ids=position_ids,
                                                  ignore_index=IGNORE_INDEX, cp_group=dims.cp_group)
    if cfg.train.tiled_loss:
        hidden = engine(tokens, position_ids, return_hidden=True, **packed)
        loss_sum, count = tiled_cross_entropy(hidden.flatten(0, 1), engine.module.output_weight,
                                              labels.flatten(), ignore_index=IGNORE_INDEX)
        return sp_loss(loss_sum, count, dims.sequence_group)
    return logits_loss(engine(tokens, position_ids, **packed), labels, dims)


def logits_loss(logits: torch.Tensor, labels: torch.Tensor, dims: zero.ParallelDims) -> torch.Tensor:
    """Mean next-token cross-entropy from logits [b, s, vocab] (vocabulary-sliced under tp, never gathered)
    over the whole sequence (sp x cp) of this data shard. Also the last pipeline stage's loss function."""
    loss_sum, count = vocab_parallel_cross_entropy(logits.flatten(0, 1), labels.flatten(), dims.tp_group,
                                                   IGNORE_INDEX)
    return sp_loss(loss_sum, count, dims.sequence_group)


def mean_over_dp(value: float, dims: zero.ParallelDims) -> float:
    """Average a per-data-shard scalar over data-parallel ranks (for logging the global-batch loss)."""
    if dims.dp == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=default_device())  # NCCL reduces device tensors
    comm.all_reduce(t, dims.dp_group)
    return t.item() / dims.dp
