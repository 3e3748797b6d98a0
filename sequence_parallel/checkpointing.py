"""Activation checkpointing per layer, optionally offloading the saved layer inputs to CPU memory.

A checkpointed layer keeps only its inputs from forward and recomputes its activations in backward;
with offload those inputs wait in (pinned) host memory, so device memory holds one layer's worth.
"""

from __future__ import annotations

import re
import types
from collections.abc import Callable

import torch
import torch.nn as nn


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cpu":
        return t  # already in host memory: the move is a no-op and the tensor is kept as is
    host = torch.empty(t.shape, dtype=t.dtype, layout=t.layout, pin_memory=torch.cuda.is_available())
    host.copy_(t, non_blocking=True)
    return host


class _Checkpoint(torch.autograd.Function):
    """Reentrant-style checkpoint: forward without a graph, backward recomputes and differentiates.

    Inputs are (run, offload, n_args, *args, *params). The layer's parameters are explicit inputs, so
    their gradients come back from this function and autograd accumulates them once per step.
    Tensor arguments that require grad (the activations flowing through the layers) are offloaded;
    the others (e.g. RoPE tables shared by every layer) stay where they are.
    """

    @staticmethod
    def forward(ctx, run: Callable, offload: bool, n_args: int, *inputs):
        args, params = inputs[:n_args], inputs[n_args:]
        ctx.run, ctx.n_args, ctx.params = run, n_args, params
        ctx.cpu_rng = torch.get_rng_state()
        on_cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        ctx.cuda_rng = torch.cuda.get_rng_state() if on_cuda else None
        with torch.no_grad():
            out = run(*args)
        saved, devices, kinds = [], [], []
        for a in args:
            if torch.is_tensor(a):
                moved = offload and a.requires_grad
                saved.append(_to_host(a) if moved else a)
                devices.append(a.device)
                kinds.append(("tensor", a.requires_grad))
            else:
                saved.append(a)
                devices.append(None)
                kinds.append(("object", False))
        ctx.saved_args, ctx.devices, ctx.kinds = saved, devices, kinds
        return out

    @staticmethod
    def backward(ctx, *grad_outs):
        args = []
        for a, dev, (kind, req) in zip(ctx.saved_args, ctx.devices, ctx.kinds):
            if kind == "tensor":
                a = a.to(dev, non_blocking=True).detach().requires_grad_(req)
            args.append(a)
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
        ctx.saved_args = None
        return (None, None, None, *arg_grads, *param_grads)


def checkpoint_module(module: nn.Module, offload: bool = False) -> nn.Module:
    """Checkpoint `module` in place: its forward keeps only its inputs and recomputes in backward.

    With `offload=True` the inputs that carry gradient are copied to pinned host memory after forward
    and brought back for the recomputation (on a CPU device the same path runs and the move is a
    no-op). Parameter names and the state dict are unchanged (only `forward` is replaced). Keyword
    arguments are passed through but get no gradient. The recomputation repeats the forward once,
    so any side effect of forward (e.g. MoE router statistics) is recorded twice. Returns the module.
    """
    if getattr(module, "_checkpointed", False):
        return module
    original = module.forward

    def forward(self, *args, **kwargs):
        params = [p for p in self.parameters()]
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)

        def run(*a):
            return original(*a, **kwargs)

        return _Checkpoint.apply(run, offload, len(args), *args, *params)

    module.forward = types.MethodType(forward, module)
    module._checkpointed = True
    module._checkpoint_offload = offload
    return module


_BLOCK_NAME = re.compile(r"(^|\.)(layers|blocks|h)\.\d+$")


def is_transformer_block(name: str, module: nn.Module) -> bool:
    """Default predicate: the items of a ModuleList called `layers`, `blocks` or `h`."""
    return bool(_BLOCK_NAME.search(name))


def apply_activation_checkpointing(model: nn.Module, offload: bool = False,
                                   predicate: Callable[[str, nn.Module], bool] = is_transformer_block
                                   ) -> nn.Module:
    """Checkpoint (and optionally offload the inputs of) every submodule `predicate(name, module)` picks.

    The default picks each transformer block (`layers.0`, `layers.1`, ...). Returns the model.
    """
    chosen = [m for n, m in model.named_modules() if n and predicate(n, m)]
    if not chosen:
        raise ValueError(
            f"apply_activation_checkpointing: the predicate selected no submodule of {type(model).__name__}; "
            "pass predicate=lambda name, module: ... naming the transformer blocks"
        )
    for m in chosen:
        checkpoint_module(m, offload=offload)
    return model
