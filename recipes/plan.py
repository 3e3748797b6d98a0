"""Plan a run before launching it: `python -m recipes.plan [--json] [--world N] OVERRIDES...` predicts, per rank,
memory by category, communication per collective kind and group, and step time for the recipe's config (the same
Hydra overrides as recipes.pretrain) on a cluster (`cluster=h100`, `cluster.inter_gbps=25`; presets in
recipes/conf/cluster/). `python -m recipes.plan search --world N OVERRIDES...` ranks the layouts that fit.
"""

from __future__ import annotations

import argparse
import json
import sys

from recipes.config import ConfigError, compose_command_line
from recipes.planner import estimate, load_cluster
from recipes.planner.host import host_fit
from recipes.planner.layouts import apply_overrides, candidate_overrides, resolve_world, valid
from recipes.planner.predict import check_planned

GiB = 2**30


def split_cluster(overrides: list[str]) -> tuple[str, dict, list[str]]:
    """(preset, cluster key overrides, the recipe's overrides) from a command line."""
    import yaml

    name, keys, rest = "cpu", {}, []
    for o in overrides:
        if o.startswith("cluster="):
            name = o.split("=", 1)[1]
        elif o.startswith("cluster."):
            k, v = o[len("cluster."):].split("=", 1)
            keys[k] = yaml.safe_load(v)
        else:
            rest.append(o)
    return name, keys, rest


def describe(est, world: int) -> str:
    lines = [f"rank {est.rank} of {world}: {est.params / 1e9:.3f}B parameters held, {est.buckets} flat buckets"]
    lines.append(f"  device memory at its peak ({est.peak_phase}): "
                 + ", ".join(f"{k} {v / GiB:.3f}" for k, v in est.memory.items() if v)
                 + f" GiB (total {est.peak_device_bytes / GiB:.3f} GiB)")
    if est.host_memory or est.nvme_bytes:
        lines.append("  host memory: " + ", ".join(f"{k} {v / GiB:.3f}" for k, v in est.host_memory.items())
                     + f" GiB; nvme {est.nvme_bytes / GiB:.3f} GiB")
    if est.host_phases:
        lines.append("  host memory by phase: " + ", ".join(f"{k} {sum(v.values()) / GiB:.3f}"
                                                           for k, v in est.host_phases.items())
                     + f" GiB (peak at {est.host_peak_phase}: " + ", ".join(
                         f"{k} {v / GiB:.3f}" for k, v in est.host_phases[est.host_peak_phase].items())
                     + f" GiB); nvme {est.nvme_bytes / GiB:.3f} GiB")
    for c in sorted(est.collectives, key=lambda c: -c.bytes):
        lines.append(f"  {c.kind:>14} over {c.group} ({c.ranks} ranks): {c.bytes / 2**20:.2f} MiB in {c.calls} calls")
    lines.append(f"  comm_bytes per step {est.comm_bytes_per_step}; step time {est.step_time_s * 1e3:.1f} ms ("
                 + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in est.time_s.items() if k != "step") + ")")
    return "\n".join(lines)


def search(cfg, cluster, world: int, top: int,
           refused: list[str] | None = None) -> list[tuple[float, dict, str | None]]:
    """Every valid layout of `world` devices that fits device memory and the host's, fastest first; `refused`
    collects a line for each layout that fits its devices but not the host."""
    check_planned(cfg)
    ranked = []
    for overrides in candidate_overrides(cfg, world):
        candidate = apply_overrides(cfg, overrides)
        if valid(candidate) is not None:
            continue
        try:
            ests = estimate(candidate, cluster, world)
        except (NotImplementedError, ValueError):
            continue
        peak = max(e.peak_device_bytes for e in ests)
        if peak > cluster.device_memory_gb * 1e9:
            continue
        host = host_fit(ests, cluster)
        if host is not None:
            if refused is not None:
                refused.append(" ".join(f"{k}={v}" for k, v in overrides.items()) + f": {host}")
            continue
        ranked.append((max(e.step_time_s for e in ests), overrides, peak))
    ranked.sort(key=lambda x: x[0])
    return ranked[:top]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    is_search = bool(argv) and argv[0] == "search"
    parser = argparse.ArgumentParser(prog="python -m recipes.plan" + (" search" if is_search else ""))
    parser.add_argument("--json", action="store_true", help="one JSON object per rank, in rank order")
    parser.add_argument("--world", type=int, default=None, help="devices (default: the product of the degrees)")
    parser.add_argument("--top", type=int, default=5, help="search: layouts to print")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args(argv[1:] if is_search else argv)
    try:
        name, keys, overrides = split_cluster(args.overrides)
        cluster = load_cluster(name, keys)
        cfg = compose_command_line(overrides)
        if is_search:
            world = args.world or 1
            refused: list[str] = []
            best = search(cfg, cluster, world, args.top, refused)
            launch = (f"torchrun --nproc_per_node {world} -m recipes.pretrain" if world > 1
                      else "python -m recipes.pretrain")
            for t, o, peak in best:
                chosen = [x for x in overrides if x.split("=", 1)[0] not in o] + [f"{k}={v}" for k, v in o.items()]
                print(f"{t * 1e3:9.1f} ms  {peak / GiB:7.2f} GiB  {launch} " + " ".join(chosen))
            if refused:
                print(f"{len(refused)} layouts fit the devices but not the host, e.g. {refused[0]}", file=sys.stderr)
            if not best:
                print(f"no layout of {world} devices fits {cluster.device_memory_gb} GB per device and "
                      f"{cluster.host_memory_gb} GB of host memory per node", file=sys.stderr)
                return 1
            return 0
        cfg = resolve_world(cfg, args.world)
        world = cfg.parallel.dp * cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.sp * cfg.parallel.get("cp", 1)
        ests = estimate(cfg, cluster, world)
    except (ConfigError, ValueError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([e.to_json() for e in ests]))
    else:
        shown = {e.rank: e for e in ests if e.rank % (world // cfg.parallel.pp) == 0}
        print("\n".join(describe(e, world) for e in shown.values()))
    host = host_fit(ests, cluster)
    if host is not None:
        print(f"does not fit the host: {host}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
