"""The on-disk format of a prepared corpus: what `python -m recipes.prepare_data` writes and every reader checks.

One module that the writer and the readers both import, so the two cannot drift. A prepared directory holds, per
split, a token shard and a document index in one of two layouts (meta.json's `format` says which):

- `moe-lst-tokenized` (the default): SPLIT.bin, the token ids back to back (little-endian uint16 or uint32), and
  SPLIT.idx, little-endian uint64 token offsets of each document's start, then the split's length;
- `megatron-indexed`: SPLIT_text_document.bin / .idx, Megatron-LM's indexed dataset (moe_lst.data.megatron).

meta.json, written last, is what makes a preparation complete.
"""

from __future__ import annotations

import numpy as np

FORMAT = "moe-lst-tokenized"
MEGATRON_FORMAT = "megatron-indexed"
FORMATS = (FORMAT, MEGATRON_FORMAT)
FORMAT_VERSION = 1
META = "meta.json"
SPLITS = ("train", "val")
PARTIAL = ".partial"  # suffix of the files of a preparation in progress (never read as data)
INDEX_DTYPE = np.dtype("<u8")  # document start offsets, in tokens
TOKEN_DTYPES = ("uint16", "uint32")


class DataError(ValueError):
    """A data file or data setting that cannot be used; the message names it, the rule and the fix."""


def shard_name(split: str) -> str:
    return f"{split}.bin"


def index_name(split: str) -> str:
    return f"{split}.idx"


def megatron_prefix(split: str) -> str:
    """The file prefix of a split written in Megatron's layout (Megatron's preprocess_data names its outputs
    PREFIX_text_document.bin / .idx)."""
    return f"{split}_text_document"


def split_files(split: str, fmt: str = FORMAT) -> tuple[str, str]:
    """The (token shard, index) file names of `split` in format `fmt`."""
    if fmt == MEGATRON_FORMAT:
        return f"{megatron_prefix(split)}.bin", f"{megatron_prefix(split)}.idx"
    return shard_name(split), index_name(split)


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (vocab_size <= 65,536), else uint32."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")
