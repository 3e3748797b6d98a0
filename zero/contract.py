"""The model contract: what the runtime's `apply_*` functions and the engine need from a model, written once.

A model states its parts by implementing `ModelContract` (structurally, or by subclassing it next to
`nn.Module` to inherit the defaults, which raise `ContractError` naming the missing part):

- `blocks()`: its repeated blocks, in order: ZeRO-3 gather units, activation checkpointing, pipeline splits;
- `attention_sites()`: where an attention function is called and may be swapped (Ulysses, sparse);
- `mlp_sites()`: its token-wise MLPs (tiling);
- `tensor_parallel_styles(tp)`: module name -> `zero.parallel.tensor.Style`;
- `pipeline_stage(layers, first, last)` and `pipeline_shapes(tokens_shape)`: the module of one pipeline stage
  (itself a contract model for its blocks) and the shapes of what stages exchange;
- `init_parameter(name, tensor)`: a parameter's initial values, for models built on the meta device.

The project's Llama implements all of it; an adapter around another framework's model (e.g. a Hugging
Face `PreTrainedModel`) implements what it can, and each `apply_*` says in one line which part it lacks.
`zero.initialize` trains any `nn.Module`: the contract is needed only by what uses a part of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

AttentionFn = Callable[..., torch.Tensor]


class ContractError(TypeError):
    """A model lacks a part of the contract that a runtime function needs."""


@dataclass(frozen=True)
class AttentionSite:
    """One place where the model calls an attention function `fn(q, k, v, causal=..., **kw) -> out` on
    q [b, s, h, d], k/v [b, s, h_kv, d]: `get()` reads the function in use, `set(fn)` replaces it."""

    name: str
    get: Callable[[], AttentionFn]
    set: Callable[[AttentionFn], None]


def _missing(model: object, part: str) -> ContractError:
    return ContractError(f"{type(model).__name__} does not offer {part} of the model contract "
                         f"(zero.contract.ModelContract): implement it to use this")


@runtime_checkable
class ModelContract(Protocol):
    """What a model offers the runtime (see the module docstring). Subclass it beside `nn.Module` to get
    defaults that raise a one-line `ContractError` for every part the model does not implement."""

    def blocks(self) -> Sequence[tuple[str, nn.Module]]:
        """The repeated blocks in forward order, with their names in `named_modules()`."""
        raise _missing(self, "blocks()")

    def attention_sites(self) -> Sequence[AttentionSite]:
        """Every attention call site, in forward order."""
        raise _missing(self, "attention_sites()")

    def mlp_sites(self) -> Sequence[tuple[str, nn.Module]]:
        """Every token-wise MLP (`forward(x [..., s, dim]) -> [..., s, dim]`, each token on its own), by name."""
        raise _missing(self, "mlp_sites()")

    def tensor_parallel_styles(self, tp: int) -> dict[str, Any]:
        """How the model splits over `tp` ranks: module name -> zero.parallel.tensor.Style."""
        raise _missing(self, "tensor_parallel_styles(tp)")

    def pipeline_stage(self, layers: range, first: bool, last: bool) -> nn.Module:
        """A module running blocks `layers` (embedding when `first`; the output the loss reads when `last`)
        that shares this model's modules and parameter names; its own `blocks()` are those blocks."""
        raise _missing(self, "pipeline_stage(layers, first, last)")

    def pipeline_shapes(self, tokens_shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(the activation sent between stages, the last stage's output) for a micro-batch of tokens."""
        raise _missing(self, "pipeline_shapes(tokens_shape)")

    def init_parameter(self, name: str, tensor: torch.Tensor) -> None:
        """Fill `tensor` with the initial values of parameter `name` (in any order of calls)."""
        raise _missing(self, "init_parameter(name, tensor)")

    def stage3_edge_units(self) -> Sequence[tuple[str, nn.Module]]:
        """Optional: modules outside `blocks()` that ZeRO-3 gathers as units of their own (an untied embedding and
        head), with their names; every use of their parameters goes through their own call. Default: none."""
        return []


def offers(model: object, part: str) -> bool:
    """Whether `model` implements the contract's `part` (a method name) itself: its class, or a class it inherits
    from other than ModelContract, defines it."""
    return any(part in vars(cls) for cls in type(model).__mro__[:-1] if cls is not ModelContract)


def contract_of(model: object, needed_by: str, part: str) -> ModelContract:
    """`model`, checked to offer the contract's `part` (a method name) that `needed_by` calls: a model that
    subclasses ModelContract, or whose class defines that method; else a one-line ContractError."""
    if isinstance(model, ModelContract) or offers(model, part):
        return model  # a subclass without the part raises ContractError naming it when called
    raise ContractError(f"{needed_by} needs {type(model).__name__}.{part}() of the model contract "
                        f"(zero.contract.ModelContract); {type(model).__name__} does not define it")
