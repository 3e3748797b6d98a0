"""ZeRO stages 1-3: ours against DeepSpeed (same stage) and PyTorch FSDP2 (the stage-3 peer).

Trains the same ~50M-parameter Llama-style model for a few steps on 2 gloo ranks per framework, each
framework in fresh processes (so peak RSS is its own), and prints step time, peak memory, bytes sent
per step and the loss of each.

    python -m benchmarks.zero            # full run (stages 1, 2, 3)
    python -m benchmarks.zero --quick    # small model, 2 measured steps, stages 1 and 3: a smoke run (~5 s)

Without DeepSpeed (`import deepspeed` fails) its side is skipped with a note; FSDP2 always runs.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
import warnings
from collections import defaultdict

if not __package__:  # run as a file: the repository root leads sys.path, not this folder (its zero.py)
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from benchmarks import common  # noqa: E402

WORLD = 2


# ---------------------------------------------------------------------------- byte counting
def _install_counters(counts: dict) -> None:
    """Count bytes this rank sends through torch.distributed, the same convention as zero.dist.comm.

    Patching the module attributes catches every framework alike (ours, DeepSpeed, FSDP2 all call
    torch.distributed.<collective> at run time).
    """
    import inspect

    import torch.distributed as dist

    def n(group) -> int:
        return dist.get_world_size(group)

    def nbytes(t) -> int:
        return t.numel() * t.element_size()

    # name -> bytes sent, from the bound arguments of the call
    rules = {
        "all_reduce": lambda a: 2 * (n(a["group"]) - 1) / n(a["group"]) * nbytes(a["tensor"]),
        "all_gather_into_tensor": lambda a: (n(a["group"]) - 1) * nbytes(a["input_tensor"]),
        "all_gather_single": lambda a: (n(a["group"]) - 1) * nbytes(a["input_tensor"]),
        "reduce_scatter_single": lambda a: (n(a["group"]) - 1) / n(a["group"]) * nbytes(a["input"]),
        "_all_gather_base": lambda a: (n(a["group"]) - 1) * nbytes(a["input_tensor"]),
        "all_gather": lambda a: (n(a["group"]) - 1) * nbytes(a["tensor"]),
        "reduce_scatter_tensor": lambda a: (n(a["group"]) - 1) / n(a["group"]) * nbytes(a["input"]),
        "_reduce_scatter_base": lambda a: (n(a["group"]) - 1) / n(a["group"]) * nbytes(a["input"]),
        "reduce_scatter": lambda a: (n(a["group"]) - 1) / n(a["group"]) * sum(map(nbytes, a["input_list"])),
        "reduce": lambda a: (n(a["group"]) - 1) / n(a["group"]) * nbytes(a["tensor"]),
        "broadcast": lambda a: nbytes(a["tensor"]),
        "all_to_all_single": lambda a: (n(a["group"]) - 1) / n(a["group"]) * nbytes(a["input"]),
    }
    for name, rule in rules.items():
        original = getattr(dist, name)
        signature = inspect.signature(original)

        def wrapped(*args, _original=original, _rule=rule, _name=name, _sig=signature, **kwargs):
            bound = _sig.bind(*args, **kwargs)
            bound.apply_defaults()
            counts[_name] += _rule(bound.arguments)
            return _original(*args, **kwargs)

        setattr(dist, name, wrapped)


# ---------------------------------------------------------------------------- one framework
def _model_config(quick: bool):
    from moe_lst.models.llama import ModelConfig

    if quick:
        return ModelConfig(vocab_size=4096, dim=256, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=256)
    # ~52M parameters: 12 blocks of 2.95M plus a 16.4M tied embedding
    return ModelConfig(vocab_size=32000, dim=512, n_layers=12, n_heads=8, n_kv_heads=4, max_seq_len=256)


def fsdp2_step(model, **adamw):
    """FSDP2 (`fully_shard` on every block of `model.layers` and on the root) with torch AdamW: one step."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), **adamw)

    def train_step(x, y):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return train_step


def timed_steps(train_step, vocab: int, rank: int, counts: dict, args) -> dict:
    """Warm-up then measured steps on fixed random batches (this rank's rows of each global batch), every
    step between two barriers: the median measured step time, every loss, the median bytes sent per
    measured step, this process's peak RSS."""
    import torch
    import torch.distributed as dist

    g = torch.Generator().manual_seed(1234)
    batches = [torch.randint(0, vocab, (WORLD * args.batch, args.seq + 1), generator=g)
               for _ in range(args.warmup + args.steps)]
    times, losses, step_bytes = [], [], []
    for i, tokens in enumerate(batches):
        local = tokens[rank * args.batch:(rank + 1) * args.batch]
        dist.barrier()
        before = sum(counts.values())
        t0 = time.perf_counter()
        loss = train_step(local[:, :-1], local[:, 1:])
        dist.barrier()
        elapsed = time.perf_counter() - t0
        step_bytes.append(sum(counts.values()) - before)
        losses.append(loss.item())
        if i >= args.warmup:
            times.append(elapsed)
    return {"step_s": statistics.median(times), "losses": losses,
            "bytes_per_step": statistics.median(step_bytes[args.warmup:]), "peak_rss_mb": common.peak_rss_mb()}


def rank_start() -> tuple[int, dict, float]:
    """A rank's start of a run: (its rank, its byte counters, now installed, its RSS before the model)."""
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    counts: dict = defaultdict(float)
    _install_counters(counts)
    return dist.get_rank(), counts, common.rss_mb()


def _run(framework: str, stage: int, args: argparse.Namespace) -> dict:
    import torch

    rank, counts, baseline_rss = rank_start()
    from moe_lst.models.llama import Transformer

    cfg = _model_config(args.quick)
    torch.manual_seed(0)
    model = Transformer(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    adamw = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    if framework == "ours":
        engine = common.initialize(model, functools.partial(torch.optim.AdamW, **adamw),
                                   common.parallel_dims(dp=WORLD), stage=stage, clip_grad_norm=None,
                                   reduce_bucket_size=args.bucket, allgather_bucket_size=args.bucket,
                                   overlap_comm=True, prefetch_depth=1)
        train_step = common.engine_step(engine)
    elif framework == "deepspeed":
        import deepspeed

        ds_config = {
            "train_micro_batch_size_per_gpu": args.batch,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,
            "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": args.bucket,
                                  "allgather_bucket_size": args.bucket, "overlap_comm": True,
                                  "contiguous_gradients": True},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), **adamw),
                                          config=ds_config, dist_init_required=False)
        train_step = common.engine_step(engine)
    elif framework == "fsdp2":
        train_step = fsdp2_step(model, **adamw)
    else:
        raise ValueError(framework)

    return {"params": n_params, **timed_steps(train_step, cfg.vocab_size, rank, counts, args),
            "baseline_rss_mb": baseline_rss}


def run_framework(framework: str, stage: int, args) -> list[dict] | None:
    """Its ranks' figures; a peer's failure (or a run past its deadline) is said in one line and gives None."""
    if framework == "ours":
        return common.spawn(_run, framework, stage, args, world=WORLD, threads=args.threads, timeout=args.timeout)
    return common.peer(f"{framework} stage {stage}", _run, framework, stage, args, world=WORLD, threads=args.threads,
                       timeout=args.timeout)


def summarise_ranks(ranks: list[dict]) -> dict:
    """One run from its ranks' `timed_steps` figures: the slowest rank's step time, the largest rank's RSS and
    bytes sent, the losses averaged over the ranks."""
    losses = [sum(r["losses"][i] for r in ranks) / WORLD for i in range(len(ranks[0]["losses"]))]
    return {"step_s": max(r["step_s"] for r in ranks), **common.rss_over_ranks(ranks),
            "bytes_per_step": max(r["bytes_per_step"] for r in ranks), "losses": losses, "params": ranks[0]["params"]}


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    common.quick_mode(args.quick, "torch.distributed.fsdp")
    stages = [int(s) for s in args.stages.split(",")]
    frameworks = common.without_deepspeed(args.frameworks.split(","), "DeepSpeed ZeRO")
    table = {}
    for stage in stages:
        for fw in frameworks:
            if fw == "fsdp2" and stage != 3:
                continue
            ranks = run_framework(fw, stage, args)
            if ranks is None:  # (a peer that failed or did not finish: said, and left out)
                continue
            table[(fw, stage)] = summarise_ranks(ranks)
            print(f"done {fw} stage {stage}: {table[(fw, stage)]['step_s']:.3f}s/step", file=sys.stderr, flush=True)
    _print_table(table, args)
    for (fw, stage), row in table.items():
        for peer, name in (("deepspeed", "DeepSpeed"), ("fsdp2", "FSDP2")):
            other = table.get((peer, stage))
            if fw == "ours" and other:
                common.print_ratio(f"stage {stage} step time ours / {name}", row["step_s"] / other["step_s"],
                                   f"peak RSS {row['peak_rss_mb'] / other['peak_rss_mb']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({f"{fw}/{stage}": row for (fw, stage), row in table.items()}, f, indent=1)
    common.finish()


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model and few steps (smoke run)")
    parser.add_argument("--stages", default="1,2,3")
    parser.add_argument("--frameworks", default="ours,deepspeed,fsdp2")
    parser.add_argument("--steps", type=int, default=None, help="measured steps (after warmup)")
    parser.add_argument("--warmup", type=int, default=None, help="unmeasured steps first (default 2; quick 1)")
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 128; quick 64)")
    parser.add_argument("--bucket", type=int, default=25_000_000, help="reduce/all-gather bucket elements")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--json", default=None, help="also write the raw results here")
    args = parser.parse_args(argv)
    args.steps = args.steps or (2 if args.quick else 4)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    args.seq = args.seq or (64 if args.quick else 128)
    if args.quick and args.stages == parser.get_default("stages"):
        args.stages = "1,3"
    return args


def _print_table(table: dict, args) -> None:
    """Every (framework, stage) run: step time against the peers, memory, bytes sent, losses."""
    psi = next(iter(table.values()))["params"] * 4  # fp32 bytes of the model
    print(f"\nmodel: {next(iter(table.values()))['params'] / 1e6:.1f}M parameters, {WORLD} gloo ranks, "
          f"batch {args.batch}x{args.seq} per rank, {args.steps} measured steps, {args.threads} thread(s)/rank")
    header = (f"{'stage':>5} {'framework':>10} {'step s':>8} {'vs DS':>6} {'vs FSDP2':>8} {'peak RSS MB':>11} "
              f"{'train RSS MB':>12} {'MB/step':>8} {'x Psi':>6}  losses")
    # MB/step: bytes this rank sent; x Psi: the same volume in the usual ZeRO units (data-parallel
    # all-reduce = 2 Psi, i.e. sent bytes * n / (n - 1) over the fp32 model size).
    print(header)
    for (fw, stage), row in table.items():
        ds = table.get(("deepspeed", stage))
        fsdp = table.get(("fsdp2", stage))
        vs_ds = f"{row['step_s'] / ds['step_s']:.2f}" if ds else "-"
        vs_fsdp = f"{row['step_s'] / fsdp['step_s']:.2f}" if fsdp else "-"
        losses = " ".join(f"{x:.4f}" for x in row["losses"])
        print(f"{stage:>5} {fw:>10} {row['step_s']:>8.3f} {vs_ds:>6} {vs_fsdp:>8} {row['peak_rss_mb']:>11.0f} "
              f"{row['train_rss_mb']:>12.0f} {row['bytes_per_step'] / 2**20:>8.1f} "
              f"{row['bytes_per_step'] * WORLD / (WORLD - 1) / psi:>6.2f}  {losses}")


if __name__ == "__main__":
    main()
