"""Expert GEMMs on CPU in bf16: resident memory stays flat over steps whose routing changes every segment size."""

import torch
import torch.distributed as dist

from moe import MoELayer
from moe.experts import ONEDNN_CACHE_CAPACITY, bound_onednn_caches
from tests.multirank import run_multirank

STEPS, SETTLED = 12, 4  # growth is measured from the end of step SETTLED to the end of the last step


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


def _train_bf16_expert_parallel() -> dict:
    """A bf16 MoE layer over the all-to-all dispatcher (ep=2): each step routes new tokens, so every expert GEMM
    meets row counts it has not seen; the resident memory after each step. The caches are bounded first, as a
    training run does (an environment that sets the capacities keeps its own)."""
    bound_onednn_caches()
    torch.manual_seed(0)
    layer = MoELayer(64, 64, 8, top_k=2, ep_group=dist.group.WORLD).to(torch.bfloat16)
    torch.manual_seed(1 + dist.get_rank())
    rss = []
    for _ in range(STEPS):
        x = torch.randn(512, 64, dtype=torch.bfloat16, requires_grad=True)
        layer(x).float().square().mean().backward()
        layer.zero_grad(set_to_none=True)
        rss.append(_rss_mib())
    return {"growth_mib": rss[-1] - rss[SETTLED - 1], "rss": rss}


def test_bf16_expert_gemms_keep_resident_memory_flat():
    # oneDNN's default caches (1,024 shapes each) grow ~10 MiB a step on this layer: 60-90 MiB over the 8 steps
    # fresh processes: resident memory is measured
    unbounded = run_multirank(_train_bf16_expert_parallel, 2, env={name: "1024" for name in ONEDNN_CACHE_CAPACITY},
                              fresh=True)
    bounded = run_multirank(_train_bf16_expert_parallel, 2, fresh=True)
    for rank in range(2):
        assert unbounded[rank]["growth_mib"] > 40, unbounded[rank]["rss"]  # the growth this test must catch
        assert bounded[rank]["growth_mib"] < 16, bounded[rank]["rss"]
