"""Block-sparse attention layouts and native sparse attention against dense PyTorch SDPA (causal), CPU.

Forward + backward of one attention call (batch 1, 8 heads, head_dim 64, fp32) at 2k-64k tokens. Every
(mode, length) runs in a fresh process: its time is the median of the timed runs (one warm-up first when a
run is short) and its memory the peak RSS growth over the process after the inputs exist. A probe starts
when the machine is quiet and is repeated (up to 3 times) if other processes used over 15% of a core while
it ran; `--repeats` more runs keep the fastest. Prints one table, the ratios to dense, the longest sparse
length that fits the step time dense needs at 4k, and writes a log-log plot of time against length beside
this script.

    python benchmarks/sparse_attention.py --repeats 2           # everything (~16 minutes on a quiet 2-core CPU)
    python benchmarks/sparse_attention.py --quick               # 1k only, no waiting for quiet: a smoke run
    python benchmarks/sparse_attention.py --probe fixed 16384   # one measurement, printed as JSON
    python benchmarks/sparse_attention.py --resume run.log      # re-measure only what run.log lacks or had noisy
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time

if not __package__:  # run as a file: the repository root leads sys.path, not this folder (its zero.py)
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from benchmarks import common  # noqa: E402

ROOT = common.ROOT

HEADS, HEAD_DIM, BLOCK = 8, 64, 64
# The layouts at the sizes of the issue: 64-token blocks, a 4-block window, 1-2 global blocks.
LAYOUTS = {
    "fixed": dict(layout="fixed", window_blocks=4, global_blocks=1),
    "bigbird": dict(layout="bigbird", window_blocks=4, global_blocks=1, random_blocks=1),
    "longformer": dict(layout="longformer", window_blocks=4, global_tokens=(0, 64)),  # 2 global blocks
    "sliding_window": dict(layout="sliding_window", window_blocks=4),
    "variable": dict(layout="variable", local_window_blocks=(4,), global_block_indices=(0, 1)),
}
MODES = ("dense", *LAYOUTS, "nsa")
LENGTHS = (2048, 4096, 8192, 16384, 32768, 65536)
# A probe projected (from the previous length, x4 for dense, x2 for sparse) to run longer than this is
# skipped and reported as such.
MAX_PROBE_S = 240.0


def probe(mode: str, seq: int, runs: int = 3) -> dict:
    """Time and peak memory of forward + backward of `mode` at `seq` tokens, in this process: the median of
    `runs` runs after a warm-up one (the first alone when it took over 5 s)."""
    import torch
    from moe_lst.kernels.attention import attention
    from moe_lst.kernels.nsa import Compressor, NativeSparseAttention, NSAConfig
    from moe_lst.kernels.sparse import SparseConfig, block_layout, block_sparse_attention

    torch.manual_seed(0)
    shape = (1, seq, HEADS, HEAD_DIM)
    q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape)
    extra = {}
    if mode == "dense":
        def fn():
            return attention(q, k, v, causal=True)
    elif mode == "nsa":
        cfg = NSAConfig()  # the paper's sizes: l=32, d=16, 64-token blocks, 16 selected, 512-token window
        ck, cv = (Compressor(HEAD_DIM, cfg.compress_block, cfg.compress_stride) for _ in range(2))
        nsa = NativeSparseAttention(cfg, ck, cv)
        gates = torch.rand(1, seq, HEADS, 3, requires_grad=True)

        def fn():
            return nsa(q, k, v, gates=gates)
    else:
        layout = block_layout(SparseConfig(block_size=BLOCK, **LAYOUTS[mode]), seq, True)
        extra = {"blocks": layout.nnz, "density": round(layout.density, 4)}

        def fn():
            return block_sparse_attention(q, k, v, layout)

    base = common.reset_peak_rss()  # the peak from here: the inputs exist already

    def run() -> float:
        start = time.perf_counter()
        fn().backward(grad)
        q.grad = k.grad = v.grad = None
        return time.perf_counter() - start

    first = run()
    times = [first] if first > 5 else [run() for _ in range(runs)]
    return {"mode": mode, "seq": seq, "time_s": statistics.median(times), "peak_mib": common.peak_rss_mb() - base,
            **extra}


def _cpu_busy_s() -> float:
    """CPU seconds all processes on the machine have used (busy jiffies of /proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _wait_for_quiet(max_wait_s: float = 600.0) -> None:
    """Wait until other processes use under a tenth of a core over a second (or max_wait_s passed)."""
    deadline = time.monotonic() + max_wait_s
    while time.monotonic() < deadline:
        before = _cpu_busy_s()
        time.sleep(1.0)
        if _cpu_busy_s() - before < 0.1:
            return


def _run_probe(mode: str, seq: int, timeout: float, attempts: int = 3, quiet: bool = True, timed: int = 3) -> dict:
    """One probe in a fresh process, on a quiet machine: a probe during which other processes used more than
    15% of a core is repeated (up to `attempts` times; the fastest run is kept and flagged if none was quiet).
    quiet=False (quick runs): at once, one attempt, the load of other processes not measured. `timed`: timed
    runs of the probe."""
    env = {"MALLOC_MMAP_THRESHOLD_": str(256 * 1024)}  # freed tensors leave RSS: peaks are real
    runs = []
    for _ in range(attempts if quiet else 1):
        if quiet:
            _wait_for_quiet()
        busy, ours, start = _cpu_busy_s(), _children_cpu_s(), time.monotonic()
        try:
            (result,) = common.spawn(probe, mode, seq, timed, timeout=timeout, env=env)
        except common.RankTimeout:
            return {"mode": mode, "seq": seq, "skipped": f"over {timeout:.0f} s"}
        except common.RankFailed as e:
            common.failed(f"probe {mode} {seq}", e)
            return {"mode": mode, "seq": seq, "skipped": f"failed: {common.last_line(e)}"}
        if not quiet:
            return result
        others = (_cpu_busy_s() - busy) - (_children_cpu_s() - ours)
        result["other_load"] = round(max(0.0, others) / (time.monotonic() - start), 2)  # cores used by others
        runs.append(result)
        if result["other_load"] < 0.15 or result["time_s"] > 60:  # a minute-long probe is not repeated
            break
    quiet_runs = [r for r in runs if r["other_load"] < 0.15]
    best = min(quiet_runs or runs, key=lambda r: r["time_s"])
    if not quiet_runs:
        best["noisy"] = True
    return best


def _fmt_time(r: dict) -> str:
    return f"{r['time_s']:.3f}" if "time_s" in r else "-"


def _earlier_results(path: str) -> dict:
    """Quiet measurements (JSON lines) of an earlier run's log, to keep instead of measuring again."""
    kept = {}
    with open(path) as f:
        for line in f:
            if line.startswith("{"):
                r = json.loads(line)
                if "time_s" in r and not r.get("noisy"):
                    best = kept.get((r["mode"], r["seq"]))
                    kept[(r["mode"], r["seq"])] = r if best is None or r["time_s"] < best["time_s"] else best
    return kept


def table(results: dict, lengths) -> list[str]:
    lines = ["| mode | " + " | ".join(f"{s // 1024}k s (MiB)" for s in lengths) + " |",
             "|---|" + "---|" * len(lengths)]
    for mode in MODES:
        cells = []
        for s in lengths:
            r = results.get((mode, s))
            if r is None:
                cells.append("")
            elif "time_s" in r:
                cells.append(f"{r['time_s']:.3f} ({r['peak_mib']:.0f}){'*' if r.get('noisy') else ''}")
            else:
                cells.append(f"skipped: {r['skipped']}")
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    return lines


def speedups(results: dict, lengths) -> list[str]:
    lines = ["| mode | " + " | ".join(f"{s // 1024}k" for s in lengths) + " |", "|---|" + "---|" * len(lengths)]
    for mode in MODES[1:]:
        cells = []
        for s in lengths:
            dense, ours = results.get(("dense", s), {}), results.get((mode, s), {})
            ok = "time_s" in dense and "time_s" in ours
            cells.append(f"{dense['time_s'] / ours['time_s']:.1f}x" if ok else "-")
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    return lines


def longest_within(results: dict, mode: str, budget: float, lengths) -> tuple[int, float] | None:
    """The longest measured length of `mode` at or under `budget` seconds, and its time."""
    fits = [(s, results[(mode, s)]["time_s"]) for s in lengths
            if "time_s" in results.get((mode, s), {}) and results[(mode, s)]["time_s"] <= budget]
    return max(fits) if fits else None


def plot(results: dict, lengths, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5), dpi=130)
    for mode in MODES:
        pts = [(s, results[(mode, s)]["time_s"]) for s in lengths if "time_s" in results.get((mode, s), {})]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=mode, linestyle="--" if mode == "dense" else "-")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("forward + backward (s)")
    ax.set_title("attention, 8 heads x 64, fp32, 2-core CPU", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def layout_images(path: str, seq: int = 2048) -> None:
    """The five layouts at `seq` tokens side by side (block masks, causal)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from moe_lst.kernels.sparse import SparseConfig, block_layout

    fig, axes = plt.subplots(1, len(LAYOUTS), figsize=(3 * len(LAYOUTS), 3.6), dpi=110, layout="constrained")
    for ax, (name, kw) in zip(axes, LAYOUTS.items()):
        layout = block_layout(SparseConfig(block_size=BLOCK, **kw), seq, True)
        ax.imshow(layout.block_mask().numpy(), cmap="Greys", interpolation="nearest")
        ax.set_title(f"{name}\n{layout.nnz} blocks, density {layout.density:.2f}", fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    args = _parse_args()
    if args.probe:
        print(json.dumps(probe(args.probe[0], int(args.probe[1]))))
        return
    import torch

    quick = args.quick
    common.quick_mode(quick, "moe_lst.kernels.sparse", "moe_lst.kernels.nsa")
    if args.out is None:
        args.out = os.path.join(tempfile.mkdtemp() if quick else os.path.join(ROOT, "benchmarks"), "sparse_attention")
    lengths = (1024,) if quick else LENGTHS
    budget_seq, refine = (1024, 0) if quick else (4096, 2)  # the budget: dense's step time at budget_seq tokens
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, heads {HEADS}, head_dim {HEAD_DIM}, "
          f"block {BLOCK}", flush=True)

    def measure(mode: str, seq: int) -> dict:
        return _run_probe(mode, seq, timeout=3 * MAX_PROBE_S, quiet=not quick, timed=1 if quick else 3)

    kept = _earlier_results(args.resume) if args.resume else {}
    results = _measure_all(args.modes, lengths, kept, measure, args.repeats)
    lines = ["Forward + backward seconds (peak MiB above the inputs; * = other processes used over 15% of a core "
             "during every attempt):", "", *table(results, lengths), "",
             "Speed-up over dense SDPA (dense time / mode time):", "", *speedups(results, lengths)]
    if ("dense", budget_seq) in results and "time_s" in results[("dense", budget_seq)]:
        lines += _within_dense_time(results, budget_seq, refine, args, lengths, kept, measure)
    print("\n".join(lines))
    dense = results.get(("dense", lengths[-1]), {})
    for mode in args.modes:
        r = results.get((mode, lengths[-1]), {})
        if mode != "dense" and "time_s" in dense and "time_s" in r:
            common.print_ratio(f"{lengths[-1] // 1024}k tokens fwd+bwd time, dense SDPA / {mode}",
                               dense["time_s"] / r["time_s"])
    plot(results, lengths, args.out + ".png")
    layout_images(args.out + "_layouts.png")
    print(f"plot: {args.out}.png, layouts: {args.out}_layouts.png")
    common.finish()


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probe", nargs=2, metavar=("MODE", "SEQ"))
    parser.add_argument("--quick", action="store_true", help="1k only, one timed run per cell, no waiting for quiet")
    parser.add_argument("--modes", nargs="*", default=list(MODES))
    parser.add_argument("--repeats", type=int, default=1, help="probes per cell under 30 s; the fastest is kept")
    parser.add_argument("--resume", metavar="LOG", help="keep the quiet measurements printed in an earlier run's "
                        "output and measure only the rest")
    parser.add_argument("--out", default=None, help="plot path prefix (default: benchmarks/sparse_attention; "
                        "quick: a temporary directory)")
    return parser.parse_args()


def _fastest(runs) -> dict:
    return min(runs, key=lambda r: r.get("time_s", float("inf")))


def _measure_all(modes: list[str], lengths, kept: dict, measure, repeats: int) -> dict:
    """Every (mode, length), printed as it comes: kept from an earlier run, skipped when projected over
    MAX_PROBE_S, else measured `repeats` times (while under 30 s), the fastest kept."""
    # Lengths outside, modes inside, and every probe `--repeats` times keeping the fastest: load from other
    # processes on the machine only ever slows a probe down, and it hits the modes of one length alike.
    results: dict = {}
    previous: dict = {}
    for s in lengths:
        for mode in modes:
            growth = 4 if mode == "dense" else 2.2
            if (mode, s) in kept:
                results[(mode, s)] = kept[(mode, s)]
            elif mode in previous and previous[mode] * growth > MAX_PROBE_S:
                results[(mode, s)] = {"mode": mode, "seq": s,
                                      "skipped": f"projected {previous[mode] * growth:.0f} s > {MAX_PROBE_S:.0f} s"}
            else:
                runs = [measure(mode, s)]
                while len(runs) < repeats and runs[0].get("time_s", float("inf")) < 30:
                    runs.append(measure(mode, s))
                results[(mode, s)] = _fastest(runs)
            previous[mode] = results[(mode, s)].get("time_s", float("inf"))
            print(json.dumps(results[(mode, s)]), flush=True)
    return results


def _within_dense_time(results: dict, budget_seq: int, refine: int, args, lengths, kept: dict, measure) -> list[str]:
    """The longest length of each sparse mode within dense's step time at `budget_seq` tokens: the longest
    measured one, then `refine` bisection probes towards twice it."""
    budget = results[("dense", budget_seq)]["time_s"]
    k = f"{budget_seq // 1024}k"
    lines = ["", f"Within dense's {k} step time ({budget:.3f} s), the longest length per mode (measured "
                 f"lengths, then {refine} bisection probes between the last that fits and the next):"]
    for mode in args.modes[1:] if args.modes[0] == "dense" else args.modes:
        if mode == "dense":
            continue
        best = longest_within(results, mode, budget, lengths)
        if best is None:
            lines.append(f"- {mode}: none")
            continue
        lo, hi = best[0], best[0] * 2
        for _ in range(refine):
            mid = (lo + hi) // 2 // BLOCK * BLOCK
            r = kept.get((mode, mid)) or _fastest(measure(mode, mid) for _ in range(args.repeats))
            print(json.dumps(r), flush=True)
            if r.get("time_s", float("inf")) <= budget:
                lo, best = mid, (mid, r["time_s"])
            else:
                hi = mid
        lines.append(f"- {mode}: {best[0]} tokens ({best[0] / budget_seq:.1f}x {k}) in {best[1]:.3f} s")
    return lines


if __name__ == "__main__":
    main()
