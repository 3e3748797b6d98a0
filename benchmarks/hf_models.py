"""Hugging Face models trained three ways: a plain loop, our engine at ZeRO-3 (through moe_lst.models.hf), and
DeepSpeed ZeRO-3 on the plain model.

Four models of 50-100M parameters, from configs written here with random init (nothing downloaded), train a few
steps on 2 gloo ranks with the same weights, batches and AdamW: an HF Llama (~56M), an HF Qwen3-MoE (~75M, 8
experts, top-2), a DeepSeek-V3-style model (~75M: multi-head latent attention, a leading dense layer, 8 routed
experts top-2 in 2 groups with sigmoid scores and the correction bias, a shared expert) and a GPT-OSS-style one
(~75M: attention sinks, sliding windows alternating with full attention, YaRN rope, 8 experts top-2 with biases and
the clamped SwiGLU). Ours runs the generic adapter (`HFCausalLM`: attention through AttentionInterface, experts
through ExpertsInterface); DeepSpeed runs transformers' own model, its experts through transformers' default
implementation.

- plain: the transformers model, torch AdamW, gradients all-reduced in one flat buffer after backward (DDP-style);
- plain+grouped (MoE only): the same loop with the sparse blocks swapped for our grouped experts
  (`adopt_moe_blocks`): the gain of the grouped experts over transformers' default expert implementation;
- ours: `HFCausalLM` (MoE blocks swapped) under our engine at stage 3 (which pins glibc's mmap threshold at
  `zero.host_mmap_threshold`, 1 MiB, on the host, and advises its fresh buffers for transparent huge pages), the
  rank started with `zero.offload.hugepages.enable_torch_huge_pages()` (torch's large host blocks advised too);
- ours+release: the same with `zero.release_host_memory=True` (glibc's free memory trimmed after backward and step);
- ours-unpinned: the same with `zero.host_mmap_threshold=0` (glibc's allocator left alone: its dynamic threshold);
- ours-4k: ours without huge pages (zero.offload.hugepages: the advice the engine gives its fresh unit-sized buffers
  turned off after initialize, torch's own large blocks not advised): the engine of runs K and L;
- ours-meta (Llama only): the same, the model built by `moe_lst.models.hf.build(config, meta=True)`, so no rank
  ever holds the whole model (its weights come from the adapter's init by name: other losses than the rest);
- deepspeed: `deepspeed.initialize` at stage 3 on the plain transformers model (built whole on every rank, as
  the plain and ours variants are; `deepspeed.zero.Init` is not used).

Prints step time and peak RSS (VmHWM, the larger rank) side by side, each variant's VmRSS after build, initialize
and the last step's forward, backward and step, the step-1 and last-step losses of every variant, and
`ratio ours/deepspeed step time` / `ratio ours/deepspeed peak memory` per model. With `--repeats N` the variants run
N rounds, interleaved (ours, DeepSpeed, ours, ...: a change of the machine's load meets every variant alike); the
figures are medians over rounds and each ratio the median of the rounds' own ratios.

    python -m benchmarks.hf_models            # full sizes, all four models
    python -m benchmarks.hf_models --models deepseek_v3,gpt_oss --variants ours,ours+release,deepspeed --repeats 3
    python -m benchmarks.hf_models --quick    # tiny sizes (Llama, Qwen3-MoE), 2 steps: a smoke run

Without DeepSpeed its side is skipped with a note.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import warnings

if not __package__:  # run as a file: the repository root leads sys.path, not this folder (its zero.py)
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from benchmarks import common  # noqa: E402
from benchmarks import zero as zero_bench  # noqa: E402

WORLD = 2
ADAMW = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
KINDS = ("llama", "qwen3_moe", "deepseek_v3", "gpt_oss")
QUICK_KINDS = ("llama", "qwen3_moe")  # a quick run's default (the others: --models)
LABELS = {"step_s": "step time", "peak_rss_mb": "peak RSS", "train_rss_mb": "train RSS"}
VARIANTS = ("plain", "plain+grouped", "ours", "ours+release", "ours-unpinned", "ours-4k", "ours-meta", "deepspeed")


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
    hidden, experts = common_size["hidden_size"], 4 if quick else 8
    if kind == "llama":  # 8 blocks of 2.95M + untied 16.4M embedding and head: 56.0M
        extra = dict(intermediate_size=4 * hidden * 11 // 16, tie_word_embeddings=False)
    elif kind == "qwen3_moe":  # 6 blocks of 7.1M (8 experts x 0.79M, attention, router) + embedding and head: 75.4M
        extra = dict(num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=hidden,
                     intermediate_size=hidden * 2, head_dim=64 if not quick else 16,
                     norm_topk_prob=True, output_router_logits=False, tie_word_embeddings=False)
        if not quick:
            common_size["num_hidden_layers"] = 6
    elif kind == "deepseek_v3":
        # DeepSeek-V3's architecture scaled down: multi-head latent attention (q and kv low-rank, a decoupled
        # rope part, interleaved rope), one leading dense layer, then MoE layers of 8 routed experts top-2 in 2
        # groups (top-1 group, sigmoid scores with the correction bias, routed scaling) plus one shared expert.
        # 1 dense block of 3.0M + 5 MoE blocks of 7.9M + embedding and head: 74.6M
        heads = common_size["num_attention_heads"]
        common_size.update(num_hidden_layers=2 if quick else 6, num_key_value_heads=heads)
        extra = dict(intermediate_size=hidden * 11 // 4, moe_intermediate_size=hidden, n_routed_experts=experts,
                     num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
                     routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=hidden // 2,
                     kv_lora_rank=hidden // 4, qk_nope_head_dim=hidden // heads // 2,
                     qk_rope_head_dim=hidden // heads // 2, v_head_dim=hidden // heads,
                     head_dim=hidden // heads // 2, tie_word_embeddings=False)
    elif kind == "gpt_oss":
        # GPT-OSS's architecture scaled down: attention with learned sinks and biases, sliding-window layers
        # (window 64) alternating with full ones, YaRN rope, 8 experts top-2 with biases and the clamped SwiGLU.
        # 6 blocks of 7.1M + embedding and head: 75.3M
        layers = 2 if quick else 6
        common_size.update(num_hidden_layers=layers)
        extra = dict(head_dim=16 if quick else 64, intermediate_size=hidden, num_local_experts=experts,
                     num_experts_per_tok=2, sliding_window=16 if quick else 64,
                     layer_types=["sliding_attention", "full_attention"] * (layers // 2),
                     rope_parameters=dict(rope_type="yarn", factor=8.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                          original_max_position_embeddings=common_size["max_position_embeddings"] // 8,
                                          rope_theta=150000.0),
                     output_router_logits=False, tie_word_embeddings=False)
    else:
        raise ValueError(f"--models: unknown model {kind!r}; choose from {', '.join(KINDS)}")
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


def ours_step(model, args, phases: Phases, release: bool = False, pinned: bool = True, huge: bool = True):
    """Our engine at ZeRO-3 around the adapter (`HFCausalLM`, sparse blocks swapped for grouped experts); `model`
    is a transformers model, or an adapted one already (e.g. built on the meta device). `release`: the engine's
    `release_host_memory` (free host memory handed back to the OS after each backward and step). `pinned=False`:
    `host_mmap_threshold=0`, glibc's allocator left alone (by default the engine pins its mmap threshold at stage 3
    on the host). `huge=False`: the huge page advice the pinned engine gives its fresh buffers turned off."""
    import torch
    from moe_lst.models.hf import HFCausalLM

    from zero.offload.hugepages import enable_huge_pages

    adapted = model if isinstance(model, HFCausalLM) else HFCausalLM(model)
    engine = common.initialize(adapted, functools.partial(torch.optim.AdamW, **ADAMW),
                               common.parallel_dims(dp=WORLD), plans=[adapted.loss_plan()], stage=3,
                               clip_grad_norm=None, reduce_bucket_size=args.bucket,
                               allgather_bucket_size=args.bucket, overlap_comm=True, prefetch_depth=1,
                               release_host_memory=release, **({} if pinned else {"host_mmap_threshold": 0}))
    if not huge:
        enable_huge_pages(False)
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
    huge = False
    if variant in ("ours", "ours-meta", "ours+release"):  # before any tensor exists: torch reads it once
        from zero.offload.hugepages import enable_torch_huge_pages

        huge = enable_torch_huge_pages()
    if variant == "deepspeed":
        import deepspeed  # noqa: F401 - its imports belong to the baseline, not to the training's RSS
    import moe_lst.models.hf  # noqa: F401
    import transformers  # noqa: F401

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
    elif variant in ("ours", "ours-meta", "ours+release", "ours-unpinned", "ours-4k"):
        train_step = ours_step(model, args, phases, release=variant == "ours+release",
                               pinned=variant != "ours-unpinned", huge=variant != "ours-4k")
    elif variant == "deepspeed":
        train_step = deepspeed_step(model, args, phases)
    else:
        raise ValueError(variant)
    phases.marks.setdefault("initialize", phases.marks["build"])  # the plain loop has nothing to initialise
    faults: list[int] = []
    figures = zero_bench.timed_steps(_counting_faults(train_step, faults), model.config.vocab_size, rank, counts,
                                     args)
    return {"params": n_params, "experts_impl": experts, **figures, "baseline_rss_mb": baseline,
            "phases": phases.marks, "faults_per_step": statistics.median(faults[args.warmup:]),
            "torch_huge_pages": huge}


def _counting_faults(train_step, faults: list[int]):
    """`train_step` appending to `faults` the minor page faults this process takes in each step."""
    import resource

    def counted(x, y):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        loss = train_step(x, y)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        return loss

    return counted


# ---------------------------------------------------------------------------- the runs and the report
def variants_of(kind: str, args: argparse.Namespace) -> list[str]:
    """The variants run for `kind`: those that apply to it (plain+grouped: a sparse-MoE block type the hand-written
    swap covers; ours-meta: a dense model), less those --variants leaves out and DeepSpeed where it cannot run."""
    applies = ["plain", *(["plain+grouped"] if kind == "qwen3_moe" else []), "ours", "ours+release", "ours-unpinned",
               "ours-4k",
               *(["ours-meta"] if kind == "llama" else []), "deepspeed"]
    chosen = ([v for v in applies if v != "ours-4k"] if args.variants is None  # ours-4k: a comparison asked for
              else [v for v in applies if v in args.variants])
    return [v for v in chosen if v != "deepspeed" or args.with_deepspeed]


def run_model(kind: str, args: argparse.Namespace) -> dict[str, list[dict]]:
    """Every variant of `kind`, each on its own 2 fresh ranks, the whole round `args.repeats` times (the variants
    interleaved, so that a change of the machine's load meets all of them alike): variant -> one row per round; a
    failed run is reported and left out."""
    rows: dict[str, list[dict]] = {}
    for round_ in range(args.repeats):
        for variant in variants_of(kind, args):
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
            row = {**zero_bench.summarise_ranks(ranks), "experts_impl": ranks[0]["experts_impl"],
                   "phases": largest["phases"], "baseline": largest["baseline_rss_mb"], "round": round_,
                   "faults": max(r["faults_per_step"] for r in ranks),
                   "torch_huge_pages": all(r["torch_huge_pages"] for r in ranks)}
            rows.setdefault(variant, []).append(row)
            print(f"done {kind} {variant} round {round_ + 1}/{args.repeats}: {row['step_s']:.3f} s/step, "
                  f"peak {row['peak_rss_mb']:.0f} MB, {row['faults']:.0f} page faults/step, torch's large blocks "
                  f"huge-page advised: {row['torch_huge_pages']}", file=sys.stderr,
                  flush=True)
    return rows


def _median(values: list[float]) -> float:
    return statistics.median(values)


def _ratio(rows: dict[str, list[dict]], ours: str, peer: str, key: str) -> tuple[float, list[float]] | None:
    """The median over rounds of `ours`' `key` / `peer`'s in the same round, and the per-round ratios (None when
    no round has both)."""
    peers = {r["round"]: r[key] for r in rows.get(peer, [])}
    each = [r[key] / peers[r["round"]] for r in rows.get(ours, []) if r["round"] in peers]
    return (_median(each), each) if each else None


def report(kind: str, runs: dict[str, list[dict]], args: argparse.Namespace) -> None:
    """The table of one model (medians over the rounds, each round's figure after them when there are several), its
    step-1 losses and its ratio lines (each the median over rounds of the ratio within a round)."""
    rows = {name: {**each[0], "step_s": _median([r["step_s"] for r in each]),
                   "peak_rss_mb": _median([r["peak_rss_mb"] for r in each]),
                   "train_rss_mb": _median([r["train_rss_mb"] for r in each])} for name, each in runs.items()}
    first = next(iter(rows.values()))
    impl = f", transformers experts implementation: {first['experts_impl']}" if first["experts_impl"] else ""
    print(f"\n{kind}: {first['params'] / 1e6:.1f}M parameters, {WORLD} gloo ranks, batch {args.batch}x{args.seq} "
          f"per rank, {args.warmup} warm-up + {args.steps} measured steps, {args.threads} thread(s)/rank, "
          f"{args.repeats} round(s) of the variants interleaved{impl}")
    print(f"{'variant':>14} {'step s':>8} {'peak RSS MB':>11} {'train RSS MB':>12}  losses")
    for name, row in rows.items():
        losses = " ".join(f"{x:.4f}" for x in row["losses"])
        print(f"{name:>14} {row['step_s']:>8.3f} {row['peak_rss_mb']:>11.0f} {row['train_rss_mb']:>12.0f}  {losses}")
    print(f"{kind} each round, step s / peak RSS MB / minor page faults per measured step (median; the rank with "
          "more):")
    for name, each in runs.items():
        print(f"{name:>14} " + "  ".join(f"{r['step_s']:.3f} / {r['peak_rss_mb']:.0f} / {r['faults']:.0f}"
                                         for r in each))
    print(f"{kind} memory at phases, MiB, the rank with the larger peak (RSS after start-up imports, then VmRSS "
          "after build and initialize and after the last step's forward, backward and step; VmHWM at the end), "
          "first round:")
    print(f"{'variant':>14} {'imports':>8} " + " ".join(f"{p:>10}" for p in PHASES) + f" {'VmHWM':>7}")
    for name, row in rows.items():
        marks = row["phases"]
        print(f"{name:>14} {row['baseline']:>8.0f} " + " ".join(f"{marks[p][0]:>10.0f}" for p in PHASES)
              + f" {marks['step'][1]:>7.0f}")
    step1 = {name: row["losses"][0] for name, row in rows.items() if name != "ours-meta"}
    spread = max(step1.values()) - min(step1.values())
    print(f"{kind} step-1 loss: " + ", ".join(f"{n} {v:.6f}" for n, v in step1.items())
          + f"; max difference {spread:.2e}")
    last = {name: row["losses"][-1] for name, row in rows.items() if name != "ours-meta"}
    print(f"{kind} last-step loss: " + ", ".join(f"{n} {v:.6f}" for n, v in last.items())
          + f"; max difference {max(last.values()) - min(last.values()):.2e}")

    def ratio(what: str, ours: str, peer: str, key: str, detail_key: str | None = None) -> None:
        found = _ratio(runs, ours, peer, key)
        if found is None:
            return
        value, each = found
        detail = [f"rounds {', '.join(f'{x:.3f}' for x in each)}"] if len(each) > 1 else []
        if detail_key:
            other = _ratio(runs, ours, peer, detail_key)
            detail.insert(0, f"{LABELS[detail_key]} {other[0]:.2f}x")
        common.print_ratio(f"{kind} {what}", value, "; ".join(detail))

    ratio("ours/deepspeed step time", "ours", "deepspeed", "step_s")
    ratio("ours/deepspeed peak memory", "ours", "deepspeed", "peak_rss_mb", "train_rss_mb")
    ratio("ours with release_host_memory/deepspeed peak memory", "ours+release", "deepspeed", "peak_rss_mb",
          "step_s")
    ratio("ours (meta-device build)/deepspeed peak memory", "ours-meta", "deepspeed", "peak_rss_mb", "step_s")
    ratio("ours, allocator left alone (host_mmap_threshold=0)/deepspeed peak memory", "ours-unpinned", "deepspeed",
          "peak_rss_mb", "step_s")
    ratio("ours/ours with the allocator left alone step time", "ours", "ours-unpinned", "step_s", "peak_rss_mb")
    ratio("ours/ours without huge page advice step time", "ours", "ours-4k", "step_s", "peak_rss_mb")
    ratio("ours/plain step time", "ours", "plain", "step_s", "peak_rss_mb")
    if "plain" in runs and "plain+grouped" in runs:
        value, _ = _ratio(runs, "plain", "plain+grouped", "step_s")
        common.print_ratio(f"{kind} plain loop step time, transformers experts / our grouped experts", value)


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
    parser.add_argument("--models", default=None, help=f"of {','.join(KINDS)} (default: all; quick: "
                        f"{','.join(QUICK_KINDS)})")
    parser.add_argument("--variants", default=None, help="of plain,plain+grouped,ours,ours+release,ours-unpinned,"
                        "ours-4k,ours-meta,deepspeed (default: every one that applies, less ours-4k)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of the variants, interleaved (figures: "
                        "medians over rounds)")
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
    args.models = args.models or ",".join(QUICK_KINDS if args.quick else KINDS)
    unknown = [k for k in args.models.split(",") if k not in KINDS]
    if unknown:
        parser.error(f"--models: unknown model(s) {', '.join(unknown)}; choose from {', '.join(KINDS)}")
    if args.variants is not None:
        args.variants = args.variants.split(",")
        unknown = [v for v in args.variants if v not in VARIANTS]
        if unknown:
            parser.error(f"--variants: unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    if args.repeats < 1:
        parser.error(f"--repeats={args.repeats}: at least 1 round")
    return args


if __name__ == "__main__":
    main()
