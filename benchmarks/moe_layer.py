"""Forward+backward of one MoE layer: ours (dropless and capacity 1.25) vs DeepSpeed MoE vs a naive loop.

Peak memory: each (impl, size) runs once in a fresh process (peak RSS above the RSS before the
pass). Time: each impl runs in its own process (`--rounds` of them, impls alternating), timing its
passes with fresh and with kept gradients and, interleaved, dense GEMMs of the per-expert shapes;
the compute bound uses the fastest dense pass of the size.

    python benchmarks/moe_layer.py            # 4096 / 16384 tokens x 8 / 64 experts, 2 rounds
    python benchmarks/moe_layer.py --quick    # 512 tokens x 8 experts, one pass: a smoke run

Without DeepSpeed (`import deepspeed` fails) its MoE is skipped with a note; the naive loop always runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if not __package__:  # run as a file: the repository root leads sys.path, not this folder (its zero.py)
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from benchmarks import common  # noqa: E402

DIM, FFN, TOP_K = 512, 1024, 2
IMPLS = ("ours", "ours_cap", "ours_device", "deepspeed", "naive")
PEER = "deepspeed"  # the implementation that is not ours: its failure is a peer's
GRAD_MODES = ("fresh", "kept")


def _build(impl: str, num_experts: int):
    if impl in ("ours", "ours_cap", "ours_device"):
        from moe import MoELayer

        return MoELayer(DIM, FFN, num_experts, top_k=TOP_K, activation="gelu",
                        capacity_factor=1.25 if impl == "ours_cap" else None,
                        local_path="device" if impl == "ours_device" else "auto")
    if impl == "deepspeed":
        return common.deepspeed_moe(DIM, FFN, num_experts, TOP_K)  # on one gloo rank
    return _naive_module(num_experts)


def _naive_module(num_experts: int):
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Naive(nn.Module):
        """Router + a python loop over experts, each an nn.Sequential MLP (the Mixtral-in-HF pattern)."""

        def __init__(self) -> None:
            super().__init__()
            self.router = nn.Linear(DIM, num_experts, bias=False)
            self.experts = nn.ModuleList(
                nn.Sequential(nn.Linear(DIM, FFN, bias=False), nn.GELU(), nn.Linear(FFN, DIM, bias=False))
                for _ in range(num_experts))

        def forward(self, x_in: torch.Tensor) -> torch.Tensor:
            x = x_in.reshape(-1, DIM)
            probs = F.softmax(self.router(x).float(), dim=-1)
            w, idx = probs.topk(TOP_K, dim=-1)
            w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
            y = torch.zeros_like(x)
            for e, expert in enumerate(self.experts):
                tok, slot = torch.where(idx == e)
                if tok.numel():
                    y = y.index_add(0, tok, expert(x[tok]) * w[tok, slot, None])
            return y.view_as(x_in)

    return Naive()


def _dense_gemms(tokens: int, num_experts: int):
    """Dense GEMMs with the layer's per-expert shapes, E times: the forward pair ([T*k/E, dim] @
    [dim, ffn], [T*k/E, ffn] @ [ffn, dim]) and the four backward ones (input and weight gradients),
    i.e. exactly the expert matmul work of one forward+backward. Returns (callable, its FLOPs)."""
    import torch

    m = max(1, tokens * TOP_K // num_experts)
    x, w1, h, w2 = torch.randn(m, DIM), torch.randn(DIM, FFN), torch.randn(m, FFN), torch.randn(FFN, DIM)
    gy, gh = torch.randn(m, DIM), torch.randn(m, FFN)

    def run() -> None:
        for _ in range(num_experts):
            torch.mm(x, w1)
            torch.mm(h, w2)
            torch.mm(gy, w2.t())  # d h
            torch.mm(h.t(), gy)  # d w2
            torch.mm(gh, w1.t())  # d x
            torch.mm(x.t(), gh)  # d w1

    return run, num_experts * 6 * (2 * m * DIM * FFN)


def _stepper(impl: str, layer, x, g, grads: str = "fresh"):
    """One forward+backward pass of `layer`.

    grads="fresh": every .grad is None before the pass, so the pass allocates its gradients
    (optimizer.zero_grad() with set_to_none=True). grads="kept": every .grad is a zeroed buffer that
    the pass accumulates into, as under a ZeRO stage 0-1 engine (ours presets .grad to flat-buffer
    views) or zero_grad(set_to_none=False); ours then adds its weight gradients in place, as our
    engine configures it. Zeroing happens before the clock starts.
    """
    import torch

    def step() -> float:
        x.grad = None
        if impl in ("ours", "ours_cap", "ours_device"):
            layer.experts.fuse_grad_accumulation = grads == "kept"
        for p in layer.parameters():
            if grads == "fresh":
                p.grad = None
            elif p.grad is None:
                p.grad = torch.zeros_like(p)
            else:
                p.grad.zero_()
        t = time.perf_counter()
        out = layer(x)
        if impl == "deepspeed":
            y, l_aux, _ = out  # its aux loss is returned; ours is attached to the output by autograd
            torch.autograd.backward([y, l_aux], [g.view_as(y), torch.tensor(1e-2)])
        else:
            out.backward(g)
        return time.perf_counter() - t

    return step


def _inputs(tokens: int):
    import torch

    x = torch.randn(1, tokens, DIM, requires_grad=True)
    return x, torch.randn(1, tokens, DIM)


def measure_memory(impl: str, tokens: int, num_experts: int, threads: int) -> dict:
    """Peak RSS of one forward+backward above the RSS before it (fresh process per case)."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    layer = _build(impl, num_experts)
    x, g = _inputs(tokens)
    step = _stepper(impl, layer, x, g)
    step()  # warm-up: one-off library initialisation stays out of the measurement
    x.grad = None
    for p in layer.parameters():
        p.grad = None
    base = common.reset_peak_rss()
    step()
    stats = getattr(layer, "last_stats", {})
    return {"impl": impl, "peak_mib": common.peak_rss_mb() - base,
            "dropped": float(stats["dropped"]) if "dropped" in stats else None}


def measure_time(impls: list[str], tokens: int, num_experts: int, threads: int, reps: int) -> dict:
    """Best-of-`reps` pass time of `impls` in both gradient modes (`_stepper`) and of the dense
    GEMMs, interleaved round by round in one process so that all of them see the same load."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    dense, dense_flops = _dense_gemms(tokens, num_experts)
    x, g = _inputs(tokens)
    steps = {}
    for impl in impls:
        layer = _build(impl, num_experts)
        for mode in GRAD_MODES:
            steps[f"{impl}/{mode}"] = _stepper(impl, layer, x, g, mode)
    best = {key: float("inf") for key in [*steps, "dense"]}
    for _ in range(reps + 1):  # the first round is warm-up
        for key, step in steps.items():
            best[key] = min(best[key], step())
        t = time.perf_counter()
        dense()
        best["dense"] = min(best["dense"], time.perf_counter() - t)
    rate = dense_flops / best.pop("dense")
    return {"time": best, "bound": layer_flops(tokens, num_experts) / rate, "gemm_gflops": rate / 1e9}


def layer_flops(tokens: int, num_experts: int) -> int:
    """Matmul FLOPs of the layer's forward (two expert GEMMs per token-slot + the router), x3 for fwd+bwd."""
    return 3 * (2 * 2 * tokens * TOP_K * DIM * FFN + 2 * tokens * DIM * num_experts)


def time_isolated(impls: list[str], tokens: int, num_experts: int, rounds: int, args, env: dict) -> dict | None:
    """Every impl in its own process (as in training, where one process runs one implementation, so
    the heap one leaves behind does not tax the next), `rounds` times, impls alternating so that a
    change of machine speed hits them alike. Each process also times the dense GEMMs; the bound uses
    the fastest dense pass of the whole size. Returns {"time": {impl/mode: best s}, "bound", ...}."""
    best: dict[str, float] = {}
    rate = 0.0
    impls = list(impls)
    for _ in range(rounds):
        for impl in list(impls):
            out = _in_process(measure_time, [impl], tokens, num_experts, args.threads, args.reps,
                              threads=args.threads, env=env)
            if out is None and impl == PEER:  # (said in one line; the others go on without it)
                impls.remove(impl)
                continue
            if out is None:
                return None
            for key, value in out["time"].items():
                best[key] = min(best.get(key, float("inf")), value)
            rate = max(rate, out["gemm_gflops"] * 1e9)
    return {"time": best, "bound": layer_flops(tokens, num_experts) / rate, "gemm_gflops": rate / 1e9}


def _in_process(fn, *args, threads: int, env: dict) -> dict | None:
    """fn(*args) in a fresh process; None (and the failure recorded: a peer's as a peer's) if it fails."""
    try:
        (out,) = common.spawn(fn, *args, threads=threads, env=env)
    except common.RankFailed as e:
        if args[0] in (PEER, [PEER]):
            common.peer_failed(f"DeepSpeed MoE ({fn.__name__})", e)
        else:
            common.failed(f"{fn.__name__}{args[:3]}", e)
        return None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one small size, one repeat (smoke run)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads in every case")
    ap.add_argument("--reps", type=int, default=2, help="timed passes per process (the best is reported)")
    ap.add_argument("--rounds", type=int, default=2, help="timing processes per implementation and size")
    ap.add_argument("--impls", default=",".join(IMPLS))
    args = ap.parse_args()
    common.quick_mode(args.quick, "moe")
    impls = common.without_deepspeed(args.impls.split(","), "DeepSpeed MoE")
    sizes = [(512, 8)] if args.quick else [(4096, 8), (4096, 64), (16384, 8), (16384, 64)]
    args.reps = 1 if args.quick else args.reps
    rounds = 1 if args.quick else args.rounds
    # A fixed mmap threshold makes glibc hand every freed tensor back to the kernel at once, so RSS
    # tracks live tensor memory instead of the allocator's retained heap.
    # Timing runs keep glibc's default (adaptive) threshold, the allocator a training job runs with:
    # with the fixed threshold every tensor over 64 KiB is a fresh mmap whose pages fault in and are
    # zeroed on first touch, a cost that scales with the number of temporaries, not with the work.
    time_env = {"MALLOC_MMAP_THRESHOLD_": None}
    mem_env = {"MALLOC_MMAP_THRESHOLD_": "65536"}
    print(f"MoE layer fwd+bwd, dim {DIM}, ffn {FFN}, GELU experts, top-{TOP_K}, fp32, "
          f"{args.threads} thread(s); time: best of {args.reps} passes x {rounds} "
          "process(es) per implementation")
    print("| tokens | E | impl | grads | time ms | time / bound | time / ours | peak MiB | peak / ours | dropped |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    ratios = []
    for tokens, experts in sizes:
        mem = {impl: _in_process(measure_memory, impl, tokens, experts, args.threads, threads=args.threads,
                                 env=mem_env) for impl in impls}
        timing = time_isolated(impls, tokens, experts, rounds, args, time_env)
        if timing is None:
            continue
        t, bound = timing["time"], timing["bound"]
        for mode in GRAD_MODES:
            ours = t.get(f"ours/{mode}")
            for impl in impls:
                m = mem.get(impl) if mode == "fresh" else None  # peak memory: fresh gradients only
                peak = f"{m['peak_mib']:.1f}" if m else ("failed" if mode == "fresh" else "")
                peak_ratio = (f"{m['peak_mib'] / mem['ours']['peak_mib']:.2f}" if m and mem.get("ours") else "")
                dropped = f"{m['dropped']:.3f}" if m and m["dropped"] is not None else ""
                if f"{impl}/{mode}" not in t:  # (a peer left out)
                    continue
                mine = t[f"{impl}/{mode}"]
                vs_ours = f"{mine / ours:.2f}" if ours else "-"
                print(f"| {tokens} | {experts} | {impl} | {mode} | {mine * 1e3:.1f} | {mine / bound:.2f} | "
                      f"{vs_ours} | {peak} | {peak_ratio} | {dropped} |", flush=True)
                if impl != "ours" and ours:
                    ratios.append((f"{tokens} tokens x {experts} experts, {mode} grads: time {impl} / ours",
                                   mine / ours))
            if ours:
                ratios.append((f"{tokens} tokens x {experts} experts, {mode} grads: time ours / compute bound",
                               ours / bound))
        print(f"| {tokens} | {experts} | compute bound ({timing['gemm_gflops']:.0f} GFLOP/s) | | "
              f"{bound * 1e3:.1f} | 1.00 | | | | |", flush=True)
    for what, value in ratios:
        common.print_ratio(what, value)
    common.finish()


if __name__ == "__main__":
    main()
