"""The training engine: `zero.initialize(model, optimizer, config, dims)` wraps a model for ZeRO 0-3.

It owns forward/backward/step with gradient accumulation, mixed precision, clipping, loss scaling,
state dicts, atomic checkpoints and per-rank memory / communication metrics.
"""

from __future__ import annotations

import resource
from collections.abc import Callable
from typing import Any

import psutil
import torch
import torch.distributed as dist
import torch.nn as nn

from zero import comm
from zero.config import ZeroConfig
from zero.optimizer import FullGradReducer, ZeroOptimizer
from zero.partition import FlatBucket, split_into_buckets
from zero.stage3 import Stage3Hooks, assign_parameters, find_units
from zero.topology import ParallelDims, group_size

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def _twin_groups(groups: list) -> list:
    """A second process group over the same ranks as each given group (None stays None).

    Gradient reductions run on the twin so their order can never interleave differently across
    ranks with the parameter all-gathers of stage 3 (which depend only on the forward order).
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(groups)
    mine = [None if g is None else dist.get_process_group_ranks(g) for g in groups]
    everyone = comm.all_gather_object(mine, dist.group.WORLD)
    twins = []
    for k, g in enumerate(groups):
        if g is None:
            twins.append(None)
            continue
        twin = None
        # Every rank must call new_group for every group, in the same order.
        for ranks in sorted({tuple(r[k]) for r in everyone}):
            created = dist.new_group(list(ranks))
            if dist.get_rank() in ranks:
                twin = created
        twins.append(twin)
    return twins


class Engine:
    """A model wrapped for data-parallel training with ZeRO stage 0-3. Build it with `zero.initialize`."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: OptimizerFactory,
        config: ZeroConfig,
        dims: ParallelDims,
        lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    ) -> None:
        if isinstance(optimizer, torch.optim.Optimizer) or not callable(optimizer):
            raise TypeError(
                f"optimizer={type(optimizer).__name__} is invalid: pass a factory that builds the optimizer "
                "from a list of parameters, e.g. functools.partial(torch.optim.AdamW, lr=3e-4); the engine "
                "gives it "
                "the flat fp32 master shards it owns"
            )
        if lr_scheduler is not None and not callable(lr_scheduler):
            raise TypeError(
                "lr_scheduler must be a factory optimizer -> scheduler, e.g. "
                "functools.partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=...)"
            )
        if isinstance(lr_scheduler, torch.optim.lr_scheduler.LRScheduler):
            raise TypeError(
                "lr_scheduler is a built scheduler; pass a factory optimizer -> scheduler instead "
                "(the engine builds the optimizer over its master shards)"
            )
        if dims.tp > 1 or dims.pp > 1:
            raise NotImplementedError(
                f"the ZeRO engine supports data, sequence and expert parallelism; tp={dims.tp}, pp={dims.pp} "
                "(tensor/pipeline parallel gradient reduction and norms) are not implemented"
            )
        self.module = model
        self.config = config
        self.dims = dims
        self.dp = dims.dp
        dtype = config.torch_dtype
        dense_group, expert_group = dims.dp_sp_group, dims.expert_data_parallel_group
        dense_grad_group, expert_grad_group = _twin_groups([dense_group, expert_group])
        groups = {
            False: (dense_group, dense_grad_group, dims.dp_sp),
            True: (expert_group, expert_grad_group, dims.edp),
        }

        def make(
            named: list[tuple[str, nn.Parameter]], resident: bool, max_numel: int | None
        ) -> list[FlatBucket]:
            """Buckets for `named`, split by (expert, trainable), each kind cut at max_numel elements."""
            out = []
            for is_expert in (False, True):
                for trainable in (True, False):
                    sel = [
                        (n, p)
                        for n, p in named
                        if bool(getattr(p, "is_expert", False)) == is_expert and p.requires_grad == trainable
                    ]
                    if not sel:
                        continue
                    group, grad_group, region = groups[is_expert]
                    for chunk in split_into_buckets(sel, max_numel or sum(p.numel() for _, p in sel)):
                        b = FlatBucket(
                            [p for _, p in chunk],
                            [n for n, _ in chunk],
                            group,
                            dtype=dtype,
                            shard=config.stage >= 1,
                            resident=resident,
                            is_expert=is_expert,
                            grad_group=grad_group,
                        )
                        # Ranks of the dp x sp region holding the same reduced gradient elements:
                        # the global norm counts each element once.
                        b.replicas = 1 if b.world > 1 else (dims.dp_sp if not is_expert else dims.edp)
                        # Attach at once so each original parameter tensor is released before the next
                        # bucket is flattened: the build never holds two copies of the whole model.
                        b.broadcast_from_first_rank()
                        b.attach()
                        out.append(b)
            return out

        named = list(model.named_parameters())
        self.stage3: Stage3Hooks | None = None
        if config.stage == 3:
            units = find_units(model, config.stage3_unit_classes)
            per_unit, root, persistent = assign_parameters(model, units, config.param_persistence_threshold)
            unit_buckets = [make(params, resident=False, max_numel=None) for params in per_unit]
            root_buckets = make(root, resident=False, max_numel=None)
            persistent_buckets = make(persistent[::-1], resident=True, max_numel=config.reduce_bucket_size)
            # Reduction order: blocks last-to-first (backward order), then the root, then the small ones.
            self.buckets = [b for bl in unit_buckets[::-1] for b in bl] + root_buckets + persistent_buckets
        else:
            # Reverse registration order approximates backward order, so buckets fill front to back.
            self.buckets = make(named[::-1], resident=True, max_numel=config.reduce_bucket_size)
        if config.stage == 3:
            root_ids = {id(p) for _, p in root}
            self.stage3 = Stage3Hooks(
                model, units, unit_buckets, root_buckets, root_ids, config.prefetch_depth
            )
        self.zero_optimizer = ZeroOptimizer(
            self.buckets,
            config,
            self.dp,
            dense_group,
            optimizer,
            on_bucket_complete=self.stage3.on_bucket_reduced if self.stage3 else None,
        )
        self.optimizer = self.zero_optimizer.optimizer
        if isinstance(self.zero_optimizer.reducer, FullGradReducer):
            # Stages 0-1 preset every .grad to a view of a flat buffer and run no gradient hooks, so
            # modules that can add their weight gradients into .grad in place may do so.
            for m in model.modules():
                if hasattr(m, "fuse_grad_accumulation"):
                    m.fuse_grad_accumulation = True
        self.device = self.zero_optimizer.device
        self.lr_scheduler = lr_scheduler(self.optimizer) if lr_scheduler is not None else None
        self.micro_steps = 0  # backward calls so far
        self.global_steps = 0  # optimizer steps taken
        self.skipped_steps = 0  # fp16 steps skipped for inf/nan gradients
        self._micro_since_step = 0
        self._comm_mark: dict[str, int] | None = None  # comm.stats at the start of this step's first pass
        self._last_step_comm: dict[str, int] = {}

    # ------------------------------------------------------------------ training
    def _mark_comm(self) -> None:
        if self._comm_mark is None:
            self._comm_mark = comm.stats.snapshot()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._mark_comm()
        if self.stage3 is not None:
            self.stage3.gather_root()
        return self.module(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate loss / grad_accum_steps (times the fp16 loss scale) and reduce what is ready."""
        self._mark_comm()
        scale = self.zero_optimizer.loss_scale / self.config.grad_accum_steps
        (loss * scale).backward()
        self.zero_optimizer.reducer.after_backward()
        if self.stage3 is not None:
            self.stage3.after_backward()
        self.micro_steps += 1
        self._micro_since_step += 1

    @property
    def is_accumulation_boundary(self) -> bool:
        """True when the micro-batches backpropagated since the last step complete an accumulation cycle."""
        return self._micro_since_step >= self.config.grad_accum_steps

    def step(self) -> bool:
        """Optimizer step at the accumulation boundary (else a no-op); True if the parameters changed."""
        if not self.is_accumulation_boundary:
            return False
        if self.stage3 is not None:
            self.stage3.release_all()
        stepped = self.zero_optimizer.step()
        self._micro_since_step = 0
        if stepped:
            self.global_steps += 1
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        else:
            self.skipped_steps += 1
        now = comm.stats.snapshot()
        mark = self._comm_mark or {}
        if any(v < mark.get(k, 0) for k, v in now.items()) or set(mark) - set(now):
            mark = {}  # the counters were reset after our mark (e.g. by the training loop)
        self._last_step_comm = {k: v - mark.get(k, 0) for k, v in now.items() if v - mark.get(k, 0)}
        self._comm_mark = None
        return stepped

    def zero_grad(self) -> None:
        """Drop gradients accumulated since the last step (step() already clears them)."""
        self.zero_optimizer.clear_grads()
        self._micro_since_step = 0

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    @property
    def global_grad_norm(self) -> float | None:
        """Global L2 norm of the (unscaled, unclipped) gradient at the last step."""
        return self.zero_optimizer.last_grad_norm

    @property
    def loss_scale(self) -> float:
        return self.zero_optimizer.loss_scale

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    # ------------------------------------------------------------------ metrics
    def memory_breakdown(self) -> dict[str, int]:
        """Bytes this rank holds now for parameters, gradients, fp32 masters and optimizer state."""
        out = {"params": 0, "grads": 0, "master": 0, "optimizer_state": 0}
        for b in self.buckets:
            for k, v in b.state_bytes().items():
                out[k] += v
        for state in self.optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    out["optimizer_state"] += v.numel() * v.element_size()
        return out

    def metrics(self) -> dict[str, float]:
        """Per-rank memory and communication figures, cheap enough to log every step."""
        rss = psutil.Process().memory_info().rss
        peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out: dict[str, float] = {
            "rss_mb": rss / 2**20,
            "peak_rss_mb": peak_kb / 1024,
            "comm_bytes_per_step": float(sum(self._last_step_comm.values())),
            "loss_scale": self.loss_scale,
            "skipped_steps": self.skipped_steps,
            "global_steps": self.global_steps,
        }
        for kind, nbytes in self._last_step_comm.items():
            out[f"comm_bytes_{kind}"] = float(nbytes)
        if self.global_grad_norm is not None:
            out["grad_norm"] = self.global_grad_norm
        if torch.cuda.is_available():
            out["cuda_max_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
            out["cuda_allocated_mb"] = torch.cuda.memory_allocated() / 2**20
        for k, v in self.memory_breakdown().items():
            out[f"{k}_bytes"] = float(v)
        return out

    # ------------------------------------------------------------------ state
    def _layout(self) -> list[dict]:
        return [
            {
                "names": b.names,
                "numels": b.numels,
                "padded": b.padded,
                "world": b.world,
                "rank": b.rank,
                "trainable": b.trainable,
            }
            for b in self.buckets
        ]

    def state_dict(self) -> dict:
        """This rank's shard of the training state (what its checkpoint file holds)."""
        return {
            "format": "zero-sharded-v1",
            "stage": self.config.stage,
            "dtype": self.config.dtype,
            "layout": self._layout(),
            "shards": [
                (b.master if b.trainable else b.shard_tensor()).detach().clone() for b in self.buckets
            ],
            "optimizer": self.optimizer.state_dict(),
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "loss_scaler": self.zero_optimizer.scaler.state_dict() if self.zero_optimizer.scaler else None,
            "buffers": {n: b.detach().clone() for n, b in self.module.named_buffers()},
            "counters": {
                "micro_steps": self.micro_steps,
                "global_steps": self.global_steps,
                "skipped_steps": self.skipped_steps,
            },
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        if state.get("format") != "zero-sharded-v1":
            raise ValueError("not a sharded engine state dict (expected format 'zero-sharded-v1')")
        if state["layout"] != self._layout() or state["stage"] != self.config.stage:
            raise ValueError(
                f"checkpoint layout (stage {state['stage']}, {len(state['layout'])} buckets) does not match "
                f"this engine (stage {self.config.stage}, {len(self.buckets)} buckets): load it with the "
                "same "
                "model, "
                "stage, bucket sizes and parallel layout, or go through "
                "full_state_dict()/load_full_state_dict()"
            )
        if self.stage3 is not None:
            self.stage3.release_all()
        self.zero_optimizer.clear_grads()
        for b, shard in zip(self.buckets, state["shards"]):
            (b.master if b.trainable else b.shard_tensor()).copy_(shard)
            if not b.trainable and b.resident and b.sharded and b.world > 1:
                comm.all_gather_into_tensor(b.full, b.shard_tensor().clone(), b.group)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.lr_scheduler is not None and state["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if self.zero_optimizer.scaler is not None and state["loss_scaler"] is not None:
            self.zero_optimizer.scaler.load_state_dict(state["loss_scaler"])
        buffers = dict(self.module.named_buffers())
        for n, v in state["buffers"].items():
            buffers[n].copy_(v)
        for k, v in state["counters"].items():
            setattr(self, k, v)
        self._micro_since_step = 0
        self.zero_optimizer.publish()

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded model state dict (fp32 masters for trainable parameters), on CPU, on every rank.

        Collective: every rank of the engine must call it. Expert parameters are this rank's local experts.
        """
        values: dict[int, torch.Tensor] = {}
        for b in self.buckets:
            src = (b.master if b.trainable else b.shard_tensor()).detach()
            if b.world > 1:
                flat = torch.empty(b.padded, dtype=src.dtype, device=src.device)
                comm.all_gather_into_tensor(flat, src.contiguous(), b.group)
            else:
                flat = src
            for p, v in zip(b.params, b.param_views(flat)):
                values[id(p)] = v.detach().to("cpu", copy=True)
        out = {}
        for name, v in self.module.state_dict(keep_vars=True).items():
            out[name] = values[id(v)] if id(v) in values else v.detach().to("cpu", copy=True)
        return out

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load unsharded model weights (e.g. from full_state_dict or a pretrained file) into every layout."""
        if self.stage3 is not None:
            self.stage3.release_all()
        missing = [n for b in self.buckets for n in b.names if n not in state]
        if missing:
            raise KeyError(f"state dict lacks parameters {missing[:5]}{'...' if len(missing) > 5 else ''}")
        for b in self.buckets:
            flat = torch.zeros(b.padded, dtype=torch.float32)
            for n, o, k in zip(b.names, b.offsets, b.numels):
                flat[o : o + k].copy_(state[n].reshape(-1))
            shard = b.shard_of(flat).to(b.device)
            if b.trainable:
                b.master.copy_(shard)
            b.shard_tensor().copy_(shard)
            if b.resident:
                b.full.copy_(flat)
        buffers = dict(self.module.named_buffers())
        for n, v in state.items():
            if n in buffers:
                buffers[n].copy_(v)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str, client_state: dict | None = None) -> None:
        """Atomically write this rank's sharded state (plus its `client_state`) into directory `path`."""
        from zero.checkpoint import save_checkpoint

        save_checkpoint(self, path, client_state)

    def load_checkpoint(self, path: str) -> dict | None:
        """Restore a checkpoint written by save_checkpoint; returns this rank's client_state."""
        from zero.checkpoint import load_checkpoint

        return load_checkpoint(self, path)


def initialize(
    model: nn.Module,
    optimizer: OptimizerFactory,
    config: ZeroConfig | None = None,
    dims: ParallelDims | None = None,
    lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
) -> Engine:
    """Wrap `model` for training: shard per `config.stage` over the groups of `dims`.

    `optimizer` is a factory (e.g. functools.partial(torch.optim.AdamW, lr=3e-4)) called with the flat
    fp32 master shards; `lr_scheduler` a factory optimizer -> scheduler, stepped after each optimizer step.
    """
    config = config if config is not None else ZeroConfig()
    dims = dims if dims is not None else ParallelDims()
    if group_size(dims.dp_sp_group) != dims.dp_sp:
        raise RuntimeError(f"{dims} does not match the process group sizes")
    return Engine(model, optimizer, config, dims, lr_scheduler)
