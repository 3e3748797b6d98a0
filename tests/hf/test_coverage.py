"""The coverage sweep (moe_lst.models.hf.coverage) and its page: docs/hf_coverage.md is what the recorded results
render to, every causal LM of the installed transformers has a row, the adapter builds exactly the families whose
logits pass, representative rows still hold when checked again (the whole sweep under -m slow)."""

from __future__ import annotations

import pytest
from moe_lst.models.hf import MODEL_TYPES, coverage
from moe_lst.models.hf.config import coverage as recorded

REQUIRED = ("deepseek_v3", "gpt_oss", "glm4_moe", "qwen3_moe", "qwen2_moe", "mixtral", "llama", "qwen3",
            "mistral", "qwen2", "olmoe")
#: Rows checked again in the default suite: an MLA model, one with sinks, sliding windows and expert biases, and
#: refused ones (bidirectional attention, attention logit softcapping).
RECHECKED = ("deepseek_v3", "gpt_oss", "bert", "gemma2")


def test_the_page_renders_the_recorded_results():
    records = recorded()
    assert coverage.DOC.read_text() == coverage.render(records), \
        "docs/hf_coverage.md is stale: run python -m moe_lst.models.hf.coverage"
    assert set(records) == set(coverage.causal_lm_types())
    assert all(set(r["features"]) == set(coverage.FEATURES) for r in records.values())
    passing = {k for k, r in records.items() if coverage.passes(r)}
    assert len(passing) >= 40 and set(REQUIRED) <= passing, sorted(set(REQUIRED) - passing)
    assert any(k.startswith(("qwen3_5_moe", "qwen3_next")) for k in passing)
    # every check that applies, tp2 and pp2 included: at least 40 families, the required ones among them
    everything = {k for k, r in records.items() if coverage.passes_every_check(r)}
    assert len(everything) >= 40 and set(REQUIRED) <= everything, sorted(set(REQUIRED) - everything)
    assert {"qwen3_next", "qwen3_5_moe_text"} <= everything
    tensor_parallel = {k for k in passing if records[k]["features"]["tp2"] == "pass"}
    assert {"llama", "mistral", "qwen2"} <= tensor_parallel  # (untied dense models whose plan maps)
    # (expert tensor parallelism: routed experts, DeepSeek-style routing with shared experts, a shared-expert gate)
    assert {"mixtral", "qwen3_moe", "glm4_moe", "qwen2_moe"} <= tensor_parallel
    pipeline = {k for k in passing if records[k]["features"]["pp2"] == "pass"}
    # (untied, tied head, MoE without a balancing loss, MoE with one)
    assert {"llama", "gemma", "deepseek_v3", "mixtral", "qwen3_moe", "gpt_oss"} <= pipeline
    assert set(MODEL_TYPES) == {k for k, r in records.items() if r["features"]["logits"] == "pass"}
    # every cell that is not a pass is a refusal naming what the family lacks, never a raw failure
    for kind, record in records.items():
        for feature, cell in record["features"].items():
            assert cell == "pass" or cell.startswith(("n/a (", "refused: ", "NotImplementedError: ")), \
                (kind, feature, cell)


def test_passes_needs_every_applicable_feature():
    row = {"moe": True, "features": {"logits": "pass", "dp2_zero3": "pass", "sp2": "n/a (refused: ...)",
                                     "ep2": "pass", "tp2": "refused: ...", "pp2": "refused: ..."}}
    assert coverage.passes(row)
    assert not coverage.passes({**row, "features": {**row["features"], "ep2": "AssertionError: rank 0 losses"}})
    assert not coverage.passes({**row, "features": {**row["features"], "logits": "TimeoutError: ..."}})
    # every check that applies, tp2 and pp2 included: a missing plan does not count against it, a refusal does
    assert not coverage.passes_every_check(row)
    planless = {**row["features"], "tp2": coverage.NO_PLAN, "pp2": "pass"}
    assert coverage.passes_every_check({**row, "features": planless})
    assert not coverage.passes_every_check({**row, "features": {**planless, "ep2": "AssertionError: ..."}})


@pytest.mark.parametrize("kind", RECHECKED)
def test_a_recorded_row_holds_when_checked_again(kind):
    again = coverage.local_sweep([kind])[kind]
    assert again["features"]["logits"] == recorded()[kind]["features"]["logits"]
    assert again["moe"] == recorded()[kind]["moe"]


@pytest.mark.slow
def test_the_whole_sweep_reproduces_the_recorded_results():
    fresh = coverage.local_sweep(list(coverage.causal_lm_types()))
    coverage.multirank_sweep(fresh)
    coverage.finish(fresh)
    want = recorded()
    assert {k: r["features"] for k, r in fresh.items()} == {k: r["features"] for k, r in want.items()}


def test_a_heterogeneous_configs_per_layer_sizes_shrink_by_the_same_ratio():
    # Gemma 4: 256-wide heads with 512-wide ones on its global layers; the tiny model keeps the ratio (16 against 8)
    # rather than 512-wide heads on a 32-wide model, whose unscaled attention logits make fp32 rounding grow past
    # the tolerances over two SGD steps
    config = coverage.tiny_config("gemma4_unified_text").to_dict()
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    assert config["head_dim"] == 8
    assert {int(k): v for k, v in config["per_layer_config"].items()} == {1: {"head_dim": 16}}


class _DerivedLayersConfig:
    """A config whose layer pattern is a property derived from other fields (no setter), as several hybrid configs of
    transformers have, reached through an alias (`layer_types`) and, inside its own init, through a field it sets."""

    model_type = "derived_layers_probe"
    attribute_map = {"layer_types": "layers_block_type"}

    def __init__(self, **values):
        self.hidden_size, self.num_hidden_layers = 4096, 32
        for key, value in values.items():
            setattr(self, self.attribute_map.get(key, key), value)
        if values.get("num_hidden_layers", 32) != 32:  # (its own rule: the pattern is fixed for 32 layers)
            self.layers_block_type = None

    @property
    def layers_block_type(self):
        return ["attention", "mamba"] * (self.num_hidden_layers // 2)

    def get_text_config(self):
        return self

    def to_dict(self):
        return {"hidden_size": self.hidden_size, "num_hidden_layers": self.num_hidden_layers,
                "layers_block_type": self.layers_block_type}


def test_a_config_the_sweep_cannot_derive_is_one_line_naming_why(monkeypatch):
    from transformers import CONFIG_MAPPING

    kind = _DerivedLayersConfig.model_type
    monkeypatch.setitem(CONFIG_MAPPING._extra_content, kind, _DerivedLayersConfig)
    assert "layer_types" not in coverage._tiny_values(kind)  # (the alias of a read-only property is left alone)
    cell = coverage.local_sweep([kind])[kind]["features"]["logits"]
    assert cell == ("refused: no tiny config: _DerivedLayersConfig.layers_block_type is derived from other fields and "
                    "has no setter"), cell
    # a config's own validator: the cell names it and its rule, on one line
    cell = coverage.local_sweep(["kolibri1_1"])["kolibri1_1"]["features"]["logits"]
    assert cell.startswith("refused: no tiny config: Kolibri1_1Config's validator 'validate_architecture' rejects")
    assert "head_dim" in cell and "\n" not in cell
