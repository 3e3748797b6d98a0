"""Million-token training steps through the recipe: `python -m recipes.pretrain +experiment=million`.

Runs the preset (sliding-window block-sparse attention, tiled MLP, tiled loss, activation
checkpointing) as a user would, each run in a fresh process (or torchrun for sp > 1), and reads what
the run recorded: per-step wall time, tokens/s, loss, peak RSS per rank, and the crop check (the last
1,000 tokens against a plain forward over their receptive field).

    python benchmarks/million_step.py                       # 131k, 262k, 524k, 1M (1 step each) + 1M x 3 steps
    python benchmarks/million_step.py --lengths 65536 131072 --steps 1 --sp 1
    python benchmarks/million_step.py --sp 2 --lengths 1048576 --steps 3
    python benchmarks/million_step.py --quick   # 512, 1k, 2k tokens (4 MLP tiles) + 2 steps at 2k, 1 thread: smoke run

Memory is checked for linearity: a line is fitted through the peaks below the longest length (least
squares, bytes per token and intercept) and the longest point's distance from that line is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a file: the repository root leads sys.path, not this folder (its zero.py)
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from benchmarks import common  # noqa: E402

ROOT = Path(common.ROOT)


def _cli(argv: list[str]) -> None:
    """`python -m recipes.pretrain <argv>` in this process (its command line, Hydra and all)."""
    import runpy

    os.chdir(ROOT)
    sys.argv = ["recipes.pretrain", *argv]
    sys.modules.pop("recipes.pretrain", None)  # preloaded by the server: run afresh as __main__, as -m does
    try:
        runpy.run_module("recipes.pretrain", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code not in (None, 0):
            raise RuntimeError(f"python -m recipes.pretrain exited with {e.code}") from e


def run(seq: int, steps: int, sp: int, crop: bool, out: Path, extra: list[str], quick: bool = False) -> dict:
    """One recipe run; its metrics (the last step's and every step's) and result. Its processes share the
    cores (quick: one thread each, as in every quick run; more only contend on a shared machine)."""
    args = ["+experiment=million", f"train.seq_len={seq}", f"train.steps={steps}", f"run_dir={out}",
            "wandb.mode=disabled", "train.progress=false", f"parallel.sp={sp}",
            f"train.crop_check_tokens={1000 if crop else 0}", *extra]
    if not crop:
        args.append("train.eval_batches=0")
    threads = 1 if quick else max(1, (os.cpu_count() or 2) // sp)
    start = time.time()
    if sp == 1:  # a fresh process (forked from a preloaded server in quick runs)
        common.spawn(_cli, args, threads=threads, env={"WANDB_MODE": "disabled"}, timeout=7200)
    else:  # torchrun, as a user launches sp > 1
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), WANDB_MODE="disabled")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(sp),
               "-m", "recipes.pretrain", *args]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"seq={seq} sp={sp} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    wall = time.time() - start
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    result = json.loads((out / "result.json").read_text())
    per_rank = [v for k, v in records[-1].items() if k.startswith("peak_rss_mb/rank")] or [records[-1]["peak_rss_mb"]]
    return {"seq": seq, "sp": sp, "steps": steps, "wall_s": wall, "records": records, "result": result,
            "peak_gib": max(per_rank) / 1024, "peak_per_rank_gib": [p / 1024 for p in per_rank]}


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares line peak = a * seq + b through (seq, peak bytes)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    a = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return a, my - a * mx


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="*", default=[131072, 262144, 524288, 1048576])
    parser.add_argument("--steps", type=int, default=1, help="steps of each length run")
    parser.add_argument("--sp", type=int, nargs="*", default=[1])
    parser.add_argument("--full", type=int, default=3, help="then this many steps at the longest length (0: none)")
    parser.add_argument("--quick", action="store_true", help="512-2k tokens, 4 MLP tiles, 2 full steps, one thread "
                        "(smoke run)")
    args = parser.parse_args()
    common.quick_mode(args.quick, "hydra", "recipes.pretrain")
    # quick: short lengths, where the preset's 64 MLP tiles (sized for 1M tokens) would be mostly overhead
    extra = ["train.tiled_mlp=4"] if args.quick else []
    if args.quick:
        args.lengths, args.steps, args.sp, args.full = [512, 1024, 2048], 1, [1], 2
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for sp in args.sp:
            for seq in args.lengths:
                rows.append(run(seq, args.steps, sp, False, Path(tmp) / f"sp{sp}_{seq}", extra, args.quick))
                r = rows[-1]
                print(f"sp={sp} seq={seq:>8}: step {r['records'][-1]['step_time_s']:.1f} s, "
                      f"{r['records'][-1]['tokens_per_s']:.0f} tokens/s, peak RSS {r['peak_gib']:.2f} GiB "
                      f"(per rank {', '.join(f'{p:.2f}' for p in r['peak_per_rank_gib'])})", flush=True)
            if len(args.lengths) >= 3:
                points = [(r["seq"], r["peak_gib"] * 2**30) for r in rows if r["sp"] == sp]
                a, b = fit(points[:-1])
                last = points[-1]
                predicted = a * last[0] + b
                print(f"sp={sp} memory: {a:.0f} bytes per token + {b / 2**30:.2f} GiB (fit below {last[0]} tokens); "
                      f"{last[0]} tokens: measured {last[1] / 2**30:.2f} GiB, line {predicted / 2**30:.2f} GiB, "
                      f"{100 * (last[1] - predicted) / predicted:+.1f}%", flush=True)
                common.print_ratio(f"sp={sp} peak RSS at {last[0]} tokens, measured / linear fit", last[1] / predicted)
            if args.full:
                seq = max(args.lengths)
                r = run(seq, args.full, sp, True, Path(tmp) / f"sp{sp}_{seq}_full", extra, args.quick)
                print(f"sp={sp} seq={seq} x {args.full} steps (wall {r['wall_s']:.0f} s for the whole run):")
                for rec in r["records"]:
                    print(f"  step {rec['step']}: loss {rec['loss']:.4f}, step time {rec['step_time_s']:.1f} s, "
                          f"{rec['tokens_per_s']:.0f} tokens/s, peak RSS {rec['peak_rss_mb'] / 1024:.2f} GiB")
                res = r["result"]
                print(f"  peak RSS per rank {', '.join(f'{p:.2f}' for p in r['peak_per_rank_gib'])} GiB; "
                      f"val_loss {res.get('val_loss')}; crop check: largest per-token loss difference "
                      f"{res.get('crop_check_max_abs_diff')} over the last {res.get('crop_check_tokens')} tokens "
                      f"(crop {res.get('crop_check_crop_len')} tokens)", flush=True)


if __name__ == "__main__":
    main()
