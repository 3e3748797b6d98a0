"""ZeRO-3 gradient buffers, read from tensor storages (not RSS): the root's reductions follow backward's order
(the output head before the blocks, the embedding after them), a parameter that fills its bucket is reduced
from its own gradient (no full-size staging copy), at most one reduction's staging buffer waits beside the
one being launched, none survives backward, and no gradient survives the optimizer step. The values these
buffers carry are checked against the single-process trajectory in tests/zero/test_stages.py (the same
bucket size: the head and the embedding stand alone there too)."""

from __future__ import annotations

import torch.distributed as dist

import zero
from tests.multirank import run_multirank
from tests.zero.models import SGD, build, global_batch, lm_loss

BUCKET = 1000  # the head and the embedding (37 x 12 = 444 elements) hold over a quarter of it: alone


def _watch(engine: zero.Engine) -> dict:
    """Record, at each reduction launch, the bucket launched and the staging buffers alive; for the head, whether
    the buffer it reduces from is a view of its gradient (autograd's tensor) rather than a buffer of its own."""
    reducer = engine.zero_optimizer.reducer
    seen: dict = {"launches": [], "head_grad_is_staging": []}
    progress = [p for chain in reducer.chains.values() for p in chain]
    launch = reducer._launch
    head = engine.module.head.weight

    def watched_launch(prog, flat):
        alive = [p.bucket.names for p in progress if p.staging is not None or p.late is not None]
        seen["launches"].append((prog.bucket.names, alive))
        if prog.bucket.names == ["head.weight"]:
            seen["head_grad_is_staging"].append(flat._base is not None and flat._base.shape == head.shape)
        return launch(prog, flat)

    reducer._launch = watched_launch
    return seen


def _run() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    config = zero.ZeroConfig(stage=3, reduce_bucket_size=BUCKET)
    engine = zero.initialize(build(seed=rank), SGD, config, zero.ParallelDims(dp=world))
    seen = _watch(engine)
    shard_bytes = 4 * sum(b.shard_size for b in engine.zero_optimizer.trainable)
    out = {"order": [b.names for b in engine.buckets], "shard_bytes": shard_bytes, "after": []}
    reducer = engine.zero_optimizer.reducer
    for step in range(2):
        rows = global_batch(step, 0, 2 * world)[2 * rank: 2 * rank + 2]
        engine.backward(lm_loss(engine, rows))
        staged = [p.staging is not None or p.late is not None for chain in reducer.chains.values() for p in chain]
        grads = engine.memory_breakdown()["grads"]
        engine.step()
        out["after"].append({"staged": any(staged), "grads_after_backward": grads,
                             "grads_after_step": engine.memory_breakdown()["grads"]})
    return {**out, **seen}


def test_stage3_gradient_buffers_follow_backward_and_leave_memory() -> None:
    for r in run_multirank(_run, 2):
        blocks = [names for names in r["order"] if names[0].startswith("blocks.")]
        # reduction order: head, final norm, blocks last to first, embedding
        assert r["order"][0] == ["head.weight"] and r["order"][1] == ["norm.bias", "norm.weight"]
        assert r["order"][2:-1] == blocks and [n[0].split(".")[1] for n in blocks] == ["2", "1", "0"]
        assert r["order"][-1] == ["embed.weight"]
        # the head's gradient is its bucket's staging buffer, every step
        assert r["head_grad_is_staging"] == [True, True]
        # at each launch at most the one launched and the one whose reduction is in flight hold staging
        assert all(len(alive) <= 2 for _, alive in r["launches"]), r["launches"]
        # the head's buffer is gone before the embedding (last) reduces
        last = [alive for names, alive in r["launches"] if names == ["embed.weight"]]
        assert last and all(["head.weight"] not in alive for alive in last)
        for step in r["after"]:
            assert not step["staged"]  # no full-size gradient buffer after backward
            assert step["grads_after_backward"] == r["shard_bytes"]  # only this rank's reduced shard
            assert step["grads_after_step"] == 0



def test_release_host_memory_trims_after_each_backward_and_step(monkeypatch) -> None:
    """zero.release_host_memory hands freed host memory back after every backward and every optimizer step (and is
    off by default); values are untouched, so the trajectory is the one without it."""
    import zero.engine as engine_module
    from zero.dist.topology import release_free_host_memory

    assert zero.ZeroConfig().release_host_memory is False
    calls: list[str] = []
    monkeypatch.setattr(engine_module, "release_free_host_memory", lambda: calls.append("trim") or True)
    losses = {}
    for release in (False, True):
        calls.clear()
        engine = zero.initialize(build(seed=0), SGD, zero.ZeroConfig(stage=2, release_host_memory=release,
                                                                      grad_accum_steps=2))
        out = []
        for step in range(2):
            for micro in range(2):
                loss = lm_loss(engine, global_batch(step, micro, 2))
                engine.backward(loss)
                out.append(loss.item())
            engine.step()
        losses[release] = out
        assert len(calls) == (6 if release else 0)  # 2 backwards + 1 step, twice
    assert losses[False] == losses[True]
    assert isinstance(release_free_host_memory(), bool)  # the real call runs here (glibc or not)
