"""The recipe's run every integration compares with, trained once per session."""

from __future__ import annotations

import pytest

from tests.integrations.common import recipe_losses


@pytest.fixture(scope="session")
def recipe_zero3(tmp_path_factory) -> list[float]:
    """`python -m recipes.pretrain` on 2 processes: the tiny dense Llama, dp=2, ZeRO-3, 4 steps of this setting."""
    return recipe_losses(tmp_path_factory.mktemp("recipe") / "run", ["model=tiny", "parallel.dp=2", "zero.stage=3"])
