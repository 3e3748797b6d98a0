"""The features whose numbers depend on the layout (recipes.compat.LAYOUT_DEPENDENT) with the other features: each run
of recipes.compat.LAYOUT_RUNS trains through the recipe (its train(), on the ranks of the tests' process pool, with
tests/recipes/pairwise.py's settings: the tiny models' 4 steps of 128 tokens) and is compared, every step's loss
and gradient norm, with its reference:

- DiLoCo (`parallel.replicas=2`, a synchronisation after steps 2 and 4): its replicas simulated in one process, each
  an engine built as the recipe builds it on one process with the run's other features (plain AdamW,
  train.grad_accum times dp), trained by the recipe's train_step on its replica's rows (micro-step major, then data
  rank), and after every `optim.diloco.inner_steps` steps tests.zero.test_diloco.outer_step on the engines' fp32
  masters. Tolerance: pairwise.tolerance (fp32 1e-5; bf16 and fp16 from the dtype's unit roundoff). The same
  simulation without its outer step is a wrong reference each DiLoCo run must reject.
- The quantized ZeRO collectives (qwZ's int8 weight all-gather, qgZ's int8 gradient reduce-scatter): the same run
  without them on one process (with DiLoCo: the simulated replicas without them), within QUANTIZED_TOLERANCE added
  to the dtype's. Not an exact reference: the int8 blocks are each rank's piece of a flat bucket, laid out by the
  run's degrees, stage, hpZ and bucket sizes, which one process does not reproduce (tests/zero/
  test_quantized_collectives.py checks the codec on the engine's own blocks against a plain engine given the decoded
  weights); the tolerance bounds what int8 rounding does to these runs, and a run that does not train is beyond it.
- The million-token preset at 128 tokens (pairwise.EXERCISE): the same run on one process without its layout, at
  pairwise.tolerance, as the pairwise runs are compared.
- 1-bit Adam (optim.onebit.warmup_steps=3 of the 4 steps): its warm-up is AdamW over the exactly averaged gradient,
  so the same run on one process is its reference for every loss (the last is taken before the compressed update)
  and the warm-up's gradient norms; its compressed step (the 4th) is checked where its numbers are made: every
  compressed all-reduce of the run (each bucket, on the group the engine chose for it) returned, bitwise, what the
  codec's one-process simulation (zero.optim.compression.simulate_all_reduce) computes from the inputs and error
  feedback of that group's ranks. What the step then does with the average (the masters' update) is compared with a
  simulation by tests/zero/test_onebit.py only (dp=2, ZeRO stages 0-1).

Every run is slow but those of recipes.compat.LAYOUT_DEFAULT, which hold every layout-dependent feature.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from recipes import compat
from tests.multirank import run_multirank
from tests.recipes import pairwise
from tests.recipes.test_pairwise import Shared

#: Relative distance allowed between a run with an int8 quantized collective and its reference without it, added to
#: the dtype's (pairwise.tolerance). int8 keeps each value to half a step of its block's absolute maximum / 127 (0.4%
#: of the block's largest value at worst): the weights a step computes with (qwZ) and the gradient each rank
#: contributes (qgZ) carry that rounding, which moves a loss far less (it averages over every token and weight) than
#: a gradient norm, and AdamW's first steps, about sign(g), turn an element whose gradient rounds across zero into a
#: whole lr step. Measured over the quantized runs (fp32, fp16, bf16; the dtype's own tolerance added): losses up to
#: 9.3e-4 (fp32, ZeRO-3 dp=2 with the million preset: 2.2x room), gradient norms up to 6.6e-3 in fp32 (3x) and 9.8e-3
#: in bf16 (dp=2 x sp=2 with a Mixtral, against 2.8e-2). Beyond them: a run that does not train (lr=1e-12: losses 8%
#: away at step 2, test_tolerance_rejects_a_run_that_does_not_train); the codec rounding to int4's 7 levels instead
#: of 127 (losses 8.1e-3 away at step 2, gradient norms 8.3e-2). Not pinned: the block size (zero.quantize_block):
#: another block rounds within the same kind of bound, which this tolerance does not tell apart
#: (tests/zero/test_quantized_collectives.py checks the codec on the engine's own blocks).
QUANTIZED_TOLERANCE = {"loss": 2e-3, "grad_norm": 2e-2}
#: The fp32 gradient norm's tolerance for runs of the million-token preset (1e-5 otherwise, pairwise.tolerance): with
#: dp=2 or sp=2 its gradient norms were up to 1.5e-5 from one process's in the four such runs, from step 1 (the same
#: weights and rows), while the losses agreed within 1.2e-7; with replicas of one process each (DiLoCo), 1e-7. Which
#: of the preset's sums rounds that much further than the tiny models' was not isolated (its MLP in 2 tiles instead of
#: 64 changed nothing). A gradient off by 0.1% under dp (1e-3 on every step's norm) is beyond it; so is a reference
#: on half the global batch.
MILLION_FP32_GRAD_NORM = 5e-5


def tolerance(run: tuple[str, ...], settings: dict[str, str]) -> dict[str, float]:
    """pairwise.tolerance for the run's dtype (fp32 runs of the million preset: MILLION_FP32_GRAD_NORM for the
    gradient norm), QUANTIZED_TOLERANCE added where the run quantizes a collective."""
    tol = pairwise.tolerance(settings)
    if "million" in run and settings.get("zero.dtype", "fp32") == "fp32":
        tol = {**tol, "grad_norm": MILLION_FP32_GRAD_NORM}
    if set(run) & set(pairwise.QUANTIZED):
        tol = {k: tol[k] + QUANTIZED_TOLERANCE[k] for k in tol}
    return tol


def train_in_process(overrides: list[str]) -> None:
    """`python -m recipes.pretrain <overrides>` on this rank of a tests.multirank process group (the ranks that
    torchrun would start, already joined): the recipe's own train(), without a process start per run."""
    from recipes.config import compose_command_line
    from recipes.preempt import StopSignals
    from recipes.pretrain import train

    train(compose_command_line(overrides), StopSignals())


def train_recording_compression(overrides: list[str]) -> list[dict]:
    """train_in_process, recording every call of 1-bit Adam's compressed all-reduce on this rank (each bucket of each
    compressed step): its input chunks, this rank's error feedback before the call, the chunk layout, the ranks of
    its group and what it returned."""
    import torch.distributed as dist

    import zero.optim.onebit as onebit

    calls, real = [], onebit.compressed_all_reduce

    def spy(x, worker_error, server_error, layout, group):
        before = {"x": x.clone(), "worker": worker_error.clone(), "server": server_error.clone()}
        out = real(x, worker_error, server_error, layout, group)
        # (None: a group of this rank alone, as zero.dist.comm reads it)
        ranks = [dist.get_rank()] if group is None else dist.get_process_group_ranks(group)
        calls.append({**before, "layout": (layout.numel, layout.world, layout.block), "ranks": ranks,
                      "out": out.clone()})
        return out

    onebit.compressed_all_reduce = spy
    try:
        train_in_process(overrides)
    finally:
        onebit.compressed_all_reduce = real
    return calls


def check_compressed_steps(records: list[list[dict]]) -> int:
    """Every compressed all-reduce the ranks made (records[rank]: that rank's calls, in order) returned what
    zero.optim.compression.simulate_all_reduce computes in one process from the inputs and error feedback of the
    ranks of its group, bitwise; returns the number of calls checked."""
    from zero.optim.compression import ChunkLayout, simulate_all_reduce

    assert len({len(calls) for calls in records}) == 1, [len(calls) for calls in records]
    for i in range(len(records[0])):
        for rank, calls in enumerate(records):
            call = calls[i]
            peers = [records[r][i] for r in call["ranks"]]
            assert all(peer["ranks"] == call["ranks"] and peer["layout"] == call["layout"] for peer in peers)
            layout = ChunkLayout(*call["layout"])
            assert layout.world == len(call["ranks"])
            want = simulate_all_reduce([peer["x"] for peer in peers], [peer["worker"].clone() for peer in peers],
                                       [peer["server"].clone() for peer in peers], layout)
            assert torch.equal(call["out"], want), (rank, i, call["ranks"], (call["out"] - want).abs().max())
    return len(records[0])


class Runs(Shared):
    """Shared's corpus, configs and references, each run trained by train_in_process on the tests' process pool."""

    def train(self, settings: dict[str, str], run_dir: Path) -> None:
        run_multirank(train_in_process, pairwise.processes(settings), _overrides(settings, self.paths, run_dir),
                      timeout=900)


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Shared:
    return Runs(tmp_path_factory.mktemp("layout_features"))


def _overrides(settings: dict[str, str], paths: pairwise.Paths, run_dir: Path) -> list[str]:
    return pairwise.command(settings, paths, run_dir)


# ------------------------------------------------------------------------------------ DiLoCo's simulated replicas
class _Rows:
    """Replica `replica`'s rows of the run's stream, as one process reads them: micro-batch m of a step is the run's
    micro-step m // dp of the replica's data rank m % dp (micro-step major, then dp rank)."""

    def __init__(self, stream, replica: int, dp: int) -> None:
        self.stream, self.replica, self.dp = stream, replica, dp

    def packed_batch(self, index: int, micro: int, rank: int, ignore_index: int):
        assert rank == 0
        return self.stream.packed_batch(index, micro // self.dp, self.replica * self.dp + micro % self.dp,
                                        ignore_index)


class _Masters:
    """An engine's fp32 masters as tests.zero.test_diloco.outer_step takes a replica: `parameters()`."""

    def __init__(self, engine) -> None:
        self.zo = engine.zero_optimizer
        self.values = [self.zo.read_master(b).detach().clone() for b in self.zo.trainable]

    def parameters(self):
        return iter(self.values)

    def publish(self) -> None:
        self.zo.load_masters(self.values)
        self.zo.gather_shards()


def simulate_replicas(run_overrides: list[str], reference_overrides: list[str], outer: bool = True) -> dict:
    """The DiLoCo run `run_overrides` describes with its replicas simulated in this one process: one engine per
    replica built as `python -m recipes.pretrain <reference_overrides>` builds it on one process (the run's other
    features, plain AdamW, train.grad_accum times dp), each trained by the recipe's train_step on its replica's rows
    of the run's stream; after every optim.diloco.inner_steps steps tests.zero.test_diloco.outer_step on their
    masters (outer=False leaves it out: a wrong reference the test must reject). Returns replica 0's loss and
    gradient norm per step, what the run's rank 0 logs."""
    import torch

    from recipes.config import compose_command_line, vocab_size
    from recipes.data import BatchSpec, build_streams
    from recipes.pretrain import build_dims, build_engine, build_model, train_step
    from tests.zero.test_diloco import outer_step

    cfg, ref = compose_command_line(run_overrides), compose_command_line(reference_overrides)
    t, par, d = cfg.train, cfg.parallel, cfg.optim.diloco
    assert par.replicas > 1 and d.inner_steps and d.warmup_steps == 0 and d.delta_dtype == "fp32"
    assert ref.parallel.replicas == 1 and not ref.optim.diloco.inner_steps
    assert ref.train.grad_accum == t.grad_accum * par.dp and ref.train.seed == t.seed
    dims = build_dims(ref)
    spec = BatchSpec(t.micro_batch_size, t.grad_accum, par.dp * par.replicas, t.seq_len)
    engines, streams = [], []
    for _ in range(par.replicas):  # each replica as the run builds it: seed, data, model, engine
        torch.manual_seed(t.seed)
        stream, _ = build_streams(cfg.data, spec, t.seed, vocab_size(cfg))
        model, parallel = build_model(ref, dims)
        engines.append(build_engine(ref, model, dims, parallel))
        streams.append(stream)
    anchor = _Masters(engines[0]).values
    momentum = [torch.zeros_like(a) for a in anchor]
    out: dict[int, dict[str, float]] = {}
    for step in range(t.steps):
        for r, (engine, stream) in enumerate(zip(engines, streams)):
            loss = train_step(engine, _Rows(stream, r, par.dp), step, ref, dims)
            if r == 0:
                out[step + 1] = {"loss": loss, "grad_norm": float(engine.global_grad_norm)}
        if outer and (step + 1) % d.inner_steps == 0:
            replicas = [_Masters(engine) for engine in engines]
            outer_step(replicas, anchor, momentum, d.outer_lr, d.outer_momentum)
            for replica in replicas:
                replica.publish()
    return out


def _simulated(shared: Shared, run: tuple[str, ...], settings: dict[str, str], outer: bool = True) -> dict:
    reference = pairwise.reference_settings(run, without=("diloco", *pairwise.QUANTIZED))
    directory = shared.root / "simulated" / pairwise.reference_key({**settings, "outer": str(outer)})
    (got,) = run_multirank(simulate_replicas, 1, _overrides(settings, shared.paths, directory / "run"),
                           _overrides(reference, shared.paths, directory / "reference"), outer, timeout=900)
    return got


def compared(run: tuple[str, ...], settings: dict[str, str]) -> list[tuple[str, int]]:
    """The (key, step) the run and its reference must agree on: every step's loss and gradient norm; with 1-bit Adam
    every loss (the last step's is taken before its compressed update) and the gradient norms of the warm-up (a
    compressed step reduces no gradient, so it has no global norm)."""
    steps = range(1, int(settings["train.steps"]) + 1)
    norms = range(1, int(settings["optim.onebit.warmup_steps"]) + 1) if "onebit" in run else steps
    return [("loss", step) for step in steps] + [("grad_norm", step) for step in norms]


def _distances(got: dict[int, dict], want: dict[int, dict], which: list[tuple[str, int]]) -> dict:
    """Per (key, step) of `which` the relative distance |got - want| / |want| (inf where either lacks it)."""
    out = {}
    for key, step in which:
        value, reference = got.get(step, {}).get(key), want.get(step, {}).get(key)
        out[(key, step)] = math.inf if value is None or reference is None else abs(value - reference) / abs(reference)
    return out


def reference_records(shared: Shared, run: tuple[str, ...], settings: dict[str, str]) -> dict[int, dict]:
    """What the run is compared with: DiLoCo's simulated replicas, or the run on one process without its layout (and
    without its quantized collectives)."""
    if "diloco" in run:
        return _simulated(shared, run, settings)
    return pairwise.metrics(shared.reference(tuple(n for n in run if n not in pairwise.QUANTIZED)))


def layout_settings(run: tuple[str, ...]) -> dict[str, str]:
    return pairwise.run_settings(run)


@pytest.mark.parametrize("run", [pytest.param(run, id=compat.pairwise_test_id(run),
                                              marks=() if run in compat.LAYOUT_DEFAULT else pytest.mark.slow)
                                 for run in compat.LAYOUT_RUNS])
def test_layout_dependent_run_equals_its_reference(run, shared, tmp_path):
    settings = layout_settings(run)
    if "onebit" in run:  # (its compressed step: each all-reduce against the codec's one-process simulation)
        records = run_multirank(train_recording_compression, pairwise.processes(settings),
                                _overrides(settings, shared.paths, tmp_path / "run"), timeout=900)
        assert check_compressed_steps(records) >= 1
    else:
        shared.train(settings, tmp_path / "run")
    want = reference_records(shared, run, settings)
    distances = _distances(pairwise.metrics(tmp_path / "run"), want, compared(run, settings))
    tol = tolerance(run, settings)
    largest = {key: max(d for (k, _), d in distances.items() if k == key) for key in tol}
    print(f"{compat.pairwise_test_id(run)}: largest relative distance "
          + ", ".join(f"{key} {largest[key]:.2e} (tolerance {tol[key]:.1e})" for key in tol))
    far = {k: d for k, d in distances.items() if not d <= tol[k[0]]}
    assert not far, f"beyond {tol}: {far}"
    if "diloco" in run:  # a wrong reference, the replicas without their outer step, is rejected
        wrong = _distances(pairwise.metrics(tmp_path / "run"), _simulated(shared, run, settings, outer=False),
                           compared(run, settings))
        assert any(d > tol[k] for (k, _), d in wrong.items()), wrong


#: The control's learning rate: as good as none (the recipe refuses optim.lr=0).
STILL_LR = "1e-12"


@pytest.mark.parametrize("which", ["quantized", pytest.param("bf16", marks=pytest.mark.slow)])
def test_tolerance_rejects_a_run_that_does_not_train(which, shared, tmp_path):
    """The tolerances against a control: the reference of a default run (the quantized one: QUANTIZED_TOLERANCE on
    fp32; the bf16 one: bf16's) trained at STILL_LR, a run that does not train, is beyond the run's tolerance from
    step 2 on the loss (step 1 computes with the same weights)."""
    (run,) = [run for run in compat.LAYOUT_DEFAULT if (set(run) & set(pairwise.QUANTIZED) if which == "quantized"
                                                       else "bf16" in run and "diloco" not in run)]
    plain = tuple(n for n in run if n not in pairwise.QUANTIZED)
    reference = pairwise.metrics(shared.reference(plain))
    settings = pairwise.reference_settings(plain)
    shared.train({**settings, "optim.lr": STILL_LR}, tmp_path / "lr0")
    distances = _distances(pairwise.metrics(tmp_path / "lr0"), reference, compared(run, settings))
    tol = tolerance(run, layout_settings(run))
    print(f"{which}: lr={STILL_LR} against the reference (tolerance {tol}): "
          + ", ".join(f"{k}@{step} {d:.2e}" for (k, step), d in distances.items()))
    assert distances[("loss", 1)] < 1e-6
    assert all(distances[("loss", step)] > tol["loss"] for step in (2, 3, 4)), distances
