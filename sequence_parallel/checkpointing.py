"""Activation checkpointing per layer, optionally offloading the saved layer inputs to CPU memory.

A checkpointed layer keeps only its inputs from forward and recomputes its activations in backward;
with offload those inputs wait in (pinned) host memory, so device memory holds one layer's worth.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from zero.contract import contract_of


@dataclass
class ActivationOffload:
    """Keeps checkpointed layer inputs in host memory between forward and backward, counting what it holds.

    One object serves every block it is given to; the counters add up over steps until `reset()`.
    `packed_*` count the tensors handed to host storage in forward, `restored_*` those brought back for
    the recomputation in backward. A tensor already in host memory (a CPU device) is kept as it is, not
    copied, and still counted: the counters read the same as on an accelerator.
    """

    packed_tensors: int = 0
    packed_bytes: int = 0
    restored_tensors: int = 0
    restored_bytes: int = 0

    @property
    def held_bytes(self) -> int:
        """Bytes packed and not yet restored (activations waiting in host memory for their backward)."""
        return self.packed_bytes - self.restored_bytes

    def reset(self) -> None:
        self.packed_tensors = self.packed_bytes = self.restored_tensors = self.restored_bytes = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """`t` in host memory (pinned when CUDA is there, so the copy back can overlap compute)."""
        self.packed_tensors += 1
        self.packed_bytes += t.numel() * t.element_size()
        if t.device.type == "cpu":
            return t
        host = torch.empty(t.shape, dtype=t.dtype, layout=t.layout, pin_memory=torch.cuda.is_available())
        host.copy_(t, non_blocking=True)
        return host

    def restore(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The packed `t` back on `device`."""
        self.restored_tensors += 1
        self.restored_bytes += t.numel() * t.element_size()
        return t.to(device, non_blocking=True)


class _Checkpoint(torch.autograd.Function):
    """Reentrant-style checkpoint: forward without a graph, backward recomputes and differentiates.

    Inputs are (run, offload, n_args, *args, *params). The layer's parameters are explicit inputs, so
    their gradients come back from this function and autograd accumulates them once per step.
    With an `ActivationOffload`, tensor arguments that require grad (the activations flowing through
    the layers) go to host memory; the others (e.g. RoPE tables shared by every layer) stay where they are.
    """

    @staticmethod
    def forward(ctx, run: Callable, offload: ActivationOffload | None, n_args: int, *inputs):
        args, params = inputs[:n_args], inputs[n_args:]
        ctx.run, ctx.offload, ctx.params = run, offload, params
        ctx.cpu_rng = torch.get_rng_state()
        on_cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        ctx.cuda_rng = torch.cuda.get_rng_state() if on_cuda else None
        with torch.no_grad():
            out = run(*args)
        # One (value, device, requires_grad, packed) per argument; device is None for non-tensors.
        saved = []
        for a in args:
            if torch.is_tensor(a):
                packed = offload is not None and a.requires_grad
                saved.append((offload.pack(a) if packed else a, a.device, a.requires_grad, packed))
            else:
                saved.append((a, None, False, False))
        ctx.saved_args = saved
        return out

    @staticmethod
    def backward(ctx, *grad_outs):
        args = []
        for a, device, requires_grad, packed in ctx.saved_args:
            if device is not None:
                a = ctx.offload.restore(a, device) if packed else a
                a = a.detach().requires_grad_(requires_grad)
            args.append(a)
        ctx.saved_args = None
        params = list(ctx.params)
        with torch.random.fork_rng(devices=[] if ctx.cuda_rng is None else [torch.cuda.current_device()]):
            # Same random stream as the forward, so dropout masks match.
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng)
            with torch.enable_grad():
                out = ctx.run(*args)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grad_outs)
                 if torch.is_tensor(o) and o.requires_grad and g is not None]
        grad_args = [a for a in args if torch.is_tensor(a) and a.requires_grad]
        wanted = grad_args + [p for p in params if p.requires_grad]
        grads = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True) \
            if pairs and wanted else [None] * len(wanted)
        it = iter(grads)
        arg_grads = [next(it) if torch.is_tensor(a) and a.requires_grad else None for a in args]
        param_grads = [next(it) if p.requires_grad else None for p in params]
        return (None, None, None, *arg_grads, *param_grads)


class _CheckpointedForward:
    """The `forward` that `checkpoint_module` installs; it carries the module's checkpoint settings itself.

    Being the replaced `forward` is the module's only mark of being checkpointed: no flags are added.
    A plain class (not a closure), so the module still deep-copies and pickles.
    """

    def __init__(self, module: nn.Module, original: Callable, offload: ActivationOffload | None) -> None:
        self.module, self.original, self.offload = module, original, offload

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.original(*args, **kwargs)

        def run(*a):
            return self.original(*a, **kwargs)

        params = list(self.module.parameters())
        return _Checkpoint.apply(run, self.offload, len(args), *args, *params)


def _resolve_offload(offload: bool | ActivationOffload) -> ActivationOffload | None:
    if isinstance(offload, ActivationOffload):
        return offload
    if isinstance(offload, bool):
        return ActivationOffload() if offload else None
    raise TypeError(f"offload must be True, False or an ActivationOffload, got {type(offload).__name__}")


def checkpoint_module(module: nn.Module, offload: bool | ActivationOffload = False) -> nn.Module:
    """Checkpoint `module` in place: its forward keeps only its inputs and recomputes in backward.

    With `offload` (an `ActivationOffload` to read its counters, or True for a new one) the inputs that
    carry gradient wait in pinned host memory between forward and backward; on a CPU device they are
    already there and are not copied. Parameter names and the state dict are unchanged (only `forward`
    is replaced). Keyword arguments are passed through but get no gradient. The recomputation repeats
    the forward once, so any side effect of forward (e.g. MoE router statistics) is recorded twice.
    A module that is already checkpointed is left as it is, with its first offload setting. Returns
    the module.
    """
    resolved = _resolve_offload(offload)
    if not is_checkpointed(module):
        module.forward = _CheckpointedForward(module, module.forward, resolved)
    return module


def is_checkpointed(module: nn.Module) -> bool:
    """Whether `checkpoint_module` has checkpointed `module`."""
    return isinstance(vars(module).get("forward"), _CheckpointedForward)


def apply_activation_checkpointing(model: nn.Module, offload: bool | ActivationOffload = False,
                                   predicate: Callable[[str, nn.Module], bool] | None = None) -> nn.Module:
    """Checkpoint (and optionally offload the inputs of) every block of `model` (`zero.contract`: the
    model's `blocks()`), or every submodule `predicate(name, module)` picks when one is given.

    All chosen blocks share one `ActivationOffload`: pass your own to read how many tensors and bytes went
    to host memory and came back (True makes a new one). Returns the model.
    """
    if predicate is None:
        chosen = [m for _, m in contract_of(model, "apply_activation_checkpointing", "blocks").blocks()]
    else:
        chosen = [m for n, m in model.named_modules() if n and predicate(n, m)]
    if not chosen:
        raise ValueError(
            f"apply_activation_checkpointing: no block of {type(model).__name__} was chosen; its blocks() are "
            "empty or the predicate selected nothing"
        )
    shared = _resolve_offload(offload)
    for m in chosen:
        checkpoint_module(m, offload=shared or False)
    return model
