"""ZeRO-3: parameters partitioned per unit module, gathered just before use with prefetch, freed after.

Units (by default the children of every nn.ModuleList, e.g. transformer blocks, and a contract model's blocks and
edge units: an untied embedding and output head) own flat buckets whose full storage exists only between a unit's
forward pre-hook and post-hook, and again from the first gradient reaching its outputs (not for an embedding, whose
backward reads no weight) until its parameters' gradients have been reduce-scattered. The rest (the root: parameters
of no unit or of several, e.g. a tied embedding and head) stays gathered for the whole forward and backward.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from zero.contract import ContractError, ModelContract, offers
from zero.sharding.buckets import FlatBucket


def _in_backward() -> bool:
    """True while the autograd engine runs (e.g. an activation-checkpoint recompute)."""
    return torch._C._current_graph_task_id() != -1


class BlockDict(nn.ModuleDict):
    """Consecutive blocks keyed by their index in the whole model (e.g. a pipeline rank's layers, whose
    names stay those of the full model): like a ModuleList's children, each one is a ZeRO-3 unit."""


def find_units(module: nn.Module, class_names: tuple[str, ...] | None) -> list[tuple[str, nn.Module]]:
    """The gather units, by the first policy that applies: the modules of the named classes (an explicit
    `stage3_unit_classes`), the blocks of a model implementing the contract (`zero.contract`) with its edge units
    (`edge_units`), in the order the model registers them, else the children of every ModuleList (and BlockDict),
    outermost first."""
    if class_names:
        return _outermost(module, lambda parent, child: type(child).__name__ in class_names)
    if isinstance(module, ModelContract):
        try:
            blocks = list(module.blocks())
        except ContractError:
            pass  # a contract model without blocks: the container policy below
        else:
            edges = edge_units(module)
            if not edges:
                return blocks
            position = {id(m): k for k, m in enumerate(module.modules())}
            return sorted(blocks + edges, key=lambda unit: position[id(unit[1])])
    return _outermost(module, lambda parent, child: isinstance(parent, (nn.ModuleList, BlockDict)))


def edge_units(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules outside the blocks that a model lets ZeRO-3 gather on their own (its optional
    `stage3_edge_units()`, e.g. an untied embedding and output head): every use of their parameters in the model's
    forward goes through their own call, so they can be gathered just around it, like a block, instead of staying
    gathered with the root for the whole forward and backward. A caller that reads such a parameter directly (a
    tiled loss reading the head's weight after `forward(return_hidden=True)`) still finds it gathered: an edge unit
    the model's forward did not call is gathered at its end, and a forward of the model's parts without its own
    (`model.forward_hidden`) gathers every edge unit; either way they stay gathered until their gradients are
    reduced (or backward ends), as the root does."""
    return list(module.stage3_edge_units()) if offers(module, "stage3_edge_units") else []


def _backward_needs_parameters(unit: nn.Module) -> bool:
    """False for an embedding: its backward reads only the indices (and the weight's shape), so its unit is not
    gathered again for backward (its gradient still arrives and is reduced)."""
    return not isinstance(unit, nn.Embedding)


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
        # Edge units (see edge_units): which ran in the model's forward now under way (None: no forward of the
        # model itself is under way), and those kept gathered for a direct use of their parameters.
        edge_ids = {id(m) for _, m in edge_units(module)}
        self.edge = {i for i, (_, unit) in enumerate(units) if id(unit) in edge_ids}
        self.edge_ran: set[int] | None = None
        self.held: set[int] = set()
        self.backward_gather = [_backward_needs_parameters(unit) for _, unit in units]
        if self.edge:
            self.hook_handles.append(module.register_forward_pre_hook(self._model_pre_forward))
            self.hook_handles.append(module.register_forward_hook(self._model_post_forward))
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
                b._gather_source = None  # (a synchronous gather: its source is no longer read)
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
        for b in self.unit_buckets[i]:
            b._gather_source = None  # the shard read for the gather (from nvme: a copy) is no longer needed

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
        """Free every unit but keep the root and the held edge units (more backwards of this step's forwards
        follow)."""
        for i in range(len(self.units)):
            if i not in self.held:
                self._free(i)

    def release_all(self) -> None:
        """Free every unit and the root (end of backward, before an optimizer step changes the shards)."""
        self.held.clear()
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
            self.held.discard(i)

    # ------------------------------------------------------------------ edge units
    def _hold(self, units) -> None:
        """Gather edge units for a use of their parameters outside their own calls; kept until their gradients
        are reduced or backward ends."""
        for i in units:
            self._gather(i, async_op=False)
            self._wait(i)
            self.held.add(i)

    def _model_pre_forward(self, module: nn.Module, args) -> None:
        if not _in_backward():
            self.edge_ran = set()

    def _model_post_forward(self, module: nn.Module, args, output) -> None:
        if self.edge_ran is not None:
            self._hold(sorted(self.edge - self.edge_ran))  # e.g. the head, when the caller applies its weight
            self.edge_ran = None

    # ------------------------------------------------------------------ hooks
    def _prefetch(self, positions: list[int], backward: bool = False) -> None:
        for pos in positions:
            if 0 <= pos < len(self.order) and (not backward or self.backward_gather[self.order[pos]]):
                self._gather(self.order[pos], async_op=True)

    def _pre_forward(self, i: int, module: nn.Module, args) -> None:
        self.gather_root()
        self._gather(i, async_op=False)
        self._wait(i)
        if _in_backward():
            return  # recompute under activation checkpointing: gather only
        if i in self.edge:
            if self.edge_ran is None:  # a forward of the model's parts, not of the model: their uses are unknown
                self._hold(sorted(self.edge))
            else:
                self.edge_ran.add(i)
        if self.recording:
            if i not in self.order:
                self.order.append(i)
        elif self.prefetch_depth and i in self.order:
            pos = self.order.index(i)
            self._prefetch(list(range(pos + 1, pos + 1 + self.prefetch_depth)))

    def _post_forward(self, i: int, module: nn.Module, args, output) -> None:
        if _in_backward():
            return  # a recompute: backward is about to use these parameters
        if i in self.held:
            return
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
        if tensors and self.backward_gather[i]:
            torch.autograd.graph.register_multi_grad_hook(tensors, functools.partial(self._pre_backward, i), mode="any")

    def _pre_backward(self, i: int, grad) -> None:
        self._gather(i, async_op=False)
        self._wait(i)
        # An edge unit (the output head) makes a gradient as large as itself in its backward: the previous unit is
        # gathered when its own backward starts, not prefetched beside these two.
        if self.prefetch_depth and i in self.order and i not in self.edge:
            pos = self.order.index(i)
            self._prefetch(list(range(pos - 1, pos - 1 - self.prefetch_depth, -1)), backward=True)

    def after_backward(self, keep_gathered: bool = False) -> None:
        """End of a backward: free everything, unless more backwards of the same forwards follow (a
        pipeline schedule's micro-batches), which still need the root."""
        if keep_gathered:
            self.release_units()
        else:
            self.release_all()
        self.recording = False
