"""Hugging Face MoE models (Mixtral, Qwen3-MoE, OLMoE) with their sparse-MoE blocks swapped for moe.MoELayer
(`moe_lst.models.hf.moe.adopt_moe_blocks`) equal the unswapped models: logits, loss with and without the
auxiliary loss, every parameter's gradient, state_dict; under expert parallelism (ep=2 over dp=2 through
zero.initialize) a few SGD steps equal the unswapped model's on one process.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
from moe_lst.models.hf.moe import HFMoEBlock, adopt_moe_blocks
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from tests.equivalence import Recorder, assert_equivalent, reference_trajectory
from tests.multirank import run_multirank

VOCAB, SEQ, RTOL, ATOL = 61, 9, 1e-5, 1e-6
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, router_aux_loss_coef=0.5)


def build(kind: str, seed: int = 0, **kw) -> torch.nn.Module:
    """A tiny Hugging Face MoE model built locally (no weights downloaded), fp32."""
    torch.manual_seed(seed)
    if kind == "mixtral":
        config = MixtralConfig(**COMMON, intermediate_size=24, num_hidden_layers=2, num_local_experts=4,
                               **{"num_experts_per_tok": 2, **kw})
        return MixtralForCausalLM(config).float()
    if kind == "olmoe":
        from transformers import OlmoeConfig, OlmoeForCausalLM

        config = OlmoeConfig(**COMMON, intermediate_size=24, num_hidden_layers=2, num_experts=4,
                             **{"num_experts_per_tok": 2, **kw})
        return OlmoeForCausalLM(config).float()
    # layer 1 dense (mlp_only_layers): only the sparse blocks are swapped
    config = Qwen3MoeConfig(**COMMON, intermediate_size=40, moe_intermediate_size=24, num_hidden_layers=3,
                            head_dim=8, num_experts=4, mlp_only_layers=[1],
                            **{"num_experts_per_tok": 2, "norm_topk_prob": True, **kw})
    return Qwen3MoeForCausalLM(config).float()


def tokens(rows: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(seed))


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _forward_backward(model, ids, mask, aux: bool):
    out = model(input_ids=ids, attention_mask=mask, labels=ids, output_router_logits=aux)
    out.loss.backward()
    return out, _grads(model)


CASES = [("mixtral", {}), ("mixtral", {"num_experts_per_tok": 1}), ("qwen3_moe", {}),
         ("qwen3_moe", {"norm_topk_prob": False}), ("olmoe", {"num_experts_per_tok": 3})]


@pytest.mark.parametrize("kind,kw", CASES, ids=["mixtral", "mixtral-top1", "qwen3", "qwen3-unnormalised", "olmoe"])
def test_swapped_blocks_equal_hugging_face(kind, kw):
    ref = build(kind, **kw)
    ours = copy.deepcopy(ref)
    before = dict(ours.named_parameters())
    names = adopt_moe_blocks(ours)
    assert all(p is before[n] for n, p in ours.named_parameters())  # the very same parameter tensors
    layers = ["model.layers.0.mlp", "model.layers.2.mlp" if kind == "qwen3_moe" else "model.layers.1.mlp"]
    assert names == layers and all(isinstance(ours.get_submodule(n), HFMoEBlock) for n in names)
    # same names, shapes and order in state_dict
    assert [(k, v.shape) for k, v in ours.state_dict().items()] == [(k, v.shape) for k, v in ref.state_dict().items()]
    ids = tokens(3, 1)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding: HF's aux loss leaves these tokens out
    router_grads = {}
    for aux in (False, True):
        ref.zero_grad(set_to_none=True)
        ours.zero_grad(set_to_none=True)
        want, want_grads = _forward_backward(ref, ids, mask, aux)
        got, got_grads = _forward_backward(ours, ids, mask, aux)
        torch.testing.assert_close(got.logits, want.logits, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(got.loss, want.loss, rtol=RTOL, atol=ATOL)
        assert (got.aux_loss is None) == (want.aux_loss is None) == (not aux)
        if aux:
            torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=RTOL, atol=ATOL)
            assert len(got.router_logits) == len(names)
        assert got_grads.keys() == want_grads.keys() == dict(ref.named_parameters()).keys()
        for n in want_grads:
            torch.testing.assert_close(got_grads[n], want_grads[n], rtol=RTOL, atol=ATOL,
                                       msg=lambda m, n=n: f"{n}: {m}")
        router_grads[aux] = want_grads[f"{names[0]}.gate.weight"]
    # the aux term really reaches the routers' gradients
    assert not torch.allclose(router_grads[True], router_grads[False], rtol=1e-3)


def test_jitter_noise_is_hugging_faces_draw():
    ref = build("mixtral", router_jitter_noise=0.2).train()
    ours = copy.deepcopy(ref)
    adopt_moe_blocks(ours)
    ids = tokens(2, 3)
    results = []
    for model in (ref, ours):
        torch.manual_seed(7)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), _grads(model)))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=RTOL, atol=ATOL)
    for n, g in results[0][1].items():
        torch.testing.assert_close(results[1][1][n], g, rtol=RTOL, atol=ATOL, msg=lambda m, n=n: f"{n}: {m}")
    ref.eval()
    ours.eval()
    torch.testing.assert_close(ours(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=RTOL, atol=ATOL)


def test_generation_with_cache_matches():
    ref = build("qwen3_moe").eval()
    ours = copy.deepcopy(ref)
    adopt_moe_blocks(ours)
    prompt = tokens(2, 4)[:, :4]
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    got, want = ours.generate(prompt, **kw), ref.generate(prompt, **kw)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), rtol=RTOL, atol=ATOL)


def test_balancing_statistics_on_swapped_blocks():
    from moe import collect_moe_stats

    model = build("qwen3_moe")
    adopt_moe_blocks(model)
    ids = tokens(2, 5)
    out = model(input_ids=ids, output_router_logits=True)
    stats = collect_moe_stats(model)
    assert len(out.router_logits) == 2
    for i, logits in enumerate(out.router_logits):  # the counts are those of Hugging Face's top-k
        chosen = logits.softmax(-1).topk(2, dim=-1).indices
        assert stats[f"moe/layer{i}/tokens_per_expert"] == torch.bincount(chosen.flatten(), minlength=4).tolist()
        assert stats[f"moe/layer{i}/aux_loss"] > 0 and stats[f"moe/layer{i}/dropped"] == 0.0
        assert stats[f"moe/layer{i}/load_max"] >= 0.25 >= stats[f"moe/layer{i}/load_min"]


def test_save_pretrained_round_trip(tmp_path):
    model = build("mixtral")
    adopt_moe_blocks(model)
    with torch.no_grad():
        model.model.layers[1].mlp.experts.down_proj.mul_(3.0)  # differs from any fresh init
    model.save_pretrained(tmp_path)
    loaded = MixtralForCausalLM.from_pretrained(tmp_path)
    state = model.state_dict()
    assert list(loaded.state_dict()) == list(state)
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, state[k]), k


def test_covered_dense_and_uncovered_models():
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

    dense = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    assert adopt_moe_blocks(dense) == []
    model = build("mixtral")
    assert len(adopt_moe_blocks(model)) == 2 and adopt_moe_blocks(model) == []  # adopted once
    qwen2 = Qwen2MoeForCausalLM(Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=8,
                                               moe_intermediate_size=8, shared_expert_intermediate_size=8,
                                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                               num_experts=4, num_experts_per_tok=2))
    with pytest.raises(NotImplementedError, match="model_type='qwen2_moe'.* is a mixture-of-experts model whose "
                                                  "MoE block is not covered"):
        adopt_moe_blocks(qwen2)
    with pytest.raises(NotImplementedError, match="hidden_act='gelu' is not supported"):
        adopt_moe_blocks(build("mixtral", hidden_act="gelu"))
    with pytest.raises(NotImplementedError, match="expert tensor parallelism of Hugging Face MoE blocks"):
        model.model.layers[0].mlp.set_tensor_parallel(None)


# ------------------------------------------------------------------------------------- expert parallelism
STEPS, ROWS = 3, 2
SGD = functools.partial(torch.optim.SGD, lr=0.5)


def _batch(step: int, rank: int) -> torch.Tensor:
    return tokens(2 * ROWS, 100 + step)[rank * ROWS:(rank + 1) * ROWS]


def _ep_run(runs: list[tuple[str, int]]) -> dict:
    import zero
    from moe import GroupedExperts, apply_expert_parallel

    rank = dist.get_rank()
    dims = zero.ParallelDims(dp=2, ep=2)
    out = {}
    for kind, stage in runs:
        model = build(kind, output_router_logits=True)
        adopt_moe_blocks(model)
        engine = zero.initialize(model, SGD, zero.ZeroConfig(stage=stage), dims,
                                 plans=[apply_expert_parallel(model, dims)])
        fused = {m.fuse_grad_accumulation for m in model.modules() if isinstance(m, GroupedExperts)}
        assert fused == {stage < 2}  # stage 1 adds the transposed weight gradients in place
        record = Recorder(engine, dims.dp_group)
        for step in range(STEPS):
            ids = _batch(step, rank)
            loss = engine(input_ids=ids, labels=ids).loss  # includes the aux loss (output_router_logits)
            engine.backward(loss)
            assert engine.step()
            record.step(loss.item())
        out[(kind, stage)] = record.result()
    return out


def _reference(kind: str) -> dict:
    model = build(kind, output_router_logits=True)

    def micro_losses(m, step):  # the two ranks' rows, one micro-batch each (the aux loss is per micro-batch)
        for rank in range(2):
            ids = _batch(step, rank)
            yield m(input_ids=ids, labels=ids).loss

    return reference_trajectory(model, SGD(model.parameters()), STEPS, micro_losses)


def test_expert_parallel_equals_one_process():
    runs = [("mixtral", 1), ("qwen3_moe", 2)]
    results = run_multirank(_ep_run, 2, runs)
    for kind, stage in runs:
        records = [r[(kind, stage)] for r in results]
        for rank, r in enumerate(records):  # each rank holds its half of the experts of the HF tensors
            placement = r["final"]["placements"]["model.layers.0.mlp.experts.gate_up_proj"]
            assert placement.shape == (4, 48, 32) and placement.pieces[0].start == (2 * rank, 0, 0)
            assert r["final"]["master"]["model.layers.0.mlp.experts.down_proj"].shape == (2, 32, 24)
        assert_equivalent(records, _reference(kind), label=f"{kind} ep=2 stage {stage}")
