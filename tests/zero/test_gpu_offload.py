"""Offload on a CUDA device: host masters in pinned memory, nvme files, parameter shards off the GPU.

The same model trained on the GPU with the optimizer (and, at stage 3, the parameter shards) offloaded
gives the losses of no offload. The step runs on the host there, so equality is to the rounding of a
CPU AdamW against a CUDA one, not bitwise.
"""

from __future__ import annotations

import functools
import gc

import pytest
import torch

import zero
from tests.zero.models import build, global_batch, lm_loss

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def _losses(stage: int, dtype: str, root: str, **offload) -> tuple[list[float], zero.Engine]:
    if "nvme" in offload.values():
        offload["nvme_path"] = root
    config = zero.ZeroConfig(stage=stage, dtype=dtype, grad_accum_steps=2, clip_grad_norm=0.5,
                             reduce_bucket_size=500, offload_chunk_size=97, offload_buffer_count=3, **offload)
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    engine = zero.initialize(build(seed=0, tie=True).cuda(), ADAMW, config)
    losses = []
    for step in range(4):
        total = 0.0
        for micro in range(2):
            loss = lm_loss(engine, global_batch(step, micro, 4).cuda())
            engine.backward(loss)
            total += loss.item() / 2
        assert engine.step()
        losses.append(total)
    torch.cuda.synchronize()
    engine.gpu_bytes = torch.cuda.memory_allocated() - before  # what the engine holds after its steps
    return losses, engine


CASES = [(1, {"offload_optimizer": "cpu"}), (2, {"offload_optimizer": "nvme"}),
         (3, {"offload_optimizer": "cpu"}), (3, {"offload_params": "cpu", "offload_optimizer": "cpu"}),
         (3, {"offload_params": "nvme", "offload_optimizer": "nvme"})]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("stage,offload", CASES, ids=lambda c: str(c))
def test_offload_on_gpu_matches_no_offload(stage, offload, dtype, tmp_path):
    ref, ref_engine = _losses(stage, dtype, str(tmp_path))
    ref_bytes = ref_engine.gpu_bytes
    ref_engine.close()
    del ref_engine
    got, engine = _losses(stage, dtype, str(tmp_path), **offload)
    got_bytes = engine.gpu_bytes
    engine.close()
    print(f"GPU bytes held after the steps: {got_bytes} with {offload}, {ref_bytes} without")
    tol = 1e-4 if dtype == "fp32" else 2e-2
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=tol, atol=0)
    assert got[-1] < got[0]
    # The masters and the optimizer state left the GPU: less device memory than without offload.
    assert got_bytes < ref_bytes, (got_bytes, ref_bytes)
