"""The Llama's parallel parts of the model contract: its tensor-parallel styles and divisibility rules, and its
pipeline stages (consecutive layers sharing the model's modules and names) with the shapes they exchange."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from moe_lst.kernels.documents import Documents

from moe import ExpertTensorParallel
from zero.contract import ModelContract
from zero.parallel.tensor import ColwiseParallel, RowwiseParallel, SequenceParallelNorm, VocabParallelEmbedding


def check_tensor_parallel(cfg, tp: int) -> None:
    """The divisibility rules of this model's tensor-parallel styles, with the rule in the message."""
    if cfg.attention == "nsa" and tp > 1:
        raise ValueError(f"model.attention=nsa with tp={tp} is not supported (its compressors are shared by all "
                         "heads, so their gradients would need a reduction over tp); use sp for long sequences")
    if cfg.n_heads % tp:
        raise ValueError(f"tp={tp} must divide model.n_heads={cfg.n_heads} (attention heads are split over tp)")
    if cfg.n_kv_heads % tp and tp % cfg.n_kv_heads:
        raise ValueError(f"tp={tp} and model.n_kv_heads={cfg.n_kv_heads}: kv heads are split over tp when tp "
                         "divides them, or replicated when they divide tp; neither holds")
    if cfg.vocab_size % tp:
        raise ValueError(f"tp={tp} must divide model.vocab_size={cfg.vocab_size} (vocabulary-parallel embedding)")
    if cfg.ffn_dim % tp:
        raise ValueError(f"tp={tp} must divide model.ffn_dim={cfg.ffn_dim} (MLP hidden units are split over tp)")
    if cfg.moe.num_experts and (cfg.moe.ffn_dim or cfg.ffn_dim) % tp:
        raise ValueError(f"tp={tp} must divide the expert hidden width {cfg.moe.ffn_dim or cfg.ffn_dim} "
                         "(expert tensor parallelism)")


def tensor_parallel_styles(model, tp: int) -> dict:
    """How this model splits over tp ranks (zero.parallel.tensor.apply_tensor_parallel): vocabulary-
    parallel embedding (and tied head), sequence-parallel norms, column-parallel q/k/v and MLP input,
    row-parallel attention output and MLP output, expert tensor parallelism for MoE layers."""
    check_tensor_parallel(model.cfg, tp)
    styles: dict = {"tok_embeddings": VocabParallelEmbedding()}
    for i in range(len(model.layers)):
        p = f"layers.{i}"
        styles[f"{p}.attention_norm"] = SequenceParallelNorm(gather_output=True)
        styles[f"{p}.attention.wq"] = ColwiseParallel(units=model.cfg.n_heads)
        styles[f"{p}.attention.wk"] = ColwiseParallel(units=model.cfg.n_kv_heads)
        styles[f"{p}.attention.wv"] = ColwiseParallel(units=model.cfg.n_kv_heads)
        styles[f"{p}.attention.wo"] = RowwiseParallel()
        styles[f"{p}.ffn_norm"] = SequenceParallelNorm(gather_output=True)
        if model.cfg.is_moe_layer(i):
            styles[f"{p}.feed_forward"] = ExpertTensorParallel()
        else:
            styles[f"{p}.feed_forward.w1"] = ColwiseParallel()
            styles[f"{p}.feed_forward.w3"] = ColwiseParallel()
            styles[f"{p}.feed_forward.w2"] = RowwiseParallel()
    # The final norm gathers the sequence: the (tied or own) head then gives vocabulary-sliced logits.
    styles["norm"] = SequenceParallelNorm(gather_output=True)
    if model.output is not None:
        styles["output"] = ColwiseParallel()
    return styles


def pipeline_shapes(model, tokens_shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(activation between stages, last stage's output) for a micro-batch of tokens [b, s]: hidden
    [b, s / tp, dim] (sequence-parallel shards under tensor parallelism) and logits [b, s, vocab / tp]."""
    b, s = tokens_shape
    local_vocab = model.output_weight.shape[0]
    tp = model.cfg.vocab_size // local_vocab
    return (b, s // tp, model.cfg.dim), (b, s, local_vocab)


class PipelineStageModule(nn.Module, ModelContract):
    """Consecutive layers of a Transformer as one pipeline stage; its parameter names are the model's.

    forward(x, position_ids): x is the token ids on the first stage, else the hidden states from the
    stage before; returns hidden states, or logits (vocabulary-sliced under tensor parallelism) on the
    last stage. Position ids come to every stage beside the activations (they are not sent). With tied
    embeddings the last stage holds the embedding as its head.
    """

    def __init__(self, model, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        self.cfg, self.first, self.last = model.cfg, first, last
        self._rotary = model.rotary  # a function, not a module: the other stages' layers stay unregistered
        self.tied = last and model.output is None
        if first:
            self.tok_embeddings = model.tok_embeddings
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layers})
        if last:
            self.norm = model.norm
            if model.output is not None:
                self.output = model.output
            else:  # the tied head: on another rank than the first stage it is a copy (zero.parallel.pipeline ties them)
                self.tok_embeddings = model.tok_embeddings

    def blocks(self) -> list[tuple[str, nn.Module]]:
        return [(f"layers.{i}", layer) for i, layer in self.layers.items()]

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None, packed: bool = False) -> torch.Tensor:
        if self.first:
            tokens = x
            x = self.tok_embeddings(tokens)
        if position_ids is None:
            raise ValueError("pipeline stages need position_ids beside their input (pass them to every stage)")
        cos, sin = self._rotary(position_ids)
        documents = Documents(position_ids) if packed else None  # packed documents: attention stays inside each
        for layer in self.layers.values():
            x = layer(x, cos, sin, documents)
        if self.last:
            x = self.norm(x)
            weight = self.tok_embeddings.weight if self.tied else self.output.weight
            x = F.linear(x, weight)
        return x.contiguous()  # sent to the next stage as it is
