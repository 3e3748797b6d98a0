"""THE bucket policy: which parameters share a flat buffer, over which group each bucket reduces, and in what order.

`bucket_layout` is a pure function of parameter descriptions (`ParamSpec`) and reductions; `module_bucket_layout`
describes a model and its merged `zero.Plan` and applies it. The engine builds its FlatBuckets from the layout it
returns and the planner (recipes.planner) reads the same layout for a model on the meta device, so the two cannot
disagree.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ProcessGroup

from zero.config import ZeroConfig
from zero.dist.comm import group_size
from zero.dist.topology import ParallelDims, node_partition
from zero.plan import Plan, ReduceGroup
from zero.sharding.stage3 import assign_parameters, find_units

DEFAULT_REDUCE_GROUP = "dense"


@dataclass(frozen=True)
class Reduction:
    """One gradient reduction: its name, this rank's group (None: one rank) and that group's global ranks."""

    name: str
    group: ProcessGroup | None
    ranks: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class ParamSpec:
    """What the policy reads of one parameter (listed in the module's registration order)."""

    name: str
    numel: int
    trainable: bool
    reduction: int = 0  # index into the reductions: 0 the default (data x sequence parallel), k the k-th declared
    tp_replicas: int = 1  # tensor-parallel ranks holding it identically (bucketed apart, counted once in the norm)
    tie_ranks: int = 0  # ranks of the group holding copies of it (a pipeline's tied embedding and head); 0: untied
    unit: int | None = None  # stage 3: the index of the unit it belongs to; None: the root
    persistent: bool = False  # stage 3: at most param_persistence_threshold elements, kept replicated


@dataclass
class BucketSpec:
    """One flat bucket, sizes only: `world` ranks share it (1 when unsharded), `group` ranks reduce it."""

    names: list[str]
    numels: list[int]
    world: int
    group: int  # ranks of its reduction group (gradients reduce over them, parameters gather over them)
    reduce_group: str
    trainable: bool
    resident: bool
    role: str  # "flat" (stages 0-2), "unit" / "root" / "persistent" (stage 3)
    unit: int | None = None
    tp_replicas: int = 1
    tied: bool = False
    tie_group: int = 1  # ranks holding a copy (a pipeline's tied embedding and head)
    secondary: int = 0  # hpZ: ranks of its gather group on this rank's node keeping a secondary copy (0: none)

    @property
    def numel(self) -> int:
        return sum(self.numels)

    @property
    def replicas(self) -> int:
        """Ranks outside the reduction group holding each element (tensor-parallel replicas, tied copies)."""
        return self.tp_replicas * self.tie_group

    @property
    def padded(self) -> int:
        return math.ceil(self.numel / self.world) * self.world

    @property
    def shard(self) -> int:
        return self.padded // self.world


@dataclass
class Layout:
    """Every bucket of one rank, in reduction order (backward's); `units` stage-3 gather units."""

    buckets: list[BucketSpec] = field(default_factory=list)
    units: int = 0
    reductions: list[Reduction] = field(default_factory=list)
    params: list[ParamSpec] = field(default_factory=list)
    unit_modules: list[tuple[str, nn.Module]] = field(default_factory=list, repr=False)


def split_into_buckets(params: Sequence[ParamSpec], max_numel: int) -> list[list[ParamSpec]]:
    """Consecutive runs of parameters of at most `max_numel` elements each (a larger one stands alone)."""
    buckets: list[list[ParamSpec]] = []
    current: list[ParamSpec] = []
    size = 0
    for p in params:
        if current and size + p.numel > max_numel:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel
    if current:
        buckets.append(current)
    return buckets


def _buckets(params: Sequence[ParamSpec], reductions: Sequence[Reduction], stage: int, resident: bool, role: str,
             max_numel: int | None, unit: int | None = None) -> list[BucketSpec]:
    """Buckets for `params` (in that order), split by (reduction, trainable, tp replicas, tied), each kind cut at
    `max_numel` elements (None: uncut). Each tied parameter has a bucket of its own, ordered by name (the same
    order on every rank)."""
    tie_order = {p.name: k for k, p in enumerate(sorted(params, key=lambda p: p.name), 1) if p.tie_ranks}

    def kind(p: ParamSpec) -> tuple[int, int]:
        return p.tp_replicas, tie_order.get(p.name, 0)

    out = []
    kinds = sorted({kind(p) for p in params})
    for k, reduction in enumerate(reductions):
        for trainable, (tp_replicas, tied) in itertools.product((True, False), kinds):
            sel = [p for p in params
                   if p.reduction == k and p.trainable == trainable and kind(p) == (tp_replicas, tied)]
            if not sel:
                continue
            for chunk in split_into_buckets(sel, max_numel or sum(p.numel for p in sel)):
                out.append(BucketSpec([p.name for p in chunk], [p.numel for p in chunk],
                                      reduction.size if stage >= 1 else 1, reduction.size, reduction.name, trainable,
                                      resident, role, unit, tp_replicas, bool(tied),
                                      chunk[0].tie_ranks if tied else 1))
    return out


def split_root(params: Sequence[ParamSpec], bucket_numel: int) -> tuple[list[list[ParamSpec]], list[list[ParamSpec]]]:
    """The root parameters (unit None, not persistent) in groups to bucket apart, in (roughly) the order backward
    reaches them: (the groups of those registered after every unit parameter, e.g. a final norm and an output head;
    the groups of the others, e.g. the embedding), each last registered first. Backward produces the first part's
    gradients before any unit's and the second's after them, so reducing in that order lets a head's gradient leave
    memory at once instead of waiting, in full size, for the embedding's at the end of backward. A parameter of at
    least a quarter of `bucket_numel` elements is a group of its own: its gradient is then the bucket's staging
    buffer itself (zero.sharding.optimizer), not copied into a second one. Only the order and the cut of the
    reductions depend on this."""
    last_unit = max((k for k, p in enumerate(params) if p.unit is not None and not p.persistent), default=-1)

    def groups(part: list[ParamSpec]) -> list[list[ParamSpec]]:
        out: list[list[ParamSpec]] = []
        for p in part[::-1]:
            alone = 4 * p.numel >= bucket_numel
            if alone or not out or out[-1][-1].numel * 4 >= bucket_numel:
                out.append([])
            out[-1].append(p)
        return out

    root = [(k, p) for k, p in enumerate(params) if p.unit is None and not p.persistent]
    return groups([p for k, p in root if k > last_unit]), groups([p for k, p in root if k <= last_unit])


def _secondary_size(reduction: Reduction, node_size: int, rank: int) -> int:
    """hpZ: the ranks of this rank's reduction group on its node (a node: `node_size` consecutive global ranks), as
    ParallelDims.secondary_groups forms them; 0 where a secondary partition would not help."""
    return next((len(part) for part in node_partition(list(reduction.ranks), node_size, reduction.name)
                 if rank in part), 0)


def bucket_layout(params: Sequence[ParamSpec], reductions: Sequence[Reduction], *, stage: int,
                  reduce_bucket_size: int, units: int = 0, hpz_partition_size: int = 1, rank: int = 0) -> Layout:
    """The bucket policy: every bucket of one rank, in reduction order (backward's).

    Stages 0-2: all parameters, last registered first (backward's order, approximately), cut at
    `reduce_bucket_size`, resident. Stage 3: one uncut bucket per kind for each of the `units` gather units, the
    root (parameters of no unit or of several) cut by `split_root`, and the persistent ones, resident, cut at
    `reduce_bucket_size`; reduced in the order: the root used after the blocks, the units last-to-first, the rest of
    the root, then the persistent ones. With hpZ (`hpz_partition_size` > 1) each unit bucket records the ranks of
    its secondary partition's group (`rank` is this rank's global rank)."""
    if stage < 3:
        return Layout(_buckets(params[::-1], reductions, stage, True, "flat", reduce_bucket_size), 0,
                      list(reductions), list(params))
    per_unit = [_buckets([p for p in params if p.unit == i and not p.persistent], reductions, stage, False, "unit",
                         None, unit=i) for i in range(units)]
    late, early = ([b for group in part for b in _buckets(group, reductions, stage, False, "root", reduce_bucket_size)]
                   for part in split_root(params, reduce_bucket_size))
    persistent = _buckets([p for p in params if p.persistent][::-1], reductions, stage, True, "persistent",
                          reduce_bucket_size)
    if hpz_partition_size > 1:
        sizes = {r.name: _secondary_size(r, hpz_partition_size, rank) for r in reductions}
        for b in (b for bl in per_unit for b in bl):
            b.secondary = sizes[b.reduce_group]
    buckets = late + [b for bl in per_unit[::-1] for b in bl] + early + persistent
    return Layout(buckets, units, list(reductions), list(params))


# ---------------------------------------------------------------------------- describing a model
def _same(p: nn.Parameter) -> nn.Parameter:
    return p


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def module_reductions(module: nn.Module, dims: ParallelDims, declared: Sequence[ReduceGroup], *,
                    skip_absent: bool = False, resolve: Callable[[nn.Parameter], nn.Parameter] = _same,
                    ) -> tuple[list[Reduction], dict[int, int]]:
    """The reductions (the default first, then the declared ones) and which one owns each parameter of `module`
    (by id; absent: the default). `skip_absent`: a declared parameter not in `module` belongs to another pipeline
    stage. `resolve` maps a declared parameter to the one `module` holds (the engine's meta-device stand-ins)."""
    in_model = {id(p) for p in module.parameters()}
    owner: dict[int, int] = {}
    names = [DEFAULT_REDUCE_GROUP]
    for k, rg in enumerate(declared, start=1):
        if not isinstance(rg, ReduceGroup):
            raise TypeError(f"reduce_groups[{k - 1}] is a {type(rg).__name__}; pass zero.ReduceGroup items")
        if rg.name in names:
            raise ValueError(f"reduce group name {rg.name!r} is used twice (or is the default's name)")
        if dims.dp_sp % group_size(rg.group):
            raise ValueError(
                f"reduce group {rg.name!r} has {group_size(rg.group)} ranks, which does not divide the "
                f"data x sequence parallel size {dims.dp_sp}: use a group of this engine's ParallelDims"
            )
        names.append(rg.name)
        for p in (resolve(q) for q in rg.params):
            if id(p) not in in_model and skip_absent:
                continue
            if id(p) not in in_model:
                raise ValueError(f"reduce group {rg.name!r} lists a parameter that is not in the model")
            if id(p) in owner:
                raise ValueError(f"a parameter is declared in reduce groups {names[owner[id(p)]]!r} and "
                                 f"{rg.name!r}; each parameter reduces over one group")
            owner[id(p)] = k
    rank = _rank()
    groups = [(DEFAULT_REDUCE_GROUP, dims.dp_sp_group)] + [(rg.name, rg.group) for rg in declared]
    return [Reduction(n, g, (rank,) if g is None else tuple(dist.get_process_group_ranks(g))) for n, g in groups], owner


def module_bucket_layout(module: nn.Module, plan: Plan, dims: ParallelDims, config: ZeroConfig, *,
                 resolve: Callable[[nn.Parameter], nn.Parameter] = _same) -> Layout:
    """The bucket layout of `module` (what the engine wraps: under pp this rank's stages) given the merged plan of
    what was applied to it (reduce groups, tensor-parallel replicas, tied copies): the engine's and the planner's.
    `resolve` maps the plan's parameters to those `module` holds (the identity but for meta-device stand-ins)."""
    reductions, owner = module_reductions(module, dims, plan.reduce_groups, skip_absent=plan.pipelined, resolve=resolve)
    replicas = {id(resolve(p)): k for p, k in plan.replicated_params.items() if k > 1}
    tied = {id(resolve(p)): group_size(g) for p, g in plan.tied_params.items() if g is not None}
    units = find_units(module, config.stage3_unit_classes) if config.stage == 3 else []
    unit_of: dict[int, int] = {}
    persistent: set[int] = set()
    if config.stage == 3:
        per_unit, _, kept = assign_parameters(module, units, config.param_persistence_threshold)
        unit_of = {id(p): i for i, params in enumerate(per_unit) for _, p in params}
        persistent = {id(p) for _, p in kept}
    params = [ParamSpec(name, p.numel(), p.requires_grad, owner.get(id(p), 0), replicas.get(id(p), 1),
                        tied.get(id(p), 0), unit_of.get(id(p)), id(p) in persistent)
              for name, p in module.named_parameters()]
    layout = bucket_layout(params, reductions, stage=config.stage, reduce_bucket_size=config.reduce_bucket_size,
                           units=len(units), hpz_partition_size=config.hpz_partition_size, rank=_rank())
    layout.unit_modules = units
    return layout
