import os
import sys

import pytest

# Ranks of multi-process tests share two cores: one thread each keeps them from fighting.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


@pytest.fixture(scope="session", autouse=True)
def _multirank_pools():
    """The processes that tests.multirank keeps for multi-rank tests end with the session."""
    yield
    from tests.multirank import close_pools

    close_pools()


def pytest_collection_finish(session):
    """The benchmarks' quick runs start in the background once collection ends (tests/test_benchmarks.py)."""
    bench = sys.modules.get("tests.test_benchmarks")
    if bench is not None:
        bench.start_ahead(session.items)


def pytest_sessionfinish(session):
    bench = sys.modules.get("tests.test_benchmarks")
    if bench is not None:
        bench.close_ahead()
