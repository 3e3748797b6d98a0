"""The delayed offload update on a CUDA device: side-stream copies, the host step on its worker thread, and still
the one-step lag of the plain loop. Losses are compared (to 2e-4): element-wise parameters of a CUDA run
and a CPU loop can part where Adam divides a near-zero gradient by its own size, and the lag moves the losses
by up to 3e-3 here, far more than the rounding."""

from __future__ import annotations

import pytest
import torch

from tests.zero.test_offload_delayed import STEPS, WARMUP, _reference, _train
from zero.offload.overlap import StreamExecutor

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("delayed", [False, True])
def test_offload_on_cuda_overlaps_and_keeps_the_trajectory(stage, delayed):
    kw = dict(offload_delayed_update=True, offload_delayed_warmup_steps=WARMUP) if delayed else {}
    got = torch.tensor(_train(STEPS, stage, "cuda", **kw)["losses"])
    want = torch.tensor(_reference(STEPS, warmup=WARMUP if delayed else None)["losses"])
    other = torch.tensor(_reference(STEPS, warmup=None if delayed else WARMUP)["losses"])
    torch.testing.assert_close(got, want, rtol=2e-4, atol=0)
    assert (got - want).abs().max() < (got - other).abs().max() / 4  # the lag (or its absence) is seen


def test_the_cuda_executor_is_used_on_cuda():
    import zero
    from tests.zero.models import build
    from tests.zero.test_offload_delayed import ADAMW

    engine = zero.initialize(build(seed=0).cuda(), ADAMW, zero.ZeroConfig(stage=1, offload_optimizer="cpu"))
    assert isinstance(engine.zero_optimizer.masters.executor, StreamExecutor)
    assert all(m.is_pinned() for m in engine.zero_optimizer.masters.masters)
    engine.close()
