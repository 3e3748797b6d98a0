"""Attention arguments the Hugging Face adapter computes beyond windows and sinks: Gemma 2's attention logit
softcapping (scores capped before the mask) and Llama 4's chunked attention (causal within fixed chunks, which
transformers builds as a mask). The adapter's logits and gradients equal plain transformers' (its eager attention for
Gemma 2, SDPA and eager for Llama 4), with packed documents too (transformers' own packed-row masks: chunks counted
by position ids); ring attention and block-sparse layouts refuse them by name, ring attention in the config check.
Ulysses over both: tests/hf/test_generic.py's 2-rank run."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from moe_lst.kernels.documents import positions_from_starts
from moe_lst.models.hf import coverage
from moe_lst.models.spec import ConfigError

#: A softcap far below the tiny model's scaled scores would leave nothing; this one bends them (checked below).
SOFTCAP = dict(attn_logit_softcapping=0.05)
#: Chunks of 4 positions: a 16-token row has four, and packed documents' chunks differ from the row's.
CHUNKS = dict(attention_chunk_size=4)
#: Documents per row of the packed batch (row 1 is one document: transformers still numbers its chunks by position).
LENGTHS = ((6, 7, 3), (16,))


@pytest.fixture(scope="module")
def configs() -> dict:
    return {"gemma2": coverage.tiny_config("gemma2", **SOFTCAP),
            "llama4_text": coverage.tiny_config("llama4_text", **CHUNKS)}


def _packed_positions() -> torch.Tensor:
    starts = torch.zeros(len(LENGTHS), 16, dtype=torch.bool)
    for row, lengths in enumerate(LENGTHS):
        starts[row, torch.tensor((0,) + lengths[:-1]).cumsum(0)] = True
    return positions_from_starts(starts)


def _tokens() -> torch.Tensor:
    return torch.randint(3, 256, (2, 17), generator=torch.Generator().manual_seed(5))


def _equal_to_plain(config, implementation: str | None = None, packed: bool = False) -> torch.Tensor:
    """The adapter's logits and every gradient equal plain transformers' (attn_implementation `implementation`) on
    the same rows, packed documents given as restarting position ids to both (transformers then masks each document
    and counts chunks by position); returns the adapter's logits."""
    from moe_lst.models.hf import HFCausalLM

    ref = coverage._plain(config)
    if implementation is not None:
        ref.set_attn_implementation(implementation)
    ours = HFCausalLM(copy.deepcopy(ref))
    tokens = _tokens()
    x, y = tokens[:, :-1], tokens[:, 1:]
    positions = _packed_positions() if packed else torch.arange(16).expand(2, 16)
    want = ref(input_ids=x, position_ids=positions, use_cache=False).logits  # (no cache: packed rows are masked)
    got = ours(x, positions, packed=packed)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda m: f"logits: {m}")
    F.cross_entropy(want.flatten(0, 1), y.flatten()).backward()
    F.cross_entropy(got.flatten(0, 1), y.flatten()).backward()
    grads = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        g = grads[name].grad
        scale = float(g.abs().max()) or 1.0
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-5 * scale, msg=lambda m, n=name: f"grad {n}: {m}")
    return got.detach()


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_softcap_equals_transformers_eager(configs, packed):
    config = configs["gemma2"]
    assert config.sliding_window < 16 and "sliding_attention" in config.layer_types  # (capped inside windows too)
    capped = _equal_to_plain(config, "eager", packed=packed)
    with torch.no_grad():  # the cap changes the logits well beyond the tolerance
        from moe_lst.models.hf import HFCausalLM

        uncapped = HFCausalLM(coverage._plain(coverage.tiny_config("gemma2", attn_logit_softcapping=None)))
        positions = _packed_positions() if packed else None
        assert (uncapped(_tokens()[:, :-1], positions, packed=packed) - capped).abs().max() > 1e-3


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_chunked_attention_equals_transformers(configs, implementation, packed):
    config = configs["llama4_text"]
    assert config.layer_types[0] == "chunked_attention"
    chunked = _equal_to_plain(config, implementation, packed=packed)
    with torch.no_grad():  # whole-row causal attention gives other logits after the first chunk
        from moe_lst.models.hf import HFCausalLM

        whole = HFCausalLM(coverage._plain(coverage.tiny_config("llama4_text", attention_chunk_size=4,
                                                                layer_types=["full_attention"] * 2)))
        positions = _packed_positions() if packed else None
        assert (whole(_tokens()[:, :-1], positions, packed=packed) - chunked).abs().max() > 1e-3


def test_chunks_of_packed_documents_whose_positions_do_not_start_at_zero_are_refused(configs):
    from moe_lst.models.hf import HFCausalLM

    model = HFCausalLM(coverage._plain(configs["llama4_text"]))
    positions = _packed_positions()
    positions[0, :6] += 3  # the first document continues one cut before the row: chunks by position differ
    with pytest.raises(NotImplementedError, match=r"chunked attention \(chunk=4\) over packed documents needs each "
                       r"document's position ids to start at 0.*row 0's document at token 0 starts at position 3"):
        model(_tokens()[:, :-1], positions, packed=True)


@pytest.mark.parametrize("kind,what", [("gemma2", r"attention logit softcapping \(softcap=0.05\)"),
                                       ("llama4_text", r"chunked attention \(chunk=4\)")])
def test_ring_and_block_sparse_attention_refuse_them_by_name(configs, kind, what):
    from moe_lst.kernels.sparse import SparseAttention, SparseConfig
    from moe_lst.models.hf import HFCausalLM
    from moe_lst.models.hf.attention import attention_of, set_attention

    from sequence_parallel.ring import RingAttention

    x = _tokens()[:, :-1]
    ring = HFCausalLM(coverage._plain(configs[kind]))
    for name in ring._sites:  # (one rank: the refusal comes before any exchange)
        module = ring.get_submodule(name)
        set_attention(module, RingAttention(None, attention_of(module)))
    with pytest.raises(NotImplementedError, match=rf"{what} with RingAttention, which does not take it .*parallel.sp"):
        ring(x)
    full = coverage.tiny_config(kind, layer_types=["full_attention"] * 2, **SOFTCAP) if kind == "gemma2" \
        else configs[kind]  # (a block-sparse layout refuses Gemma 2's sliding window first)
    sparse = HFCausalLM(coverage._plain(full),
                        attention_fn=SparseAttention(SparseConfig(layout="sliding_window", block_size=4)))
    what = what.split(r" \(")[0]
    with pytest.raises(NotImplementedError, match=rf"{what} with attention function .*only the dense attention"):
        sparse(x)


@pytest.mark.parametrize("kind,what", [("gemma2", r"model.layers.0.self_attn has attention logit softcapping"),
                                       ("llama4_text", r"model.layers.0.self_attn has chunked attention")])
def test_ring_attention_is_refused_by_the_config_check(tmp_path, monkeypatch, kind, what):
    from tests.hf.test_composed_layouts import _check

    with pytest.raises(ConfigError, match=rf"^parallel.cp=2 with model=hf is refused: {what}.*use parallel.sp"):
        _check(tmp_path, kind, 2, ["parallel.cp=2"], monkeypatch)
    assert not (tmp_path / "run").exists()


def test_sparse_attention_is_refused_by_the_config_check(tmp_path, monkeypatch):
    from tests.hf.test_composed_layouts import _check

    with pytest.raises(ConfigError, match=r"^model.attention=sparse with model=hf is refused: model.layers.0.self_attn "
                       r"has attention logit softcapping \(50.0\), which only the dense attention computes"):
        _check(tmp_path, "gemma2", 1, ["model.attention=sparse"], monkeypatch)


#: Llama 4 with a NoPE layer 0 (its queries scaled by attention temperature tuning) and a small floor_scale.
NOPE = dict(no_rope_layers=[0, 1], attention_chunk_size=4)


def test_temperature_tuning_under_shards_and_packed_documents_is_refused_from_floor_scale_on(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from moe_lst.models.hf import HFCausalLM
    from moe_lst.models.hf.attention import _check_temperature_positions

    from tests.hf.test_composed_layouts import _check

    _equal_to_plain(coverage.tiny_config("llama4_text", floor_scale=17, **NOPE), packed=True)  # (16 tokens: scales 1)
    model = HFCausalLM(coverage._plain(coverage.tiny_config("llama4_text", floor_scale=16, **NOPE)))
    with pytest.raises(NotImplementedError, match=r"Llama4TextAttention: attention temperature tuning .* packed "
                       r"documents of a 16-token sequence \(at least floor_scale=16\)"):
        model(_tokens()[:, :-1], _packed_positions(), packed=True)
    attn = model.model.layers[0].self_attn
    _check_temperature_positions(attn, SimpleNamespace(sp=2), 7)  # (14 tokens over 2 shards: all scales 1)
    with pytest.raises(NotImplementedError, match=r"Ulysses sequence shards \(sp=2\) of a 16-token sequence"):
        _check_temperature_positions(attn, SimpleNamespace(sp=2), 8)
    with pytest.raises(ConfigError, match=r"^parallel.sp=2 with model=hf is refused at train.seq_len=16: "
                       r"model.layers.0.self_attn \(Llama4TextAttention\) scales its queries .*floor_scale=16"):
        _check(tmp_path, "llama4_text", 2, ["parallel.sp=2", "model.hf.overrides={no_rope_layers: [0, 1], "
               "floor_scale: 16}"], monkeypatch)
