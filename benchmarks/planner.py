"""Planner against measurement: a grid of small layouts on this machine (1-4 gloo ranks; dense and MoE with ep;
ZeRO 0-3; cpu and nvme offload; pp with 1f1b, interleaved and zbv; tp; sp; checkpointing and tiling), each
trained a few steps by the recipe and predicted by recipes.planner. Per layout: communication bytes per
collective kind against zero.dist.comm's counters (every rank; the MoE all-to-all given the measured routing),
parameter and optimizer-state bytes, peak memory (VmHWM of the steps less the runtime's baseline, glibc's mmap
threshold pinned so that freed tensors leave resident memory) and step time (after one
calibration factor fitted over the grid), and which layout the planner ranks first among each model's 2-rank
layouts. Results are cached per layout (--cache), so a rerun measures only what is missing; --time-only
remeasures step times late, when the machine is quieter.

    python benchmarks/planner.py [--cache runs/planner_bench.json] [--only NAME] [--steps 6] [--search] [--write]
    python benchmarks/planner.py --quick     # two layouts, a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import failed, finish, print_ratio, quick_mode, spawn, table  # noqa: E402
from recipes.planner.measure import MMAP_THRESHOLD  # noqa: E402

# Large enough that what the planner predicts (state, activations, logits) is tens to hundreds of MB per rank
# against the allocator's floor of a few MB, small enough that the 63 layouts run in minutes on 2 cores.
BASE = ["train.micro_batch_size=4", "train.seq_len=256", "model.n_layers=4", "model.dim=256", "model.ffn_dim=768",
        "model.vocab_size=4096", "model.max_seq_len=256"]
# The quick run's smoke check (bytes per kind only) on the small models, seconds per layout.
QUICK_BASE = ["train.micro_batch_size=4", "train.seq_len=128", "model.n_layers=4"]
DENSE, MOE = ["model=tiny"], ["model=moe_tiny", "model.moe.ffn_dim=256"]
NVME = "zero.nvme_path=runs/planner_nvme"


def grid(base: list[str] | None = None) -> list[tuple[str, int, list[str]]]:
    """(name, ranks, overrides) of every layout (on `base`, default BASE)."""
    out = []
    for label, model in (("dense", DENSE), ("moe", MOE)):
        # (moe_tiny's every feed-forward is MoE, which train.tiled_mlp leaves whole and the recipe refuses: its
        # tiled layout tiles the loss only)
        tiled = ["train.tiled_loss=true"] + (["train.tiled_mlp=2"] if model is DENSE else [])
        for name, extra in (("z0", ["zero.stage=0"]), ("z1", ["zero.stage=1"]), ("z3", ["zero.stage=3"]),
                            ("z2-ckpt", ["zero.stage=2", "train.activation_checkpointing=true"]),
                            ("z3-cpu", ["zero.stage=3", "zero.offload_optimizer=cpu", "zero.offload_params=cpu"]),
                            ("z0-tiled", ["zero.stage=0", *tiled])):
            out.append((f"{label} 1r {name}", 1, model + extra))
    dense2 = [("dp2 z0", ["zero.stage=0"]), ("dp2 z1", ["zero.stage=1"]), ("dp2 z2", ["zero.stage=2"]),
              ("dp2 z3", ["zero.stage=3"]), ("dp2 z2 accum2", ["zero.stage=2", "train.grad_accum=2"]),
              ("dp2 z1 small buckets", ["zero.stage=1", "zero.reduce_bucket_size=20000"]),
              ("dp2 z2 cpu", ["zero.stage=2", "zero.offload_optimizer=cpu"]),
              ("dp2 z3 cpu", ["zero.stage=3", "zero.offload_optimizer=cpu", "zero.offload_params=cpu"]),
              ("dp2 z2 nvme", ["zero.stage=2", "zero.offload_optimizer=nvme", NVME]),
              ("dp2 z3 ckpt", ["zero.stage=3", "train.activation_checkpointing=true"]),
              ("dp2 z1 tiled", ["zero.stage=1", "train.tiled_mlp=2", "train.tiled_loss=true"]),
              ("dp2 z2 bf16", ["zero.stage=2", "zero.dtype=bf16"]),
              ("tp2 z0", ["parallel.tp=2", "zero.stage=0"]), ("tp2 z1", ["parallel.tp=2", "zero.stage=1"]),
              ("tp2 z3", ["parallel.tp=2", "zero.stage=3"]),
              ("sp2 z0", ["parallel.sp=2", "zero.stage=0"]), ("sp2 z2", ["parallel.sp=2", "zero.stage=2"]),
              ("sp2 z3 ckpt", ["parallel.sp=2", "zero.stage=3", "train.activation_checkpointing=true"]),
              ("pp2 1f1b z1", ["parallel.pp=2", "train.grad_accum=2", "zero.stage=1"]),
              ("pp2 interleaved z1", ["parallel.pp=2", "train.grad_accum=2", "zero.stage=1",
                                      "parallel.pp_schedule=interleaved_1f1b"]),
              ("pp2 zbv z1", ["parallel.pp=2", "train.grad_accum=2", "zero.stage=1", "parallel.pp_schedule=zbv"]),
              ("pp2 1f1b z2", ["parallel.pp=2", "train.grad_accum=2", "zero.stage=2"]),
              ("pp2 gpipe z0", ["parallel.pp=2", "train.grad_accum=2", "zero.stage=0", "parallel.pp_schedule=gpipe"])]
    out += [(f"dense 2r {n}", 2, DENSE + o) for n, o in dense2]
    moe2 = [("ep2 z0", ["parallel.ep=2", "zero.stage=0"]), ("ep2 z1", ["parallel.ep=2", "zero.stage=1"]),
            ("ep2 z2", ["parallel.ep=2", "zero.stage=2"]), ("ep2 z3", ["parallel.ep=2", "zero.stage=3"]),
            ("ep2 z3 ckpt", ["parallel.ep=2", "zero.stage=3", "train.activation_checkpointing=true"]),
            ("ep1 dp2 z1", ["zero.stage=1"]), ("sp2 ep2 z1", ["parallel.sp=2", "parallel.ep=2", "zero.stage=1"]),
            ("sp2 ep2 z3", ["parallel.sp=2", "parallel.ep=2", "zero.stage=3"]),
            ("ep2 z2 cpu", ["parallel.ep=2", "zero.stage=2", "zero.offload_optimizer=cpu"]),
            ("ep2 z1 bf16", ["parallel.ep=2", "zero.stage=1", "zero.dtype=bf16"]),
            ("pp2 1f1b z1", ["parallel.pp=2", "train.grad_accum=2", "zero.stage=1"])]
    out += [(f"moe 2r {n}", 2, MOE + o) for n, o in moe2]
    dense4 = [("dp4 z0", ["zero.stage=0"]), ("dp4 z1", ["zero.stage=1"]), ("dp4 z3", ["zero.stage=3"]),
              ("tp2 dp2 z1", ["parallel.tp=2", "zero.stage=1"]), ("sp2 dp2 z2", ["parallel.sp=2", "zero.stage=2"]),
              ("pp2 dp2 z1", ["parallel.pp=2", "train.grad_accum=2", "zero.stage=1"]),
              ("tp2 pp2 z0", ["parallel.tp=2", "parallel.pp=2", "train.grad_accum=2", "zero.stage=0"]),
              ("tp2 sp2 z0", ["parallel.tp=2", "parallel.sp=2", "zero.stage=0"]),
              ("dp4 z2 cpu", ["zero.stage=2", "zero.offload_optimizer=cpu"]),
              ("pp2 dp2 interleaved z2", ["parallel.pp=2", "train.grad_accum=2", "zero.stage=2",
                                          "parallel.pp_schedule=interleaved_1f1b"]),
              ("pp2 dp2 zbv z2", ["parallel.pp=2", "train.grad_accum=2", "zero.stage=2", "parallel.pp_schedule=zbv"]),
              ("pp2 dp2 1f1b z3", ["parallel.pp=2", "train.grad_accum=2", "zero.stage=3"])]
    out += [(f"dense 4r {n}", 4, DENSE + o) for n, o in dense4]
    moe4 = [("ep4 z1", ["parallel.ep=4", "zero.stage=1"]), ("ep2 dp4 z2", ["parallel.ep=2", "zero.stage=2"]),
            ("sp2 ep4 z1", ["parallel.sp=2", "parallel.ep=4", "zero.stage=1"]),
            ("ep4 z3 ckpt", ["parallel.ep=4", "zero.stage=3", "train.activation_checkpointing=true"]),
            ("pp2 ep2 z1", ["parallel.pp=2", "parallel.ep=2", "train.grad_accum=2", "zero.stage=1"])]
    out += [(f"moe 4r {n}", 4, MOE + o) for n, o in moe4]
    return [(name, world, (BASE if base is None else base) + o) for name, world, o in out]


# The host-memory grid (docs/planner_host.md): models whose state (a 16k vocabulary, untied) outweighs the step's
# activations (one sequence of 32 tokens), so that the build and the load, not only the step, can be the peak.
# Where the engine pins glibc's mmap threshold itself (zero.host_mmap_threshold, 1 MiB by default: nvme parameter
# offload), it pins the measurement's own 64 KiB, so that resident memory follows the live tensors there too.
HOST_BASE = ["train.micro_batch_size=1", "train.seq_len=32", "model.n_layers=4", "model.dim=256", "model.ffn_dim=768",
             "model.vocab_size=16384", "model.max_seq_len=64", "model.tie_embeddings=false",
             f"zero.host_mmap_threshold={MMAP_THRESHOLD}"]
HOST_NVME = "zero.nvme_path=runs/planner_host_nvme"
HOST_CHECKPOINTS = "runs/planner_host_checkpoints"


def host_grid() -> list[tuple[str, int, list[str]]]:
    """(name, ranks, overrides) of the host-memory grid; each run starts from its model's checkpoint
    (train.init_from, added by host_run)."""
    z3_cpu = ["zero.stage=3", "zero.offload_optimizer=cpu", "zero.offload_params=cpu"]
    z3_nvme = ["zero.stage=3", "zero.offload_optimizer=nvme", "zero.offload_params=nvme", HOST_NVME]
    out = [("dense 1r z0", 1, DENSE + ["zero.stage=0"]),
           ("dense 1r z3", 1, DENSE + ["zero.stage=3"]),
           ("dense 1r z1 bf16", 1, DENSE + ["zero.stage=1", "zero.dtype=bf16"]),
           ("dense 1r z3 cpu", 1, DENSE + z3_cpu),
           ("dense 2r dp2 z1", 2, DENSE + ["zero.stage=1"]),
           ("dense 2r dp2 z2 nvme", 2, DENSE + ["zero.stage=2", "zero.offload_optimizer=nvme", HOST_NVME]),
           ("dense 2r dp2 z3", 2, DENSE + ["zero.stage=3"]),
           ("dense 2r dp2 z3 nvme", 2, DENSE + z3_nvme),
           ("dense 2r tp2 z1", 2, DENSE + ["parallel.tp=2", "zero.stage=1"]),
           ("dense 2r pp2 z1", 2, DENSE + ["parallel.pp=2", "train.grad_accum=2", "zero.stage=1"]),
           ("dense 4r tp2 dp2 z3", 4, DENSE + ["parallel.tp=2", "zero.stage=3"]),
           ("moe 1r z0", 1, MOE + ["zero.stage=0"]),
           ("moe 2r ep2 z1", 2, MOE + ["parallel.ep=2", "zero.stage=1"]),
           ("moe 2r ep2 z3", 2, MOE + ["parallel.ep=2", "zero.stage=3"]),
           ("moe 2r ep2 z3 cpu", 2, MOE + ["parallel.ep=2"] + z3_cpu),
           ("moe 2r ep2 z3 nvme", 2, MOE + ["parallel.ep=2"] + z3_nvme),
           ("moe 4r pp2 ep2 z1", 4, MOE + ["parallel.pp=2", "parallel.ep=2", "train.grad_accum=2", "zero.stage=1"])]
    return [(name, world, HOST_BASE + o) for name, world, o in out]


def host_checkpoint(overrides: list[str], directory: str) -> str:
    """A Hugging Face directory (fp32 safetensors) of the model `overrides` configure, freshly initialised
    (written once; the run's train.init_from)."""
    import torch
    from moe_lst.models.llama import Transformer
    from moe_lst.models.llama.spec import model_config
    from moe_lst.models.llama.state_dict import save_hf

    from recipes.config import compose_command_line

    if not os.path.isfile(os.path.join(directory, "model.safetensors")):
        model = model_config(compose_command_line(overrides))
        torch.manual_seed(0)
        save_hf(Transformer(model).state_dict(), model, directory)
    return directory


def measure_host_rank(overrides: list[str]) -> dict:
    from recipes.planner.measure import measure_host

    return measure_host(overrides)


def host_layout(name: str, world: int, overrides: list[str], cluster=None, run=None,
                measured: list[dict] | None = None) -> dict:
    """Measure one layout of the host grid (every rank, fresh processes: `run(fn, world, *args)`, default
    benchmarks.common.spawn) and predict it: per rank and phase, MiB measured and predicted; `error`: the
    largest relative error of a rank's peak over the phases."""
    from recipes.config import compose_command_line
    from recipes.planner import estimate, load_cluster

    model = "moe" if name.startswith("moe") else "dense"
    base = [o for o in overrides if not o.startswith(("zero.", "parallel.", "train.grad_accum"))]
    directory = host_checkpoint(base, os.path.join(HOST_CHECKPOINTS, model))
    overrides = overrides + [f"train.init_from={directory}"]
    os.makedirs(HOST_NVME.split("=", 1)[1], exist_ok=True)
    t0 = time.perf_counter()
    if measured is None:  # (given: the earlier measurement, predicted again)
        measured = (run(measure_host_rank, world, overrides) if run is not None
                    else spawn(measure_host_rank, overrides, world=world, timeout=600))
    wall = time.perf_counter() - t0
    ests = estimate(compose_command_line(overrides), cluster or load_cluster("cpu"), world)
    ranks = []
    for m, e in zip(measured, ests):
        pm = {k: v / 2**20 for k, v in m["phases"].items()}
        pp = {k: sum(v.values()) / 2**20 for k, v in e.host_phases.items()}
        ranks.append({"measured": pm, "predicted": pp, "peak_measured": max(pm.values()),
                      "peak_predicted": e.host_peak_bytes / 2**20, "predicted_phase": e.host_peak_phase,
                      "measured_phase": max(pm, key=pm.get), "nvme_bytes": e.nvme_bytes,
                      "nvme_measured": m.get("nvme_bytes"),
                      "categories": {k: {c: b / 2**20 for c, b in v.items()} for k, v in e.host_phases.items()},
                      "raw": m})
    error = max(abs(r["peak_predicted"] - r["peak_measured"]) / r["peak_measured"] for r in ranks)
    return {"name": name, "world": world, "overrides": overrides, "ranks": ranks, "error": error, "wall_s": wall}


def host_table(results: list[dict]) -> str:
    """The host grid's markdown table: per layout, the rank with the largest error."""
    rows = []
    for r in results:
        worst = max(r["ranks"], key=lambda x: abs(x["peak_predicted"] - x["peak_measured"]) / x["peak_measured"])
        phases = lambda d: " / ".join(f"{d.get(k, 0):.0f}" for k in ("build", "load", "step"))  # noqa: E731
        rows.append([r["name"], phases(worst["measured"]), phases(worst["predicted"]),
                     f"{worst['peak_measured']:.1f} ({worst['measured_phase']})",
                     f"{worst['peak_predicted']:.1f} ({worst['predicted_phase']})",
                     f"{(worst['peak_predicted'] - worst['peak_measured']) / worst['peak_measured']:+.1%}",
                     f"{worst['nvme_bytes'] / 2**20:.1f} / {(worst.get('nvme_measured') or 0) / 2**20:.1f}"])
    return table(["layout", "measured MiB build / load / step", "predicted build / load / step", "peak measured",
                  "peak predicted", "error", "nvme MiB predicted / files"], rows)


def host_main(args) -> None:
    path = os.path.join("runs", "planner_host.json")
    earlier = {r["name"]: r for r in json.load(open(path))} if args.host_predict and os.path.exists(path) else {}
    results = []
    for name, world, overrides in host_grid():
        if args.only and args.only not in name:
            continue
        kept = earlier.get(name)
        measured = [rank.get("raw") or {"phases": {k: v * 2**20 for k, v in rank["measured"].items()}}
                    for rank in kept["ranks"]] if kept else None
        r = host_layout(name, world, overrides, measured=measured)
        results.append(r)
        print(f"{name:24s} |error| {r['error']:.1%}  ({r['wall_s']:.0f} s)", flush=True)
    text = host_table(results)
    print(text)
    if args.write:
        doc = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "planner_host.md")
        head = open(doc).read().split("<!-- host table -->")[0]
        with open(doc, "w") as f:
            f.write(head + "<!-- host table -->\n" + text + "\n")
    with open(path, "w") as f:
        json.dump(results, f)


def measure_rank(overrides: list[str], steps: int) -> dict:
    from recipes.planner.measure import measure

    return measure(overrides, steps)


def predict(world: int, overrides: list[str], measured: list[dict] | None, flops: dict[str, float]) -> list[dict]:
    from recipes.plan import compose_command_line
    from recipes.planner import estimate, load_cluster

    rows = None if measured is None else {r: m["a2a_rows"] for r, m in enumerate(measured)}
    # the raw roofline: the measured GEMM rates and a bare 60 us link latency; the fitted terms (the preset's
    # overheads, elementwise rate, extra latency) are what calibrate() finds, so they are off here
    cluster = load_cluster("cpu", {"flops": flops, "intra_latency_us": 60, "inter_latency_us": 60,
                                   "layer_overhead_us": 0, "unit_overhead_us": 0, "moe_overhead_us": 0,
                                   "elementwise_gbps": 0})
    ests = estimate(compose_command_line(overrides), cluster, world, a2a_rows=rows)
    return [e.to_json() for e in ests]


def gemm_rate(dtype: str = "fp32") -> float:
    """FLOP/s of one thread on a 256 x 256 GEMM in `dtype` (fp32 or bf16), now (the roofline's calibration)."""
    import torch

    torch.set_num_threads(1)
    kind = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    a, b = torch.randn(256, 256, dtype=kind), torch.randn(256, 256, dtype=kind)
    for _ in range(5):
        a @ b
    t0, n = time.perf_counter(), 50
    for _ in range(n):
        a @ b
    return 2 * 256**3 * n / (time.perf_counter() - t0)


def compare(overrides: list[str], measured: list[dict], predicted: list[dict]) -> dict:
    """Exactness of bytes, memory and the raw (uncalibrated) time ratio of one layout."""
    comm = all(m["comm"] == p["comm_bytes_by_kind"] for m, p in zip(measured, predicted))
    params = all(m["params"] == p["params"] for m, p in zip(measured, predicted))

    def both(p: dict, key: str) -> int:
        return p["memory"].get(key, 0) + p["host_memory"].get(key, 0)

    state = all(m["memory"]["optimizer_state"] == both(p, "optimizer_state") for m, p in zip(measured, predicted))
    nvme = "zero.offload_optimizer=nvme" in overrides  # (its state lives in files)
    peak_m = max(m["peak_rss"] - m.get("runtime_baseline", m["base_rss"]) for m in measured)
    peak_p = max(p.get("peak_total_bytes") or sum(p["memory"].values()) + sum(p["host_memory"].values())
                 for p in predicted)
    t_m = statistics.median(measured[0]["step_times"][1:])
    slowest = max(predicted, key=lambda p: p["step_time_s"])
    # the roofline without the fitted terms (host overheads, memory-bound operations)
    t_p = slowest["step_time_s"] - slowest["time_s"].get("host", 0.0) - slowest["time_s"].get("elementwise", 0.0)
    # what the fit leaves as predicted (the cluster's bandwidths and the bare latency): communication, optimizer
    t_fixed = slowest["time_s"].get("communication", 0.0) + slowest["time_s"].get("optimizer", 0.0)
    events = slowest.get("host_events", {})
    slowdown = 1 / _cpu().share(len(predicted))  # (host work of ranks that outnumber the cores: step_time's)
    return {"comm_exact": comm, "params_exact": params, "state_exact": state or nvme, "peak_measured": peak_m,
            "peak_predicted": peak_p, "time_measured": t_m, "time_predicted": t_p,
            "time_compute": t_p - t_fixed, "time_fixed": t_fixed,
            "layer_passes": events.get("layer_passes", 0) * slowdown,
            "unit_events": events.get("unit_events", 0) * slowdown,
            "collective_calls": sum(c["calls"] for c in slowest["collectives"]) * slowdown,
            "activation_bytes": events.get("activation_bytes", 0) * slowdown,
            "moe_passes": events.get("moe_passes", 0) * slowdown,
            "comm_measured": measured[0]["comm"], "comm_predicted": predicted[0]["comm_bytes_by_kind"]}


def _cpu():
    from recipes.planner import load_cluster

    return load_cluster("cpu")


def rates(cache: dict) -> dict[str, float]:
    """The measured GEMM rates per dtype (cached with the measurements; fp16 taken as bf16's)."""
    for key, dtype in (("_gemm_flops", "fp32"), ("_gemm_flops_bf16", "bf16")):
        if key not in cache:  # (measured once, with the grid; not again on each call)
            cache[key] = gemm_rate(dtype)
    return {"fp32": cache["_gemm_flops"], "bf16": cache["_gemm_flops_bf16"], "fp16": cache["_gemm_flops_bf16"]}


def gemm_cache_check(cache: dict, steps: int) -> None:
    """The memory one cached GEMM holds (the cpu preset's gemm_cache_entry_kb): every bf16 layout of the grid
    measured again with oneDNN's and ideep's per-shape caches at one entry each; the difference of the peaks over
    the difference of the entries the planner counts. Stored in the cache as `_gemm_cache_entry_kb`."""
    from moe.experts import ONEDNN_CACHE_CAPACITY

    entry = _cpu().gemm_cache_entry_kb * 1024
    found = {}
    for name, world, overrides in grid():
        if "bf16" not in name or "compare" not in cache.get(name, {}):
            continue
        measured = spawn(measure_rank, overrides, steps, world=world, timeout=600,
                         env={k: "1" for k in ONEDNN_CACHE_CAPACITY})
        low = max(m["peak_rss"] - m.get("runtime_baseline", m["base_rss"]) for m in measured)
        entries = round(cache[name]["predicted"][0]["memory"].get("gemm_caches", 0) / entry) - 2  # (1 + 1 left)
        found[name] = {"peak_mib": cache[name]["compare"]["peak_measured"] / 2**20, "one_entry_mib": low / 2**20,
                       "entries": entries, "kb_per_entry": (cache[name]["compare"]["peak_measured"] - low) /
                       max(1, entries) / 1024}
    cache["_gemm_cache_entry_kb"] = found


def kendall_tau(a: list[float], b: list[float]) -> float:
    pairs = [(i, j) for i in range(len(a)) for j in range(i + 1, len(a))]
    s = sum((1 if (a[i] - a[j]) * (b[i] - b[j]) > 0 else -1) for i, j in pairs if a[i] != a[j] and b[i] != b[j])
    return s / max(1, len(pairs))


def run(args) -> dict:
    cache = json.load(open(args.cache)) if os.path.exists(args.cache) else {}
    os.makedirs(NVME.split("=", 1)[1], exist_ok=True)  # (nvme offload's files go there)
    flops = rates(cache)
    for name, world, overrides in grid(getattr(args, "base", None)):
        if args.only and args.only not in name:
            continue
        entry = cache.get(name)
        if entry is not None and entry.get("overrides") != overrides:
            entry = None  # the grid changed: measure again
        if entry is None or args.time_only:
            try:
                t0 = time.perf_counter()
                measured = spawn(measure_rank, overrides, args.steps, world=world, timeout=600)
                entry = {"world": world, "overrides": overrides, "measured": measured,
                         "wall_s": time.perf_counter() - t0, "load": os.getloadavg()[0]}
            except Exception as e:  # a layout that fails is reported, the grid goes on
                failed(name, e)
                continue
        cache[name] = entry  # the measurement is kept even if the prediction fails
        try:
            entry["predicted"] = predict(world, overrides, entry["measured"], flops)
            entry["compare"] = compare(overrides, entry["measured"], entry["predicted"])
        except Exception as e:
            failed(f"{name} (prediction)", e)
            entry.pop("compare", None)
            _save(cache, args.cache)
            continue
        c = entry["compare"]
        print(f"{name:32s} comm {'exact' if c['comm_exact'] else 'DIFFERS'}  params {c['params_exact']}  "
              f"state {c['state_exact']}  time {c['time_measured'] * 1e3:7.1f} ms measured, "
              f"{c['time_predicted'] * 1e3:7.1f} ms predicted (load {entry['load']:.1f})", flush=True)
        _save(cache, args.cache)
    return cache


def _save(cache: dict, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(cache, f)
    os.replace(path + ".tmp", path)


# the fitted terms: the GEMM compute (scaled: the preset's flops), then host and memory-bound terms; communication
# and the optimizer step stay as predicted (time_fixed), so the preset with the fitted constants reproduces the fit
FEATURES = ("time_compute", "layer_passes", "unit_events", "collective_calls", "activation_bytes", "moe_passes")


def calibrate(cs: list[dict]) -> tuple[float, ...]:
    """(GEMM compute scale, seconds per layer pass, per ZeRO-3 unit event, per collective call, per activation byte,
    per MoE layer pass) fitted to the measured step times, less the predicted communication and optimizer time, by
    non-negative least squares on relative error (exact: the best unconstrained fit over every subset of the terms
    whose coefficients all come out non-negative). They are the cluster's flops divisor, layer_overhead_us,
    unit_overhead_us, collective latency beyond the bare 60 us, elementwise_gbps and moe_overhead_us."""
    from itertools import combinations

    import numpy as np

    x = np.array([[c.get(k, 0) for k in FEATURES] for c in cs], dtype=float)
    y = np.array([c["time_measured"] for c in cs])
    fixed = np.array([c.get("time_fixed", 0.0) for c in cs])
    a, target = x / y[:, None], 1 - fixed / y
    terms = [j for j in range(x.shape[1]) if x[:, j].any()]
    best, coef = float("inf"), np.zeros(x.shape[1])
    for n in range(1, len(terms) + 1):
        for subset in combinations(terms, n):
            sol = np.linalg.lstsq(a[:, subset], target, rcond=None)[0]
            if (sol < 0).any():
                continue
            residual = float(np.sum((a[:, subset] @ sol - target) ** 2))
            if residual < best:
                best, coef = residual, np.zeros(x.shape[1])
                coef[list(subset)] = sol
    return tuple(float(v) for v in coef)


def calibrated(c: dict, fit: tuple[float, ...]) -> float:
    return c.get("time_fixed", 0.0) + sum(f * c.get(k, 0) for f, k in zip(fit, FEATURES))


def search_check(cache: dict, fit: tuple[float, ...], steps: int) -> None:
    """For each model, `recipes.plan search` on 2 devices with the calibrated cpu cluster; its first layout is
    trained and compared with the fastest measured 2-rank layout of that model in the grid."""
    from recipes.plan import compose_command_line, search
    from recipes.planner import load_cluster

    flops = {k: v / max(fit[0], 1e-9) for k, v in rates(cache).items()}  # the roofline scaled by the fitted factor
    cluster = load_cluster("cpu", {"flops": flops,
                                   "layer_overhead_us": fit[1] * 1e6, "unit_overhead_us": fit[2] * 1e6,
                                   "elementwise_gbps": 1 / (fit[4] * 1e9) if fit[4] else 0.0,
                                   "moe_overhead_us": fit[5] * 1e6,
                                   "intra_latency_us": 60 + fit[3] * 1e6, "inter_latency_us": 60 + fit[3] * 1e6})
    for label, model in (("dense", DENSE), ("moe", MOE)):
        base = BASE + model
        best = search(compose_command_line(base), cluster, 2, 1)
        if not best:
            failed(f"search {label}", "no layout fits")
            continue
        predicted, chosen, _ = best[0]
        overrides = base + [f"{k}={v}" for k, v in chosen.items()]
        key = "_search " + label
        if cache.get(key, {}).get("overrides") != overrides:
            measured = spawn(measure_rank, overrides, steps, world=2, timeout=600)
            cache[key] = {"overrides": overrides, "measured": measured, "predicted_s": predicted,
                          "load": os.getloadavg()[0]}


def _search_lines(names: list[str], cs: list[dict], cache: dict) -> list[str]:
    """For each model's 2-rank layouts: what the search and the calibrated plan pick, against the measured best."""
    lines = []
    for label in ("dense 2r", "moe 2r"):
        group = [(n, c) for n, c in zip(names, cs) if n.startswith(label)]
        picked = cache.get("_search " + label.split()[0])
        if group and picked:
            best = min(group, key=lambda x: x[1]["time_measured"])
            t = statistics.median(picked["measured"][0]["step_times"][1:])
            chosen = " ".join(o for o in picked["overrides"] if o.split("=")[0] not in ("model", *(
                x.split("=")[0] for x in BASE)))
            lines.append(f"- `recipes.plan search --world 2` for `{label.split()[0]}` (calibrated cpu cluster) picks "
                         f"`{chosen}`: {t * 1e3:.1f} ms measured against the grid's fastest {best[0]} "
                         f"({best[1]['time_measured'] * 1e3:.1f} ms): {t / best[1]['time_measured']:.2f}x")
        if group:
            pick = min(group, key=lambda x: x[1]["time_calibrated"])
            best = min(group, key=lambda x: x[1]["time_measured"])
            ratio = pick[1]["time_measured"] / best[1]["time_measured"]
            lines.append(f"- planner's pick among the {len(group)} `{label}` layouts: {pick[0]} "
                         f"({pick[1]['time_measured'] * 1e3:.1f} ms measured) against the measured best {best[0]} "
                         f"({best[1]['time_measured'] * 1e3:.1f} ms): {ratio:.2f}x")
    return lines


def gemm_cache_lines(cache: dict) -> list[str]:
    """The `--gemm-caches` measurement, if the cache holds one (a line of summarize's)."""
    caches = cache.get("_gemm_cache_entry_kb")
    if not caches:
        return []
    return ["- bf16 GEMM caches (each bf16 layout again with oneDNN's and ideep's per-shape caches at one entry): "
            + "; ".join(f"`{n}` {c['peak_mib']:.1f} MiB against {c['one_entry_mib']:.1f}, {c['entries']} entries "
                        f"fewer: {c['kb_per_entry']:.0f} KB each" for n, c in caches.items())
            + f" (the cpu preset's gemm_cache_entry_kb: {_cpu().gemm_cache_entry_kb:g})"]


def summarize(cache: dict) -> str:
    """The grid's table and the headline figures (markdown)."""
    names = [n for n, _, _ in grid() if n in cache and "compare" in cache[n]]
    cs = [cache[n]["compare"] for n in names]
    fit = calibrate(cs) if len(cs) >= 4 else (1.0, 0.0, 0.0, 0.0)
    rows, time_err, mem_err = [], [], []
    for n, c in zip(names, cs):
        c["time_calibrated"] = calibrated(c, fit)
        te = abs(c["time_calibrated"] - c["time_measured"]) / c["time_measured"]
        me = (c["peak_predicted"] - c["peak_measured"]) / max(1, c["peak_measured"])
        time_err.append(te)
        mem_err.append(abs(me))
        rows.append([n, "exact" if c["comm_exact"] else "differs", "yes" if c["params_exact"] else "no",
                     "yes" if c["state_exact"] else "no", f"{sum(c['comm_measured'].values()):,}",
                     f"{c['peak_measured'] / 2**20:.1f}", f"{c['peak_predicted'] / 2**20:.1f}", f"{me:+.0%}",
                     f"{c['time_measured'] * 1e3:.1f}", f"{c['time_calibrated'] * 1e3:.1f}", f"{te:.0%}"])
    tau = kendall_tau([c["time_measured"] for c in cs], [c["time_calibrated"] for c in cs])
    lines = [table(["layout", "comm bytes (every rank, per kind)", "params", "optimizer state",
                    "rank-0 comm bytes/step", "peak MiB measured", "predicted", "error", "step ms measured",
                    "predicted (calibrated)", "error"], rows), ""]
    n_exact = sum(c["comm_exact"] for c in cs)
    lines.append(f"- layouts: {len(cs)}; communication bytes per kind equal on every rank: {n_exact}/{len(cs)}; "
                 f"parameters exact: {sum(c['params_exact'] for c in cs)}/{len(cs)}; optimizer state exact: "
                 f"{sum(c['state_exact'] for c in cs)}/{len(cs)}")
    if cs:
        lines.append(f"- peak memory: median |error| {statistics.median(mem_err):.1%}, within 10% for "
                     f"{sum(e <= 0.10 for e in mem_err)}/{len(cs)} layouts")
        # where nothing but the engine's state should outlive a step: no offload buffers, no pipeline outputs
        plain = [n for n in names if not any(k in " ".join(cache[n]["overrides"]) for k in (
            "offload_optimizer=", "offload_params=", "parallel.pp=", "dtype=bf16"))]
        retained = [m["retained"] / 2**20 for n in plain for m in cache[n]["measured"] if "retained" in m]
        if retained:
            from recipes.planner import load_cluster

            lines.append(f"- resident beyond the engine's state after the steps (no activation alive), every rank "
                         f"of the {len(plain)} fp32 layouts without offload or pipeline: median "
                         f"{statistics.median(retained):.1f} MiB, quartiles "
                         f"{statistics.quantiles(retained, n=4)[0]:.1f}-{statistics.quantiles(retained, n=4)[2]:.1f}"
                         f" MiB (the cpu preset's runtime_memory_mb: {load_cluster('cpu').runtime_memory_mb:g})")
        lines += gemm_cache_lines(cache)
        gflops, bf16 = cache.get("_gemm_flops", 0) / 1e9, cache.get("_gemm_flops_bf16", 0) / 1e9
        lines.append(f"- step time: calibrated as {fit[0]:.2f} x the GEMM compute (at the measured GEMM rates "
                     f"{gflops:.1f} GFLOP/s fp32, {bf16:.1f} bf16) + {fit[1] * 1e6:.0f} us per layer pass + "
                     f"{fit[2] * 1e6:.0f} us per ZeRO-3 unit event + {fit[3] * 1e6:.0f} us per collective call + "
                     f"{fit[4] * 1e12:.1f} us per MB of activation + {fit[5] * 1e6:.0f} us per MoE layer pass "
                     f"(host and memory-bound terms x2 where 4 ranks share the 2 cores; communication and the "
                     f"optimizer step as predicted); median error {statistics.median(time_err):.0%}, Kendall tau "
                     f"{tau:.2f}")
        lines.append(f"- fitted terms, exactly (the cpu preset's): GEMM compute x {fit[0]:.4f}, layer_overhead_us "
                     f"{fit[1] * 1e6:.0f}, unit_overhead_us {fit[2] * 1e6:.0f}, link latency "
                     f"{60 + fit[3] * 1e6:.0f} us, elementwise_gbps {1 / (fit[4] * 1e9) if fit[4] else 0:.3f}, "
                     f"moe_overhead_us {fit[5] * 1e6:.0f}")
    lines += _search_lines(names, cs, cache)
    loads = [cache[n].get("load", 0) for n in names]
    if loads:
        lines.append(f"- load average (1 min) while measuring: median {statistics.median(loads):.1f}, "
                     f"max {max(loads):.1f} on {os.cpu_count()} cores")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cache", default="runs/planner_bench.json")
    parser.add_argument("--only", default=None, help="layouts whose name contains this")
    parser.add_argument("--steps", type=int, default=6)  # (the grid in planner.md: 6, quiet)
    parser.add_argument("--time-only", action="store_true", help="remeasure cached layouts (step times)")
    parser.add_argument("--write", action="store_true", help="write the table into benchmarks/planner.md")
    parser.add_argument("--search", action="store_true", help="also run and measure recipes.plan search's picks")
    parser.add_argument("--quick", action="store_true", help="two layouts, two steps, nothing cached (a smoke run)")
    parser.add_argument("--host", action="store_true",
                        help="the host-memory grid instead (build, init_from load, first step; docs/planner_host.md)")
    parser.add_argument("--host-predict", action="store_true",
                        help="with --host: predict again against the measurements in runs/planner_host.json")
    parser.add_argument("--gemm-caches", action="store_true",
                        help="also measure the bf16 layouts with the GEMM caches at one entry (gemm_cache_entry_kb)")
    args = parser.parse_args(argv)
    if args.quick:
        return quick(args)
    if args.host:
        return host_main(args)
    cache = run(args)
    if args.gemm_caches:
        gemm_cache_check(cache, args.steps)
        _save(cache, args.cache)
    if args.search:
        names = [n for n, _, _ in grid() if n in cache and "compare" in cache[n]]
        search_check(cache, calibrate([cache[n]["compare"] for n in names]), args.steps)
        _save(cache, args.cache)
    text = summarize(cache)
    print(text)
    if args.write:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "planner.md")
        head = open(path).read().split("<!-- table -->")[0] if os.path.exists(path) else "# Planner\n\n"
        with open(path, "w") as f:
            f.write(head + "<!-- table -->\n" + text + "\n")
    finish()


QUICK = ("dense 2r dp2 z2 accum2", "moe 2r ep2 z1")


def quick(args) -> None:
    """Two layouts trained two steps and predicted: every rank's bytes per kind, measured / predicted."""
    import tempfile

    quick_mode(True, "recipes.pretrain", "recipes.planner")
    args.cache, args.steps, args.time_only = os.path.join(tempfile.mkdtemp(), "quick.json"), 2, False
    args.base = QUICK_BASE
    for name in QUICK:
        args.only = name
        cache = run(args)
        c = cache.get(name, {}).get("compare")
        if c is not None:
            print_ratio(f"{name}: rank-0 comm bytes per step, measured / predicted",
                        sum(c["comm_measured"].values()) / max(1, sum(c["comm_predicted"].values())),
                        "every rank and kind equal" if c["comm_exact"] else "DIFFERENT")
            if not c["comm_exact"]:
                failed(name, "communication bytes differ from the prediction")
    finish()


if __name__ == "__main__":
    main()
