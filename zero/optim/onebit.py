"""1-bit Adam: AdamW for a warm-up, then frozen variance and a 1-bit compressed momentum all-reduce.

During the first `warmup_steps` optimizer steps the engine steps exactly as with AdamW (the same torch
optimizer, full-precision gradient reduction). Afterwards gradients are no longer reduced: each rank folds
its own gradient into its copy of the momentum, the momenta are averaged by the error-compensated 1-bit
all-reduce (`zero.optim.compression`, worker and server error feedback), and every rank applies the averaged
momentum over the variance frozen at the end of the warm-up. Works at ZeRO stages 0-1, fp32 and bf16, with
gradient accumulation and with experts (their momenta are averaged over their expert-data-parallel group).

What is compressed: by default (`precondition=True`) the momentum divided by the frozen Adam denominator
(sqrt(v / bias2) + eps), i.e. the update direction, and the average is multiplied back. Since the denominator is
frozen this is the same average (averaging commutes with a fixed per-element scale) and the error feedback works
in the same fixed coordinates, but a block's 1-bit scale is then shared by elements of comparable update size: an
element whose variance is tiny beside its block-mates' no longer receives the block's mean momentum divided by
its own tiny denominator (a step of many times the learning rate). `precondition=False` compresses the raw
momentum, as DeepSpeed's 1-bit Adam does.

Variance refresh (`refresh_every=K`, 0/1 Adam's idea in its simplest form): every K-th optimizer step after the
warm-up is an ordinary AdamW step (full-precision gradient reduction, the variance updated), after which the
compressed phase freezes afresh (the momentum and variance that step left, error buffers cleared). It costs one
AdamW reduction per K steps. Each refresh adds one gradient to the variance at weight 1 - beta2, so the variance
follows the gradients only slowly (at beta2 = 0.999, over about 1000 refreshes); the first compressed period has K
compressed steps, later ones K - 1, and K = 1 leaves one compressed step and AdamW after it. The variance's bias
correction counts only the steps that updated it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from zero.dist import comm
from zero.dist.topology import group_size
from zero.optim.bound import BoundOptimizer
from zero.optim.compression import ChunkLayout, compressed_all_reduce
from zero.sharding.optimizer import collect_grads


class OneBitAdam(BoundOptimizer):
    """Optimizer factory for zero.initialize: AdamW(lr, betas, eps, weight_decay) for `warmup_steps` steps,
    then 1-bit compressed momentum with one fp32 scale per `block` elements (a multiple of 8).

    Built like any factory (the engine calls it with its master shards); the engine then calls
    `bind(engine)`, which refuses what cannot work and returns the object that takes over the compressed
    steps.
    """

    def __init__(self, *, warmup_steps: int, block: int = 2048, precondition: bool = True, refresh_every: int = 0,
                 lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01) -> None:
        if not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(f"warmup_steps={warmup_steps!r} must be an int >= 1: the compressed phase freezes the "
                             "variance the warm-up's AdamW steps estimated")
        ChunkLayout(1, 1, block)  # checks the block
        if not isinstance(precondition, bool):
            raise ValueError(f"precondition={precondition!r} must be True or False")
        if isinstance(refresh_every, bool) or not isinstance(refresh_every, int) or refresh_every < 0:
            raise ValueError(f"refresh_every={refresh_every!r} must be an int >= 0 (0: the variance stays frozen)")
        self.warmup_steps, self.block, self.precondition = warmup_steps, block, precondition
        self.refresh_every = refresh_every
        self.hyper = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}

    def __call__(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        from zero.sharding.optimizer import FastAdamW  # (the engine's own AdamW: the warm-up is exactly it)

        return FastAdamW(**self.hyper)(params)

    def bind(self, engine: Any) -> OneBitAdamSteps:
        refuse_layout(engine.config, engine.dims)
        return OneBitAdamSteps(engine, self.warmup_steps, self.block, self.precondition, self.refresh_every)

    def __repr__(self) -> str:
        return (f"OneBitAdam(warmup_steps={self.warmup_steps}, block={self.block}, precondition={self.precondition}, "
                f"refresh_every={self.refresh_every}, {self.hyper})")


def refuse_layout(config: Any, dims: Any) -> None:
    """Raise, in one line, for an engine configuration 1-bit Adam cannot train correctly."""
    if config.stage >= 2:
        raise ValueError(f"1-bit Adam at zero.stage={config.stage} is not supported: stages 2-3 reduce-scatter every "
                         "gradient during backward, but the compressed phase needs each rank's own whole gradient to "
                         "build its local momentum; use zero.stage=0 or 1")
    if config.offload_optimizer != "none":
        raise NotImplementedError(f"1-bit Adam with zero.offload_optimizer={config.offload_optimizer} is not "
                                  "implemented: its compressed step updates masters in device memory")
    if config.dtype == "fp16":
        raise ValueError("1-bit Adam with zero.dtype=fp16 is not supported: a loss-scale overflow would have to be "
                         "detected before the error feedback absorbs the gradient; use bf16 or fp32")
    if config.quantize_gradients != "none":
        raise ValueError(f"1-bit Adam with zero.quantize_gradients={config.quantize_gradients} is not supported: it "
                         "compresses the momentum itself; use zero.quantize_gradients=none")
    if config.clip_grad_norm:
        raise ValueError(f"1-bit Adam with clip_grad_norm={config.clip_grad_norm} is not supported: the compressed "
                         "phase never reduces gradients, so their global norm is unknown; turn clipping off")
    if dims.tp > 1 or dims.pp > 1:
        raise NotImplementedError(f"1-bit Adam with tp={dims.tp}, pp={dims.pp} is not implemented (tied pipeline "
                                  "copies and tensor-parallel replicas are not compressed): use tp=1, pp=1")


@dataclass
class _Feedback:
    """One trainable bucket's compressed-phase state (the same on every rank but the two errors)."""

    layout: ChunkLayout
    momentum: torch.Tensor  # [padded] fp32, the averaged momentum of the last step (every rank's copy)
    worker_error: torch.Tensor  # [world, padded_chunk] what this rank's compression has lost so far
    server_error: torch.Tensor  # [padded_chunk] what this rank's server compression has lost so far
    # [padded] fp32, the frozen Adam denominator of the whole bucket (precondition=True only; rebuilt from the
    # optimizer's frozen exp_avg_sq, never checkpointed)
    denom: torch.Tensor | None = None


def _variance_updates(state: dict) -> float:
    """How many AdamW steps have updated this master's exp_avg_sq (the compressed steps leave it and the step
    count alone)."""
    return float(state["step"])


def _whole(b: Any, shard: torch.Tensor) -> torch.Tensor:
    """The bucket's whole [padded] fp32 tensor from this rank's shard of it (gathered over the bucket's group)."""
    full = torch.empty(b.padded, dtype=torch.float32, device=b.device)
    comm.all_gather_into_tensor(full, shard.float().contiguous(), b.group) if b.world > 1 else full.copy_(shard)
    return full


def _local_grad(b: Any) -> torch.Tensor:
    """The bucket's accumulated local gradient ([padded], fp32), with the gradients that bypassed the flat
    buffer folded in (zero.sharding.optimizer.collect_grads)."""
    collect_grads(b)
    return b.grad_full.float()


class OneBitAdamSteps:
    """The compressed steps of one engine (built by OneBitAdam.bind): takes over from `warmup_steps` on."""

    def __init__(self, engine: Any, warmup_steps: int, block: int, precondition: bool = True,
                 refresh_every: int = 0) -> None:
        self.engine, self.warmup_steps, self.block, self.precondition = engine, warmup_steps, block, precondition
        self.refresh_every = refresh_every
        self.frozen_at: int | None = None  # the optimizer step whose variance is frozen
        self.feedback: list[_Feedback] | None = None

    def takes_step(self) -> bool:
        s = self.engine.global_steps
        if s < self.warmup_steps:
            return False
        # a refresh step: the engine's own AdamW step (full-precision reduction, the variance updated)
        return not (self.refresh_every and s > self.warmup_steps and (s - self.warmup_steps) % self.refresh_every == 0)

    def _frozen_at(self) -> int:
        """The step count when the current compressed period began: the warm-up's end or one past the last
        refresh step before now."""
        s, w, k = self.engine.global_steps, self.warmup_steps, self.refresh_every
        refreshes = (s - 1 - w) // k if k and s > w else 0
        return w + k * refreshes + 1 if refreshes else w

    # ------------------------------------------------------------------ the compressed phase
    @torch.no_grad()
    def _freeze(self) -> None:
        """Start the compressed phase: every rank's momentum is AdamW's (gathered whole, once)."""
        zo = self.engine.zero_optimizer
        self.frozen_at, self.feedback = self.engine.global_steps, []
        for b, master in zip(zo.trainable, zo.masters.masters):
            layout = ChunkLayout(b.padded, group_size(b.grad_group), self.block)
            self.feedback.append(_Feedback(
                layout, _whole(b, zo.optimizer.state[master]["exp_avg"]), torch.zeros(layout.world, layout.padded_chunk, device=b.device),
                torch.zeros(layout.padded_chunk, device=b.device)))

    @torch.no_grad()
    def _denominators(self) -> None:
        """Each bucket's whole frozen denominator sqrt(v / bias2) + eps (v gathered from the shards once)."""
        zo = self.engine.zero_optimizer
        for b, master, fb in zip(zo.trainable, zo.masters.masters, self.feedback):
            group, state = self._group(master), zo.optimizer.state[master]
            bias2 = 1 - group["betas"][1] ** _variance_updates(state)
            fb.denom = _whole(b, state["exp_avg_sq"]).sqrt_().div_(math.sqrt(bias2)).add_(group["eps"])

    def _group(self, master: torch.Tensor) -> dict:
        return next(g for g in self.engine.zero_optimizer.optimizer.param_groups
                    if any(p is master for p in g["params"]))

    @torch.no_grad()
    def step(self) -> bool:
        """One compressed step; False (nothing changed) when some rank's gradient is not finite."""
        zo = self.engine.zero_optimizer
        if self.feedback is None or self.frozen_at != self._frozen_at():
            self._freeze()  # (the warm-up or a refresh step just ended: freeze the state it left)
        if self.precondition and self.feedback[0].denom is None:
            self._denominators()
        grads = [_local_grad(b) for b in zo.trainable]
        # The averaged gradient is never formed, so the reported norm is the root mean square over ranks of
        # each rank's own gradient norm: 8 bytes that also tell every rank whether some gradient is not finite.
        square = sum((g.double().square().sum() for g in grads), torch.zeros((), dtype=torch.float64))
        square = square.reshape(1).to(zo.device)
        comm.all_reduce(square, zo.norm_group)
        zo.last_grad_norm = math.sqrt(float(square) / comm.group_size(zo.norm_group))
        if not math.isfinite(zo.last_grad_norm):
            zo.clear_grads()
            return False
        for i, (b, grad, fb) in enumerate(zip(zo.trainable, grads, self.feedback)):
            self._step_bucket(i, b, grad, fb)
        zo.gather_shards()
        zo.clear_grads()
        return True

    def _step_bucket(self, i: int, b: Any, grad: torch.Tensor, fb: _Feedback) -> None:
        zo = self.engine.zero_optimizer
        master = zo.masters.masters[i]
        group = self._group(master)
        beta1, beta2 = group["betas"]
        # The engine's reduced gradient is sum over the reduction group / dp (experts: over their expert-data-
        # parallel group); each rank's share of that average is its gradient times group size / dp.
        share = fb.layout.world / self.engine.dp
        local = grad.mul_((1 - beta1) * share).add_(fb.momentum, alpha=beta1)
        if self.precondition:
            local.div_(fb.denom)  # the update direction: what travels, and what the error feedback tracks
        average = fb.layout.from_chunks(compressed_all_reduce(fb.layout.to_chunks(local), fb.worker_error,
                                                              fb.server_error, fb.layout, b.grad_group))
        state = zo.optimizer.state[master]
        # state["step"] counts the AdamW steps (those that updated the variance: the warm-up's and the refreshes'),
        # so that a refresh step's AdamW corrects the variance's bias for its real number of updates; the momentum,
        # updated every step, is corrected for the optimizer steps taken
        bias1 = 1 - beta1 ** float(self.engine.global_steps + 1)
        master.mul_(1 - group["lr"] * group["weight_decay"])
        own = b.shard_of(average) if b.world > 1 else average  # this rank's shard of the averaged direction
        if self.precondition:
            fb.momentum.copy_(average).mul_(fb.denom)
            master.add_(own, alpha=-group["lr"] / bias1)
        else:
            fb.momentum.copy_(average)
            bias2 = 1 - beta2 ** _variance_updates(state)
            denom = (state["exp_avg_sq"].sqrt() / math.sqrt(bias2)).add_(group["eps"])
            master.addcdiv_(own, denom, value=-group["lr"] / bias1)
        mine = b.shard_of(fb.momentum) if b.world > 1 else fb.momentum
        state["exp_avg"].copy_(mine)
        if not zo.masters.aliased[i]:
            b.write_shard(master)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        feedback = None if self.feedback is None else [
            {"momentum": f.momentum.clone(), "worker_error": f.worker_error.clone(),
             "server_error": f.server_error.clone()} for f in self.feedback]
        return {"kind": "onebit_adam", "warmup_steps": self.warmup_steps, "block": self.block,
                "precondition": self.precondition, "refresh_every": self.refresh_every, "frozen_at": self.frozen_at,
                "feedback": feedback}

    @torch.no_grad()
    def load_state_dict(self, state: dict | None) -> None:
        """Restore the compressed phase's state; None (a checkpoint without it: resharded, or written by
        AdamW) is fine only before the compressed phase began."""
        if state is None or state.get("feedback") is None:
            if self.engine.global_steps > self.warmup_steps:
                raise NotImplementedError(
                    f"this checkpoint (step {self.engine.global_steps}) lacks 1-bit Adam's error feedback for its "
                    f"compressed phase (warm-up {self.warmup_steps} steps): it was resharded or written by another "
                    "optimizer; resume under the layout and optimizer it was written with")
            self.frozen_at, self.feedback = None, None
            return
        if state["block"] != self.block:
            raise ValueError(f"checkpoint's 1-bit Adam block={state['block']} differs from block={self.block}: "
                             "resume with the same chunking")
        if state.get("refresh_every", 0) != self.refresh_every:
            raise ValueError(f"checkpoint's 1-bit Adam refresh_every={state.get('refresh_every', 0)} differs from "
                             f"refresh_every={self.refresh_every}: resume with the same variance refreshes")
        saved = state.get("precondition", False)  # (checkpoints from before the option compressed the momentum)
        if saved != self.precondition:
            raise ValueError(f"checkpoint's 1-bit Adam precondition={saved} differs from precondition="
                             f"{self.precondition}: its error feedback is in the other coordinates; resume with "
                             f"precondition={saved}")
        zo = self.engine.zero_optimizer
        self.frozen_at, self.feedback = state["frozen_at"], []
        for b, saved in zip(zo.trainable, state["feedback"]):
            layout = ChunkLayout(b.padded, group_size(b.grad_group), self.block)
            self.feedback.append(_Feedback(layout, *(saved[k].to(b.device).clone()
                                                     for k in ("momentum", "worker_error", "server_error"))))
