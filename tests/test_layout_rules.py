"""Rules of the codebase's shape that review would otherwise have to catch by eye."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 60


def _functions(package: str):
    for path in sorted((REPO / package).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield path.relative_to(REPO), node


def test_runtime_and_recipe_functions_fit_a_screen():
    too_long = [
        f"{path}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for package in ("zero", "recipes")
        for path, node in _functions(package)
        if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines: {too_long}"


def test_packages_declare_contracts_instead_of_sniffing_attributes():
    # zero speaks of reduce groups, not experts; nothing finds MoE layers by their attributes.
    pattern = re.compile(r"is_expert|hasattr\([^)]*router")
    hits = [
        f"{path.relative_to(REPO)}:{i}"
        for package in ("zero", "sequence_parallel", "recipes")
        for path in sorted((REPO / package).rglob("*.py"))
        for i, line in enumerate(path.read_text().splitlines(), start=1)
        if pattern.search(line)
    ]
    assert not hits, hits


def test_layering_moe_and_sequence_parallel_never_import_each_other():
    imports = re.compile(r"^\s*(from|import)\s+(\w+)", re.MULTILINE)
    below = {"zero": {"moe", "sequence_parallel", "recipes"}, "kernels": {"moe", "sequence_parallel", "recipes",
             "zero"}, "moe": {"sequence_parallel", "recipes"}, "sequence_parallel": {"moe", "recipes"}}
    bad = []
    for package, forbidden in below.items():
        for path in sorted((REPO / package).rglob("*.py")):
            for _, name in imports.findall(path.read_text()):
                if name in forbidden:
                    bad.append(f"{path.relative_to(REPO)} imports {name}")
    assert not bad, bad


def test_collectives_go_through_zero_comm():
    # zero.comm counts their bytes and its watchdog sees them wait (torch's pipeline schedules send and
    # receive by themselves: zero/pipeline.py watches the schedule as one section instead).
    pattern = re.compile(r"\b(dist|torch\.distributed)\.(all_reduce|all_gather|reduce_scatter|all_to_all|broadcast|"
                         r"barrier|monitored_barrier|send|recv|isend|irecv|batch_isend_irecv|gather|scatter|reduce)\w*\(")
    hits = [
        f"{path.relative_to(REPO)}:{i}"
        for package in ("zero", "moe", "sequence_parallel", "recipes", "kernels")
        for path in sorted((REPO / package).rglob("*.py")) if path != REPO / "zero" / "comm.py"
        for i, line in enumerate(path.read_text().splitlines(), start=1)
        if pattern.search(line)
    ]
    assert not hits, hits
