import time

import pytest
import torch
import torch.distributed as dist

from tests.multirank import MultiRankError, run_multirank


def _rank_and_sum():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t.item()}


def _fail_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("boom from rank one")
    return dist.get_rank()


def _hang_on_rank_0():
    if dist.get_rank() == 0:
        time.sleep(60)


def test_results_in_rank_order():
    out = run_multirank(_rank_and_sum, 3)
    assert [o["rank"] for o in out] == [0, 1, 2]
    assert all(o["world"] == 3 and o["sum"] == 6.0 for o in out)


def test_exception_carries_failing_rank_traceback():
    with pytest.raises(MultiRankError, match=r"(?s)rank 1 of 2 failed.*ValueError: boom from rank one"):
        run_multirank(_fail_on_rank_1, 2)


def test_timeout_instead_of_hang():
    start = time.monotonic()
    with pytest.raises(MultiRankError, match="timed out"):
        run_multirank(_hang_on_rank_0, 2, timeout=12)
    assert time.monotonic() - start < 40
