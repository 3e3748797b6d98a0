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

Variance refresh (`refresh_every=K`, after 0/1 Adam): every K-th step after the warm-up averages the gradients
themselves, sent in `refresh_dtype` (int8 with one fp32 scale per 256 elements by default, about a quarter of an
fp32 all-reduce; or bf16, fp32), and takes an Adam step on that average: the momentum becomes beta1 m + (1 - beta1) g
exactly, the variance beta2 v + (1 - beta2) g^2 (its bias correction counting the steps that updated it), and the
denominator the next compressed steps divide by is the new one. The error feedback carries on (preconditioned: its
buffers are rescaled into the new denominator's coordinates). A frozen variance cannot follow the gradients as
they shrink or grow over a run; with refreshes it follows them with a time constant of about K / (1 - beta2)
steps, at the cost of one quantized all-reduce per K steps.

Update bound (`max_update=c`, default none): after the warm-up each element's bias-corrected Adam update m / denom
is clipped to [-c, c] before the learning rate multiplies it (the momentum itself is kept whole). AdamW's own
update rarely exceeds about 1, since its variance includes the current gradient; a frozen variance has no such
brake, and an element whose gradient outgrows its frozen variance moves by many times the learning rate per step.
The bound keeps every element's pace at most c learning rates per step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from zero.config import ConfigError, int_at_least, key_namer
from zero.dist import comm
from zero.dist.comm import group_rank
from zero.dist.topology import group_size
from zero.optim.bound import BoundOptimizer
from zero.optim.compression import ChunkLayout, check_block, compressed_all_reduce, quantized_all_reduce
from zero.sharding.optimizer import collect_grads


#: How the variance refreshes' gradient average can travel; int8 with one fp32 scale per REFRESH_BLOCK elements.
REFRESH_DTYPES = ("int8", "bf16", "fp32")
REFRESH_BLOCK = 256


class OneBitAdam(BoundOptimizer):
    """Optimizer factory for zero.initialize: AdamW(lr, betas, eps, weight_decay) for `warmup_steps` steps,
    then 1-bit compressed momentum with one fp32 scale per `block` elements (a multiple of 8).

    Built like any factory (the engine calls it with its master shards); the engine then calls
    `bind(engine)`, which refuses what cannot work (`refuse_layout`) and returns the object that takes over the
    compressed steps. `keys`: how the refusals name the arguments and the layout (zero.config.key_name), so a
    caller with keys of its own (the recipe) checks with these rules before any process group exists.
    """

    def __init__(self, *, warmup_steps: int, block: int = 2048, precondition: bool = True, refresh_every: int = 0,
                 refresh_dtype: str = "int8", max_update: float | None = None, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
                 keys: Mapping[str, str] | None = None) -> None:
        k = key_namer(keys, "OneBitAdam")
        int_at_least(k("warmup_steps"), warmup_steps, 1, " (the compressed phase freezes the variance the warm-up's "
                     "AdamW steps estimated)")
        check_block(k("block"), block)
        if not isinstance(precondition, bool):
            raise ConfigError(f"{k('precondition')}={precondition!r} must be true or false")
        int_at_least(k("refresh_every"), refresh_every, 0, " (0: the variance stays frozen)")
        if refresh_dtype not in REFRESH_DTYPES:
            raise ConfigError(f"{k('refresh_dtype')}={refresh_dtype!r} must be one of {', '.join(REFRESH_DTYPES)}")
        if max_update is not None and (isinstance(max_update, bool) or not isinstance(max_update, (int, float))
                                       or not max_update > 0):
            raise ConfigError(f"{k('max_update')}={max_update!r} must be a number > 0, or null (no bound)")
        self.warmup_steps, self.block, self.precondition = warmup_steps, block, precondition
        self.refresh_every, self.refresh_dtype, self.max_update = refresh_every, refresh_dtype, max_update
        self.hyper = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        self.keys = keys

    def __call__(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        from zero.sharding.optimizer import FastAdamW  # (the engine's own AdamW: the warm-up is exactly it)

        return FastAdamW(**self.hyper)(params)

    def refuse_layout(self, config: Any, dims: Any) -> None:
        refuse_layout(config, dims, self.keys)

    def bind(self, engine: Any) -> OneBitAdamSteps:
        self.refuse_layout(engine.config, engine.dims)
        return OneBitAdamSteps(engine, self.warmup_steps, self.block, self.precondition, self.refresh_every,
                               self.refresh_dtype, self.max_update)

    def __repr__(self) -> str:
        return (f"OneBitAdam(warmup_steps={self.warmup_steps}, block={self.block}, precondition={self.precondition}, "
                f"refresh_every={self.refresh_every}, refresh_dtype={self.refresh_dtype}, max_update={self.max_update}, "
                f"{self.hyper})")


def refuse_layout(config: Any, dims: Any, keys: Mapping[str, str] | None = None) -> None:
    """Raise, in one line, for an engine configuration (a ZeroConfig; `dims`: anything with tp and pp) 1-bit Adam
    cannot train correctly; `keys` names the values (zero.config.key_name)."""
    z, d = key_namer(keys, "ZeroConfig"), key_namer(keys, "ParallelDims")
    if config.stage >= 2:
        raise ConfigError(f"1-bit Adam at {z('stage')}={config.stage} is not supported: stages 2-3 reduce-scatter "
                          "every gradient during backward, but the compressed phase needs each rank's own whole "
                          f"gradient to build its local momentum; use {z('stage')}=0 or 1")
    if config.offload_optimizer != "none":
        raise NotImplementedError(f"1-bit Adam with {z('offload_optimizer')}={config.offload_optimizer} is not "
                                  "implemented: its compressed step updates masters in device memory; use "
                                  f"{z('offload_optimizer')}=none")
    if config.dtype == "fp16":
        raise ConfigError(f"1-bit Adam with {z('dtype')}=fp16 is not supported: a loss-scale overflow would have to "
                          "be detected before the error feedback absorbs the gradient; use bf16 or fp32")
    if config.quantize_gradients != "none":
        raise ConfigError(f"1-bit Adam with {z('quantize_gradients')}={config.quantize_gradients} is not supported: "
                          f"it compresses the momentum itself; use {z('quantize_gradients')}=none")
    if config.clip_grad_norm:
        raise ConfigError(f"1-bit Adam with {z('clip_grad_norm')}={config.clip_grad_norm} is not supported: the "
                          "compressed phase never reduces gradients, so their global norm is unknown; set "
                          f"{z('clip_grad_norm')}=0")
    if dims.tp > 1 or dims.pp > 1:
        raise NotImplementedError(f"1-bit Adam with {d('tp')}={dims.tp}, {d('pp')}={dims.pp} is not implemented "
                                  "(tied pipeline copies and tensor-parallel replicas are not compressed): use "
                                  f"{d('tp')}=1, {d('pp')}=1")


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
    # [padded] fp32, the whole bucket's variance (refresh_every > 0 only: the refreshes update it whole; rebuilt
    # from the optimizer's exp_avg_sq shards, never checkpointed)
    variance: torch.Tensor | None = None


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
                 refresh_every: int = 0, refresh_dtype: str = "int8", max_update: float | None = None) -> None:
        self.engine, self.warmup_steps, self.block, self.precondition = engine, warmup_steps, block, precondition
        self.refresh_every, self.refresh_dtype, self.max_update = refresh_every, refresh_dtype, max_update
        self.frozen_at: int | None = None  # the optimizer step whose variance was frozen (the warm-up's end)
        self.feedback: list[_Feedback] | None = None

    def takes_step(self) -> bool:
        return self.engine.global_steps >= self.warmup_steps

    def _refreshes(self) -> bool:
        """Whether the step being taken is a variance refresh."""
        s, w, k = self.engine.global_steps, self.warmup_steps, self.refresh_every
        return bool(k) and s > w and (s - w) % k == 0

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
        """Each bucket's whole denominator sqrt(v / bias2) + eps (v gathered from the shards once), and its whole
        variance where refreshes update it."""
        zo = self.engine.zero_optimizer
        for b, master, fb in zip(zo.trainable, zo.masters.masters, self.feedback):
            variance = _whole(b, zo.optimizer.state[master]["exp_avg_sq"])
            if self.refresh_every:
                fb.variance = variance.clone()
            if self.precondition:
                fb.denom = self._denominator(master, variance)

    def _denominator(self, master: torch.Tensor, variance: torch.Tensor) -> torch.Tensor:
        group = self._group(master)
        bias2 = 1 - group["betas"][1] ** _variance_updates(self.engine.zero_optimizer.optimizer.state[master])
        return variance.sqrt().div_(math.sqrt(bias2)).add_(group["eps"])

    def _group(self, master: torch.Tensor) -> dict:
        return next(g for g in self.engine.zero_optimizer.optimizer.param_groups
                    if any(p is master for p in g["params"]))

    @torch.no_grad()
    def step(self) -> bool:
        """One compressed step (or variance refresh); False (nothing changed) when some rank's gradient is not
        finite."""
        zo = self.engine.zero_optimizer
        if self.feedback is None:
            self._freeze()  # (the warm-up just ended: freeze the state it left)
        if (self.precondition or self.refresh_every) and self.feedback[0].denom is None \
                and self.feedback[0].variance is None:
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
        refresh = self._refreshes()
        for i, (b, grad, fb) in enumerate(zip(zo.trainable, grads, self.feedback)):
            (self._refresh_bucket if refresh else self._step_bucket)(i, b, grad, fb)
        zo.gather_shards()
        zo.clear_grads()
        return True

    def _apply(self, master: torch.Tensor, momentum: torch.Tensor, denom: torch.Tensor | None, bias1: float,
               lr: float) -> None:
        """master -= lr * momentum / denom / bias1 (denom None: the momentum is already over the denominator), each
        element of that bias-corrected update bounded to +-max_update where a bound is set."""
        if self.max_update is None:
            if denom is None:
                master.add_(momentum, alpha=-lr / bias1)
            else:
                master.addcdiv_(momentum, denom, value=-lr / bias1)
            return
        update = momentum if denom is None else momentum / denom
        master.add_((update / bias1).clamp_(-self.max_update, self.max_update), alpha=-lr)

    def _share(self, fb: _Feedback) -> float:
        # The engine's reduced gradient is sum over the reduction group / dp (experts: over their expert-data-
        # parallel group); each rank's share of that average is its gradient times group size / dp.
        return fb.layout.world / self.engine.dp

    def _step_bucket(self, i: int, b: Any, grad: torch.Tensor, fb: _Feedback) -> None:
        zo = self.engine.zero_optimizer
        master = zo.masters.masters[i]
        group = self._group(master)
        beta1, beta2 = group["betas"]
        local = grad.mul_((1 - beta1) * self._share(fb)).add_(fb.momentum, alpha=beta1)
        if self.precondition:
            local.div_(fb.denom)  # the update direction: what travels, and what the error feedback tracks
        average = fb.layout.from_chunks(compressed_all_reduce(fb.layout.to_chunks(local), fb.worker_error,
                                                              fb.server_error, fb.layout, b.grad_group))
        state = zo.optimizer.state[master]
        # state["step"] counts the steps that updated the variance (the warm-up's and the refreshes'); the
        # momentum, updated every step, is corrected for the optimizer steps taken
        bias1 = 1 - beta1 ** float(self.engine.global_steps + 1)
        master.mul_(1 - group["lr"] * group["weight_decay"])
        own = b.shard_of(average) if b.world > 1 else average  # this rank's shard of the averaged direction
        if self.precondition:
            fb.momentum.copy_(average).mul_(fb.denom)
            self._apply(master, own, None, bias1, group["lr"])
        else:
            fb.momentum.copy_(average)
            bias2 = 1 - beta2 ** _variance_updates(state)
            denom = (state["exp_avg_sq"].sqrt() / math.sqrt(bias2)).add_(group["eps"])
            self._apply(master, own, denom, bias1, group["lr"])
        mine = b.shard_of(fb.momentum) if b.world > 1 else fb.momentum
        state["exp_avg"].copy_(mine)
        if not zo.masters.aliased[i]:
            b.write_shard(master)

    def _refresh_bucket(self, i: int, b: Any, grad: torch.Tensor, fb: _Feedback) -> None:
        """A variance refresh: the gradients averaged in `refresh_dtype`, then an Adam step on that average."""
        zo = self.engine.zero_optimizer
        master = zo.masters.masters[i]
        group, state = self._group(master), zo.optimizer.state[master]
        beta1, beta2 = group["betas"]
        layout = ChunkLayout(b.padded, fb.layout.world, REFRESH_BLOCK)
        local = grad.mul_(self._share(fb))
        average = layout.from_chunks(quantized_all_reduce(layout.to_chunks(local), layout, self.refresh_dtype,
                                                          b.grad_group))
        fb.momentum.mul_(beta1).add_(average, alpha=1 - beta1)
        fb.variance.mul_(beta2).addcmul_(average, average, value=1 - beta2)
        state["step"] += 1
        bias1 = 1 - beta1 ** float(self.engine.global_steps + 1)
        denom = self._denominator(master, fb.variance)
        if self.precondition:  # the error feedback into the new denominator's coordinates
            ratio = fb.layout.to_chunks(fb.denom / denom)
            fb.worker_error.mul_(ratio)
            fb.server_error.mul_(ratio[group_rank(b.grad_group)])
            fb.denom = denom
        master.mul_(1 - group["lr"] * group["weight_decay"])
        shard = (lambda t: b.shard_of(t)) if b.world > 1 else (lambda t: t)
        self._apply(master, shard(fb.momentum), shard(denom), bias1, group["lr"])
        state["exp_avg"].copy_(shard(fb.momentum))
        state["exp_avg_sq"].copy_(shard(fb.variance))
        if not zo.masters.aliased[i]:
            b.write_shard(master)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        feedback = None if self.feedback is None else [
            {"momentum": f.momentum.clone(), "worker_error": f.worker_error.clone(),
             "server_error": f.server_error.clone()} for f in self.feedback]
        return {"kind": "onebit_adam", "warmup_steps": self.warmup_steps, "block": self.block,
                "precondition": self.precondition, "refresh_every": self.refresh_every,
                "refresh_dtype": self.refresh_dtype, "frozen_at": self.frozen_at, "feedback": feedback}

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
        if self.refresh_every and state.get("refresh_dtype") != self.refresh_dtype:
            raise ValueError(f"checkpoint's 1-bit Adam refresh_dtype={state.get('refresh_dtype')} differs from "
                             f"refresh_dtype={self.refresh_dtype} (None: written when a refresh was a full AdamW "
                             "step): resume with the refreshes it was written with")
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
