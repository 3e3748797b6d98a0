"""The in-loop evaluations of recipes/evals.py: pass-key retrieval scores the same at sp=2 as at sp=1, a model that
can copy from its context scores the key higher with the needle present than with it removed (the control), and
hooks are loaded before training or refused in one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
from moe_lst.data.streams import stdlib_corpus

from recipes.config import ConfigError
from recipes.evals import byte_encode, load_hook, retrieval_prompts, score_prompts, summarize
from tests.multirank import run_multirank

LENGTHS, DEPTHS = [96, 160], [0.0, 0.5, 1.0]


def _prompts():
    _, val = stdlib_corpus(max_bytes=1_000_000)
    return retrieval_prompts(val, byte_encode, LENGTHS, DEPTHS, prompts=2, digits=5, seed=3)


def _model():
    from moe_lst.models.llama import ModelConfig, Transformer

    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
                                   max_seq_len=256)).eval()


def _scores_under_sp() -> np.ndarray:
    import torch.distributed as dist

    from sequence_parallel import apply_ulysses

    model = apply_ulysses(_model(), dist.group.WORLD)
    prompts, controls = _prompts()
    return np.concatenate([score_prompts(model, p, dist.group.WORLD, None, "cpu") for p in (prompts, controls)])


def test_retrieval_scores_at_sp2_equal_sp1():
    prompts, controls = _prompts()
    model = _model()
    one = np.concatenate([score_prompts(model, p, None, None, "cpu") for p in (prompts, controls)])
    two = run_multirank(_scores_under_sp, 2)
    assert len(one) == 2 * len(LENGTHS) * len(DEPTHS) * 2 and np.all(one[:, 2] >= 1)
    for rank in two:
        np.testing.assert_allclose(rank, one, rtol=1e-5, atol=1e-5)  # log-probs, top-1 counts, key lengths


class CopyModel(nn.Module):
    """A model that retrieves: at each position it predicts the token that followed the most recent earlier
    occurrence of its last 8 tokens (an induction head, written out), else nothing in particular (uniform)."""

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        b, s = tokens.shape
        logits = torch.zeros(b, s, 256)
        for row in range(b):
            t = bytes(tokens[row].tolist())
            for i in range(8, s):
                j = t.rfind(t[i - 7:i + 1], 0, i)  # an earlier occurrence of tokens i-7..i
                if j >= 0:
                    logits[row, i, t[j + 8]] = 20.0
        return logits


def test_the_needle_present_scores_higher_than_removed():
    prompts, controls = _prompts()
    found = score_prompts(CopyModel(), prompts, None, None, "cpu")
    control = score_prompts(CopyModel(), controls, None, None, "cpu")
    with_needle, without = summarize(found, prompts), summarize(control, controls)
    assert with_needle["accuracy"] == 1.0 and without["accuracy"] == 0.0
    assert with_needle["logprob"] > without["logprob"] + 5  # the score measures retrieval, not the question
    # every prompt: same length as its control, the key only once in the control (in the answer)
    for p, c in zip(prompts, controls):
        assert len(p.tokens) == len(c.tokens) == p.length
        key = p.tokens[p.answer_start:].tolist()
        joined = bytes(c.tokens.tolist())
        assert joined.count(bytes(key)) == 1 and bytes(p.tokens.tolist()).count(bytes(key)) >= 2


def sample_hook(model, step):
    return {"answer": 42.0, "step_seen": step}


def test_hooks_load_before_training_and_refuse_in_one_line():
    assert load_hook("tests.recipes.test_evals:sample_hook")(None, 3) == {"answer": 42.0, "step_seen": 3}
    for name, what in (("tests.recipes.nowhere:fn", "ModuleNotFoundError"),
                       ("tests.recipes.test_evals:missing", "AttributeError")):
        with pytest.raises(ConfigError, match=f"eval.hooks has '{name}', which cannot be loaded \\({what}") as e:
            load_hook(name)
        assert "\n" not in str(e.value)


def test_wandb_media_are_a_retrieval_heatmap_and_a_tokens_table(tmp_path):
    from moe_lst.data.megatron import write_megatron
    from moe_lst.data.mixture import mixture_streams
    from moe_lst.data.streams import BatchSpec

    from recipes.evals import heatmap_media, tokens_table

    media = heatmap_media({(64, 0.5): 1.0, (64, 0.9): 0.5, (128, 0.5): 0.0, (128, 0.9): 0.25})
    image, table = media["eval/retrieval_heatmap"], media["eval/retrieval_table"]
    assert image.image.size[0] > 100 and table.columns == ["length", "depth", "accuracy"]
    assert table.data == [[64, 0.5, 1.0], [64, 0.9, 0.5], [128, 0.5, 0.0], [128, 0.9, 0.25]]
    for name in ("a", "b"):
        write_megatron(tmp_path / name, [np.arange(200) % 250] * 3, np.uint16)
    sources = [{"path": str(tmp_path / "a"), "weight": 3}, {"path": str(tmp_path / "b"), "weight": 1}]
    train, _ = mixture_streams({"sources": sources, "on_exhausted": "repeat"}, BatchSpec(4, 1, 1, 16), 0, 256)
    rows = tokens_table(train, 10)["data/tokens_per_source"].data
    assert [r[0] for r in rows] == ["a", "b"] and rows[0][3] + rows[1][3] == 10 * 4 * 16
    assert rows[0][3] == train.tokens_seen(10)["a"] and rows[0][4] == pytest.approx(0.75, abs=1 / 40)
