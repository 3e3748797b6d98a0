"""The generic Hugging Face family on families no hand-written mapping covers: DeepSeek-V3 (multi-head latent
attention, sigmoid group routing with a correction bias, shared experts, a leading dense layer), GPT-OSS (attention
sinks, alternating sliding windows, expert biases, interleaved gate / up), GLM-4.5 MoE. Their logits and every
gradient equal plain transformers' (through AttentionInterface and ExpertsInterface), windows and sinks stay inside
packed documents, and on 2 gloo ranks (ZeRO-3, Ulysses, expert parallel) two SGD steps equal one process."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from moe_lst.kernels.documents import positions_from_starts
from moe_lst.models.hf import coverage

from tests.multirank import run_multirank

REPRESENTATIVE = ("deepseek_v3", "gpt_oss", "glm4_moe")


@pytest.fixture(scope="module")
def configs() -> dict:
    return {**{kind: coverage.tiny_config(kind) for kind in (*REPRESENTATIVE, "llama")},
            # (a softcap that bends the tiny model's scores, beside its sliding windows; chunks inside a shard)
            "gemma2": coverage.tiny_config("gemma2", attn_logit_softcapping=0.05),
            "llama4_text": coverage.tiny_config("llama4_text", attention_chunk_size=4)}


@pytest.mark.parametrize("kind", REPRESENTATIVE)
def test_logits_and_gradients_equal_plain_transformers(configs, kind):
    coverage.check_logits(configs[kind])


def test_the_representatives_exercise_what_they_stand_for(configs):
    from moe_lst.models.hf import HFCausalLM
    from moe_lst.models.hf.experts import is_experts

    gpt = HFCausalLM(coverage._plain(configs["gpt_oss"]))
    assert gpt.config.sliding_window < coverage.SEQ and set(gpt.config.layer_types) == {"sliding_attention",
                                                                                     "full_attention"}
    experts = [m for m in gpt.modules() if is_experts(m)]
    assert experts and all(m.has_bias and not m.is_concatenated for m in experts)
    assert all(hasattr(layer.self_attn, "sinks") for layer in gpt.model.layers)
    deepseek = HFCausalLM(coverage._plain(configs["deepseek_v3"]))
    assert deepseek.moe_blocks == ("model.layers.1.mlp",)  # first_k_dense_replace=1
    attn = deepseek.model.layers[0].self_attn
    assert attn.qk_head_dim != attn.v_head_dim  # latent attention: values narrower than queries


def test_windows_and_sinks_stay_inside_packed_documents(configs):
    from moe_lst.models.hf import HFCausalLM

    model = HFCausalLM(coverage._plain(configs["gpt_oss"]))
    model.balance = None  # per-token logits only (the balancing loss is a statistic of the whole batch)
    lengths = (9, 3, 8)  # one document longer than the window
    tokens = torch.randint(3, 256, (1, sum(lengths)), generator=torch.Generator().manual_seed(2))
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[0, torch.tensor((0,) + lengths[:-1]).cumsum(0)] = True
    positions = positions_from_starts(starts)
    docs = tokens.split(list(lengths), dim=1)
    alone = torch.cat([model(d) for d in docs], 1)
    packed = model(tokens, positions, packed=True)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    sum(F.cross_entropy(p[0, :-1], d[0, 1:]) for p, d in zip(packed.split(list(lengths), 1), docs)).backward()
    assert all(layer.self_attn.sinks.grad.abs().max() > 0 for layer in model.model.layers)


def test_unsupported_attention_arguments_are_refused_by_name(configs):
    from moe_lst.models.hf import HFCausalLM
    from moe_lst.models.hf.attention import hf_attention

    model = HFCausalLM(coverage._plain(configs["gpt_oss"]))
    attn = model.model.layers[0].self_attn
    q = torch.zeros(1, 4, 5, 8)
    with pytest.raises(NotImplementedError,
                       match=r"GptOssAttention: attention argument position_bias=tensor\(1, 4, 5, 5\) is not supp"):
        hf_attention(attn, q, q[:, :2], q[:, :2], None, position_bias=torch.zeros(1, 4, 5, 5))
    with pytest.raises(NotImplementedError, match=r"attention dropout=0.1 is not supported"):
        hf_attention(attn, q, q[:, :2], q[:, :2], None, dropout=0.1)
    with pytest.raises(NotImplementedError, match=r"an attention mask is not supported"):
        hf_attention(attn, q, q[:, :2], q[:, :2], torch.ones(1, 1, 5, 5))
    from moe_lst.kernels.sparse import SparseAttention, SparseConfig

    sparse = HFCausalLM(coverage._plain(configs["gpt_oss"]),
                        attention_fn=SparseAttention(SparseConfig(layout="sliding_window", block_size=4)))
    with pytest.raises(NotImplementedError, match=r"sliding_window with attention function .*only the dense"):
        sparse(torch.randint(3, 256, (1, 8)))


# ------------------------------------------------------------------------------------------ 2 ranks
#: Ulysses over sinks and sliding windows, and over Gemma 2's logit softcapping and Llama 4's chunked attention
#: (tests/hf/test_attention_args.py), expert parallelism of latent-attention DeepSeek-V3, Llama's tensor-parallel plan
#: (ZeRO-3 data parallel: tests/hf/test_multirank.py; every layout of the three under -m slow).
DEFAULT_RUNS = [("gpt_oss", "sp2"), ("deepseek_v3", "ep2"), ("llama", "tp2"), ("gemma2", "sp2"), ("llama4_text", "sp2")]
SLOW_RUNS = [(k, layout) for k in REPRESENTATIVE for layout in coverage.MULTIRANK
             if (k, layout) not in DEFAULT_RUNS and layout != "tp2"]  # (their experts: tp2 is refused)


def _ranks(jobs: list) -> dict:
    return {(kind, layout): coverage.rank_run(config, layout) for kind, layout, config in jobs}


def _check_runs(configs, runs) -> None:
    jobs = [(kind, layout, configs[kind].to_dict()) for kind, layout in runs]
    per_rank = run_multirank(_ranks, 2, jobs, timeout=300)
    for kind, layout in runs:
        coverage.compare([r[kind, layout] for r in per_rank], coverage.reference_run(configs[kind], layout))


def test_two_ranks_equal_one_process(configs):
    _check_runs(configs, DEFAULT_RUNS)


@pytest.mark.slow
def test_two_ranks_equal_one_process_every_layout(configs):
    _check_runs(configs, SLOW_RUNS)


def test_compare_catches_a_stale_parameter(configs):
    """The 2-rank comparison fails on a one-element change of one parameter (what a lost gradient would leave)."""
    reference = coverage.reference_run(configs["glm4_moe"], "sp2")
    ranks = [copy.deepcopy(reference) | {"expert_ranges": {}} for _ in range(2)]
    name = next(n for n in ranks[1]["state"] if n.endswith("e_score_correction_bias") is False and "experts" in n)
    ranks[1]["state"][name].view(-1)[0] += 1e-3 * float(ranks[1]["state"][name].abs().max())
    coverage.compare(ranks[:1], reference)
    with pytest.raises(AssertionError, match=f"rank 1 {name}"):
        coverage.compare(ranks, reference)


# ------------------------------------------------------------------------------------------ the recipe
def _trains_and_exports(tmp_path, kind: str) -> None:
    from moe_lst.models.hf import build, load_config
    from transformers import AutoModelForCausalLM

    from recipes.export import consolidate, export
    from recipes.pretrain import train
    from tests.hf.test_recipe import _cfg, _records

    coverage.tiny_config(kind).save_pretrained(tmp_path / "config")
    run_dir = tmp_path / "run"
    train(_cfg(run_dir, f"model.hf.config={tmp_path / 'config'}", "train.steps=3"))
    losses = [r["loss"] for r in _records(run_dir)]
    assert len(losses) == 3 and all(0 < v < 10 for v in losses)
    out = export(run_dir, tmp_path / "export", "fused")
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    trained = build(load_config(run_dir / "hf_config.json"))
    shapes = {n: p.shape for n, p in trained.state_dict().items()}
    state = {n: t.reshape(shapes[n]) for n, t in consolidate(run_dir / "checkpoints" / "step_0000003").items()
             if n in shapes}
    trained.load_state_dict(state, strict=False)
    tokens = torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=tokens).logits, trained.eval()(tokens), rtol=1e-5, atol=1e-5)


def test_a_family_without_a_hand_written_mapping_trains_through_the_recipe_and_exports(tmp_path):
    _trains_and_exports(tmp_path, "gpt_oss")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["deepseek_v3", "glm4_moe"])
def test_more_families_train_through_the_recipe_and_export(tmp_path, kind):
    _trains_and_exports(tmp_path, kind)
