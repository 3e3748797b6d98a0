"""Block-sparse layouts (fixed, BigBird, Longformer, sliding window, variable) as data: per query block, the
ascending key blocks it attends (`BlockLayout`), built from a `SparseConfig`, cached per (config, length, causal)."""

from __future__ import annotations

import functools
from dataclasses import astuple, dataclass, field, fields

import torch

LAYOUTS = ("fixed", "bigbird", "longformer", "sliding_window", "variable")
# The SparseConfig fields each layout reads (block_size always); any other field set away from its default
# is refused by `SparseConfig.unused_fields`, so a key that would silently do nothing is caught.
LAYOUT_FIELDS = {
    "fixed": ("window_blocks", "global_blocks"),
    "bigbird": ("window_blocks", "global_blocks", "random_blocks", "seed"),
    "longformer": ("window_blocks", "global_tokens"),
    "sliding_window": ("window_blocks",),
    "variable": ("local_window_blocks", "global_block_indices"),
}


@dataclass
class SparseConfig:
    """Which key blocks each query block attends (all counts in blocks of `block_size` tokens).

    - sliding_window: the blocks within `window_blocks - 1` of the query block (earlier ones only when causal).
    - fixed (Sparse Transformer): the sequence is cut into windows of `window_blocks` blocks; a query block
      attends its own window and the last `global_blocks` blocks of every window (strided global columns).
    - bigbird: sliding window, the first `global_blocks` blocks attend and are attended by every block, and
      `random_blocks` more blocks per row drawn with `seed`.
    - longformer: sliding window, and the blocks holding the `global_tokens` (token positions) attend and
      are attended by every block.
    - variable: windows of `local_window_blocks` blocks (the last size repeats), and every block attends
      the blocks in `global_block_indices`.
    Causal layouts keep only key blocks at or before the query block; inside a block the usual token-level
    causal mask applies.
    """

    layout: str = "fixed"
    block_size: int = 64
    window_blocks: int = 4
    global_blocks: int = 1
    random_blocks: int = 1
    seed: int = 0
    global_tokens: tuple[int, ...] = (0,)
    local_window_blocks: tuple[int, ...] = (4,)
    global_block_indices: tuple[int, ...] = (0,)

    def __post_init__(self) -> None:
        for name in ("global_tokens", "local_window_blocks", "global_block_indices"):  # lists from a config file
            setattr(self, name, tuple(int(x) for x in getattr(self, name)))
        if self.layout not in LAYOUTS:
            raise ValueError(f"model.sparse.layout={self.layout!r} is not a layout; choose one of {', '.join(LAYOUTS)}")
        for name, minimum in (("block_size", 1), ("window_blocks", 1), ("global_blocks", 0), ("random_blocks", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"model.sparse.{name}={value!r} must be an integer >= {minimum}")
        if self.layout == "fixed" and self.global_blocks > self.window_blocks:
            raise ValueError(f"model.sparse.global_blocks={self.global_blocks} must be <= window_blocks="
                             f"{self.window_blocks} for layout=fixed (the global blocks are the last blocks of "
                             "each window); lower global_blocks or raise window_blocks")
        if self.layout == "variable" and (not self.local_window_blocks or min(self.local_window_blocks) < 1):
            raise ValueError(f"model.sparse.local_window_blocks={list(self.local_window_blocks)} must be a non-empty "
                             "list of window sizes >= 1 (in blocks)")
        negative = [t for t in self.global_tokens + self.global_block_indices if t < 0]
        if negative:
            raise ValueError(f"global token / block positions must be >= 0, got {negative}")

    def unused_fields(self) -> list[str]:
        """Fields set away from their defaults that this layout does not read."""
        used = ("layout", "block_size", *LAYOUT_FIELDS[self.layout])
        return [f.name for f in fields(self) if f.name not in used and getattr(self, f.name) != _DEFAULT[f.name]]

    def check_sequence(self, seq_len: int) -> None:
        """Raise a ValueError if this layout cannot be built for `seq_len` tokens (global blocks or tokens
        beyond the sequence)."""
        n = -(-seq_len // self.block_size)
        if self.layout == "bigbird" and self.global_blocks > n:
            raise ValueError(f"model.sparse.global_blocks={self.global_blocks} is more global blocks than the "
                             f"sequence has ({seq_len} tokens: {n} block(s) of {self.block_size}); lower it")
        if self.layout == "longformer" and any(t >= seq_len for t in self.global_tokens):
            raise ValueError(f"model.sparse.global_tokens={list(self.global_tokens)} must be token positions "
                             f"< the sequence length {seq_len}")
        if self.layout == "variable" and any(j >= n for j in self.global_block_indices):
            raise ValueError(f"model.sparse.global_block_indices={list(self.global_block_indices)} must be blocks "
                             f"< {n}: the sequence has {seq_len} tokens, {n} blocks of {self.block_size}")


_DEFAULT = {f.name: getattr(SparseConfig(), f.name) for f in fields(SparseConfig)}


@dataclass(frozen=True, eq=False)
class BlockLayout:
    """A block-sparse mask as data: query block r attends key blocks `cols[..., r, :counts[..., r]]`
    (ascending; the slots after `counts` are padding). Leading dims, when present, are [batch, kv_heads]
    (a per-sequence, per-head layout such as NSA's selected blocks; sizes 1 broadcast).

    Inside the attended blocks a token-level mask applies only where needed: the causal mask on the
    diagonal block and the tail of a ragged last block. Both can only hit a row's last attended block (its
    largest index), which the kernel uses to mask just that slot.
    """

    name: str
    block_size: int
    seq_len: int
    causal: bool
    cols: torch.Tensor  # [..., n_blocks, max_nnz] int64
    counts: torch.Tensor  # [..., n_blocks] int64
    _on_device: dict = field(default_factory=dict, repr=False, compare=False)  # copies per device, BlockMasks

    @property
    def num_blocks(self) -> int:
        return self.cols.shape[-2]

    @property
    def nnz(self) -> int:
        """Attended (query block, key block) pairs, summed over any leading dims."""
        return int(self.counts.sum())

    @property
    def density(self) -> float:
        """Fraction of the blocks a dense (causal or not) attention would compute."""
        n = self.num_blocks
        full = n * (n + 1) // 2 if self.causal else n * n
        return self.nnz / (full * max(1, self.counts[..., 0].numel()))

    def to(self, device: torch.device | str) -> BlockLayout:
        device = torch.device(device)
        if device == self.cols.device:
            return self
        if device not in self._on_device:
            self._on_device[device] = BlockLayout(self.name, self.block_size, self.seq_len, self.causal,
                                                  self.cols.to(device), self.counts.to(device))
        return self._on_device[device]

    def block_mask(self) -> torch.Tensor:
        """Dense block-level mask [..., n_blocks, n_blocks] (bool): for display and tests."""
        n = self.num_blocks
        valid = torch.arange(self.cols.shape[-1], device=self.cols.device) < self.counts[..., None]
        mask = torch.zeros(*self.cols.shape[:-1], n + 1, dtype=torch.bool, device=self.cols.device)
        mask.scatter_(-1, torch.where(valid, self.cols, n), True)  # padding slots land in the spare column
        return mask[..., :n]

    def token_mask(self) -> torch.Tensor:
        """Dense token-level mask [..., seq, seq]: quadratic, for tests on short sequences only."""
        s, B = self.seq_len, self.block_size
        blocks = torch.arange(s, device=self.cols.device) // B
        mask = self.block_mask()[..., blocks, :][..., blocks]
        if self.causal:
            mask = mask & torch.ones(s, s, dtype=torch.bool, device=mask.device).tril()
        return mask

    def __str__(self) -> str:
        n = self.num_blocks
        head = (f"BlockLayout({self.name}, {'causal' if self.causal else 'bidirectional'}, seq_len={self.seq_len}, "
                f"block_size={self.block_size}: {n}x{n} blocks, {self.nnz} non-zero, density {self.density:.3f})")
        if self.cols.dim() > 2 or n > 64:
            return head
        rows = ["".join("#" if x else "." for x in row) for row in self.block_mask().tolist()]
        return "\n".join([head, *rows])

    def save_image(self, path: str, title: str | None = None) -> None:
        """Save the block mask as an image (matplotlib): one pixel row per query block."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        mask = self.block_mask()
        while mask.dim() > 2:
            mask = mask[0]
        fig, ax = plt.subplots(figsize=(4, 4), dpi=150)
        ax.imshow(mask.cpu().numpy(), cmap="Greys", interpolation="nearest")
        ax.set_xlabel("key block")
        ax.set_ylabel("query block")
        ax.set_title(title or f"{self.name} ({self.block_size}-token blocks, density {self.density:.2f})", fontsize=8)
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)


# ----------------------------------------------------------------------------------------------- layouts
def _window_ids(sizes: tuple[int, ...], n: int) -> torch.Tensor:
    """Window index of each of n blocks for consecutive windows of `sizes` blocks (the last size repeats)."""
    ids, start, w = [], 0, 0
    while start < n:
        size = sizes[min(w, len(sizes) - 1)]
        ids += [w] * size
        start, w = start + size, w + 1
    return torch.tensor(ids[:n])


_HASH_PRIME = 2**31 - 1


def _uniform_hash(seed: int, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """Pseudo-random numbers in [0, 1) that depend on (seed, i, j) alone: a causal layout's random blocks
    are then the same whatever the sequence length (a padded sequence under Ulysses keeps them)."""
    h = (i * 1_000_003 + j * 7_919 + (seed % _HASH_PRIME) * 104_729 + 12_345) % _HASH_PRIME
    for mult in (48_271, 16_807, 69_621):  # xor-shift then multiply mod a prime: products stay below 2**62
        h = ((h ^ (h >> 15)) * mult) % _HASH_PRIME
    return h.double().div_(_HASH_PRIME).float()


def _rows(cfg: SparseConfig, n: int, causal: bool, i: torch.Tensor) -> torch.Tensor:
    """Block mask rows `i` [R] of the layout: bool [R, n]."""
    j = torch.arange(n)[None, :]
    i = i[:, None]
    w = cfg.window_blocks
    window = (i - j).abs() < w
    if cfg.layout == "sliding_window":
        mask = window
    elif cfg.layout == "fixed":
        mask = (i // w == j // w) | (j % w >= w - cfg.global_blocks)
    elif cfg.layout == "bigbird":
        mask = window | (j < cfg.global_blocks) | (i < cfg.global_blocks)
    elif cfg.layout == "longformer":
        g = torch.tensor(sorted({t // cfg.block_size for t in cfg.global_tokens}), dtype=torch.long)
        mask = window | torch.isin(j, g) | torch.isin(i, g)
    else:  # variable
        ids = _window_ids(cfg.local_window_blocks, n)
        g = torch.tensor(cfg.global_block_indices, dtype=torch.long)
        mask = (ids[i] == ids[j]) | torch.isin(j, g)
    allowed = j <= i if causal else torch.ones_like(mask)
    mask = mask & allowed
    if cfg.layout == "bigbird" and cfg.random_blocks:
        scores = _uniform_hash(cfg.seed, i, j).masked_fill(~(allowed & ~mask), -1.0)
        top = scores.topk(min(cfg.random_blocks, n), dim=1)
        mask = mask.scatter(1, top.indices, top.values >= 0) | mask
    return mask


def block_layout(cfg: SparseConfig, seq_len: int, causal: bool = True) -> BlockLayout:
    """The layout of `cfg` for `seq_len` tokens, cached per (config values, length, causal)."""
    return _cached_layout(astuple(cfg), seq_len, causal)


@functools.lru_cache(maxsize=64)
def _cached_layout(values: tuple, seq_len: int, causal: bool) -> BlockLayout:
    # Keyed on the values, not the (mutable) config object. Built in chunks of rows, never [seq, seq].
    cfg = SparseConfig(*values)
    cfg.check_sequence(seq_len)
    n = -(-seq_len // cfg.block_size)
    cols, counts = [], []
    step = max(1, (1 << 22) // n)
    for r0 in range(0, n, step):
        mask = _rows(cfg, n, causal, torch.arange(r0, min(n, r0 + step)))
        c = mask.sum(1)
        rows, found = mask.nonzero(as_tuple=True)  # row-major: each row's key blocks in ascending order
        slot = torch.arange(rows.numel()) - (torch.cumsum(c, 0) - c)[rows]
        chunk = torch.zeros(mask.shape[0], int(c.max()), dtype=torch.long)
        chunk[rows, slot] = found
        cols.append(chunk)
        counts.append(c)
    width = max(x.shape[1] for x in cols)
    cols = torch.cat([torch.nn.functional.pad(x, (0, width - x.shape[1])) for x in cols])
    return BlockLayout(cfg.layout, cfg.block_size, seq_len, causal, cols, torch.cat(counts))
