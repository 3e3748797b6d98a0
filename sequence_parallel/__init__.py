"""Ulysses sequence parallelism and long-sequence training (ALST): tiling, checkpointing, SP data/loss.

Turn on in a recipe, each piece on its own switch (all functions take the model or the SP group and
change nothing else; the model states its parts in the model contract, `zero.contract`):

    apply_ulysses(model, sp_group)                       # every attention site -> UlyssesAttention
    tokens, labels, pos = shard_sequence(tokens, labels, sp_group)   # labels already shifted
    apply_tiled_mlp(model, tile_size=..., exclude=(MoELayer,))  # every other MLP site, in place
    apply_activation_checkpointing(model, offload=True)  # every block, inputs to host memory
                                                         # (or offload=ActivationOffload() to count them)
    loss_sum, count = tiled_cross_entropy(model.forward_hidden(tokens, pos), model.output_weight, labels)
    loss = sp_loss(loss_sum, count, sp_group)            # sum over SP ranks / global label count
    with local_attention(model): ...                     # whole sequence per rank, e.g. to sample

Sequence lengths reached (one training step of a dim-256, 2-layer, 32k-vocab Llama on CPU, see
benchmarks/long_sequence.md): under a 1.5 GiB RSS cap, 2560 tokens without ALST and >= 16384 with
it (>= 6.4x, bounded by CPU time, not memory: ~7 KB per token with ALST vs ~420 KB without), which
extrapolates to ~1.1M tokens per process under 8 GiB; Ulysses sp=N multiplies the per-process length
by about N. Ulysses needs sp <= the number of query heads; past the heads, or across nodes, ring attention
(`sequence_parallel.ring`: `apply_context_parallel(model, cp_group, sp_group)`, rows sharded by
`shard_sequence(..., cp_group=cp_group)`, the loss summed over the cp x sp ranks) splits the sequence further
(docs/long_context.md).
"""

from sequence_parallel.checkpointing import (
    ActivationOffload,
    apply_activation_checkpointing,
    checkpoint_module,
    is_checkpointed,
)
from sequence_parallel.data import collect_sequence, cross_entropy_sum, shard_sequence, sp_loss
from sequence_parallel.tiling import TiledMLP, apply_tiled_mlp, tiled_cross_entropy
from sequence_parallel.ulysses import HeadSplit, UlyssesAttention, apply_ulysses, head_split, local_attention

__all__ = [
    "ActivationOffload",
    "HeadSplit",
    "TiledMLP",
    "UlyssesAttention",
    "apply_activation_checkpointing",
    "apply_tiled_mlp",
    "apply_ulysses",
    "checkpoint_module",
    "collect_sequence",
    "cross_entropy_sum",
    "head_split",
    "is_checkpointed",
    "local_attention",
    "shard_sequence",
    "sp_loss",
    "tiled_cross_entropy",
]
