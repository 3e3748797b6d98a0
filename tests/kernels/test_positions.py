"""position_ids_for: the default positions, a shared row, and the shape rule."""

from __future__ import annotations

import pytest
import torch
from moe_lst.kernels.positions import position_ids_for


def test_default_shared_and_full_positions():
    tokens = torch.zeros(3, 5, dtype=torch.long)
    assert torch.equal(position_ids_for(tokens), torch.tensor([[0, 1, 2, 3, 4]] * 3))
    row = torch.tensor([7, 8, 9, 10, 11])
    assert torch.equal(position_ids_for(tokens, row), row.expand(3, 5))
    full = torch.arange(15).view(3, 5)
    assert position_ids_for(tokens, full) is full


def test_bad_shapes_name_the_rule():
    tokens = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"position_ids \(3,\) must be \[seq=4\].*\(2, 4\)"):
        position_ids_for(tokens, torch.arange(3))
    with pytest.raises(ValueError, match=r"position_ids \(1, 4\) must be"):
        position_ids_for(tokens, torch.arange(4)[None])
    with pytest.raises(ValueError, match=r"tokens must be \[batch, seq\], got shape \(4,\)"):
        position_ids_for(torch.zeros(4, dtype=torch.long))
