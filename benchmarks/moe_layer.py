"""Forward+backward of one MoE layer: ours (dropless and capacity 1.25) vs DeepSpeed MoE vs a naive loop.

Peak memory: each (impl, size) runs once in a fresh subprocess (peak RSS above the RSS before the
pass). Time: each impl runs in its own subprocess (`--rounds` of them, impls alternating), timing its
passes with fresh and with kept gradients and, interleaved, dense GEMMs of the per-expert shapes;
the compute bound uses the fastest dense pass of the size.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# Run as a script, this folder leads sys.path and its other scripts could shadow our packages.
_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0]) == _HERE:
    sys.path[0] = os.path.dirname(_HERE)

from tests.multirank import free_port  # noqa: E402

DIM, FFN, TOP_K = 512, 1024, 2
IMPLS = ("ours", "ours_cap", "deepspeed", "naive")
GRAD_MODES = ("fresh", "kept")


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # reported in kB
    raise RuntimeError(f"{field} not found in /proc/self/status")


def _reset_peak_rss() -> float:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS and return that RSS in MiB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_mib("VmRSS")


def _build(impl: str, num_experts: int):
    from torch import nn

    if impl in ("ours", "ours_cap"):
        from moe import MoELayer

        return MoELayer(DIM, FFN, num_experts, top_k=TOP_K, activation="gelu",
                        capacity_factor=1.25 if impl == "ours_cap" else None)
    if impl == "deepspeed":
        import deepspeed
        from deepspeed.moe.layer import MoE

        # DeepSpeed's MoE needs its expert-parallel groups, which need a process group: one gloo rank.
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        expert = nn.Sequential(nn.Linear(DIM, FFN, bias=False), nn.GELU(), nn.Linear(FFN, DIM, bias=False))
        layer = MoE(DIM, expert, num_experts=num_experts, ep_size=1, k=TOP_K, capacity_factor=1.25)
        layer.set_deepspeed_parallelism()
        return layer
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
        if impl in ("ours", "ours_cap"):
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
    base = _reset_peak_rss()
    step()
    stats = getattr(layer, "last_stats", {})
    return {"impl": impl, "peak_mib": _status_mib("VmHWM") - base,
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


def time_isolated(impls: list[str], tokens: int, num_experts: int, rounds: int, common: list[str],
                  env: dict, root: str) -> dict | None:
    """Every impl in its own process (as in training, where one process runs one implementation, so
    the heap one leaves behind does not tax the next), `rounds` times, impls alternating so that a
    change of machine speed hits them alike. Each process also times the dense GEMMs; the bound uses
    the fastest dense pass of the whole size. Returns {"time": {impl/mode: best s}, "bound", ...}."""
    best: dict[str, float] = {}
    rate = 0.0
    for _ in range(rounds):
        for impl in impls:
            out = _subprocess(["--time-case", str(tokens), str(num_experts), *common, "--impls", impl], env, root)
            if out is None:
                return None
            for key, value in out["time"].items():
                best[key] = min(best.get(key, float("inf")), value)
            rate = max(rate, out["gemm_gflops"] * 1e9)
    return {"time": best, "bound": layer_flops(tokens, num_experts) / rate, "gemm_gflops": rate / 1e9}


def _subprocess(args: list[str], env: dict, root: str) -> dict | None:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), *args], capture_output=True,
                          text=True, env=env, cwd=root)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        print(f"{' '.join(args)} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="one small size, one repeat (smoke run)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads in every case")
    ap.add_argument("--reps", type=int, default=2, help="timed passes per process (the best is reported)")
    ap.add_argument("--rounds", type=int, default=2, help="timing processes per implementation and size")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--mem-case", nargs=3, metavar=("IMPL", "TOKENS", "EXPERTS"), help=argparse.SUPPRESS)
    ap.add_argument("--time-case", nargs=2, metavar=("TOKENS", "EXPERTS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    impls = args.impls.split(",")
    if args.mem_case:
        impl, tokens, experts = args.mem_case[0], int(args.mem_case[1]), int(args.mem_case[2])
        print(json.dumps(measure_memory(impl, tokens, experts, args.threads)))
        return
    if args.time_case:
        print(json.dumps(measure_time(impls, int(args.time_case[0]), int(args.time_case[1]), args.threads,
                                      args.reps)))
        return

    sizes = [(1024, 8)] if args.quick else [(4096, 8), (4096, 64), (16384, 8), (16384, 64)]
    reps = 1 if args.quick else args.reps
    root = os.path.dirname(_HERE)
    # A fixed mmap threshold makes glibc hand every freed tensor back to the kernel at once, so RSS
    # tracks live tensor memory instead of the allocator's retained heap.
    # Timing runs keep glibc's default (adaptive) threshold, the allocator a training job runs with:
    # with the fixed threshold every tensor over 64 KiB is a fresh mmap whose pages fault in and are
    # zeroed on first touch, a cost that scales with the number of temporaries, not with the work.
    time_env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONPATH=root)
    time_env.pop("MALLOC_MMAP_THRESHOLD_", None)
    env = dict(time_env, MALLOC_MMAP_THRESHOLD_="65536")
    common = ["--threads", str(args.threads), "--reps", str(reps)]
    print(f"MoE layer fwd+bwd, dim {DIM}, ffn {FFN}, GELU experts, top-{TOP_K}, fp32, "
          f"{args.threads} thread(s); time: best of {reps} passes x {1 if args.quick else args.rounds} "
          "process(es) per implementation")
    print("| tokens | E | impl | grads | time ms | time / bound | time / ours | peak MiB | peak / ours | dropped |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for tokens, experts in sizes:
        mem = {impl: _subprocess(["--mem-case", impl, str(tokens), str(experts), *common], env, root)
               for impl in impls}
        timing = time_isolated(impls, tokens, experts, 1 if args.quick else args.rounds, common, time_env, root)
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
                mine = t[f"{impl}/{mode}"]
                vs_ours = f"{mine / ours:.2f}" if ours else "-"
                print(f"| {tokens} | {experts} | {impl} | {mode} | {mine * 1e3:.1f} | {mine / bound:.2f} | "
                      f"{vs_ours} | {peak} | {peak_ratio} | {dropped} |", flush=True)
        print(f"| {tokens} | {experts} | compute bound ({timing['gemm_gflops']:.0f} GFLOP/s) | | "
              f"{bound * 1e3:.1f} | 1.00 | | | | |", flush=True)


if __name__ == "__main__":
    main()
