"""Ring attention (parallel.cp) and Ulysses x ring equal one process: outputs and q/k/v gradients.

One 4-rank spawn runs every case: U x C = 1x2 (two independent rings of two ranks), 1x4 and 2x2, for dense causal
GQA (2 kv heads, so 4 ranks are more ranks than kv heads), bidirectional, packed documents whose boundaries cross
chunks, and the sliding-window and BigBird layouts. Bytes: what the ring sends equals `ring_bytes_per_rank`, and the
layout-aware ring at C=4 with a sliding window sends at most 1/C of the dense ring at 32k tokens.
"""

from __future__ import annotations

import pytest

from tests.multirank import run_multirank

B, S, H, HK, D = 2, 64, 4, 2, 8
SLIDING = {"layout": "sliding_window", "block_size": 4, "window_blocks": 3}
BIGBIRD = {"layout": "bigbird", "block_size": 4, "window_blocks": 2, "global_blocks": 1, "random_blocks": 2}
CASES = ("dense", "bidirectional", "documents", "sliding_window", "bigbird")
LAYOUTS = ((1, 2), (1, 4), (2, 2))


def _inputs(case: str):
    import torch
    from moe_lst.kernels.attention import attention
    from moe_lst.kernels.documents import Documents, positions_from_starts
    from moe_lst.kernels.sparse import SparseAttention, SparseConfig

    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(B, S, n, D, generator=gen) for n in (H, HK, HK))
    dout = torch.randn(B, S, H, D, generator=gen)
    fn = attention
    if case in ("sliding_window", "bigbird"):
        fn = SparseAttention(SparseConfig(**(SLIDING if case == "sliding_window" else BIGBIRD)))
    positions = None
    if case == "documents":
        starts = torch.zeros(B, S, dtype=torch.bool)
        starts[0, [5, 21, 40]] = True  # inside chunks, so documents cross the chunk and piece boundaries
        starts[1, [30]] = True
        positions = positions_from_starts(starts)
    return q, k, v, dout, fn, case != "bidirectional", positions, Documents


def _run_case(case: str, sp_group, cp_group) -> dict[str, float]:
    """Max |parallel - one process| of the output and the three gradients, on this rank (after gathering)."""
    import torch
    from moe_lst.kernels.documents import attend

    from sequence_parallel.data import collect_context_parallel, shard_context_parallel
    from sequence_parallel.ring import RingAttention
    from sequence_parallel.ulysses import UlyssesAttention
    from zero.dist.topology import group_size

    q, k, v, dout, fn, causal, positions, documents = _inputs(case)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    want = attend(fn, *leaves, causal=causal, documents=None if positions is None else documents(positions))
    want_grads = torch.autograd.grad(want, leaves, dout)

    def shard(x):
        return shard_context_parallel(x, sp_group, cp_group)

    local = [shard(x).requires_grad_() for x in (q, k, v)]
    ring = RingAttention(cp_group, fn, ulysses=group_size(sp_group))
    module = UlyssesAttention(sp_group, ring) if group_size(sp_group) > 1 else ring
    docs = None if positions is None else documents(shard(positions))
    out = module(*local, causal=causal, documents=docs)
    grads = torch.autograd.grad(out, local, shard(dout))
    got = [collect_context_parallel(x, sp_group, cp_group) for x in (out, *grads)]
    return {name: float((g - w).abs().max() / w.abs().max())
            for name, g, w in zip(("out", "dq", "dk", "dv"), got, (want, *want_grads))}


def _groups(sp: int, cp: int):
    """This rank's (sp group, cp group) of a world cut into sp x cp blocks (sp innermost); every rank makes
    every group, as torch.distributed requires."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    mine = {}
    for base in range(0, world, sp * cp):
        for c in range(cp):
            ranks = [base + c * sp + u for u in range(sp)]
            group = dist.new_group(ranks) if sp > 1 else None
            if rank in ranks:
                mine["sp"] = group
        for u in range(sp):
            ranks = [base + c * sp + u for c in range(cp)]
            group = dist.new_group(ranks)
            if rank in ranks:
                mine["cp"] = group
    return mine["sp"], mine["cp"]


def _bytes(seq_len: int, cp_group, sparse: dict | None) -> tuple[int, int]:
    """(p2p bytes this rank sent for one forward + backward of the ring, bytes of its forward alone)."""
    import torch
    from moe_lst.kernels.attention import attention
    from moe_lst.kernels.sparse import SparseAttention, SparseConfig

    from sequence_parallel.data import shard_context_parallel
    from sequence_parallel.ring import RingAttention
    from zero.dist import comm

    gen = torch.Generator().manual_seed(3)
    q, k, v = (shard_context_parallel(torch.randn(1, seq_len, n, 2, generator=gen), None, cp_group).requires_grad_()
               for n in (2, 1, 1))
    ring = RingAttention(cp_group, attention if sparse is None else SparseAttention(SparseConfig(**sparse)))
    with comm.counting() as stats:
        out = ring(q, k, v)
        forward = stats.bytes["p2p"]
        out.sum().backward()
        total = stats.bytes["p2p"]
    return total, forward


def _order(cp_group) -> list[str]:
    """What one ring forward does, in order: "transfer" (a step's send/receive started), "compute" (a pair of
    chunks attended), "wait" (a transfer waited for)."""
    import torch

    import sequence_parallel.ring as ring
    from zero.dist import comm

    log: list[str] = []
    send_recv, forward = comm.send_recv, ring._PairMasks.forward

    class Logged:
        def __init__(self, handle) -> None:
            self.handle = handle

        def wait(self):
            log.append("wait")
            return self.handle.wait()

    def logged_send_recv(*args, **kwargs):
        log.append("transfer")
        return [Logged(h) for h in send_recv(*args, **kwargs)]

    def logged_forward(self, *args, **kwargs):
        log.append("compute")
        return forward(self, *args, **kwargs)

    comm.send_recv, ring._PairMasks.forward = logged_send_recv, logged_forward
    try:
        gen = torch.Generator().manual_seed(5)
        ring.RingAttention(cp_group)(*(torch.randn(1, 32, n, 4, generator=gen) for n in (2, 1, 1)))
    finally:
        comm.send_recv, ring._PairMasks.forward = send_recv, forward
    return log


def _worker() -> dict:
    import torch.distributed as dist

    results = {}
    for sp, cp in LAYOUTS:
        sp_group, cp_group = _groups(sp, cp)
        for case in CASES:
            results[(sp, cp, case)] = _run_case(case, sp_group, cp_group)
    _, cp_group = _groups(1, 4)
    results["bytes"] = {name: _bytes(256, cp_group, sparse)
                        for name, sparse in (("dense", None), ("sliding_window", dict(SLIDING, block_size=8)),
                                             ("bigbird", dict(BIGBIRD, block_size=8)))}
    results["order"] = _order(cp_group)
    results["rank"] = dist.get_rank()
    return results


@pytest.fixture(scope="module")
def results():
    return run_multirank(_worker, 4, timeout=240)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"{x[0]}x{x[1]}")
def test_ring_equals_one_process(results, layout, case):
    from tests.equivalence import RTOL

    for r in results:
        errors = r[(*layout, case)]
        assert max(errors.values()) < RTOL, f"rank {r['rank']} U x C = {layout[0]}x{layout[1]} {case}: {errors}"


def test_ring_bytes_are_predicted(results):
    """What each rank sends through comm (p2p) equals the planner's formula, forward and forward + backward."""
    from moe_lst.kernels.sparse import SparseConfig

    from sequence_parallel.ring import ring_bytes_per_rank

    for name, sparse in (("dense", None), ("sliding_window", dict(SLIDING, block_size=8)),
                         ("bigbird", dict(BIGBIRD, block_size=8))):
        config = None if sparse is None else SparseConfig(**sparse)
        want = ring_bytes_per_rank(256, 1, 1, 2, 4, 4, config)
        got = [r["bytes"][name] for r in sorted(results, key=lambda r: r["rank"])]
        assert [(w["forward"] + w["backward"], w["forward"]) for w in want] == got, name


def test_sliding_window_ring_sends_one_cth_of_the_dense_ring():
    """At C=4 and 32k tokens the layout-aware ring with a sliding window sends at most 1/C of the dense ring per
    step (forward and backward), each rank's neighbours only (the formula checked against comm above)."""
    from moe_lst.kernels.sparse import SparseConfig

    from sequence_parallel.ring import ring_bytes_per_rank, ring_slots, sparse_chunk_pairs

    window = SparseConfig(layout="sliding_window", block_size=256, window_blocks=4)
    dense = ring_bytes_per_rank(32768, 1, 8, 128, 4, 2)
    sparse = ring_bytes_per_rank(32768, 1, 8, 128, 4, 2, window)
    for key in ("forward", "backward"):
        assert sum(s[key] for s in sparse) <= sum(d[key] for d in dense) / 4, key
    slots = ring_slots(sparse_chunk_pairs(window, 32768, 4), 4)
    for c in range(4):
        assert all(not slots[c][s] for s in range(4) if abs(s - c) > 1), slots[c]


def _measure_32k(sparse: dict | None) -> tuple[int, int]:
    from tests.sequence_parallel.test_ring import _bytes, _groups

    return _bytes(32768, _groups(1, 4)[1], sparse)


@pytest.mark.slow
def test_sliding_window_ring_bytes_measured_at_32k():
    dense = run_multirank(_measure_32k, 4, None, timeout=600)
    window = run_multirank(_measure_32k, 4, {"layout": "sliding_window", "block_size": 256, "window_blocks": 4},
                           timeout=600)
    assert sum(w[0] for w in window) <= sum(d[0] for d in dense) / 4
    assert sum(w[1] for w in window) <= sum(d[1] for d in dense) / 4


def test_next_block_is_in_flight_while_the_current_one_computes(results):
    """Every step's transfer starts before that step's attention and is waited for only after it: the keys and
    values of step t + 1 travel while step t computes (C=4: three transfers, each with compute before its wait)."""
    for r in results:
        log = r["order"]
        starts = [i for i, e in enumerate(log) if e == "transfer"]
        assert len(starts) == 3, log
        for i in starts:
            first_wait = log.index("wait", i)
            assert "compute" in log[i + 1:first_wait], (r["rank"], log)
        assert log[0] == "transfer", log


def test_causal_work_is_even_over_the_ring():
    """Two mirrored chunks per rank: under causal attention every ring rank computes the same attention (2C + 1
    chunk pairs, of which 2 diagonal), where two contiguous chunks would give the last rank 4C - 1 and the first 3."""
    from sequence_parallel.ring import _PairMasks, chunks_of

    for cp in (2, 4, 8):
        masks = _PairMasks(chunk=8, causal=True, doc_ids=None, layout=None)
        work = [sum(masks.needed(i, j) for i in chunks_of(c, cp) for j in range(2 * cp)) for c in range(cp)]
        assert work == [2 * cp + 1] * cp, (cp, work)


def test_ring_refuses_what_it_does_not_run_naming_what_is_missing():
    import torch
    from moe_lst.kernels.nsa import NativeSparseAttention, NSAConfig

    from sequence_parallel.ring import RingAttention, check_ring

    with pytest.raises(NotImplementedError, match="does not run native sparse attention: its selected branch"):
        RingAttention(None, NativeSparseAttention(NSAConfig(), None, None))
    with pytest.raises(NotImplementedError, match="not my_attention: a ring needs the attention's mask"):
        def my_attention(q, k, v, causal=True):
            return q
        RingAttention(None, my_attention)
    with pytest.raises(NotImplementedError, match="^ring attention \\(cp\\) runs block-sparse layouts on unpacked rows "
                       "only: a layout per packed document is not implemented; pack rows without documents "
                       "\\(packing=concat\\) or use sp for sparse attention over packed documents$"):
        check_ring("sparse", 64, 1, 2, block_size=8, packed_documents=True)
    q = torch.zeros(1, 8, 2, 4)
    with pytest.raises(NotImplementedError, match="does not run attention sinks"):
        RingAttention(None)(q, q, q, sinks=torch.zeros(1, 8, 2, 1))
