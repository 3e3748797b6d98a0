"""Checkpoints hold data only and loading runs none of their code.

A shard is a safetensors file (the tensors) whose header carries a JSON skeleton (everything else); it
round-trips the training state exactly (types included) and loads memory-mapped. A shard crafted to run a
command when unpickled, with meta.json's checksum updated to match, runs nothing and is refused in one line
naming the file, by the engine and by the recipe. A checkpoint of the old pickle format is refused with the
command that converts it; converted, it is byte for byte the checkpoint the new format writes and resumes
bit for bit like it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import random
import shlex
import shutil
from pathlib import Path, PurePosixPath

import numpy as np
import pytest
import torch

import zero
from tests.zero.models import OPT, build, global_batch, lm_loss
from zero.state import shardfile
from zero.state.checkpoint import LegacyCheckpointError
from zero.state.convert import WARNING
from zero.state.convert import main as convert


class _Payload:
    """Unpickling this runs a shell command that creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def _refusal(load, path: Path, marker: Path, kind: type[Exception] = zero.CheckpointError) -> str:
    """The one-line message `load(path)` refuses with, once it is checked that nothing ran."""
    try:
        load(path)
        error = None
    except Exception as e:  # noqa: BLE001 - the marker is checked first, whatever happened
        error = e
    assert not marker.exists(), "loading ran the command the checkpoint carries"
    assert isinstance(error, kind), repr(error)
    assert "\n" not in str(error)
    return str(error)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _match_meta(ckpt: Path, shard: Path) -> None:
    """Update meta.json's size and SHA-256 of `shard` to its current contents (as a forger would)."""
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["shards"][0].update(file=shard.name, bytes=shard.stat().st_size, sha256=_sha256(shard))
    (ckpt / "meta.json").write_text(json.dumps(meta))


def _save_old_format(engine: zero.Engine, path: Path, client_state) -> None:
    """What save_checkpoint wrote before shards were safetensors (one process): a pickled shard and meta.json v2."""
    path.mkdir()
    shard = path / "rank00000.pt"
    torch.save({"shard": {"rank": 0, "world_size": 1, "global_steps": engine.global_steps, "run_id": None},
                "engine": engine.state_dict(file_backed=True), "client_state": client_state,
                "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "cuda": None}}, shard)
    meta = {"format": "zero-checkpoint-v2", "world_size": 1,
            "shards": [{"file": shard.name, "bytes": shard.stat().st_size, "sha256": _sha256(shard)}],
            "layout": {"dp": 1, "tp": 1, "pp": 1, "sp": 1, "ep": 1}, "stage": engine.config.stage,
            "dtype": engine.config.dtype, "global_steps": engine.global_steps, "run_id": None, "unplaced": []}
    (path / "meta.json").write_text(json.dumps(meta))


def _assert_same(got, expected, where: str = "state") -> None:
    """Equal values of the same types, tensors bit for bit (NaN included), down the whole structure."""
    assert type(got) is type(expected), f"{where}: {type(got)} != {type(expected)}"
    if isinstance(expected, dict):
        assert list(got) == list(expected), where
        for k in expected:
            _assert_same(got[k], expected[k], f"{where}[{k!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), where
        for i, (g, e) in enumerate(zip(got, expected)):
            _assert_same(g, e, f"{where}[{i}]")
    elif isinstance(expected, torch.Tensor):
        assert (got.dtype, got.shape) == (expected.dtype, expected.shape), where
        as_bytes = [x.reshape(-1).contiguous().view(torch.uint8) for x in (got, expected)]
        assert torch.equal(*as_bytes), where
    elif isinstance(expected, (np.ndarray, np.generic)):
        assert got.dtype == expected.dtype and np.array_equal(got, expected), where
    elif isinstance(expected, float):
        assert math.copysign(1, got) == math.copysign(1, expected) and (got == expected or got != got), where
    else:
        assert got == expected, where


def _engine(seed: int = 0) -> zero.Engine:
    # fp16: the checkpoint holds a loss scaler's state beside AdamW's, the schedule's and the counters
    config = zero.ZeroConfig(stage=3, dtype="fp16", reduce_bucket_size=1000)
    return zero.initialize(build(seed=seed), OPT, config,
                           lr_scheduler=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.5))


def _train(engine: zero.Engine, steps: range) -> list[float]:
    losses = []
    for step in steps:
        loss = lm_loss(engine, global_batch(step, 0, 2))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _mapped_from(t: torch.Tensor, path: Path) -> bool:
    """Whether `t`'s memory lies in a mapping of the file `path` (read lazily from the page cache)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path.resolve()):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= t.data_ptr() < hi:
                return True
    return False


def test_state_round_trips_exactly_and_loads_memory_mapped(tmp_path):
    t = torch.randn(4, 8)
    np.random.seed(3)
    state = {
        "tensors": [t, t.t(), torch.tensor(2.5, dtype=torch.bfloat16), torch.empty(0, 3),
                    torch.tensor([True, False]), torch.arange(5, dtype=torch.uint8), torch.arange(3).to(torch.int32),
                    torch.tensor([float("nan"), -0.0, float("inf")], dtype=torch.float16)],
        "optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(7)}},
                      "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "foreach": None, "params": [0]}]},
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
        "plain": [None, True, 0, -(2**70), 1.5, float("nan"), -0.0, float("-inf"), "", "é/x", b"\x00\xff"],
        "keys": {(1, "a"): 1, 2: "two", None: 3, "2": 4},
        "torch": [torch.Size([2, 3]), torch.bfloat16, torch.device("cpu")],
        "numpy": [np.float64(0.1), np.int8(-3), np.arange(6, dtype=np.uint32).reshape(2, 3).T],
        "empty": [{}, [], ()],
        "a/b": torch.zeros(2), "a": {"b": torch.ones(2)},  # the same path spelled twice: two tensors
    }
    with open(tmp_path / "s", "wb") as f:
        shardfile.dump(state, f)
    back = shardfile.load(tmp_path / "s")
    _assert_same(back, state)
    random.setstate(back["rng"]["python"])  # (a list instead of a tuple is refused here)
    np.random.set_state(back["rng"]["numpy"])
    # One tensor object stored once comes back as one object; tensors are mapped from the file, not copied.
    with open(tmp_path / "alias", "wb") as f:
        shardfile.dump({"best": t, "all": [t]}, f)
    aliased = shardfile.load(tmp_path / "alias")
    assert aliased["best"] is aliased["all"][0]
    assert all(_mapped_from(x, tmp_path / "s") for x in (back["tensors"][0], back["optimizer"]["state"][0]["exp_avg"]))


@pytest.mark.parametrize("value", [PurePosixPath("x"), _Payload(Path("x")), torch.ones(2).to_sparse()],
                         ids=["path", "object", "sparse"])
def test_what_a_shard_cannot_hold_is_refused_by_its_place_before_writing(tmp_path, value):
    target = tmp_path / "s"
    with open(target, "wb") as f, pytest.raises(shardfile.ShardFormatError) as e:
        shardfile.dump({"client_state": {"cfg": [1, value]}}, f)
    assert str(e.value).startswith("state['client_state']['cfg'][1]: ") and "\n" not in str(e.value)
    assert target.stat().st_size == 0  # refused before anything was written


def test_checkpoint_holds_the_engine_state_exactly(tmp_path):
    engine = _engine()
    _train(engine, range(3))
    engine.save_checkpoint(tmp_path / "ckpt", client_state={"step": 3, "rng": torch.get_rng_state()})
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["meta.json", "rank00000.safetensors"]
    saved = shardfile.load(tmp_path / "ckpt" / "rank00000.safetensors")
    _assert_same(saved["engine"], engine.state_dict())
    _assert_same(saved["rng"], {"torch": torch.get_rng_state(), "python": random.getstate(), "cuda": None})
    # (the first fp16 steps overflow and are skipped: the schedule counts the applied ones)
    assert saved["engine"]["loss_scaler"]["scale"] < 2**16 and saved["engine"]["lr_scheduler"]["last_epoch"] == 1
    engine.close()


def test_crafted_shard_runs_nothing_and_is_refused_by_name(tmp_path):
    engine = _engine()
    _train(engine, range(1))
    ckpt, marker = tmp_path / "ckpt", tmp_path / "ran"
    engine.save_checkpoint(ckpt)
    shard = ckpt / "rank00000.safetensors"
    fresh = _engine(seed=1)
    # A pickle whose unpickling runs a command, in place of the shard; meta.json's checksum updated to match.
    torch.save({"engine": _Payload(marker)}, shard)
    _match_meta(ckpt, shard)
    zero.verify_checkpoint(fresh, ckpt)  # the checksum matches: it proves integrity, not who wrote the file
    for load in (fresh.load_checkpoint, zero.open_checkpoint):
        message = _refusal(load, ckpt, marker)
        assert message.startswith(f"{shard}: not a safetensors file") and "never unpickled" in message
    # A real safetensors file whose skeleton asks for an object.
    with open(shard, "wb") as f:
        shardfile.dump({"shard": {"rank": 0, "global_steps": 1}}, f)
    raw = shard.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header["__metadata__"]["skeleton"] = json.dumps({"dict": {"shard": {"pickle": "os.system"}}})
    text = json.dumps(header).encode()
    shard.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])
    _match_meta(ckpt, shard)
    assert _refusal(fresh.load_checkpoint, ckpt, marker).startswith(
        f"{shard}: state['shard']: {{\"pickle\": \"os.system\"}} is not a node of zero-shard-v1")
    # The control: the payload is live, were it unpickled.
    torch.save(_Payload(marker), tmp_path / "payload.pt")
    torch.load(tmp_path / "payload.pt", weights_only=False)
    assert marker.exists()
    engine.close(), fresh.close()


def test_old_format_is_refused_and_converted_on_request_to_resume_bitwise(tmp_path, capsys):
    engine = _engine()
    _train(engine, range(3))
    new, old, marker = tmp_path / "new", tmp_path / "old", tmp_path / "ran"
    client = {"step": 3, "rng": torch.get_rng_state()}
    engine.save_checkpoint(new, client_state=client)
    _save_old_format(engine, old, client)
    expected = _train(engine, range(3, 5))
    final = engine.full_state_dict()

    fresh = _engine(seed=1)
    trap = tmp_path / "trap"  # an old-format checkpoint that runs a command when unpickled, checksums matching
    _save_old_format(fresh, trap, {"step": _Payload(marker)})
    for load in (fresh.load_checkpoint, zero.open_checkpoint, functools.partial(zero.verify_checkpoint, fresh)):
        assert _refusal(load, trap, marker, LegacyCheckpointError) == (
            f"{trap / 'rank00000.pt'}: a checkpoint of the old pickle format, which is never loaded (unpickling runs "
            "whatever code the file carries); if you trust where it came from, convert it once with `python -m "
            f"zero.state.convert {trap}`")

    # The conversion checks the shards' checksums before it unpickles anything.
    hostile = tmp_path / "hostile"
    shutil.copytree(old, hostile)
    torch.save({"engine": _Payload(marker)}, hostile / "rank00000.pt")
    assert convert([str(hostile)]) == 2
    assert f"error: {hostile / 'rank00000.pt'}: " in capsys.readouterr().err and not marker.exists()
    # A value the new format cannot hold stops it by name, the old checkpoint as it was.
    odd = tmp_path / "odd"
    _save_old_format(fresh, odd, {"where": PurePosixPath("data")})
    before = {p.name: p.read_bytes() for p in odd.iterdir()}
    assert convert([str(odd)]) == 2
    assert "state['client_state']['where']: a pathlib.PurePosixPath cannot be stored" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in odd.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hostile", "new", "odd", "old", "trap"]

    assert convert([str(tmp_path / "old")]) == 0
    assert capsys.readouterr().out.startswith(WARNING)
    assert sorted(p.name for p in old.iterdir()) == ["meta.json", "rank00000.safetensors"]
    # Byte for byte what the new format wrote for the same state, and it resumes the same.
    assert (old / "rank00000.safetensors").read_bytes() == (new / "rank00000.safetensors").read_bytes()
    assert json.loads((old / "meta.json").read_text()) == json.loads((new / "meta.json").read_text())
    for path in (new, old):
        resumed = _engine(seed=2)
        _assert_same(resumed.load_checkpoint(path), client)
        assert _train(resumed, range(3, 5)) == expected
        for name, value in resumed.full_state_dict().items():
            assert torch.equal(value, final[name]), (path, name)
        resumed.close()
    engine.close(), fresh.close()


def test_recipe_refuses_a_crafted_or_old_checkpoint_and_resumes_a_converted_one(tmp_path, capsys):
    from recipes.pretrain import train
    from tests.recipes.test_pretrain import _cfg, _losses

    run, marker = tmp_path / "run", tmp_path / "ran"
    train(_cfg(run, "train.steps=2"))
    ckpt = run / "checkpoints" / "step_0000002"
    untouched = tmp_path / "untouched"
    shutil.copytree(run, untouched, ignore=shutil.ignore_patterns("wandb", ".lock"))
    state = shardfile.load(ckpt / "rank00000.safetensors")

    # As reported: a shard that runs a command on load, its checksum updated; the run resumed and ran it.
    shard = ckpt / "rank00000.safetensors"
    shard.unlink()  # (`state` keeps its mapping of the original)
    torch.save({**state, "client_state": _Payload(marker)}, shard)
    _match_meta(ckpt, shard)
    message = _refusal(train, _cfg(run, "train.steps=3"), marker)
    assert message.startswith(f"none of the 1 checkpoints in {run / 'checkpoints'} can be loaded (newest: {shard}: "
                              "not a safetensors file")

    # The same checkpoint in the old format: refused with the command, converted by it, then resumed.
    shard.unlink()
    torch.save(state, ckpt / "rank00000.pt")
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["format"] = "zero-checkpoint-v2"
    (ckpt / "meta.json").write_text(json.dumps(meta))
    _match_meta(ckpt, ckpt / "rank00000.pt")
    message = _refusal(train, _cfg(run, "train.steps=3"), marker, LegacyCheckpointError)
    assert message.endswith(f"python -m zero.state.convert {ckpt}`")
    assert convert([str(run)]) == 0  # a run directory: every old checkpoint under it
    assert f"converted {ckpt}: 1 shard(s)" in capsys.readouterr().out
    train(_cfg(run, "train.steps=3"))
    train(_cfg(untouched, "train.steps=3"))
    assert _losses(run) == _losses(untouched) and len(_losses(run)) == 3


def test_lightning_hyperparameters_in_an_omegaconf_container_are_stored_as_plain_data(tmp_path):
    pytest.importorskip("lightning")
    from lightning.pytorch.core.saving import _convert_loaded_hparams
    from moe_lst.integrations.lightning import _plain_hparams
    from omegaconf import DictConfig, OmegaConf

    # What Lightning's dump_checkpoint puts beside the loops and callbacks for hparams saved from a Hydra config.
    hparams = OmegaConf.create({"model": {"dim": 64, "name": "${run}"}, "run": "tiny", "betas": [0.9, 0.95]})
    state = {"epoch": 1, "hyper_parameters": hparams, "hparams_type": DictConfig}
    with open(tmp_path / "raw", "wb") as f, pytest.raises(shardfile.ShardFormatError,
                                                           match=r"^state\['hyper_parameters'\]: a omegaconf"):
        shardfile.dump(state, f)
    with open(tmp_path / "s", "wb") as f:
        shardfile.dump(_plain_hparams(state), f)
    back = shardfile.load(tmp_path / "s")
    assert back == {"epoch": 1, "hyper_parameters": {"model": {"dim": 64, "name": "${run}"}, "run": "tiny",
                                                     "betas": [0.9, 0.95]},
                    "hparams_type": "omegaconf.dictconfig.DictConfig"}
    assert _convert_loaded_hparams(back["hyper_parameters"], back["hparams_type"])["model"]["dim"] == 64
    assert state["hyper_parameters"] is hparams  # Lightning's own dict is left as it was
