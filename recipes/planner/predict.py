"""Per-rank predictions of a layout: memory by category, communication per collective kind and group, step time.

`estimate(cfg, cluster, world)` is the function API (recipes.plan prints it): it builds one rank per pipeline
coordinate (`recipes.planner.build`), lays out its buckets as the engine does, traces one micro-batch's
collectives on the meta device (`recipes.planner.trace`) and adds the engine's own collectives per step.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field

import torch
from omegaconf import DictConfig

from recipes.planner.build import (
    ITEMSIZE,
    BucketSpec,
    Layout,
    RankModel,
    bucket_specs,
    fake_world,
    gradient_passes,
    rank_model,
    zero_config,
)
from recipes.planner.cluster import Cluster
from recipes.planner.host import host_phases
from recipes.planner.stage3 import (
    Window,
    after_first_reduction,
    backward_gather,
    backward_windows,
    forward_windows,
    gathered_again,
    largest_read,
    root_window,
)
from recipes.planner.trace import Trace, trace_micro_batch
from zero.dist import quantized

ADAM_STATES = 2  # exp_avg and exp_avg_sq, fp32, per master element


@dataclass
class Collective:
    kind: str
    group: str
    ranks: int
    bytes: int = 0
    calls: int = 0


@dataclass
class RankEstimate:
    """What one rank holds, sends and spends in one optimizer step."""

    rank: int
    memory: dict[str, int]
    host_memory: dict[str, int]
    nvme_bytes: int
    collectives: list[Collective]
    comm_bytes_per_step: int  # what the engine counts into metrics.jsonl's comm_bytes
    comm_bytes_by_kind: dict[str, int]
    time_s: dict[str, float]
    params: int  # parameters this rank holds (unsharded by ZeRO)
    buckets: int
    host_events: dict[str, float] = field(default_factory=dict)  # what the host overheads multiply
    peak_phase: str = ""  # the moment of the step where `memory` is counted (its device peak)
    peak_total_bytes: int = 0  # the largest device + host total of any moment (where they are one memory)
    # host bytes by category of each phase ("build", "load" with train.init_from, "step"): recipes.planner.host
    host_phases: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def host_peak_phase(self) -> str:
        return max(self.host_phases, key=lambda k: sum(self.host_phases[k].values()), default="")

    @property
    def host_peak_bytes(self) -> int:
        """The rank's largest host memory of build, load and first step (less the process's own
        `Cluster.host_process_mb`)."""
        return max((sum(v.values()) for v in self.host_phases.values()), default=0)

    @property
    def peak_device_bytes(self) -> int:
        return sum(self.memory.values())

    @property
    def step_time_s(self) -> float:
        return self.time_s["step"]

    def to_json(self) -> dict:
        out = asdict(self)
        out["peak_device_bytes"] = self.peak_device_bytes
        out["step_time_s"] = self.step_time_s
        out["host_peak_bytes"] = self.host_peak_bytes
        out["host_peak_phase"] = self.host_peak_phase
        return out


@dataclass
class _Counter:
    entries: dict = field(default_factory=dict)

    def add(self, kind: str, group: str, ranks: int, nbytes: float, calls: int = 1) -> None:
        """`calls` collectives of `nbytes` each (zero.dist.comm truncates each call's count to an int)."""
        if ranks <= 1 or calls <= 0:
            return
        c = self.entries.setdefault((kind, group), Collective(kind, group, ranks))
        c.bytes += int(nbytes) * calls
        c.calls += calls

    def ring_all_reduce(self, group: str, ranks: int, nbytes: int, calls: int = 1) -> None:
        self.add("all_reduce", group, ranks, 2 * (ranks - 1) / ranks * nbytes, calls)


def backward_passes(cfg: DictConfig, rm: RankModel) -> int:
    """How often the engine's after_backward runs per step: once per micro-batch; a pipeline rank with several
    stages reduces every `stages` gradient passes and after each stage's last one (zero.parallel.pipeline),
    counted along the schedule's own action list."""
    m = cfg.train.grad_accum
    order = gradient_passes(rm, cfg)
    if order is None:
        return m
    calls, done = 0, defaultdict(int)
    for k, stage in enumerate(order, start=1):
        done[stage] += 1
        calls += k % rm.stages == 0 or done[stage] == m
    return calls


def _encoded(b: BucketSpec, codec: str, block: int) -> int:
    """One rank's chunk of `b` as zero.dist.quantized sends it."""
    return quantized.payload_bytes(quantized.padded_length(b.shard, block), codec, block)


def _stage3_gathers(out: _Counter, layout: Layout, cfg: DictConfig, rm: RankModel, isz: int) -> None:
    """ZeRO-3's parameter all-gathers: each unit in forward and again in backward (inside the node from hpZ's
    copies when it keeps them; not at all for a unit backward does not gather, an embedding), the root once per
    step (per micro-batch without a pipeline)."""
    z, m = cfg.zero, cfg.train.grad_accum
    again = gathered_again(layout)
    for b in layout.buckets:
        one = (b.group - 1) * (_encoded(b, z.quantize_weights, z.quantize_block) if z.quantize_weights != "none"
                               else b.shard * isz)
        if b.role == "unit" and not again[b.unit]:
            out.add("all_gather", f"{b.reduce_group} parameters", b.group, one, m)
        elif b.role == "unit" and b.secondary:
            out.add("all_gather", f"{b.reduce_group} parameters", b.group, one, m)
            s = b.secondary
            out.add("all_gather", f"{b.reduce_group} parameters (node)", s, (s - 1) * (b.padded // s) * isz, m)
        elif b.role == "unit":
            out.add("all_gather", f"{b.reduce_group} parameters", b.group, one, 2 * m)
        elif b.role == "root":
            out.add("all_gather", f"{b.reduce_group} parameters", b.group, one, 1 if rm.dims.pp > 1 else m)


def engine_collectives(out: _Counter, layout: Layout, cfg: DictConfig, rm: RankModel, isz: int) -> None:
    """The engine's own collectives in one step: gradient reductions, ZeRO-3 gathers, the step's gathers."""
    stage, passes = cfg.zero.stage, backward_passes(cfg, rm)
    z = cfg.zero
    trainable = [b for b in layout.buckets if b.trainable]
    for b in trainable:
        group = f"{b.reduce_group} reduction"
        if stage == 0:
            out.ring_all_reduce(group, b.group, b.padded * isz)
        elif b.world > 1 and z.quantize_gradients != "none":  # one all-to-all of the encoded chunks
            out.add("all_to_all", group, b.group, (b.group - 1) * _encoded(b, z.quantize_gradients, z.quantize_block),
                    1 if stage == 1 else passes)
        elif b.world > 1:
            out.add("reduce_scatter", group, b.group, (b.group - 1) / b.group * b.padded * isz,
                    1 if stage == 1 else passes)
        if b.resident and stage >= 1 and b.world > 1:
            out.add("all_gather", f"{b.reduce_group} parameters", b.group, (b.group - 1) * b.shard * isz)
        if b.tie_group > 1:
            out.ring_all_reduce("tied copies", b.tie_group, b.shard * 4)
    if stage >= 2:
        chains: dict[str, list[BucketSpec]] = defaultdict(list)
        for b in trainable:
            chains[b.reduce_group].append(b)
        for name, chain in chains.items():
            out.ring_all_reduce(f"{name} reduction", chain[0].group, 4 * len(chain), passes)
    if stage == 3:
        _stage3_gathers(out, layout, cfg, rm, isz)
    dims = rm.dims
    norm = dims.dp_sp if dims.tp == 1 and dims.pp == 1 else dims.world_size
    out.ring_all_reduce("gradient norm", norm, 8)
    if dims.pp > 1:
        out.ring_all_reduce("pipeline loss", dims.pp, 8)


def model_collectives(out: _Counter, trace: Trace, cfg: DictConfig, rm: RankModel,
                      a2a_rows: float | None) -> None:
    """The model's collectives (one micro-batch traced, times the micro-batches); the expert all-to-alls
    from `a2a_rows` (rows sent per step, e.g. measured) or else at uniform routing."""
    dims, m = rm.dims, cfg.train.grad_accum
    groups = {"all_to_all": ("sp" if dims.sp > 1 else "ep", dims.sp if dims.sp > 1 else dims.ep),
              "reduce_scatter": ("tp", dims.tp), "all_gather": ("tp" if dims.tp > 1 else "sp", max(dims.tp, dims.sp)),
              "all_reduce": ("tp/sp", max(dims.tp, dims.sp)), "p2p": ("cp ring", dims.cp)}
    for kind, nbytes in trace.bytes.items():
        name, ranks = groups.get(kind, (kind, 2))
        c = out.entries.setdefault((kind, f"model {name}"), Collective(kind, f"model {name}", ranks))
        c.bytes += nbytes * m
        c.calls += trace.calls[kind] * m
    if trace.a2a_calls:
        rows = a2a_rows if a2a_rows is not None else trace.a2a_rows * m
        c = out.entries.setdefault(("all_to_all", "model ep"), Collective("all_to_all", "model ep", dims.ep))
        c.bytes += int(round(rows)) * trace.a2a_row_bytes
        c.calls += trace.a2a_calls * m


def _grad_shard_bytes(b: BucketSpec, stage: int, isz: int) -> int:
    """The reduced fp32 gradient a trainable bucket holds for the step (`grad_acc`) beyond its flat gradient:
    stages 2-3 their shard (reduced in backward); stage 1 the reduce-scatter's output, or an fp32 copy of the
    whole flat buffer where it is not sharded; stage 0 an fp32 copy only when the flat buffer is not fp32."""
    if stage >= 2:
        return b.shard * 4
    if stage == 1 and b.world > 1:
        return b.shard * 4
    return b.padded * 4 if isz != 4 else 0


def state_memory(layout: Layout, cfg: DictConfig, isz: int) -> tuple[dict[str, int], dict[str, int], int]:
    """(device, host, nvme) bytes of what a rank keeps from step to step: parameters, flat padding, the full
    flat gradients of stages 0-1, masters, optimizer state, the host gradient copies of cpu offload and the
    chunk buffers of nvme offload. The nvme bytes are the sizes of the rank's files: a stage-3 parameter shard
    per partitioned bucket, and per trainable bucket the optimizer file's fields (master, the moments and, at
    stages 2-3, the spilled gradient)."""
    z = cfg.zero
    dev, host = defaultdict(int), defaultdict(int)
    nvme = 0
    for b in layout.buckets:
        if b.resident:
            dev["parameters"] += b.numel * isz
            dev["flat_padding"] += (b.padded - b.numel) * isz
        elif z.offload_params == "cpu":
            host["parameters"] += b.shard * isz
        elif z.offload_params == "nvme":
            nvme += b.shard * isz
        else:
            dev["parameters"] += b.shard * isz
        if not b.trainable:
            continue
        if z.stage <= 1:  # backward accumulates into the full flat gradient (kept between steps)
            dev["gradients"] += b.padded * isz
        master = b.shard * 4 if (isz != 4 or z.offload_optimizer != "none") else 0
        states = ADAM_STATES * b.shard * 4
        if z.offload_optimizer == "none":
            dev["master_weights"] += master
            dev["optimizer_state"] += states
        elif z.offload_optimizer == "cpu":
            host["master_weights"] += master
            host["optimizer_state"] += states
            host["gradients"] += b.shard * 4  # the step's fp32 gradient copies on the host
        else:  # (stages 2-3 also spill each reduced gradient shard into the file: a field of its own)
            nvme += master + states + (b.shard * 4 if z.stage >= 2 else 0)
    if z.offload_optimizer == "nvme":
        # a ring of chunk buffers (master, the states, the gradient) the step streams the files through: slot k
        # serves chunks k, k + count, ..., and becomes resident as far as the largest of them reaches
        shards = [b.shard for b in layout.buckets if b.trainable]
        chunk = min(z.offload_chunk_size, max(shards, default=1))
        jobs = [min(chunk, n - s) for n in shards for s in range(0, n, chunk)]
        slots = [max(jobs[k::z.offload_buffer_count]) for k in range(min(z.offload_buffer_count, len(jobs)))]
        host["offload_buffers"] = sum(slots) * 4 * (2 + ADAM_STATES)
    return dict(dev), dict(host), nvme


def step_buffers(layout: Layout, cfg: DictConfig, isz: int) -> dict[str, int]:
    """What a step allocates and frees on the device, each at its largest: the reduced gradients held from
    backward to the step, the staging buffers of stages 2-3 during backward, the gathered ZeRO-3 units."""
    z = cfg.zero
    trainable = [b for b in layout.buckets if b.trainable]
    out = {"reduced_gradients": 0 if (z.offload_optimizer == "nvme" and z.stage >= 2) else
           sum(_grad_shard_bytes(b, z.stage, isz) for b in trainable)}
    if z.stage >= 2:
        # a bucket's full-size buffer while it is filled and one while its reduction is in flight; unsharded
        # (one rank) the staging buffer becomes the reduced gradient itself unless it has to be cast to fp32
        sizes = sorted((b.padded * isz for b in trainable if b.world > 1 or isz != 4), reverse=True)
        out["gradient_staging"] = sum(sizes[:2]) if any(b.world > 1 for b in trainable) else sum(sizes[:1])
    if z.stage == 3 and any(b.secondary for b in layout.buckets):  # every unit's copy, forward to end of backward
        out["hpz_secondary"] = sum(b.padded // b.secondary * isz for b in layout.buckets if b.secondary)
    return out


def gradient_write_temporaries(b: BucketSpec, cfg: DictConfig) -> int:
    """Bytes a background write of a reduced gradient shard into its nvme file holds (stages 2-3 with
    offload_optimizer=nvme: `NvmeMasters._accumulate`, one chunk at a time): the final micro-batch's sum of squares
    takes the chunk's float64 copy and its square (16 bytes per element); a later micro-batch also reads the
    file's chunk back into a buffer of its own (4)."""
    z = cfg.zero
    chunk = min(z.offload_chunk_size, b.shard)
    return chunk * (16 + (4 if cfg.train.grad_accum > 1 else 0))


def in_flight_micro_batches(cfg: DictConfig, rm: RankModel) -> float:
    """Micro-batches whose activations a rank holds at its peak, per the pipeline schedule, in units of one
    micro-batch through all of this rank's stages."""
    p, m, v, pp_rank = rm.dims.pp, cfg.train.grad_accum, rm.stages, rm.dims.coordinate()["pp"]
    if p == 1:
        return 1
    schedule = cfg.parallel.pp_schedule
    if schedule in ("gpipe", "looped_bfs"):  # every forward before any backward
        return m
    if schedule in ("zbv", "dualpipev"):
        return min(m, 2 * p) * 1.0
    if v == 1:  # 1F1B: the warm-up forwards of the stages after this one, and the one of the steady state
        return min(m, p - pp_rank)
    # interleaved 1F1B: torch's warm-up of (v - 1) p + 2 (p - 1 - rank) chunks, and one more, of one stage each
    return min(m * v, (v - 1) * p + 2 * (p - 1 - pp_rank) + 1) / v


def _moe_layers(rm: RankModel) -> set[int]:
    from moe import MoELayer

    return {i for i in rm.stage_layers if any(isinstance(m, MoELayer) for m in rm.model.layers[i].modules())}


def _moe_saved(mc, tokens: int, slots: float, a2a: bool, isz: int) -> float:
    """What an MoE layer saves for backward beyond attention: the router's fp32 logits and probabilities and its
    experts' pre-activation per routed slot; through the all-to-all (ep > 1) the experts run unfused and also keep
    the rows they received (input, pre-activation, both halves' activations) and the combine's rows of this rank's
    own tokens; shared experts are a dense MLP."""
    width = mc.moe.ffn_dim or mc.ffn_dim
    gated = 2 if mc.moe.activation == "swiglu" else 1
    out = tokens * mc.moe.num_experts * 8
    if a2a:
        out += slots * (mc.dim + 2 * gated * width) * isz + tokens * mc.moe.top_k * mc.dim * isz
    else:
        out += slots * gated * width * isz
    return out + tokens * 4 * width * mc.moe.num_shared_experts * isz


def _saved_per_layer(cfg: DictConfig, rm: RankModel, isz: int, imbalance: float) -> tuple[int, list[int], float]:
    """(tokens per micro-batch on this rank, bytes each of its layers saves for backward without checkpointing,
    routed expert slots)."""
    mc, t, d = cfg.model, cfg.train, rm.dims
    tokens = t.micro_batch_size * -(-t.seq_len // (d.sp * d.cp))
    head_dim = mc.dim // mc.n_heads
    kv = mc.n_kv_heads * head_dim
    ffn = mc.ffn_dim // d.tp
    # saved per token: the two norms' outputs (gathered to the whole sequence under tp), q, attention output and
    # its projection (3 x dim / tp), k and v; a dense MLP's two inputs, SiLU and product (4 x ffn / tp); under
    # Ulysses also q, k, v and the output on the other side of the all-to-alls
    attention = tokens * (2 * mc.dim + (4 * mc.dim + 2 * kv) // d.tp) * isz
    if d.sp > 1:
        attention += tokens * (2 * mc.dim + 2 * kv) // d.tp * isz
    # a tiled MLP (train.tiled_mlp) keeps only its input and recomputes tile by tile in backward
    tiles = t.tiled_mlp or 0
    dense_layer = attention + (0 if tiles else tokens * 4 * ffn * isz)
    moe = _moe_layers(rm)
    slots = tokens * mc.moe.top_k * imbalance if moe else 0
    a2a = d.ep > 1
    moe_layer = attention + (_moe_saved(mc, tokens, slots, a2a, isz) if moe else 0)
    return tokens, [moe_layer if i in moe else dense_layer for i in rm.stage_layers], slots


def activation_memory(cfg: DictConfig, rm: RankModel, isz: int, imbalance: float) -> dict[str, int]:
    """Per micro-batch in flight, what backward needs: `activations` (saved per layer: norms, q/k/v, attention
    output, MLP hidden, or the MoE layer's router and expert hidden; only the block inputs under
    checkpointing), `recompute` (one block recomputed with its gradients, under checkpointing), `logits` (the
    logits, their fp32 log-softmax and its gradient, at the loss) and `moe_dispatch` (the all-to-all
    dispatcher's rows of one MoE layer, at `imbalance`)."""
    mc, t, d = cfg.model, cfg.train, rm.dims
    tokens, per_layer, slots = _saved_per_layer(cfg, rm, isz, imbalance)
    moe, a2a, ffn = _moe_layers(rm), d.ep > 1, mc.ffn_dim // d.tp
    tiles = t.tiled_mlp or 0
    held = in_flight_micro_batches(cfg, rm)
    out = {"recompute": 0}
    if t.activation_checkpointing:  # the blocks' inputs; in backward one block recomputed with its gradients
        out["activations"] = int(tokens * mc.dim // d.tp * isz * len(per_layer) * held)
        out["recompute"] = int(2 * max(per_layer, default=0))
    else:
        out["activations"] = int(sum(per_layer) * held)
    if tiles and len(moe) < len(per_layer):
        # backward of a tiled MLP: one tile's hidden recomputed with its gradients, and the MLP's weight
        # gradients summed over tiles in buffers of their own
        out["recompute"] += int(2 * -(-tokens // tiles) * 4 * ffn * isz + 3 * mc.dim * ffn * isz)
    rows = tokens * d.sp if d.sp == 1 else tokens
    vocab = mc.vocab_size // d.tp
    if rm.last:  # the final norm's input and output, for the head
        out["activations"] += int(2 * tokens * mc.dim // d.tp * isz * held)
    if rm.last and not t.tiled_loss:
        # the logits (compute dtype), their fp32 copy below fp32, the fp32 log-softmax kept for backward and
        # its fp32 gradient
        out["logits"] = int(rows * vocab * (isz + 8 + (4 if isz != 4 else 0)))
    if rm.last and d.pp > 1:
        # the schedule keeps the last stage's output (the logits) of each micro-batch whose backward has not run
        # (torch's forward cache): all of them where every forward comes first (gpipe, looped BFS), else the one
        # beside the loss's working set (the last stage runs each backward right after its forward)
        outputs = t.grad_accum if cfg.parallel.pp_schedule in ("gpipe", "looped_bfs") else 1
        if d.tp > 1 and not t.tiled_loss:
            # the current micro-batch's output is the logits the working set above already counts: kept alive by
            # the cache, it costs nothing more under the vocabulary-parallel loss, whose backward works in place
            # on its saved probabilities (F.cross_entropy's backward, at tp=1, allocates the log-softmax
            # gradient and the input gradient beside them: the one more logits-sized buffer counted there)
            outputs -= 1
        out["pipeline_outputs"] = int(outputs * rows * vocab * isz)
    if rm.last and t.tiled_loss:
        # tiled: one tile's logits in fp32 (a cast copy below fp32) and logsumexp's temporary of its size, the
        # head's fp32 weight gradient and the hidden states' gradient, computed in forward
        tile = min(rows, max(1, 16 * 2**20 // mc.vocab_size))
        out["logits"] = int(tile * vocab * (8 + (isz if isz != 4 else 0)) + vocab * mc.dim * 4 + rows * mc.dim * isz)
    if moe and a2a:  # the dispatch's permuted and received rows, alive around each exchange
        out["moe_dispatch"] = int(2 * slots * mc.dim * isz)
    return out


def collective_temporaries(layout: Layout, cfg: DictConfig, isz: int) -> dict[str, int]:
    """Per moment of the step, the largest buffer a collective backend that copies whole buffers (gloo on CPU:
    its reduce-scatter and all-gather into a flat tensor allocate a temporary of the whole input / output) holds
    beside the engine's: a stage-3 unit's gather in forward and its re-gather in backward; at the end of backward
    the last reductions' (stages 2-3: a bucket's reduce-scatter runs once it is full, after the activations of
    its layers are gone); at the step stage 1's reduce-scatter of the flat gradients and stages 1-2's all-gather
    of the updated parameters."""
    z = cfg.zero
    shared = [b for b in layout.buckets if b.world > 1]
    if z.stage == 0 or not shared:
        return {}
    reduced = max((b.padded * isz for b in shared if b.trainable), default=0)
    if z.stage == 3:
        unit = max((b.padded * isz for b in shared if b.role == "unit"), default=0)
        return {"loss": unit, "backward": unit, "end of backward": reduced}
    resident = max((b.padded * isz for b in shared if b.resident), default=0)
    out = {"step": max(resident, reduced if z.stage == 1 else 0)}
    if z.stage == 2:
        out["end of backward"] = reduced
    return out


# what backward holds from its start to its end (the moments within it take these from "backward")
_HELD = ("activations", "moe_dispatch", "pipeline_outputs", "hpz_secondary", "gradients")


def _gathered(window: Window, roots: Window) -> dict[str, int]:
    return {"zero3_gathered": window.gathered + roots.gathered, "nvme_parameter_reads": window.reads + roots.reads}


def _stage3_moments(phases: dict, layout: Layout, cfg: DictConfig, isz: int, copies: bool) -> None:
    """Stage 3's gathered parameters in the step's moments (recipes.planner.stage3), each with its nvme read
    buffers: at the loss the largest forward window (an upper bound of the forward's), in backward the largest
    backward window with its prefetches' gathers in flight, or (a moment of its own) the largest unit backward
    gathers with nothing prefetched yet, its own gather in flight; at the end of backward the roots."""
    roots = root_window(layout, cfg, isz)
    fwd = max(forward_windows(layout, cfg, isz, copies), key=lambda w: w.total, default=Window())
    bwd = max(backward_windows(layout, cfg, isz, copies).values(), key=lambda w: w.total, default=Window())
    alone = backward_gather(layout, cfg, isz, copies)
    phases["loss"].update(_gathered(fwd, roots))
    phases["backward"].update({**_gathered(bwd, roots), "collective_buffers": bwd.in_flight})
    phases["backward gather"] = {**{k: phases["backward"].get(k, 0) for k in _HELD},
                                 **_gathered(alone, roots), "collective_buffers": alone.in_flight}
    phases["end of backward"].update(_gathered(Window(), roots))


def _nvme_gradient_writes(phases: dict, layout: Layout, cfg: DictConfig, isz: int, copies: bool) -> None:
    """Stages 2-3 with offload_optimizer=nvme: each reduced shard goes to its file in the background (up to
    offload_buffer_count queued, at their most at the end of backward), and the write holds its temporaries
    (`gradient_write_temporaries`) once its reduction has returned: at the end of backward beside the queue in
    place of the last reduction's collective temporary, and (a moment of its own) after backward's first reduction,
    while the next units' backward runs beside the first bucket's staging buffer, kept for reuse."""
    z = cfg.zero
    trainable = [b for b in layout.buckets if b.trainable]
    if z.offload_optimizer != "nvme" or z.stage < 2 or not trainable:
        return
    shards = sorted((b.shard * 4 for b in trainable), reverse=True)
    end = phases["end of backward"]
    end["nvme_gradient_queue"] = sum(shards[:z.offload_buffer_count])
    last = [gradient_write_temporaries(b, cfg) for b in trainable[-z.offload_io_threads:]]
    end["nvme_gradient_writes"] = max(0, max(last) - end.get("collective_buffers", 0))
    first = trainable[0]
    after = {k: phases["backward"].get(k, 0) for k in _HELD}
    if z.stage == 3:
        after.update({**_gathered(after_first_reduction(layout, cfg, isz, copies), root_window(layout, cfg, isz)),
                      "collective_buffers": after_first_reduction(layout, cfg, isz, copies).in_flight})
    kept = first.padded * isz if first.world > 1 else 0  # (unsharded, the staging buffer is the reduced shard)
    phases["first gradient write"] = {**after, "gradient_staging": kept, "nvme_gradient_queue": first.shard * 4,
                                      "nvme_gradient_writes": gradient_write_temporaries(first, cfg)}


def memory_phases(layout: Layout, cfg: DictConfig, rm: RankModel, isz: int, imbalance: float, runtime: int = 0,
                  copies: bool = False, unified: bool = True
                  ) -> tuple[dict[str, tuple[dict[str, int], dict[str, int]]], int]:
    """(device, host) bytes by category at each moment of a step where the peak can fall, and the nvme bytes.

    - "loss": the end of a forward, all its saved activations and the logits' working set alive; the reduced
      gradients of earlier micro-batches too (stages 2-3, or any stage within a pipeline's schedule);
    - "backward": backward under way: the activations still mostly alive, the first buckets' staging, the
      recomputed block (checkpointing), the gathered units of stage 3, the largest weight's own gradient;
    - "end of backward": every reduced gradient (nvme offload: the shards queued for their files), the staging of
      the last buckets, the gathered roots of stage 3;
    - "step": the optimizer step over the reduced gradients;
    - stage 3's "backward gather" and nvme offload's "first gradient write" (`_stage3_moments`,
      `_nvme_gradient_writes`).
    What persists (parameters, masters, optimizer state, flat gradients, and `runtime` bytes: the cluster's memory
    of the runtime beyond tensors) is in every moment; with `copies` (the cluster's `collective_copies`) the
    backend's temporaries of `collective_temporaries` too. Not `unified` (a GPU), a stage-3 gather's nvme read
    buffer is on the host only until its shard is copied to the device: one at a time."""
    z = cfg.zero
    dev, host, nvme = state_memory(layout, cfg, isz)
    if runtime:
        dev["runtime"] = runtime
    buf = step_buffers(layout, cfg, isz)
    acts = activation_memory(cfg, rm, isz, imbalance)
    earlier = cfg.train.grad_accum > 1 and (z.stage >= 2 or rm.dims.pp > 1)
    reduced = buf["reduced_gradients"]
    saved = {"activations": acts["activations"], "moe_dispatch": acts.get("moe_dispatch", 0),
             "pipeline_outputs": acts.get("pipeline_outputs", 0), "hpz_secondary": buf.get("hpz_secondary", 0)}
    staging = buf.get("gradient_staging", 0)
    # the first bucket's staging buffer in backward (none where the bucket's one parameter's gradient is it)
    first = max((b.padded * isz for b in layout.buckets[:1] if b.trainable and (b.world > 1 or isz != 4)
                 and not (len(b.numels) == 1 and b.padded == b.numel)), default=0) if z.stage >= 2 else 0
    # autograd makes each weight's gradient in a tensor of its own before it is added to the flat gradient (or
    # copied to the staging buffer): the largest of them is alive in backward
    weight_grad = max((n * isz for b in layout.buckets if b.trainable for n in b.numels), default=0)
    phases = {
        "loss": {**saved, "logits": acts.get("logits", 0), "gradients": reduced if earlier and z.stage >= 2 else 0},
        "backward": {**saved, "recompute": acts.get("recompute", 0), "gradient_staging": first if staging else 0,
                     "weight_gradient": weight_grad, "gradients": reduced if earlier and z.stage >= 2 else 0},
        # (hpZ's copies are dropped after the last reduction: an upper bound)
        "end of backward": {"gradients": reduced if z.stage >= 2 else 0, "gradient_staging": staging,
                            "hpz_secondary": saved["hpz_secondary"]},
        "step": {"gradients": reduced},
    }
    for name, n in (collective_temporaries(layout, cfg, isz) if copies else {}).items():
        phases[name]["collective_buffers"] = n
        if name == "end of backward" and staging:  # (a synchronous reduction: one bucket's staging at a time)
            phases[name]["gradient_staging"] = max((b.padded * isz for b in layout.buckets if b.trainable), default=0)
    if z.stage == 3:
        _stage3_moments(phases, layout, cfg, isz, copies)
    _nvme_gradient_writes(phases, layout, cfg, isz, copies)
    return _moments(phases, dev, host, 0 if unified else largest_read(layout, cfg, isz)), nvme


def _moments(phases: dict, dev: dict, host: dict, read_buffer: int) -> dict[str, tuple[dict[str, int], dict[str, int]]]:
    """Each moment's (device, host) bytes: what persists plus the moment's own; `read_buffer`: a stage-3 gather's
    host read buffer beside a device, in the moments where gathers run."""
    out = {}
    for name, extra in phases.items():
        d = dict(dev)
        for k, v in extra.items():
            if v:
                d[k] = d.get(k, 0) + v
        h = dict(host)
        if read_buffer and name not in ("end of backward", "step"):  # (the moments where gathers run)
            h["nvme_read_buffer"] = read_buffer
        out[name] = (d, h)
    return out


def gemm_cache_memory(trace: Trace, cluster: Cluster) -> int:
    """Bytes the CPU math library's per-shape GEMM caches hold from the first step on (`Cluster.gemm_cache_entry_kb`
    per entry): each cache keeps one entry per distinct bf16 / fp16 GEMM of the step up to its capacity, and a
    full set where expert GEMMs take a new shape with every routing (`Trace.expert_shapes`)."""
    if not cluster.gemm_cache_entry_kb:
        return 0
    from moe.experts import onednn_cache_capacities

    capacities = onednn_cache_capacities()
    half = (torch.bfloat16, torch.float16)
    distinct = len({key for key in trace.gemms if any(operand[2] in half for operand in key[1:])})
    if trace.expert_shapes:
        distinct = max(capacities)
    return int(sum(min(distinct, capacity) for capacity in capacities) * cluster.gemm_cache_entry_kb * 1024)


def flops_per_micro_batch(cfg: DictConfig, rm: RankModel) -> float:
    """Forward + backward FLOPs of one micro-batch on this rank: 6 per parameter a token passes through (an
    expert counted for the tokens routed to it), the head, and causal attention's score and value GEMMs."""
    from moe import MoELayer

    mc, t, d = cfg.model, cfg.train, rm.dims
    tokens = t.micro_batch_size * -(-t.seq_len // (d.sp * d.cp))
    model = rm.model
    active = 0.0
    for i in rm.stage_layers:
        layer = model.layers[i]
        for mod in layer.modules():
            if isinstance(mod, MoELayer):  # each token passes through top_k experts (balanced over ep ranks)
                experts = sum(p.numel() for p in mod.experts.parameters())
                active += experts / mod.experts.num_experts * mod.top_k
        moe_params = sum(p.numel() for mod in layer.modules() if isinstance(mod, MoELayer)
                         for p in mod.experts.parameters())
        active += sum(p.numel() for p in layer.parameters()) - moe_params
    if rm.last:
        active += model.output_weight.numel()
    attention = 4 * tokens * t.seq_len * mc.dim / d.tp / 2 * len(rm.stage_layers)  # QK^T and PV, causal half
    return 6 * tokens * active + 3 * attention


def _bubble(cfg: DictConfig, rm: RankModel) -> float:
    """Idle fraction added to compute by the pipeline schedule (warm-up and drain of p - 1 stages)."""
    p, m, v = rm.dims.pp, cfg.train.grad_accum, rm.stages
    if p == 1:
        return 0.0
    zero_bubble = cfg.parallel.pp_schedule in ("interleaved_zb", "zbv", "dualpipev")
    return (p - 1) / (v * m) / (3 if zero_bubble else 1)


def activation_traffic(cfg: DictConfig, rm: RankModel, isz: int) -> float:
    """Bytes of activation one micro-batch produces on this rank (what its layers would save without
    checkpointing or tiling, and the loss's logits working set): what the non-GEMM operations (norms, SiLU,
    softmax, RoPE, copies) stream through memory, in proportion."""
    mc, t, d = cfg.model, cfg.train, rm.dims
    tokens, per_layer, _ = _saved_per_layer(cfg, rm, isz, 1.0)
    if t.tiled_mlp:  # (tiling saves less, but computes the same hidden activations)
        per_layer = [x + (0 if i in _moe_layers(rm) else tokens * 4 * (mc.ffn_dim // d.tp) * isz)
                     for x, i in zip(per_layer, rm.stage_layers)]
    logits = tokens * (mc.vocab_size // d.tp) * (isz + 8) if rm.last else 0
    return float(sum(per_layer) + logits)


def host_events(cfg: DictConfig, rm: RankModel, layout: Layout) -> dict[str, float]:
    """What costs time apart from GEMM FLOPs and collective bytes, per step: layer passes (forward, backward,
    recompute), ZeRO-3 gather / free events of the units, and the activation bytes the non-GEMM operations
    produce (recompute included)."""
    m = cfg.train.grad_accum
    passes = 3 if cfg.train.activation_checkpointing else 2
    units = sum(1 for b in layout.buckets if b.role == "unit")
    traffic = activation_traffic(cfg, rm, ITEMSIZE[cfg.zero.dtype]) * m * passes / 2
    return {"layer_passes": m * passes * len(rm.stage_layers), "unit_events": 2 * m * units if units else 0,
            "activation_bytes": traffic, "moe_passes": m * passes * len(_moe_layers(rm))}


def step_time(cfg: DictConfig, rm: RankModel, cluster: Cluster, collectives: list[Collective],
              layout: Layout, isz: int) -> dict[str, float]:
    """Roofline: compute from FLOPs at the cluster's rate, collectives alpha-beta per link, the optimizer
    step from the bytes it streams, host overheads per layer pass and ZeRO-3 event (the cluster's calibrated
    `layer_overhead_us`, `unit_overhead_us`); gradient reductions overlap backward where the engine does."""
    z = cfg.zero
    m = cfg.train.grad_accum
    recompute = 4 / 3 if cfg.train.activation_checkpointing else 1.0
    compute = flops_per_micro_batch(cfg, rm) * m * recompute / cluster.flop_rate(z.dtype, rm.dims.world_size)
    compute *= 1 + _bubble(cfg, rm)
    # host work (Python, launches, a collective call's setup) runs on the rank's share of a compute unit too:
    # ranks that outnumber a CPU's cores each wait for theirs
    slowdown = 1 / cluster.share(rm.dims.world_size)
    # overlap needs a free compute unit for the collectives' threads: ranks that fill a CPU's cores (gloo) wait
    overlap = z.overlap_comm and cluster.spare_unit(rm.dims.world_size)
    events = host_events(cfg, rm, layout)
    exposed = hidden = 0.0
    for c in collectives:
        alpha, beta = cluster.link(c.ranks)
        t = c.calls * alpha * slowdown + c.bytes / beta
        if "reduction" in c.group and z.stage >= 2 and overlap:
            hidden += t
        else:
            exposed += t
    elementwise = 0.0
    if cluster.elementwise_gbps:  # memory-bound operations, on the rank's share of the compute units
        elementwise = events["activation_bytes"] / (cluster.elementwise_gbps * 1e9) * slowdown
    exposed += max(0.0, hidden - (compute + elementwise) * 2 / 3)  # backward is about two thirds of the compute
    shard = sum(b.shard for b in layout.buckets if b.trainable)
    streamed = shard * 4 * (2 * ADAM_STATES + 3)  # read and write the states, master, gradient, new value
    bandwidth = {"none": cluster.memory_gbps, "cpu": cluster.host_gbps, "nvme": cluster.nvme_gbps}[z.offload_optimizer]
    optimizer = streamed / (bandwidth * 1e9)
    if z.offload_optimizer == "cpu":
        optimizer += shard * (4 + isz) / (cluster.host_gbps * 1e9)
    host = (events["layer_passes"] * cluster.layer_overhead_us + events["unit_events"] * cluster.unit_overhead_us
            + events["moe_passes"] * cluster.moe_overhead_us)
    host *= 1e-6 * slowdown
    return {"compute": compute, "elementwise": elementwise, "communication": exposed, "optimizer": optimizer,
            "host": host, "step": compute + elementwise + exposed + optimizer + host}


def _plan_rank(cfg: DictConfig, rank: int, cluster: Cluster, a2a_rows: float | None,
               imbalance: float) -> RankEstimate:
    z = cfg.zero
    isz = ITEMSIZE[z.dtype]
    rm = rank_model(cfg, rank)
    config = zero_config(cfg)
    layout = bucket_specs(rm, config)
    trace = trace_micro_batch(rm, cfg, config.torch_dtype, gemms=bool(cluster.gemm_cache_entry_kb))
    counter = _Counter()
    engine_collectives(counter, layout, cfg, rm, isz)
    model_collectives(counter, trace, cfg, rm, a2a_rows)
    collectives = list(counter.entries.values())
    if a2a_rows is not None and trace.a2a_rows:
        # the measured routing: rows sent and received against uniform routing's (sent equal to received there);
        # what this rank's experts received over uniform is its imbalance for the expert activations
        imbalance = max(0.0, 2 * a2a_rows / (trace.a2a_rows * cfg.train.grad_accum) - 1)
    phases, nvme = memory_phases(layout, cfg, rm, isz, imbalance, int(cluster.runtime_memory_mb * 2**20),
                                 cluster.collective_copies, cluster.unified_memory)
    caches = gemm_cache_memory(trace, cluster)
    if caches:  # (resident from the first step on: in every moment)
        for d, _ in phases.values():
            d["gemm_caches"] = caches
    peak = max(phases, key=lambda k: sum(phases[k][0].values()))
    dev, host = phases[peak]
    together = max(sum(d.values()) + sum(h.values()) for d, h in phases.values())  # host and device one memory
    step = max(phases.values(), key=lambda m: sum(m[1].values()) + (sum(m[0].values()) if cluster.unified_memory
                                                                     else 0))
    hosts = host_phases(layout, cfg, rm, isz, step, cluster)
    by_kind: dict[str, int] = defaultdict(int)
    for c in collectives:
        by_kind[c.kind] += c.bytes
    return RankEstimate(rank, dev, host, nvme, collectives, sum(by_kind.values()), dict(by_kind),
                        step_time(cfg, rm, cluster, collectives, layout, isz),
                        sum(p.numel() for p in rm.module.parameters()), len(layout.buckets),
                        host_events(cfg, rm, layout), peak, together, hosts)


def check_planned(cfg: DictConfig) -> None:
    """Raise NotImplementedError, in one line, for what the planner does not model (before any work)."""
    o = cfg.optim
    if o.get("name", "adamw") == "onebit_adam":
        raise NotImplementedError("the planner does not model 1-bit Adam's compressed steps (optim.name=onebit_adam): "
                                  "plan its warm-up with optim.name=adamw; a compressed step sends 2 (n - 1) / n x "
                                  "(1/8 + 4/block) bytes per parameter (docs/slow_links.md)")
    if cfg.parallel.get("replicas", 1) > 1 or o.get("diloco", {}).get("inner_steps", 0):
        raise NotImplementedError("the planner does not model DiLoCo (parallel.replicas > 1 or "
                                  "optim.diloco.inner_steps > 0): plan one replica's layout with parallel.replicas=1 "
                                  "and optim.diloco.inner_steps=0 on its share of the devices")


def estimate(cfg: DictConfig, cluster: Cluster | None = None, world: int | None = None, *,
             a2a_rows: dict[int, float] | None = None, imbalance: float = 1.0,
             ranks: list[int] | None = None) -> list[RankEstimate]:
    """Predictions for every rank of `cfg` on `world` processes (default: the product of the degrees, dp
    numeric), in rank order. One rank per pipeline coordinate is built; the others share its figures.
    `a2a_rows`: per rank, the expert all-to-all rows sent in one step (e.g. from a measured routing
    histogram) instead of uniform routing; `imbalance`: the busiest expert's load over the mean, for the
    dispatch buffers."""
    from recipes.config import check_config
    from recipes.planner.layouts import resolve_world, world_env

    check_planned(cfg)
    cluster = cluster or Cluster()
    cfg = resolve_world(cfg, world)
    with world_env(cfg):
        check_config(cfg)
    world = cfg.parallel.dp * cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.sp * cfg.parallel.cp
    stride = world // cfg.parallel.pp
    wanted = list(range(world)) if ranks is None else ranks
    built: dict[int, RankEstimate] = {}
    out = []
    for r in wanted:
        # (the ring ranks of a layout-aware ring send different bytes: each is planned on its own)
        key = r // stride if a2a_rows is None and cfg.parallel.cp == 1 else r
        if key not in built:
            with fake_world(world, r):
                built[key] = _plan_rank(cfg, r, cluster, None if a2a_rows is None else a2a_rows.get(r), imbalance)
        est = built[key]
        out.append(RankEstimate(**{**est.__dict__, "rank": r}))
    return out
