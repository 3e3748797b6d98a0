"""Training over slow links: bytes per step, step time under a rate-limited link, and quality at equal tokens for
AdamW, 1-bit Adam and DiLoCo (int8 deltas), each a 4-process run of the recipe (the same model and data).

    python benchmarks/slow_links.py bytes [--steps 60] [--model tiny]       exact bytes per step (zero.dist.comm)
    python benchmarks/slow_links.py --quick                                 AdamW and 1-bit Adam bytes, 6 steps
    python benchmarks/slow_links.py quality [--steps 2000] [--model small]  final validation loss, loss-vs-bytes plot
    python benchmarks/slow_links.py timing [--model small] [--rates 100mbit,1gbit,none]   (root: ip netns, tc tbf)

Bytes come from metrics.jsonl's per-step `comm_bytes` (what each rank sent, compressed bytes counted as sent), so
their ratios are exact on any machine. Timing runs the ranks inside a fresh network namespace whose loopback is
shaped by `tc qdisc add dev lo root tbf rate R` (the ranks talk over 127.0.0.1 there); it reports the median step
time of each phase and the ratio to AdamW at the same rate.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

if not __package__:  # run as a file: the repository root leads sys.path, not this folder (its zero.py)
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from benchmarks import common  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORLD = 4
BASE = ["train.seq_len=64", "train.micro_batch_size=4", "train.sample_tokens=0", "train.progress=false",
        "wandb.mode=disabled", "train.eval_batches=4", "optim.grad_clip=0", "train.keep_checkpoints=1"]


WARMUP = 0.1  # 1-bit Adam's warm-up, a fraction of the run (--warmup)
REFRESH = 10  # 1-bit Adam's variance refresh period for timing (optim=onebit_adam's default)
DILOCO_WARMUP = 0.2  # DiLoCo's synchronous warm start, a fraction of the run (--diloco-warmup; slow_links.md)
DILOCO = ["parallel.replicas=4", "optim.diloco.delta_dtype=int8", "optim.diloco.outer_lr=0.7",
          "optim.diloco.outer_momentum=0.5"]
# Further quality variants: name -> recipe overrides, each run like the others (the same model, data and steps).
ZERO_VARIANTS = {
    "zero3": ["zero.stage=3"],
    "zero3_q": ["zero.stage=3", "zero.quantize_weights=int8", "zero.quantize_gradients=int4"],
}


def diloco_warmup(steps: int, periods: tuple[int, ...] = (20, 50)) -> int:
    """DILOCO_WARMUP of the run, rounded to a multiple of the periods' least common multiple (so every DiLoCo
    variant synchronises at the same steps, those eval_every validates at)."""
    lcm = math.lcm(*periods) if periods else 1
    return lcm * round(steps * DILOCO_WARMUP / lcm)


def variants(steps: int, periods: tuple[int, ...] = (20, 50)) -> dict[str, list[str]]:
    """The runs compared: AdamW's all-reduce, 1-bit Adam (WARMUP of the run as warm-up), DiLoCo with R=4 replicas
    of one process each, int8 deltas, after a synchronous warm start of DILOCO_WARMUP of the run, synchronising
    every 20 and every 50 steps."""
    warmup = max(1, round(steps * WARMUP))
    diloco = [*DILOCO, f"optim.diloco.warmup_steps={diloco_warmup(steps, periods)}"]
    return {
        "adamw": [],
        "onebit_adam": ["optim=onebit_adam", f"optim.onebit.warmup_steps={warmup}"],
        **{f"diloco_h{h}": [*diloco, f"optim.diloco.inner_steps={h}"] for h in periods},
    }


def eval_every(steps: int, periods: tuple[int, ...] = (20, 50)) -> int:
    """About ten validations per run, each at a step where every DiLoCo variant has just synchronised (a multiple
    of the periods' least common multiple), so all variants are compared on one model, not on a replica's."""
    lcm = math.lcm(*periods)
    return lcm * max(1, steps // 10 // lcm)


def run(name: str, overrides: list[str], model: str, steps: int, out: Path, netns: str | None = None,
        eval_every: int = 0) -> list[dict]:
    """One 4-process recipe run; its metrics.jsonl records."""
    run_dir = out / name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD), "--standalone",
           "-m", "recipes.pretrain", f"model={model}", *BASE, f"train.steps={steps}", f"train.eval_every={eval_every}",
           f"run_dir={run_dir}", *overrides]
    if netns is not None:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode and status(run_dir) != "diverged":  # (a diverged run is a result: quality reports it)
        raise RuntimeError(f"{name} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def status(run_dir: Path) -> str | None:
    """result.json's status of a recipe run (complete, diverged, ...); None before it is written."""
    path = run_dir / "result.json"
    return json.loads(path.read_text())["status"] if path.exists() else None


def per_step_bytes(records: list[dict]) -> list[float]:
    return [r["comm_bytes"] for r in records if "comm_bytes" in r]


def bytes_report(model: str, steps: int, out: Path, periods: tuple[int, ...] = (20, 50)) -> dict:
    """Per-step bytes of every variant and their ratios to AdamW's."""
    found = {name: per_step_bytes(run(name, o, model, steps, out)) for name, o in variants(steps, periods).items()}
    adamw = statistics.mean(found["adamw"])
    warmup = max(1, round(steps * WARMUP))
    onebit = found["onebit_adam"]
    compressed = statistics.mean(onebit[warmup + 1 :])  # (the first compressed step also gathers the momentum)
    rows = {
        "adamw": (adamw, 1.0),
        "onebit_adam after warm-up": (compressed, adamw / compressed),
        f"onebit_adam whole run ({warmup} of {steps} steps warm-up)": (statistics.mean(onebit),
                                                                       adamw / statistics.mean(onebit)),
    }
    start = diloco_warmup(steps, periods)  # (the warm start's steps send AdamW's all-reduce)
    for h in periods:
        whole = found[f"diloco_h{h}"][start : start + (steps - start) // h * h]  # whole periods only
        rows[f"diloco_h{h} (per step over its periods)"] = (statistics.mean(whole), adamw / statistics.mean(whole))
    print(f"bytes sent per step and rank, model={model}, {WORLD} ranks, {steps} steps:")
    for label, (value, ratio) in rows.items():
        print(f"  {label:<55} {value / 1e3:>12.1f} kB   {ratio:>8.1f}x fewer than AdamW")
    common.print_ratio("bytes per step, AdamW / 1-bit Adam after warm-up", rows["onebit_adam after warm-up"][1])
    for h in periods:
        common.print_ratio(f"bytes per step, AdamW / DiLoCo H={h} int8", rows[f"diloco_h{h} (per step over its "
                                                                            "periods)"][1])
    return {"per_step": found, "rows": rows}


def quality_report(model: str, steps: int, out: Path, only: str | None = None) -> dict:
    """Final validation loss of every variant at equal tokens, and validation loss against bytes sent (plot).
    Runs already in `out` (a previous call's) are read, not repeated; `only` limits the new ones."""
    results = {}
    for name, overrides in {**variants(steps), **ZERO_VARIANTS}.items():
        if (out / name / "result.json").exists():
            records = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]
        elif only is None or name in only.split(",") or name == "adamw":
            records = run(name, overrides, model, steps, out, eval_every=eval_every(steps))
        else:
            continue
        results[name] = curve(records)
    base = results["adamw"][-1][1]
    print(f"final validation loss, model={model}, {WORLD} ranks, {steps} steps (equal tokens):")
    for name, points in results.items():
        if status(out / name) != "complete":
            result = json.loads((out / name / "result.json").read_text())
            print(f"  {name:<12} {result['status']} at step {result['step']} (last validation {points[-1][1]:.4f})")
            continue
        print(f"  {name:<12} {points[-1][1]:.4f}   {100 * (points[-1][1] / base - 1):+.2f}% vs AdamW   "
              f"{points[-1][0] / 1e6:.2f} MB sent per rank")
    plot(results, {name: status(out / name) for name in results}, f"{WORLD} ranks, model={model}, {steps} steps",
         ROOT / "benchmarks" / "slow_links.png")
    return results


def curve(records: list[dict]) -> list[tuple[float, float]]:
    """(cumulative bytes sent per rank, validation loss) at each validation of a run."""
    sent, out = 0.0, []
    for r in records:
        sent += r.get("comm_bytes", 0.0)
        if "val_loss" in r:
            out.append((sent, r["val_loss"]))
    return out


def plot(results: dict[str, list[tuple[float, float]]], statuses: dict[str, str | None], title: str,
         path: Path) -> None:
    """Validation loss against MB sent per rank (log scale), one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in results.items():
        label = name if statuses.get(name) == "complete" else f"{name} ({statuses.get(name)})"
        ax.plot([max(b, 1.0) / 1e6 for b, _ in points], [v for _, v in points], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("MB sent per rank (cumulative)")
    ax.set_ylabel("validation loss")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_runs(runs: Path, png: Path, title: str) -> None:
    """`plot` of every recipe run directory under `runs` (named as the lines are to be labelled)."""
    dirs = sorted(d for d in runs.iterdir() if (d / "metrics.jsonl").exists())
    results = {d.name: curve([json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]) for d in dirs}
    plot(results, {d.name: status(d) for d in dirs}, title, png)
    for name, points in results.items():
        print(f"  {name:<40} final {points[-1][1]:.4f}   {points[-1][0] / 1e6:,.1f} MB sent per rank")


@contextmanager
def shaped_namespace(rate: str | None):
    """A fresh network namespace whose loopback sends at most `rate` (tc tbf; None: unlimited)."""
    name = f"slowlinks{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=True)
        if rate is not None:
            bits = float(rate.lower().replace("gbit", "e9").replace("mbit", "e6"))
            burst = max(int(bits / 8 / 100), 256 * 1024)  # 10 ms of traffic, and well above lo's 64 KiB packets
            subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate",
                            rate, "burst", str(burst), "latency", "100ms"], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=False)


def timing_report(model: str, rates: list[str | None], out: Path) -> dict:
    """Median step time per variant and phase under each link rate, and the ratio to AdamW's."""
    h, steps = 50, 60
    table = {}
    for rate in rates:
        with shaped_namespace(rate) as ns:
            adamw = run("t_adamw", [], model, 12, out / str(rate), ns)
            # warm-up 2, then one whole refresh period: 9 compressed steps and the variance refresh (int8 gradients)
            onebit = run("t_onebit", ["optim=onebit_adam", "optim.onebit.warmup_steps=2",
                                      f"optim.onebit.refresh_every={REFRESH}"], model, 3 + REFRESH, out / str(rate), ns)
            diloco = run("t_diloco", ["parallel.replicas=4", "optim.diloco.delta_dtype=int8",
                                      f"optim.diloco.inner_steps={h}"], model, steps, out / str(rate), ns)
        a = statistics.median(r["step_time_s"] for r in adamw[2:])
        o = statistics.mean(r["step_time_s"] for r in onebit[3 : 3 + REFRESH])  # (the first also gathers)
        d = sum(r["step_time_s"] for r in diloco[:h]) / h  # one whole period: h - 1 local steps and one sync
        table[rate or "unlimited"] = {"adamw_s": a, "onebit_s": o, "diloco_s": d}
        print(f"  {rate or 'unlimited':>10}: AdamW {a:.3f} s/step, 1-bit Adam {o:.3f} s ({a / o:.2f}x), "
              f"DiLoCo H={h} int8 {d:.3f} s ({a / d:.2f}x)", flush=True)
    return table


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", nargs="?", default="bytes", choices=("bytes", "quality", "timing", "plot"))
    p.add_argument("--quick", action="store_true", help="AdamW and 1-bit Adam bytes over 6 steps (a smoke run)")
    p.add_argument("--model", default=None, help="recipe model (default: tiny; quality and timing: small)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (bytes: 60, quality: 2000)")
    p.add_argument("--rates", default="100mbit,1gbit,none", help="timing: link rates, 'none' = unlimited")
    p.add_argument("--out", default=None, help="where the runs write (default: a temporary directory)")
    p.add_argument("--warmup", type=float, default=WARMUP, help="1-bit Adam's warm-up, a fraction of the steps")
    p.add_argument("--diloco-warmup", type=float, default=DILOCO_WARMUP,
                   help="DiLoCo's synchronous warm start, a fraction of the steps")
    p.add_argument("--only", default=None, help="quality: comma-separated variants to run (default: all)")
    p.add_argument("--png", default=None, help="plot: the figure to write (plot draws every run under --out)")
    p.add_argument("--title", default="", help="plot: the figure's title")
    args = p.parse_args(argv)
    globals()["WARMUP"] = args.warmup
    globals()["DILOCO_WARMUP"] = args.diloco_warmup
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="slow_links_"))
    if args.quick:
        globals()["WARMUP"] = 1 / 3
        bytes_report("tiny", 6, out, periods=())  # (two runs: DiLoCo's recipe runs are tests/recipes' business)
    elif args.what == "bytes":
        bytes_report(args.model or "tiny", args.steps or 60, out)
    elif args.what == "plot":
        if not args.out or not args.png:
            raise SystemExit("plot needs --out (a directory of recipe runs) and --png")
        plot_runs(out, Path(args.png), args.title)
    elif args.what == "quality":
        quality_report(args.model or "small", args.steps or 2000, out, args.only)
    else:
        if os.geteuid() != 0:
            raise SystemExit("timing needs root (ip netns, tc)")
        rates = [None if r == "none" else r for r in args.rates.split(",")]
        print(f"step time, model={args.model or 'small'}, {WORLD} ranks in a network namespace, loopback shaped by "
              "tc tbf:", flush=True)
        timing_report(args.model or "small", rates, out)


if __name__ == "__main__":
    main()
