"""Per-rank predictions of a layout: memory by category, communication per collective kind and group, step time.

`estimate(cfg, cluster, world)` is the function API (recipes.plan prints it): it builds one rank per pipeline
coordinate (`recipes.planner.build`), lays out its buckets as the engine does, traces one micro-batch's
collectives on the meta device (`recipes.planner.trace`) and adds the engine's own collectives per step.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field

from omegaconf import DictConfig

import zero
from recipes.config import is_moe
from recipes.planner.build import (
    ITEMSIZE,
    BucketSpec,
    Layout,
    RankModel,
    bucket_specs,
    fake_world,
    gradient_passes,
    rank_model,
)
from recipes.planner.cluster import Cluster
from recipes.planner.trace import Trace, trace_micro_batch

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


def engine_collectives(out: _Counter, layout: Layout, cfg: DictConfig, rm: RankModel, isz: int) -> None:
    """The engine's own collectives in one step: gradient reductions, ZeRO-3 gathers, the step's gathers."""
    stage, m, passes = cfg.zero.stage, cfg.train.grad_accum, backward_passes(cfg, rm)
    trainable = [b for b in layout.buckets if b.trainable]
    for b in trainable:
        group = f"{b.reduce_group} reduction"
        if stage == 0:
            out.ring_all_reduce(group, b.group, b.padded * isz)
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
        for b in layout.buckets:
            if b.role == "unit":
                out.add("all_gather", f"{b.reduce_group} parameters", b.group, (b.group - 1) * b.shard * isz, 2 * m)
            elif b.role == "root":
                out.add("all_gather", f"{b.reduce_group} parameters", b.group, (b.group - 1) * b.shard * isz,
                        1 if rm.dims.pp > 1 else m)
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
              "all_reduce": ("tp/sp", max(dims.tp, dims.sp))}
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


def state_memory(layout: Layout, cfg: DictConfig, isz: int) -> tuple[dict[str, int], dict[str, int], int]:
    """(device, host, nvme) bytes of parameters, gradients, masters, optimizer state and flat padding."""
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
        if z.stage <= 1:
            dev["gradients"] += b.padded * isz + (b.shard * 4 if (z.stage == 1 or isz != 4) else 0)
        elif z.offload_optimizer != "nvme":
            dev["gradients"] += b.shard * 4
        master = b.shard * 4 if (isz != 4 or z.offload_optimizer != "none") else 0
        states = ADAM_STATES * b.shard * 4
        if z.offload_optimizer == "none":
            dev["master_weights"] += master
            dev["optimizer_state"] += states
        elif z.offload_optimizer == "cpu":
            host["master_weights"] += master
            host["optimizer_state"] += states
        else:
            nvme += master + states
    if z.stage >= 2:  # a bucket's full-size staging buffer while its reduction is in flight (two at most)
        sizes = sorted((b.padded * isz for b in layout.buckets if b.trainable), reverse=True)[:2]
        dev["gradient_staging"] += sum(sizes)
    if z.stage == 3:
        units = defaultdict(int)
        for b in layout.buckets:
            if b.role == "unit":
                units[b.unit] += b.padded * isz
        largest = max(units.values(), default=0)
        dev["zero3_gathered"] = largest * (1 + z.prefetch_depth) + sum(
            b.padded * isz for b in layout.buckets if b.role == "root")
    return dict(dev), dict(host), nvme


def in_flight_micro_batches(cfg: DictConfig, rm: RankModel) -> float:
    """Micro-batches whose activations a rank holds at its peak, per the pipeline schedule."""
    p, m, pp_rank = rm.dims.pp, cfg.train.grad_accum, rm.dims.coordinate()["pp"]
    if p == 1:
        return 1
    schedule = cfg.parallel.pp_schedule
    if schedule in ("gpipe", "looped_bfs"):
        return m * rm.stages
    if schedule in ("zbv", "dualpipev"):
        return min(m, 2 * p) * 1.0
    return min(m, p - pp_rank) * rm.stages if rm.stages == 1 else min(m * rm.stages, (p - pp_rank) + p)


def activation_memory(cfg: DictConfig, rm: RankModel, isz: int, imbalance: float) -> dict[str, int]:
    """Saved activations of the micro-batches in flight (per layer: norms, q/k/v, attention output, MLP
    hidden; only the block inputs under checkpointing), logits and the MoE dispatch buffers."""
    mc, t, d = cfg.model, cfg.train, rm.dims
    tokens = t.micro_batch_size * -(-t.seq_len // d.sp)
    head_dim = mc.dim // mc.n_heads
    kv = mc.n_kv_heads * head_dim
    ffn = mc.ffn_dim // d.tp
    # saved per token: the two norms' outputs (gathered to the whole sequence under tp), q, attention output and
    # its projection (3 x dim / tp), k and v, the MLP's two inputs, SiLU and product (4 x ffn / tp); under
    # Ulysses also q, k, v and the output on the other side of the all-to-alls
    per_layer = tokens * (2 * mc.dim + (4 * mc.dim + 2 * kv) // d.tp + 4 * ffn) * isz
    if d.sp > 1:
        per_layer += tokens * (2 * mc.dim + 2 * kv) // d.tp * isz
    layers = len(rm.stage_layers)
    held = in_flight_micro_batches(cfg, rm)
    if t.activation_checkpointing:  # the blocks' inputs, and in backward one block recomputed with its gradients
        acts = tokens * mc.dim // d.tp * isz * layers * held + 2 * per_layer
    else:
        acts = per_layer * layers * held
    out = {"activations": int(acts)}
    if rm.last and not t.tiled_loss:
        out["logits"] = int(tokens * d.sp * mc.vocab_size // d.tp * (isz + 8) if d.sp == 1 else
                            tokens * mc.vocab_size // d.tp * (isz + 8))
    if is_moe(cfg):
        slots = tokens * mc.moe.top_k
        width = mc.moe.ffn_dim or mc.ffn_dim
        out["moe_dispatch"] = int(slots * imbalance * (2 * mc.dim + 3 * width) * isz)
    return out


def flops_per_micro_batch(cfg: DictConfig, rm: RankModel) -> float:
    """Forward + backward FLOPs of one micro-batch on this rank: 6 per parameter a token passes through (an
    expert counted for the tokens routed to it), the head, and causal attention's score and value GEMMs."""
    from moe import MoELayer

    mc, t, d = cfg.model, cfg.train, rm.dims
    tokens = t.micro_batch_size * -(-t.seq_len // d.sp)
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


def host_events(cfg: DictConfig, rm: RankModel, layout: Layout) -> dict[str, float]:
    """What costs host time apart from FLOPs and bytes, per step: layer passes (forward, backward, recompute)
    and ZeRO-3 gather / free events of the units."""
    m = cfg.train.grad_accum
    passes = 3 if cfg.train.activation_checkpointing else 2
    units = sum(1 for b in layout.buckets if b.role == "unit")
    return {"layer_passes": m * passes * len(rm.stage_layers), "unit_events": 2 * m * units if units else 0}


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
    exposed = hidden = 0.0
    for c in collectives:
        alpha, beta = cluster.link(c.ranks)
        t = c.calls * alpha + c.bytes / beta
        if "reduction" in c.group and z.stage >= 2 and z.overlap_comm:
            hidden += t
        else:
            exposed += t
    exposed += max(0.0, hidden - compute * 2 / 3)  # backward is about two thirds of the compute
    shard = sum(b.shard for b in layout.buckets if b.trainable)
    streamed = shard * 4 * (2 * ADAM_STATES + 3)  # read and write the states, master, gradient, new value
    bandwidth = {"none": cluster.memory_gbps, "cpu": cluster.host_gbps, "nvme": cluster.nvme_gbps}[z.offload_optimizer]
    optimizer = streamed / (bandwidth * 1e9)
    if z.offload_optimizer == "cpu":
        optimizer += shard * (4 + isz) / (cluster.host_gbps * 1e9)
    events = host_events(cfg, rm, layout)
    host = events["layer_passes"] * cluster.layer_overhead_us + events["unit_events"] * cluster.unit_overhead_us
    host *= 1e-6
    return {"compute": compute, "communication": exposed, "optimizer": optimizer, "host": host,
            "step": compute + exposed + optimizer + host}


def _plan_rank(cfg: DictConfig, rank: int, cluster: Cluster, a2a_rows: float | None,
               imbalance: float) -> RankEstimate:
    z = cfg.zero
    isz = ITEMSIZE[z.dtype]
    rm = rank_model(cfg, rank)
    config = zero.ZeroConfig(**{k: v for k, v in z.items() if k in ("stage", "dtype", "reduce_bucket_size",
                                                                     "param_persistence_threshold", "prefetch_depth")})
    layout = bucket_specs(rm, config)
    trace = trace_micro_batch(rm, cfg, config.torch_dtype)
    counter = _Counter()
    engine_collectives(counter, layout, cfg, rm, isz)
    model_collectives(counter, trace, cfg, rm, a2a_rows)
    collectives = list(counter.entries.values())
    dev, host, nvme = state_memory(layout, cfg, isz)
    dev.update(activation_memory(cfg, rm, isz, imbalance))
    by_kind: dict[str, int] = defaultdict(int)
    for c in collectives:
        by_kind[c.kind] += c.bytes
    return RankEstimate(rank, dev, host, nvme, collectives, sum(by_kind.values()), dict(by_kind),
                        step_time(cfg, rm, cluster, collectives, layout, isz),
                        sum(p.numel() for p in rm.module.parameters()), len(layout.buckets),
                        host_events(cfg, rm, layout))


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

    cluster = cluster or Cluster()
    cfg = resolve_world(cfg, world)
    with world_env(cfg):
        check_config(cfg)
    world = cfg.parallel.dp * cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.sp
    stride = world // cfg.parallel.pp
    wanted = list(range(world)) if ranks is None else ranks
    built: dict[int, RankEstimate] = {}
    out = []
    for r in wanted:
        key = r // stride if a2a_rows is None else r
        if key not in built:
            with fake_world(world, r):
                built[key] = _plan_rank(cfg, r, cluster, None if a2a_rows is None else a2a_rows.get(r), imbalance)
        est = built[key]
        out.append(RankEstimate(**{**est.__dict__, "rank": r}))
    return out
