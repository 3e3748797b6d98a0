"""The streams of a `data` config: the kind it names (stdlib, bin, tokenized, mixture) opened and checked."""

from __future__ import annotations

from .format import DataError
from .mixture import mixture_streams
from .streams import (
    VAL_SEED_OFFSET,
    BatchSpec,
    TokenStream,
    check_token_ids,
    load_bin,
    stdlib_corpus,
    tokenized_streams,
)


def build_streams(data_cfg, spec: BatchSpec, seed: int, vocab_size: int):
    """(train, val) streams for a `data` config (the recipe's data group; any mapping with its keys): `kind`
    stdlib, bin, tokenized or mixture (moe_lst.data.mixture)."""
    kind = data_cfg.get("kind", "stdlib")
    if kind == "stdlib":
        if vocab_size < 256:
            raise DataError(f"the byte-level stdlib corpus needs model.vocab_size >= 256, got {vocab_size}")
        train, val = stdlib_corpus(data_cfg.get("max_bytes"))
    elif kind == "bin":
        train = load_bin(data_cfg["train_path"], data_cfg["dtype"])
        val = load_bin(data_cfg["val_path"], data_cfg["dtype"])
        for name, tokens in (("data.train_path", train), ("data.val_path", val)):
            check_token_ids(tokens, vocab_size, f"{name}={data_cfg[name.split('.')[1]]!r}")
    elif kind == "tokenized":
        return tokenized_streams(data_cfg["path"], spec, seed, vocab_size, data_cfg.get("packing", "document"))
    elif kind == "mixture":
        return mixture_streams(data_cfg, spec, seed, vocab_size)
    else:
        raise DataError(f"data.kind={kind!r} is unknown; use 'stdlib', 'bin', 'tokenized' or 'mixture'")
    return TokenStream(train, spec, seed, vocab_size), TokenStream(val, spec, seed + VAL_SEED_OFFSET, vocab_size)
