"""Under pipeline parallelism each rank holds only its own stages: after the recipe builds a pp=2 run and takes a
step, no tensor alive in the process holds another stage's parameters, and the parameters, gradients, master
weights and optimizer state it does hold add up to its own stages' share of the model.

The sweep finds tensors two ways: every tensor the garbage collector tracks (`gc.get_objects()`), and every
tensor reachable from the run object (model, stages, engine, optimizer state) by walking its attributes."""

from __future__ import annotations

import contextlib
import functools
import gc
import types
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from hydra import compose, initialize_config_dir

from tests.multirank import run_multirank

REPO = Path(__file__).resolve().parents[2]
# Four layers of model=tiny: two per stage. seq_len 24 and 6 rows per step are no parameter's shape, so what the
# sweep counts as parameter-shaped is parameters, their gradients and nothing the step left behind.
RUN = ["model=tiny", "model.n_layers=4", "parallel.pp=2", "zero.stage=1", "train.steps=1", "train.grad_accum=2",
       "train.micro_batch_size=3", "train.seq_len=24", "train.eval_batches=0", "train.sample_tokens=0",
       "train.progress=false", "data.max_bytes=2000000", "wandb.mode=disabled"]
CASES = {  # an untied head: the stages share nothing; MoE layers: built eagerly, the other stage's layers dropped
    "dense_untied": ["model.tie_embeddings=false"],
    "moe_tied": ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.ffn_dim=64", "model.moe.first_dense=1"],
}


def _reachable_tensors(root: object) -> list[torch.Tensor]:
    """Every tensor reachable from `root` through attributes, containers, module parameters, buffers and grads."""
    seen, found, todo = set(), [], [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None), type, types.ModuleType)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
            if obj.grad is not None:
                todo.append(obj.grad)
            continue
        if isinstance(obj, dict):
            todo.extend(obj.keys())
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo.extend(obj)
        elif isinstance(obj, torch.optim.Optimizer):
            todo.extend([obj.state, obj.param_groups])
        elif isinstance(obj, types.MethodType):  # a bound method keeps its object (and what it holds) alive
            todo.append(obj.__self__)
        elif isinstance(obj, functools.partial):
            todo.extend([obj.func, obj.args, obj.keywords])
        elif isinstance(obj, types.FunctionType):
            for cell in obj.__closure__ or ():
                with contextlib.suppress(ValueError):  # (an empty cell)
                    todo.append(cell.cell_contents)
        if isinstance(obj, nn.Module):
            todo.extend(obj.parameters())
            todo.extend(obj.buffers())
        if hasattr(obj, "__dict__"):
            todo.extend(vars(obj).values())
    return found


def _storage(t: torch.Tensor) -> tuple[tuple, int] | None:
    """(key, bytes) of the memory behind `t`; None for meta tensors and storage-less stand-ins."""
    if t.is_meta or t.layout != torch.strided:
        return None
    s = t.untyped_storage()
    return ((s.device.type, s.data_ptr()), s.nbytes()) if s.nbytes() else None


def _measure(extra: list[str], run_dir: str) -> dict:
    from recipes.config import model_config
    from moe_lst.models.llama import Transformer
    from recipes.pretrain import Run
    from zero.dist import comm

    with initialize_config_dir(version_base=None, config_dir=str(REPO / "recipes" / "conf")):
        cfg = compose("config", overrides=[*RUN, *extra, f"run_dir={run_dir}"])
    run = Run(cfg)
    try:
        # This rank's stages start from the values of the whole model built eagerly from the same seed (the recipe
        # builds a dense model's stages on the meta device, an MoE model whole and drops the other stages').
        torch.manual_seed(cfg.train.seed)
        eager = dict(Transformer(model_config(cfg)).named_parameters())
        differ = sorted(n for n, p in run.pipe.module.named_parameters() if not torch.equal(p, eager[n]))
        del eager
        run.loop()  # one step of the recipe's own loop (and its checkpoint)
        whole = dict(Transformer(model_config(cfg), device="meta").named_parameters())
        pipe = run.pipe
        tied = cfg.model.tie_embeddings
        mine = {name for span in pipe.spans for i in span.layers for name in whole if name.startswith(f"layers.{i}.")}
        for span in pipe.spans:
            if span.first or (span.last and tied):
                mine |= {n for n in whole if n.startswith("tok_embeddings.")}
            if span.last:
                mine |= {n for n in whole if n.startswith(("norm.", "output."))}
        stage_params = dict(pipe.module.named_parameters())
        engine = run.engine
        masters = [p for g in engine.optimizer.param_groups for p in g["params"]]  # flat fp32 shards
        own = {id(p) for p in (*stage_params.values(), *masters)}
        gc.collect()
        tensors = {id(t): t for t in [*(o for o in gc.get_objects() if isinstance(o, torch.Tensor)),
                                      *_reachable_tensors(run)]}
        # Parameter objects with storage that are not this rank's stages' (by identity), and by name in the model.
        strays = sorted({n for n, p in run.model.named_parameters(remove_duplicate=False)
                         if id(p) not in own and _storage(p) is not None})
        foreign = [tuple(t.shape) for t in tensors.values()
                   if isinstance(t, nn.Parameter) and id(t) not in own and _storage(t) is not None]
        shapes = {tuple(p.shape) for p in whole.values()}
        param_storages = {}
        for t in tensors.values():
            found = _storage(t)
            if found is not None and tuple(t.shape) in shapes:
                param_storages[found[0]] = found[1]
        state = [t for s in engine.optimizer.state.values() for t in s.values()
                 if isinstance(t, torch.Tensor) and t.dim() > 0]
        return {"differ": differ, "whole": sorted(whole), "mine": sorted(mine), "stage_names": sorted(stage_params),
                "bucket_names": sorted(n for b in engine.buckets for n in b.names),
                "mine_numel": sum(whole[n].numel() for n in mine),
                "other_numel": sum(p.numel() for n, p in whole.items() if n not in mine),
                "bucket_padded": sum(b.padded for b in engine.buckets),
                "strays": strays, "foreign": foreign, "param_bytes": sum(param_storages.values()),
                "master_numel": sum(p.numel() for p in masters), "state_numel": sum(t.numel() for t in state)}
    finally:
        run.logger.finish()
        if run.lock is not None:  # (rank 0 holds it)
            run.lock.close()
        comm.stop_watchdog()


def _measure_cases(run_dir: str) -> dict:
    return {name: _measure(extra, f"{run_dir}/{name}") for name, extra in CASES.items()}


def test_each_pipeline_rank_holds_only_its_own_stage(tmp_path):
    results = run_multirank(_measure_cases, 2, str(tmp_path), timeout=300, fresh=True)  # (gc sees every live tensor)
    for name in CASES:
        ranks = [r[name] for r in results]
        for rank, r in enumerate(ranks):
            label = f"{name} rank {rank}"
            assert r["stage_names"] == r["mine"] and r["bucket_names"] == r["mine"], label
            assert r["differ"] == [], (label, "initial values differ from an eager build's", r["differ"][:5])
            # No parameter of another stage keeps storage: neither in the model by name nor anywhere by identity.
            assert r["strays"] == [] and r["foreign"] == [], (label, r["strays"][:5], r["foreign"][:5])
            # Parameters (flat bucket) and their gradients, both parameter-shaped views: 2 x 4 bytes per own element.
            budget = 2 * 4 * r["bucket_padded"]
            assert 4 * r["mine_numel"] <= r["param_bytes"] <= budget, (label, r["param_bytes"], budget)
            # fp32 master weights and Adam's two moments: this rank's elements only (dp=1: the whole bucket).
            assert r["master_numel"] == r["bucket_padded"] and r["state_numel"] == 2 * r["bucket_padded"], label
        # The two ranks' stages cover the model; only a tied embedding is on both (the head's copy).
        assert set(ranks[0]["mine"]) | set(ranks[1]["mine"]) == set(ranks[0]["whole"]), name
        both = set(ranks[0]["mine"]) & set(ranks[1]["mine"])
        tied = "model.tie_embeddings=false" not in CASES[name]
        assert both == ({"tok_embeddings.weight"} if tied else set()), (name, both)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_stage_materialised_on_the_gpu_gets_the_eager_values():
    """The engine materialises a meta-built stage where it trains (the GPU); an eager build draws its values on
    the CPU and moves them there: init_parameter must give the same values."""
    from moe_lst.models.llama import ModelConfig, Transformer

    torch.manual_seed(0)
    eager = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2))
    for name, p in eager.named_parameters():
        out = torch.empty(p.shape, device="cuda")
        eager.init_parameter(name, out)
        assert torch.equal(out.cpu(), p), name
