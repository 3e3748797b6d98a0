"""Million-token training steps through the recipe: `python -m recipes.pretrain +experiment=million`.

Runs the preset (sliding-window block-sparse attention, tiled MLP, tiled loss, activation
checkpointing) as a user would, each run in a fresh process (or torchrun for sp > 1), and reads what
the run recorded: per-step wall time, tokens/s, loss, peak RSS per rank, and the crop check (the last
1,000 tokens against a plain forward over their receptive field).

    python benchmarks/million_step.py                       # 131k, 262k, 524k, 1M (1 step each) + 1M x 3 steps
    python benchmarks/million_step.py --lengths 65536 131072 --steps 1 --sp 1
    python benchmarks/million_step.py --sp 2 --lengths 1048576 --steps 3

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

ROOT = Path(__file__).resolve().parents[1]


def run(seq: int, steps: int, sp: int, crop: bool, out: Path) -> dict:
    """One recipe run; its metrics (the last step's and every step's) and result."""
    args = ["+experiment=million", f"train.seq_len={seq}", f"train.steps={steps}", f"run_dir={out}",
            "wandb.mode=disabled", "train.progress=false", f"parallel.sp={sp}",
            f"train.crop_check_tokens={1000 if crop else 0}"]
    if not crop:
        args.append("train.eval_batches=0")
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // sp)), WANDB_MODE="disabled")
    if sp == 1:
        cmd = [sys.executable, "-m", "recipes.pretrain", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(sp),
               "-m", "recipes.pretrain", *args]
    start = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.time() - start
    if proc.returncode != 0:
        raise RuntimeError(f"seq={seq} sp={sp} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
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
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for sp in args.sp:
            for seq in args.lengths:
                rows.append(run(seq, args.steps, sp, False, Path(tmp) / f"sp{sp}_{seq}"))
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
            if args.full:
                seq = max(args.lengths)
                r = run(seq, args.full, sp, True, Path(tmp) / f"sp{sp}_{seq}_full")
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
