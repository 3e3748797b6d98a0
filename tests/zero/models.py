"""Tiny models, data and a single-process reference loop shared by the ZeRO tests."""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

VOCAB, DIM, SEQ = 37, 12, 6  # odd sizes so flat buffers need padding on 2 and 4 ranks


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 3 * dim)
        self.down = nn.Linear(3 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """Embedding, a ModuleList of blocks, a head (optionally tied to the embedding).

    ckpt: False, True (non-reentrant activation checkpointing per block) or "reentrant";
    reuse_block applies the first block a second time, so its parameters get two gradient terms.
    """

    def __init__(
        self, n_layers: int = 3, tie: bool = False, ckpt: bool | str = False, reuse_block: bool = False
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(DIM) for _ in range(n_layers))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tie:
            self.head.weight = self.embed.weight
        self.ckpt = ckpt
        self.reuse_block = reuse_block

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.ckpt == "reentrant") if self.ckpt else block(x)
        if self.reuse_block:  # the first block used twice per step
            x = self.blocks[0](x)
        return self.head(self.norm(x))


def lm_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def global_batch(step: int, micro: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)


def build(seed: int = 0, **kw) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(**kw)


OPT = functools.partial(torch.optim.AdamW, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
# Plain SGD for equivalence tests: the parameters after one step are the initial values minus lr times
# the reduced gradient, so they compare the gradient itself (Adam would hide a constant scale).
SGD = functools.partial(torch.optim.SGD, lr=0.5)


def reference(
    model_kw: dict,
    steps: int,
    rows: int,
    accum: int = 1,
    clip: float | None = None,
    loss_fn=lm_loss,
    batch_fn=global_batch,
    model_fn=None,
    before_step=None,
    optimizer=SGD,
) -> dict:
    """Single process, full global batch: the trajectory every parallel run must reproduce
    (`tests.equivalence.reference_trajectory`: losses, gradient norms, parameters after step 1 and at the end)."""
    from tests.equivalence import reference_trajectory

    model = (model_fn or build)(**model_kw)
    return reference_trajectory(
        model, optimizer(model.parameters()), steps,
        lambda m, step: (loss_fn(m, batch_fn(step, micro, rows)) for micro in range(accum)),
        clip=clip, before_step=before_step)


class MoEBlock(nn.Module):
    def __init__(self, dim: int, num_experts: int, aux_loss_coef: float = 0.0, z_loss_coef: float = 1e-3) -> None:
        super().__init__()
        from moe import MoELayer

        self.norm = nn.LayerNorm(dim)
        # aux loss off by default: it is a product of batch statistics, so a per-rank batch cannot
        # reproduce the global-batch value; the z-loss is a plain token mean and stays on.
        self.ffn = MoELayer(dim, 16, num_experts, top_k=2, aux_loss_coef=aux_loss_coef, z_loss_coef=z_loss_coef)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ffn(self.norm(x))


class TinyMoE(nn.Module):
    """Embedding, a dense block, MoE blocks, a head: dense and expert parameters in every unit kind."""

    def __init__(self, n_layers: int = 2, num_experts: int = 4, ckpt: bool = False, **moe_kw) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(DIM)] + [MoEBlock(DIM, num_experts, **moe_kw) for _ in range(n_layers)])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.ckpt = ckpt

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.ckpt else block(x)
        return self.head(self.norm(x))


def build_moe(seed: int = 0, **kw) -> TinyMoE:
    torch.manual_seed(seed)
    return TinyMoE(**kw)


STARVE_STEP = 4


def starve_last_experts(model: nn.Module, step: int) -> None:
    """At STARVE_STEP route every token to experts 0 and 1, so the ranks holding the others get none."""
    from moe import MoELayer

    for m in model.modules():
        if isinstance(m, MoELayer):
            bias = m.router.expert_bias
            bias.zero_()
            if step == STARVE_STEP:
                bias[:2] = 100.0
