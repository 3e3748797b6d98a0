"""Forward+backward of one MoE layer: ours (dropless and capacity 1.25) vs DeepSpeed MoE vs a naive loop.

Every case runs in a fresh subprocess so its peak memory (peak RSS above the RSS at the start) is
its own; each subprocess also times dense GEMMs of the per-expert shapes to give the compute bound.
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

DIM, FFN, TOP_K = 512, 1024, 2
IMPLS = ("ours", "ours_cap", "deepspeed", "naive")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
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
    """A pass of dense GEMMs with the layer's per-expert shapes ([T*k/E, dim] @ [dim, ffn] and back),
    E times each; returns (callable, its FLOPs)."""
    import torch

    m = max(1, tokens * TOP_K // num_experts)
    a, w1 = torch.randn(m, DIM), torch.randn(DIM, FFN)
    h, w2 = torch.randn(m, FFN), torch.randn(FFN, DIM)

    def run() -> None:
        for _ in range(num_experts):
            torch.mm(a, w1)
            torch.mm(h, w2)

    return run, num_experts * 2 * (2 * m * DIM * FFN)


def run_case(impl: str, tokens: int, num_experts: int, threads: int, reps: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    dense, dense_flops = _dense_gemms(tokens, num_experts)
    dense()
    layer = _build(impl, num_experts)
    x = torch.randn(1, tokens, DIM, requires_grad=True)
    g = torch.randn(1, tokens, DIM)
    def step() -> float:
        x.grad = None
        for p in layer.parameters():
            p.grad = None  # gradients are allocated inside the measured pass, as in training
        t = time.perf_counter()
        out = layer(x)
        if impl == "deepspeed":
            y, l_aux, _ = out  # its aux loss is returned; ours is attached to the output by autograd
            torch.autograd.backward([y, l_aux], [g.view_as(y), torch.tensor(1e-2)])
        else:
            out.backward(g)
        return time.perf_counter() - t

    step()  # warm-up: one-off library initialisation stays out of both time and memory
    x.grad = None
    for p in layer.parameters():
        p.grad = None
    base = _reset_peak_rss()
    times, dense_times = [], []
    for _ in range(reps):
        times.append(step())
        # Dense GEMMs timed right after each pass, so both see the same load on a shared machine.
        t = time.perf_counter()
        dense()
        dense_times.append(time.perf_counter() - t)
    peak = _status_mib("VmHWM") - base
    rate = dense_flops / min(dense_times)
    # Matmul FLOPs of the layer's forward (two expert GEMMs per token-slot + the router), x3 for fwd+bwd.
    flops = 3 * (2 * 2 * tokens * TOP_K * DIM * FFN + 2 * tokens * DIM * num_experts)
    stats = getattr(layer, "last_stats", {})
    return {"impl": impl, "tokens": tokens, "experts": num_experts, "time": min(times),
            "peak_mib": peak, "bound": flops / rate, "gemm_gflops": rate / 1e9,
            "dropped": float(stats["dropped"]) if "dropped" in stats else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="one small size, one repeat (smoke run)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads in every case")
    ap.add_argument("--reps", type=int, default=3, help="timed passes per case (the minimum is reported)")
    ap.add_argument("--case", nargs=3, metavar=("IMPL", "TOKENS", "EXPERTS"), help=argparse.SUPPRESS)
    ap.add_argument("--impls", default=",".join(IMPLS))
    args = ap.parse_args()
    if args.case:
        impl, tokens, experts = args.case[0], int(args.case[1]), int(args.case[2])
        print(json.dumps(run_case(impl, tokens, experts, args.threads, args.reps)))
        return

    sizes = [(1024, 8)] if args.quick else [(4096, 8), (4096, 64), (16384, 8), (16384, 64)]
    reps = 1 if args.quick else args.reps
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # A fixed mmap threshold makes glibc hand every freed tensor back to the kernel at once, so RSS
    # tracks live tensor memory instead of the allocator's retained heap.
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONPATH=root, MALLOC_MMAP_THRESHOLD_="65536")
    rows: dict[tuple, dict] = {}
    for tokens, experts in sizes:
        for impl in args.impls.split(","):
            cmd = [sys.executable, os.path.abspath(__file__), "--case", impl, str(tokens), str(experts),
                   "--threads", str(args.threads), "--reps", str(reps)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if proc.returncode or not lines:
                print(f"{impl} T={tokens} E={experts} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
                continue
            rows[(tokens, experts, impl)] = r = json.loads(lines[-1])
            print(f"  {impl:10s} T={tokens:6d} E={experts:3d}  {r['time'] * 1e3:9.1f} ms  "
                  f"peak {r['peak_mib']:8.1f} MiB", file=sys.stderr, flush=True)

    print(f"\nMoE layer fwd+bwd, dim {DIM}, ffn {FFN}, GELU experts, top-{TOP_K}, fp32, "
          f"{args.threads} thread(s), best of {reps}")
    head = ("| tokens | E | impl | time ms | peak MiB | time / bound | time / ours | "
            "mem ratio (impl / ours_dropless) |")
    print(head)
    print("|---|---|---|---|---|---|---|---|")
    for tokens, experts in sizes:
        ours = rows.get((tokens, experts, "ours"))
        bound = None
        for impl in args.impls.split(","):
            r = rows.get((tokens, experts, impl))
            if r is None:
                continue
            bound = r["bound"]
            speed = f"{r['time'] / ours['time']:.2f}x" if ours else "-"
            mem = f"{r['peak_mib'] / ours['peak_mib']:.2f}" if ours and ours["peak_mib"] > 0 else "-"
            print(f"| {tokens} | {experts} | {impl} | {r['time'] * 1e3:.1f} | {r['peak_mib']:.1f} | "
                  f"{r['time'] / bound:.2f} | {speed} | {mem} |")
        if ours:
            print(f"| {tokens} | {experts} | compute bound | {ours['bound'] * 1e3:.1f} | | 1.00 | | |")


if __name__ == "__main__":
    main()
