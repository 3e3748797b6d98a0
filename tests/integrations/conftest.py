"""The recipe's run every integration compares with, trained once per session."""

from __future__ import annotations

import pytest

from tests.integrations.common import recipe_run


@pytest.fixture(scope="session")
def recipe_zero3(tmp_path_factory) -> dict[str, list[float]]:
    """`python -m recipes.pretrain` on 2 processes: the tiny dense Llama, dp=2, ZeRO-3, 4 steps of this setting
    (per-step losses and gradient norms)."""
    return recipe_run(tmp_path_factory.mktemp("recipe") / "run", ["model=tiny", "parallel.dp=2", "zero.stage=3"])
