"""model=hf's once-per-config check of whether a model builds on the meta device (models.hf.spec._meta_buildable,
behind HFSpec.builds_on_meta) leaves torch's global generator as it found it: the build draws from it, and the
check is cached per process, so otherwise a run's initial weights depended on whether the process had checked
that config before (a pooled rank or the test process after other runs)."""

from __future__ import annotations

import torch
from moe_lst.models.hf.coverage import tiny_config
from moe_lst.models.hf.spec import _meta_buildable


def test_the_meta_build_check_leaves_the_global_generator_alone():
    config = tiny_config("glm4_moe")  # (an MoE model: its meta build draws from the generator)
    torch.manual_seed(0)
    before = torch.default_generator.get_state()
    assert _meta_buildable.__wrapped__(config.to_json_string())  # (uncached: the build runs)
    assert torch.equal(torch.default_generator.get_state(), before)
