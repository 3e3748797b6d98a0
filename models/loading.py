"""Streaming loads of a safetensors model directory: each rank reads only the bytes of the slices it keeps.

A `Checkpoint` is a directory of one `model.safetensors` or shards named by `model.safetensors.index.json`. It is
checked whole before anything is read or built (every shard present and long enough for the tensors its header
places, every tensor the model needs named, each of the shape and a floating dtype the model expects), each problem
refused in one line naming the tensor and the file. A family says how its parameters are made of the file's
tensors (`Source`: a box of the parameter taken from a tensor, its axes perhaps permuted, its rows perhaps
reordered); `Checkpoint.reader` then answers "elements [start, stop) of this rank's local parameter" (its tp / ep
slice, described by its `zero.Placement`) with reads (pread, not a memory map: see `read_box`) of exactly those
elements, converted to fp32: what the engine asks of it is a stage-3 shard, or the whole local slice of a resident
bucket.
`bytes_read` counts the headers and every byte the slices return.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from zero.plan import Placement

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
#: safetensors dtype names of the floating tensors a model's weights may be stored in, and their sizes.
FLOAT_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
_TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_DTYPE_SIZES = {**FLOAT_DTYPES, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1,
                "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


class CheckpointError(ValueError):
    """A model directory that cannot be loaded into the run's model; the message names the tensor and file."""


@dataclass(frozen=True)
class Source:
    """Part of a parameter that lies in one file tensor: the parameter's box at `start` of `size` equals the file
    tensor `name` with its axes taken by `axes` (axes[d] is the file axis of the parameter's dim d, None for a dim
    of size 1 the file tensor lacks, e.g. one expert of a stacked weight), and when `rows` is given, the box's row
    i (dim 0) is the file's row rows[i] (a per-head reordering)."""

    name: str
    start: tuple[int, ...]
    size: tuple[int, ...]
    axes: tuple[int | None, ...]
    rows: tuple[int, ...] | None = None

    def file_shape(self) -> tuple[int, ...]:
        """The shape the file tensor must have."""
        shape = [0] * sum(a is not None for a in self.axes)
        for d, a in enumerate(self.axes):
            if a is not None:
                shape[a] = self.size[d]
        return tuple(shape)


@dataclass
class _File:
    path: Path
    header_bytes: int
    tensors: dict[str, dict]
    handle: int | None = None  # an open file descriptor, once read


@dataclass
class Checkpoint:
    """A safetensors model directory whose headers have been read and checked (see the module docstring)."""

    directory: Path
    files: dict[str, _File]
    where: dict[str, str]  # tensor name -> file name
    bytes_read: int = 0  # headers and data
    data_bytes_read: int = 0
    reads: int = 0
    _headers_counted: set = field(default_factory=set)

    # ------------------------------------------------------------------ opening and checking
    @staticmethod
    def open(directory: str | Path) -> Checkpoint:
        """Read and check the index (if any) and every shard's header: a shard the index names that is absent, a
        shard too short for its header's tensors, a header that does not parse, are refused in one line."""
        directory = Path(directory)
        if not directory.is_dir():
            raise CheckpointError(f"{directory} is not a directory (a model directory holds config.json and "
                                  f"{SINGLE} or shards named by {INDEX})")
        index = directory / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: not a shard index ({type(e).__name__}: {e}); it must hold a "
                                      "weight_map of tensor name -> shard file") from None
            names = sorted(set(weight_map.values()))
        elif (directory / SINGLE).is_file():
            weight_map, names = None, [SINGLE]
        else:
            raise CheckpointError(f"{directory} holds neither {SINGLE} nor {INDEX}; point train.init_from at a "
                                  "model directory as save_pretrained or python -m recipes.export writes")
        files = {name: _read_header(directory, name, index if weight_map is not None else None) for name in names}
        where: dict[str, str] = {}
        for name, f in files.items():
            for t in f.tensors:
                where[t] = name
        if weight_map is not None:
            for t, name in weight_map.items():
                if t not in files[name].tensors:
                    raise CheckpointError(f"{index} places tensor {t} in {name}, whose header does not hold it; "
                                          "the index and its shards do not belong together")
            where = {t: where[t] for t in weight_map}  # (a shard's tensor the index leaves out is not the model's)
        return Checkpoint(directory, files, where)

    def check(self, sources: Mapping[str, list[Source]], index_named: bool | None = None) -> None:
        """Every file tensor `sources` needs is there, of the shape they imply and a floating dtype."""
        described = INDEX if (self.directory / INDEX).is_file() else SINGLE
        for param, parts in sources.items():
            for s in parts:
                if s.name not in self.where:
                    raise CheckpointError(f"{self.directory}: tensor {s.name} (for {param}) is missing from "
                                          f"{described}; the directory does not hold the run's model")
                info = self.files[self.where[s.name]].tensors[s.name]
                shape, dtype = tuple(info["shape"]), info["dtype"]
                if shape != s.file_shape():
                    raise CheckpointError(f"{self.directory / self.where[s.name]}: tensor {s.name} has shape "
                                          f"{list(shape)} where the run's model needs {list(s.file_shape())} (for "
                                          f"{param}); the directory holds another model")
                if dtype not in FLOAT_DTYPES:
                    raise CheckpointError(f"{self.directory / self.where[s.name]}: tensor {s.name} is {dtype}, not "
                                          f"a floating dtype ({', '.join(FLOAT_DTYPES)}); it cannot give {param} "
                                          "its values")

    def header_bytes(self) -> int:
        return sum(f.header_bytes for f in self.files.values())

    # ------------------------------------------------------------------ reading
    def _fd(self, f: _File) -> int:
        if f.handle is None:
            f.handle = os.open(f.path, os.O_RDONLY)
            self.bytes_read += f.header_bytes  # (a file's header counts once, as the first read of it)
        return f.handle

    def read_box(self, name: str, start: tuple[int, ...], size: tuple[int, ...]) -> torch.Tensor:
        """The file tensor's box (start, size), as stored (its dtype), read with pread(2) in contiguous runs: not
        through a memory map, whose touched pages would stay resident (counted in the process's RSS) until the file
        is closed, i.e. a rank's whole share of the checkpoint by the end of its load."""
        f = self.files[self.where[name]]
        info = f.tensors[name]
        shape, item = info["shape"], FLOAT_DTYPES[info["dtype"]]
        out = torch.empty(tuple(size), dtype=_TORCH_DTYPES[info["dtype"]])
        if out.numel():
            inner = len(shape)  # dims inner.. are whole: each run is one index of the dims before inner - 1
            while inner > 0 and start[inner - 1] == 0 and size[inner - 1] == shape[inner - 1]:
                inner -= 1
            strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
            run = out.numel() if inner == 0 else size[inner - 1] * strides[inner - 1]
            outer = itertools.product(*(range(a, a + n) for a, n in zip(start[: max(inner - 1, 0)],
                                                                        size[: max(inner - 1, 0)])))
            buf = out.view(-1).view(torch.uint8).numpy()
            fd, base, pos = self._fd(f), f.header_bytes + info["data_offsets"][0], 0
            for index in outer:
                element = sum(i * st for i, st in zip((*index, *start[inner - 1: inner]), strides))
                self._pread(fd, buf[pos: pos + run * item], base + element * item, f.path, name)
                pos += run * item
        self.bytes_read += out.numel() * item
        self.data_bytes_read += out.numel() * item
        self.reads += 1
        return out

    @staticmethod
    def _pread(fd: int, into, offset: int, path: Path, name: str) -> None:
        view = memoryview(into)
        while len(view):
            got = os.preadv(fd, [view], offset)
            if got <= 0:
                raise CheckpointError(f"{path} ended while reading tensor {name}: the file was truncated after it "
                                      "was opened; copy the shard again")
            view, offset = view[got:], offset + got

    def close(self) -> None:
        for f in self.files.values():
            if f.handle is not None:
                os.close(f.handle)
                f.handle = None

    def reader(self, sources: Mapping[str, list[Source]], placements: Mapping[str, Placement],
               shapes: Mapping[str, tuple[int, ...]]) -> Callable[[str, int, int], torch.Tensor]:
        """read(name, start, stop): elements [start, stop) of this rank's local parameter `name` (its placement's
        local tensor, flattened; the whole parameter of `shapes` where it has none), fp32 on the CPU."""

        def read(name: str, start: int, stop: int) -> torch.Tensor:
            placement = placements.get(name) or Placement.whole(shapes[name])
            out = []
            for lstart, lsize in flat_boxes(placement.local_shape, start, stop):
                box = torch.empty(lsize, dtype=torch.float32)
                for piece in placement.pieces:
                    lo = [max(a, b) for a, b in zip(lstart, piece.local)]
                    hi = [min(a + s, b + t) for a, s, b, t in zip(lstart, lsize, piece.local, piece.size)]
                    if any(a >= b for a, b in zip(lo, hi)):
                        continue
                    gstart = tuple(g + a - p for g, a, p in zip(piece.start, lo, piece.local))
                    gsize = tuple(b - a for a, b in zip(lo, hi))
                    target = box[tuple(slice(a - s, b - s) for a, b, s in zip(lo, hi, lstart))]
                    self._fill_global(sources[name], gstart, gsize, target)
                out.append(box.reshape(-1))
            return out[0] if len(out) == 1 else torch.cat(out) if out else torch.empty(0)

        return read

    def read_whole(self, parts: list[Source], shape: tuple[int, ...]) -> torch.Tensor:
        """The whole tensor of `shape` that `parts` make, fp32 on the CPU."""
        out = torch.empty(shape, dtype=torch.float32)
        self._fill_global(parts, (0,) * len(shape), shape, out)
        return out

    def _fill_global(self, parts: list[Source], gstart, gsize, target: torch.Tensor) -> None:
        """Write the parameter's global box (gstart, gsize) into `target` from the file tensors of `parts`."""
        for s in parts:
            lo = [max(a, b) for a, b in zip(gstart, s.start)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(gstart, gsize, s.start, s.size)]
            if any(a >= b for a, b in zip(lo, hi)):
                continue
            rel = [a - b for a, b in zip(lo, s.start)]
            dst = target[tuple(slice(a - g, b - g) for a, b, g in zip(lo, hi, gstart))]
            if s.rows is None:
                dst.copy_(self._read_part(s, rel, [b - a for a, b in zip(lo, hi)]))
                continue
            # Rows reordered (dim 0): read the file rows in sorted runs, then put each where it belongs.
            wanted = torch.tensor(s.rows[rel[0]: rel[0] + hi[0] - lo[0]])
            order = torch.argsort(wanted)
            ordered = wanted[order].tolist()
            i = 0
            while i < len(ordered):
                j = i
                while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
                    j += 1
                values = self._read_part(s, [ordered[i]] + rel[1:], [j - i + 1] + [b - a for a, b in
                                                                                    zip(lo[1:], hi[1:])])
                dst[order[i: j + 1]] = values
                i = j + 1

    def _read_part(self, s: Source, rel: list[int], size: list[int]) -> torch.Tensor:
        """The parameter-ordered box (rel, size) of source `s` (relative to its start), read from its file
        tensor and converted to fp32."""
        fdims = len(s.file_shape())
        fstart, fsize = [0] * fdims, [0] * fdims
        for d, a in enumerate(s.axes):
            if a is not None:
                fstart[a], fsize[a] = rel[d], size[d]
        t = self.read_box(s.name, tuple(fstart), tuple(fsize)).to(torch.float32)
        kept = [a for a in s.axes if a is not None]
        t = t.permute(*kept) if kept != sorted(kept) else t
        for d, a in enumerate(s.axes):
            if a is None:
                t = t.unsqueeze(d)
        return t


def _read_header(directory: Path, name: str, index: Path | None) -> _File:
    path = directory / name
    if not path.is_file():
        raise CheckpointError(f"shard {name} named by {index} is missing from {directory}; copy it there or point "
                              "train.init_from at a complete model directory")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path} is truncated: {size} bytes, not even a safetensors header length")
        n = struct.unpack("<Q", head)[0]
        if 8 + n > size:
            raise CheckpointError(f"{path} is truncated: its header needs {8 + n} bytes but the file holds {size}")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise CheckpointError(f"{path}: its safetensors header does not parse ({e})") from None
    header.pop("__metadata__", None)
    end = 0
    for t, info in header.items():
        count = math.prod(info["shape"])
        lo, hi = info["data_offsets"]
        if hi - lo != count * _DTYPE_SIZES.get(info["dtype"], 0):
            raise CheckpointError(f"{path}: tensor {t}'s byte range ({hi - lo} bytes) does not match its shape "
                                  f"{info['shape']} in {info['dtype']}")
        end = max(end, hi)
    if 8 + n + end > size:
        last = max(header, key=lambda t: header[t]["data_offsets"][1])
        raise CheckpointError(f"{path} is truncated: its header places tensor {last} up to byte {8 + n + end} but "
                              f"the file holds {size} bytes; copy the shard again")
    return _File(path, 8 + n, header)


def flat_boxes(shape: tuple[int, ...], start: int, stop: int) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Boxes (start, size) of a tensor of `shape` that cover its flat (row-major) elements [start, stop), in
    order, each contiguous in that order."""
    if start >= stop:
        return
    if len(shape) <= 1:
        yield (start,), (stop - start,)
        return
    inner = math.prod(shape[1:])
    first, last = start // inner, (stop - 1) // inner
    if first == last:
        for s, z in flat_boxes(shape[1:], start - first * inner, stop - first * inner):
            yield (first, *s), (1, *z)
        return
    if start % inner:
        for s, z in flat_boxes(shape[1:], start % inner, inner):
            yield (first, *s), (1, *z)
        first += 1
    whole_end = stop // inner
    if whole_end > first:
        yield (first,) + (0,) * (len(shape) - 1), (whole_end - first, *shape[1:])
    if stop % inner:
        for s, z in flat_boxes(shape[1:], 0, stop % inner):
            yield (whole_end, *s), (1, *z)


def identity_sources(shapes: Mapping[str, tuple[int, ...]], names: Mapping[str, str] | None = None
                     ) -> dict[str, list[Source]]:
    """Each parameter is the file tensor of the same (or the mapped) name, as it is."""
    names = names or {}
    return {n: [Source(names.get(n, n), (0,) * len(s), tuple(s), tuple(range(len(s))))] for n, s in shapes.items()}


@dataclass
class StreamingWeights:
    """train.init_from's weights, not yet read: a checked Checkpoint and how each parameter is made of its tensors.
    `load_into(engine)` reads, on each rank, only the elements that rank keeps (Engine.load_parameters)."""

    checkpoint: Checkpoint
    sources: dict[str, list[Source]]
    #: The model's persistent buffers the directory holds (whole on every rank that holds them, e.g. a router's
    #: correction bias): read whole into the module's buffers after the parameters.
    buffers: dict[str, list[Source]] = field(default_factory=dict)

    def load_into(self, engine) -> None:
        shapes = {n: tuple(p.shape) for n, p in engine.module.named_parameters()}
        try:
            engine.load_parameters(self.checkpoint.reader(self.sources, engine.placements, shapes))
            held = dict(engine.module.named_buffers())
            for name, parts in self.buffers.items():
                if name not in held:  # (on another pipeline stage)
                    continue
                target = held[name]
                if tuple(target.shape) != parts[0].size:
                    raise CheckpointError(f"{self.checkpoint.directory}: buffer {name} is {list(parts[0].size)} "
                                          f"in the directory but {list(target.shape)} on this rank; a buffer split "
                                          "over ranks is not loaded by train.init_from")
                with torch.no_grad():
                    target.copy_(self.checkpoint.read_whole(parts, tuple(target.shape)))
        finally:
            self.checkpoint.close()


def init_with_placements(model, plans) -> Callable[[str, torch.Tensor], None]:
    """The engine's param_init for a meta-built `model` parallelised by `plans`: each parameter's values, or its
    slice's, from the model's init_parameter (given the parameter's placement where it is split)."""
    from zero.plan import Plan

    placements = Plan.merge(plans).placements

    def init(name: str, tensor: torch.Tensor) -> None:
        if name in placements and not placements[name].is_whole:
            model.init_parameter(name, tensor, placements[name])
        else:
            model.init_parameter(name, tensor)

    return init


class ShardedWriter:
    """The reverse of a streaming load: tensors added one by one are written into safetensors shards of at most
    `max_shard_bytes` each (a tensor larger than that gets a shard of its own), so no more than one shard's tensors
    are held at a time. `close()` names them as save_pretrained does (`model-0000i-of-0000N.safetensors` with
    `model.safetensors.index.json`, or one `model.safetensors`) and returns the directory."""

    def __init__(self, out_dir: str | Path, max_shard_bytes: int = 5 * 2**30) -> None:
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes={max_shard_bytes} must be positive")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.written: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0
        self.peak_pending_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.pending or any(name in names for _, names in self.written):
            raise ValueError(f"tensor {name} was written already: two parameters export to the same name")
        n = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + n > self.max_shard_bytes:
            self.flush()
        self.pending[name] = tensor.detach().contiguous()
        self.pending_bytes += n
        self.total_bytes += n
        self.peak_pending_bytes = max(self.peak_pending_bytes, self.pending_bytes)

    def flush(self) -> None:
        """Write the tensors added since the last shard into a shard of their own."""
        if not self.pending:
            return
        from moe_lst.models.files import save_safetensors

        path = self.out_dir / f".shard-{len(self.written):05d}.safetensors.partial"
        save_safetensors(self.pending, path, metadata={"format": "pt"})
        self.written.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> Path:
        self.flush()
        for stale in [*self.out_dir.glob("model-*-of-*.safetensors"), self.out_dir / SINGLE, self.out_dir / INDEX]:
            stale.unlink(missing_ok=True)  # (an earlier export's shards into the same directory)
        if len(self.written) == 1:
            self.written[0][0].rename(self.out_dir / SINGLE)
            return self.out_dir
        count, weight_map = len(self.written), {}
        for i, (path, names) in enumerate(self.written, 1):
            final = f"model-{i:05d}-of-{count:05d}.safetensors"
            path.rename(self.out_dir / final)
            weight_map.update({n: final for n in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out_dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return self.out_dir
