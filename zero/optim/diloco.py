"""DiLoCo over replicas: R copies of an inner layout train apart for H steps, then average their parameter deltas.

`ReplicaDims(replicas=R, dp=..., ...)` is a ParallelDims whose groups live inside this rank's replica (the
world's ranks split into R contiguous blocks) and whose `replica_group` joins the ranks holding the same part
of the model in every replica. `DiLoCo(inner, dims, inner_steps=H, outer_lr, outer_momentum, delta_dtype)` is
an optimizer factory for zero.initialize: each replica steps its engine with `inner` (e.g. zero.FastAdamW), and
every H engine steps (attempted: a step one replica skips for a non-finite gradient counts there too) the replicas
average their deltas from the last synchronised parameters (sent in fp32, bf16 or int8 through `zero.dist.comm`)
and an outer SGD with Nesterov momentum applies the average. The first `warmup_steps` optimizer steps may be
ordinary data-parallel steps over all replicas (a synchronous warm start). Between synchronisations no collective
leaves a replica: its layout's groups, its gradient norm included (`world_group`), lie inside it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ProcessGroup

from zero.config import ConfigError, int_at_least, key_namer
from zero.dist import comm
from zero.dist.topology import ParallelDims
from zero.optim.bound import BoundOptimizer
from zero.optim.compression import ChunkLayout, check_block, quantized_all_reduce
from zero.sharding.optimizer import collect_grads

DELTA_DTYPES = ("fp32", "bf16", "int8")


def replica_world(replicas: object, world: int, keys: Mapping[str, str] | None = None) -> int:
    """The processes of one replica when `world` processes hold `replicas` replicas; ConfigError in one line
    where they do not split (`keys`: how the text names replicas, zero.config.key_name)."""
    k = key_namer(keys, "ReplicaDims")
    int_at_least(k("replicas"), replicas, 1)
    if world % replicas:
        raise ConfigError(f"{k('replicas')}={replicas} does not divide the {world} process(es): start a multiple of "
                          f"{replicas} processes")
    return world // replicas


@dataclass
class ReplicaDims(ParallelDims):
    """A ParallelDims for one of `replicas` replicas: dp x tp x pp x sp fill world size / replicas, every group
    lies inside the replica (ranks [r * inner, (r + 1) * inner) for replica r), `replica_group` crosses them."""

    replicas: int = 1
    _root: object = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.world_size = replica_world(self.replicas, world)  # the inner layout's processes
        super().__post_init__()

    @property
    def replica(self) -> int:
        """This rank's replica index."""
        return (dist.get_rank() if dist.is_initialized() else 0) // self.world_size

    def _root_mesh(self):
        if self._root is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._root = init_device_mesh(self.device_type, (self.replicas, self.pp, self.dp, self.sp, self.tp),
                                          mesh_dim_names=("replica", "pp", "dp", "sp", "tp"))
        return self._root

    @property
    def mesh(self):
        """This replica's DeviceMesh (pp, dp, sp, tp), cut from the world's (replica, pp, dp, sp, tp)."""
        if self._mesh is None and self.distributed:
            mesh = self._root_mesh()["pp", "dp", "sp", "tp"]
            dp_sp = mesh["dp", "sp"]._flatten("dp_sp")
            dp_sp._unflatten(0, (self.edp, self.ep), ("edp", "ep"))
            self._mesh = mesh
        return self._mesh

    @property
    def world_group(self) -> ProcessGroup | None:
        """This replica's ranks (None for a replica of one rank): what the engine's whole-layout reductions (the
        gradient norm under tp) span, so the replicas stay apart between synchronisations."""
        if self.world_size == 1:
            return None
        size = self.world_size
        return self.group_of([list(range(r * size, (r + 1) * size)) for r in range(self.replicas)],
                             tag="replica world")

    @property
    def replica_group(self) -> ProcessGroup | None:
        """The ranks at this rank's place in every replica (None for one replica)."""
        return None if self.replicas == 1 else self._root_mesh()["replica"].get_group()

    def coordinate(self, rank: int | None = None) -> dict[str, int]:
        rank = (dist.get_rank() if dist.is_initialized() else 0) if rank is None else rank
        return {**super().coordinate(rank % self.world_size), "replica": rank // self.world_size}

    def __str__(self) -> str:
        return f"{super().__str__()[:-1]}, replicas={self.replicas})"


class DiLoCo(BoundOptimizer):
    """Optimizer factory: `inner` (a factory, e.g. zero.FastAdamW(lr=...)) for the inner steps; every `inner_steps`
    inner steps (engine steps, taken or skipped) the deltas are averaged over `replica_group` in `delta_dtype`
    (int8: one fp32 scale per `block` elements) and applied by SGD(outer_lr, momentum=outer_momentum, nesterov=True).
    The first `warmup_steps` optimizer steps average the gradients over `replica_group` before every inner step
    (fp32, an all-reduce: ordinary data parallelism over all replicas); the local periods start after them.
    `keys`: how the refusals name the arguments and the layout (zero.config.key_name)."""

    def __init__(self, inner: Any, replica_group: ProcessGroup | None, *, inner_steps: int, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, delta_dtype: str = "fp32", block: int = 2048,
                 warmup_steps: int = 0, keys: Mapping[str, str] | None = None) -> None:
        k = key_namer(keys, "DiLoCo")
        if isinstance(inner, BoundOptimizer):
            raise ConfigError(f"DiLoCo's inner optimizer ({k('inner')}: {type(inner).__name__}) takes over the "
                              "engine's steps itself, as DiLoCo does; use an ordinary optimizer such as AdamW "
                              "(zero.FastAdamW)")
        int_at_least(k("inner_steps"), inner_steps, 1)
        if not outer_lr > 0 or not 0 <= outer_momentum < 1:
            raise ConfigError(f"{k('outer_lr')}={outer_lr!r} must be > 0 and {k('outer_momentum')}="
                              f"{outer_momentum!r} in [0, 1)")
        if delta_dtype not in DELTA_DTYPES:
            raise ConfigError(f"{k('delta_dtype')}={delta_dtype!r} must be one of {', '.join(DELTA_DTYPES)}")
        int_at_least(k("warmup_steps"), warmup_steps, 0)
        check_block(k("block"), block)
        self.warmup_steps, self.keys = warmup_steps, keys
        self.inner, self.replica_group, self.inner_steps = inner, replica_group, inner_steps
        self.outer_lr, self.outer_momentum, self.delta_dtype, self.block = outer_lr, outer_momentum, delta_dtype, block

    def __call__(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return self.inner(params)

    def refuse_layout(self, config: Any, dims: Any) -> None:
        k, z = key_namer(self.keys, "DiLoCo"), key_namer(self.keys, "ZeroConfig")
        d = key_namer(self.keys, "ParallelDims")
        if dims.pp > 1:
            raise NotImplementedError(f"DiLoCo with {d('pp')}={dims.pp} is not implemented (tied embedding copies "
                                      f"across stages); use {d('pp')}=1")
        if self.warmup_steps and config.offload_optimizer != "none":
            raise NotImplementedError(f"DiLoCo's {k('warmup_steps')}={self.warmup_steps} with {z('offload_optimizer')}="
                                      f"{config.offload_optimizer} is not implemented (the store takes the gradients "
                                      f"before the replicas average them); use {k('warmup_steps')}=0 or "
                                      f"{z('offload_optimizer')}=none")

    def bind(self, engine: Any) -> DiLoCoSteps:
        self.refuse_layout(engine.config, engine.dims)
        return DiLoCoSteps(self, engine)


class DiLoCoSteps:
    """One engine's outer loop (built by DiLoCo.bind): every engine step after the warm-up is an inner step, taken
    or skipped; each inner_steps-th also synchronises the replicas."""

    def __init__(self, spec: DiLoCo, engine: Any) -> None:
        self.spec, self.engine = spec, engine
        self.inner_done = 0  # inner steps attempted (taken or skipped) since the last synchronisation
        self.syncs = 0
        # The parameters every replica agreed on at the last synchronisation (fp32, this rank's master shards),
        # taken at the first step (weights loaded after zero.initialize count) and the outer momentum.
        self.anchor: list[torch.Tensor] | None = None
        self.momentum: list[torch.Tensor] | None = None

    def takes_step(self) -> bool:
        return True

    def step(self) -> bool:
        zo = self.engine.zero_optimizer
        # The engine's count of applied steps (restored with its checkpoints) says whether this is a warm-up step.
        # Replicas skip warm-up steps together (a non-finite gradient reaches every replica in the average), so
        # they leave the warm-up at the same step.
        if self.engine.global_steps < self.spec.warmup_steps:
            self.average_gradients()
            return zo.step()  # every replica applies the same averaged gradient: they stay identical
        if self.anchor is None:
            self.anchor = [zo.read_master(b).detach().clone() for b in zo.trainable]
            self.momentum = [torch.zeros_like(a) for a in self.anchor]
        stepped = zo.step()
        # Every replica counts the inner steps it attempted, taken or skipped (a non-finite gradient on this
        # replica only, e.g. an fp16 overflow): the replicas then synchronise at the same steps. A skipped step
        # is an inner step without an update: this replica's delta for the period holds one update fewer.
        self.inner_done += 1
        if self.inner_done == self.spec.inner_steps:
            self.synchronise()
        return stepped

    @torch.no_grad()
    def average_gradients(self) -> None:
        """Warm-up: average this step's gradients over the replicas (fp32 all-reduce), before the inner step
        reduces them inside the replica: the sum over every rank of the world, as plain data parallelism."""
        group = self.spec.replica_group
        if group is None:
            return
        replicas = dist.get_world_size(group)
        for b in self.engine.zero_optimizer.trainable:
            if self.engine.config.stage <= 1:  # the full local gradient, reduced inside the replica at the step
                collect_grads(b)
                grad = b.grad_full
            else:  # already reduced inside the replica during backward: this rank's shard of it
                if b.grad_acc is None:
                    b.grad_acc = torch.zeros(b.shard_size, dtype=torch.float32, device=b.device)
                grad = b.grad_acc
            comm.all_reduce(grad, group)
            grad.div_(replicas)

    @torch.no_grad()
    def synchronise(self) -> None:
        """Outer step: average the deltas over the replicas, Nesterov SGD from the anchor, publish."""
        spec, zo = self.spec, self.engine.zero_optimizer
        world = dist.get_world_size(spec.replica_group) if spec.replica_group is not None else 1
        values = []
        for anchor, momentum, b in zip(self.anchor, self.momentum, zo.trainable):
            delta = anchor - zo.read_master(b).to(anchor.device)  # the outer "gradient"
            layout = ChunkLayout(delta.numel(), world, spec.block)
            average = layout.from_chunks(quantized_all_reduce(layout.to_chunks(delta), layout, spec.delta_dtype,
                                                              spec.replica_group))
            momentum.mul_(spec.outer_momentum).add_(average)
            anchor.sub_(average.add(momentum, alpha=spec.outer_momentum), alpha=spec.outer_lr)
            values.append(anchor)
        zo.load_masters(values)
        zo.gather_shards()
        self.inner_done = 0
        self.syncs += 1

    def state_dict(self) -> dict:
        return {"kind": "diloco", "inner_done": self.inner_done, "syncs": self.syncs,
                "replicas": dist.get_world_size(self.spec.replica_group) if self.spec.replica_group else 1,
                "anchor": None if self.anchor is None else [a.clone() for a in self.anchor],
                "momentum": None if self.momentum is None else [m.clone() for m in self.momentum]}

    def load_state_dict(self, state: dict | None) -> None:
        if state is None or state.get("kind") != "diloco":
            if self.engine.global_steps:
                raise NotImplementedError(
                    f"this checkpoint (step {self.engine.global_steps}) holds no DiLoCo outer state (it was resharded "
                    "or written without DiLoCo): resume under the layout and optimizer it was written with")
            return
        mine = dist.get_world_size(self.spec.replica_group) if self.spec.replica_group else 1
        if state["replicas"] != mine:
            raise ValueError(f"checkpoint written with parallel.replicas={state['replicas']} cannot resume with "
                             f"{mine} replicas (the outer state is per replica layout); resume with the same replicas")
        self.inner_done, self.syncs = state["inner_done"], state["syncs"]
        self.anchor, self.momentum = None, None
        if state["anchor"] is not None:
            devices = [b.device for b in self.engine.zero_optimizer.trainable]
            self.anchor = [a.to(d).clone() for a, d in zip(state["anchor"], devices)]
            self.momentum = [m.to(d).clone() for m, d in zip(state["momentum"], devices)]
