"""Weighted mixtures: proportions over 1,000 global batches and the exact schedule, the same samples under any
data-parallel layout and from a fresh stream (resume), exhaustion as configured, packing by document across the
mixture, and the bad sources refused in one line before training."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from moe_lst.data.build import build_streams
from moe_lst.data.format import DataError
from moe_lst.data.megatron import write_megatron
from moe_lst.data.mixture import MixtureStream, Schedule, check_mixture_config, permute
from moe_lst.data.streams import BatchSpec

from recipes.data import build_streams as recipe_streams
from tests.data.corpora import bpe, prepare, topics, write_megatron_by_hand

SEQ = 16


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict:
    """Three sources of one tokenizer: a prepared directory, one prepared in Megatron's layout and a bare Megatron
    prefix (with a validation prefix); and a fourth prepared by another tokenizer."""
    root = tmp_path_factory.mktemp("mixture")
    texts = topics()
    tokenizer = bpe(root / "tok.json", texts[:400])
    out = {"web": prepare(root, "web", texts[0:300:3], tokenizer),
           "code": prepare(root, "code", texts[1:300:3], tokenizer, fmt="megatron-indexed")}
    math_dir = prepare(root, "math_src", texts[2:300:3], tokenizer, fmt="megatron-indexed")
    out["math"] = math_dir / "train_text_document"
    out["math_val"] = math_dir / "val_text_document"
    other = bpe(root / "other.json", texts[400:800], vocab_size=300)
    out["other"] = prepare(root, "other", texts[:60], other)
    return out


def _cfg(sources, weights=(0.5, 0.3, 0.2), **extra) -> dict:
    return {"kind": "mixture", "sources": [
        {"path": str(sources["web"]), "weight": weights[0]},
        {"path": str(sources["code"]), "weight": weights[1]},
        {"path": str(sources["math"]), "weight": weights[2], "val_path": str(sources["math_val"]), "name": "math"},
    ], **extra}


def test_proportions_over_1000_global_batches_follow_the_schedule_exactly(sources):
    spec = BatchSpec(4, 1, 2, SEQ)  # global batch 8
    train, _ = build_streams(_cfg(sources, on_exhausted="repeat"), spec, 11, 400)
    counts = np.zeros(3, dtype=np.int64)
    schedule = Schedule([0.5, 0.3, 0.2], 11)
    for step in range(1000):
        source, _ = train.plan(step)
        mine = np.bincount(source, minlength=3)
        counts += mine
        # exactly the schedule: the step's rows are its cumulative counts' difference
        assert np.array_equal(mine, schedule.cumulative(8 * (step + 1)) - schedule.cumulative(8 * step))
    assert np.abs(counts / counts.sum() - [0.5, 0.3, 0.2]).max() < 0.01
    assert np.abs(counts - np.array([0.5, 0.3, 0.2]) * 8000).max() <= 3  # (within K rows, whatever the step)
    # the composition is pinned: a change to the schedule would move every resumed run's data
    assert [np.bincount(train.plan(s)[0], minlength=3).tolist() for s in range(4)] == \
        [[4, 3, 1], [4, 2, 2], [4, 2, 2], [4, 3, 1]]
    assert train.tokens_seen(1000) == {"web": int(counts[0]) * SEQ, "code": int(counts[1]) * SEQ,
                                       "math": int(counts[2]) * SEQ}


def _global_rows(stream: MixtureStream, step: int) -> tuple[torch.Tensor, ...]:
    spec = stream.spec
    parts = [stream.packed_batch(step, m, r) for m in range(spec.grad_accum) for r in range(spec.dp_size)]
    return tuple(torch.cat(t) for t in zip(*parts))


def test_resume_under_another_layout_continues_the_same_samples_bitwise(sources):
    # (the stream takes no sp: under sequence parallelism each rank shards these same rows; the recipe-level
    # resume at another dp and sp is tests/recipes/test_mixture_recipe.py)
    cfg = _cfg(sources, on_exhausted="repeat")
    layouts = {"dp2": BatchSpec(4, 1, 2, SEQ), "dp1": BatchSpec(8, 1, 1, SEQ), "dp4": BatchSpec(2, 1, 4, SEQ),
               "dp2 x accum 2": BatchSpec(2, 2, 2, SEQ)}
    ran = build_streams(cfg, layouts["dp2"], 5, 400)[0]
    for step in range(30):  # a stream that served steps 0..29 (its caches warm) ...
        ran.plan(step)
    for step in (30, 31, 97):
        want = _global_rows(ran, step)
        for name, spec in layouts.items():  # ... and one fresh per layout, as a resumed run builds it
            got = _global_rows(build_streams(cfg, spec, 5, 400)[0], step)
            assert all(torch.equal(a, b) for a, b in zip(want, got)), (name, step)
    assert not torch.equal(_global_rows(ran, 30)[0], _global_rows(ran, 31)[0])
    other_seed = build_streams(cfg, layouts["dp2"], 6, 400)[0]
    assert not torch.equal(_global_rows(other_seed, 30)[0], _global_rows(ran, 30)[0])


def test_rows_are_the_sources_windows_with_their_documents(sources):
    train, val = build_streams(_cfg(sources), BatchSpec(8, 1, 1, SEQ), 3, 400)
    for step in range(6):
        x, y, pos = train.packed_batch(step, 0, 0)
        marks = train.document_starts(step, 0, 0, SEQ + 1)
        source, offsets = train.plan(step)
        for row, (k, o) in enumerate(zip(source.tolist(), offsets.tolist())):
            tokens = np.asarray(train.sources[k].corpus.tokens[o:o + SEQ + 1], dtype=np.int64)
            assert o % SEQ == 0 and torch.equal(x[row], torch.from_numpy(tokens[:-1]))
            starts = set(np.asarray(train.sources[k].corpus.starts).tolist())
            assert marks[row].tolist() == [o + j in starts for j in range(SEQ + 1)]
            # packing by document: positions restart at each document, no label across a boundary
            for j in range(1, SEQ):
                assert pos[row, j] == (0 if marks[row, j] else pos[row, j - 1] + 1)
            assert torch.equal(y[row] == -100, marks[row, 1:])
    assert {s.name for s in val.sources} == {"web", "code", "math"}


def test_epochs_visit_every_window_once_in_a_new_order():
    for n in (1, 5, 64, 1000, 4097):
        first, second = permute(np.arange(n), n, 1), permute(np.arange(n), n, 2)
        assert sorted(first.tolist()) == list(range(n)) == sorted(second.tolist())
        assert n < 5 or not np.array_equal(first, second)


def test_an_exhausted_source_stops_or_repeats_as_configured(tmp_path, sources):
    small = tmp_path / "small"
    write_megatron(small, [np.arange(1, 40) % 300 for _ in range(4)], np.uint16)  # 156 tokens: 9 windows of 16
    cfg = _cfg(sources)
    cfg["sources"][2] = {"path": str(small), "weight": 0.2, "name": "small"}
    spec = BatchSpec(8, 1, 1, SEQ)
    # stop: refused before training, naming the source, the reads and the rule
    with pytest.raises(DataError, match=r"data source small \(.*small\) would be read 2\.\d\d times by "
                                        r"train.steps=12 \(9 sequences of 16 tokens\), past data.on_exhausted=stop"):
        recipe_streams(cfg, spec, 0, 400, steps=12)
    train, _ = recipe_streams(cfg, spec, 0, 400, steps=5)  # 5 steps read it once at most: fine
    last = next(s for s in range(40) if train.rows_before(s + 1)[2] > 9)
    train.batch(last - 1, 0, 0)
    with pytest.raises(DataError, match=f"data source small .* is exhausted at step {last + 1}"):
        train.batch(last, 0, 0)  # (the stream itself stops too, for loops other than the recipe's)
    # repeat: said once, up to max_epochs
    said = []
    cfg.update(on_exhausted="repeat")
    cfg["sources"][2]["max_epochs"] = 3
    train, _ = recipe_streams(cfg, spec, 0, 400, steps=12, say=said.append)
    assert len(said) == 1 and said[0].startswith("data source small") and "max_epochs=3" in said[0]
    epochs = [train._offsets(2, np.arange(9 * e, 9 * e + 9), 0) for e in range(3)]
    assert all(sorted(e.tolist()) == list(range(0, 9 * SEQ, SEQ)) for e in epochs)  # each epoch: every window once
    with pytest.raises(DataError, match=r"past data.sources\[2\].max_epochs=3"):
        recipe_streams(cfg, spec, 0, 400, steps=40)


def _junk(root) -> None:
    (root / "junk").mkdir()
    (root / "junk" / "notes.txt").write_text("not a corpus")


@pytest.mark.parametrize("change,message", [
    (lambda c, s, t: c["sources"][0].update(path=str(t / "nowhere")),
     r"'.*nowhere' is neither a prepared directory \(with meta.json\) nor a Megatron dataset prefix"),
    (lambda c, s, t: _junk(t) or c["sources"][0].update(path=str(t / "junk")),
     r"data.sources\[0\].path=.*junk' holds no prepared corpus"),
    (lambda c, s, t: c["sources"][1].update(weight=0), r"data.sources\[1\].weight=0 .* must be a number > 0"),
    (lambda c, s, t: c["sources"][1].update(weight=-0.5), r"data.sources\[1\].weight=-0.5 .* must be a number > 0"),
    (lambda c, s, t: c["sources"].append({"path": str(s["other"]), "weight": 1}),
     r"data source other .* was tokenized by other.json \(vocabulary 300, .*\) but web .* by tok.json "
     r"\(vocabulary 400, .*\): prepare every source with one tokenizer"),
    (lambda c, s, t: c.update(sources=[]), r"data.sources is empty"),
    (lambda c, s, t: c.update(on_exhausted="wrap"), r"data.on_exhausted='wrap' must be stop .* or repeat"),
])
def test_bad_sources_are_refused_in_one_line(tmp_path, sources, change, message):
    cfg = _cfg(sources)
    change(cfg, sources, tmp_path)
    with pytest.raises(DataError, match=message) as e:
        build_streams(cfg, BatchSpec(8, 1, 1, SEQ), 0, 400)
    assert "\n" not in str(e.value)


def test_damaged_shards_and_unknown_indices_name_the_file(tmp_path, sources):
    import shutil

    web, code = tmp_path / "web", tmp_path / "code"
    shutil.copytree(sources["web"], web)
    shutil.copytree(sources["code"], code)
    (web / "train.bin").write_bytes((web / "train.bin").read_bytes()[:-6])
    cfg = _cfg(sources)
    cfg["sources"][0]["path"] = str(web)
    with pytest.raises(DataError, match=r"data.sources\[0\].path=.*web'.*train.bin has \d+ bytes where meta.json"):
        build_streams(cfg, BatchSpec(8, 1, 1, SEQ), 0, 400)
    cfg = _cfg(sources)
    cfg["sources"][1]["path"] = str(code)
    raw = bytearray((code / "val_text_document.idx").read_bytes())
    raw[17] = 7  # float32
    (code / "val_text_document.idx").write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"val_text_document.idx declares dtype code 7 \(float32\)"):
        build_streams(cfg, BatchSpec(8, 1, 1, SEQ), 0, 400)
    write_megatron_by_hand(tmp_path / "v2", [[np.arange(40)]] * 3, version=3)
    cfg = _cfg(sources)
    cfg["sources"][2] = {"path": str(tmp_path / "v2")}
    with pytest.raises(DataError, match=r"v2.idx is a Megatron index of version 3"):
        build_streams(cfg, BatchSpec(8, 1, 1, SEQ), 0, 400)


def test_config_rules_need_no_file():
    with pytest.raises(DataError, match=r"data.sources\[0\].max_epochs=0 \(a\) must be > 0"):
        check_mixture_config({"sources": [{"path": "a", "max_epochs": 0}]})
    with pytest.raises(DataError, match="two sources are named a"):
        check_mixture_config({"sources": [{"path": "x/a"}, {"path": "y/a"}]})


def test_a_vocabulary_larger_than_the_model_is_refused(sources):
    with pytest.raises(DataError, match=r"data.sources\[0\].path=.* vocabulary of 400 tokens, more than "
                                        r"model.vocab_size=256"):
        build_streams(_cfg(sources), BatchSpec(8, 1, 1, SEQ), 0, 256)
    meta = json.loads((sources["web"] / "meta.json").read_text())
    assert meta["vocab_size"] == 400
