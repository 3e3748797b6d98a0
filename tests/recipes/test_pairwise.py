"""Every supported pair of features trains as on one process: each run of recipes.compat's pairwise covering
(`pairwise_runs`, listed on docs/compatibility.md) goes through the recipe under torchrun on its processes and is
compared, step by step, with its reference, the same run on one process without its layout settings
(tests/recipes/pairwise.py): every step's loss and gradient norm within `pairwise.tolerance` (fp32 1e-5; bf16 and
fp16 from the dtype's unit roundoff).

The runs are parametrized from the page (deriving them takes the check's whole table, ~10 s of CPU, too long for
collecting tests; tests/recipes/test_compat.py fails while the page is not what the check derives today). The whole
covering is slow; the default suite runs the two runs that together hold the most pairs.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from recipes import compat
from tests.recipes import pairwise
from tests.recipes.test_pretrain import _run_cli

RUNS = compat.runs_on_page(compat.DOC.read_text())


def _pairs(run: tuple[str, ...]) -> set[tuple[str, str]]:
    return set(itertools.combinations(run, 2))


def default_runs(runs: list[tuple[str, ...]]) -> tuple[tuple[str, ...], ...]:
    """The two runs that together hold the most pairs (then the fewest processes, then the first listed)."""
    return max(itertools.combinations(runs, 2),
               key=lambda two: (len(_pairs(two[0]) | _pairs(two[1])), -sum(compat.processes(r) for r in two)))


DEFAULT = default_runs(RUNS) if len(RUNS) > 1 else tuple(RUNS)


class Shared:
    """What the runs share: the Hugging Face configs, the prepared corpus, and the references trained so far (runs
    with equal references train one)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.paths = pairwise.Paths(pairwise.write_hf_configs(root / "hf"), pairwise.prepare_corpus(root / "data"),
                                    root / "nvme")
        self.paths.nvme.mkdir()
        self.references: dict[str, Path] = {}

    def train(self, settings: dict[str, str], run_dir: Path) -> None:
        nproc = pairwise.processes(settings)
        proc = _run_cli(*pairwise.command(settings, self.paths, run_dir), nproc=nproc, timeout=900)
        assert proc.returncode == 0, proc.stderr[-4000:]

    def reference(self, run: tuple[str, ...]) -> Path:
        settings = pairwise.reference_settings(run)
        key = pairwise.reference_key(settings)
        if key not in self.references:
            self.train(settings, self.root / "references" / key)
            self.references[key] = self.root / "references" / key
        return self.references[key]


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Shared:
    return Shared(tmp_path_factory.mktemp("pairwise"))


@pytest.mark.parametrize("run", [pytest.param(run, id=compat.pairwise_test_id(run),
                                              marks=() if run in DEFAULT else pytest.mark.slow) for run in RUNS])
def test_run_equals_one_process(run, shared, tmp_path):
    settings = pairwise.run_settings(run)
    shared.train(settings, tmp_path / "run")
    distances = pairwise.distances(tmp_path / "run", shared.reference(run))
    steps = int(pairwise.COMMON["train.steps"])
    assert sorted(distances) == sorted((key, step) for key in ("loss", "grad_norm") for step in range(1, steps + 1))
    tolerance = pairwise.tolerance(settings)
    largest = {key: max(d for (k, _), d in distances.items() if k == key) for key in tolerance}
    print(f"{compat.pairwise_test_id(run)}: largest relative distance "
          + ", ".join(f"{key} {largest[key]:.2e} (tolerance {tolerance[key]:.1e})" for key in tolerance))
    far = {k: d for k, d in distances.items() if not d <= tolerance[k[0]]}
    assert not far, f"beyond {tolerance}: {far}"


def test_reference_is_the_run_on_one_process_without_its_layout():
    run = ("zero3", "bf16", "opt_cpu", "delayed", "param_nvme", "hpz", "dp2", "pp2", "ep2", "moe", "nsa", "packed",
           "ckpt")
    mine, ref = pairwise.run_settings(run), pairwise.reference_settings(run)
    assert pairwise.processes(mine) == 4 and pairwise.processes(ref) == 1
    # the layout goes: the degrees, stage 3's parameter offload to NVMe, hpZ
    assert (mine["parallel.dp"], mine["parallel.pp"], mine["parallel.ep"], mine["zero.hpz_partition_size"]) == \
        ("2", "2", "2", "2")
    assert ref["parallel.dp"] == "1" and not {"parallel.pp", "parallel.ep", "zero.hpz_partition_size",
                                              "zero.offload_params", "zero.nvme_path"} & set(ref)
    # the delayed update keeps what it needs (ZeRO >= 1 with the optimizer on the CPU), ep2 its MoE model
    delayed = ("zero.stage", "zero.offload_optimizer", "zero.offload_delayed_update")
    assert [ref[k] for k in delayed] == ["1", "cpu", "true"]
    assert ref["model"] == mine["model"] == "moe_tiny"
    # the same global batch in the same micro-batches: pp2's 2 micro-batches on each of dp=2 ranks
    assert (mine["train.grad_accum"], ref["train.grad_accum"]) == ("2", "4")
    layout = compat.LAYOUT_KEYS | {"train.grad_accum"}
    assert {k: v for k, v in mine.items() if k not in layout} == {k: v for k, v in ref.items() if k not in layout}
    for feature in set(compat.LAYOUT_DEPENDENT) - pairwise.KEPT_IN_REFERENCE:
        with pytest.raises(ValueError, match=f"{feature} has no one-process reference"):
            pairwise.reference_settings(("dp2", feature))
    # less the features `without`: the quantized collectives' run against the same run without them
    quantized = pairwise.reference_settings(("zero3", "qwz", "qgz", "dp2", "million"), without=pairwise.QUANTIZED)
    assert quantized == pairwise.reference_settings(("dp2", "million"))
    assert not {k for k in quantized if "quantize" in k} and quantized["+experiment"] == "million"


def test_layout_only_features_are_the_degrees_and_zero_sharding_and_offload():
    names = {f.name for f in compat.FEATURES}  # (and the features named here exist)
    assert set(pairwise.EXERCISE) <= names and set(compat.LAYOUT_DEPENDENT) <= names
    assert all(apart <= names for apart in compat.APART)
    assert {f.name for f in compat.FEATURES if compat.layout_only(f)} == {
        "zero1", "zero2", "zero3", "opt_cpu", "opt_nvme", "param_cpu", "param_nvme", "hpz", "dp2", "tp2", "pp2", "sp2",
        "ep2"}


#: Features small enough to derive in the default suite, with a refusal of three together that no two make (pp2 with
#: optimizer offload to NVMe at ZeRO stage 2: tied embeddings' gradients would be summed in NVMe files), a set of
#: APART and a feature of LAYOUT_DEPENDENT.
SUBSET = ("zero1", "zero2", "bf16", "opt_nvme", "qgz", "dp2", "tp2", "pp2", "sp2", "moe")


def test_covering_of_a_subset_holds_every_supported_pair_in_runs_the_check_accepts():
    table = compat.derive(tuple(f for f in compat.FEATURES if f.name in SUBSET))
    assert table.supported("zero2", "opt_nvme") and table.supported("zero2", "pp2") and \
        table.supported("opt_nvme", "pp2")
    runs = compat.pairwise_runs(table)
    names = [n for n in SUBSET if n not in compat.LAYOUT_DEPENDENT]
    wanted = {(a, b) for a, b in table.pairs() if a in names and b in names and table.supported(a, b)}
    held = set().union(*map(_pairs, runs))
    assert wanted <= held and "qgz" not in {n for run in runs for n in run}
    assert not any({"bf16", "moe", "tp2"} <= set(run) for run in runs)
    with compat._hf_configs() as hf_dir:
        deriver = compat.Deriver(hf_dir)
        assert deriver.check(compat.command_line(("zero2", "opt_nvme", "pp2"))) is not None
        for run in runs:
            assert all(table.supported(a, b) for a, b in _pairs(run)), run
            assert compat.processes(run) <= compat.MAX_PROCESSES, run
            assert deriver.check(compat.command_line(run)) is None, run
    compat._RUNS.clear()
    assert compat.pairwise_runs(table) == runs  # deterministic
    # the page lists them as they are, and declares each as its test's coverage
    assert compat.runs_on_page(compat.render(table, runs)) == runs
    declared = compat.declared(table, runs)
    assert all(declared[f"{compat.PAIRWISE_TEST}[{compat.pairwise_test_id(run)}]"] == (run,) for run in runs)


@pytest.mark.slow  # (derives the whole table: ~10 s of CPU)
def test_covering_holds_every_supported_pair_of_the_features_compared_with_one_process():
    table = compat.derive()
    runs = compat.pairwise_runs(table)
    assert runs == RUNS, "the page lists other runs: python -m recipes.compat"
    names = [f.name for f in compat.FEATURES if f.name not in compat.LAYOUT_DEPENDENT]
    wanted = {(a, b) for a, b in table.pairs() if a in names and b in names and table.supported(a, b)}
    assert wanted <= set().union(*map(_pairs, runs))
    covered = compat.coverage(table)
    uncovered = [(a, b) for a, b in table.pairs() if table.supported(a, b) and (a, b) not in covered]
    assert uncovered == []  # (the layout-dependent features' pairs: tests/recipes/test_layout_features.py)
