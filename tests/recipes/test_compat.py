"""docs/compatibility.md is what the recipe's own check says of every feature and pair today (recipes.compat), every
refusal in it is one specific line, and every equivalence test it names exists and covers pairs the check accepts."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from recipes import compat
from recipes.config import ConfigError, check_config, compose_command_line

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def table() -> compat.Table:
    return compat.derive()


def test_committed_page_is_what_the_check_says(table, tmp_path, monkeypatch):
    assert compat.DOC.read_text() == compat.render(table), "run python -m recipes.compat and commit the page"
    monkeypatch.setattr(compat, "derive", lambda: table)  # (the command's own paths, without deriving again)
    assert compat.main(["--check"]) == 0
    stale = tmp_path / "compatibility.md"
    stale.write_text(compat.DOC.read_text().replace("✓", "○", 1))
    assert compat.main(["--check", "--out", str(stale)]) == 1
    assert compat.main(["--out", str(stale)]) == 0 and stale.read_text() == compat.DOC.read_text()


def test_every_refusal_is_one_line_naming_a_key(table):
    refusals = table.refusals()
    assert len(refusals) > 10
    for message in refusals:
        assert message and "\n" not in message and message == message.strip(), repr(message)
        assert re.search(r"\b(model|data|parallel|optim|zero|train)[.=/]", message), message
        assert "Traceback" not in message and not message.startswith(("Error", "Exception")), message


def test_refusals_and_acceptances_the_rules_state(table):
    # a few cells read by hand from the rules in recipes/config.py and zero/config.py
    assert table.cell("tp2", "tiled_loss").startswith("train.tiled_loss with parallel.tp > 1 is not supported")
    assert table.cell("zero2", "onebit").startswith("1-bit Adam at zero.stage=2 is not supported")
    assert table.cell("pp2", "diloco").startswith("DiLoCo with parallel.pp=2 is not implemented")
    assert table.cell("ep2", "hf").startswith("parallel.ep=2 needs an MoE model")
    assert table.cell("zero1", "qwz").startswith("zero.quantize_weights=int8 needs zero.stage=3")
    assert table.cell("zero1", "zero3") == "alt:zero.stage"
    for a, b in [("tp2", "sp2"), ("pp2", "ep2"), ("hf_moe", "ep2"), ("sp2", "nsa"), ("zero3", "param_nvme"),
                 ("diloco", "ep2"), ("onebit", "sp2")]:
        assert table.supported(a, b), (a, b, table.cell(a, b))


def test_declared_equivalence_runs_name_features_the_check_accepts_together(table):
    names = {f.name for f in compat.FEATURES}
    for test, runs in compat.EQUIVALENCE.items():
        assert runs and test.startswith("tests/") and "::" in test, test
        for run in runs:
            assert set(run) <= names, (test, set(run) - names)
            for a in run:
                for b in run:
                    assert table.supported(a, b), f"{test} claims {a} + {b}, which the check refuses"
    covered = compat.coverage(table)
    assert covered[("zero3", "hf")] and covered[("tp2", "sp2")]
    assert ("tp2", "tiled_loss") not in covered


def test_layout_runs_hold_every_supported_pair_of_a_layout_dependent_feature(table):
    """Each run of LAYOUT_RUNS holds a layout-dependent feature, is accepted whole by the check on at most
    MAX_PROCESSES processes and holds no refused pair; together they hold every supported pair of such a feature that
    no test of EQUIVALENCE holds, the default suite's runs every such feature, and no supported pair is left
    uncovered."""
    import itertools

    names = [f.name for f in compat.FEATURES]
    with compat._hf_configs() as hf_dir:
        deriver = compat.Deriver(hf_dir)
        for run in compat.LAYOUT_RUNS:
            assert set(run) & set(compat.LAYOUT_DEPENDENT) and list(run) == sorted(run, key=names.index), run
            assert not {"diloco", "onebit"} <= set(run), run  # (one reference each)
            assert compat.processes(run) <= compat.MAX_PROCESSES, run
            assert all(table.supported(a, b) for a, b in itertools.combinations(run, 2)), run
            assert deriver.check(compat.command_line(run)) is None, run
    assert len(set(compat.LAYOUT_RUNS)) == len(compat.LAYOUT_RUNS) and set(compat.LAYOUT_DEFAULT) <= \
        set(compat.LAYOUT_RUNS)
    assert set(compat.LAYOUT_DEPENDENT) <= {name for run in compat.LAYOUT_DEFAULT for name in run}
    held = {pair for run in compat.LAYOUT_RUNS for pair in itertools.combinations(run, 2)}
    others = compat.coverage(table, compat.EQUIVALENCE)  # (the engine-level tests of such features hold some)
    wanted = {(a, b) for a, b in table.pairs() if table.supported(a, b) and {a, b} & set(compat.LAYOUT_DEPENDENT)
              and (a, b) not in others}
    assert len(wanted) > 80 and wanted <= held, sorted(wanted - held)
    covered = compat.coverage(table)
    assert [pair for pair in table.pairs() if table.supported(*pair) and pair not in covered] == []


def test_every_named_equivalence_test_is_defined():
    """Each node id's file defines its test function at module level (the parametrized ids: the slow test below)."""
    import ast

    for test in compat.EQUIVALENCE:
        path, _, name = test.partition("::")
        tree = ast.parse((REPO / path).read_text())
        functions = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
        assert name.split("[")[0] in functions, f"{test}: no such test function in {path}"


@pytest.mark.slow  # (about 9 s of CPU: collecting imports every test module it names, transformers included)
def test_every_named_equivalence_test_is_collected():
    ids = sorted(compat.EQUIVALENCE)
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-m", "slow or not slow", *ids],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    collected = {line.strip() for line in proc.stdout.splitlines() if "::" in line}
    missing = [i for i in ids if not any(c == i or c.startswith(i + "[") for c in collected)]
    assert proc.returncode == 0 and not missing, (missing, proc.stdout[-2000:], proc.stderr[-2000:])


@pytest.mark.parametrize("overrides, world, message", [
    # zero.ParallelDims refuses this once the process group exists: its own rule, called by the check first
    (["model=moe_tiny", "parallel.ep=4"], 2,
     "parallel.ep=4 must divide dp * sp = 2: expert parallel ranks are borrowed from the data x sequence parallel "
     "region; use an ep that divides 2"),
    # moe.MoELayer refuses this while the model is built: its own rule (moe.dispatch.check_expert_parallel), called by
    # the check first with the recipe's keys
    (["model=moe_tiny", "parallel.ep=3"], 3,
     "parallel.ep=3 must divide the 8 experts (num_experts): each expert-parallel rank holds num_experts / ep of "
     "them; use an ep that divides 8"),
])
def test_expert_layouts_the_runtime_refuses_are_refused_before_any_process_group(monkeypatch, overrides, world,
                                                                                  message):
    import zero

    cfg = compose_command_line(overrides)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(ConfigError) as refused:
        check_config(cfg)
    assert str(refused.value) == message
    if world % cfg.parallel.ep:
        with pytest.raises(zero.LayoutError) as late:
            zero.ParallelDims(dp=world, ep=cfg.parallel.ep, world_size=world)
        assert message == str(late.value)
    else:
        from moe.dispatch import check_expert_parallel

        with pytest.raises(ConfigError) as late:
            check_expert_parallel(8, cfg.parallel.ep)  # the rule MoELayer applies, in the library's own names
        assert message == f"parallel.{late.value}"


def test_composition_is_put_back_after_each_check(tmp_path):
    from omegaconf import OmegaConf

    deriver = compat.Deriver(tmp_path)
    with deriver.compose(("model=tiny",)) as cfg:
        pristine = OmegaConf.to_yaml(cfg)
    with deriver.compose(("model=tiny", "zero.stage=3", "parallel.tp=2", "train.tiled_loss=true")) as cfg:
        assert (cfg.zero.stage, cfg.parallel.tp, cfg.train.tiled_loss) == (3, 2, True)
    with pytest.raises(ConfigError, match="unknown config key zero.stagee: did you mean zero.stage"):
        with deriver.compose(("model=tiny", "parallel.tp=2", "zero.stagee=3")):
            pass
    (key,) = deriver.composed
    assert OmegaConf.to_yaml(deriver.composed[key]) == pristine
