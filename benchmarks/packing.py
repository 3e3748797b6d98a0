"""Packed documents at long context: peak memory and step time of one training step over a 65,536-token row that
holds many documents (position ids restarting per document: attention stays inside each), against the same row
as one document.

Model: the recipe's Llama, dim 256, 2 layers, 8 heads / 4 KV heads, a 32k vocabulary, with activation
checkpointing, tiled MLP and tiled loss (the long-context setup); dense attention (SDPA; packed: one call per
document, only the diagonal blocks) and sliding-window block-sparse attention (block 128, 4 blocks). Documents:
lengths drawn from a log-normal (median 1,500 tokens, seed 0) until the row is full, the last one cut. Each
variant is one step (forward, backward, AdamW) in a fresh process, after one warm-up step at a short length;
peak memory is that process's VmHWM less its RSS before the measured step. The goal: packed within 10% of the
unpacked peak (no [seq, seq] mask is ever built).

    python benchmarks/packing.py            # 65,536 tokens
    python benchmarks/packing.py --quick    # 1,024 tokens: a smoke run
    python benchmarks/packing.py --attention sparse   # one attention only
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if not __package__:  # run as a file: the repository root leads sys.path, not this folder (its zero.py)
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from benchmarks import common  # noqa: E402

ATTENTIONS = {"dense": {}, "sparse": {"sparse": {"layout": "sliding_window", "block_size": 128, "window_blocks": 4}}}


def document_lengths(seq: int, median: int = 1500, seed: int = 0) -> list[int]:
    """Log-normal document lengths (at least 1 token) filling `seq` tokens, the last one cut to fit."""
    import numpy as np

    rng = np.random.default_rng(seed)
    lengths, total = [], 0
    while total < seq:
        n = max(1, int(rng.lognormal(np.log(median), 1.0)))
        n = min(n, seq - total)
        lengths.append(n)
        total += n
    return lengths


def _model(attention: str, seq: int):
    import torch
    from moe_lst.models.llama import Transformer
    from moe_lst.models.llama.model import ModelConfig
    from sequence_parallel import apply_activation_checkpointing, apply_tiled_mlp

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=32000, dim=256, n_layers=2, n_heads=8, n_kv_heads=4, max_seq_len=seq,
                      attention=attention, **ATTENTIONS[attention])
    model = Transformer(cfg)
    apply_tiled_mlp(model, tile_size=4096)
    apply_activation_checkpointing(model)
    return model


def _batch(seq: int, packed: bool):
    import torch
    from moe_lst.kernels.documents import positions_from_starts

    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 32000, (1, seq + 1), generator=gen)
    starts = torch.zeros(1, seq + 1, dtype=torch.bool)
    starts[0, 0] = True
    if packed:
        offsets = torch.tensor(document_lengths(seq)).cumsum(0)
        starts[0, offsets] = True  # (the last offset is the label past the row: it starts the next document)
    labels = tokens[:, 1:].masked_fill(starts[:, 1:], -100)
    return tokens[:, :-1], labels, positions_from_starts(starts[:, :-1])


def _step(model, optimizer, tokens, labels, positions, packed: bool) -> float:
    from sequence_parallel import tiled_cross_entropy

    hidden = model.forward_hidden(tokens, positions, packed=packed)
    loss_sum, count = tiled_cross_entropy(hidden.flatten(0, 1), model.output_weight, labels.flatten(),
                                          tile_size=4096)
    loss = loss_sum / count
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def probe(attention: str, packed: bool, seq: int) -> dict:
    """One measured training step in this (fresh) process."""
    import torch

    model = _model(attention, seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    _step(model, optimizer, *_batch(512, packed=False), packed=False)  # warm-up: AdamW state, kernels, allocator
    batch = _batch(seq, packed)
    before = common.reset_peak_rss()
    t0 = time.perf_counter()
    loss = _step(model, optimizer, *batch, packed=packed)
    return {"seconds": time.perf_counter() - t0, "peak_mb": common.peak_rss_mb() - before, "loss": loss,
            "documents": len(set(batch[2][0].eq(0).nonzero().flatten().tolist()))}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=65536, help="tokens in the row (default 65,536)")
    parser.add_argument("--quick", action="store_true", help="1,024 tokens: a smoke run")
    parser.add_argument("--attention", choices=[*ATTENTIONS, "all"], default="all", help="which attention to run")
    args = parser.parse_args(argv)
    chosen = list(ATTENTIONS) if args.attention == "all" else [args.attention]
    seq = 1024 if args.quick else args.seq
    common.quick_mode(args.quick, "moe_lst.models.llama", "sequence_parallel")
    print(f"packing: one {seq:,}-token row, {len(document_lengths(seq))} documents when packed; load average "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    rows, out = [], {}
    for attention in chosen:
        for packed in (False, True):
            name = f"{attention} {'packed' if packed else 'one document'}"
            try:
                out[name] = r = common.spawn(probe, attention, packed, seq, timeout=3600)[0]
            except Exception as e:  # noqa: BLE001 - said by common.failed; the other variants still run
                common.failed(name, e)
                continue
            rows.append([attention, "packed" if packed else "one document", str(r["documents"]),
                         common.fmt(r["seconds"]), common.fmt(r["peak_mb"], ".0f"), common.fmt(r["loss"], ".4f")])
    print(common.table(["attention", "row", "documents", "step s", "peak MB above start", "loss"], rows))
    for attention in chosen:
        one, packed = out.get(f"{attention} one document"), out.get(f"{attention} packed")
        if one and packed:
            common.print_ratio(f"{attention} peak memory, packed / one document", packed["peak_mb"] / one["peak_mb"],
                               f"goal {common.verdict(packed['peak_mb'] / one['peak_mb'], 1.10)}")
            common.print_ratio(f"{attention} step time, packed / one document", packed["seconds"] / one["seconds"])
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    common.finish()
    return out


if __name__ == "__main__":
    main()
