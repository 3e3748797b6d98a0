"""The Hugging Face adapter on one rank: the plain transformers model's logits and training, its own init on the
meta device, and tiling / checkpointing that change nothing."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zero
from moe import MoELayer
from sequence_parallel import apply_activation_checkpointing, apply_tiled_mlp, tiled_cross_entropy
from tests.hf.tiny import ALL, DENSE, MAIN, MOE, adapted_copy, plain_model, tiny_config
from zero.contract import ContractError

RTOL, ATOL = 1e-5, 1e-5


def _batch(seed: int, b: int = 2, s: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(1, 256, (b, s + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def _plain_loss(model, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the loss to minimise, its cross-entropy part) of the plain transformers model: an MoE config with
    output_router_logits adds the balancing loss as transformers' own forward does with labels."""
    out = model(input_ids=x)
    ce = F.cross_entropy(out.logits.flatten(0, 1), y.flatten())
    aux = getattr(out, "aux_loss", None)
    return (ce if aux is None else ce + model.config.router_aux_loss_coef * aux), ce


@pytest.mark.parametrize("kind", ALL)
def test_engine_logits_equal_the_plain_model(kind):
    ref = plain_model(kind).eval()
    engine = zero.initialize(adapted_copy(ref), zero.FastAdamW(lr=1e-3), zero.ZeroConfig(stage=0))
    engine.eval()
    x, _ = _batch(1)
    with torch.no_grad():
        want = ref(input_ids=x).logits
        got = engine(x)
        hidden = engine(x, torch.arange(x.shape[1]), return_hidden=True)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(F.linear(hidden, engine.module.output_weight), want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("kind", MAIN)
def test_five_steps_equal_a_plain_adamw_loop(kind):
    ref = plain_model(kind, seed=3)
    # eps well above the float rounding of a gradient (the MoE's grouped experts sum in another order than
    # transformers' loop): at 1e-8 a rarely routed expert's 1e-9 gradient would take a full Adam step either way
    adamw = functools.partial(torch.optim.AdamW, lr=3e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
    model = adapted_copy(ref)
    engine = zero.initialize(model, adamw, zero.ZeroConfig(stage=0, grad_accum_steps=2), plans=[model.loss_plan()])
    opt = adamw(ref.parameters())
    got, want = [], []
    for step in range(5):
        x, y = _batch(10 + step, b=4)
        for micro in (slice(0, 2), slice(2, 4)):  # two micro-batches: the balancing loss's gradient scales too
            loss = F.cross_entropy(engine(x[micro]).flatten(0, 1), y[micro].flatten())
            engine.backward(loss)
            total, ce = _plain_loss(ref, x[micro], y[micro])
            (total / 2).backward()
            got.append(loss.item())
            want.append(ce.item())
        engine.step()
        opt.step()
        opt.zero_grad()
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=0)
    # Parameters at 1e-5 of each tensor's scale. MoE experts sum their tokens in another order than transformers'
    # per-expert loop, and Adam turns that rounding in a rarely used row's small gradient into a visible step:
    # 5e-5 there (dense models come out identical).
    scale = 5 * RTOL if kind in MOE else RTOL
    trained, plain = engine.full_state_dict(), ref.state_dict()
    for name, value in plain.items():
        torch.testing.assert_close(trained[name].reshape(value.shape), value, rtol=RTOL,
                                   atol=scale * float(value.abs().max()), msg=lambda m, n=name: f"{n}: {m}")
    start = plain_model(kind, seed=3).state_dict()
    assert all((v - start[n]).abs().max() > 1e-3 for n, v in plain.items()), "every parameter trains"


@pytest.mark.parametrize("kind", DENSE)
def test_meta_build_is_materialised_with_the_models_own_init(kind):
    from moe_lst.models.hf import build

    config = tiny_config(kind)
    torch.manual_seed(7)
    eager = build(config)
    torch.manual_seed(7)
    meta = build(config, meta=True)
    assert all(p.is_meta for p in meta.parameters()) and not any(b.is_meta for b in meta.buffers())
    engine = zero.initialize(meta, zero.FastAdamW(lr=1e-3), zero.ZeroConfig(stage=3))
    materialised, want = engine.full_state_dict(), eager.state_dict()
    for name, value in materialised.items():
        assert torch.equal(value.reshape(want[name].shape), want[name]), name
    # the distributions of transformers' _init_weights: N(0, initializer_range), norms 1, biases 0, padding row 0
    std = config.initializer_range
    for name, p in eager.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        elif name.endswith("bias"):
            assert torch.equal(p, torch.zeros_like(p)), name
        else:
            assert abs(p.std().item() / std - 1) < 0.1 and abs(p.mean().item()) < std / 5, name
    layers = [dict(layer.named_parameters()) for layer in eager.model.layers]
    for name, p in layers[0].items():  # each parameter its own draw
        assert name.endswith(("norm.weight", "bias")) or not torch.equal(p, layers[1][name]), name
    if config.pad_token_id is not None:
        assert torch.equal(eager.model.embed_tokens.weight[config.pad_token_id], torch.zeros(config.hidden_size))
    # seeded by name: any order of calls, any device, gives the same values
    params = dict(eager.named_parameters())
    for name in list(params)[::-1]:
        out = torch.empty_like(params[name])
        eager.init_parameter(name, out)
        assert torch.equal(out, params[name]), name


@pytest.mark.parametrize("kind", ALL)
def test_tiled_mlp_tiled_loss_and_checkpointing_change_nothing(kind):
    ref = plain_model(kind, seed=5)
    x, y = _batch(2, b=2, s=24)

    def loss_and_grads(tiled: bool) -> tuple[float, dict[str, torch.Tensor]]:
        model = adapted_copy(ref)
        if tiled:
            if model.mlp_sites():  # (Mixtral has none: every feed-forward is a sparse-MoE block)
                apply_tiled_mlp(model, num_tiles=5, exclude=(MoELayer,))
            apply_activation_checkpointing(model)
            loss_sum, count = tiled_cross_entropy(model(x, return_hidden=True), model.output_weight, y, tile_size=7)
            loss = loss_sum / count
        else:
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        return loss.item(), {n: p.grad for n, p in model.named_parameters()}

    plain_loss, plain_grads = loss_and_grads(False)
    tiled_loss, tiled_grads = loss_and_grads(True)
    assert tiled_loss == pytest.approx(plain_loss, rel=RTOL)
    assert plain_grads.keys() == tiled_grads.keys()
    for name, g in plain_grads.items():
        assert g is not None and g.abs().max() > 0, name
        torch.testing.assert_close(tiled_grads[name], g, rtol=RTOL, atol=1e-6, msg=name)


def test_a_logit_transform_that_changes_nothing_leaves_the_head_plain_for_tiled_losses():
    """Gemma 3's softcapping branch with final_logit_softcapping=None: the tiled loss (hidden states and the head
    alone) equals the model's loss and gradients; with a softcap set, return_hidden is refused naming it."""
    from moe_lst.models.hf import HFCausalLM
    from moe_lst.models.hf.coverage import tiny_config as sweep_config
    from moe_lst.models.hf.model import head_problem
    from transformers import AutoModelForCausalLM

    x, y = _batch(2, b=2, s=12)
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(sweep_config("gemma3_text"), dtype=torch.float32)
    assert ref.config.final_logit_softcapping is None and head_problem(ref) is None
    results = []
    for tiled in (False, True):
        model = HFCausalLM(copy.deepcopy(ref))
        if tiled:
            loss_sum, count = tiled_cross_entropy(model(x, return_hidden=True), model.output_weight, y, tile_size=5)
            loss = loss_sum / count
        else:
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        results.append((loss.item(), {n: p.grad for n, p in model.named_parameters()}))
    (plain, plain_grads), (tiled, tiled_grads) = results
    assert tiled == pytest.approx(plain, rel=RTOL)
    for name, g in plain_grads.items():
        torch.testing.assert_close(tiled_grads[name], g, rtol=RTOL, atol=1e-6, msg=name)
    capped = copy.deepcopy(ref)
    capped.config.final_logit_softcapping = 30.0
    assert "changes its logits after the head" in head_problem(capped)
    with pytest.raises(NotImplementedError, match="final_logit_softcapping.*return_hidden"):
        HFCausalLM(capped)(x, return_hidden=True)


def test_contract_parts_and_refusals():
    from moe_lst.models.hf import build

    model = build(tiny_config("qwen3"))
    assert [n for n, _ in model.blocks()] == ["model.layers.0", "model.layers.1"]
    assert [s.name for s in model.attention_sites()] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert [n for n, _ in model.mlp_sites()] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert model.output_weight is model.model.embed_tokens.weight  # tied
    from zero.parallel.tensor import TiedHead, VocabParallelEmbedding

    styles = model.tensor_parallel_styles(2)  # (the tied head reads the vocabulary-parallel embedding's slice)
    assert isinstance(styles["lm_head"], TiedHead) and styles["lm_head"].embedding is model.model.embed_tokens
    assert isinstance(styles["model.embed_tokens"], VocabParallelEmbedding)
    with pytest.raises(ContractError, match=r"tensor_parallel_styles: qwen3 declares base_model_tp_plan \(\d+ "
                                            r"entries: colwise, replicated_with_grad_allreduce, rowwise\), "
                                            r"but tp=3 does not divide num_attention_heads=4"):
        model.tensor_parallel_styles(3)
    first = model.pipeline_stage(range(1), True, False)  # (the config's base_model_pp_plan: embed_tokens, layers, norm)
    names = {n.split(".weight")[0] for n, _ in first.named_parameters()}
    assert "model.embed_tokens" in names and not any(n.startswith(("model.layers.1", "model.norm", "lm_head"))
                                                     for n in names), sorted(names)
    x, _ = _batch(0)
    with pytest.raises(NotImplementedError, match="attention mask"):
        model.model(input_ids=x, attention_mask=torch.ones_like(x)[:, None, None, :].float(), use_cache=False)


def test_a_model_that_numbers_positions_itself_refuses_packed_documents_and_sequence_shards():
    # PLBart's decoder takes no position_ids (it numbers the sequence it is given from 0): packed documents and
    # Ulysses shards would get other positions; whisper's decoder takes them, as the Llama's model does
    from moe_lst.models.hf import build
    from moe_lst.models.hf.coverage import tiny_config as swept_config
    from moe_lst.models.hf.structure import positions_from_length

    model = build(swept_config("plbart"))
    assert model.positions_from_length == "model.decoder (PLBartDecoder)"
    tokens = torch.randint(3, 200, (1, 8))
    model(tokens)  # (one whole sequence: its own positions)
    with pytest.raises(NotImplementedError, match=r"model.decoder \(PLBartDecoder\) takes no position_ids .* packed "
                                                  r"documents would get other positions"):
        model(tokens, torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]), packed=True)
    for kind in ("llama", "whisper"):
        with torch.device("meta"):
            from transformers import AutoModelForCausalLM

            assert positions_from_length(AutoModelForCausalLM.from_config(swept_config(kind))) is None


def test_a_meta_build_checks_that_the_init_sets_integer_and_bool_buffers(monkeypatch):
    # gpt_bigcode's causal-mask buffer is bool, minicpm3's embedding scale int64: each is filled twice (True then
    # False, the least then the greatest value) and must come out of the model's init the same; one the init leaves
    # alone is refused by name
    from moe_lst.models.hf import build
    from moe_lst.models.hf.coverage import tiny_config as swept_config

    for kind in ("gpt_bigcode", "minicpm3"):
        eager = dict(build(swept_config(kind)).named_buffers())
        meta = build(swept_config(kind), meta=True)
        meta.materialise_buffers()
        assert {k: b.dtype for k, b in meta.named_buffers()} == {k: b.dtype for k, b in eager.items()}
        assert all(torch.equal(b, eager[k]) for k, b in meta.named_buffers()), kind
    from transformers.models.gpt_bigcode.modeling_gpt_bigcode import GPTBigCodePreTrainedModel

    config = swept_config("gpt_bigcode")

    def drawn(self, module):  # (an init that draws the mask: an eager build would get other values)
        if "bias" in module._buffers:
            module._buffers["bias"].copy_(torch.rand(module._buffers["bias"].shape) > 0.5)

    # (the mask is GPTBigCodeModel's, so its own _init_weights sets it, as transformers' init dispatches it)
    monkeypatch.setattr(GPTBigCodePreTrainedModel, "_init_weights", drawn)
    with pytest.raises(NotImplementedError, match=r"its buffers have no init in GPTBigCodeModel._init_weights"):
        build(config, meta=True)


def test_a_meta_build_keeps_the_constructor_values_the_init_leaves_alone(monkeypatch):
    # Apertus' XIELU activation (its beta and eps buffers, its alpha parameters) and Falcon-H1's mup_vector are made
    # by their modules' constructors and left alone by _init_weights: a meta build gives them the eager build's
    # values; one the constructor draws from the generator is refused by name
    from moe_lst.models.hf import build
    from moe_lst.models.hf.coverage import tiny_config as swept_config
    from transformers import AutoModelForCausalLM

    for kind, names in (("apertus", ("mlp.act_fn.beta", "mlp.act_fn.eps", "mlp.act_fn.alpha_p")),
                        ("falcon_h1", ("mamba.mup_vector",))):
        config = swept_config(kind)
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        eager = {**dict(plain.named_buffers()), **plain.state_dict()}
        meta = build(config, meta=True)
        meta.materialise_parameters("cpu")
        meta.reset_parameters()
        got = {**dict(meta.named_buffers()), **meta.state_dict()}
        kept = [k for k in got if any(k.endswith(n) for n in names)]
        assert len(kept) == 2 * len(names), (kind, kept)
        for k in kept:
            assert torch.equal(got[k], eager[k]), (kind, k)
        assert all(torch.equal(b, eager[k]) for k, b in meta.named_buffers()), kind
    from transformers.activations import XIELUActivation

    config = swept_config("apertus")
    made = XIELUActivation.__init__

    def drawn(self, *args, **kwargs):  # (a constructor that draws its buffer: no value an eager build shares)
        made(self, *args, **kwargs)
        self.beta = nn.Buffer(torch.rand(()))

    monkeypatch.setattr(XIELUActivation, "__init__", drawn)
    with pytest.raises(NotImplementedError, match=r"XIELUActivation: its buffers have no init in ApertusModel"):
        build(config, meta=True)


def test_a_sliding_window_model_in_float64_equals_plain_transformers_exactly():
    # the banded path (sliding windows, sinks) keeps a float64 model's precision: its logits are the plain model's to
    # float64 rounding (a float32 softmax inside left them 2.6e-7 apart)
    import copy

    from moe_lst.models.hf import build
    from moe_lst.models.hf.coverage import _batch, _plain
    from moe_lst.models.hf.coverage import tiny_config as swept_config

    config = swept_config("gemma3_text")
    torch.manual_seed(0)
    ours = build(config)
    plain = _plain(config)
    plain.load_state_dict(ours.state_dict(), strict=False)
    x, _ = _batch(0)
    with torch.no_grad():
        want, got = plain.double()(input_ids=x).logits, copy.deepcopy(ours).double()(x)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_a_balancing_loss_of_experts_outside_experts_interface_is_trained():
    # JetMoE's experts (routed by JetMoeTopKGating, in its MLPs and its mixture of attention heads) are its own, not
    # ExpertsInterface ones: the adapter trains the balancing loss its forward adds (aux_loss_coef times
    # load_balancing_loss_func over every router's recorded logits), so every gradient equals plain transformers'
    from moe_lst.models.hf.coverage import _batch, _plain_loss
    from moe_lst.models.hf.coverage import tiny_config as swept_config
    from moe_lst.models.hf.model import HFCausalLM
    from transformers import AutoModelForCausalLM

    config = swept_config("jetmoe")
    config.aux_loss_coef = 0.5  # (the swept 0.01 leaves the term's gradient near the tolerance)
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(config)
    ours = HFCausalLM(copy.deepcopy(plain))
    assert not ours.moe_blocks and ours.balance is not None
    assert (ours.balance.coef, ours.balance.num_experts, ours.balance.top_k) == (0.5, 4, 2)
    x, y = _batch(0)
    _plain_loss(plain, x, y).backward()
    F.cross_entropy(ours(x).flatten(0, 1), y.flatten()).backward()
    want = dict(plain.named_parameters())
    assert sum(n.endswith("router.layer.weight") for n, _ in ours.named_parameters()) == 4  # (2 per layer)
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, want[name].grad, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    assert ours.balance.last_value == pytest.approx(float(plain(input_ids=x).aux_loss.detach()), rel=1e-5)
    # Llama 4 records its routers' logits too, but its forward adds no balancing loss: none is trained
    llama4 = swept_config("llama4_text")
    assert llama4.output_router_logits and llama4.router_aux_loss_coef > 0
    assert HFCausalLM(AutoModelForCausalLM.from_config(llama4)).balance is None


def test_a_meta_build_initialises_each_module_by_its_innermost_pretrained_model():
    # Gemma 3n's _init_weights reads self.hidden_size, which only its text model holds: each module is initialised
    # by the innermost PreTrainedModel holding it (as transformers dispatches its init), so the text model's own
    # scales get the eager build's values. Its tiny config scales num_kv_shared_layers as the layers (15 of 35: 0)
    from moe_lst.models.hf import build
    from moe_lst.models.hf.coverage import tiny_config as swept_config
    from transformers import AutoModelForCausalLM

    config = swept_config("gemma3n_text")
    assert (config.num_hidden_layers, config.num_kv_shared_layers) == (2, 0)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    eager = {**dict(plain.named_buffers()), **dict(plain.named_parameters())}
    meta = build(config, meta=True)
    meta.materialise_parameters("cpu")
    meta.reset_parameters()
    for name in ("model.per_layer_projection_scale", "model.per_layer_input_scale"):
        assert torch.equal(dict(meta.named_buffers())[name], eager[name]), name
    assert all(torch.equal(b, eager[k]) for k, b in meta.named_buffers())
