"""ZeRO-3: parameters partitioned per unit module, gathered just before use with prefetch, freed after.

Units (by default the children of every nn.ModuleList, e.g. transformer blocks) own flat buckets whose
full storage exists only between a unit's forward pre-hook and post-hook, and again from the first
gradient reaching its outputs until its parameters' gradients have been reduce-scattered.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from zero.contract import ContractError, ModelContract
from zero.sharding.buckets import FlatBucket


def _in_backward() -> bool:
    """True while the autograd engine runs (e.g. an activation-checkpoint recompute)."""
    return torch._C._current_graph_task_id() != -1


class BlockDict(nn.ModuleDict):
    """Consecutive blocks keyed by their index in the whole model (e.g. a pipeline rank's layers, whose
    names stay those of the full model): like a ModuleList's children, each one is a ZeRO-3 unit."""


def find_units(module: nn.Module, class_names: tuple[str, ...] | None) -> list[tuple[str, nn.Module]]:
    """The gather units, by the first policy that applies: the modules of the named classes (an explicit
    `stage3_unit_classes`), the blocks of a model implementing the contract (`zero.contract`), else the
    children of every ModuleList (and BlockDict), outermost first."""
    if class_names:
        return _outermost(module, lambda parent, child: type(child).__name__ in class_names)
    if isinstance(module, ModelContract):
        try:
            return list(module.blocks())
        except ContractError:
            pass  # a contract model without blocks: the container policy below
    return _outermost(module, lambda parent, child: isinstance(parent, (nn.ModuleList, BlockDict)))


def _outermost(module: nn.Module, is_unit) -> list[tuple[str, nn.Module]]:
    units: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, parent: nn.Module) -> None:
        for name, child in parent.named_children():
            full = f"{prefix}{name}"
            if is_unit(parent, child):
                units.append((full, child))
            else:
                visit(full + ".", child)

    visit("", module)
    return units


def assign_parameters(module: nn.Module, units: list[tuple[str, nn.Module]], persistence_threshold: int):
    """Split parameters into per-unit lists, the root list and the persistent (replicated) list.

    A parameter reachable from more than one unit (tied across blocks) goes to the root unit, which
    stays gathered for the whole forward and backward, so every user sees it.
    """
    names = {id(p): n for n, p in module.named_parameters()}
    owner: dict[int, int] = {}
    for i, (_, unit) in enumerate(units):
        for p in unit.parameters():
            owner[id(p)] = -1 if owner.get(id(p), i) != i else i
    per_unit: list[list[tuple[str, nn.Parameter]]] = [[] for _ in units]
    root: list[tuple[str, nn.Parameter]] = []
    persistent: list[tuple[str, nn.Parameter]] = []
    for name, p in module.named_parameters():
        if p.numel() <= persistence_threshold:
            persistent.append((name, p))
        elif owner.get(id(p), -1) >= 0:
            per_unit[owner[id(p)]].append((names[id(p)], p))
        else:
            root.append((name, p))
    return per_unit, root, persistent


class Stage3Hooks:
    """Forward/backward hooks that gather, prefetch and free each unit's buckets."""

    def __init__(
        self,
        module: nn.Module,
        units: list[tuple[str, nn.Module]],
        unit_buckets: list[list[FlatBucket]],
        root_buckets: list[FlatBucket],
        root_param_ids: set[int],
        prefetch_depth: int,
    ) -> None:
        self.units = units
        self.unit_buckets = unit_buckets
        self.root_buckets = root_buckets
        self.prefetch_depth = prefetch_depth
        self.order: list[int] = []  # unit indices in forward order, recorded on the first forward
        self.recording = True
        self.root_gathered = False
        self.pending: dict[int, list] = {}
        self.hook_handles = []
        # Unit of each unit bucket (root buckets have none: they stay gathered until the end of backward).
        self.unit_of: dict[FlatBucket, int] = {b: i for i, b_list in enumerate(unit_buckets) for b in b_list}
        for i, (_, unit) in enumerate(units):
            self.hook_handles.append(unit.register_forward_pre_hook(functools.partial(self._pre_forward, i)))
            self.hook_handles.append(unit.register_forward_hook(functools.partial(self._post_forward, i)))
        # Any module that directly holds a root parameter gathers the root first, so calls that bypass
        # the top-level forward (model.forward_hidden, a loss reading model.output_weight) still work.
        unit_modules = {id(m) for _, u in units for m in u.modules()}
        for m in module.modules():
            if id(m) in unit_modules:
                continue
            if any(id(p) in root_param_ids for p in m.parameters(recurse=False)):
                self.hook_handles.append(m.register_forward_pre_hook(lambda *_: self.gather_root()))

    # ------------------------------------------------------------------ gather / free
    def gather_root(self) -> None:
        if not self.root_gathered:
            for b in self.root_buckets:
                b.gather()
            self.root_gathered = True

    def _gather(self, i: int, async_op: bool) -> None:
        backward = _in_backward()  # (a re-gather: from the secondary partition, when hpZ keeps one)
        for b in self.unit_buckets[i]:
            handle = b.gather(async_op=async_op, backward=backward)
            if handle is not None:
                self.pending.setdefault(i, []).append(handle)

    def _wait(self, i: int) -> None:
        for handle in self.pending.pop(i, []):
            handle.wait()

    def _free(self, i: int) -> None:
        self._wait(i)
        for b in self.unit_buckets[i]:
            b.free()

    def gather_units(self) -> None:
        """Gather every unit now (a weight-gradient pass runs backward without the hooks that gather)."""
        for i in range(len(self.units)):
            self._gather(i, async_op=False)
            self._wait(i)

    def release_units(self) -> None:
        """Free every unit but keep the root (more backwards of this step's forwards follow)."""
        for i in range(len(self.units)):
            self._free(i)

    def release_all(self) -> None:
        """Free every unit and the root (end of backward, before an optimizer step changes the shards)."""
        self.release_units()
        for b in self.root_buckets:
            b.free()
        self.root_gathered = False
        for bl in self.unit_buckets:
            for b in bl:
                b.drop_secondary()

    def on_bucket_reduced(self, b: FlatBucket) -> None:
        """All gradients of a unit bucket have arrived: its parameters are no longer needed this backward."""
        i = self.unit_of.get(b)
        if i is not None:
            self._wait(i)
            b.free()

    # ------------------------------------------------------------------ hooks
    def _prefetch(self, positions: list[int]) -> None:
        for pos in positions:
            if 0 <= pos < len(self.order):
                self._gather(self.order[pos], async_op=True)

    def _pre_forward(self, i: int, module: nn.Module, args) -> None:
        self.gather_root()
        self._gather(i, async_op=False)
        self._wait(i)
        if _in_backward():
            return  # recompute under activation checkpointing: gather only
        if self.recording:
            if i not in self.order:
                self.order.append(i)
        elif self.prefetch_depth and i in self.order:
            pos = self.order.index(i)
            self._prefetch(list(range(pos + 1, pos + 1 + self.prefetch_depth)))

    def _post_forward(self, i: int, module: nn.Module, args, output) -> None:
        if _in_backward():
            return  # a recompute: backward is about to use these parameters
        self._free(i)
        if not torch.is_grad_enabled():
            # Evaluation: no backward follows, so the unit's secondary partition (hpZ) is not needed. (In training mode
            # a reentrant checkpoint runs the forward without gradients and its recompute in backward re-gathers from
            # the copy; release_all drops it.)
            if not module.training:
                for b in self.unit_buckets[i]:
                    b.drop_secondary()
            return
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, functools.partial(self._pre_backward, i), mode="any")

    def _pre_backward(self, i: int, grad) -> None:
        self._gather(i, async_op=False)
        self._wait(i)
        if self.prefetch_depth and i in self.order:
            pos = self.order.index(i)
            self._prefetch(list(range(pos - 1, pos - 1 - self.prefetch_depth, -1)))

    def after_backward(self, keep_gathered: bool = False) -> None:
        """End of a backward: free everything, unless more backwards of the same forwards follow (a
        pipeline schedule's micro-batches), which still need the root."""
        if keep_gathered:
            self.release_units()
        else:
            self.release_all()
        self.recording = False
