"""Tensor and pipeline parallelism of the Hugging Face adapter beyond the plain Llama form (models/hf/model.py
`tensor_parallel_styles`, models/hf/pipeline.py), on 2 gloo ranks against one process of plain transformers (losses
and every parameter after two SGD steps, so every gradient): a tied head (gemma3_text: the head reads the
vocabulary-parallel embedding's own slice, the embedding's lookup scaled, the logits softcapped after the head, four
norms per layer) at tp=2 under ZeRO-3, with one parameter for both;
norms after attention and MLP plus the plan's colwise_gather_output / rowwise_split_input projections with
unplaced q / k norms between them (olmo2) at tp=2; layer children the plan leaves whole (lfm3: a short convolution
whose parent reads its weight directly, an attention, an MLP) replicated on the gathered sequence at tp=2; a
softcapped, tied, scaled-embedding family (gemma3_text) at pp=2, the last stage applying the softcap; a layer's own
per-channel rates and a head's per-token logit scale (dory: on the sequence shards, and this rank's vocabulary slice)
at tp=2; per-layer inputs (gemma4_text) made on the first stage and sent on with the hidden states at pp=2, and made
over the whole sequence on every rank, each layer cutting its shard, at tp=2. What the adapter cannot repeat around
the head is refused in one line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from moe_lst.models.hf import coverage
from transformers import LlamaForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast

from tests.multirank import run_multirank
from zero.contract import ContractError

#: (family, layout) run by coverage.rank_run (ZeRO stage 0); the tied head also runs at ZeRO-3 (_tied_zero3).
RUNS = [("olmo2", "tp2"), ("lfm3", "tp2"), ("gemma3_text", "pp2"), ("dory", "tp2"), ("gemma4_text", "pp2"),
        ("gemma4_text", "tp2")]
TIED = "gemma3_text"
#: (the sweep's tiny gemma3_text leaves its softcapping off, as gemma3's default config does; a small cap bites)
OVERRIDES = {"gemma3_text": dict(final_logit_softcapping=2.0)}


def _tied_zero3(config_dict: dict) -> dict:
    """coverage.rank_run's tp2 at ZeRO-3: the tied head is the embedding's local Parameter after the split, and the
    engine (its flat buckets, what a checkpoint records) holds it once."""
    from moe_lst.models.hf.model import build
    from transformers import CONFIG_MAPPING

    import zero
    from zero.parallel.tensor import apply_tensor_parallel, vocab_parallel_cross_entropy

    config = CONFIG_MAPPING[config_dict["model_type"]].from_dict(config_dict)
    dims = zero.ParallelDims(dp=1, tp=2)
    torch.manual_seed(0)
    model = build(config)
    count = len(list(model.parameters()))
    plan = apply_tensor_parallel(model, dims.tp_group)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    engine = zero.initialize(model, lambda params: torch.optim.SGD(params, lr=coverage.LR), zero.ZeroConfig(stage=3),
                             dims, plans=[model.loss_plan(), plan])
    names = [n for record in engine.bucket_records() for n in record["names"]]
    losses = []
    for step in range(coverage.STEPS):
        x, y = coverage._batch(step)
        loss_sum, count_tokens = vocab_parallel_cross_entropy(engine(x).flatten(0, 1), y.flatten(), dims.tp_group)
        loss = loss_sum / count_tokens
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state = plan.full_state_dict({k: v.clone() for k, v in engine.full_state_dict().items()})
    return {"run": {"losses": losses, "state": state, "expert_ranges": {}}, "tied": tied, "names": names,
            "count": (count, len(list(model.parameters())))}


def _ranks(tied_config: dict, jobs: list) -> dict:
    out = {(kind, layout): coverage.rank_run(config, layout) for kind, layout, config in jobs}
    out[TIED, "tp2_zero3"] = _tied_zero3(tied_config)
    return out


def test_two_ranks_equal_one_process():
    configs = {kind: coverage.tiny_config(kind, **OVERRIDES.get(kind, {})) for kind in (TIED, *(k for k, _ in RUNS))}
    assert configs["gemma3_text"].tie_word_embeddings and configs["gemma3_text"].final_logit_softcapping
    per_rank = run_multirank(_ranks, 2, configs[TIED].to_dict(),
                             [(kind, layout, configs[kind].to_dict()) for kind, layout in RUNS], timeout=300)
    for kind, layout in RUNS:
        coverage.compare([r[kind, layout] for r in per_rank], coverage.reference_run(configs[kind], layout))
    tied = [r[TIED, "tp2_zero3"] for r in per_rank]
    coverage.compare([r["run"] for r in tied], coverage.reference_run(configs[TIED], "tp2"))
    for r in tied:
        assert r["tied"] and r["count"][0] == r["count"][1]  # (one parameter, before and after the split)
        assert "model.embed_tokens.weight" in r["names"] and "lm_head.weight" not in r["names"]


class _ClampedLlama(LlamaForCausalLM):
    """A causal LM whose forward changes the logits after the head in a way the adapter does not know."""

    def forward(self, input_ids=None, **kwargs):
        hidden_states = self.model(input_ids=input_ids, **kwargs).last_hidden_state
        logits = self.lm_head(hidden_states)
        logits = logits.clamp(-5.0, 5.0)

        loss = None
        return CausalLMOutputWithPast(loss=loss, logits=logits)


def test_an_unknown_change_of_the_logits_after_the_head_is_refused_by_name():
    from moe_lst.models.hf import HFCausalLM

    model = HFCausalLM(_ClampedLlama(coverage.tiny_config("llama")))
    assert model.logit_fn is None
    with pytest.raises(ContractError, match=r"^tensor_parallel_styles: llama .*, but its forward changes the logits "
                                            r"after the head \(logits = logits.clamp\(-5.0, 5.0\)\)"):
        model.tensor_parallel_styles(2)
    with pytest.raises(ContractError, match=r"^pipeline_stage: llama .*, but its forward changes the logits after "
                                            r"the head \(logits = logits.clamp\(-5.0, 5.0\)\)"):
        model.pipeline_stage(range(1), True, False)
    softcapped = HFCausalLM(coverage._plain(coverage.tiny_config("gemma3_text", **OVERRIDES["gemma3_text"])))
    x = torch.randint(3, 256, (1, 6))
    head = softcapped.lm_head(softcapped.model(input_ids=x).last_hidden_state)
    cap = softcapped.config.final_logit_softcapping
    torch.testing.assert_close(softcapped.logit_fn(head), torch.tanh(head / cap) * cap, rtol=0, atol=0)
    torch.testing.assert_close(softcapped(x), F.tanh(head / cap) * cap, rtol=0, atol=0)


class _HalvedLlama(LlamaForCausalLM):
    """A causal LM whose forward changes the hidden states before the head in a way the adapter does not know."""

    def forward(self, input_ids=None, **kwargs):
        outputs = self.model(input_ids=input_ids, **kwargs)
        hidden_states = outputs.last_hidden_state
        hidden_states = hidden_states.clamp(-1.0, 1.0)
        logits = self.lm_head(hidden_states)

        loss = None
        return CausalLMOutputWithPast(loss=loss, logits=logits)


def test_an_unknown_change_before_the_head_is_refused_by_name():
    """A statement on the hidden states before the head the last stage cannot repeat refuses pipeline stages (and
    tiled losses: the head is not plain)."""
    from moe_lst.models.hf import HFCausalLM

    model = HFCausalLM(_HalvedLlama(coverage.tiny_config("llama")))
    assert model.head_input_fn is None and not model.plain_head
    with pytest.raises(ContractError, match=r"^pipeline_stage: llama .*, but its forward changes the hidden states "
                                            r"before the head \(hidden_states = hidden_states.clamp\(-1.0, 1.0\)\)"):
        model.pipeline_stage(range(1), True, False)
