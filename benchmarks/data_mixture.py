"""The mixture loader (moe_lst.data.mixture) against what training consumes, and its memory in the number of sources.

Sources: Megatron indexed datasets (moe_lst.data.megatron) written for the run, each with many short documents (a
large index: 20 bytes per document), read memory-mapped. Two measurements, each variant in a fresh process:

1. Throughput: the global batches of the default recipe run (16 rows of 256 tokens, packing by document) drawn from
   a 10-source mixture, in tokens/s, against the tokens/s of the default model's training step (`python -m
   recipes.pretrain` with its defaults, its step_time_s after a warm-up). Goal: the loader at least 50x the step.
2. Memory: the same number of global batches drawn from 1 source, from 10 sources of that size, and from 1 source
   as large as the 10 together. The process's own (anonymous) resident memory is what loading an index or a shard
   would grow (goal: 10 sources within 10% of 1). The peak resident memory (VmHWM) also counts the pages of the
   memory-mapped files the draws touched (page cache the kernel drops under pressure), which grows with the data
   read over: it is compared between 10 sources and 1 source holding as much (goal: within 10%).

    python benchmarks/data_mixture.py            # 10 sources of 1,000,000 documents (24M tokens) each
    python benchmarks/data_mixture.py --quick    # 5,000 documents each, 20 batches: a smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

if not __package__:  # run as a file: the repository root leads sys.path, not this folder (its zero.py)
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from benchmarks import common  # noqa: E402

SEQ, ROWS = 256, 16  # the default run's train.seq_len and global batch (micro_batch_size 16, one process)


def write_sources(root: str, count: int, documents: int, name: str = "source") -> list[str]:
    """`count` Megatron datasets of `documents` documents each (lengths 1..47 tokens, ids < 256), written in
    chunks so that writing holds little memory."""
    import numpy as np
    from moe_lst.data.megatron import MegatronWriter

    prefixes = []
    for k in range(count):
        prefix = os.path.join(root, f"{name}{k}")
        writer = MegatronWriter(prefix, np.dtype("uint16"))
        rng = np.random.default_rng([k, documents])
        for first in range(0, documents, 100_000):
            lengths = rng.integers(1, 48, size=min(100_000, documents - first))
            writer.append(rng.integers(0, 256, size=int(lengths.sum())).astype(np.uint16), lengths)
        writer.close()
        writer.publish()
        prefixes.append(prefix)
    return prefixes


def _rss_parts() -> dict[str, float]:
    """RssAnon and RssFile of this process now, in MiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:")):
                out[line.split(":")[0]] = int(line.split()[1]) / 1024
    return out


def draw(prefixes: list[str], steps: int) -> dict:
    """Fresh process: open a mixture of `prefixes` (equal weights), draw `steps` global batches, time them."""
    from moe_lst.data.build import build_streams
    from moe_lst.data.streams import BatchSpec

    before = common.reset_peak_rss()
    start_parts = _rss_parts()
    cfg = {"kind": "mixture", "on_exhausted": "repeat", "packing": "document",
           "sources": [{"path": p, "weight": 1.0, "name": f"s{k}"} for k, p in enumerate(prefixes)]}
    train, _ = build_streams(cfg, BatchSpec(ROWS, 1, 1, SEQ), 0, 256)
    train.packed_batch(0, 0, 0)
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        train.packed_batch(step, 0, 0)
    seconds = time.perf_counter() - t0
    parts = _rss_parts()
    return {"tokens_per_s": steps * ROWS * SEQ / seconds, "start_mb": before, "peak_mb": common.peak_rss_mb(),
            "anon_end_mb": parts["RssAnon"], "anon_mb": parts["RssAnon"] - start_parts["RssAnon"],
            "file_mb": parts["RssFile"] - start_parts["RssFile"]}


def recipe_step(run_dir: str, quick: bool) -> dict:
    """Fresh process: the default recipe run (stdlib data, its first 2 MB) for a few steps; the median step time
    after the first."""
    import json

    from hydra import compose, initialize_config_dir

    from recipes.pretrain import train

    steps = 3 if quick else 6
    overrides = [f"run_dir={run_dir}", f"train.steps={steps}", "train.eval_batches=0", "train.sample_tokens=0",
                 "train.progress=false", "wandb.mode=disabled", "data.max_bytes=2000000"]
    if quick:
        overrides += ["model=tiny", "train.micro_batch_size=4", "train.seq_len=64"]
    conf = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes", "conf")
    with initialize_config_dir(version_base=None, config_dir=conf):
        train(compose("config", overrides=overrides))
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    times = sorted(r["step_time_s"] for r in records[1:])
    rows, seq = (4, 64) if quick else (ROWS, SEQ)
    return {"step_time_s": times[len(times) // 2], "tokens_per_s": rows * seq / times[len(times) // 2]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--documents", type=int, default=None, help="documents per source (1,000,000; quick: 5,000)")
    p.add_argument("--steps", type=int, default=None, help="global batches drawn per variant (500; quick: 20)")
    args = p.parse_args(argv)
    common.quick_mode(args.quick, "numpy", "torch", "moe_lst.data.mixture")
    documents = args.documents or (5_000 if args.quick else 1_000_000)
    steps = args.steps or (20 if args.quick else 500)
    with tempfile.TemporaryDirectory(prefix="data_mixture_") as root:
        t0 = time.perf_counter()
        prefixes = write_sources(root, 10, documents)
        large = write_sources(root, 1, 10 * documents, "large")
        size = sum(os.path.getsize(f"{p}.{e}") for p in prefixes for e in ("bin", "idx")) / 2**20
        print(f"10 sources of {documents:,} documents ({size:,.0f} MiB on disk) and one of {10 * documents:,}, "
              f"written in {time.perf_counter() - t0:.1f} s", flush=True)
        one, ten = common.spawn(draw, prefixes[:1], steps)[0], common.spawn(draw, prefixes, steps)[0]
        big = common.spawn(draw, large, steps)[0]
        step = common.spawn(recipe_step, os.path.join(root, "run"), args.quick)[0]
    rows = [[name, f"{r['tokens_per_s']:,.0f}", common.fmt(r["start_mb"], ".0f"), common.fmt(r["peak_mb"], ".0f"),
             common.fmt(r["anon_end_mb"], ".1f"), common.fmt(r["anon_mb"], ".1f"), common.fmt(r["file_mb"], ".1f")]
            for name, r in (("1 source", one), ("10 sources", ten), ("1 source of 10x the documents", big))]
    print(common.table(["mixture", "loader tokens/s", "RSS at start MiB", "VmHWM MiB", "own (anonymous) MiB",
                        "own growth MiB", "mapped file pages read MiB"], rows))
    print(f"default model's training step: {step['step_time_s']:.3f} s ({step['tokens_per_s']:,.0f} tokens/s)")
    common.print_ratio("mixture loader tokens/s over the default model's step (goal >= 50)",
                       ten["tokens_per_s"] / step["tokens_per_s"])
    common.print_ratio("the process's own (anonymous) memory, 10 sources over 1 (goal within 1.10)",
                       ten["anon_end_mb"] / one["anon_end_mb"])
    common.print_ratio("VmHWM, 10 sources over 1 source of the same 10 sources' size (goal within 1.10)",
                       ten["peak_mb"] / big["peak_mb"])
    common.print_ratio("VmHWM, 10 sources over 1 of a tenth of their size", ten["peak_mb"] / one["peak_mb"],
                       "the mapped pages of the files the draws touched: page cache, more of it over more data")
    common.finish()


if __name__ == "__main__":
    main()
