"""W&B media of an MoE run in offline mode: at each evaluation the expert-load heatmap (an Image) and the
per-layer, per-expert load (a Table); at the end the run's config.yaml, the data's meta.json and the sample."""

import json
import pydoc_data.topics
from pathlib import Path

from hydra import compose, initialize_config_dir

from recipes import prepare_data as pd
from recipes.pretrain import train
from tests.recipes.test_pretrain import REPO, TINY

EOS = "<|endoftext|>"


def _corpus(root: Path) -> Path:
    """A small corpus (Python's help topics) tokenized with a 300-token byte-level BPE."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    docs = [text for _, text in sorted(pydoc_data.topics.topics.items())][:120]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=300, special_tokens=[EOS], show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(root / "tokenizer.json"))
    (root / "txt").mkdir()
    for i, doc in enumerate(docs):
        (root / "txt" / f"doc_{i:03d}.txt").write_text(doc)
    pd.prepare([str(root / "txt")], str(root / "tokenizer.json"), root / "corpus", val_fraction=0.1, workers=1,
               progress=False, say=lambda *_: None)
    return root / "corpus"


def _records(path: Path):
    """The records of a .wandb file: leveldb-log framing (32 KiB blocks of checksum, length, type, data chunks)
    after a 7-byte file header, each record a wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2

    data, pos, pending = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk  # full / first; middle / last append
        if kind in (1, 4) and pending:
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def _history(run: Path) -> dict[int, dict]:
    """The history rows of the offline run, read back from its .wandb file with wandb's own protobuf types."""
    rows: dict[int, dict] = {}
    for record in _records(next(run.glob("*.wandb"))):
        if record.WhichOneof("record_type") == "history":
            row = rows.setdefault(int(record.history.step.num), {})
            for item in record.history.item:  # a media value comes as one item per field (nested_key)
                key, *field = item.nested_key or [item.key]
                value = json.loads(item.value_json)
                row[key] = {**row.get(key, {}), field[0]: value} if field else value
    return rows


def test_offline_run_holds_load_media_per_evaluation_and_the_run_files(tmp_path, monkeypatch):
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    corpus = _corpus(tmp_path)
    run_dir = tmp_path / "run"
    overrides = ["model=moe_tiny", *TINY[1:], "data=tokenized", f"data.path={corpus}", "model.vocab_size=300",
                 "train.steps=4", "train.eval_every=2", "train.sample_tokens=8", f"run_dir={run_dir}",
                 "wandb.mode=offline"]
    with initialize_config_dir(version_base=None, config_dir=str(REPO / "recipes" / "conf")):
        cfg = compose("config", overrides=[o for o in overrides if not o.startswith("data.max_bytes")])
    train(cfg)

    (run,) = (run_dir / "wandb").glob("offline-run-*")
    files = run / "files"
    rows = _history(run)
    layers = sorted({k.split("/")[1] for k in rows[4] if k.startswith("moe/layer")})
    assert layers == ["layer0", "layer1"]
    for step in (2, 4):  # the two evaluations
        heatmap, table = rows[step]["expert_load/heatmap"], rows[step]["expert_load/table"]
        assert heatmap["_type"] == "image-file" and heatmap["format"] == "png"
        assert (files / heatmap["path"]).stat().st_size > 1000
        assert table["_type"] == "table-file" and table["nrows"] == 2 * 8
        content = json.loads((files / table["path"]).read_text())
        assert content["columns"] == ["layer", "expert", "tokens", "fraction"]
        assert sorted({(r[0], r[1]) for r in content["data"]}) == [(f, e) for f in layers for e in range(8)]
        for layer in layers:  # each layer's fractions sum to one
            assert abs(sum(r[3] for r in content["data"] if r[0] == layer) - 1) < 1e-9
    assert "expert_load/table" not in rows[1] and "expert_load/table" not in rows[3]
    # the load since the start of the run grows: the last table counts twice the first one's tokens
    first, last = (json.loads((files / rows[s]["expert_load/table"]["path"]).read_text()) for s in (2, 4))
    assert sum(r[2] for r in last["data"]) == 2 * sum(r[2] for r in first["data"]) > 0
    # the final table holds the same loads as expert_load.txt (what report_expert_load writes)
    report = (run_dir / "expert_load.txt").read_text().splitlines()[2:]
    for line in report:
        name, *values = line.split()
        fracs = [r[3] for r in last["data"] if r[0] == name]
        assert [f"{f:.3f}" for f in fracs] == values[:8]
    attached = files / "recipe"
    assert (attached / "config.yaml").read_text() == (run_dir / "config.yaml").read_text()
    assert (attached / "sample.txt").read_text() == (run_dir / "sample.txt").read_text() != ""
    assert json.loads((attached / "meta.json").read_text()) == json.loads((corpus / "meta.json").read_text())
