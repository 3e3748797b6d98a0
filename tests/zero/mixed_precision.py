"""Mixed-precision training watched step by step (tests/zero/test_features.py on the CPU, test_gpu.py on a GPU)."""

from __future__ import annotations

import torch

import zero
from tests.zero.models import lm_loss


@torch.no_grad()
def compute_weights(engine: zero.Engine) -> dict[str, torch.Tensor]:
    """The module parameters forward computes with (compute dtype), copied to the CPU. Stage 3 holds them only
    between a unit's gather and free: gather the root and every unit as the forward pre-hooks do, then free."""
    s3 = engine.stage3
    if s3 is not None:
        s3.gather_root()
        s3.gather_units()
    try:
        return {n: p.detach().to("cpu", copy=True) for n, p in engine.module.named_parameters()}
    finally:
        if s3 is not None:
            s3.release_all()


def watch_training(engine: zero.Engine, batch: torch.Tensor, steps: int) -> dict:
    """`steps` steps on one fixed batch; after each, the compute-dtype weights compared with the previous
    step's (`unchanged`: names that did not move) and with the fp32 masters (`not_rounded_masters`: names
    whose compute weights are not the masters rounded; `masters_finer`: whether the masters hold more than
    the compute dtype does, so that comparison is not of a tensor with itself)."""
    before = compute_weights(engine)
    out = {"losses": [], "unchanged": [], "not_rounded_masters": [], "masters_finer": [],
           "dtypes": sorted({str(w.dtype) for w in before.values()}), "names": sorted(before)}
    for _ in range(steps):
        loss = lm_loss(engine, batch)
        engine.backward(loss)
        engine.step()
        out["losses"].append(loss.item())
        after = compute_weights(engine)
        masters = {n: t.cpu() for n, t in engine.full_state_dict().items()}  # the fp32 masters
        assert all(masters[n].dtype == torch.float32 for n in after)
        out["unchanged"].append(sorted(n for n in after if torch.equal(after[n], before[n])))
        out["not_rounded_masters"].append(
            sorted(n for n in after if not torch.equal(after[n], masters[n].to(after[n].dtype))))
        out["masters_finer"].append(any(not torch.equal(masters[n], masters[n].to(after[n].dtype).float())
                                        for n in after))
        before = after
    out["skipped"] = engine.skipped_steps
    return out
