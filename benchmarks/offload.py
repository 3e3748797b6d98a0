"""Offload: our host AdamW step, ZeRO-3 with optimizer offload, the largest model under a memory cap, and
stage 3 against DeepSpeed ZeRO-3 and PyTorch FSDP2 on two architectures.

Part 1 times one AdamW step over 100M fp32 parameters in host memory: the optimizer our engine builds for
an offloaded step against DeepSpeedCPUAdam and torch's fused and default AdamW. Part 2 trains the ~52M
Llama of benchmarks/zero.py at stage 3 on 2 gloo ranks with optimizer offload none / cpu / nvme, against
DeepSpeed ZeRO-3 with the same offload. Part 3 searches (doubling, then bisection of the depth) the
largest Llama that trains a step under a peak-RSS cap per rank, stage 3 alone against stage 3 with the
optimizer and the parameters offloaded to nvme files. Part 4 compares stage 3 without offload against
DeepSpeed ZeRO-3 and FSDP2 on the Llama and on a GPT-2-style model. Every run is a fresh set of
processes; parts 2 and 4 run their variants in alternating rounds so load on a shared machine hits all.

    python -m benchmarks.offload                   # all four parts
    python -m benchmarks.offload --parts 1,2       # some of them
    python -m benchmarks.offload --quick           # tiny sizes, few probes and variants: a smoke run

Without DeepSpeed (`import deepspeed` fails; in a quick run also when the ops it compiles on first use are not built:
`python -m benchmarks.common --build-deepspeed-ops`) its side is skipped with a note; FSDP2 and torch's AdamW run.
A peer's run that fails or does not finish in time (in a quick run 45 s) is killed with its processes, said in one
line, and left out.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from dataclasses import replace

if not __package__:  # run as a file: the repository root leads sys.path, not this folder (its zero.py)
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from benchmarks import common  # noqa: E402
from benchmarks.common import OverMemory, fmt, table, verdict  # noqa: E402
from benchmarks.zero import WORLD, _model_config, fsdp2_step, rank_start, summarise_ranks, timed_steps  # noqa: E402

# The AdamW of every framework here (benchmarks/zero.py's hyper-parameters); no gradient clipping anywhere.
ADAMW = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


# ---------------------------------------------------------------------------- part 1: host AdamW step
def _host_adamw(n_params: int, n_tensors: int, repeats: int, with_deepspeed: bool) -> dict:
    """One process: the same AdamW step on `n_params` host fp32 elements, by each implementation."""
    import torch

    warnings.filterwarnings("ignore")
    n = n_params // n_tensors
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(n, generator=g) * 0.02 for _ in range(n_tensors)]
    grads = [torch.randn(n, generator=g) * 1e-3 for _ in range(n_tensors)]
    # Ours: what the engine runs for an offloaded step. World 1, stage 1, fp32 masters and AdamW state in
    # host memory (HostMasters), the optimizer built by zero.FastAdamW (the recipe's factory). Buckets of
    # one tensor each, so its masters are the same n_tensors flat tensors the peers step.
    engine = common.initialize(_flat_model(init), common.fast_adamw(**ADAMW), common.parallel_dims(dp=1), stage=1,
                               offload_optimizer="cpu", clip_grad_norm=None, reduce_bucket_size=n)

    def engine_backward() -> None:
        engine.backward(engine(grads))

    def engine_step() -> None:
        engine.step()

    def ours_optimizer_step() -> None:
        engine.optimizer.step()

    def restore_master_grads() -> None:
        for p, gr in zip(engine.optimizer.param_groups[0]["params"], grads):
            p.grad = gr

    peers = _host_peers(init, grads, with_deepspeed)
    first_step_diff = _first_step(engine, engine_backward, peers)
    # From here the engine's optimizer is stepped directly over its masters; their .grad are set once
    # (equal-sized random gradients; which goes to which does not matter for the time).
    restore_master_grads()
    variants = {
        "ours engine.optimizer.step()": (ours_optimizer_step, None, None),
        # it sets and clears its masters' .grad: restored after each step
        "ours engine.step()": (engine_step, engine_backward, restore_master_grads),
        **{name: (opt.step, None, None) for name, opt in peers.items()},
    }
    times = _rotating_rounds(variants, repeats)
    kind = "fused" if engine.optimizer.defaults.get("fused") else "foreach"
    engine.close()
    return {"times": times, "first_step_diff": first_step_diff, "ours_kind": kind,
            "threads": torch.get_num_threads(), "n_params": n * n_tensors, "n_tensors": n_tensors,
            "engine_optimizer": type(engine.optimizer).__name__}


def _flat_model(init: list):
    """A module of flat parameters (copies of `init`); forward(grads) = sum(p * grad), so backward leaves
    .grad == grads."""
    import torch
    import torch.nn as nn

    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weights = nn.ParameterList(nn.Parameter(t.clone()) for t in init)

        def forward(self, coefficients: list[torch.Tensor]) -> torch.Tensor:
            return sum((p * c).sum() for p, c in zip(self.weights, coefficients))

    return Flat()


def _host_peers(init: list, grads: list, with_deepspeed: bool) -> dict:
    """torch's AdamW (fused, default, foreach) and DeepSpeedCPUAdam, each over its own copy of the
    parameters, whose .grad are the shared `grads` (no optimizer here writes its gradient)."""
    import torch
    import torch.nn as nn

    def params() -> list[nn.Parameter]:
        out = [nn.Parameter(t.clone()) for t in init]
        for p, gr in zip(out, grads):
            p.grad = gr
        return out

    peers = {"torch AdamW fused": torch.optim.AdamW(params(), fused=True, **ADAMW),
             # on CPU tensors: the single-tensor for-loop path
             "torch AdamW default": torch.optim.AdamW(params(), **ADAMW),
             "torch AdamW foreach": torch.optim.AdamW(params(), foreach=True, **ADAMW)}
    if with_deepspeed:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        peers["DeepSpeedCPUAdam"] = DeepSpeedCPUAdam(params(), adamw_mode=True, **ADAMW)
    return peers


def _first_step(engine, engine_backward, peers: dict) -> dict[str, float]:
    """Warm-up: one step each (state allocation), which also checks that all compute the same update: the
    largest difference of each one's parameters from torch's default AdamW after it."""
    engine_backward()
    engine.step()
    for opt in peers.values():
        opt.step()
    reference = [p.detach() for p in peers["torch AdamW default"].param_groups[0]["params"]]

    def max_diff(values) -> float:
        return max(float((a.detach() - b).abs().max()) for a, b in zip(values, reference))

    return {"ours engine.step()": max_diff(list(engine.module.weights)),
            **{name: max_diff(opt.param_groups[0]["params"]) for name, opt in peers.items()}}


def _rotating_rounds(variants: dict, repeats: int) -> dict[str, list[float]]:
    """`repeats` rounds of every variant's timed step (prepare and restore, untimed, around it)."""
    times: dict[str, list[float]] = defaultdict(list)
    names = list(variants)
    for r in range(repeats):
        # Round-robin, the order rotated every round: load drift and what ran just before (a slow step's
        # temporaries, memory traffic) reach every variant alike.
        for name in names[r % len(names):] + names[:r % len(names)]:
            step, prepare, restore = variants[name]
            if prepare is not None:
                prepare()  # untimed: the backward that leaves the gradients engine.step() reduces
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
            if restore is not None:
                restore()
    return dict(times)


def part1(args) -> dict:
    n_params = 1_000_000 if args.quick else args.adam_params
    with_ds = common.deepspeed_runs("part 1: DeepSpeedCPUAdam", ops=("CPUAdamBuilder",))
    (res,) = common.spawn(_host_adamw, n_params, args.adam_tensors, args.repeats, with_ds,
                          threads=args.adam_threads, timeout=args.timeout)
    med = {k: statistics.median(v) for k, v in res["times"].items()}
    ours = med["ours engine.optimizer.step()"]
    peers = ["DeepSpeedCPUAdam", "torch AdamW fused", "torch AdamW default"][0 if with_ds else 1:]
    fastest = min(peers, key=med.__getitem__)
    print(f"\n## Part 1: host AdamW step, {res['n_params'] / 1e6:.0f}M fp32 parameters in {res['n_tensors']} "
          f"tensors, 1 process, {res['threads']} threads; {args.repeats} rounds, each optimizer once per "
          "round in a rotating order; median")
    print(f"ours = engine.optimizer.step(): the {res['engine_optimizer']} ({res['ours_kind']}) that zero.FastAdamW "
          "built over the engine's host fp32 masters (ZeroConfig(stage=1, offload_optimizer='cpu'), world 1)\n")
    diff = res["first_step_diff"]
    # Paired: this optimizer's time over ours in the same round (> 1: ours is faster), median over rounds.
    ours_times = res["times"]["ours engine.optimizer.step()"]
    paired = {k: statistics.median(t / o for t, o in zip(v, ours_times)) for k, v in res["times"].items()}
    rows = [[name, f"{t:.4f}", f"{res['n_params'] / t / 1e6:.0f}", f"{med[fastest] / t:.2f}", f"{paired[name]:.2f}",
             " ".join(f"{x:.4f}" for x in res["times"][name]), f"{diff.get(name, diff['ours engine.step()']):.1e}"]
            for name, t in med.items()]
    print(table(["optimizer", "median s", "M params/s", "throughput vs fastest peer (medians)",
                 "its time / ours, same round (median)", "every step s", "max abs diff vs default after step 1"],
                rows))
    print(f"\ntarget ours >= fastest peer ({fastest}): throughput ratio of medians {med[fastest] / ours:.2f}, "
          f"median of same-round ratios {paired[fastest]:.2f} "
          f"({'met' if paired[fastest] >= 1.0 else 'MISSED'} on the same-round ratio)")
    common.print_ratio(f"host AdamW step time, fastest peer ({fastest}) / ours, same round", paired[fastest])
    return {"median_s": med, "paired": paired, **res}


# ---------------------------------------------------------------------------- models
def _gpt2_class():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class GPT2Block(nn.Module):
        """Pre-LayerNorm block: multi-head causal attention and a 4x GELU MLP, with biases."""

        def __init__(self, dim: int, n_heads: int) -> None:
            super().__init__()
            self.n_heads = n_heads
            self.ln_1 = nn.LayerNorm(dim)
            self.qkv = nn.Linear(dim, 3 * dim)
            self.attn_proj = nn.Linear(dim, dim)
            self.ln_2 = nn.LayerNorm(dim)
            self.fc = nn.Linear(dim, 4 * dim)
            self.mlp_proj = nn.Linear(4 * dim, dim)

        def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
            b, s, d = x_BSD.shape
            # [b, s, 3d] -> 3 x [b, heads, s, head_dim]
            q, k, v = self.qkv(self.ln_1(x_BSD)).view(b, s, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
            x_BSD = x_BSD + self.attn_proj(y)
            return x_BSD + self.mlp_proj(F.gelu(self.fc(self.ln_2(x_BSD)), approximate="tanh"))

    class GPT2(nn.Module):
        """GPT-2-style decoder: learned positions, LayerNorm, GELU MLP, output tied to the token embedding."""

        def __init__(self, vocab_size: int, dim: int, n_layers: int, n_heads: int, max_seq_len: int) -> None:
            super().__init__()
            self.wte = nn.Embedding(vocab_size, dim)
            self.wpe = nn.Embedding(max_seq_len, dim)
            self.layers = nn.ModuleList(GPT2Block(dim, n_heads) for _ in range(n_layers))
            self.ln_f = nn.LayerNorm(dim)
            # GPT-2 init: N(0, 0.02), residual projections scaled by 1/sqrt(2L), zero biases.
            for name, p in self.named_parameters():
                if name.endswith("bias"):
                    nn.init.zeros_(p)
                elif p.dim() > 1:
                    std = 0.02 / math.sqrt(2 * n_layers) if name.endswith("proj.weight") else 0.02
                    nn.init.normal_(p, 0.0, std)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            h = self.wte(tokens) + self.wpe(positions)
            for layer in self.layers:
                h = layer(h)
            return F.linear(self.ln_f(h), self.wte.weight)

    return GPT2


def build_model(arch: str, quick: bool, n_layers: int | None = None, meta: bool = False):
    """The Llama of benchmarks/zero.py (depth optionally changed), or a GPT-2-style model of about its size.

    meta=True (Llama only) builds it on the meta device for the engine to materialise (param_init)."""
    import torch

    torch.manual_seed(0)
    cfg = _model_config(quick)
    if n_layers is not None:
        cfg = replace(cfg, n_layers=n_layers)
    if arch == "llama":
        from moe_lst.models.llama import Transformer

        return Transformer(cfg, device="meta" if meta else None), cfg.vocab_size
    if arch == "gpt2":
        # The Llama's vocabulary, width, depth and heads: 12 x 3.15M + 16.5M embeddings = 54.3M parameters.
        return _gpt2_class()(cfg.vocab_size, cfg.dim, cfg.n_layers, cfg.n_heads, cfg.max_seq_len), cfg.vocab_size
    raise ValueError(f"arch={arch!r}: use llama or gpt2")


# ---------------------------------------------------------------------------- parts 2 and 4: one run
def _deepspeed_config(args, offload: str, nvme_dir: str | None) -> dict:
    zero_opt: dict = {"stage": 3, "reduce_bucket_size": args.bucket, "allgather_bucket_size": args.bucket,
                      "overlap_comm": True, "contiguous_gradients": True}
    if offload == "cpu":
        zero_opt["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    elif offload == "nvme":
        zero_opt["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_dir, "pin_memory": False,
                                         "buffer_count": 4, "fast_init": False}
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        # DeepSpeed builds its own optimizer from this: DeepSpeedCPUAdam with an offloaded optimizer,
        # else its FusedAdam (the CPU build of its fused_adam op here).
        "optimizer": {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"])}},
        "zero_optimization": zero_opt,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def _train(framework: str, arch: str, offload: str, args) -> dict:
    """Train `arch` at stage 3 for warmup + steps batches under `framework`; step time, memory, losses."""
    rank, counts, baseline_rss = rank_start()
    model, vocab = build_model(arch, args.quick)
    n_params = sum(p.numel() for p in model.parameters())
    nvme_dir = None
    if offload == "nvme":
        nvme_dir = tempfile.mkdtemp(prefix=f"offload-{framework}-rank{rank}-", dir=args.nvme_dir)
    close = None
    try:
        if framework == "ours":
            engine = common.initialize(model, common.fast_adamw(**ADAMW), common.parallel_dims(dp=WORLD), stage=3,
                                       clip_grad_norm=None, reduce_bucket_size=args.bucket,
                                       allgather_bucket_size=args.bucket, overlap_comm=True, prefetch_depth=1,
                                       offload_optimizer=offload, nvme_path=nvme_dir)
            train_step, close = common.engine_step(engine), engine.close
            kind = "fused" if engine.optimizer.defaults.get("fused") else "foreach"
            optimizer = f"FastAdamW: torch AdamW {kind}"
        elif framework == "deepspeed":
            import deepspeed

            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                              config=_deepspeed_config(args, offload, nvme_dir),
                                              dist_init_required=False)
            train_step, close = common.engine_step(engine), engine.destroy
            optimizer = type(engine.basic_optimizer).__name__
        elif framework in ("fsdp2", "fsdp2-fused"):
            assert offload == "none", "FSDP2 runs without offload here"
            fused = framework == "fsdp2-fused"
            train_step = fsdp2_step(model, fused=fused or None, **ADAMW)
            optimizer = "torch AdamW fused" if fused else "torch AdamW default"
        else:
            raise ValueError(framework)

        measured = timed_steps(train_step, vocab, rank, counts, args)
    finally:
        if close is not None:
            close()
        if nvme_dir is not None:
            shutil.rmtree(nvme_dir, ignore_errors=True)
    return {"params": n_params, "optimizer": optimizer, **measured, "baseline_rss_mb": baseline_rss}


#: The peers' names in the line that says one was left out.
PEERS = {"deepspeed": "DeepSpeed ZeRO-3", "fsdp2": "FSDP2", "fsdp2-fused": "FSDP2 with fused AdamW"}


def _run_rounds(variants: list[tuple[str, str, str]], args) -> list[dict]:
    """Every (framework, arch, offload) once per round, rounds alternating: A B C, A B C, ...

    Returns one row per variant: the per-round figures (slowest rank's step time, largest rank's RSS)
    and their medians over rounds. A peer that fails or does not finish in time is said so and has no row.
    """
    runs: dict = defaultdict(list)
    left_out: set = set()  # peers that failed or did not finish: no further rounds, no row
    for r in range(args.rounds):
        for fw, arch, offload in variants:
            if (fw, arch, offload) in left_out:
                continue
            if fw == "ours":
                ranks = common.spawn(_train, fw, arch, offload, args, world=WORLD, timeout=args.timeout)
            else:
                ranks = common.peer(f"{PEERS[fw]} ({arch}, offload {offload})", _train, fw, arch, offload, args,
                                    world=WORLD, timeout=args.timeout)
                if ranks is None:
                    left_out.add((fw, arch, offload))
                    runs.pop((fw, arch, offload), None)
                    continue
            run = {**summarise_ranks(ranks), "optimizer": ranks[0]["optimizer"]}
            runs[(fw, arch, offload)].append(run)
            print(f"round {r + 1}: {fw} {arch} offload={offload}: {run['step_s']:.3f} s/step", file=sys.stderr,
                  flush=True)
    rows = []
    for (fw, arch, offload), per_round in runs.items():
        rows.append({"framework": fw, "arch": arch, "offload": offload, "rounds": per_round,
                     **{k: statistics.median(x[k] for x in per_round)
                        for k in ("step_s", "peak_rss_mb", "train_rss_mb", "bytes_per_step")},
                     "losses": per_round[0]["losses"], "params": per_round[0]["params"],
                     "optimizer": per_round[0]["optimizer"]})
    return rows


def _find(rows: list[dict], **match) -> dict | None:
    return next((r for r in rows if all(r[k] == v for k, v in match.items())), None)


def _loss_spread(rows: list[dict]) -> float:
    """Largest difference between any run's loss at a step and the first run's (every round)."""
    ref = rows[0]["rounds"][0]["losses"]
    return max(abs(a - b) for r in rows for run in r["rounds"] for a, b in zip(run["losses"], ref))


def _aio_available() -> tuple[bool, str]:
    """Whether DeepSpeed's async IO op (needed for its nvme offload) is compatible and built (or builds) here."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        if not AsyncIOBuilder().is_compatible(verbose=False):
            return False, "AsyncIOBuilder().is_compatible() is False (libaio-dev missing?)"
        why = common.deepspeed_ops_missing("AsyncIOBuilder")
    except Exception as e:  # any build or import failure means: no DeepSpeed nvme here
        return False, f"async_io op does not load: {type(e).__name__}: {e}"
    return why is None, why or "async_io op loads"


def _part_header(title: str, args) -> None:
    print(f"\n## {title}")
    print(f"{WORLD} gloo ranks, 1 thread each, batch {args.batch}x{args.seq} per rank, {args.warmup} warm-up + "
          f"{args.steps} measured steps (median), {args.rounds} alternating round(s); step time = slowest rank, "
          "RSS = largest rank; the summary takes the median over rounds")


def _print_runs(rows: list[dict], columns: list[tuple[str, object]], args) -> None:
    """One table per round, then the summary; `columns` are (header, row -> str given that round's rows)."""
    header = [h for h, _ in columns] + ["peak RSS MB", "train RSS MB", "MB sent/step", "losses"]

    def render(view: list[dict]) -> list[list[str]]:
        return [[fn(r, view) for _, fn in columns] + [f"{r['peak_rss_mb']:.0f}", f"{r['train_rss_mb']:.0f}",
                                                      f"{r['bytes_per_step'] / 2**20:.1f}",
                                                      " ".join(f"{x:.4f}" for x in r["losses"])] for r in view]

    for i in range(args.rounds):
        view = [{**r, **r["rounds"][i]} for r in rows]
        print(f"\nround {i + 1}\n")
        print(table(header, render(view)))
    print(f"\nsummary (median over {args.rounds} round(s))\n")
    print(table(header, render(rows)))


def part2(args) -> dict:
    with_ds = common.deepspeed_runs("part 2: DeepSpeed ZeRO-3 with offload", ops=(*common.DEEPSPEED_COMM,
                                                                                  "CPUAdamBuilder"))
    aio, aio_note = _aio_available() if with_ds else (False, "no DeepSpeed")
    variants = [("ours", "llama", "none"), ("ours", "llama", "cpu"), ("deepspeed", "llama", "cpu"),
                ("ours", "llama", "nvme"), ("deepspeed", "llama", "nvme")]
    variants = [v for v in variants if (v[0] == "ours" or (with_ds and (aio or v[2] != "nvme")))
                and not (args.quick and v[2] == "nvme")]  # quick: part 3 runs nvme offload (and of the params)
    rows = _run_rounds(variants, args)
    _part_header(f"Part 2: ZeRO-3 with optimizer offload, Llama {rows[0]['params'] / 1e6:.1f}M", args)
    print(f"DeepSpeed nvme offload: {aio_note}; nvme_path = a temp dir under {args.nvme_dir or tempfile.gettempdir()}")

    def vs_ds(r, view):
        ds = _find(view, framework="deepspeed", offload=r["offload"])
        return fmt(r["step_s"] / ds["step_s"]) if ds else "-"

    def vs_none(r, view):
        base = _find(view, framework="ours", offload="none")
        return fmt(r["step_s"] / base["step_s"])

    _print_runs(rows, [("offload", lambda r, v: r["offload"]), ("framework", lambda r, v: r["framework"]),
                       ("optimizer", lambda r, v: r["optimizer"]), ("step s", lambda r, v: f"{r['step_s']:.3f}"),
                       ("vs DeepSpeed same offload", vs_ds), ("vs ours no offload", vs_none)], args)
    print(f"\nlosses: largest difference from the first run, over every run and step: {_loss_spread(rows):.2e}")
    ratio = {}
    for offload in ("cpu", "nvme"):
        ours, ds = _find(rows, framework="ours", offload=offload), _find(rows, framework="deepspeed", offload=offload)
        ratio[offload] = ours["step_s"] / ds["step_s"] if ds else None
        print(f"target ours <= 0.8x DeepSpeed, {offload} offload: {verdict(ratio[offload], 0.8)}")
        if ds:
            common.print_ratio(f"stage 3 + {offload} optimizer offload step time, ours / DeepSpeed", ratio[offload])
    cpu_vs_none = _find(rows, framework="ours", offload="cpu")["step_s"] / _find(rows, framework="ours",
                                                                                  offload="none")["step_s"]
    print(f"target ours cpu offload <= 1.3x ours without offload: {verdict(cpu_vs_none, 1.3)}")
    common.print_ratio("stage 3 step time, ours cpu offload / ours without offload", cpu_vs_none)
    return {"rows": rows, "aio": aio_note}


def part4(args) -> dict:
    archs = args.archs.split(",")
    # (DeepSpeed's own optimizer here is its FusedAdam, whose CPU op it compiles on first use)
    frameworks = ["ours", "deepspeed", "fsdp2", "fsdp2-fused"]
    if not common.deepspeed_runs("part 4: DeepSpeed ZeRO-3", ops=(*common.DEEPSPEED_COMM, "FusedAdamBuilder")):
        frameworks.remove("deepspeed")
    if args.quick:  # FSDP2 with its fused AdamW only (the faster of the two)
        frameworks.remove("fsdp2")
    rows = _run_rounds([(fw, arch, "none") for arch in archs for fw in frameworks], args)
    _part_header("Part 4: stage 3 without offload, ours vs DeepSpeed ZeRO-3 vs FSDP2", args)

    def ratio_to(fw):
        def fn(r, view):
            peer = _find(view, framework=fw, arch=r["arch"])
            return fmt(r["step_s"] / peer["step_s"]) if peer else "-"
        return fn

    _print_runs(rows, [("model", lambda r, v: f"{r['arch']} {r['params'] / 1e6:.1f}M"),
                       ("framework", lambda r, v: r["framework"]), ("optimizer", lambda r, v: r["optimizer"]),
                       ("step s", lambda r, v: f"{r['step_s']:.3f}"), ("vs DeepSpeed", ratio_to("deepspeed")),
                       ("vs FSDP2", ratio_to("fsdp2")), ("vs FSDP2 fused", ratio_to("fsdp2-fused"))], args)
    for arch in archs:
        arch_rows = [r for r in rows if r["arch"] == arch]
        ours = _find(rows, framework="ours", arch=arch)["step_s"]
        fsdp = min((r["step_s"] for r in arch_rows if r["framework"] in ("fsdp2", "fsdp2-fused")), default=None)
        ds = _find(rows, framework="deepspeed", arch=arch)
        print(f"{arch}: losses differ by at most {_loss_spread(arch_rows):.2e}; "
              f"target <= 0.8x DeepSpeed: {verdict(ours / ds['step_s'] if ds else None, 0.8)}; "
              f"target <= 1.0x the faster FSDP2: {verdict(ours / fsdp if fsdp else None, 1.0)}")
        common.print_ratio(f"{arch} stage 3 step time, ours / the faster FSDP2", ours / fsdp if fsdp else None)
        if ds:
            common.print_ratio(f"{arch} stage 3 step time, ours / DeepSpeed", ours / ds["step_s"])
    return {"rows": rows}


# ---------------------------------------------------------------------------- part 3: largest model under a cap
def _probe(mode: str, n_layers: int, steps: int, args) -> dict:
    """Build the Llama with `n_layers` blocks, wrap it at stage 3 (`mode` none or nvme), train `steps` steps."""
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    peak_mb = common.peak_rss_mb
    marks = {"start": peak_mb()}
    # On the meta device, as the recipe builds stage-3 models: the engine materialises it unit by unit.
    model, vocab = build_model("llama", args.quick, n_layers, meta=True)
    n_params = sum(p.numel() for p in model.parameters())
    marks["built"] = peak_mb()
    rank = dist.get_rank()
    nvme_dir = tempfile.mkdtemp(prefix=f"rank{rank}-", dir=args.probe_dir) if mode == "nvme" else None
    engine = None
    try:
        engine = common.initialize(model, common.fast_adamw(**ADAMW), common.parallel_dims(dp=WORLD),
                                   param_init=model.init_parameter, stage=3, clip_grad_norm=None, overlap_comm=True,
                                   prefetch_depth=1, offload_optimizer=mode, offload_params=mode, nvme_path=nvme_dir)
        del model
        marks["wrapped"] = peak_mb()
        train_step = common.engine_step(engine)
        # One fixed batch, stepped on repeatedly: the loss must fall as the model fits it.
        import torch

        g = torch.Generator().manual_seed(1234)
        tokens = torch.randint(0, vocab, (WORLD * args.probe_batch, args.probe_seq + 1), generator=g)
        local = tokens[rank * args.probe_batch:(rank + 1) * args.probe_batch]
        losses, times = [], []
        for _ in range(steps):
            t0 = time.perf_counter()
            loss = train_step(local[:, :-1], local[:, 1:])
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
        marks["trained"] = peak_mb()
    finally:
        if engine is not None:
            engine.close()
        if nvme_dir is not None:
            shutil.rmtree(nvme_dir, ignore_errors=True)
    return {"params": n_params, "marks": marks, "losses": losses, "times": times}


# The C allocator of the probe processes. glibc's default raises its mmap threshold to the size of each
# large block it frees, after which blocks of the stage-3 gather/free cycle come from heaps that keep
# freed pages (RSS grows step after step); a fixed threshold returns every block over 1 MiB at once.
ALLOCATORS = {"glibc": {}, "mmap-1MiB": {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}}


def _try(mode: str, n_layers: int, steps: int, allocator: str, args, log: list[dict], cap: bool = True) -> bool:
    """One probe in fresh processes; it passes when every rank's peak RSS stayed under the cap.

    cap=False lets it run past the cap (it is then reported, not killed).
    """
    t0 = time.perf_counter()
    row = {"allocator": allocator, "mode": mode, "n_layers": n_layers, "steps": steps}
    # Files of every rank: parameter shards (fp32) and the optimizer's master, two moments and gradient.
    disk_need = _params_of(n_layers, args.quick) * (4 + 16) * 1.05
    args.probe_dir = tempfile.mkdtemp(prefix="offload-probe-", dir=args.nvme_dir)  # removed even if killed
    try:
        if mode == "nvme" and disk_need > shutil.disk_usage(args.probe_dir).free:
            raise OverMemory(f"needs {disk_need / 2**30:.0f} GiB of nvme files, "
                             f"{shutil.disk_usage(args.probe_dir).free / 2**30:.0f} GiB free")
        ranks = common.spawn(_probe, mode, n_layers, steps, args, world=WORLD, timeout=args.timeout,
                             rss_cap_mb=args.cap_mb if cap else None, env=ALLOCATORS[allocator])
    except OverMemory as e:
        row.update(ok=False, reason=str(e))
    else:
        marks = {k: max(r["marks"][k] for r in ranks) for k in ranks[0]["marks"]}
        ok = marks["trained"] <= args.cap_mb
        losses = [sum(r["losses"][i] for r in ranks) / WORLD for i in range(steps)]
        row.update(ok=ok, reason="" if ok else "peak RSS over the cap", params=ranks[0]["params"], marks=marks,
                   losses=losses, step_s=max(statistics.median(r["times"]) for r in ranks))
    finally:
        shutil.rmtree(args.probe_dir, ignore_errors=True)
    row["wall_s"] = time.perf_counter() - t0
    log.append(row)
    peak = fmt(row.get("marks", {}).get("trained"), ".0f")
    print(f"probe {allocator} {mode} {n_layers} layers x {steps} steps: {'pass' if row['ok'] else 'fail'} "
          f"(peak {peak} MB{', ' + row['reason'] if row['reason'] else ''}) in {row['wall_s']:.0f} s",
          file=sys.stderr, flush=True)
    return row["ok"]


def _search(fits, start: int, deadline: float, max_probes: int | None = None) -> tuple[int, int | None, bool]:
    """Largest depth n with fits(n): double from `start` to the first failure (halve while the start
    fails), then bisect to within ~5%. Returns (largest passing or 0, smallest failing or None, completed);
    it stops early at the deadline or after `max_probes` probes."""
    lo, hi, n, probes = 0, None, start, 0
    while hi is None or (lo == 0 and hi > 1) or hi - lo > max(1, lo // 20):
        if time.monotonic() > deadline or probes == max_probes:
            return lo, hi, False
        probes += 1
        if fits(n):
            lo = n
        else:
            hi = n
        n = 2 * lo if hi is None else hi // 2 if lo == 0 else (lo + hi) // 2
    return lo, hi, True


def _part3_allocator(allocator: str, args, deadline: float) -> dict:
    log: list[dict] = []
    found = {}
    for mode in ("none", "nvme"):
        # The offloaded search starts where stage 3 alone stopped: it only has to go up.
        start = max(2 if args.quick else 12, found.get("none", (0,))[0])
        found[mode] = _search(lambda n, mode=mode: _try(mode, n, 1, allocator, args, log), start, deadline,
                              args.max_probes)
    final = None
    if found["nvme"][0]:
        final_log: list[dict] = []
        _try("nvme", found["nvme"][0], args.final_steps, allocator, args, final_log, cap=False)
        final = final_log[0]

    def count(n: int) -> int:
        return _params_of(n, args.quick)

    print(f"\n### allocator {allocator} ({ALLOCATORS[allocator] or 'glibc defaults'})\n")
    rows = []
    for r in log + ([final] if final else []):
        m = r.get("marks", {})
        rows.append([r["mode"], str(r["n_layers"]), f"{count(r['n_layers']) / 1e6:.1f}", str(r["steps"]),
                     "pass" if r["ok"] else "fail", fmt(m.get("start"), ".0f"), fmt(m.get("built"), ".0f"),
                     fmt(m.get("wrapped"), ".0f"), fmt(m.get("trained"), ".0f"), fmt(r.get("step_s"), ".2f"),
                     f"{r['wall_s']:.0f}", r["reason"] or "-"])
    print(table(["offload", "layers", "params M", "steps", "result", "peak MB at start", "after build",
                 "after initialize", "after steps", "step s", "probe wall s", "why failed"], rows))
    print()
    for mode in ("none", "nvme"):
        lo, hi, done = found[mode]
        cut = "" if done else " (cut by the time or probe limit)"
        print(f"{mode}: largest passing {f'{lo} layers, {count(lo) / 1e6:.1f}M' if lo else '-'}; smallest failing "
              f"{f'{hi} layers, {count(hi) / 1e6:.1f}M' if hi else '-'}{cut}")
    ratio = count(found["nvme"][0]) / count(found["none"][0]) if found["none"][0] and found["nvme"][0] else None
    print(f"target >= 5x the parameters with nvme offload: {fmt(ratio)}x "
          f"({'met' if ratio and ratio >= 5 else 'MISSED'})")
    common.print_ratio(f"parameters trained under the cap, nvme offload / stage 3 alone ({allocator})", ratio)
    if final:
        losses = final.get("losses", [])
        trend = "-"
        if len(losses) > 1:
            monotone = all(b < a for a, b in zip(losses, losses[1:]))
            trend = (f"{'falls' if losses[-1] < losses[0] else 'does NOT fall'} by {losses[0] - losses[-1]:.4f}, "
                     f"{'' if monotone else 'not '}at every step")
        peak = final.get("marks", {}).get("trained")
        print(f"{args.final_steps} steps on one fixed batch at the largest nvme size ({found['nvme'][0]} layers): "
              f"losses {' '.join(f'{x:.4f}' for x in losses) or '-'} ({trend}); "
              f"peak RSS {fmt(peak, '.0f')} MB ({'under' if peak and peak <= args.cap_mb else 'OVER'} the cap)"
              f"{'; ' + final['reason'] if final['reason'] else ''}")
    return {"log": log, "final": final, "found": found, "ratio": ratio}


def part3(args) -> dict:
    allocators = args.allocators.split(",")
    print(f"\n## Part 3: largest Llama (benchmarks/zero.py width, depth searched) that trains a step under "
          f"{args.cap_mb:.0f} MB peak RSS per rank")
    print(f"stage 3 alone vs stage 3 with offload_optimizer=nvme and offload_params=nvme; {WORLD} gloo ranks, "
          f"1 thread each, batch {args.probe_batch}x{args.probe_seq} per rank, fp32, zero.FastAdamW. Each probe "
          "builds the model on the meta device (as the recipe does at stage 3), wraps it and trains one step "
          "in fresh processes; "
          "peak RSS = VmHWM (largest rank), read after building, after zero.initialize and after the "
          "step; a probe also fails when the parent sees a rank's RSS over the cap (it is then killed). "
          f"Time limit {args.max_minutes:.0f} min, split between the allocator settings.")
    out = {}
    for allocator in allocators:
        deadline = time.monotonic() + args.max_minutes * 60 / len(allocators)
        out[allocator] = _part3_allocator(allocator, args, deadline)
    return out


def _params_of(n_layers: int, quick: bool) -> int:
    return replace(_model_config(quick), n_layers=n_layers).num_params()


# ---------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few steps (smoke run)")
    parser.add_argument("--parts", default="1,2,3,4")
    parser.add_argument("--adam-params", type=int, default=100_000_000, help="part 1: fp32 elements stepped")
    parser.add_argument("--adam-tensors", type=int, default=4, help="part 1: split into this many tensors")
    parser.add_argument("--adam-threads", type=int, default=2, help="part 1: threads of its single process")
    parser.add_argument("--repeats", type=int, default=None, help="part 1: timed steps per optimizer")
    parser.add_argument("--rounds", type=int, default=None, help="parts 2, 4: alternating rounds of all variants")
    parser.add_argument("--steps", type=int, default=None, help="parts 2, 4: measured steps (after warmup)")
    parser.add_argument("--warmup", type=int, default=None, help="parts 2, 4: unmeasured steps (default 2; quick 1)")
    parser.add_argument("--batch", type=int, default=2, help="parts 2, 4: sequences per rank")
    parser.add_argument("--seq", type=int, default=None, help="parts 2, 4: tokens per sequence (default 128; quick 64)")
    parser.add_argument("--archs", default=None, help="part 4: models (default llama,gpt2; quick gpt2)")
    parser.add_argument("--bucket", type=int, default=25_000_000, help="reduce/all-gather bucket elements")
    parser.add_argument("--rss-cap-gib", type=float, default=None, help="part 3: peak RSS cap per rank")
    parser.add_argument("--max-minutes", type=float, default=None, help="part 3: time limit of the search")
    parser.add_argument("--probe-batch", type=int, default=1, help="part 3: sequences per rank")
    parser.add_argument("--probe-seq", type=int, default=32, help="part 3: tokens per sequence")
    parser.add_argument("--max-probes", type=int, default=None, help="part 3: probes per search (default no limit; "
                        "quick 1)")
    parser.add_argument("--final-steps", type=int, default=None, help="part 3: steps at the largest nvme size "
                        "(default 5; quick 2)")
    parser.add_argument("--allocators", default=None, help="part 3: one search per C allocator setting, of "
                        f"{list(ALLOCATORS)} (default all; quick mmap-1MiB)")
    parser.add_argument("--nvme-dir", default=None, help="where the nvme temp dirs go (default: the system temp)")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json", default=None, help="also write the raw results here")
    args = parser.parse_args(argv)
    quick = args.quick
    common.quick_mode(quick, "torch.distributed.fsdp")
    args.repeats = args.repeats or (2 if quick else 18)
    args.rounds = args.rounds or (1 if quick else 2)
    args.steps = args.steps or (2 if quick else 4)
    args.warmup = args.warmup if args.warmup is not None else (1 if quick else 2)
    args.seq = args.seq or (64 if quick else 128)
    args.archs = args.archs or ("gpt2" if quick else "llama,gpt2")
    args.cap_mb = 1024 * (args.rss_cap_gib or (0.6 if quick else 1.5))
    args.max_minutes = args.max_minutes or (3 if quick else 24)
    args.max_probes = args.max_probes or (1 if quick else None)
    args.final_steps = args.final_steps or (2 if quick else 5)
    args.allocators = args.allocators or ("mmap-1MiB" if quick else ",".join(ALLOCATORS))
    common.run_parts("offload", (part1, part2, part3, part4), args, argv)
    common.finish()


if __name__ == "__main__":
    main()
