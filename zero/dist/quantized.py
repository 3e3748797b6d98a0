"""Block-quantized codecs and the quantized collectives of ZeRO-3 (ZeRO++'s qwZ and qgZ).

A codec turns `[..., n]` fp32 values (n a multiple of `block`) into `[..., bytes]` uint8: `fp32` as is, `bf16`
rounded, `int8` and `int4` as integers with one fp32 scale (the block's absolute maximum over 127, or over 7) per
`block` elements, nearest rounding. The integers travel first, then the scales; int4 packs two values per byte.

The collectives send encoded bytes through `zero.dist.comm`, so its byte counters see what actually travels:

- `all_gather`: every rank encodes its shard, the payloads are all-gathered and each is decoded into its slice of
  the full buffer. Every rank, the shard's owner included, then computes with the same decoded values.
- `reduce_scatter`: every rank encodes its whole gradient, chunk j for rank j, an all-to-all hands rank j every
  rank's chunk j, and rank j decodes and sums them in fp32 in rank order (`sum_chunks`). One hop instead of
  ZeRO++'s two: there is no second quantization of partial sums.

Each returns its work handle when asynchronous; the decoding runs in the handle's `wait()` (exactly once), so the
output is valid after `wait()` as with a plain collective. `round_trip` is what one chunk becomes: a gather hands
every rank each shard's round trip, and rank j's reduced chunk is the rank-ordered sum of every rank's chunk j's
round trips.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.distributed import ProcessGroup

from zero.dist import comm

#: Codecs by name, and the integer range of the two integer ones.
CODECS = ("fp32", "bf16", "int8", "int4")
_LEVELS = {"int8": 127, "int4": 7}


def padded_length(n: int, block: int) -> int:
    """`n` rounded up to whole blocks (the length a codec encodes)."""
    return math.ceil(n / block) * block


def payload_bytes(n: int, codec: str, block: int) -> int:
    """Bytes of the encoding of `n` values (n a multiple of `block`)."""
    if codec == "fp32":
        return 4 * n
    if codec == "bf16":
        return 2 * n
    values = n if codec == "int8" else n // 2
    return values + 4 * (n // block)


def encode(x: torch.Tensor, codec: str, block: int) -> torch.Tensor:
    """[..., n] fp32 -> [..., payload_bytes(n)] uint8 (see the module docstring)."""
    if codec == "fp32":
        return x.float().contiguous().view(torch.uint8)
    if codec == "bf16":
        return x.to(torch.bfloat16).contiguous().view(torch.uint8)
    levels = _LEVELS[codec]
    lead, n = x.shape[:-1], x.shape[-1]
    blocks = x.float().reshape(*lead, n // block, block)
    scales = blocks.abs().amax(-1, keepdim=True) / levels
    q = torch.where(scales > 0, blocks / scales, 0.0).round_().clamp_(-levels, levels)
    if codec == "int8":
        values = q.to(torch.int8).view(*lead, n).view(torch.uint8)
    else:  # two values per byte, each stored as value + 8 in [1, 15]
        u = (q + 8).to(torch.uint8).view(*lead, n // 2, 2)
        values = u[..., 0] * 16 + u[..., 1]
    return torch.cat([values, scales.reshape(*lead, -1).contiguous().view(torch.uint8)], -1)


def decode(payload: torch.Tensor, n: int, codec: str, block: int) -> torch.Tensor:
    """Inverse of `encode`: [..., bytes] uint8 -> [..., n] fp32."""
    payload = payload.clone()  # (aligned for the wider types)
    if codec == "fp32":
        return payload.view(torch.float32)
    if codec == "bf16":
        return payload.view(torch.bfloat16).float()
    lead = payload.shape[:-1]
    width = n if codec == "int8" else n // 2
    if codec == "int8":
        q = payload[..., :width].view(torch.int8).float()
    else:
        packed = payload[..., :width]
        q = torch.stack([packed // 16, packed % 16], -1).view(*lead, n).float() - 8
    scales = payload[..., width:].clone().view(torch.float32).view(*lead, n // block, 1)
    return (q.view(*lead, n // block, block) * scales).view(*lead, n)


def round_trip(x: torch.Tensor, codec: str, block: int) -> torch.Tensor:
    """What `x` ([n], any length) becomes after encoding and decoding, fp32."""
    n = x.numel()
    padded = torch.zeros(padded_length(n, block), dtype=torch.float32, device=x.device)
    padded[:n].copy_(x.reshape(-1))
    return decode(encode(padded, codec, block), padded.numel(), codec, block)[:n]


class _Decoding:
    """The handle of an asynchronous quantized collective: `wait()` waits for the bytes, then decodes once."""

    __slots__ = ("work", "finish")

    def __init__(self, work, finish: Callable[[], None]) -> None:
        self.work, self.finish = work, finish

    def wait(self, *args) -> bool:
        if self.finish is not None:
            self.work.wait(*args)
            finish, self.finish = self.finish, None
            finish()
        return True


def _complete(work, finish: Callable[[], None], async_op: bool):
    if async_op and work is not None:
        return _Decoding(work, finish)
    finish()
    return None


def all_gather(full: torch.Tensor, shard: torch.Tensor, group: ProcessGroup | None, codec: str, block: int,
               async_op: bool = False):
    """All-gather `shard` ([m], any float dtype) from every rank of `group` into `full` ([world * m]), sent
    encoded with `codec`; `full` holds every rank's decoded shard (cast to its dtype)."""
    world, m = comm.group_size(group), shard.numel()
    length = padded_length(m, block)
    x = torch.zeros(length, dtype=torch.float32, device=shard.device)
    x[:m].copy_(shard)
    payload = encode(x, codec, block)
    gathered = torch.empty(world * payload.numel(), dtype=torch.uint8, device=shard.device)
    work = comm.all_gather_into_tensor(gathered, payload, group, async_op=async_op)

    def finish() -> None:  # one shard at a time: the fp32 temporaries stay shard-sized
        rows = full.view(world, m)
        for r, payload_r in enumerate(gathered.view(world, -1)):
            rows[r].copy_(decode(payload_r, length, codec, block)[:m])

    return _complete(work, finish, async_op)


def _encode_chunks(flat: torch.Tensor, world: int, codec: str, block: int) -> torch.Tensor:
    """[world * m] -> [world, payload] uint8: chunk j encoded for rank j (one chunk at a time: the fp32
    temporaries stay chunk-sized)."""
    m = flat.numel() // world
    length = padded_length(m, block)
    out = torch.empty(world, payload_bytes(length, codec, block), dtype=torch.uint8, device=flat.device)
    x = torch.zeros(length, dtype=torch.float32, device=flat.device)
    for j, chunk in enumerate(flat.view(world, m)):
        x[:m].copy_(chunk)
        out[j].copy_(encode(x, codec, block))
    return out


def sum_chunks(received: torch.Tensor, m: int, codec: str, block: int) -> torch.Tensor:
    """[world, payload] uint8, row r from rank r -> their decoded sum, [m] fp32, added in rank order."""
    length = padded_length(m, block)
    out = decode(received[0], length, codec, block)[:m].clone()
    for row in received[1:]:
        out.add_(decode(row, length, codec, block)[:m])
    return out


def reduce_scatter(out: torch.Tensor, flat: torch.Tensor, group: ProcessGroup | None, codec: str, block: int,
                   async_op: bool = False):
    """Sum `flat` ([world * m]) over `group` into this rank's chunk `out` ([m], fp32), every chunk sent encoded
    with `codec` through one all-to-all; the sum is taken in fp32 in rank order."""
    world = comm.group_size(group)
    m = out.numel()
    if flat.numel() != world * m:
        raise ValueError(f"reduce_scatter: {flat.numel()} elements do not split into {world} chunks of {m}")
    payload = _encode_chunks(flat, world, codec, block)
    received = torch.empty_like(payload)
    work = comm.all_to_all_single(received, payload, group, async_op=async_op)

    def finish() -> None:
        out.copy_(sum_chunks(received, m, codec, block))

    return _complete(work, finish, async_op)
