"""The values an eager build draws from the global random generator, for a model built on the meta device.

Modules such as MoE layers take their initial values from torch's global CPU generator as they are built, in
construction order. Built on the meta device they draw nothing; `DrawRecorder` notes every random fill the build
asks for (op, shape, arguments, the scope that asked), and `Replay` later reproduces any one of them, or only the
rows of it a rank keeps, from the generator state an eager build had at that point: so a rank materialises its
slice of an expert weight with the eager build's values without ever holding the whole model.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zero.plan import Placement

_FILLS = {torch.ops.aten.normal_.default: "normal", torch.ops.aten.uniform_.default: "uniform"}
#: Fills are skipped by drawing the same number of 32-bit words in chunks of this many (64 KiB of scratch at a
#: time); a normal fill of fewer than 16 elements (torch's scalar path) by performing it on a scratch tensor.
_SCRATCH = 1 << 14
_active: list[DrawRecorder] = []


@dataclass(frozen=True)
class Draw:
    """One random fill of an eager build: `op` ("normal" | "uniform") of a float32 tensor of `shape` with its two
    arguments (mean, std or low, high), asked for inside `scope`."""

    op: str
    shape: tuple[int, ...]
    args: tuple[float, float]
    scope: str

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


_CONSTANTS = (torch.ops.aten.zero_.default, torch.ops.aten.fill_.Scalar)


@dataclass(frozen=True)
class Fill:
    """How a parameter got its values: draw `index`, then the constants of `patches` written over parts of it."""

    index: int
    patches: tuple[tuple[int, tuple[int, ...], tuple[int, ...], float], ...] = ()

    def apply_patches(self, whole: torch.Tensor) -> None:
        for offset, shape, stride, value in self.patches:
            whole.as_strided(shape, stride, offset).fill_(value)


class DrawRecorder(TorchDispatchMode):
    """Records the global-generator fills of a build (on the meta device: they fill nothing). A seeded op that is
    not a plain normal_ / uniform_ (whose replay is not implemented) is recorded as such and refused on replay."""

    def __init__(self) -> None:
        super().__init__()
        self.draws: list[Draw] = []
        self.scope = ""
        self.start_state = torch.default_generator.get_state()
        #: per storage an op wrote in place (keyed by the storage, kept alive so no other takes its key): the
        #: index of its last fill in `draws`, or -1 when the last write was not a fill (a constant, a copy)
        self.last_write: dict[int, int] = {}
        self.filled: set[int] = set()  # storages that some fill wrote
        #: constants written over part of a storage after its last fill (a padding row zeroed): (storage offset,
        #: shape, stride, value) each
        self.patches: dict[int, list[tuple[int, tuple[int, ...], tuple[int, ...], float]]] = {}
        self._kept: list = []

    def __enter__(self):
        _active.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _active.remove(self)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags and kwargs.get("generator") is None:
            t = args[0]
            op = _FILLS.get(func, f"unsupported:{func}")
            if t.dtype != torch.float32:
                op = f"unsupported:{func} in {t.dtype}"
            names = ("mean", "std") if func is torch.ops.aten.normal_.default else ("from", "to")
            given = list(args[1:3]) + [kwargs[k] for k in names[len(args[1:3]):] if k in kwargs]
            default = (0.0, 1.0)
            values = tuple(float(a) for a in given) + default[len(given):]
            self.draws.append(Draw(op, tuple(t.shape), values, self.scope))
            self._wrote(t, len(self.draws) - 1)
        elif func._schema.is_mutable and args and isinstance(args[0], torch.Tensor):
            t = args[0]
            key = t.untyped_storage()._cdata
            if func in _CONSTANTS and self.last_write.get(key, -1) >= 0:  # (a constant over part of a fill)
                value = 0.0 if func is torch.ops.aten.zero_.default else float(args[1])
                self.patches.setdefault(key, []).append((t.storage_offset(), tuple(t.shape), t.stride(), value))
            else:
                self._wrote(t, -1)
        return func(*args, **kwargs)

    def _wrote(self, t: torch.Tensor, draw: int) -> None:
        s = t.untyped_storage()
        if s._cdata not in self.last_write:
            self._kept.append(s)
        self.last_write[s._cdata] = draw
        self.patches.pop(s._cdata, None)
        if draw >= 0:
            self.filled.add(s._cdata)

    def parameter_fills(self, module: torch.nn.Module) -> dict[str, Fill | None]:
        """Each parameter of `module` (built under this recorder) -> the fill that gave it its values (the last
        write to it was that fill, of its whole shape, perhaps then constants over parts of it), or None where no
        fill wrote it (its values are not random: a constant). NotImplementedError names a parameter that a fill
        and then another write (or a fill of part of it) gave its values: replaying the fill would not give them."""
        out: dict[str, Fill | None] = {}
        for name, p in module.named_parameters():
            key = p.untyped_storage()._cdata
            last = self.last_write.get(key)
            if last is None or (last < 0 and key not in self.filled):
                out[name] = None
            elif last >= 0 and self.draws[last].shape == tuple(p.shape) and p.storage_offset() == 0:
                out[name] = Fill(last, tuple(self.patches.get(key, ())))
            else:
                raise NotImplementedError(f"{name}: its initial values are a random fill changed afterwards (or one "
                                          "of part of it); a meta-device build cannot replay them, build it on a "
                                          "real device")
        return out


@contextlib.contextmanager
def scope(name: str):
    """Tag the fills of the active recorder (if any) with `name` while the block runs."""
    if not _active:
        yield
        return
    rec = _active[-1]
    before, rec.scope = rec.scope, name
    try:
        yield
    finally:
        rec.scope = before


def _box(starts, sizes) -> tuple[slice, ...]:
    return tuple(slice(a, a + s) for a, s in zip(starts, sizes))


def _consumed(draw: Draw) -> int:
    """32-bit words a CPU float32 fill of draw's size takes from the generator (normal: its uniforms, plus 16 for a
    last partial group of 16 that torch redraws)."""
    n = draw.numel
    return n + (16 if draw.op == "normal" and n % 16 else 0)


def _fill(t: torch.Tensor, op: str, args: tuple[float, float], gen: torch.Generator) -> None:
    if op == "normal":
        t.normal_(args[0], args[1], generator=gen)
    else:
        t.uniform_(args[0], args[1], generator=gen)


def _skip_words(gen: torch.Generator, words: int) -> None:
    while words > 0:
        k = min(words, _SCRATCH)
        torch.empty(k).uniform_(generator=gen)
        words -= k


def _skip(gen: torch.Generator, draw: Draw) -> None:
    if draw.op.startswith("unsupported"):
        raise NotImplementedError(f"replaying {draw.op} (drawn in {draw.scope or 'the model'}) is not implemented: "
                                  "only float32 normal_ and uniform_ fills from the global generator replay")
    if draw.op == "normal" and draw.numel < 16:
        _fill(torch.empty(draw.shape), draw.op, draw.args, gen)
    else:
        _skip_words(gen, _consumed(draw))


class Replay:
    """The recorded fills of one build, replayable from the generator state the build started from."""

    def __init__(self, draws: list[Draw], start_state: torch.Tensor) -> None:
        self.draws = draws
        self.start_state = start_state
        self._states: list[torch.Tensor] | None = None
        self._end: torch.Tensor | None = None

    def _walk(self) -> None:
        """The generator state before each fill and after the last (one pass of skips, no model-sized memory)."""
        gen = torch.Generator()
        gen.set_state(self.start_state)
        states = []
        for d in self.draws:
            states.append(gen.get_state())
            _skip(gen, d)
        self._states, self._end = states, gen.get_state()

    def end_state(self) -> torch.Tensor:
        """The global generator's state after an eager build."""
        if self._end is None:
            self._walk()
        return self._end

    def find(self, scope_name: str, shape: tuple[int, ...]) -> int:
        """The fill that gave a parameter of `shape` built in `scope_name` its values: the last normal or uniform
        fill of that shape there (a later fill overwrites an earlier, e.g. a Linear's default init)."""
        hits = [i for i, d in enumerate(self.draws) if d.scope == scope_name and d.shape == tuple(shape)]
        if not hits:
            raise KeyError(f"no random fill of shape {tuple(shape)} was recorded in {scope_name}")
        return hits[-1]

    def values(self, index: int, out: torch.Tensor, placement: Placement | None = None) -> None:
        """Write into `out` fill `index`'s values: the whole tensor, or the local tensor of `placement` cut from
        it. Only the rows of dim 0 the placement covers are drawn when the fill allows (uniform always; normal
        when its size and the row size are multiples of 16, torch's group of Box-Muller pairs)."""
        if self._states is None:
            self._walk()
        d = self.draws[index]
        if tuple(out.shape) != (placement.local_shape if placement is not None else d.shape):
            raise ValueError(f"fill {index} of {d.scope} has shape {d.shape}; cannot fill {tuple(out.shape)}")
        gen = torch.Generator()
        gen.set_state(self._states[index])
        if placement is None or placement.is_whole:
            if out.device.type == "cpu" and out.dtype == torch.float32 and out.is_contiguous():
                _fill(out, d.op, d.args, gen)
            else:
                tmp = torch.empty(d.shape)
                _fill(tmp, d.op, d.args, gen)
                out.copy_(tmp)
            return
        lo = min(p.start[0] for p in placement.pieces)
        hi = max(p.start[0] + p.size[0] for p in placement.pieces)
        row = d.numel // d.shape[0]
        if d.op == "normal" and (d.numel % 16 or row % 16 or d.numel < 16):
            lo, hi = 0, d.shape[0]
        _skip_words(gen, lo * row)
        rows = torch.empty((hi - lo,) + d.shape[1:])
        _fill(rows, d.op, d.args, gen)
        for p in placement.pieces:
            start = (p.start[0] - lo,) + tuple(p.start[1:])
            out[_box(p.local, p.size)] = rows[_box(start, p.size)]


def recorded_build(build: Any) -> tuple[Any, Replay]:
    """`build()` run under a DrawRecorder: (its result, the Replay of its fills)."""
    with DrawRecorder() as rec:
        result = build()
    return result, Replay(rec.draws, rec.start_state)
