"""recipes.prepare_data and `data=tokenized`: shards that decode back to their documents, the same bytes on every
run, interruptions that never leave a complete-looking corpus, the token width, one-line refusals, and the recipe
training on what it wrote."""

import hashlib
import io
import json
import os
import pydoc_data.topics
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from recipes import prepare_data as pd
from recipes.data import (
    BatchSpec,
    DataError,
    DocumentStream,
    TokenStream,
    build_streams,
    check_data_identity,
    load_tokenized,
    stream_tokenizer,
    tokenized_streams,
)

REPO = Path(__file__).resolve().parents[2]
EOS = "<|endoftext|>"


def _documents() -> list[str]:
    """A few hundred documents of real text (the topics of Python's own help, cut at paragraphs into pieces
    of ~1-3 KB), with non-ASCII ones, and one empty document (skipped by the preparation)."""
    docs = []
    for _, text in sorted(pydoc_data.topics.topics.items()):
        piece = ""
        for para in text.split("\n\n"):
            piece += para + "\n\n"
            if len(piece) > 1500:
                docs.append(piece)
                piece = ""
        if piece:
            docs.append(piece)
    docs[5:5] = ["Grüße, 世界! ∑ x² — naïve café 🐍\n", "tabs\tand  spaces   \n\n\n", ""]
    return docs


DOCS = _documents()


def _bpe(special_tokens=(EOS,), vocab_size=1000):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()  # byte-level: every text decodes back exactly
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(DOCS, trainer)
    return tok


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    _bpe().save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> list[str]:
    """DOCS as inputs of all three kinds, in order: a directory of .txt files, two .jsonl files (with a blank
    line), a .parquet file of several row groups."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("inputs")
    (root / "txt").mkdir()
    for i, doc in enumerate(DOCS[:60]):
        (root / "txt" / f"doc_{i:03d}.txt").write_text(doc)
    for name, part in (("a.jsonl", DOCS[60:150]), ("b.jsonl", DOCS[150:220])):
        lines = [json.dumps({"id": i, "text": doc}) for i, doc in enumerate(part)]
        (root / name).write_text("\n".join(lines[:10] + [""] + lines[10:]) + "\n")
    pq.write_table(pa.table({"text": DOCS[220:]}), root / "c.parquet", row_group_size=25)
    return [str(root / "txt"), str(root / "*.jsonl"), str(root / "c.parquet")]


def _prepare(inputs, tokenizer, out, **kw):
    kw = {"val_fraction": 0.1, "chunk_bytes": 16 << 10, "workers": 1, "progress": False, **kw}
    return pd.prepare(inputs, tokenizer, out, say=lambda *_: None, **kw)


def _split_documents(out: Path, split: str) -> list[np.ndarray]:
    meta, splits = load_tokenized(str(out))
    tokens, starts = splits[split]
    return [np.asarray(tokens[a:b]) for a, b in zip(starts[:-1], starts[1:])]


def test_shards_decode_back_to_the_documents(tmp_path, tokenizer_json, inputs):
    from tokenizers import Tokenizer

    done = _prepare(inputs, tokenizer_json, tmp_path / "out", workers=2)
    meta = done.meta
    tok = Tokenizer.from_file(tokenizer_json)
    eos = tok.token_to_id(EOS)
    assert meta["eos_id"] == eos and meta["bos_id"] is None and meta["dtype"] == "uint16"
    assert meta["vocab_size"] == 1000 and meta["empty_documents_skipped"] == 1
    assert done.units > 10 and done.workers == 2
    texts = [d for d in DOCS if d]
    decoded = {}
    for split in pd.SPLITS:
        docs = _split_documents(tmp_path / "out", split)
        assert len(docs) == meta["splits"][split]["documents"] > 0
        assert sum(map(len, docs)) == meta["splits"][split]["tokens"]
        for doc in docs:  # each document ends with EOS and holds no other
            assert doc[-1] == eos and (doc[:-1] != eos).all()
        decoded[split] = [tok.decode(doc[:-1].tolist(), skip_special_tokens=False) for doc in docs]
    # every document comes back exactly, in input order, in the split its text hashes to
    assert decoded["train"] == [t for t in texts if not pd.in_val(t, 0.1)]
    assert decoded["val"] == [t for t in texts if pd.in_val(t, 0.1)]
    assert meta["documents"] == len(texts) and meta["tokens"] == sum(s["tokens"] for s in meta["splits"].values())
    assert 0.05 < len(decoded["val"]) / len(texts) < 0.2  # --val-fraction 0.1
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == \
        [".prepare.lock", "meta.json", "train.bin", "train.idx", "val.bin", "val.idx"]


def test_split_rule_holds_out_the_fraction_by_text():
    texts = [f"document {i}" for i in range(20_000)]
    for fraction in (0.01, 0.1, 0.5):
        held = sum(pd.in_val(t, fraction) for t in texts) / len(texts)
        assert abs(held - fraction) < 3 * (fraction * (1 - fraction) / len(texts)) ** 0.5 + 1e-3, (fraction, held)
    # the same in another process (no per-process salt, as Python's hash() has): reruns and workers agree
    code = "from recipes.prepare_data import in_val; print([in_val(f'document {i}', 0.1) for i in range(500)])"
    other = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert other.stdout.strip() == str([pd.in_val(t, 0.1) for t in texts[:500]])


def test_same_inputs_give_the_same_bytes(tmp_path, tokenizer_json, inputs, monkeypatch):
    # workers, unit sizes and how workers start change how the work is cut, never the output
    _prepare(inputs, tokenizer_json, tmp_path / "a", workers=1, chunk_bytes=8 << 10)
    _prepare(inputs, tokenizer_json, tmp_path / "b", workers=2, chunk_bytes=200 << 10)
    monkeypatch.setattr(pd, "_start_method", lambda: "spawn")  # (where fork is missing: workers load the tokenizer)
    _prepare(inputs, tokenizer_json, tmp_path / "c", workers=2, chunk_bytes=64 << 10)
    for name in ("meta.json", "train.bin", "train.idx", "val.bin", "val.idx"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "c" / name).read_bytes(), name
    meta = json.loads((tmp_path / "a" / "meta.json").read_text())
    assert meta["splits"]["train"]["sha256"] == hashlib.sha256((tmp_path / "a" / "train.bin").read_bytes()).hexdigest()


def test_workers_fork_only_from_a_lone_thread():
    # a fork copies locks other threads hold into the child, where nothing releases them: a caller with threads
    # (a test runner's process pool, a threaded program calling prepare()) gets spawned workers
    import threading

    if "fork" not in __import__("multiprocessing").get_all_start_methods():
        pytest.skip("no fork on this platform")
    release = threading.Event()
    other = threading.Thread(target=release.wait)
    other.start()
    try:
        assert pd._start_method() == "spawn"
    finally:
        release.set()
        other.join()
    code = "from recipes.prepare_data import _start_method; print(_start_method())"
    alone = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert alone.stdout.strip() == "fork"


def test_command_line_run_in_process_with_spawned_workers(tmp_path, tokenizer_json, inputs):
    # `python -m recipes.prepare_data` run by runpy inside a program that bound multiprocessing's __mp_main__ to
    # itself first (a test runner, a notebook): spawned workers get the tasks, and the parent the results, under
    # recipes.prepare_data's own name, never __main__'s (a result it cannot unpickle hangs the pool)
    script = (
        "import multiprocessing.spawn, runpy, sys, threading\n"
        "threading.Thread(target=threading.Event().wait, daemon=True).start()  # (workers are spawned)\n"
        f"sys.argv = ['prepare_data', '--tokenizer', {tokenizer_json!r}, '--out', {str(tmp_path / 'out')!r},"
        f" '--workers', '2', '--chunk-mb', '0.01', '--quiet', *{inputs!r}]\n"
        "runpy.run_module('recipes.prepare_data', run_name='__main__', alter_sys=True)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "2 worker(s)" in done.stdout and (tmp_path / "out" / "meta.json").exists()


def test_uint32_when_the_vocabulary_passes_65536(tmp_path):
    assert pd.token_dtype(65_536) == np.uint16 and pd.token_dtype(65_537) == np.uint32
    tok = _bpe()
    tok.add_tokens([f"<extra_{i}>" for i in range(69_500)])  # ids up to ~70,500
    path = tmp_path / "big.json"
    tok.save(str(path))
    docs = [f"first <extra_69499> doc {i}\n" + DOCS[i] for i in range(40)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    meta = _prepare([str(tmp_path / "in.jsonl")], str(path), tmp_path / "out", val_fraction=0.2).meta
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == tok.get_vocab_size() > 70_000
    high = tok.token_to_id("<extra_69499>")
    assert high > 65_535
    out = [d for s in pd.SPLITS for d in _split_documents(tmp_path / "out", s)]
    assert all(high in doc for doc in out)  # (a uint16 shard would have wrapped it)
    assert sorted(tok.decode(d[:-1].tolist(), skip_special_tokens=False) for d in out) == sorted(docs)


def test_sentencepiece_and_hf_directory_frame_documents_with_bos(tmp_path):
    import sentencepiece as spm
    from transformers import PreTrainedTokenizerFast

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(DOCS[:200]), model_writer=model, vocab_size=400, model_type="bpe", byte_fallback=True,
        normalization_rule_name="identity", add_dummy_prefix=False, remove_extra_whitespaces=False, minloglevel=2,
        max_sentence_length=100_000)
    (tmp_path / "sp.model").write_bytes(model.getvalue())
    hf = tmp_path / "hf"
    PreTrainedTokenizerFast(tokenizer_object=_bpe(("<s>", "</s>")), bos_token="<s>", eos_token="</s>") \
        .save_pretrained(hf)
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in DOCS[:80] if d))
    for name, tokenizer in (("sp", tmp_path / "sp.model"), ("hf", hf)):
        meta = _prepare([str(tmp_path / "in.jsonl")], str(tokenizer), tmp_path / name, text_field="body").meta
        kind = meta["tokenizer"]["kind"]
        assert kind == {"sp": "sentencepiece", "hf": "transformers"}[name]
        assert (meta["tokenizer"]["bos"], meta["tokenizer"]["eos"]) == ("<s>", "</s>")
        tok = pd.TextTokenizer(pd.TokenizerSpec(kind, str(tokenizer)))
        docs = [d for s in pd.SPLITS for d in _split_documents(tmp_path / name, s)]
        assert all(d[0] == meta["bos_id"] and d[-1] == meta["eos_id"] for d in docs)
        assert sorted(tok.decode(d[1:-1].tolist()) for d in docs) == sorted(d for d in DOCS[:80] if d)


def _big_jsonl(path: Path, megabytes: int) -> int:
    lines = [json.dumps({"text": d}) + "\n" for d in DOCS if d]
    written = count = 0
    with open(path, "w") as f:
        while written < megabytes << 20:
            for i, line in enumerate(lines):
                f.write(line.replace('"text": "', f'"text": "{count}.{i} ', 1))
                written += len(line)
            count += 1
    return count * len(lines)


def test_interrupted_preparation_is_detected_and_replaced(tmp_path, tokenizer_json):
    corpus, out = tmp_path / "big.jsonl", tmp_path / "out"
    documents = _big_jsonl(corpus, 6)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([sys.executable, "-m", "recipes.prepare_data", "--tokenizer", tokenizer_json, "--out",
                             str(out), "--workers", "1", "--chunk-mb", "0.25", "--quiet", str(corpus)], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not ((out / "train.bin.partial").exists() and (out / "train.bin.partial").stat().st_size):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)  # no handler can run: whatever is on disk is what an interruption leaves
    proc.wait()
    assert not (out / "meta.json").exists() and not (out / "train.bin").exists()
    with pytest.raises(DataError, match="has no meta.json: its preparation did not finish"):
        load_tokenized(str(out))
    said = []
    meta = pd.prepare([str(corpus)], tokenizer_json, out, workers=1, chunk_bytes=1 << 20, progress=False,
                      say=said.append).meta
    assert said and "interrupted preparation" in said[0] and "train.bin.partial" in said[0]
    assert meta["documents"] == documents and not list(out.glob("*.partial"))
    assert load_tokenized(str(out))[0] == meta


def test_no_interruption_point_leaves_a_complete_looking_corpus(tmp_path, tokenizer_json, inputs, monkeypatch):
    out = tmp_path / "out"
    first = _prepare(inputs, tokenizer_json, out).meta
    # A failure while working (a bad line deep in a .jsonl) removes its partial files; the old corpus stands.
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[:100]) + "{not json\n")
    with pytest.raises(pd.PrepareError, match=r"bad.jsonl \(byte \d+\): not a JSON line"):
        _prepare([str(bad)], tokenizer_json, out, force=True)
    assert load_tokenized(str(out))[0] == first and not list(out.glob("*.partial"))
    # Interrupted after the shards moved into place but before meta.json: refused, then replaced by a rerun.
    def interrupted(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(pd, "write_meta", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _prepare(inputs[:1], tokenizer_json, out, force=True)
    assert (out / "train.bin").exists() and not (out / "meta.json").exists()
    with pytest.raises(DataError, match="did not finish"):
        build_streams(OmegaConf.create({"kind": "tokenized", "path": str(out)}), BatchSpec(2, 1, 1, 16), 0, 1000)
    monkeypatch.undo()
    said = []
    lock = pd.claim_output(out, False, said.append)  # what a rerun does first: the leftovers go
    assert "interrupted preparation (train.bin, train.idx, val.bin, val.idx)" in said[0]
    assert sorted(p.name for p in out.iterdir()) == [".prepare.lock"]
    with pytest.raises(pd.PrepareError, match="is being written by another preparation"):
        pd.claim_output(out, False, said.append)
    lock.close()
    meta = _prepare(inputs[:1], tokenizer_json, out).meta
    assert meta["documents"] == len([d for d in DOCS[:60] if d])
    with pytest.raises(pd.PrepareError, match="already holds a prepared corpus.*--force"):
        _prepare(inputs, tokenizer_json, out)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tokenizer_json, inputs) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "corpus"
    _prepare(inputs, tokenizer_json, out)
    return out


def test_loader_refusals_are_one_line(tmp_path, prepared):
    spec = BatchSpec(2, 1, 1, 16)
    with pytest.raises(DataError, match=r"vocabulary of 1,000 tokens, more than model.vocab_size=256: set "
                                        r"model.vocab_size=1000") as e:
        tokenized_streams(str(prepared), spec, 0, 256)
    assert "\n" not in str(e.value)
    with pytest.raises(DataError, match=r"its val split has [\d,]+ tokens, fewer than one sequence of "
                                        r"train.seq_len=100000"):
        tokenized_streams(str(prepared), BatchSpec(2, 1, 1, 100_000), 0, 1000)
    with pytest.raises(DataError, match="is not a directory"):
        tokenized_streams(str(tmp_path / "nowhere"), spec, 0, 1000)
    with pytest.raises(DataError, match="holds no prepared corpus"):
        tokenized_streams(str(tmp_path), spec, 0, 1000)
    for name, change, message in (("train.idx", "remove", "train.idx is missing"),
                                  ("val.bin", "truncate", "val.bin has .* bytes where meta.json records"),
                                  ("meta.json", "garble", "meta.json cannot be used")):
        copy = tmp_path / change
        copy.mkdir()
        for p in prepared.iterdir():
            (copy / p.name).write_bytes(p.read_bytes())
        if change == "remove":
            (copy / name).unlink()
        elif change == "truncate":
            (copy / name).write_bytes((copy / name).read_bytes()[:-2])
        else:
            (copy / name).write_text("{")
        with pytest.raises(DataError, match=message) as e:
            tokenized_streams(str(copy), spec, 0, 1000)
        assert "\n" not in str(e.value)


def test_document_starts_follow_the_index(prepared):
    meta = json.loads((prepared / "meta.json").read_text())
    train, val = build_streams(OmegaConf.create({"kind": "tokenized", "path": str(prepared)}), BatchSpec(4, 2, 2, 64),
                               seed=3, vocab_size=1000)
    assert isinstance(train, DocumentStream) and train.identity["tokenizer_sha256"] == meta["tokenizer"]["sha256"]
    starts = set(np.asarray(train.starts).tolist())
    seen = 0
    for step in range(8):
        for micro in range(2):
            for rank in range(2):
                x, _ = train.batch(step, micro, rank)
                marks = train.document_starts(step, micro, rank)
                assert marks.shape == x.shape and marks.dtype == torch.bool
                offsets = train._row_offsets(step, micro, rank)
                want = torch.tensor([[o + j in starts for j in range(64)] for o in offsets.tolist()])
                assert torch.equal(marks, want)
                # a document starts right after an EOS, and nowhere else inside a row
                after_eos = x[:, :-1] == meta["eos_id"]
                assert torch.equal(marks[:, 1:], after_eos)
                seen += int(marks.sum())
    assert seen > 10  # (documents of ~400 tokens: about one start in six rows of 64)


@pytest.mark.parametrize("packing", ["document", "concat"])
def test_packed_batch_restarts_positions_and_drops_cross_document_labels(prepared, packing):
    data = OmegaConf.create({"kind": "tokenized", "path": str(prepared), "packing": packing})
    train, _ = build_streams(data, BatchSpec(4, 1, 1, 64), seed=3, vocab_size=1000)
    restarts = 0
    for step in range(8):
        x, y, pos = train.packed_batch(step, 0, 0)
        plain_x, plain_y = train.batch(step, 0, 0)
        assert torch.equal(x, plain_x)  # the same windows either way
        if packing == "concat":
            assert pos is None and torch.equal(y, plain_y)
            continue
        marks = train.document_starts(step, 0, 0, length=65)  # also covers the last label
        assert torch.equal(marks[:, :64], train.document_starts(step, 0, 0))
        for row in range(4):
            run = 0
            for j in range(64):
                run = 0 if marks[row, j] else run + 1 if j else 0
                assert pos[row, j] == run
                # a label that begins the next document is not predicted from this one's last token
                assert y[row, j] == (-100 if marks[row, j + 1] else plain_y[row, j])
        restarts += int(marks[:, 1:64].sum())
    assert restarts > 3 or packing == "concat"


def test_packing_is_refused_unless_document_or_concat(prepared):
    with pytest.raises(DataError, match="data.packing='docs' must be one of document, concat"):
        build_streams(OmegaConf.create({"kind": "tokenized", "path": str(prepared), "packing": "docs"}),
                      BatchSpec(4, 1, 1, 64), seed=3, vocab_size=1000)


def test_resumed_run_refuses_another_tokenizer(tmp_path, prepared):
    spec = BatchSpec(2, 1, 1, 16)
    train, _ = tokenized_streams(str(prepared), spec, 0, 1000)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    check_data_identity(train, run_dir, resuming=False, is_rank0=True)  # a fresh run records its tokenizer
    recorded = json.loads((run_dir / "data_identity.json").read_text())
    assert recorded["tokenizer_sha256"] == train.identity["tokenizer_sha256"]
    check_data_identity(train, run_dir, resuming=True, is_rank0=True)  # the same tokenizer resumes
    other = dict(train.identity, tokenizer_sha256="0" * 64)
    train.identity = other
    with pytest.raises(DataError, match=r"now tokenized by tokenizer.json \(sha256 000000000000\), but this run "
                                        r"started with tokenizer.json \(sha256 [0-9a-f]{12}\)") as e:
        check_data_identity(train, run_dir, resuming=True, is_rank0=True)
    assert "\n" not in str(e.value)
    check_data_identity(train, run_dir, resuming=False, is_rank0=True)  # a fresh start records anew


def test_stream_tokenizer_is_the_one_that_prepared_the_data(tmp_path, prepared, tokenizer_json):
    train, _ = tokenized_streams(str(prepared), BatchSpec(2, 1, 1, 16), 0, 1000)
    copy = tmp_path / "tokenizer.json"
    copy.write_bytes(Path(tokenizer_json).read_bytes())
    train.identity = dict(train.identity, tokenizer_path=str(copy))
    tok = stream_tokenizer(train)
    ids = tok.encode_batch(["def sample(prompt):"])[0]
    assert tok.decode(ids) == "def sample(prompt):" and max(ids) < 1000
    copy.write_text(copy.read_text().replace("<|endoftext|>", "<|end|>"))
    with pytest.raises(DataError, match=r"tokenizer.json\) cannot decode its ids: it is another tokenizer now"):
        stream_tokenizer(train)
    copy.unlink()
    with pytest.raises(DataError, match="cannot decode its ids: No such file or directory"):
        stream_tokenizer(train)
    assert stream_tokenizer(TokenStream(np.zeros(100, np.uint8), BatchSpec(2, 1, 1, 16), 0, 256)) is None  # bytes


@pytest.mark.parametrize("case,message", [
    ({"tokenizer": "{tmp}/none.json"}, "--tokenizer .*none.json: no such file or directory"),
    ({"inputs": ["{tmp}/*.nothing"]}, "input '.*\\*.nothing' matches no file"),
    ({"inputs": ["{tmp}/missing.txt"]}, "input '.*missing.txt': no such file or directory"),
    ({"inputs": ["{tmp}/x.csv"]}, "input '.*x.csv' is not a .txt, .jsonl, .parquet file"),
    ({"extra": ["--text-field", "body"]}, "in.jsonl \\(byte 1\\): no string field 'body' \\(it has: text\\); "
                                          "choose the field with --text-field"),
    ({"extra": ["--val-fraction", "0"]}, "--val-fraction 0.0 must be between 0 and 1"),
    ({"tokenizer": "{tmp}/noeos.json"}, "declares no end-of-document token: name one of its tokens with --eos"),
    ({"extra": ["--eos", "<nope>"]}, "--eos '<nope>' is not a token of"),
    ({"tokenizer": "{tmp}/x.csv"}, "cannot be loaded as a SentencePiece model"),
    ({"out": "{tmp}/x.csv"}, "--out .*x.csv is a file, not a directory"),
    ({"extra": ["--workers", "0"]}, "--workers 0 must be >= 1"),
    ({"inputs": ["{tmp}/surrogate.jsonl"]}, "surrogate.jsonl: the tokenizer failed on a document"),
])
def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, tokenizer_json, case, message, capsys):
    (tmp_path / "x.csv").write_text("a,b\n")
    (tmp_path / "in.jsonl").write_text("\n" + json.dumps({"text": "hello"}) + "\n")
    _bpe(special_tokens=()).save(str(tmp_path / "noeos.json"))
    (tmp_path / "surrogate.jsonl").write_text('{"text": "fine"}\n{"text": "a lone \\ud800 surrogate"}\n')
    case = {"tokenizer": tokenizer_json, "out": "{tmp}/out", "inputs": ["{tmp}/in.jsonl"], "extra": [], **case}
    fill = str(tmp_path).join
    argv = ["--quiet", "--tokenizer", fill(case["tokenizer"].split("{tmp}")), "--out", fill(case["out"].split("{tmp}")),
            *case["extra"], *(fill(x.split("{tmp}")) for x in case["inputs"])]
    with pytest.raises(SystemExit) as e:
        pd.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    assert re.search(message, err), err
    assert not (tmp_path / "out" / "meta.json").exists()


def test_parquet_without_pyarrow_or_column_is_refused(tmp_path, tokenizer_json, inputs, monkeypatch):
    with pytest.raises(pd.PrepareError, match=r"c.parquet has no column 'body' \(it has: text\)"):
        _prepare(inputs[2:], tokenizer_json, tmp_path / "out", text_field="body")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if it were not installed
    with pytest.raises(pd.PrepareError, match="reading .*c.parquet needs pyarrow: pip install pyarrow"):
        _prepare(inputs[2:], tokenizer_json, tmp_path / "out")


def _recipe(*args, timeout=300, sample_tokens=0):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    return subprocess.run([sys.executable, "-m", "recipes.pretrain", "model=tiny", "data=tokenized",
                           "train.progress=false", f"train.sample_tokens={sample_tokens}", "wandb.mode=disabled",
                           *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_recipe_trains_on_a_prepared_corpus(tmp_path, prepared):
    done = _recipe(f"data.path={prepared}", "model.vocab_size=1000", "train.steps=3", "train.seq_len=64",
                   "train.micro_batch_size=4", "train.eval_batches=1", "train.sample_prompt=The",
                   f"run_dir={tmp_path / 'run'}", sample_tokens=8)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(np.isfinite(r["loss"]) and 6 < r["loss"] < 7.5 for r in records)  # ln(1000) = 6.9 at the start
    assert 6 < records[-1]["val_loss"] < 7.5
    # the sample is the data's tokenizer's text (not bytes), and the run recorded that tokenizer for resumes
    text = (tmp_path / "run" / "sample.txt").read_text()
    assert text.startswith("The") and len(text) > len("The")
    assert json.loads((tmp_path / "run" / "data_identity.json").read_text())["tokenizer_sha256"]


def test_recipe_refuses_a_vocabulary_larger_than_the_model(tmp_path, prepared):
    done = _recipe(f"data.path={prepared}", "train.steps=3", f"run_dir={tmp_path / 'run'}")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: data.path='{prepared}' was tokenized by tokenizer.json with a vocabulary of 1,000 tokens, more "
        "than model.vocab_size=256: set model.vocab_size=1000 (or more)"]


def _mistral_tokenizer() -> Path:
    mistral_common = pytest.importorskip("mistral_common")
    path = Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1"
    if not path.is_file():
        pytest.skip(f"mistral-common {getattr(mistral_common, '__version__', '?')} ships no data/tokenizer.model.v1")
    return path


@pytest.mark.slow
def test_real_32k_sentencepiece_tokenizer_prepares_and_trains(tmp_path):
    """Mistral's 32k SentencePiece tokenizer.model (shipped inside mistral-common) on the text of Python's help
    topics: prepared over two processes, then 20 steps of training whose loss falls."""
    tokenizer = _mistral_tokenizer()
    topics = tmp_path / "topics"
    topics.mkdir()
    for name, text in sorted(pydoc_data.topics.topics.items()):
        (topics / f"{name}.txt").write_text(text)
    done = subprocess.run([sys.executable, "-m", "recipes.prepare_data", "--tokenizer", str(tokenizer), "--out",
                           str(tmp_path / "out"), "--val-fraction", "0.1", "--chunk-mb", "0.05", "--quiet",
                           str(topics)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["vocab_size"] == 32_000 and meta["dtype"] == "uint16" and (meta["bos_id"], meta["eos_id"]) == (1, 2)
    assert meta["documents"] == len(pydoc_data.topics.topics) and meta["tokens"] > 100_000
    run = _recipe(f"data.path={tmp_path / 'out'}", "model.vocab_size=32000", "train.steps=20", "train.seq_len=128",
                  "train.micro_batch_size=8", "train.eval_batches=2", "train.eval_every=10", "optim.warmup_steps=2",
                  f"run_dir={tmp_path / 'run'}", timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records]
    assert len(losses) == 20 and losses[0] > 10  # ln(32000) = 10.4
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 1.0, losses  # (measured: 10.18 -> 8.66)
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(val) == 2 and val[1] < val[0], val
