"""Tensor parallelism (Megatron-style, with sequence-parallel norms) over plain local tensors.

`apply_tensor_parallel(model, tp_group)` reads the model's styles (`model.tensor_parallel_styles(tp)`: module
name -> style) and converts each named module in place: its weights are sliced to this rank's part
and its forward gains the collectives around it. Parameters stay ordinary tensors holding the local
slice (no DTensor wrapper), so the ZeRO engine flattens, shards over dp, offloads, checkpoints and
materialises them exactly like any other parameter, and no dispatch layer runs per op.

Between blocks the activations are split along the sequence over the tp ranks (sequence
parallelism): a norm runs on its sequence shard and all-gathers its output once for the column-
parallel projections that follow; row-parallel projections reduce-scatter their partial sums back to
sequence shards. So each block does one all-gather and one reduce-scatter for attention and one
each for the MLP, and no rank stores a full-sequence activation between blocks.

Styles (what `tensor_parallel_styles` maps each module name to):
  SequenceParallelNorm(gather_output)  replicated weights over a sequence shard; grads summed over tp
  ColwiseParallel(units)               output features sliced; `units` < tp replicates whole units
                                       (GQA kv heads when kv_heads < tp); `gather_output`: the features
                                       all-gathered after it (what follows runs replicated)
  RowwiseParallel()                    input features sliced; output reduce-scattered over sequence;
                                       `split_input`: its input is the whole (replicated) features
  Replicated()                         replicated weights that each rank differentiates completely (on
                                       replicated activations): no gradient reduction
  VocabParallelEmbedding()             vocabulary rows sliced; output reduce-scattered over sequence
                                       (`gather_output`: then all-gathered, the whole sequence on every rank)
  SequenceShardArguments(positions)    whole-sequence positional arguments of a layer cut to its sequence shard
  TiedHead(embedding)                  an output projection reading the (vocabulary-parallel) embedding's own
                                       local weight: vocabulary-sliced logits, one parameter for both
  SequenceGather()                     a module whose input hidden states are sequence shards, all-gathered
                                       at its entry (the column-parallel layers inside it need the whole sequence)
and `vocab_parallel_cross_entropy` computes the loss from vocabulary-sliced logits without gathering them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from zero.contract import contract_of
from zero.dist import comm
from zero.dist.topology import group_rank, group_size
from zero.plan import Placement, Plan


# ---------------------------------------------------------------------- autograd collectives
def _gather_dim(x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
    world = group_size(group)
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((world * moved.shape[0], *moved.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather_into_tensor(out, moved, group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter_dim(x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
    world = group_size(group)
    moved = x.movedim(dim, 0).contiguous()
    if moved.shape[0] % world:
        raise ValueError(f"dimension {dim} of size {moved.shape[0]} does not divide over {world} tensor-parallel "
                         "ranks: the sequence length must be a multiple of tp (times sp)")
    out = torch.empty((moved.shape[0] // world, *moved.shape[1:]), dtype=x.dtype, device=x.device)
    comm.reduce_scatter_tensor(out, moved, group)
    return out.movedim(0, dim).contiguous()


class _GatherSequence(torch.autograd.Function):
    """Forward: all-gather along `dim`; backward: reduce-scatter (the gathered tensor feeds partial sums)."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _gather_dim(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_dim(grad, ctx.group, ctx.dim), None, None


class _ReduceScatterSequence(torch.autograd.Function):
    """Forward: sum partial results and keep this rank's sequence shard; backward: all-gather."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter_dim(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _gather_dim(grad, ctx.group, ctx.dim), None, None


class _SumGrad(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the group (weights replicated over tp that
    each rank differentiates on its own sequence shard, or with its own slice of the features)."""

    @staticmethod
    def forward(ctx, w, group):
        ctx.group = group
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        comm.all_reduce(grad, ctx.group)
        return grad, None


class _SumGradSlots(torch.autograd.Function):
    """Identity forward on one `slot` of `slots` replicated units; backward sums each slot's gradient over
    the ranks holding that slot (one all-reduce over the tp group of a [slots, ...] buffer)."""

    @staticmethod
    def forward(ctx, w, group, slot, slots):
        ctx.group, ctx.slot, ctx.slots = group, slot, slots
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        buf = grad.new_zeros((ctx.slots, *grad.shape))
        buf[ctx.slot].copy_(grad)
        comm.all_reduce(buf, ctx.group)
        return buf[ctx.slot], None, None, None


class _GatherFeatures(torch.autograd.Function):
    """Forward: all-gather the last dim (each rank's slice of the features); backward: this rank's slice of the
    gradient (what follows runs replicated, so every rank holds the whole gradient already)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_dim(x, group, x.dim() - 1)

    @staticmethod
    def backward(ctx, grad):
        world, rank = group_size(ctx.group), group_rank(ctx.group)
        return grad.chunk(world, -1)[rank].contiguous(), None


class _SplitFeatures(torch.autograd.Function):
    """Forward: this rank's slice of the last dim of replicated features; backward: the slices' gradients
    all-gathered (the replicated computation before it gets the whole gradient on every rank)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        world, rank = group_size(group), group_rank(group)
        return x.chunk(world, -1)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _gather_dim(grad.contiguous(), ctx.group, grad.dim() - 1), None


def gather_sequence(x: torch.Tensor, group: ProcessGroup | None, dim: int = 1) -> torch.Tensor:
    """All-gather sequence shards along `dim` (backward: reduce-scatter). Identity for one rank."""
    return x if group_size(group) == 1 else _GatherSequence.apply(x, group, dim)


def reduce_scatter_sequence(x: torch.Tensor, group: ProcessGroup | None, dim: int = 1) -> torch.Tensor:
    """Sum partial results over the group, keeping this rank's shard of `dim` (backward: all-gather)."""
    return x if group_size(group) == 1 else _ReduceScatterSequence.apply(x, group, dim)


def sum_grad(w: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """`w` unchanged, with its gradient summed over `group` in backward."""
    return w if group_size(group) == 1 else _SumGrad.apply(w, group)


def substitute_parameters(module: nn.Module, transform: Mapping[str, Callable[[torch.Tensor], torch.Tensor]]) -> None:
    """Make `module`'s forward see `transform[name](param)` in place of each named direct parameter.

    The parameters themselves stay registered (same names, same tensors for the optimizer, checkpoints
    and ZeRO); only the forward reads the transformed tensor, so e.g. a gradient reduction can be
    inserted between a weight and its uses without the module knowing.
    """
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        saved = {name: module._parameters[name] for name in transform}
        try:
            for name, fn in transform.items():
                module._parameters[name] = fn(saved[name])
            return inner(*args, **kwargs)
        finally:
            module._parameters.update(saved)

    module.forward = forward


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, group: ProcessGroup | None,
                                 ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of token losses, count of counted tokens) from logits [N, V/tp] sliced by vocabulary over `group`.

    The logits are never gathered: the max, the sum of exponentials and the target logit are each
    reduced over the group (three small all-reduces over [N]). Gradients flow to each rank's slice.
    """
    if group_size(group) == 1:
        loss = F.cross_entropy(logits.float(), labels, ignore_index=ignore_index, reduction="sum")
        return loss, (labels != ignore_index).sum()
    return _VocabParallelCE.apply(logits, labels, group, ignore_index)


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, group, ignore_index):
        local_v = logits.shape[-1]
        start = group_rank(group) * local_v
        x = logits.float()
        row_max = x.max(dim=-1).values
        comm.all_reduce(row_max, group, op=torch.distributed.ReduceOp.MAX)
        x = x - row_max[:, None]
        exp = x.exp()
        sum_exp = exp.sum(-1)
        comm.all_reduce(sum_exp, group)
        valid = labels != ignore_index
        local = (labels >= start) & (labels < start + local_v) & valid
        idx = (labels - start).clamp(0, local_v - 1)
        target = torch.where(local, x.gather(1, idx[:, None]).squeeze(1), torch.zeros_like(row_max))
        comm.all_reduce(target, group)
        losses = torch.where(valid, sum_exp.log() - target, torch.zeros_like(target))
        probs = exp.div_(sum_exp[:, None])
        ctx.save_for_backward(probs, idx, local, valid)
        ctx.dtype = logits.dtype
        return losses.sum(), valid.sum()

    @staticmethod
    def backward(ctx, grad_loss, _grad_count):
        probs, idx, local, valid = ctx.saved_tensors
        grad = probs
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows[local], idx[local]] -= 1.0
        grad.mul_(valid[:, None].to(grad.dtype) * grad_loss)
        return grad.to(ctx.dtype), None, None, None


# ---------------------------------------------------------------------- styles
@dataclass(frozen=True)
class TensorSplit:
    """How one parameter is split over the tp ranks: sliced along `dim` (None: replicated), as
    `halves` (two stacked halves, e.g. SwiGLU gate | up, each sliced alike), or as one of `slots` whole
    units when there are fewer units than ranks. `replicas`: tp ranks holding each element."""

    dim: int | None
    replicas: int = 1
    slots: int = 0
    halves: bool = False

    def assemble(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every tp rank's local tensor (rank order)."""
        if self.dim is None:
            return parts[0]
        if self.slots:
            world = len(parts)
            return torch.cat([parts[k * world // self.slots] for k in range(self.slots)], self.dim)
        if self.halves:
            halves = [p.chunk(2, self.dim) for p in parts]
            return torch.cat([h[0] for h in halves] + [h[1] for h in halves], self.dim)
        return torch.cat(list(parts), self.dim)

    def local(self, whole: torch.Tensor, rank: int, world: int) -> torch.Tensor:
        """Tp rank `rank`'s local tensor cut from the full one (the inverse of `assemble`; a view)."""
        if self.dim is None:
            return whole
        if self.slots:
            size = whole.shape[self.dim] // self.slots
            return whole.narrow(self.dim, rank * self.slots // world * size, size)
        parts = whole.chunk(2, self.dim) if self.halves else (whole,)
        cut = [q.narrow(self.dim, rank * (q.shape[self.dim] // world), q.shape[self.dim] // world) for q in parts]
        return cut[0] if len(cut) == 1 else torch.cat(cut, self.dim)

    def placement(self, local_shape: Sequence[int], rank: int, world: int) -> Placement:
        """Where tp rank `rank`'s local tensor of `local_shape` lies in the full tensor."""
        if self.dim is None:
            return Placement.whole(local_shape)
        n = local_shape[self.dim]
        if self.slots:
            return Placement.along(local_shape, self.dim, n * self.slots, [(0, rank * self.slots // world * n, n)])
        if self.halves:
            h = n // 2
            return Placement.along(local_shape, self.dim, n * world, [(0, rank * h, h), (h, world * h + rank * h, h)])
        return Placement.along(local_shape, self.dim, n * world, [(0, rank * n, n)])


REPLICATED = TensorSplit(None)
def _rank_slice(total: int, world: int, rank: int, what: str) -> slice:
    if total % world:
        raise ValueError(f"{what} of size {total} does not divide over tp={world}")
    size = total // world
    return slice(rank * size, (rank + 1) * size)


def _replace(module: nn.Module, name: str, value: torch.Tensor) -> nn.Parameter:
    old = module._parameters[name]
    p = nn.Parameter(value.detach().clone().contiguous(), requires_grad=old.requires_grad)
    module._parameters[name] = p
    return p


class Style:
    """How one module is split over the tp group. `apply` converts it in place and returns the split
    of each of its parameters (by name within the module)."""

    def apply(self, module: nn.Module, group: ProcessGroup) -> dict[str, TensorSplit]:
        raise NotImplementedError


class SequenceParallelNorm(Style):
    """A module with replicated parameters (a norm) applied to sequence shards; its parameter gradients
    are partial per shard and are summed over tp. `gather_output` all-gathers the sequence after it (the
    input of the column-parallel layers that follow)."""

    def __init__(self, gather_output: bool = False, seq_dim: int = 1) -> None:
        self.gather_output, self.seq_dim = gather_output, seq_dim

    def apply(self, module, group):
        names = [n for n, p in module.named_parameters(recurse=False)]
        substitute_parameters(module, {n: functools.partial(sum_grad, group=group) for n in names})
        if self.gather_output:
            module.register_forward_hook(lambda m, args, out: gather_sequence(out, group, self.seq_dim))
        return {n: TensorSplit(None, replicas=group_size(group)) for n in names}


class Replicated(Style):
    """A module with replicated parameters on replicated activations (between a ColwiseParallel(gather_output)
    and a RowwiseParallel(split_input)): every rank computes the whole gradient, so none is reduced."""

    def apply(self, module, group):
        return {n: TensorSplit(None, replicas=group_size(group)) for n, _ in module.named_parameters(recurse=False)}


class ReplicatedSequence(Style):
    """A module the plan does not split (e.g. an attention with sinks, a short convolution) between sequence shards:
    it runs replicated on the whole sequence (its input hidden states all-gathered at its entry) and keeps this rank's
    sequence shard of its output (the first element of a tuple); each rank differentiates only its shard's outputs,
    so the gradients of its parameters (its children's included) are summed over tp, and those of its input by the
    gather's reduce-scatter."""

    #: (the parameters of its children are placed by it too)
    places_submodules = True

    def __init__(self, seq_dim: int = 1) -> None:
        self.seq_dim = seq_dim

    def apply(self, module, group):
        world, rank = group_size(group), group_rank(group)
        owned = [(sub, n, f"{prefix}.{n}".lstrip(".")) for prefix, sub in module.named_modules()
                 for n, _ in sub.named_parameters(recurse=False)]
        inner = module.forward

        @functools.wraps(inner)
        def forward(*args, **kwargs):  # (every parameter inside summed, read by its own module's forward or not)
            saved = [(sub, n, sub._parameters[n]) for sub, n, _ in owned]
            try:
                for sub, n, p in saved:
                    sub._parameters[n] = sum_grad(p, group)
                return inner(*args, **kwargs)
            finally:
                for sub, n, p in saved:
                    sub._parameters[n] = p

        module.forward = forward
        SequenceGather(self.seq_dim).apply(module, group)
        splits = {name: TensorSplit(None, replicas=world) for _, _, name in owned}

        def shard(m, args, output):
            first = output[0] if isinstance(output, tuple) else output
            if first.shape[self.seq_dim] % world:
                raise ValueError(f"{type(m).__name__}: a sequence of {first.shape[self.seq_dim]} does not split "
                                 f"over tp={world}")
            part = first.chunk(world, self.seq_dim)[rank]
            return (part, *output[1:]) if isinstance(output, tuple) else part

        module.register_forward_hook(shard)
        return splits


class ColwiseParams(Style):
    """Direct parameters of a module (e.g. attention sinks or a per-head gate bias, [heads, ...]) sliced along dim 0
    like the column-parallel projections beside them (this rank's heads)."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)

    def apply(self, module, group):
        world, rank = group_size(group), group_rank(group)
        for n in self.names:
            _replace(module, n, module._parameters[n][_rank_slice(module._parameters[n].shape[0], world, rank, n)])
        return dict.fromkeys(self.names, TensorSplit(0))


class Chain(Style):
    """Several styles applied to one module in order (their parameters' splits merged; none may split the same
    parameter twice)."""

    def __init__(self, *styles: Style) -> None:
        self.styles = styles
        #: (whether one of them places the parameters of the module's children too)
        self.places_submodules = any(getattr(s, "places_submodules", False) for s in styles)

    def apply(self, module, group):
        out: dict[str, TensorSplit] = {}
        for style in self.styles:
            splits = style.apply(module, group)
            if set(splits) & set(out):
                raise ValueError(f"Chain: parameters {sorted(set(splits) & set(out))} are split by two styles")
            out.update(splits)
        return out


class ColwiseParallel(Style):
    """nn.Linear split by output features (weight rows; a bias likewise). Its input is the full sequence
    (gathered by the norm before it), its output this rank's features.

    `units` (e.g. kv heads) groups the rows: with units >= tp each rank takes units / tp whole units;
    with fewer units than ranks each rank takes the one unit its slice of the model needs, replicated
    on tp / units ranks, whose gradients are summed over them.
    """

    def __init__(self, units: int | None = None, gather_output: bool = False) -> None:
        self.units, self.gather_output = units, gather_output

    def apply(self, module, group):
        world, rank = group_size(group), group_rank(group)
        if self.gather_output:
            if self.units is not None:
                raise ValueError("ColwiseParallel: gather_output slices the features evenly (no units)")
            module.register_forward_hook(lambda m, args, out: _GatherFeatures.apply(out, group))
        rows = module.weight.shape[0]
        units = self.units or world
        if rows % units:
            raise ValueError(f"{rows} output features do not split into {units} units")
        if units >= world:
            if units % world:
                raise ValueError(f"{units} units (e.g. kv heads) do not split evenly over tp={world}")
            sl = _rank_slice(rows, world, rank, "output features")
            replicas = 1
        else:
            if world % units:
                raise ValueError(f"tp={world} is not a multiple of the {units} units (kv heads) it replicates")
            slot = rank * units // world
            size = rows // units
            sl = slice(slot * size, (slot + 1) * size)
            replicas = world // units
        names = [n for n in ("weight", "bias") if module._parameters.get(n) is not None]
        for n in names:
            _replace(module, n, module._parameters[n][sl])
        module.out_features = module.weight.shape[0]
        if replicas > 1:
            slot = rank * units // world
            substitute_parameters(module, {n: functools.partial(_sum_grad_slots, group=group, slot=slot, slots=units)
                                           for n in names})
            return {n: TensorSplit(0, replicas=replicas, slots=units) for n in names}
        return dict.fromkeys(names, TensorSplit(0))


def _sum_grad_slots(w, group, slot, slots):
    return _SumGradSlots.apply(w, group, slot, slots)


class RowwiseParallel(Style):
    """nn.Linear split by input features (weight columns). Its input is this rank's features, its output
    the partial sum, reduce-scattered to this rank's sequence shard (a bias is added once, after)."""

    def __init__(self, seq_dim: int = 1, split_input: bool = False) -> None:
        self.seq_dim, self.split_input = seq_dim, split_input

    def apply(self, module, group):
        world, rank = group_size(group), group_rank(group)
        sl = _rank_slice(module.weight.shape[1], world, rank, "input features")
        _replace(module, "weight", module.weight[:, sl])
        module.in_features = module.weight.shape[1]

        def forward(x):
            if self.split_input:  # (the whole features, replicated: this rank's slice of them)
                x = _SplitFeatures.apply(x, group)
            y = reduce_scatter_sequence(F.linear(x, module.weight), group, self.seq_dim)
            # The bias is replicated and added to a sequence shard: its gradient is summed over tp.
            return y if module.bias is None else y + sum_grad(module.bias, group)

        module.forward = forward
        out = {"weight": TensorSplit(1)}
        if module.bias is not None:
            out["bias"] = TensorSplit(None, replicas=world)
        return out


class VocabParallelEmbedding(Style):
    """nn.Embedding split by vocabulary rows: each rank looks up the tokens in its range (zeros elsewhere)
    and the partial embeddings are reduce-scattered to sequence shards. A tied output projection that
    reads the same weight then yields vocabulary-sliced logits (see vocab_parallel_cross_entropy)."""

    def __init__(self, seq_dim: int = 1, scale: Callable[[nn.Module], torch.Tensor] | None = None,
                 gather_output: bool = False) -> None:
        #: `scale(module)`: the scalar its lookup is multiplied by (a scaled embedding's), read at each forward
        self.seq_dim, self.scale = seq_dim, scale
        #: the whole sequence out (its shards all-gathered after the reduce-scatter), for what runs replicated on it
        self.gather_output = gather_output

    def apply(self, module, group):
        world, rank = group_size(group), group_rank(group)
        vocab = module.weight.shape[0]
        sl = _rank_slice(vocab, world, rank, "vocabulary")
        _replace(module, "weight", module.weight[sl])
        start, stop = sl.start, sl.stop
        module.num_embeddings = stop - start
        # (the padding row, whose lookups get no gradient, by its index in this rank's rows: another rank's, none)
        padding = module.padding_idx
        if padding is not None:
            padding = padding % vocab - start if start <= padding % vocab < stop else None
        module.padding_idx = padding

        def forward(tokens):
            inside = (tokens >= start) & (tokens < stop)
            local = torch.where(inside, tokens - start, torch.zeros_like(tokens))
            out = F.embedding(local, module.weight, padding, module.max_norm, module.norm_type,
                              module.scale_grad_by_freq, module.sparse)
            out = out * inside.unsqueeze(-1).to(out.dtype)
            out = reduce_scatter_sequence(out, group, self.seq_dim)
            if self.gather_output:
                out = gather_sequence(out, group, self.seq_dim)
            return out if self.scale is None else out * self.scale(module).to(module.weight.dtype)

        module.forward = forward
        return {"weight": TensorSplit(0)}


class TiedHead(Style):
    """nn.Linear output projection tied to `embedding` (same weight), which VocabParallelEmbedding splits first: after
    the split the head holds the embedding's local Parameter itself (one parameter for the optimizer, ZeRO and
    checkpoints), so its output is this rank's vocabulary slice of the logits (see vocab_parallel_cross_entropy).
    Its input is the full sequence (gathered by the norm before it)."""

    def __init__(self, embedding: nn.Module) -> None:
        self.embedding = embedding

    def apply(self, module, group):
        world = group_size(group)
        weight = self.embedding.weight
        if module.weight is weight:
            raise ValueError("TiedHead: the embedding is not split yet (apply VocabParallelEmbedding to it first)")
        if weight.shape[0] * world != module.weight.shape[0] or weight.shape[1:] != module.weight.shape[1:]:
            raise ValueError(f"TiedHead: the embedding's local weight {tuple(weight.shape)} is not a tp={world} "
                             f"vocabulary slice of the head's {tuple(module.weight.shape)}")
        if module.bias is not None:
            raise NotImplementedError("TiedHead: a tied output projection with a bias is not split")
        module._parameters["weight"] = weight
        module.out_features = weight.shape[0]
        return {"weight": TensorSplit(0)}


class SequenceGather(Style):
    """A module without parameters of its own here (e.g. an attention or MLP whose projections have their own
    styles) that takes sequence-sharded hidden states (its first argument or `hidden_states=`): they are all-gathered
    at its entry (backward: reduce-scattered), as a sequence-parallel norm's `gather_output` would."""

    def __init__(self, seq_dim: int = 1) -> None:
        self.seq_dim = seq_dim

    def apply(self, module, group):
        def gather(m, args, kwargs):
            if "hidden_states" in kwargs:
                kwargs = {**kwargs, "hidden_states": gather_sequence(kwargs["hidden_states"], group, self.seq_dim)}
            elif args:
                args = (gather_sequence(args[0], group, self.seq_dim), *args[1:])
            else:
                raise ValueError(f"SequenceGather: {type(m).__name__} was called without hidden states")
            return args, kwargs

        module.register_forward_pre_hook(gather, with_kwargs=True)
        return {}


class SequenceShardArguments(Style):
    """A module (a layer) given whole-sequence tensors as positional arguments `positions` (e.g. per-layer inputs
    made replicated outside the layers; the first layer's hidden states, `hidden_states=` too for position 0): each
    is cut to this rank's sequence shard at its entry (None passes as it is). Its gradient is then this shard's, zero
    elsewhere: whatever made the tensor replicated sums those over tp (a gathered sequence's reduce-scatter, summed
    parameter gradients)."""

    def __init__(self, positions: Sequence[int], seq_dim: int = 1) -> None:
        self.positions, self.seq_dim = tuple(positions), seq_dim

    def apply(self, module, group):
        world, rank = group_size(group), group_rank(group)

        def part(m, k, x):
            if x is None:
                return x
            if x.shape[self.seq_dim] % world:
                raise ValueError(f"{type(m).__name__}: argument {k}'s sequence of {x.shape[self.seq_dim]} does not "
                                 f"split over tp={world}")
            return x.chunk(world, self.seq_dim)[rank]

        def cut(m, args, kwargs):
            args = list(args)
            for k in self.positions:
                if k < len(args):
                    args[k] = part(m, k, args[k])
                elif k == 0 and "hidden_states" in kwargs:
                    kwargs = {**kwargs, "hidden_states": part(m, k, kwargs["hidden_states"])}
            return tuple(args), kwargs

        module.register_forward_pre_hook(cut, with_kwargs=True)
        return {}


class TensorParallel(Plan):
    """What apply_tensor_parallel did, as the plan the engine takes: the tp group, how each parameter is
    split (by model name), the placements of the split ones and the replicas of the whole ones."""

    def __init__(self, group: ProcessGroup | None, model: nn.Module | None = None,
                 splits: dict[str, TensorSplit] | None = None) -> None:
        self.group = group
        self.splits = dict(splits or {})
        params = dict(model.named_parameters(remove_duplicate=False)) if model is not None else {}
        self.params = {n: params[n] for n in self.splits}
        world, rank = group_size(group), group_rank(group)
        super().__init__(
            "tensor",
            placements={n: split.placement(self.params[n].shape, rank, world) for n, split in self.splits.items()
                        if split.dim is not None},
            # held identically by k > 1 tp ranks: counted once in the global gradient norm
            replicated_params={self.params[n]: split.replicas for n, split in self.splits.items()
                               if split.replicas > 1},
        )

    def full_state_dict(self, local: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Assemble full tensors from every tp rank's `local` state dict (names as the model's); names
        without a split are taken as they are. Collective over the tp group."""
        world = group_size(self.group)
        out = {}
        for name, t in local.items():
            split = self.splits.get(name)
            if split is None or split.dim is None or world == 1:
                out[name] = t
                continue
            flat = torch.empty(world * t.numel(), dtype=t.dtype, device=t.device)
            comm.all_gather_into_tensor(flat, t.contiguous().view(-1), self.group)
            out[name] = split.assemble(list(flat.view(world, *t.shape).unbind(0)))
        return out


def apply_tensor_parallel(model: nn.Module, tp_group: ProcessGroup | None,
                          styles: Mapping[str, Style] | None = None) -> TensorParallel:
    """Split `model` over `tp_group` per `styles` (default: the model contract's `tensor_parallel_styles(tp)`),
    in place. Returns the plan for zero.initialize. A tp group of one rank changes nothing.
    """
    tp = group_size(tp_group)
    if tp == 1:
        return TensorParallel(tp_group)
    if styles is None:
        styles = contract_of(model, "apply_tensor_parallel (or pass styles=)", "tensor_parallel_styles")
        styles = styles.tensor_parallel_styles(tp)
    modules = dict(model.named_modules())
    missing = [n for n in styles if n not in modules]
    if missing:
        raise ValueError(f"the tensor-parallel styles name modules the model does not have: {missing[:5]}")
    splits = {}
    for name, style in styles.items():
        for pname, split in style.apply(modules[name], tp_group).items():
            splits[f"{name}.{pname}"] = split
    return TensorParallel(tp_group, model, splits)
