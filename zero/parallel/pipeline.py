"""Pipeline parallelism: `apply_pipeline` splits a model into stages over the pp ranks and runs one of
torch.distributed.pipelining's schedules, with the ZeRO engine reducing each stage's gradients.

    pipe = apply_pipeline(model, dims, schedule="1f1b", microbatches=m, loss_fn=loss_fn)
    engine = zero.initialize(pipe.module, ...)           # this rank's stages only (the rest of `model` is released)
    losses = pipe.train_step(engine, tokens, labels, position_ids=pos)   # m forwards and backwards
    engine.step()

The model implements the contract's `blocks()`, `pipeline_stage(layers, first, last)` (a module running
those blocks; the first stage embeds, the last returns the output the loss reads) and
`pipeline_shapes(tokens_shape)` (the shape of the activation sent between stages and of the last
stage's output): see `zero.contract`. The returned `Pipeline` is also the plan the engine takes. Stages are balanced by
parameter count unless `split` lists the layers of each stage. The micro-batches are the engine's
gradient-accumulation micro-batches: `tokens` holds m of them stacked along the batch dimension, in
order, and the loss of each is scaled exactly as `engine.backward` would scale it.

Schedules and their stages per rank (`virtual_stages`): gpipe and 1f1b one; interleaved_1f1b,
looped_bfs and interleaved_zb any number (default 2, placed round-robin: rank r holds stages r, r+p,
...); zbv and dualpipev exactly 2 placed in a V (rank r holds stages r and 2p-1-r).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from zero.config import int_at_least
from zero.contract import ModelContract, contract_of
from zero.dist import comm
from zero.dist.topology import LayoutError, ParallelDims
from zero.plan import Plan
from zero.sharding.stage3 import BlockDict

#: name -> (torch schedule class, stages per rank: None = any (default 2), else that exact number, V placement)
SCHEDULES: dict[str, tuple[str, int | None, bool]] = {
    "gpipe": ("ScheduleGPipe", 1, False),
    "1f1b": ("Schedule1F1B", 1, False),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", None, False),
    "looped_bfs": ("ScheduleLoopedBFS", None, False),
    "interleaved_zb": ("ScheduleInterleavedZeroBubble", None, False),
    "zbv": ("ScheduleZBVZeroBubble", 2, True),
    "dualpipev": ("ScheduleDualPipeV", 2, True),
}


def resolve_virtual_stages(schedule: str, virtual_stages: int | None) -> int:
    """Stages per rank for `schedule` (its default when None); clear errors for the rest."""
    if schedule not in SCHEDULES:
        raise LayoutError(f"parallel.pp_schedule={schedule!r} is not one of {', '.join(SCHEDULES)}")
    _, fixed, _ = SCHEDULES[schedule]
    if virtual_stages is None:
        return fixed or 2
    int_at_least("parallel.pp_virtual_stages", virtual_stages, 1, error=LayoutError)
    if fixed is not None and virtual_stages != fixed:
        raise LayoutError(f"parallel.pp_schedule={schedule} runs exactly {fixed} stage(s) per rank; "
                          f"parallel.pp_virtual_stages={virtual_stages} does not fit it (leave it unset)")
    return virtual_stages


def check_pipeline_layout(schedule: str, pp: int, virtual_stages: int | None, n_layers: int,
                          microbatches: int, split: Sequence[int] | None = None) -> int:
    """Validate a pipeline layout before any process group exists; returns the stages per rank."""
    v = resolve_virtual_stages(schedule, virtual_stages)
    stages = pp * v
    if n_layers < stages:
        raise LayoutError(f"parallel.pp={pp} x {v} stage(s) per rank = {stages} stages but the model has "
                          f"{n_layers} layers: every stage needs a layer (use pp <= {n_layers // v})")
    if split is not None:
        if len(split) != stages or any(not isinstance(k, int) or k < 1 for k in split) or sum(split) != n_layers:
            raise LayoutError(f"parallel.pp_split={list(split)} must list {stages} positive layer counts summing "
                              f"to model.n_layers={n_layers}")
    if schedule != "gpipe" and microbatches < pp:
        raise LayoutError(f"parallel.pp_schedule={schedule} needs at least pp={pp} micro-batches per step "
                          f"(train.grad_accum={microbatches}); raise train.grad_accum or use gpipe")
    if schedule == "dualpipev" and microbatches < 2 * pp:
        raise LayoutError(f"parallel.pp_schedule=dualpipev needs at least as many micro-batches as stages "
                          f"(2 x pp = {2 * pp}; train.grad_accum={microbatches}); raise train.grad_accum")
    if v > 1 and schedule in ("interleaved_1f1b", "interleaved_zb") and microbatches % pp:
        raise LayoutError(f"parallel.pp_schedule={schedule} needs the micro-batches per step "
                          f"(train.grad_accum={microbatches}) to be a multiple of pp={pp}")
    return v


def balance(costs: Sequence[int], parts: int, first_extra: int = 0, last_extra: int = 0) -> list[int]:
    """Split consecutive items with `costs` into `parts` non-empty runs minimising the largest run's
    cost (the first run also pays `first_extra`, the last `last_extra`); returns the run lengths."""
    n = len(costs)
    if parts > n:
        raise LayoutError(f"{parts} stages for {n} layers")

    def runs_within(limit: int) -> list[int] | None:
        out, i = [], 0
        for part in range(parts):
            extra = (first_extra if part == 0 else 0) + (last_extra if part == parts - 1 else 0)
            if part == parts - 1:
                return out + [n - i] if extra + sum(costs[i:]) <= limit else None
            left = parts - part - 1  # runs still to fill after this one, each needs a layer
            total, j = extra + costs[i], i + 1
            if total > limit:
                return None
            while j < n - left and total + costs[j] <= limit:  # greedy: as many layers as fit
                total += costs[j]
                j += 1
            out.append(j - i)
            i = j
        return out

    lo = max(max(costs), first_extra + costs[0], last_extra + costs[-1])
    hi = sum(costs) + first_extra + last_extra
    while lo < hi:  # binary search on the largest stage cost
        mid = (lo + hi) // 2
        if runs_within(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    return runs_within(lo)


def stage_indices(pp_rank: int, pp: int, v: int, v_shape: bool) -> list[int]:
    """The global stage indices this pp rank holds (round-robin, or a V for zbv/dualpipev)."""
    if v_shape:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(v)]



@torch.no_grad()
def release_other_stages(model: nn.Module, mine: nn.Module) -> None:
    """Leave every parameter and buffer of `model` that `mine` (this rank's stages) does not hold on the meta
    device: the same tensor objects, shapes kept, no storage, so whatever still refers to them (the model, the
    plans applied before the pipeline) keeps no other stage's weights alive. Tied tensors `mine` holds stay."""
    kept = {id(t) for t in (*mine.parameters(), *mine.buffers())}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for t in table.values():
                if t is None or t.is_meta or id(t) in kept:
                    continue
                placeholder = torch.empty_like(t, device="meta")
                if isinstance(t, nn.Parameter):
                    placeholder = type(t)(placeholder, requires_grad=t.requires_grad)
                # In place (the object keeps its identity), so the storage goes with the last reference to it.
                torch.utils.swap_tensors(t, placeholder)


class LocalStages(nn.Module, ModelContract):
    """This rank's stage modules as one module with the model's own parameter names (children of the
    stages are merged by name; ModuleDicts key by key into a BlockDict, whose blocks are ZeRO-3 units), so
    checkpoints, per-name initialisation and the engine see the same names as on one rank. As a contract
    model it offers its stages' blocks and the whole model's per-parameter init."""

    def __init__(self, stages: Sequence[nn.Module], model: ModelContract) -> None:
        super().__init__()
        self._stages = list(stages)  # plain list: the stages' modules are registered below, by name
        self._init_parameter = model.init_parameter
        for stage in stages:
            for name, child in stage.named_children():
                mine = self._modules.get(name)
                if mine is None:
                    self.add_module(name, BlockDict(dict(child.items())) if isinstance(child, nn.ModuleDict)
                                    else child)
                elif isinstance(mine, nn.ModuleDict) and isinstance(child, nn.ModuleDict):
                    for key, sub in child.items():
                        if key in mine:
                            raise ValueError(f"two pipeline stages on this rank hold {name}.{key}")
                        mine[key] = sub
                elif mine is not child:
                    raise ValueError(f"two pipeline stages on this rank hold different modules named {name!r}")

    def blocks(self) -> list[tuple[str, nn.Module]]:
        out = [block for stage in self._stages for block in contract_of(stage, "pipeline stages", "blocks").blocks()]
        order = {name: k for k, (name, _) in enumerate(self.named_modules())}
        return sorted(out, key=lambda item: order[item[0]])

    def init_parameter(self, name: str, tensor: torch.Tensor) -> None:
        self._init_parameter(name, tensor)

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipeline rank's stages run through Pipeline.train_step / eval_step, not forward")


@dataclass
class Action:
    """One computation of a stage in the last step: kind F (forward), B (full backward), I (input-gradient
    backward) or W (weight-gradient backward), times from time.perf_counter(), and the micro-batches
    whose activations the stage held right after it."""

    kind: str
    stage: int
    microbatch: int
    start: float
    end: float
    held: int


@dataclass
class StepTimeline:
    """What this rank computed in the last pipeline step, for bubble and memory measurements."""

    start: float = 0.0
    end: float = 0.0
    actions: list[Action] = field(default_factory=list)

    @property
    def busy(self) -> float:
        return sum(a.end - a.start for a in self.actions)

    @property
    def idle_fraction(self) -> float:
        """Share of this rank's own step (from its call of train_step until its part is done) in which it
        computed nothing. A stage that finishes early does not count the time until the others finish:
        compare windows over all ranks for the pipeline's bubble (benchmarks/pipeline.py does)."""
        total = self.end - self.start
        return max(0.0, 1.0 - self.busy / total) if total > 0 else 0.0

    @property
    def max_held(self) -> int:
        """Most micro-batches whose activations one stage of this rank held at once."""
        return max((a.held for a in self.actions), default=0)


@dataclass
class StageSpan:
    """The layers one pipeline stage holds, and whether it holds the embedding (first) or the head (last)."""

    index: int  # global stage index
    layers: range
    first: bool
    last: bool


class Pipeline(Plan):
    """This rank's part of a pipeline: its stage modules, the layers each holds, and the schedule (built on first
    use).
    As a `zero.Plan` it declares the tied parameters' copies and how backward runs.

    `loss_fn(output, target) -> loss` (a micro-batch's mean loss) runs on the last stage per
    micro-batch; what is backpropagated is that loss times the engine's loss multiplier, and
    `train_step` returns the mean of the micro-batches' losses (on every rank of the pipeline).
    """

    def __init__(self, model: ModelContract, dims: ParallelDims, schedule: str, virtual_stages: int,
                 spans: list[StageSpan], microbatches: int,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        # zero-bubble schedules run an input- and a weight-gradient pass over the same forward graph
        super().__init__("pipeline", pipelined=True, splits_backward=schedule in ("interleaved_zb", "zbv", "dualpipev"))
        self.dims, self.schedule_name, self.v = dims, schedule, virtual_stages
        self.spans, self.microbatches, self.loss_fn = spans, microbatches, loss_fn
        self.num_stages = dims.pp * virtual_stages
        self.stage_modules = [model.pipeline_stage(p.layers, p.first, p.last) for p in spans]
        self.module = LocalStages(self.stage_modules, model)
        self._shapes = model.pipeline_shapes
        self._schedule = None
        self._engine = None
        self._key = None
        self._grads_done, self._counted, self._stage_done = 0, 0, {}
        self._loss_values: list[torch.Tensor] = []
        self.timeline = StepTimeline()  # the last step's computations on this rank
        self.holds_last_stage = any(p.last for p in spans)
        self.holds_first_stage = any(p.first for p in spans)
        self.tied_params = self._tie(model)
        release_other_stages(model, self.module)

    def _tie(self, model: nn.Module) -> dict[nn.Parameter, dist.ProcessGroup]:
        """Parameters both the first and the last stage use (a tied embedding and head) when those stages
        sit on different ranks: each keeps a copy, and the engine sums their gradients over the group of
        the two ranks (one group per data/sequence/tensor coordinate). Collective over the world."""
        dims, last = self.dims, self.num_stages - 1
        first_rank = 0
        # V placement brings the last stage back to the first rank; round-robin puts it on rank last % pp.
        last_rank = 0 if SCHEDULES[self.schedule_name][2] else last % dims.pp
        if first_rank == last_rank or dims.pp == 1:
            return {}
        n = len(model.blocks())
        head = dict(model.pipeline_stage(range(n, n), False, True).named_parameters())
        tied = [name for name, p in model.pipeline_stage(range(0), True, False).named_parameters()
                if head.get(name) is p]
        if not tied:
            return {}
        inner = dims.dp * dims.sp * dims.tp  # ranks per pipeline stage; pp is the outermost mesh dimension
        mine = dims.group_of([[first_rank * inner + k, last_rank * inner + k] for k in range(inner)])
        if not (self.holds_first_stage or self.holds_last_stage):
            return {}
        params = dict(self.module.named_parameters())
        return {params[name]: mine for name in tied}

    # -------------------------------------------------------------- engine hooks (called by the stages)
    def _record(self, kind: str, stage: int, microbatch: int, start: float, held: int) -> None:
        self.timeline.actions.append(Action(kind, stage, microbatch, start, time.perf_counter(), held))

    def _before_grads(self, stage: int, produces_grads: bool, weight_pass: bool = False) -> None:
        # Every backward pass, the input-gradient-only one of zero-bubble schedules included, sees the
        # engine's loss multiplier in the losses attached inside the model. A stage's last gradient-
        # producing pass of the step is final for the gradients it completes.
        final = produces_grads and self._stage_done.get(stage, 0) + 1 == self.microbatches
        # A weight-gradient pass runs without the hooks that gather ZeRO-3 parameters: gather them first.
        self._engine.before_backward(final=final, gather_parameters=weight_pass)

    def _after_grads(self, stage: int) -> None:
        self._grads_done += 1
        self._stage_done[stage] = self._stage_done.get(stage, 0) + 1
        # Reduce once per micro-batch of this rank (every v gradient-producing passes) rather than after
        # every stage's pass (the reduction is linear, so passes may share it), and after each stage's
        # final pass, so everything that stage completes is reduced while the pass is marked final.
        if self._grads_done % self.v == 0 or self._stage_done[stage] == self.microbatches:
            counted, self._counted = self._counted, self._grads_done // self.v
            self._engine.after_backward(micro_batches=self._counted - counted,
                                        more_backwards=self._grads_done < self.microbatches * self.v)

    # -------------------------------------------------------------- schedule
    def _build(self, engine, tokens: torch.Tensor) -> None:
        m = self.microbatches
        if engine.config.grad_accum_steps != m:
            raise ValueError(f"the pipeline runs {m} micro-batches per step but the engine accumulates "
                             f"grad_accum_steps={engine.config.grad_accum_steps}: they are the same micro-batches, "
                             "so set ZeroConfig(grad_accum_steps=microbatches)")
        if tokens.shape[0] % m:
            raise ValueError(f"the batch of {tokens.shape[0]} rows does not split into {m} micro-batches")
        mb_shape = (tokens.shape[0] // m, *tokens.shape[1:])
        act_shape, out_shape = self._shapes(mb_shape)
        dtype = engine.config.torch_dtype
        device = engine.device
        meta = {"device": "meta"}
        from torch.distributed import pipelining as pl  # (a second or more to import: only where pp > 1)

        from zero.parallel.pipeline_stage import EngineStage

        stages = []
        for span, module in zip(self.spans, self.stage_modules):
            inp = (torch.empty(mb_shape, dtype=tokens.dtype, **meta) if span.first
                   else torch.empty(act_shape, dtype=dtype, **meta, requires_grad=True))
            # requires_grad marks what carries gradients back (the static metadata derives the grads from it)
            out = torch.empty(out_shape if span.last else act_shape, dtype=dtype, **meta, requires_grad=True)
            stages.append(EngineStage(module, span.index, self.num_stages, device, input_args=(inp,),
                                       output_args=(out,), group=self.dims.pp_group, runner=self))
        cls = getattr(pl, SCHEDULES[self.schedule_name][0])
        kwargs = {"n_microbatches": m, "loss_fn": self._loss, "scale_grads": False}
        self._schedule = cls(stages[0], **kwargs) if SCHEDULES[self.schedule_name][1] == 1 else cls(stages, **kwargs)
        self._stages = stages
        self._engine = engine
        self._key = (tuple(tokens.shape), tokens.dtype)

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        with comm.unwatched():
            loss = self.loss_fn(output, target)
        self._loss_values.append(loss.detach())
        if not torch.is_grad_enabled() or not self._training:
            return loss
        return loss * self._engine.loss_multiplier

    def _run(self, engine, tokens, target, training: bool, **kwargs) -> float:
        if self._schedule is None or self._key != (tuple(tokens.shape), tokens.dtype) or self._engine is not engine:
            self._build(engine, tokens)
        self._training = training
        self._loss_values = []
        self._grads_done, self._counted, self._stage_done = 0, 0, {}
        engine.before_forward()
        self.timeline = StepTimeline(start=time.perf_counter())
        args = (tokens,) if self.holds_first_stage else ()
        tgt = target if self.holds_last_stage else None
        # The schedule sends and receives activations by itself: its waits are watched as one collective
        # over the pipeline ranks (the stages' computations in it are not waiting).
        from zero.parallel.pipeline_stage import NO_OUTPUTS

        with comm.watched("pipeline send/recv", self.dims.pp_group):
            if training:  # (the losses come through loss_fn: the merged last-stage output is not wanted)
                self._schedule.step(*args, target=tgt, **NO_OUTPUTS, **kwargs)
            elif SCHEDULES[self.schedule_name][2]:
                # torch's V schedules (zbv, dualpipev) run their backward actions in eval() too and fail
                # ("can't steal_bwd_input if this stage doesn't have backward"): forward them in stage order
                with torch.no_grad():
                    self._eval_v(engine, tokens, target, **kwargs)
            else:
                with torch.no_grad():
                    self._schedule.eval(*args, target=tgt, **kwargs)
        for stage in self._stages:  # torch keeps each micro-batch's output (the logits) until the next step
            stage.output_chunks.clear()
        self.timeline.end = time.perf_counter()
        total = torch.zeros(1, dtype=torch.float64, device=engine.device)
        if self.holds_last_stage:
            total += torch.stack(self._loss_values).double().mean()
        # The last stage knows the loss: every pp rank gets it (one scalar all-reduce).
        comm.all_reduce(total, self.dims.pp_group)
        return float(total)

    def _eval_v(self, engine, tokens: torch.Tensor, target: torch.Tensor, **kwargs) -> None:
        """Forward-only pass of a V placement (rank r holds stages r and 2p-1-r): each micro-batch goes
        through the stages in order, an activation sent (blocking) to the rank of the next stage when that
        is another rank; the last stage's losses land in self._loss_values as the schedules' do."""
        p, me, m = self.dims.pp, self.dims.coordinate()["pp"], self.microbatches
        owner = [s if s < p else 2 * p - 1 - s for s in range(2 * p)]
        mine = {span.index: module for span, module in zip(self.spans, self.stage_modules)}
        from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

        _, kwarg_chunks = split_args_kwargs_into_chunks((), kwargs, m)
        token_chunks = tokens.tensor_split(m)
        target_chunks = target.tensor_split(m)
        act_shape, _ = self._shapes(tuple(token_chunks[0].shape))
        dtype, device = engine.config.torch_dtype, engine.device
        ranks = dist.get_process_group_ranks(self.dims.pp_group)
        for j in range(m):
            x = token_chunks[j]
            for s in range(2 * p):
                if owner[s] != me:
                    continue
                if s > 0 and owner[s - 1] != me:  # (adjacent stages on this rank pass x directly)
                    x = torch.empty(act_shape, dtype=dtype, device=device)
                    comm.recv(x, ranks[owner[s - 1]], self.dims.pp_group)
                with comm.unwatched():
                    x = mine[s](x, **kwarg_chunks[j])
                if s == 2 * p - 1:
                    with comm.unwatched():
                        self._loss_values.append(self.loss_fn(x, target_chunks[j]).detach())
                elif owner[s + 1] != me:
                    comm.send(x.to(dtype).contiguous(), ranks[owner[s + 1]], self.dims.pp_group)

    def train_step(self, engine, tokens: torch.Tensor, target: torch.Tensor, **kwargs) -> float:
        """Forward and backward of the m micro-batches stacked in `tokens` (every rank passes its data
        shard; keyword tensors such as position_ids are split alike and reach every stage). Gradients
        are reduced by `engine`; call engine.step() after. Returns the mean micro-batch loss."""
        return self._run(engine, tokens, target, True, **kwargs)

    def eval_step(self, engine, tokens: torch.Tensor, target: torch.Tensor, **kwargs) -> float:
        """Forward only (no gradients); returns the mean micro-batch loss."""
        return self._run(engine, tokens, target, False, **kwargs)


def apply_pipeline(model: nn.Module, dims: ParallelDims, schedule: str = "1f1b", *,
                   microbatches: int,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   virtual_stages: int | None = None, split: Sequence[int] | None = None) -> Pipeline:
    """This rank's pipeline stages of `model` over `dims.pp` ranks (see the module doc).

    `model` implements the contract's `blocks()` (what is split), `pipeline_stage(layers, first, last)` and
    `pipeline_shapes(tokens_shape)`. The result is the plan to pass to zero.initialize (with
    `pipe.module`, this rank's stages): a parameter used by both the first and the last stage (tied
    embeddings) has a copy on each, with gradients summed. `split` lists the number of layers per stage
    (all pp x virtual stages, in order); by default stages are balanced by parameter count, the embedding counted on
    the first stage and the final norm and head on the last.

    Each rank keeps only its stages' weights: the parameters and buffers of `model` its stages do not hold are left
    on the meta device (`release_other_stages`), so `model` itself no longer runs. A model built on the meta device
    stays there, for zero.initialize to materialise this rank's stages alone.
    """
    for part in ("blocks", "pipeline_stage", "pipeline_shapes"):
        contract_of(model, "apply_pipeline", part)
    blocks = [block for _, block in model.blocks()]
    n_layers = len(blocks)
    v = check_pipeline_layout(schedule, dims.pp, virtual_stages, n_layers, microbatches, split)
    stages = dims.pp * v
    if split is None:
        costs = [sum(p.numel() for p in block.parameters()) for block in blocks]

        def own(first: bool, last: bool) -> int:
            stage = model.pipeline_stage(range(0), first, last)
            return sum(p.numel() for p in stage.parameters())

        split = balance(costs, stages, own(True, False), own(False, True) if stages > 1 else 0)
    starts = [sum(split[:k]) for k in range(stages)]
    pp_rank = dims.coordinate()["pp"] if dims.distributed else 0
    spans = [StageSpan(i, range(starts[i], starts[i] + split[i]), i == 0, i == stages - 1)
             for i in stage_indices(pp_rank, dims.pp, v, SCHEDULES[schedule][2])]
    if not dist.is_initialized() and dims.pp > 1:
        raise LayoutError("pipeline parallelism needs torch.distributed (launch with torchrun)")
    return Pipeline(model, dims, schedule, v, spans, microbatches, loss_fn)
