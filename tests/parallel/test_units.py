"""ZeRO-3 gather units: blocks of a ModuleList (or a pipeline rank's BlockDict), never a ModuleDict's."""

import torch.nn as nn

from zero.sharding.stage3 import BlockDict, find_units


def test_units_are_blocks_not_moduledict_children():
    # A nanoGPT-style layout: the blocks sit in a ModuleList inside a ModuleDict beside the embedding.
    model = nn.Module()
    model.transformer = nn.ModuleDict({"wte": nn.Embedding(8, 4), "h": nn.ModuleList(nn.Linear(4, 4) for _ in range(3)),
                                       "ln_f": nn.LayerNorm(4)})
    assert [n for n, _ in find_units(model, None)] == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]
    stages = nn.Module()
    stages.layers = BlockDict({"3": nn.Linear(4, 4), "4": nn.Linear(4, 4)})
    assert [n for n, _ in find_units(stages, None)] == ["layers.3", "layers.4"]
