"""The coverage sweep (moe_lst.models.hf.coverage) and its page: docs/hf_coverage.md is what the recorded results
render to, every causal LM of the installed transformers has a row, the adapter builds exactly the families whose
logits pass, representative rows still hold when checked again (the whole sweep under -m slow)."""

from __future__ import annotations

import pytest
from moe_lst.models.hf import MODEL_TYPES, coverage
from moe_lst.models.hf.config import coverage as recorded

REQUIRED = ("deepseek_v3", "gpt_oss", "glm4_moe", "qwen3_moe", "qwen2_moe", "mixtral", "llama", "qwen3",
            "mistral", "qwen2", "olmoe")
#: Rows checked again in the default suite: an MLA model, one with sinks, sliding windows and expert biases, a refused
#: one (bidirectional attention) and one with attention logit softcapping.
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


# ----------------------------------------------------------- the tiny-config rules (one family each, no training)
def test_per_layer_schedules_and_layer_index_lists_follow_the_tiny_layers():
    # DeepSeek V4: its MLP schedule (hash-routed MoE, then learned routing) cycles over the tiny layers as the
    # attention kinds do, so the tiny model has a router whose logits the balancing loss reads
    values = coverage._tiny_values("deepseek_v4")
    assert values["mlp_layer_types"] == ["hash_moe", "moe"]
    assert values["layer_types"] == ["heavily_compressed_attention", "compressed_sparse_attention"]
    # Zamba 2: hybrid_layer_ids names exactly the default layers of kind "hybrid": it names the tiny ones
    values = coverage._tiny_values("zamba2")
    assert values["layer_types"] == ["linear_attention", "hybrid"] and values["hybrid_layer_ids"] == [1]


def test_sizes_under_unknown_keys_shrink_by_their_name_or_a_shared_default():
    values = coverage._tiny_values("ergo")  # (named after intermediate_size)
    assert values["first_dense_intermediate_size"] == values["shared_intermediate_size"] == 48
    values = coverage._tiny_values("deepseek_v4")
    assert values["index_head_dim"] == 8  # (named after head_dim)
    # defaults equal to those of known sizes: o_lora_rank as q_lora_rank (1024), index_n_heads as the heads (64)
    assert values["o_lora_rank"] == values["q_lora_rank"] == 16 and values["index_n_heads"] == 4
    # a key that shares a size's default but sizes no parameter keeps its value: the indexer's top-k (512, as the
    # head dim), Gemma 2's query scale (256, as the head dim)
    assert "index_topk" not in values and "query_pre_attn_scalar" not in coverage._tiny_values("gemma2")


def test_a_rotary_width_keeps_its_share_of_the_tiny_head():
    # GPT-J rotates 64 of its 256 head channels: 2 of the tiny 8 (64 would not fit the tiny head)
    assert coverage._tiny_values("gptj")["rotary_dim"] == 2
    assert coverage.tiny_config("gptj").rotary_dim == 2  # (and its plain model runs with it)


def test_relaxations_combine_and_per_layer_sizes_may_keep_the_tiny_ones():
    values = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "per_layer_config": {}}
    variants = coverage._variants(values)
    # the relaxations alone come first, in the order a family that runs with one got before
    assert variants[:6] == [values, {**values, "num_key_value_heads": 4}, {k: v for k, v in values.items()
                            if k != "head_dim"}, {**values, "head_dim": 16}, {**values, "use_cache": False},
                            {**values, coverage._FLAT: True}]
    assert len(variants) == 3 * 2 * 2 * 2  # (every combination; head_dim dropped or 16, not both)
    # Dots 3 Note: its sliding layers' scaled head widths break its rule head_dim = nope + rope width; as many key-
    # value heads as query heads, head_dim 16 and the tiny sizes on every layer satisfy it
    config = coverage.tiny_config("dots3_note_text")
    assert (config.num_key_value_heads, config.head_dim, config.to_dict()["per_layer_config"]) == (4, 16, {})


def test_sub_configs_and_open_choices_are_derived_too():
    # GIT's vision tower is a sub-config: derived from its own class like the causal LM's
    vision = coverage._tiny_values("git")["vision_config"]
    assert (vision["hidden_size"], vision["num_hidden_layers"]) == (32, 2)
    # Moshi's parent fills its depth decoder from its other fields: that sub-config keeps its default
    assert "depth_decoder_config" not in coverage._tiny_values("moshi")
    assert coverage._tiny_values("xmod")["default_language"] == "en_XX"  # (the first of its languages)


def test_keys_that_are_not_the_tokens_are_refused_by_name():
    import torch
    from moe_lst.models.hf.attention import hf_attention, hf_dense_attention, set_attention

    module = torch.nn.Module()
    set_attention(module, hf_dense_attention)
    q = torch.randn(1, 2, 6, 4)
    out, _ = hf_attention(module, q, q, q, None)
    assert out.shape == (1, 6, 2, 4)
    kv = torch.randn(1, 2, 8, 4)  # (6 tokens' keys and 2 compressed slots, as DeepSeek V4's attention appends)
    with pytest.raises(NotImplementedError, match="8 keys for 6 tokens"):
        hf_attention(module, q, kv, kv, None)


def test_experts_with_a_tensor_beside_their_fused_weights_refuse_expert_parallelism():
    # Ergo's experts hold a per-expert output norm [experts, hidden] indexed by the global expert ids: sharding only
    # the fused weights would leave it whole, its gradient reduced as one expert's; the shard is refused by name
    from moe_lst.models.hf.experts import is_experts
    from moe_lst.models.hf.model import HFCausalLM
    from transformers import AutoModelForCausalLM

    model = HFCausalLM(AutoModelForCausalLM.from_config(coverage.tiny_config("ergo")))
    experts = next(m for m in model.modules() if is_experts(m))
    with pytest.raises(NotImplementedError, match="ErgoExperts: post_expert_norm.weight is a tensor"):
        experts.keep_experts(0, 2)


def test_the_sweep_compares_expert_slices_and_whole_tensors_of_the_experts():
    import torch

    full = torch.arange(8.0).reshape(4, 2)
    reference = {"losses": [1.0], "state": {"b.experts.down_proj": full, "b.experts.norm.weight": full}}
    rank = {"losses": [1.0], "expert_ranges": {"b": (2, 4)},
            "state": {"b.experts.down_proj": full[2:4], "b.experts.norm.weight": full}}
    coverage.compare([rank], reference)  # (rank 1's experts 2 and 3, and the unsharded tensor whole)
    rank["state"]["b.experts.down_proj"] = full[0:2]
    with pytest.raises(AssertionError, match="down_proj"):
        coverage.compare([rank], reference)


def test_aliases_and_layer_kinds_follow_the_tiny_model():
    from transformers import CONFIG_MAPPING

    # DBRX copies d_model into its ffn_config in its own init, before an alias (hidden_size) is applied: the tiny
    # width goes under the config's own key, so its experts are 32 wide, not 2048
    dbrx = coverage._construct(CONFIG_MAPPING["dbrx"], {"hidden_size": 32, "ffn_config": {"ffn_hidden_size": 48}})
    assert (dbrx.d_model, dbrx.ffn_config.hidden_size) == (32, 32)
    # LFM2-MoE leaves layer_types at None and its model indexes it: the kinds its model compares them with, and its
    # leading dense layers (num_dense_layers) leave one MoE layer of 2
    values = coverage._tiny_values("lfm2_moe")
    assert values["layer_types"] == ["conv", "full_attention"] and values["num_dense_layers"] == 1
    # Falcon-H1's mamba_d_ssm (1024) breaks its rule against the tiny mamba heads: left for the config to derive
    assert coverage._tiny_values("falcon_h1")["mamba_d_ssm"] is None


def test_configs_whose_model_reads_what_they_leave_out_get_it_or_a_refusal_naming_the_statement():
    # ZAYA routes to one expert only: the top-1 relaxation
    assert coverage.tiny_config("zaya").num_experts_per_tok == 1
    # Cohere Compass reads rotary parameters per layer kind and leaves them empty: the default rotary for each kind
    assert coverage.tiny_config("cohere_compass_text").rope_parameters["full_attention"]["rope_type"] == "default"
    # DBRX's attention reads attn_config.rope_theta (given the parent's); its defaults then clamp by clip_qkv=None,
    # which the refusal names by its statement
    with pytest.raises(NotImplementedError, match=r"in DbrxAttention\.forward: `qkv_states = .*self\.clip_qkv\)`"):
        coverage.tiny_config("dbrx")


def test_the_balancing_loss_is_scaled_by_the_factor_the_model_reads():
    import copy

    import torch
    from moe_lst.models.hf.balance import balancing_coefficient, balancing_top_k
    from moe_lst.models.hf.model import HFCausalLM
    from transformers import AutoModelForCausalLM

    config = coverage.tiny_config("jetmoe")  # (JetMoE reads aux_loss_coef; no router_aux_loss_coef)
    config.aux_loss_coef = 0.25
    plain = AutoModelForCausalLM.from_config(config)
    assert (balancing_coefficient(plain), balancing_top_k(plain)) == (0.25, 2)
    x, y = coverage._batch(0)
    out = plain(input_ids=x)
    ce = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), y.flatten())
    torch.testing.assert_close(coverage._plain_loss(plain, x, y), ce + 0.25 * out.aux_loss)
    # its experts are not ExpertsInterface experts; the adapter trains its balancing loss from the routers' recorded
    # logits all the same (tests/hf/test_adapter.py compares the gradients)
    ours = HFCausalLM(AutoModelForCausalLM.from_config(copy.deepcopy(config)))
    assert coverage.untrained_balancing_loss(plain, ours, out.aux_loss) is None
    config.output_router_logits = False  # (the adapter then builds none: against a forward that adds one, refused)
    unbalanced = HFCausalLM(AutoModelForCausalLM.from_config(copy.deepcopy(config)))
    problem = coverage.untrained_balancing_loss(plain, unbalanced, out.aux_loss)
    assert problem == ("JetMoeForCausalLM trains no balancing loss here: the adapter found no router_logits it "
                       "records (moe_lst.models.hf.balance.records_router_logits)")
    plain = AutoModelForCausalLM.from_config(config)  # (the model then adds none)
    assert coverage.untrained_balancing_loss(plain, unbalanced, plain(input_ids=x).aux_loss) is None


def test_a_convolution_along_the_sequence_beside_attention_keeps_ulysses_and_packing_out():
    import torch
    from moe_lst.models.hf.structure import blocks_outside_attention
    from transformers import AutoModelForCausalLM

    # Falcon-H1 runs a Mamba mixer (a causal convolution and a scan) in parallel with attention in every layer, ZAYA
    # convolves its queries and keys before attention: a Ulysses shard or a packed document would reach neither
    for kind in ("falcon_h1", "zaya"):
        config = coverage.tiny_config(kind)
        with torch.device("meta"):
            causal_lm = AutoModelForCausalLM.from_config(config)
        assert blocks_outside_attention(causal_lm) == ["model.layers.0", "model.layers.1"], kind


def test_a_family_two_layers_cannot_build_gets_four():
    # Zamba ties one shared transformer across its hybrid layers: with 2 layers there is one hybrid layer and nothing
    # to tie (its model refuses that); 4 layers cycle its kinds twice
    config = coverage.tiny_config("zamba")
    assert config.num_hidden_layers == 4 and config.layer_types.count("hybrid") == 2, config.layer_types
    assert coverage.tiny_config("llama").num_hidden_layers == 2  # (2 wherever they build)
