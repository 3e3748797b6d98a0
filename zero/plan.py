"""What parallelism applied from outside tells the engine: the declaration types, importable alone.

`Placement`: where a rank's local parameter lies inside the logical (unsharded) parameter of the whole model.

Tensor and expert parallelism replace parameters by slices: an expert-parallel rank holds experts
[r*E/P, (r+1)*E/P) of a [E, ...] weight, a column-parallel rank some rows, a SwiGLU input projection two
stacked half-slices. A `Placement` records this as boxes: each `Piece` says that the local box starting at
`local` equals the global box starting at `start`, both of `size`. Placements are data (JSON in every
checkpoint), compose (a tp slice of an ep slice), and let a checkpoint written under one layout be read
under any other: each rank assembles exactly the boxes it needs from whichever ranks wrote them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed import ProcessGroup


def _box(starts: Sequence[int], sizes: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(a, a + s) for a, s in zip(starts, sizes))


@dataclass(frozen=True)
class Piece:
    """local[local : local + size] == global[start : start + size] (per dimension)."""

    local: tuple[int, ...]
    start: tuple[int, ...]
    size: tuple[int, ...]


@dataclass(frozen=True)
class Placement:
    """A local tensor as pieces of a global tensor of shape `shape`."""

    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @staticmethod
    def whole(shape: Sequence[int]) -> Placement:
        """The local tensor is the whole global tensor (a replicated or unsplit parameter)."""
        shape = tuple(int(s) for s in shape)
        zero = (0,) * len(shape)
        return Placement(shape, (Piece(zero, zero, shape),))

    @staticmethod
    def along(local_shape: Sequence[int], dim: int, global_size: int,
              chunks: Sequence[tuple[int, int, int]]) -> Placement:
        """Slices along `dim` (global length `global_size`): each chunk (local start, global start, length)
        maps that range of the local tensor to that range of the global one; other dims are whole."""
        local_shape = tuple(int(s) for s in local_shape)
        shape = local_shape[:dim] + (int(global_size),) + local_shape[dim + 1:]
        pieces = []
        for lo, go, n in chunks:
            at = [0] * len(shape)
            gat = [0] * len(shape)
            at[dim], gat[dim] = lo, go
            size = local_shape[:dim] + (n,) + local_shape[dim + 1:]
            pieces.append(Piece(tuple(at), tuple(gat), size))
        return Placement(shape, tuple(pieces))

    @property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(max(p.local[d] + p.size[d] for p in self.pieces) for d in range(len(self.shape)))

    @property
    def is_whole(self) -> bool:
        return self == Placement.whole(self.shape)

    def within(self, outer: Placement) -> Placement:
        """This placement is relative to `outer`'s local tensor (e.g. a tp slice of an ep rank's experts):
        the same local tensor placed in `outer`'s global tensor."""
        if self.shape != outer.local_shape:
            raise ValueError(f"cannot compose placements: {self.shape} is not the outer local shape "
                             f"{outer.local_shape}")
        pieces = []
        for q in self.pieces:
            for p in outer.pieces:
                lo = [max(a, b) for a, b in zip(q.start, p.local)]
                hi = [min(a + s, b + t) for a, s, b, t in zip(q.start, q.size, p.local, p.size)]
                if any(a >= b for a, b in zip(lo, hi)):
                    continue
                pieces.append(Piece(tuple(ql + a - qs for ql, a, qs in zip(q.local, lo, q.start)),
                                    tuple(ps + a - pl for ps, a, pl in zip(p.start, lo, p.local)),
                                    tuple(b - a for a, b in zip(lo, hi))))
        return Placement(outer.shape, tuple(pieces))

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This placement's local tensor cut out of the global tensor `full`."""
        out = full.new_empty(self.local_shape)
        for p in self.pieces:
            out[_box(p.local, p.size)] = full[_box(p.start, p.size)]
        return out

    def fill_from_whole(self, local: torch.Tensor, fill: Callable[[torch.Tensor], None]) -> None:
        """Fill the local tensor with its cut of the global tensor that `fill` writes (in fp32): what a per-name
        initialiser gives a slice, the same values as the whole parameter's."""
        whole = torch.empty(self.shape, dtype=torch.float32)
        fill(whole)
        local.copy_(self.take(whole))

    def put(self, local: torch.Tensor, full: torch.Tensor, covered: torch.Tensor | None = None) -> None:
        """Write the local tensor into its boxes of `full` (marking them in the bool tensor `covered`)."""
        for p in self.pieces:
            full[_box(p.start, p.size)] = local[_box(p.local, p.size)]
            if covered is not None:
                covered[_box(p.start, p.size)] = True

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "pieces": [[list(p.local), list(p.start), list(p.size)]
                                                      for p in self.pieces]}

    @staticmethod
    def from_json(data: dict) -> Placement:
        return Placement(tuple(data["shape"]), tuple(Piece(tuple(a), tuple(b), tuple(c))
                                                     for a, b, c in data["pieces"]))


def compose(outer: Mapping[str, Placement], inner: Mapping[str, Placement]) -> dict[str, Placement]:
    """Placements after two splits by name: `outer` first (e.g. expert parallelism), then `inner` of the
    tensors it left (e.g. tensor parallelism); a name split only once keeps that placement."""
    out = dict(outer)
    for name, p in inner.items():
        out[name] = p.within(outer[name]) if name in outer else p
    return out


@dataclass(eq=False)
class ReduceGroup:
    """Parameters whose gradients reduce over `group` instead of the engine's data x sequence group.

    The engine shards their optimizer state, master weights (and at stage 3 the parameters) over
    `group` and reduces their gradients there; everything else reduces over `dims.dp_sp_group`.
    Example: expert weights replicated only across the expert-data-parallel ranks (the plan of
    `moe.apply_expert_parallel` declares that). `group` must be a group of the engine's ParallelDims
    (None: one rank, nothing to reduce).
    """

    name: str
    params: Sequence[nn.Parameter]
    group: ProcessGroup | None


# ---------------------------------------------------------------------------- losses attached to activations
# A layer that computes a side loss (e.g. an MoE balancing loss) can make it part of whatever loss is later
# backpropagated from its output, without threading it through the model's return values. The engine
# multiplies the main loss by a factor before backward (fp16 loss scale / accumulation steps); an
# `AttachedLossScale` declared in a plan's `loss_scale_hooks` receives that same factor.


class AttachedLossScale:
    """The factor the gradient of attached losses is multiplied by (read in backward, so it is the
    factor of the backward that actually runs). Calling it sets the factor: it is a loss-scale hook."""

    def __init__(self, value: float = 1.0) -> None:
        self.value = float(value)

    def __call__(self, scale: float) -> None:
        self.value = float(scale)

    def __repr__(self) -> str:
        return f"AttachedLossScale({self.value})"


class _AttachLoss(torch.autograd.Function):
    """Returns `output` unchanged; backward also sends gradient `scale.value` into `loss`."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, loss: torch.Tensor, scale: AttachedLossScale) -> torch.Tensor:
        ctx.scale = scale
        ctx.loss_shape, ctx.loss_dtype = loss.shape, loss.dtype
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        loss_grad = torch.full(ctx.loss_shape, ctx.scale.value, dtype=ctx.loss_dtype, device=grad.device)
        return grad, loss_grad, None


def attach_loss(output: torch.Tensor, loss: torch.Tensor, scale: AttachedLossScale) -> torch.Tensor:
    """`output`, through which backward also differentiates `loss` with gradient `scale.value`."""
    return _AttachLoss.apply(output, loss, scale)


# ---------------------------------------------------------------------------- the one declaration type
@dataclass(frozen=True)
class RuntimeFacts:
    """What the engine knows once built, handed to each plan's `on_initialize` callbacks: whether `.grad`
    are preset flat-buffer views without hooks (stages 0-1), and whether a pipeline schedule runs backward
    more than once over one forward (zero-bubble) or runs backward itself (any pipeline)."""

    grads_accumulate_in_place: bool
    splits_backward: bool
    pipelined: bool


@dataclass(eq=False)
class Plan:
    """What one `apply_*` (expert, tensor, pipeline parallelism) tells the engine about the model it changed.

    `zero.initialize(..., plans=[ep, tp, pipe])` merges them (`Plan.merge`, in the order they were
    applied): placements compose (a tp slice of an ep slice), reduce groups, replicated and tied
    parameters and loss-scale hooks are collected, and after the engine is built each `on_initialize`
    callback receives its `RuntimeFacts` (e.g. MoE turns on fused gradient accumulation at stages 0-1).
    Parameters of other pipeline stages may appear in a plan made before the model was split; the
    engine ignores them when a pipeline plan is among the plans.
    """

    name: str
    #: parameter name -> where this rank's local tensor lies in the full parameter (split parameters only)
    placements: dict[str, Placement] = field(default_factory=dict)
    #: parameters that reduce over another group than data x sequence parallel (e.g. routed experts)
    reduce_groups: list[ReduceGroup] = field(default_factory=list)
    #: parameter -> number of tensor-parallel ranks holding it whole (counted once in the gradient norm)
    replicated_params: dict[nn.Parameter, int] = field(default_factory=dict)
    #: parameter -> the group of ranks holding copies of it (a pipeline's tied embedding and head)
    tied_params: dict[nn.Parameter, ProcessGroup | None] = field(default_factory=dict)
    #: called with the engine's loss multiplier before every backward (losses attached inside the model)
    loss_scale_hooks: list[Callable[[float], None]] = field(default_factory=list)
    on_initialize: list[Callable[[RuntimeFacts], None]] = field(default_factory=list)
    pipelined: bool = False
    splits_backward: bool = False

    def resolved(self) -> Plan:
        """The plan as the engine is built: a plan whose parameters a later apply_* may replace (tensor
        parallelism slices experts) refreshes them here."""
        return self

    @staticmethod
    def merge(plans: Sequence[Plan]) -> Plan:
        """One plan from several, in the order their apply_* ran; refuses what is not a Plan."""
        out = Plan("merged")
        for k, p in enumerate(plans):
            if not isinstance(p, Plan):
                raise TypeError(f"plans[{k}] is a {type(p).__name__}; pass the zero.Plan objects that "
                                "apply_expert_parallel, apply_tensor_parallel and apply_pipeline return")
            p = p.resolved()
            out.placements = compose(out.placements, p.placements)
            out.reduce_groups += p.reduce_groups
            out.replicated_params.update(p.replicated_params)
            out.tied_params.update(p.tied_params)
            out.loss_scale_hooks += p.loss_scale_hooks
            out.on_initialize += p.on_initialize
            out.pipelined |= p.pipelined
            out.splits_backward |= p.splits_backward
        return out
