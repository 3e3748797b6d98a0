"""The training engine: `zero.initialize(model, optimizer, config, dims)` wraps a model for ZeRO 0-3.

It owns forward/backward/step with gradient accumulation, mixed precision, clipping, loss scaling,
state dicts, atomic checkpoints and per-rank memory / communication metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import psutil
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ProcessGroup

from zero.config import ZeroConfig
from zero.contract import ModelContract
from zero.dist import comm
from zero.dist.topology import ParallelDims, default_device, group_size, peak_rss_bytes, release_free_host_memory
from zero.offload.hugepages import enable_huge_pages
from zero.offload.masters import streamed_shard
from zero.offload.nvme import check_nvme_path, pin_mmap_threshold
from zero.optim.bound import BoundOptimizer, StepOverride
from zero.plan import Placement, Plan, RuntimeFacts
from zero.sharding.buckets import FlatBucket
from zero.sharding.optimizer import FullGradReducer, ZeroOptimizer
from zero.sharding.policy import DEFAULT_REDUCE_GROUP, BucketSpec, Layout, module_bucket_layout
from zero.sharding.stage3 import Stage3Hooks
from zero.state.checkpoint import load_checkpoint, save_checkpoint
from zero.state.shardfile import done_reading

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
ParamInit = Callable[[str, torch.Tensor], None]


def _check_factories(optimizer: object, lr_scheduler: object) -> None:
    if isinstance(optimizer, torch.optim.Optimizer) or not callable(optimizer):
        raise TypeError(
            f"optimizer={type(optimizer).__name__} is invalid: pass a factory that builds the optimizer "
            "from a list of parameters, e.g. functools.partial(torch.optim.AdamW, lr=3e-4); the engine "
            "gives it the flat fp32 master shards it owns"
        )
    if isinstance(lr_scheduler, torch.optim.lr_scheduler.LRScheduler):
        raise TypeError(
            "lr_scheduler is a built scheduler; pass a factory optimizer -> scheduler instead "
            "(the engine builds the optimizer over its master shards)"
        )
    if lr_scheduler is not None and not callable(lr_scheduler):
        raise TypeError(
            "lr_scheduler must be a factory optimizer -> scheduler, e.g. "
            "functools.partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=...)"
        )


def _norm_group(dims: ParallelDims) -> ProcessGroup | None:
    """The ranks over which the global gradient norm sums: every rank holding distinct gradients, so with
    tensor or pipeline parallelism every rank of the layout (tp replicas are divided out per bucket). Never
    beyond the layout: DiLoCo's replicas each clip by their own norm, and talk only when they synchronise."""
    return dims.dp_sp_group if dims.tp == 1 and dims.pp == 1 else dims.world_group


def _check_placements(model: nn.Module, placements: Mapping[str, Placement]) -> dict[str, Placement]:
    """The placements of this module's parameters (names of other pipeline stages are ignored), each
    checked against its parameter's shape; whole placements are dropped (that is the default)."""
    out = {}
    for name, p in model.named_parameters():
        placement = placements.get(name)
        if placement is None:
            continue
        if not isinstance(placement, Placement):
            raise TypeError(f"placements[{name!r}] must be a zero.plan.Placement, got {type(placement).__name__}")
        if tuple(p.shape) != placement.local_shape:
            raise ValueError(f"placements[{name!r}] describes a local tensor of shape {placement.local_shape} but "
                             f"the parameter has shape {tuple(p.shape)}")
        if not placement.is_whole:
            out[name] = placement
    return out


def _check_declarations(config: ZeroConfig, replicated: dict, tied: dict, loss_scale_hooks: Sequence) -> None:
    if not all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in replicated.values()):
        raise ValueError("replicated_params maps parameters to the number of tensor-parallel ranks holding "
                         "them (an int >= 1)")
    if any(g is not None for g in tied.values()) and config.offload_optimizer == "nvme" and config.stage >= 2:
        raise NotImplementedError("parameters tied across pipeline stages with gradients spilled to nvme "
                                  "(offload_optimizer=nvme at stage >= 2) are not implemented; offload to cpu, "
                                  "use stage 1 or untie the embeddings")
    if not all(callable(h) for h in loss_scale_hooks):
        raise TypeError("loss_scale_hooks must be callables taking the loss multiplier (a float)")


def _check_meta(model: nn.Module, param_init: ParamInit | None) -> torch.device | None:
    """The device meta-device parameters are materialised on (None when there are none); clear errors first."""
    if param_init is not None and not callable(param_init):
        raise TypeError("param_init must be a callable (name, tensor) -> None that fills tensor in place")
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    if not meta:
        return None
    if param_init is None:
        raise ValueError(f"{len(meta)} parameters are on the meta device (first: {meta[0]!r}): pass param_init= "
                         "to zero.initialize to materialise them bucket by bucket")
    buffers = [n for n, b in model.named_buffers() if b.is_meta]
    if buffers:
        raise NotImplementedError(f"meta-device buffers ({buffers[:3]}) are not materialised by the engine: "
                                  "build buffers on a real device")
    if any(not p.is_meta for p in model.parameters()):
        raise ValueError("the model mixes meta-device and materialised parameters; build it wholly on one")
    return default_device()


def _tune_host_allocator(model: nn.Module, config: ZeroConfig) -> None:
    """Pin glibc's mmap threshold where the engine should (`pins_host_allocator`), and advise the fresh per-step
    mappings it then makes to fault in 2 MiB pages where the kernel's transparent huge pages allow."""
    if pins_host_allocator(config, next(model.parameters(), torch.empty(0)).device):
        pin_mmap_threshold(config.host_mmap_threshold)
        enable_huge_pages(True)


def pins_host_allocator(config: ZeroConfig, device: torch.device) -> bool:
    """Whether the engine pins glibc's mmap threshold at `config.host_mmap_threshold` (0: never): with nvme
    parameter offload, and at stage 3 on a CPU `device` (the parameters', where units are gathered). Left alone, glibc
    raises the threshold to the size of each large block it frees (up to 32 MiB), after which the unit gathers,
    gradient buffers and collective copies that stage 3 allocates and frees every step come from heaps that keep
    freed pages and fragment: resident memory grows step after step to far more than is ever live at once."""
    if not config.host_mmap_threshold:
        return False
    return config.offload_params == "nvme" or (config.stage == 3 and device.type == "cpu")


class Engine:
    """A model wrapped for data-parallel training with ZeRO stage 0-3. Build it with `zero.initialize`."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: OptimizerFactory,
        config: ZeroConfig,
        dims: ParallelDims,
        lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
        plan: Plan | None = None,
        param_init: ParamInit | None = None,
    ) -> None:
        plan = plan if plan is not None else Plan("none")
        replicated_params, tied_params = plan.replicated_params, plan.tied_params
        _check_factories(optimizer, lr_scheduler)
        _check_declarations(config, replicated_params, tied_params, plan.loss_scale_hooks)
        self.module, self.config, self.dims, self.dp = model, config, dims, dims.dp
        self.plan = plan
        self.placements = _check_placements(model, plan.placements)
        self.loss_scale_hooks = list(plan.loss_scale_hooks)
        self.param_init = param_init
        self._unmaterialised: set[int] = set()  # ids of the storage-less stand-ins of meta-built parameters
        self._meta_ids: dict[int, nn.Parameter] = {}  # meta parameter id -> stand-in (reduce_groups name the former)
        self._swap_meta_parameters(model, _check_meta(model, param_init))
        # Parameters held identically by k tensor-parallel ranks: bucketed apart, counted once in the norm.
        self._tp_replicas = {id(self._meta_ids.get(id(p), p)): k for p, k in replicated_params.items() if k > 1}
        # Parameters with a copy on other ranks (a pipeline's tied embedding and head): gradients summed there.
        self._tied = {id(self._meta_ids.get(id(p), p)): g for p, g in tied_params.items() if g is not None}
        _tune_host_allocator(model, config)  # before the buckets are built and gathered
        self._rank = dist.get_rank() if dist.is_initialized() else 0
        self.stage3: Stage3Hooks | None = None
        #: The bucket policy's layout (zero.sharding.policy), the one the planner predicts: buckets in reduction order.
        self.layout = module_bucket_layout(model, plan, dims, config, resolve=lambda p: self._meta_ids.get(id(p), p))
        # Gradient reductions run on twins of the reduction groups (see ParallelDims.twin_groups).
        twins = dims.twin_groups({r.name: r.group for r in self.layout.reductions})
        self._check_param_offload_space(self.layout)
        self.buckets = self._build_buckets(model, self.layout, twins)
        if config.stage == 3:
            self.stage3 = self._stage3_hooks(model, self.layout, self.buckets)
        self.zero_optimizer = ZeroOptimizer(
            self.buckets,
            config,
            self.dp,
            _norm_group(dims),
            optimizer,
            on_bucket_complete=self.stage3.on_bucket_reduced if self.stage3 else None,
            rank=self._rank,
        )
        self.optimizer = self.zero_optimizer.optimizer
        # An optimizer that changes what is communicated (1-bit Adam, DiLoCo) takes over the steps it changes.
        self.step_override: StepOverride | None = (
            optimizer.bind(self) if isinstance(optimizer, BoundOptimizer) else None)
        self.device = self.zero_optimizer.device
        self.lr_scheduler = lr_scheduler(self.optimizer) if lr_scheduler is not None else None
        # backward calls, optimizer steps taken, steps skipped for a non-finite gradient (fp16 or divergence)
        self.micro_steps = self.global_steps = self.skipped_steps = 0
        self._micro_since_step = 0
        self._comm_mark: dict[str, int] | None = None  # comm.stats at the start of this step's first pass
        self._last_step_comm: dict[str, int] = {}
        #: Set by load_checkpoint: {"path": ..., "resharded_from": the checkpoint's layout or None}.
        self.loaded_checkpoint: dict | None = None

    # ------------------------------------------------------------------ construction
    def _swap_meta_parameters(self, model: nn.Module, device: torch.device | None) -> None:
        """Replace meta-device parameters by storage-less ones on `device` (filled when bucketed)."""
        if device is None:
            return
        for module in model.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                if id(p) not in self._meta_ids:  # a tied parameter is swapped once, everywhere
                    empty = torch.empty(0, device=device).set_(torch.UntypedStorage(0, device=device), 0,
                                                                p.shape, p.stride())
                    self._meta_ids[id(p)] = nn.Parameter(empty, requires_grad=p.requires_grad)
                    self._unmaterialised.add(id(self._meta_ids[id(p)]))
                setattr(module, name, self._meta_ids[id(p)])

    @torch.no_grad()
    def _fill_initial_values(self, name: str, p: nn.Parameter, view: torch.Tensor) -> None:
        """Write `p`'s initial values into its bucket view; a meta-built one is initialised there (fp32
        values, cast like an eagerly built model's: in place when the buffer is fp32, no temporary)."""
        if id(p) not in self._unmaterialised:
            view.copy_(p.detach())
        elif view.dtype == torch.float32:
            self.param_init(name, view)
        else:
            out = torch.empty(p.shape, dtype=torch.float32, device=view.device)
            self.param_init(name, out)
            view.copy_(out)

    def _build_buckets(self, model: nn.Module, layout: Layout, twins: dict[str, ProcessGroup | None]
                       ) -> list[FlatBucket]:
        """The FlatBuckets of the policy's layout, in its (reduction) order; built units first, in forward order,
        then the root and the persistent buckets."""
        config, params = self.config, dict(model.named_parameters())
        groups = {r.name: r.group for r in layout.reductions}
        roles = {"unit": 0, "root": 1, "persistent": 2, "flat": 0}
        order = sorted(range(len(layout.buckets)),
                       key=lambda i: (roles[layout.buckets[i].role], layout.buckets[i].unit or 0))
        built: dict[int, FlatBucket] = {}
        for i in order:
            spec: BucketSpec = layout.buckets[i]
            b = FlatBucket([params[n] for n in spec.names], list(spec.names), groups[spec.reduce_group],
                           dtype=config.torch_dtype, shard=config.stage >= 1, resident=spec.resident,
                           reduce_group=spec.reduce_group, grad_group=twins[spec.reduce_group],
                           fill=self._fill_initial_values)
            b.replicas *= spec.tp_replicas  # ranks holding each element, for the global gradient norm
            self._set_codecs(b)
            if spec.tied:
                b.tie_group = self._tied[id(b.params[0])]
                b.replicas *= group_size(b.tie_group)
            # Attach at once so each original parameter tensor is released before the next
            # bucket is flattened: the build never holds two copies of the whole model.
            b.broadcast_from_first_rank()
            home = "none" if spec.resident else config.offload_params
            b.attach(home, config.nvme_path, f"rank{self._rank}-params{len(built)}-{id(b):x}")
            built[i] = b
        return [built[i] for i in range(len(layout.buckets))]

    def _set_codecs(self, b: FlatBucket) -> None:
        """The quantized collectives (zero.quantize_*) of a bucket: gathers of stage-3 parameters, reductions of
        trainable ones."""
        config = self.config
        b.quant_block = config.quantize_block
        if config.quantize_weights != "none" and not b.resident:
            b.weight_codec = config.quantize_weights
        if config.quantize_gradients != "none" and b.trainable:
            b.grad_codec = config.quantize_gradients

    def _check_param_offload_space(self, layout: Layout) -> None:
        """nvme parameter offload: refuse a too-small or unusable nvme_path before any file is written."""
        if self.config.offload_params != "nvme" or self.config.stage != 3:
            return
        elements = 0
        for p in layout.params:
            if not p.persistent:
                size = layout.reductions[p.reduction].size
                elements += -(-p.numel // size) + size  # this rank's shard, with room for padding
        itemsize = torch.empty((), dtype=self.config.torch_dtype).element_size()
        check_nvme_path(self.config.nvme_path, elements * itemsize, "parameter shards")

    def _stage3_hooks(self, model: nn.Module, layout: Layout, buckets: list[FlatBucket]) -> Stage3Hooks:
        """The hooks that gather each unit's buckets and the root's (hpZ: backward re-gathers units inside nodes)."""
        config = self.config
        if config.hpz_partition_size > 1:
            secondary = self.dims.secondary_groups({r.name: r.group for r in layout.reductions},
                                                   config.hpz_partition_size)
            for b, spec in zip(buckets, layout.buckets):
                if spec.secondary:
                    b.secondary_group = secondary[b.reduce_group]
        unit_buckets = [[b for b, spec in zip(buckets, layout.buckets) if spec.role == "unit" and spec.unit == i]
                        for i in range(layout.units)]
        root = [(b, spec) for b, spec in zip(buckets, layout.buckets) if spec.role == "root"]
        return Stage3Hooks(model, layout.unit_modules, unit_buckets, [b for b, _ in root],
                           {id(p) for b, _ in root for p in b.params}, config.prefetch_depth)

    @property
    def grads_accumulate_in_place(self) -> bool:
        """True at stages 0-1: every `.grad` is a preset view of a flat buffer and no gradient hooks run.

        A module that can add its weight gradients into an existing `.grad` in place (e.g. MoE experts,
        `moe.set_fused_grad_accumulation`) may then do so; at stages 2-3 per-parameter hooks must see
        each accumulated gradient, so it must not.
        """
        return isinstance(self.zero_optimizer.reducer, FullGradReducer)

    # ------------------------------------------------------------------ training
    def _mark_comm(self) -> None:
        # Only training passes start a step's count (an evaluation between steps is not the step's traffic).
        if self._comm_mark is None and self.module.training:
            self._comm_mark = comm.stats.snapshot()

    def before_forward(self) -> None:
        """Call before running the module other than through `engine(...)` (e.g. a pipeline schedule)."""
        self._mark_comm()
        if self.stage3 is not None:
            self.stage3.gather_root()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.before_forward()
        return self.module(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self(*args, **kwargs)

    @property
    def loss_multiplier(self) -> float:
        """What a micro-batch's loss is multiplied by before backward: fp16 loss scale / grad_accum_steps (under
        fp16 also / dp: the gradients are divided before their reduction, see ZeroOptimizer.predivide)."""
        zo = self.zero_optimizer
        return zo.loss_scale / (self.config.grad_accum_steps * zo.predivide)

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate loss / grad_accum_steps (times the fp16 loss scale) and reduce what is ready."""
        self.before_backward()
        (loss * self.loss_multiplier).backward()
        self.after_backward()

    def before_backward(self, final: bool | None = None, gather_parameters: bool = False) -> None:
        """Prepare a backward that the caller runs itself on `loss * engine.loss_multiplier` (e.g. a pipeline
        schedule); `final` says it completes the accumulation cycle (default: counted by micro-batches).
        `gather_parameters`: at stage 3 gather every parameter first, for a backward that does not pass
        through the modules' hooks (a pipeline's separate weight-gradient pass)."""
        self._mark_comm()
        if gather_parameters and self.stage3 is not None:
            self.stage3.gather_units()
        # Losses attached inside the model (e.g. MoE balancing losses) backpropagate with the same factor.
        for hook in self.loss_scale_hooks:
            hook(self.loss_multiplier)
        if final is None:
            final = self._micro_since_step + 1 >= self.config.grad_accum_steps
        self.zero_optimizer.final_micro_batch = final

    def after_backward(self, micro_batches: int = 1, more_backwards: bool = False) -> None:
        """Reduce what the backward just produced; it completed `micro_batches` micro-batches (a pipeline
        rank with several stages runs several backwards per micro-batch and counts the last).
        `more_backwards`: further backwards through forwards already run follow (a pipeline schedule),
        so ZeRO-3 keeps the parameters they need gathered."""
        self.zero_optimizer.reducer.after_backward()
        if self.stage3 is not None:
            self.stage3.after_backward(keep_gathered=more_backwards)
        self.micro_steps += micro_batches
        self._micro_since_step += micro_batches
        if self.config.release_host_memory:
            release_free_host_memory()

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
        override = self.step_override is not None and self.step_override.takes_step()
        stepped = self.step_override.step() if override else self.zero_optimizer.step()
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
        if self.config.release_host_memory:
            release_free_host_memory()
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
        out.update(self.zero_optimizer.masters.resident_bytes())  # 0 for what lives in files
        return out

    def metrics(self) -> dict[str, float]:
        """Per-rank memory and communication figures, cheap enough to log every step."""
        rss = psutil.Process().memory_info().rss
        out: dict[str, float] = {
            "rss_mb": rss / 2**20,
            "peak_rss_mb": peak_rss_bytes() / 2**20,
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
    def bucket_records(self) -> list[dict]:
        """Per flat bucket: names, shapes, offsets, ZeRO split and placements (what a checkpoint records)."""
        def placement(name: str) -> dict | None:
            p = self.placements.get(name)
            return None if p is None else p.to_json()

        return [
            {
                "names": b.names,
                "shapes": [list(s) for s in b.shapes],
                "placements": [placement(n) for n in b.names],
                "numels": b.numels,
                "padded": b.padded,
                "world": b.world,
                "rank": b.rank,
                "trainable": b.trainable,
            }
            for b in self.buckets
        ]

    def unplaced_split_params(self) -> list[str]:
        """Parameters that are probably slices (tp > 1 and not declared replicated; ep > 1 and in a declared
        reduce group, e.g. experts) but have no placement: a checkpoint with them cannot be resharded."""
        out = []
        for b in self.buckets:
            for name, p in zip(b.names, b.params):
                if name in self.placements:
                    continue
                if (self.dims.tp > 1 and id(p) not in self._tp_replicas) or (
                        self.dims.ep > 1 and b.reduce_group != DEFAULT_REDUCE_GROUP):
                    out.append(name)
        return out

    def state_dict(self, *, file_backed: bool = False, streamed: bool = False) -> dict:
        """This rank's shard of the training state (what its checkpoint file holds).

        file_backed=True lets nvme-offloaded optimizer state come as tensors mapped from its files rather
        than copies in memory (so a larger-than-memory state can be saved); they follow the files, so
        serialise them before the next step. save_checkpoint does so.

        streamed=True gives every shard and fp32 master as a zero.state.shardfile StreamedTensor read from where
        it lives (memory: the tensor itself; nvme: chunk by chunk) only while a shard file is written, in-memory
        optimizer state as the optimizer's own tensors and nvme optimizer state as file mappings whose pages the
        writer drops after each tensor: saving holds no copy of the state beyond one tensor. Valid until the next
        step."""
        if streamed:
            masters = self.zero_optimizer.masters
            index = {id(b): i for i, b in enumerate(self.zero_optimizer.trainable)}
            shards = [masters.streamed_master(index[id(b)]) if b.trainable else
                      streamed_shard(b, self.config.offload_chunk_size) for b in self.buckets]
        else:
            shards = [self._shard_values(b).detach().clone() for b in self.buckets]
        return {
            "format": "zero-sharded-v1",
            "stage": self.config.stage,
            "dtype": self.config.dtype,
            "layout": self.bucket_records(),
            "shards": shards,
            "optimizer": self.zero_optimizer.masters.state_dict(file_backed, streamed),
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "loss_scaler": self.zero_optimizer.scaler.state_dict() if self.zero_optimizer.scaler else None,
            "buffers": {n: b.detach() if streamed else b.detach().clone() for n, b in self.module.named_buffers()},
            "step_override": self.step_override.state_dict() if self.step_override is not None else None,
            "counters": {
                "micro_steps": self.micro_steps,
                "global_steps": self.global_steps,
                "skipped_steps": self.skipped_steps,
            },
        }

    @torch.no_grad()
    def state_mismatch(self, state: dict) -> str | None:
        """Why `state` (a state_dict of this rank) cannot be loaded into this engine, or None if it can."""
        if state.get("format") != "zero-sharded-v1":
            return "not a sharded engine state dict (expected format 'zero-sharded-v1')"
        if state["stage"] != self.config.stage:
            return (f"checkpoint written at ZeRO stage {state['stage']} but this engine is stage {self.config.stage}: "
                    "resume at the same stage, or go through full_state_dict()/load_full_state_dict()")
        mine = self.bucket_records()
        # (keys an older checkpoint does not record are not compared)
        if len(mine) != len(state["layout"]) or [{k: b[k] for k in b if k in t}
                                                 for b, t in zip(mine, state["layout"])] != state["layout"]:
            k = next((i for i, (a, b) in enumerate(zip(state["layout"], mine)) if a != b), min(len(mine),
                                                                                          len(state["layout"])))
            theirs = state["layout"][k] if k < len(state["layout"]) else None
            ours = mine[k] if k < len(mine) else None

            def show(b: dict | None) -> str:
                return "none" if b is None else f"{b['names'][0]}{' ...' if len(b['names']) > 1 else ''} " \
                    f"({sum(b['numels'])} elements, {b['world']}-way)"

            return (f"checkpoint bucket {k} of {len(state['layout'])} holds {show(theirs)} but this engine's bucket "
                    f"{k} of {len(mine)} holds {show(ours)}: load it with the same model, bucket sizes and parallel "
                    "layout (pipeline split and expert parallelism included), or go through "
                    "full_state_dict()/load_full_state_dict()")
        return None

    def load_state_dict(self, state: dict) -> None:
        problem = self.state_mismatch(state)
        if problem is not None:
            raise ValueError(problem)
        if self.stage3 is not None:
            self.stage3.release_all()
        self.zero_optimizer.clear_grads()
        for b, shard in zip(self.buckets, state["shards"]):
            if not b.trainable:
                b.write_shard(shard)
                done_reading(shard)  # a loaded shard's file pages leave the process one tensor at a time
                if b.resident and b.sharded and b.world > 1:
                    comm.all_gather_into_tensor(b.full, b.shard_tensor().clone(), b.group)
        self.zero_optimizer.load_masters([v for b, v in zip(self.buckets, state["shards"]) if b.trainable],
                                         done=done_reading)
        self.zero_optimizer.masters.load_state_dict(state["optimizer"])
        if self.lr_scheduler is not None and state["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if self.zero_optimizer.scaler is not None and state["loss_scaler"] is not None:
            self.zero_optimizer.scaler.load_state_dict(state["loss_scaler"])
        buffers = dict(self.module.named_buffers())
        for n, v in state["buffers"].items():
            buffers[n].copy_(v)
        for k, v in state["counters"].items():
            setattr(self, k, v)
        if self.step_override is not None:
            self.step_override.load_state_dict(state.get("step_override"))
        self._micro_since_step = 0
        self.zero_optimizer.gather_shards()

    def _shard_values(self, b: FlatBucket) -> torch.Tensor:
        """This rank's shard of `b` at full precision: the fp32 master if trainable, else the values."""
        return self.zero_optimizer.read_master(b) if b.trainable else b.read_shard()

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded model state dict (fp32 masters for trainable parameters), on CPU, on every rank.

        Collective: every rank of the engine must call it. Expert parameters are this rank's local experts.
        """
        values: dict[int, torch.Tensor] = {}
        for b in self.buckets:
            src = self._shard_values(b).detach().to(b.device)
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
        self.load_parameters(lambda name, start, stop: state[name].reshape(-1)[start:stop])
        buffers = dict(self.module.named_buffers())
        for n, v in state.items():
            if n in buffers:
                buffers[n].copy_(v)

    @torch.no_grad()
    def load_parameters(self, read: Callable[[str, int, int], torch.Tensor]) -> None:
        """Load weights piece by piece: `read(name, start, stop)` gives elements [start, stop) of this rank's
        parameter `name` (as this rank holds it: its tensor- or expert-parallel slice), flattened. Only what the rank
        keeps is asked for: its shard of a partitioned (stage-3) bucket, every element of a resident one, so a
        streaming reader never brings in more than the rank's own part of the model."""
        if self.stage3 is not None:
            self.stage3.release_all()
        optimizer = self.zero_optimizer
        for b in self.buckets:
            if b.resident:  # parameter by parameter into the full buffer and the master shard: no bucket-sized copy
                b.full.zero_()
                lo, hi = b.shard_start, b.shard_start + b.shard_size
                for n, o, k in zip(b.names, b.offsets, b.numels):
                    values = read(n, 0, k).to(b.device)
                    b.full[o : o + k].copy_(values)
                    a, z = max(o, lo), min(o + k, hi)
                    if a < z and b.trainable:
                        optimizer.masters.write_master(optimizer._index[b], values[a - o : z - o], a - lo)
                    del values
                continue
            shard = torch.zeros(b.shard_size, dtype=torch.float32)
            for i, lo, hi in b.shard_ranges():
                start = b.shard_start + lo - b.offsets[i]
                shard[lo:hi].copy_(read(b.names[i], start, start + hi - lo))
            shard = shard.to(b.device)
            if b.trainable:  # (bucket by bucket: never a second copy of all of this rank's masters)
                optimizer.masters.write_master(optimizer._index[b], shard)
            b.write_shard(shard)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str, client_state: dict | None = None, run_id: str | None = None) -> None:
        """Atomically write this rank's sharded state (plus its `client_state`) into directory `path`."""
        save_checkpoint(self, path, client_state, run_id)

    def close(self) -> None:
        """Release what the engine holds outside the process (offload files); also done at exit."""
        self.zero_optimizer.masters.close()
        for b in self.buckets:
            b.close()

    def load_checkpoint(self, path: str) -> dict | None:
        """Restore a checkpoint written by save_checkpoint under this or any other layout (resharded);
        returns this rank's client_state."""

        return load_checkpoint(self, path)


def initialize(
    model: nn.Module,
    optimizer: OptimizerFactory,
    config: ZeroConfig | None = None,
    dims: ParallelDims | None = None,
    lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    *,
    plans: Sequence[Plan] = (),
    param_init: ParamInit | None = None,
) -> Engine:
    """Wrap `model` for training: shard per `config.stage` over the groups of `dims`.

    `optimizer` is a factory (e.g. functools.partial(torch.optim.AdamW, lr=3e-4)) called with the flat
    fp32 master shards; `lr_scheduler` a factory optimizer -> scheduler, stepped after each optimizer step.
    `dims` defaults to pure data parallelism over every process.

    `plans` are what parallelism applied from outside returns (`moe.apply_expert_parallel`,
    `zero.parallel.tensor.apply_tensor_parallel`, `zero.parallel.pipeline.apply_pipeline`), in the
    order they were applied: `zero.Plan.merge` composes their placements (so checkpoints load under any
    other layout), collects the groups that reduce some parameters elsewhere (experts over the
    expert-data-parallel group), the tensor-parallel replicas (counted once in the gradient norm), the
    copies a pipeline keeps of tied parameters (gradients summed over them) and the hooks that scale
    losses attached inside the model like the main loss; once built the engine tells each plan's
    `on_initialize` callbacks what it settled (`zero.plan.RuntimeFacts`). With pipeline parallelism
    `model` is this rank's stages (`Pipeline.module`).

    A model built on the meta device (`Transformer(cfg, device="meta")`) is materialised bucket by bucket:
    `param_init(name, tensor)` fills each parameter's fp32 values in place (on the CUDA device when there
    is one, else the CPU), so no rank ever holds the whole model; at stage 3 one unit at a time. It must
    not depend on the order it is called in. It defaults to the model contract's `init_parameter`
    (`zero.contract.ModelContract`) when the model offers it.
    """
    config = config if config is not None else ZeroConfig()
    dims = dims if dims is not None else ParallelDims()
    if group_size(dims.dp_sp_group) != dims.dp_sp:
        raise RuntimeError(f"{dims} does not match the process group sizes")
    if param_init is None and isinstance(model, ModelContract) and any(p.is_meta for p in model.parameters()):
        param_init = model.init_parameter
    engine = Engine(model, optimizer, config, dims, lr_scheduler, Plan.merge(plans), param_init)
    facts = RuntimeFacts(grads_accumulate_in_place=engine.grads_accumulate_in_place,
                         splits_backward=engine.plan.splits_backward, pipelined=engine.plan.pipelined)
    for callback in engine.plan.on_initialize:
        callback(facts)
    return engine
