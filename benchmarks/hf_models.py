"""Hugging Face models trained three ways: a plain loop, our engine at ZeRO-3 (through moe_lst.models.hf), and
DeepSpeed ZeRO-3 on the plain model.

An HF Llama (~56M parameters) and an HF Qwen3-MoE (~75M, 8 experts, top-2), both from configs written here with
random init (nothing downloaded), train a few steps on 2 gloo ranks with the same weights, batches and AdamW:

- plain: the transformers model, torch AdamW, gradients all-reduced in one flat buffer after backward (DDP-style);
- plain+grouped (MoE only): the same loop with the sparse blocks swapped for our grouped experts
  (`adopt_moe_blocks`): the gain of the grouped experts over transformers' default expert implementation;
- ours: `HFCausalLM` (MoE blocks swapped) under our engine at stage 3;
- ours-meta (Llama only): the same, the model built by `moe_lst.models.hf.build(config, meta=True)`, so no rank
  ever holds the whole model (its weights come from the adapter's init by name: other losses than the rest);
- deepspeed: `deepspeed.initialize` at stage 3 on the plain transformers model (built whole on every rank, as
  the plain and ours variants are; `deepspeed.zero.Init` is not used).

Prints step time and peak RSS (VmHWM, the larger rank) side by side, each variant's VmRSS after build, initialize
and the last step's forward, backward and step, the step-1 losses of every variant, and
`ratio ours/deepspeed step time` / `ratio ours/deepspeed peak memory` per model.

    python -m benchmarks.hf_models            # full sizes
    python -m benchmarks.hf_models --quick    # tiny sizes, 2 steps: a smoke run

Without DeepSpeed its side is skipped with a note.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import warnings

if not __package__:  # run as a file: the repository root leads sys.path, not this folder (its zero.py)
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from benchmarks import common  # noqa: E402
from benchmarks import zero as zero_bench  # noqa: E402

WORLD = 2
ADAMW = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
KINDS = ("llama", "qwen3_moe")


# ---------------------------------------------------------------------------- models
def hf_config(kind: str, quick: bool):
    """The transformers config of `kind` at benchmark size (quick: tiny)."""
    from transformers import CONFIG_MAPPING

    if quick:
        common_size = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=256)
    else:
        common_size = dict(vocab_size=32000, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                           num_key_value_heads=4, max_position_embeddings=1024)
    if kind == "llama":  # 8 blocks of 2.95M + untied 16.4M embedding and head: 56.0M
        extra = dict(intermediate_size=4 * common_size["hidden_size"] * 11 // 16, tie_word_embeddings=False)
    else:  # 6 blocks of 7.1M (8 experts x 0.79M, attention, router) + embedding and head: 75.4M
        experts = 4 if quick else 8
        extra = dict(num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=common_size["hidden_size"],
                     intermediate_size=common_size["hidden_size"] * 2, head_dim=64 if not quick else 16,
                     norm_topk_prob=True, output_router_logits=False, tie_word_embeddings=False)
        if not quick:
            common_size["num_hidden_layers"] = 6
    return CONFIG_MAPPING[kind](**common_size, **extra)


def plain_model(kind: str, quick: bool):
    """The transformers model with its own init under seed 0 (every variant starts from these weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(hf_config(kind, quick), dtype=torch.float32)


# ---------------------------------------------------------------------------- memory at phases
PHASES = ("build", "initialize", "forward", "backward", "step")


def rss_hwm_mb() -> tuple[float, float]:
    """This process's resident memory now and its peak so far (VmRSS, VmHWM), in MiB."""
    found = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                found[key] = int(value.split()[0]) / 1024
    return found["VmRSS"], found["VmHWM"]


class Phases:
    """(VmRSS, VmHWM) after build and initialize, and after the forward, backward and step of the last step."""

    def __init__(self) -> None:
        self.marks: dict[str, tuple[float, float]] = {}

    def mark(self, phase: str) -> None:
        self.marks[phase] = rss_hwm_mb()


# ---------------------------------------------------------------------------- one training step per variant
def plain_step(model, phases: Phases):
    """Plain loop: forward, backward, one all-reduce of every gradient (flat, averaged), torch AdamW."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, **ADAMW)

    def train_step(x, y):
        loss = F.cross_entropy(model(input_ids=x, use_cache=False).logits.flatten(0, 1), y.flatten())
        phases.mark("forward")
        loss.backward()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat)
        flat.div_(WORLD)
        offset = 0
        for p in params:
            p.grad = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        phases.mark("backward")
        opt.step()
        opt.zero_grad(set_to_none=True)
        phases.mark("step")
        return loss

    return train_step


def ours_step(model, args, phases: Phases, release: bool = False):
    """Our engine at ZeRO-3 around the adapter (`HFCausalLM`, sparse blocks swapped for grouped experts); `model`
    is a transformers model, or an adapted one already (e.g. built on the meta device). `release`: the engine's
    `release_host_memory` (free host memory handed back to the OS after each backward and step)."""
    import torch

    from moe_lst.models.hf import HFCausalLM

    adapted = model if isinstance(model, HFCausalLM) else HFCausalLM(model)
    engine = common.initialize(adapted, functools.partial(torch.optim.AdamW, **ADAMW),
                               common.parallel_dims(dp=WORLD), plans=[adapted.loss_plan()], stage=3,
                               clip_grad_norm=None, reduce_bucket_size=args.bucket,
                               allgather_bucket_size=args.bucket, overlap_comm=True, prefetch_depth=1,
                               release_host_memory=release)
    phases.mark("initialize")
    return _engine_step(engine, lambda x: engine(x), phases)


def _engine_step(engine, logits_of, phases: Phases):
    """One step through an engine with the DeepSpeed-style API (ours and DeepSpeed's), marking its phases."""
    import torch.nn.functional as F

    def train_step(x, y):
        loss = F.cross_entropy(logits_of(x).flatten(0, 1), y.flatten())
        phases.mark("forward")
        engine.backward(loss)
        phases.mark("backward")
        engine.step()
        phases.mark("step")
        return loss

    return train_step


def deepspeed_step(model, args, phases: Phases):
    """DeepSpeed ZeRO-3 on the plain transformers model, torch AdamW, no clipping."""
    import deepspeed
    import torch

    config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
              "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
              "zero_optimization": {"stage": 3, "reduce_bucket_size": args.bucket,
                                    "allgather_bucket_size": args.bucket, "overlap_comm": True,
                                    "contiguous_gradients": True},
              "wall_clock_breakdown": False}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), **ADAMW),
                                      config=config, dist_init_required=False)
    phases.mark("initialize")
    return _engine_step(engine, lambda x: engine(input_ids=x, use_cache=False).logits, phases)


def _rank(kind: str, variant: str, args: argparse.Namespace) -> dict:
    """One rank of one variant: build, train the warm-up and measured steps, report."""
    if variant == "deepspeed":
        import deepspeed  # noqa: F401 - its imports belong to the baseline, not to the training's RSS
    import transformers  # noqa: F401

    import moe_lst.models.hf  # noqa: F401

    rank, counts, baseline = zero_bench.rank_start()
    if variant == "ours-meta":  # the adapter's own init by parameter name: other weights than the rest
        from moe_lst.models.hf import build

        model = build(hf_config(kind, args.quick), meta=True)
    else:
        model = plain_model(kind, args.quick)
    phases = Phases()
    phases.mark("build")
    n_params = sum(p.numel() for p in model.parameters())
    experts = getattr(model.config, "_experts_implementation", None)
    if variant == "plain":
        train_step = plain_step(model, phases)
    elif variant == "plain+grouped":
        from moe_lst.models.hf.moe import adopt_moe_blocks

        adopt_moe_blocks(model)
        train_step = plain_step(model, phases)
    elif variant in ("ours", "ours-meta", "ours+release"):
        train_step = ours_step(model, args, phases, release=variant == "ours+release")
    elif variant == "deepspeed":
        train_step = deepspeed_step(model, args, phases)
    else:
        raise ValueError(variant)
    phases.marks.setdefault("initialize", phases.marks["build"])  # the plain loop has nothing to initialise
    figures = zero_bench.timed_steps(train_step, model.config.vocab_size, rank, counts, args)
    return {"params": n_params, "experts_impl": experts, **figures, "baseline_rss_mb": baseline,
            "phases": phases.marks}


# ---------------------------------------------------------------------------- the runs and the report
def run_model(kind: str, args: argparse.Namespace) -> dict[str, dict]:
    """Every variant of `kind`, each on its own 2 fresh ranks; a failed one is reported and left out."""
    variants = ["plain", *(["plain+grouped"] if kind != "llama" else []), "ours", "ours+release",
                *(["ours-meta"] if kind == "llama" else []), "deepspeed"]
    if not args.with_deepspeed:
        variants.remove("deepspeed")
    rows = {}
    for variant in variants:
        if variant == "deepspeed":  # (a peer: its failure, or a run past its deadline, is said and left out)
            ranks = common.peer(f"DeepSpeed ZeRO-3 ({kind})", _rank, kind, variant, args, world=WORLD,
                                threads=args.threads, timeout=args.timeout)
            if ranks is None:
                continue
        else:
            try:
                ranks = common.spawn(_rank, kind, variant, args, world=WORLD, threads=args.threads,
                                     timeout=args.timeout)
            except common.RankFailed as e:
                common.failed(f"{kind} {variant}", e)
                continue
        largest = max(ranks, key=lambda r: r["peak_rss_mb"])  # its phases: the rank whose peak is reported
        rows[variant] = {**zero_bench.summarise_ranks(ranks), "experts_impl": ranks[0]["experts_impl"],
                         "phases": largest["phases"], "baseline": largest["baseline_rss_mb"]}
        print(f"done {kind} {variant}: {rows[variant]['step_s']:.3f} s/step", file=sys.stderr, flush=True)
    return rows


def report(kind: str, rows: dict[str, dict], args: argparse.Namespace) -> None:
    """The table of one model, its step-1 losses and its ratio lines."""
    first = next(iter(rows.values()))
    impl = f", transformers experts implementation: {first['experts_impl']}" if kind != "llama" else ""
    print(f"\n{kind}: {first['params'] / 1e6:.1f}M parameters, {WORLD} gloo ranks, batch {args.batch}x{args.seq} "
          f"per rank, {args.warmup} warm-up + {args.steps} measured steps, {args.threads} thread(s)/rank{impl}")
    print(f"{'variant':>14} {'step s':>8} {'peak RSS MB':>11} {'train RSS MB':>12}  losses")
    for name, row in rows.items():
        losses = " ".join(f"{x:.4f}" for x in row["losses"])
        print(f"{name:>14} {row['step_s']:>8.3f} {row['peak_rss_mb']:>11.0f} {row['train_rss_mb']:>12.0f}  {losses}")
    print(f"{kind} memory at phases, MiB, the rank with the larger peak (RSS after start-up imports, then VmRSS "
          "after build and initialize and after the last step's forward, backward and step; VmHWM at the end):")
    print(f"{'variant':>14} {'imports':>8} " + " ".join(f"{p:>10}" for p in PHASES) + f" {'VmHWM':>7}")
    for name, row in rows.items():
        marks = row["phases"]
        print(f"{name:>14} {row['baseline']:>8.0f} " + " ".join(f"{marks[p][0]:>10.0f}" for p in PHASES)
              + f" {marks['step'][1]:>7.0f}")
    step1 = {name: row["losses"][0] for name, row in rows.items() if name != "ours-meta"}
    spread = max(step1.values()) - min(step1.values())
    print(f"{kind} step-1 loss: " + ", ".join(f"{n} {v:.6f}" for n, v in step1.items())
          + f"; max difference {spread:.2e}")
    ours, ds, plain = rows.get("ours"), rows.get("deepspeed"), rows.get("plain")
    if ours and ds:
        common.print_ratio(f"{kind} ours/deepspeed step time", ours["step_s"] / ds["step_s"])
        common.print_ratio(f"{kind} ours/deepspeed peak memory", ours["peak_rss_mb"] / ds["peak_rss_mb"],
                           f"train RSS {ours['train_rss_mb'] / ds['train_rss_mb']:.2f}x")
    if "ours+release" in rows and ds:
        release = rows["ours+release"]
        common.print_ratio(f"{kind} ours with release_host_memory/deepspeed peak memory",
                           release["peak_rss_mb"] / ds["peak_rss_mb"], f"step time {release['step_s'] / ds['step_s']:.2f}x")
    if "ours-meta" in rows and ds:
        common.print_ratio(f"{kind} ours (meta-device build)/deepspeed peak memory",
                           rows["ours-meta"]["peak_rss_mb"] / ds["peak_rss_mb"],
                           f"step time {rows['ours-meta']['step_s'] / ds['step_s']:.2f}x")
    if ours and plain:
        common.print_ratio(f"{kind} ours/plain step time", ours["step_s"] / plain["step_s"],
                           f"peak RSS {ours['peak_rss_mb'] / plain['peak_rss_mb']:.2f}x")
    if plain and "plain+grouped" in rows:
        common.print_ratio(f"{kind} plain loop step time, transformers experts / our grouped experts",
                           plain["step_s"] / rows["plain+grouped"]["step_s"])


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    common.quick_mode(args.quick, "transformers", "moe_lst.models.hf")
    args.with_deepspeed = common.deepspeed_runs("the DeepSpeed ZeRO-3 side")
    warnings.filterwarnings("ignore")
    results = {kind: run_model(kind, args) for kind in args.models.split(",")}
    for kind, rows in results.items():
        if rows:
            report(kind, rows, args)
    print(f"\ncommand: python -m benchmarks.hf_models {' '.join(argv if argv is not None else sys.argv[1:])}")
    common.finish()


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, 2 steps (smoke run)")
    parser.add_argument("--models", default=",".join(KINDS))
    parser.add_argument("--steps", type=int, default=None, help="measured steps (default 3; quick 1)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured steps first")
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 128; quick 32)")
    parser.add_argument("--bucket", type=int, default=25_000_000, help="reduce/all-gather bucket elements")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args(argv)
    args.steps = args.steps or (1 if args.quick else 3)
    args.seq = args.seq or (32 if args.quick else 128)
    return args


if __name__ == "__main__":
    main()
