"""bf16 on model-parallel layouts equals the bf16 one-rank run: tp x sp, pp x ep (MoE), a Hugging Face MoE model at
ZeRO-3 with ep, packed documents with pp, tp, ep and ZeRO-3, and quantized ZeRO-3 (int8 weights and gradients).

Every case trains five SGD steps of `tests.parallel.harness` (2 layers, dim 32, 4 micro-batches of 4 rows of 16
tokens, gradient clipping at 1.0, zero.dtype=bf16: bf16 forward and backward, bf16 gradient buffers and
reductions, fp32 masters) on 4 ranks, all cases in one spawn, and compares every rank with the same training on one
rank (`tests.equivalence.assert_within`): the global-batch losses of the five steps, the first step's gradient
norm, every replica and slice of every parameter's first-step update (the change from the initial value: the
clipped gradient times lr) and its change over the five steps; exactly, that every rank's bf16 weights are its fp32
masters rounded and that some rank holds every element of every parameter. The one-rank runs (each case's reference
and its lr=0 control) run on the same spawn after the cases, shared out over the ranks, each as a layout of one
process (bitwise what a process of its own computes).

The reference is the one-rank run whose micro-batches are the data-parallel ranks' shards (`split_rows=dp`):
each dp rank averages its loss over its own tokens, and an MoE layer's balancing loss is a statistic of the
rank's own tokens, so with packed documents (ignored labels at document ends, a different count per rank) or MoE
balancing the dp ranks compute the mean of per-shard means, which a one-rank run over whole micro-batches does
not. (Without dp, as in the packed pp x tp case, the reference is the plain one-rank run.) The MoE cases have no
tp: under tp the router's input carries the bf16 all-reduce's rounding, so a token near a top-k tie can take
another expert at step 1 (a dp2 x ep2 x tp2 run moved 9% of an expert's update so); tests/parallel/test_layouts.py
covers MoE under tp in fp32.

The tolerance, from bf16's unit roundoff u = 2^-8 (3.9e-3 relative) and where the runs round differently:
  - update (step 1), per parameter (or slice) ||u - u_ref|| / ||u_ref|| <= 8u = 3.1e-2. Each element of a gradient
    is a sum of partial gradients, each rounded to bf16 once (u), accumulated over 4 micro-batches in a bf16 buffer
    and over the ranks by a bf16 reduction (tp's row-parallel outputs are summed in bf16 too); the parallel run
    forms and rounds different partial sums than the one-rank run (per rank, per sequence shard), so the two
    differ by a few roundings of the partial sums, ~(4 + 2) u |partials|, and by more where partial sums cancel
    (the RMSNorm weights' gradients, sums over every token of terms of both signs: the largest measured
    differences, 2.5u). 8u leaves 3x room over the largest measured; an update that is missing (the lr=0 control:
    distance 1), doubled, halved or made of a part of the batch (>= 25%) falls far outside.
  - loss, every step, relative <= u/8 = 4.9e-4. Step 1 computes from the same weights: only the tp all-reduce's
    extra rounding changes activations (<= u each), and the mean over the step's 256 tokens averages independent
    per-token errors (measured <= 1e-5, mostly 0). Later steps start from weights that differ by the update
    differences above (a few % of one step's change), which move the loss by a few % of one step's improvement
    (~2e-3 relative here): measured <= 1.9e-4 (HF MoE, where a token's routing may flip). The lr=0 control misses
    every step's improvement: >= 2.1e-3 from the reference over steps 2-5, 4x the tolerance.
  - gradient norm (step 1), relative <= u: a sum of squares of the gradient above (measured <= 2e-4).
  - change over five steps, per parameter relative <= 1/4: bf16 differences grow step by step (MoE routing
    flips; measured up to 9%); coarse, it catches a rank whose shard stops being updated after step 1.

Quantized ZeRO-3 (zero.quantize_weights=int8) computes with the weights its int8 gathers decode, so its one-rank
reference computes with them too: before each step the one-rank run loads the values the quantized run's forward
read (`read_values`; every rank decoded the same), as tests/zero/test_quantized_collectives.py gives a plain engine
the decoded weights; the masters' update is then the one-rank gradient's at the tolerance above. With
zero.quantize_gradients=int8 the reduced gradient carries the codec's error (up to half an int8 step of each block's
largest value: a third of a small RMSNorm gradient in a block of large ones), so there, as in the fp32 test, every
quantized reduction equals its simulation from the ranks' own bf16 gradients bitwise, and the losses and step-1
norm are compared at the tolerance.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moe_lst.models.hf import moe_supported
from tests.equivalence import as_reference, assert_within, distances
from tests.multirank import run_multirank
from tests.parallel.harness import train

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

U = 2.0**-8  # bf16's unit roundoff
TOLERANCE = {"loss": U / 8, "norm": U, "update": 8 * U, "final": 0.25}
STEPS = 5
SMALL = {"model_overrides": {"n_layers": 2}}  # (the Hugging Face configs of tests/hf/tiny.py have 2 layers)
INT8 = {"quantize_block": 64, "quantize_weights": "int8"}

#: name -> (layout on 4 ranks, options of harness.train); all bf16, five steps
CASES: dict[str, tuple[dict, dict]] = {
    "tp2_sp2": ({"tp": 2, "sp": 2}, {**SMALL, "stage": 1}),
    # the balancing loss on: the reference's micro-batches are the dp shards
    "pp2_ep2_dp2_moe": ({"dp": 2, "ep": 2, "pp": 2}, {**SMALL, "moe": True, "stage": 2}),
    "hf_mixtral_zero3_ep2_sp2_packed": ({"dp": 2, "ep": 2, "sp": 2}, {"hf": "mixtral", "stage": 3, "packed": True}),
    "packed_pp2_tp2": ({"pp": 2, "tp": 2}, {**SMALL, "packed": True}),
    "packed_moe_zero3_ep2_sp2": ({"dp": 2, "ep": 2, "sp": 2}, {**SMALL, "moe": True, "stage": 3, "packed": True}),
    "int8_weights_zero3": ({"dp": 4}, {**SMALL, "stage": 3, "zero_options": INT8, "record_read": True}),
    "int8_weights_and_gradients_zero3": (
        {"dp": 4}, {**SMALL, "stage": 3, "zero_options": {**INT8, "quantize_gradients": "int8"}, "record_read": True}),
}
NEEDS_HF_MOE = {"hf_mixtral_zero3_ep2_sp2_packed"}
#: the one-rank runs' relative cost (others 1), to share them evenly over the ranks
COST = {"hf_mixtral_zero3_ep2_sp2_packed": 6, "packed_moe_zero3_ep2_sp2": 3, "pp2_ep2_dp2_moe": 3}


def _runnable() -> list[str]:
    return [name for name in CASES if moe_supported() or name not in NEEDS_HF_MOE]


def _options(name: str) -> dict:
    return {**CASES[name][1], "dtype": "bf16", "steps": STEPS}


# ---------------------------------------------------------------------------------------- on the ranks
class _Reductions:
    """In place of zero.sharding.optimizer._reduce: each reduction done synchronously (the same values), its input
    and output kept for the check against the codec's simulation."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, []

    def __call__(self, bucket, flat, async_op):
        out, handle = self.inner(bucket, flat, False)
        assert handle is None
        self.calls.append((bucket, flat.detach().clone(), out.detach().clone()))
        return out, None


def _quantized_reductions_match(calls: list) -> int:
    """Every quantized reduce-scatter's output is the codec's round trips of every rank's chunk for this rank,
    added in rank order in fp32 (collective over each bucket's group, in the same order on every rank); returns
    how many were checked."""
    from zero.dist import quantized

    checked = 0
    for bucket, flat, out in calls:
        if bucket.grad_codec is None or bucket.world == 1 or not bucket.sharded:
            continue
        assert flat.dtype == torch.bfloat16, "bf16 gradients are reduced"
        every = [torch.empty_like(flat) for _ in range(bucket.world)]
        dist.all_gather(every, flat, group=bucket.grad_group)
        mine = dist.get_rank(bucket.grad_group)
        want = None
        for rank_flat in every:
            chunk = quantized.round_trip(rank_flat.float().view(bucket.world, -1)[mine], bucket.grad_codec,
                                         bucket.quant_block)
            want = chunk if want is None else want + chunk
        assert torch.equal(out, want), "a quantized reduce-scatter differs from its simulation"
        checked += 1
    return checked


def _one_rank_options(name: str, read: list[dict] | None) -> dict:
    """harness.train's options of the case's one-rank reference: its micro-batches the dp shards, or, after a
    quantized run, each step from the weights that run's forward read (`read`)."""
    layout, options = CASES[name][0], _options(name)
    one = {k: v for k, v in options.items() if k != "record_read"}
    one["split_rows"] = layout.get("dp", 1)
    if options.get("record_read"):
        one["split_rows"], one["start_weights"] = 1, read
    return one


def _ranks(names: list[str]) -> dict[str, dict]:
    """Every case on the 4 ranks in turn, then this rank's share of the one-rank runs (a layout of one process
    inside the group: it trains as a process of its own would, bitwise), the reference and the lr=0 control of
    each case."""
    import zero.sharding.optimizer as reducer_module

    out = {}
    for name in names:
        layout, options = CASES[name][0], _options(name)
        recorder = None
        if options.get("zero_options", {}).get("quantize_gradients"):
            recorder = reducer_module._reduce = _Reductions(reducer_module._reduce)
        try:
            out[name] = train(layout, **options)
        finally:
            if recorder is not None:
                reducer_module._reduce = recorder.inner
        if recorder is not None:
            out[name]["reductions_checked"] = _quantized_reductions_match(recorder.calls)
    load, mine = [0] * dist.get_world_size(), []
    for name in sorted(names, key=lambda n: -COST.get(n, 1)):  # each run to the least loaded rank, costly first
        for lr in (None, 0.0):
            rank = load.index(min(load))
            load[rank] += COST.get(name, 1)
            if rank == dist.get_rank():
                mine.append((name, lr))
    one_rank = {}
    for name, lr in mine:
        options = _one_rank_options(name, out[name]["read"])
        one_rank[name, lr] = train({"world_size": 1}, **options, **({} if lr is None else {"lr": lr}))
    return {"runs": out, "one_rank": one_rank}


# ---------------------------------------------------------------------------------------- the checks
@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    """All cases and their one-rank runs on one spawn of 4 ranks."""
    return run_multirank(_ranks, 4, _runnable(), timeout=900)


def _one_rank(name: str, ranks: list[dict]) -> tuple[dict, dict]:
    """The case's reference (as a reference trajectory) and its lr=0 control record, wherever they ran."""
    found = {lr: r["one_rank"][name, lr] for r in ranks for (n, lr) in r["one_rank"] if n == name}
    assert set(found) == {None, 0.0}, f"{name}: the one-rank runs {sorted(map(str, found))}"
    return as_reference(found[None]), found[0.0]


@pytest.mark.parametrize("name", _runnable())
def test_bf16_layout_equals_one_rank(ranks, name):
    runs = [r["runs"][name] for r in ranks]
    reference_run, control = _one_rank(name, ranks)
    options = CASES[name][1]
    forced = bool(options.get("record_read"))  # each step's weights are the quantized run's
    if forced:  # every rank read the same decoded weights (the reference followed rank r's, any r)
        assert len(runs[0]["read"]) == STEPS
        for other in runs[1:]:
            assert all(torch.equal(a[k], b[k]) for a, b in zip(runs[0]["read"], other["read"]) for k in a), (
                f"{name}: the ranks decoded different weights")
    gradients_quantized = "quantize_gradients" in options.get("zero_options", {})
    tolerance = {k: v for k, v in TOLERANCE.items()
                 if not (forced and k == "final") and not (gradients_quantized and k == "update")}
    found = assert_within(runs, reference_run, tolerance, label=name)
    if gradients_quantized:
        assert all(r["reductions_checked"] > 0 for r in runs)
    # the control: the same one-rank training without updates falls outside the tolerance
    missed = distances([control], reference_run)
    assert missed["update"][0] > 30 * TOLERANCE["update"], missed
    if not forced:  # (forced weights make every step's loss the reference's)
        assert missed["loss"][0] > 4 * TOLERANCE["loss"], missed
    print(f"{name}: " + ", ".join(f"{k} {v:.2g}" for k, (v, _) in found.items())
          + "; lr=0 control: " + ", ".join(f"{k} {v:.2g}" for k, (v, _) in missed.items()))
