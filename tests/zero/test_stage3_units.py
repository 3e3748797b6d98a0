"""ZeRO-3 edge units: the Llama's untied embedding and output head are gather units of their own
(zero.sharding.stage3.edge_units), not the root that stays gathered for the whole forward and backward.

One 2-rank run of a tiny Llama with a large vocabulary (the embedding and the head are each 4x a block):
- the units and the root: the embedding and the head are units, the root holds only the final norm;
- a census of live storages (gathered parameter buffers and full-size gradient buffers, by their storages'
  bytes, not RSS) at every unit's forward and every gradient reduction: the embedding and the head are gathered
  only around their own forward (and the head around its backward), the embedding is not gathered again for
  its backward, and the step's peak stays under the head's weight and gradient plus a few blocks (the root
  design holds both large weights and the head's gradient at once: over it);
- the losses and parameters of 2 ranks equal one process's plain PyTorch loop, with the logits loss, the tiled
  loss (the head's weight read after `forward(return_hidden=True)`) and a forward of the model's parts
  (`forward_hidden`), each of which needs the head's weight gathered outside its own call; every gather and
  gradient reduction takes gloo's paths without a full-size temporary (zero.dist.comm.LEAN_GLOO_BYTES set to 0).
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from moe_lst.models.llama.model import ModelConfig, Transformer

import zero
from sequence_parallel import tiled_cross_entropy
from tests.equivalence import Recorder, assert_equivalent, reference_trajectory
from tests.multirank import run_multirank
from zero.sharding import optimizer

VOCAB, DIM, SEQ, ROWS = 2048, 32, 8, 4
MODES = ("logits", "tiled", "parts")  # one step each


def _model() -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=VOCAB, dim=DIM, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
                      max_seq_len=SEQ, tie_embeddings=False)
    return Transformer(cfg)


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))


def _loss(model, tokens: torch.Tensor, mode: str, before=None) -> torch.Tensor:
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    if mode == "logits":
        return F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
    if mode == "tiled":
        hidden = model(inputs, return_hidden=True)
    else:
        if before is not None:
            before()
        inner = getattr(model, "module", model)
        hidden = inner.forward_hidden(inputs)
    weight = getattr(model, "module", model).output_weight
    loss_sum, count = tiled_cross_entropy(hidden.flatten(0, 1), weight, labels.flatten(), tile_size=5)
    return loss_sum / count


class _Census:
    """Bytes of the storages alive at the watched points: every bucket's gathered buffer and the shard read for its
    gather, and the reducer's full-size gradient buffers (staging, late, and those whose reduction is in flight),
    with the buckets whose gradient buffers are alive."""

    def __init__(self, engine: zero.Engine) -> None:
        self.engine = engine
        self.reducer = engine.zero_optimizer.reducer
        self.samples: list[tuple[str, int, set[str], set[str], int]] = []
        names = {b: ",".join(b.names) for b in engine.buckets}
        self.names = names
        launch = self.reducer._launch

        def watched_launch(progress, flat):
            self.sample(f"reduce {names[progress.bucket]}", extra=[flat])
            return launch(progress, flat)

        self.reducer._launch = watched_launch
        for name, unit in engine.stage3.units:
            unit.register_forward_pre_hook(functools.partial(self._forward, name))  # after the unit's gather

    def _forward(self, name, module, args) -> None:
        if torch._C._current_graph_task_id() == -1:  # (not a recompute in backward)
            self.sample(f"forward {name}")

    def sample(self, where: str, extra=()) -> None:
        storages: dict[int, int] = {}
        gathered = set()
        for b in self.engine.buckets:
            if not b.resident and b.full.untyped_storage().nbytes():
                gathered.add(self.names[b])
                storages[b.full.untyped_storage().data_ptr()] = b.full.untyped_storage().nbytes()
            if b._gather_source is not None:
                storages[b._gather_source.untyped_storage().data_ptr()] = b._gather_source.untyped_storage().nbytes()
        chains = [p for chain in self.reducer.chains.values() for p in chain]
        staged = {self.names[p.bucket] for p in chains if p.staging is not None or p.late is not None}
        staged |= {self.names[item[0].bucket] for item in self.reducer.pending}
        flats = [t for p in chains for t in (p.staging, p.late) if t is not None]
        flats += [item[1] for item in self.reducer.pending] + list(extra)
        for t in flats:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        self.samples.append((where, sum(storages.values()), gathered, staged, len(self.reducer.pending)))


def _run() -> dict:
    from zero.dist import comm

    lean = comm.LEAN_GLOO_BYTES
    comm.LEAN_GLOO_BYTES = 0  # every gather and gradient reduction takes gloo's paths without a full-size temporary
    try:
        return _train()
    finally:
        comm.LEAN_GLOO_BYTES = lean


def _train() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    sgd = functools.partial(torch.optim.SGD, lr=0.5)
    engine = zero.initialize(copy.deepcopy(model), sgd, zero.ZeroConfig(stage=3), zero.ParallelDims(dp=world))
    census = _Census(engine)
    wait_bytes = optimizer.HOST_WAIT_BYTES
    record = Recorder(engine, dist.group.WORLD)
    rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    steps = []
    for step, mode in enumerate(MODES):
        census.samples.clear()
        # the last step treats every gradient buffer as large: each reduction is waited for when launched
        optimizer.HOST_WAIT_BYTES = 0 if step == len(MODES) - 1 else wait_bytes
        loss = _loss(engine, _batch(step)[rows], mode, before=engine.before_forward)
        after_forward = [census.names[b] for b in engine.buckets if not b.resident and b.gathered]
        engine.backward(loss)
        gathered_after = [census.names[b] for b in engine.buckets if not b.resident and b.gathered]
        optimizer.HOST_WAIT_BYTES = wait_bytes
        assert engine.step()
        record.step(loss.item())
        steps.append({"mode": mode, "samples": list(census.samples), "after_forward": after_forward,
                      "gathered_after_backward": gathered_after})
    reference = None
    if rank == 0:
        reference = reference_trajectory(model, sgd(model.parameters()), len(MODES),
                                         lambda m, step: [_loss(m, _batch(step), MODES[step])])
    units = [name for name, _ in engine.layout.unit_modules]
    root = [n for spec in engine.layout.buckets if spec.role == "root" for n in spec.names]
    numel = {n: p.numel() for n, p in model.named_parameters()}
    return {"record": record.result(), "reference": reference, "units": units, "root": root, "steps": steps,
            "numel": numel}


def test_embedding_and_head_are_units_gathered_only_around_their_use() -> None:
    results = run_multirank(_run, 2)
    assert_equivalent([r["record"] for r in results], results[0]["reference"])
    for r in results:
        assert r["units"] == ["tok_embeddings", "layers.0", "layers.1", "output"]
        assert r["root"] == ["norm.weight"]
        numel = r["numel"]
        emb, head = "tok_embeddings.weight", "output.weight"
        block = 4 * sum(n for k, n in numel.items() if k.startswith("layers.0."))
        big = 4 * numel[head]
        assert big >= 4 * block  # the vocabulary makes the embedding and the head dominate
        for step in r["steps"]:
            samples = step["samples"]
            where = [w for w, *_ in samples]
            # reductions in flight at each launch (before it): at most one, none when every buffer counts as large
            in_flight = [n for w, *_, n in samples if w.startswith("reduce")]
            assert max(in_flight) <= (0 if step["mode"] == MODES[-1] else 1), (step["mode"], in_flight)
            # at the embedding's forward: it and the block prefetched beside it, no copy of its shard kept
            nbytes = next(n for w, n, *_ in samples if w == "forward tok_embeddings")
            assert step["mode"] == "parts" or nbytes <= big + 2 * block, (nbytes, big + 2 * block)
            if step["mode"] == "logits":
                # forward: each large unit gathered only at its own call
                for w, _, gathered, *_ in samples:
                    if w.startswith("forward layers."):
                        assert emb not in gathered and head not in gathered, (w, gathered)
                assert "forward output" in where
            else:  # the head is not called: gathered after the forward for the loss that reads its weight
                assert "forward output" not in where
                assert head in step["after_forward"]
            # backward: the blocks reduce with neither large weight gathered, the embedding never re-gathered
            for w, _, gathered, staged, _ in samples:
                if w.startswith("reduce layers."):
                    assert head not in staged, (w, staged)  # the head's gradient reduced and released first
                if w.startswith("reduce layers.") and step["mode"] != "parts":
                    assert emb not in gathered and head not in gathered, (step["mode"], w, gathered)
                if w.startswith("reduce"):
                    assert emb not in gathered or step["mode"] == "parts", (w, gathered)
            assert any(w == f"reduce {emb}" for w in where) and any(w == f"reduce {head}" for w in where)
            # the step's peak: the head's weight and its gradient, plus at most two blocks' buffers and gradients
            # (a forward of the model's parts keeps both large weights gathered, as the root did: not bounded)
            peak = max(nbytes for _, nbytes, *_ in samples)
            assert step["mode"] == "parts" or peak <= 2 * big + 4 * block, (step["mode"], peak, 2 * big + 4 * block)
            assert step["gathered_after_backward"] == []  # nothing stays gathered past backward
