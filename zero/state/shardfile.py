"""One checkpoint shard as a file that holds data only: its tensors in safetensors, everything else (nested dicts,
lists, tuples, numbers, strings, None) as a JSON skeleton in the file's header that names the tensors.

Reading a shard parses JSON and maps tensors; nothing is unpickled, so a crafted file can be refused but never
runs code. Tensors come back memory-mapped (safetensors' `safe_open`): a reader touches only the bytes it uses.
Writing streams one tensor at a time (a tensor mapped from an nvme file is never copied whole into memory), and a
`StreamedTensor` (a dtype, a shape and a generator of its values piece by piece) is read from where it lives only
while it is written: a saved state need not exist in memory at once.

The skeleton's nodes: null, booleans, numbers (NaN and infinities as Python's json writes them) and strings stand
for themselves, a JSON list for a list, and every other value is an object with one tag:
`{"dict": {str: node}}`, `{"items": [[key node, node], ...]}` (a dict with keys that are not all strings),
`{"tuple": [...]}`, `{"tensor": key}`, `{"ndarray": key}`, `{"numpy_scalar": key}`, `{"bytes": base64}`,
`{"dtype": "float32"}`, `{"device": "cuda:0"}`, `{"size": [...]}` (torch.Size). A tensor object referenced twice
is stored once and comes back as one object; dict subclasses (OrderedDict, ...) come back as dict, tensor
subclasses (Parameter) as tensors, and every tensor contiguous. Anything else is refused on save by its place in
the state (e.g. `state['client_state']['config']`), so a save never writes what a load could not read back.
"""

from __future__ import annotations

import base64
import ctypes
import enum
import functools
import json
import struct
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

FORMAT = "zero-shard-v1"

# torch dtype -> safetensors dtype name (the ones both sides read)
_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}
# the dtypes a numpy array or scalar is stored with (torch.from_numpy's)
_NUMPY = {d for d in _DTYPES if d not in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)}
_ALLOWED = ("tensors, numpy arrays and scalars, None, bool, int, float, str, bytes, torch dtypes, devices and "
            "sizes, and lists, tuples and dicts of them")


class ShardFormatError(ValueError):
    """A value a shard cannot hold (on save), or a file that is not a shard of this format (on load)."""


class StreamedTensor:
    """A tensor that `dump` writes without it ever being whole in memory: its dtype and shape, and `chunks()`, a
    generator of its elements in order (flat tensors of this dtype, on any device), called once, while the file is
    written. A chunk may reuse the previous chunk's buffer (each is written before the next is asked for). A shard
    reads it back as an ordinary tensor."""

    def __init__(self, dtype: torch.dtype, shape: Sequence[int], chunks: Callable[[], Iterator[torch.Tensor]]) -> None:
        self.dtype, self.shape, self.chunks = dtype, torch.Size(shape), chunks

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def materialize(self) -> torch.Tensor:
        """The whole tensor in memory (CPU): for callers that need one, never for writing a shard."""
        out = torch.empty(self.numel(), dtype=self.dtype)
        start = 0
        for part in self.chunks():
            out[start : start + part.numel()].copy_(part.reshape(-1))
            start += part.numel()
        return out.view(self.shape)


class _Encoder:
    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._key_of: dict[int, str] = {}  # id(tensor) -> key: one object stored once

    def _tensor_key(self, t: torch.Tensor | StreamedTensor, where: str, path: str) -> str:
        if id(t) in self._key_of:
            return self._key_of[id(t)]
        if not isinstance(t, StreamedTensor) and (
                t.layout != torch.strided or t.is_quantized or t.device.type == "meta"):
            raise ShardFormatError(f"{where}: a {t.layout} {'quantized ' if t.is_quantized else ''}tensor on "
                                   f"{t.device} cannot be stored; store a dense, materialised tensor (e.g. "
                                   ".to_dense() or .dequantize())")
        if t.dtype not in _DTYPES:
            raise ShardFormatError(f"{where}: tensors of dtype {t.dtype} cannot be stored (supported: "
                                   f"{', '.join(str(d).removeprefix('torch.') for d in _DTYPES)}); convert it")
        key, n = path or "value", 1
        while key in self.tensors:  # a dict key holding "/" may spell another value's path
            key, n = f"{path}#{n}", n + 1
        self.tensors[key] = t
        self._key_of[id(t)] = key
        return key

    def node(self, x: Any, where: str, path: str) -> Any:
        if isinstance(x, enum.Enum):  # before int / str: an IntEnum or StrEnum would silently lose its type
            raise ShardFormatError(f"{where}: {type(x).__name__}.{x.name} (an enum) cannot be stored; store its "
                                   f"value ({x.value!r}) and rebuild the enum when loading")
        if isinstance(x, np.generic):  # before float: np.float64 is a float, and comes back as np.float64
            return {"numpy_scalar": self._array_key(np.asarray(x), where, path)}
        if x is None or type(x) in (bool, int, float, str):
            return x
        if isinstance(x, (torch.Tensor, StreamedTensor)):
            return {"tensor": self._tensor_key(x, where, path)}
        if isinstance(x, np.ndarray):
            return {"ndarray": self._array_key(x, where, path)}
        if isinstance(x, torch.Size):  # before tuple
            return {"size": list(x)}
        if isinstance(x, torch.dtype):
            return {"dtype": str(x).removeprefix("torch.")}
        if isinstance(x, torch.device):
            return {"device": str(x)}
        if isinstance(x, bytes):
            return {"bytes": base64.b64encode(x).decode("ascii")}
        if isinstance(x, list):
            return [self.node(v, f"{where}[{i}]", _join(path, i)) for i, v in enumerate(x)]
        if isinstance(x, tuple):
            return {"tuple": [self.node(v, f"{where}[{i}]", _join(path, i)) for i, v in enumerate(x)]}
        if isinstance(x, dict):
            if all(type(k) is str for k in x):
                return {"dict": {k: self.node(v, f"{where}[{k!r}]", _join(path, k)) for k, v in x.items()}}
            return {"items": [[self._key(k, f"{where} key {k!r}"), self.node(v, f"{where}[{k!r}]", _join(path, k))]
                              for k, v in x.items()]}
        if isinstance(x, (int, float, str)):  # a subclass (not an enum): stored as the plain value
            return next(kind(x) for kind in (int, float, str) if isinstance(x, kind))
        raise ShardFormatError(f"{where}: a {type(x).__module__}.{type(x).__qualname__} cannot be stored in a "
                               f"checkpoint (it holds only {_ALLOWED}); convert it, e.g. to a dict or a string")

    def _key(self, k: Any, where: str) -> Any:
        if isinstance(k, (torch.Tensor, np.ndarray, np.generic)):
            raise ShardFormatError(f"{where}: a {type(k).__name__} as a dict key cannot be stored; use a number or "
                                   "a string")
        return self.node(k, where, "")

    def _array_key(self, a: np.ndarray, where: str, path: str) -> str:
        try:
            t = torch.from_numpy(a if a.flags.c_contiguous else a.copy(order="C"))
        except (TypeError, ValueError) as e:
            raise ShardFormatError(f"{where}: a numpy array of dtype {a.dtype} cannot be stored ({e}); convert "
                                   "it to a numeric dtype or a list") from None
        return self._tensor_key(t, where, path)


def _join(path: str, key: Any) -> str:
    return f"{path}/{key}" if path else str(key)


def encode(obj: Any, name: str = "state") -> tuple[str, dict[str, torch.Tensor | StreamedTensor]]:
    """`obj` as (its JSON skeleton, its tensors by key); raises ShardFormatError naming the first value that
    cannot be stored (`name` begins its place, e.g. `state['client_state']['config']`)."""
    encoder = _Encoder()
    skeleton = encoder.node(obj, name, "")
    return json.dumps(skeleton, separators=(",", ":")), encoder.tensors


class _Decoder:
    def __init__(self, tensor: Callable[[str], torch.Tensor]) -> None:
        self.tensor = tensor
        self.used: dict[str, torch.Tensor] = {}

    def _get(self, key: Any, where: str) -> torch.Tensor:
        if type(key) is not str:
            raise ShardFormatError(f"{where}: a tensor reference must be a string, not {key!r:.60}")
        if key not in self.used:
            self.used[key] = self.tensor(key)
        return self.used[key]

    def node(self, node: Any, where: str) -> Any:
        if node is None or type(node) in (bool, int, float, str):
            return node
        if type(node) is list:
            return [self.node(v, f"{where}[{i}]") for i, v in enumerate(node)]
        if type(node) is not dict or len(node) != 1:
            raise ShardFormatError(f"{where}: {json.dumps(node)[:80]} is not a node of {FORMAT}")
        (tag, value), = node.items()
        if tag == "dict" and type(value) is dict:
            return {k: self.node(v, f"{where}[{k!r}]") for k, v in value.items()}
        if tag == "items" and type(value) is list and all(type(kv) is list and len(kv) == 2 for kv in value):
            out = {}
            for k, v in value:
                key = self.node(k, f"{where} key")
                try:
                    hash(key)
                except TypeError:
                    raise ShardFormatError(f"{where}: key {json.dumps(k)[:60]} is not hashable") from None
                out[key] = self.node(v, f"{where}[{key!r}]")
            return out
        if tag == "tuple" and type(value) is list:
            return tuple(self.node(v, f"{where}[{i}]") for i, v in enumerate(value))
        if tag == "tensor":
            return self._get(value, where)
        if tag in ("ndarray", "numpy_scalar"):
            t = self._get(value, where)
            if t.dtype not in _NUMPY or (tag == "numpy_scalar" and t.dim() != 0):
                raise ShardFormatError(f"{where}: {json.dumps(node)[:80]} names a {t.dtype} tensor of shape "
                                       f"{list(t.shape)}, not a numpy {'scalar' if t.dim() else 'array'}")
            return t.numpy() if tag == "ndarray" else t.numpy()[()]
        if tag == "size" and type(value) is list and all(type(v) is int for v in value):
            return torch.Size(value)
        if tag == "dtype" and type(value) is str and isinstance(getattr(torch, value, None), torch.dtype):
            return getattr(torch, value)
        if tag == "device" and type(value) is str:
            try:
                return torch.device(value)
            except RuntimeError:
                pass
        if tag == "bytes" and type(value) is str:
            try:
                return base64.b64decode(value, validate=True)
            except ValueError:
                pass
        raise ShardFormatError(f"{where}: {json.dumps(node)[:80]} is not a node of {FORMAT}")


def decode(skeleton: str, tensor: Callable[[str], torch.Tensor], name: str = "state") -> tuple[Any, set[str]]:
    """The object `skeleton` describes, its tensors read through `tensor(key)` (each key once), and the keys
    it used."""
    try:
        tree = json.loads(skeleton)
    except ValueError as e:
        raise ShardFormatError(f"its skeleton is not JSON ({e})") from None
    decoder = _Decoder(tensor)
    return decoder.node(tree, name), set(decoder.used)


def _check_byte_order() -> None:
    if sys.byteorder != "little":
        raise NotImplementedError("checkpoint shards are little-endian (safetensors); reading or writing them on a "
                                  "big-endian machine is not implemented")


def dump(obj: Any, f: BinaryIO) -> None:
    """Write `obj` to the binary file `f` as a safetensors file whose header carries the skeleton. Tensors are
    written one at a time from their own memory (moved to the CPU and made contiguous one by one if need be).
    Raises ShardFormatError before writing anything if some value cannot be stored."""
    _check_byte_order()
    skeleton, tensors = encode(obj)
    # Widest elements first: every tensor then starts at a multiple of its element size (the data section starts
    # 8-byte aligned), so a reader can map each one in place.
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header: dict[str, Any] = {"__metadata__": {"format": FORMAT, "skeleton": skeleton}}
    offset = 0
    for key in order:
        t = tensors[key]
        size = t.numel() * t.element_size()
        header[key] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    f.write(struct.pack("<Q", len(text)))
    f.write(text)
    for key in order:
        t = tensors[key]
        if isinstance(t, StreamedTensor):
            _write_streamed(t, key, f)
        elif t.numel():
            # [any shape] -> [bytes]: one write per tensor, straight from its memory when it is a CPU tensor
            f.write(_bytes(t))
            release = getattr(t, "release_after_write", None)
            if release is not None:  # e.g. a tensor mapped from a file drops the pages the write touched
                release()


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()


def _write_streamed(t: StreamedTensor, key: str, f: BinaryIO) -> None:
    """Write `t`'s chunks one after the other (each dropped before the next is produced); its header entry
    promised numel x element_size bytes, so any other count is an error, not a corrupt file."""
    expected, done = t.numel() * t.element_size(), 0
    for part in t.chunks():
        if part.dtype != t.dtype:
            raise ShardFormatError(f"tensor {key!r}: a streamed chunk of dtype {part.dtype}, declared {t.dtype}")
        done += part.numel() * part.element_size()
        if done > expected:
            break
        if part.numel():
            f.write(_bytes(part))
        del part
    if done != expected:
        raise ShardFormatError(f"tensor {key!r}: its chunks hold {'more than ' if done > expected else ''}{done} "
                               f"bytes, its shape {list(t.shape)} of {t.dtype} {expected}")


def _drop_pages(t: torch.Tensor) -> None:
    """Drop from the process the whole pages under `t`, a tensor of a loaded shard (a private, never written
    mapping of the file: a page touched again is read again from the file)."""
    import mmap

    page = mmap.PAGESIZE
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    first, last = -(-start // page) * page, end // page * page
    if last > first:
        _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), mmap.MADV_DONTNEED)


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def done_reading(t: Any) -> None:
    """A reader copied `t` (a tensor of a loaded shard) to where it lives and never uses it again: its file pages
    leave the process, so a load holds one tensor's pages at a time. Never for a tensor something keeps (an
    optimizer state that aliases it) or writes to; a no-op for any other value."""
    release = getattr(t, "release_after_read", None)
    if release is not None:
        release()


def load(path: str | Path) -> Any:
    """The object a shard file holds, its tensors memory-mapped. Raises ShardFormatError (naming the problem, not
    the file) for anything that is not a shard of this format: a pickle, another safetensors file, a skeleton
    with unknown nodes or references to tensors the file lacks."""
    from safetensors import SafetensorError, safe_open

    _check_byte_order()
    try:
        f = safe_open(str(path), framework="pt", device="cpu")
    except SafetensorError as e:
        raise ShardFormatError(f"not a safetensors file ({e})") from None
    with f:
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT or "skeleton" not in meta:
            raise ShardFormatError(f"a safetensors file but not a shard of {FORMAT} (its header's format is "
                                   f"{meta.get('format')!r})")
        keys = set(f.keys())

        def tensor(key: str) -> torch.Tensor:
            if key not in keys:
                raise ShardFormatError(f"its skeleton names tensor {key!r:.80}, which the file does not hold")
            t = f.get_tensor(key)
            t.release_after_read = functools.partial(_drop_pages, t)
            return t

        obj, used = decode(meta["skeleton"], tensor)
    if used != keys:
        extra = sorted(keys - used)
        raise ShardFormatError(f"it holds {len(extra)} tensor(s) its skeleton does not name (e.g. {extra[0]!r:.80})")
    return obj
