"""Block-sparse layouts and attention: every layout equals dense attention under its mask, counts follow the
layout formulas, the FlexAttention block mask describes the same mask, memory stays below [seq, seq]."""

import math
import os
import struct
import warnings

import moe_lst.kernels.sparse as sparse
import pytest
import torch
from moe_lst.kernels.attention import attention
from moe_lst.kernels.sparse import SparseConfig, block_layout, block_sparse_attention, flex_block_mask
from torch.utils._python_dispatch import TorchDispatchMode

B = 8  # block size of the small cases
CONFIGS = {
    "fixed": SparseConfig(layout="fixed", block_size=B, window_blocks=3, global_blocks=1),
    "bigbird": SparseConfig(layout="bigbird", block_size=B, window_blocks=2, global_blocks=1, random_blocks=2, seed=7),
    "longformer": SparseConfig(layout="longformer", block_size=B, window_blocks=2, global_tokens=(3, 29)),
    "sliding_window": SparseConfig(layout="sliding_window", block_size=B, window_blocks=3),
    "variable": SparseConfig(layout="variable", block_size=B, local_window_blocks=(2, 3), global_block_indices=(1, 4)),
}
# (seq, q heads, kv heads): whole blocks, a ragged last block, GQA with a ragged block
SHAPES = [(64, 2, 2), (61, 4, 2), (45, 6, 2)]


@pytest.fixture(params=["native", "eager"])
def impl(request, monkeypatch):
    """Run the test on both CPU implementations of block_sparse_attention."""
    monkeypatch.setattr(sparse, "CPU_IMPL", request.param)
    return request.param


def _masked_dense(q, k, v, mask):
    """softmax(q k^T / sqrt(d) + (-inf outside mask)) v, per head, GQA by repeating kv heads."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    if mask.dim() == 4:  # [b, kv heads, s, s] -> per query head
        mask = mask.repeat_interleave(rep, 1)
    return torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v)


def _qkv(s, h, hk, seed=0, d=16, b=2):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, n, d, generator=gen, requires_grad=True) for n in (h, hk, hk)]


def _compare(out, ref, inputs, atol=2e-5, rtol=1e-5):
    g = torch.randn_like(ref)
    got = torch.autograd.grad(out, inputs, g)
    want = torch.autograd.grad(ref, inputs, g)
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, atol=atol, rtol=rtol)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("causal", [True, False])
def test_layout_equals_dense_attention_with_its_mask(name, causal, monkeypatch, impl):
    for i, (s, h, hk) in enumerate(SHAPES):
        # the last shape in chunks of a few query blocks, so chunk boundaries are exercised too
        monkeypatch.setattr(sparse, "CHUNK_ELEMENTS", 1 << 19 if i < 2 else 3000)
        layout = block_layout(CONFIGS[name], s, causal)
        q, k, v = _qkv(s, h, hk, seed=i)
        _compare(block_sparse_attention(q, k, v, layout), _masked_dense(q, k, v, layout.token_mask()), (q, k, v))


def test_per_head_layout_and_custom_scale(impl):
    # A layout with [batch, kv_heads] leading dims (as NSA's selected blocks are) and GQA.
    s, h, hk, n = 40, 4, 2, 5
    gen = torch.Generator().manual_seed(3)
    cols = torch.zeros(2, hk, n, 3, dtype=torch.long)
    counts = torch.zeros(2, hk, n, dtype=torch.long)
    for b in range(2):
        for kh in range(hk):
            for r in range(n):
                extra = torch.randperm(r, generator=gen)[: min(r, 2)].tolist() if r else []
                picked = sorted(set(extra) | {r})
                cols[b, kh, r, : len(picked)] = torch.tensor(picked)
                counts[b, kh, r] = len(picked)
    layout = sparse.BlockLayout("per_head", B, s, True, cols, counts)
    q, k, v = _qkv(s, h, hk, seed=4)
    out = block_sparse_attention(q, k, v, layout, scale=0.3)
    mask = layout.token_mask()  # [2, hk, s, s]
    ref = _masked_dense(q * 0.3 * math.sqrt(16), k, v, mask)
    _compare(out, ref, (q, k, v))


def _window(i, n, w, causal):
    return min(i + 1, w) if causal else min(i, w - 1) + min(n - 1 - i, w - 1) + 1


def _expected_counts(cfg: SparseConfig, n: int, causal: bool) -> list[int]:
    """Per-row block counts from each layout's formula (written without building a mask)."""
    w, g = cfg.window_blocks, cfg.global_blocks
    rows = []
    for i in range(n):
        if cfg.layout == "sliding_window":
            rows.append(_window(i, n, w, causal))
        elif cfg.layout == "fixed":
            if causal:  # own window up to i, plus g global blocks of every earlier (complete) window
                rows.append(i % w + 1 + g * (i // w))
            else:  # own window, plus the global blocks of every other window (the last one may be short)
                sizes = [min(w, n - W * w) for W in range(-(-n // w))]
                glob = [max(0, size - (w - g)) for size in sizes]
                rows.append(sizes[i // w] + sum(glob) - glob[i // w])
        elif cfg.layout == "bigbird":
            allowed = i + 1 if causal else n
            if i < g:
                rows.append(allowed)
                continue
            base = _window(i, n, w, causal) + max(0, min(g, i - w + 1))
            rows.append(base + min(cfg.random_blocks, allowed - base))
        elif cfg.layout == "longformer":
            glob = sorted({t // cfg.block_size for t in cfg.global_tokens})
            if i in glob:
                rows.append(i + 1 if causal else n)
            else:
                far = [j for j in glob if abs(i - j) >= w and (j <= i or not causal)]
                rows.append(_window(i, n, w, causal) + len(far))
        else:  # variable
            starts, size, x = [], None, 0
            while x < n:
                size = cfg.local_window_blocks[min(len(starts), len(cfg.local_window_blocks) - 1)]
                starts.append(x)
                x += size
            start = max(s for s in starts if s <= i)
            end = min(n, start + cfg.local_window_blocks[min(starts.index(start), len(cfg.local_window_blocks) - 1)])
            glob = set(cfg.global_block_indices)
            if causal:
                rows.append(i - start + 1 + len([j for j in glob if j < start]))
            else:
                rows.append(end - start + len([j for j in glob if not start <= j < end]))
    return rows


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("causal", [True, False])
def test_block_counts_match_layout_formulas(name, causal):
    for seq in (64, 200, 1000):
        cfg = CONFIGS[name]
        layout = block_layout(cfg, seq, causal)
        n = -(-seq // cfg.block_size)
        assert layout.num_blocks == n
        assert layout.counts.tolist() == _expected_counts(cfg, n, causal), (name, causal, seq)
        assert layout.nnz == sum(_expected_counts(cfg, n, causal))
        cols = layout.cols
        for r in range(n):  # ascending, distinct, the diagonal always there, nothing after it when causal
            row = cols[r, : layout.counts[r]].tolist()
            assert row == sorted(set(row)) and r in row and (not causal or row[-1] == r)
    # the fixed formula in closed form for whole windows: n/w windows, each row sees its window prefix
    big = block_layout(SparseConfig(layout="fixed", block_size=64, window_blocks=4, global_blocks=1), 16384)
    n, w = 256, 4
    assert big.nnz == n // w * (w * (w + 1) // 2) + w * sum(range(n // w))


def test_bigbird_random_blocks_are_seeded():
    cfg = CONFIGS["bigbird"]
    a = block_layout(cfg, 200, True)
    b = block_layout(SparseConfig(**{**cfg.__dict__, "seed": 8}), 200, True)
    assert torch.equal(a.cols, block_layout(SparseConfig(**cfg.__dict__), 200, True).cols)
    assert not torch.equal(a.cols, b.cols)


@pytest.mark.parametrize("cfg", [
    SparseConfig(layout="sliding_window", block_size=8, window_blocks=100),
    SparseConfig(layout="fixed", block_size=8, window_blocks=3, global_blocks=3),
    SparseConfig(layout="bigbird", block_size=16, global_blocks=4),
])
@pytest.mark.parametrize("causal", [True, False])
def test_layout_that_covers_everything_equals_dense(cfg, causal, impl):
    s = 61
    layout = block_layout(cfg, s, causal)
    n = layout.num_blocks
    assert layout.nnz == (n * (n + 1) // 2 if causal else n * n)
    q, k, v = _qkv(s, 4, 2, seed=5)
    _compare(block_sparse_attention(q, k, v, layout), attention(q, k, v, causal=causal, backend="reference"),
             (q, k, v))


def test_layout_is_cached_printable_and_plottable(tmp_path):
    cfg = CONFIGS["bigbird"]
    layout = block_layout(cfg, 64, True)
    assert block_layout(cfg, 64, True) is layout and block_layout(cfg, 64, False) is not layout
    text = str(layout)
    assert text.splitlines()[0].startswith("BlockLayout(bigbird, causal, seq_len=64, block_size=8: 8x8 blocks")
    assert text.splitlines()[1:] == ["".join("#" if x else "." for x in row) for row in layout.block_mask().tolist()]
    layout.save_image(str(tmp_path / "bigbird.png"))
    assert (tmp_path / "bigbird.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("kwargs, message", [
    ({"block_size": 0}, "block_size=0 must be an integer >= 1"),
    ({"window_blocks": 0}, "window_blocks=0 must be an integer >= 1"),
    ({"layout": "strided"}, "is not a layout"),
    ({"layout": "fixed", "global_blocks": 5}, "must be <= window_blocks=4"),
    ({"layout": "variable", "local_window_blocks": []}, "non-empty"),
])
def test_bad_configs_name_the_rule(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SparseConfig(**kwargs)


def test_sequence_dependent_errors_and_unused_fields():
    with pytest.raises(ValueError, match="more global blocks than the sequence has"):
        block_layout(SparseConfig(layout="bigbird", block_size=8, global_blocks=9), 64)
    with pytest.raises(ValueError, match="global_tokens=\\[70\\]"):
        block_layout(SparseConfig(layout="longformer", global_tokens=(70,)), 64)
    with pytest.raises(ValueError, match="global_block_indices"):
        block_layout(SparseConfig(layout="variable", block_size=8, global_block_indices=(8,)), 64)
    assert SparseConfig(layout="fixed", random_blocks=3).unused_fields() == ["random_blocks"]
    assert SparseConfig(layout="bigbird", random_blocks=3).unused_fields() == []
    q = torch.randn(1, 32, 2, 8)
    with pytest.raises(ValueError, match="built for 64 tokens but q has 32"):
        block_sparse_attention(q, q, q, block_layout(CONFIGS["fixed"], 64))


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_cpu_path_never_builds_seq_by_seq_tensors(impl):
    s = 2048
    layout = block_layout(SparseConfig(layout="bigbird", block_size=32, window_blocks=3, random_blocks=2), s)
    q, k, v = _qkv(s, 1, 1, d=16, b=1)
    with _LargestTensor() as probe:
        out = block_sparse_attention(q, k, v, layout)
        out.sum().backward()
    assert probe.largest < s * s // 8, probe.largest


@pytest.mark.parametrize("block, s", [(8, 45), (64, 300)])
def test_flex_block_mask_describes_the_layout(block, s):
    # FlexAttention has no CPU backward and its eager CPU forward applies the mask function to every score;
    # that checks the mask function, and the block lists are checked against the layout below.
    if not sparse.flex.available():
        pytest.skip("this torch has no FlexAttention")
    cfg = SparseConfig(layout="bigbird", block_size=block, window_blocks=2, global_blocks=1, random_blocks=1)
    for causal in (True, False):
        layout = block_layout(cfg, s, causal)
        mask = flex_block_mask(layout, heads=4)
        q, k, v = (x.detach() for x in _qkv(s, 4, 2, seed=6))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            flex = sparse.flex._flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               block_mask=mask, enable_gqa=True).transpose(1, 2)
        torch.testing.assert_close(flex, block_sparse_attention(q, k, v, layout), atol=2e-5, rtol=1e-5)
        # every block the layout attends is visited by the kernel (coarsened to FlexAttention's tile)
        F = mask.BLOCK_SIZE[0]
        visited = mask.to_dense()[0, 0].bool()
        fine = layout.block_mask()
        coarse = torch.zeros_like(visited)
        for r, c in fine.nonzero().tolist():
            coarse[r * block // F, c * block // F] = True
        assert torch.equal(visited, coarse)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flex_path_matches_cpu_path_on_gpu():
    for name in ("fixed", "bigbird", "sliding_window"):
        cfg = SparseConfig(**{**CONFIGS[name].__dict__, "block_size": 64})
        layout = block_layout(cfg, 1000, True)
        q, k, v = _qkv(1000, 8, 2, seed=9, d=64)
        g = torch.randn(2, 1000, 8, 64)
        out = block_sparse_attention(q, k, v, layout)
        grads = torch.autograd.grad(out, (q, k, v), g)
        qc, kc, vc = (x.detach().cuda().requires_grad_() for x in (q, k, v))
        out_cuda = block_sparse_attention(qc, kc, vc, layout)
        grads_cuda = torch.autograd.grad(out_cuda, (qc, kc, vc), g.cuda())
        torch.testing.assert_close(out_cuda.cpu(), out, atol=2e-3, rtol=2e-3)
        for a, e in zip(grads_cuda, grads):
            torch.testing.assert_close(a.cpu(), e, atol=5e-3, rtol=5e-3)


@pytest.mark.parametrize("name", ["sliding_window", "fixed", "bigbird"])
def test_native_kernel_equals_eager_path_at_block_64(name, monkeypatch):
    # Real block size, a ragged length and GQA: rows read in place (consecutive blocks) and gathered rows,
    # several query heads accumulating one kv head's gradients.
    s = 64 * 9 + 21
    extra = {"random_blocks": 2} if name == "bigbird" else {}
    cfg = SparseConfig(layout=name, block_size=64, window_blocks=3, **extra)
    layout = block_layout(cfg, s)
    q, k, v = _qkv(s, 4, 2, seed=11, d=32)
    results = {}
    for impl_ in ("native", "eager"):
        monkeypatch.setattr(sparse, "CPU_IMPL", impl_)
        out = block_sparse_attention(q, k, v, layout)
        results[impl_] = (out, *torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))
    for a, e in zip(results["native"], results["eager"]):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)


def test_cpu_implementation_choice(monkeypatch):
    layout = block_layout(CONFIGS["sliding_window"], 40)
    q, k, v = _qkv(40, 2, 2)
    monkeypatch.setattr(sparse, "CPU_IMPL", "auto")
    assert sparse.cpu._use_native(q) and not sparse.cpu._use_native(q.double())  # fp64 runs the eager path
    # bf16 inputs compute in fp32 on either path and come back in bf16
    qb, kb, vb = (x.detach().bfloat16() for x in (q, k, v))
    out = block_sparse_attention(qb, kb, vb, layout)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), block_sparse_attention(qb.float(), kb.float(), vb.float(), layout),
                               atol=1e-2, rtol=1e-2)
    monkeypatch.setattr(sparse, "CPU_IMPL", "native")
    with pytest.raises(ValueError, match="fp64"):
        block_sparse_attention(q.double(), k.double(), v.double(), layout)
    monkeypatch.setattr(sparse, "CPU_IMPL", "fast")
    with pytest.raises(ValueError, match="must be one of"):
        block_sparse_attention(q, k, v, layout)


def test_a_kernel_that_cannot_build_falls_back_with_one_warning(monkeypatch, tmp_path):
    monkeypatch.setattr(sparse.cpu, "_NATIVE_SOURCE", str(tmp_path / "missing.cpp"))
    monkeypatch.setattr(sparse.cpu, "_native_state", {})
    monkeypatch.setattr(sparse, "CPU_IMPL", "auto")
    layout = block_layout(CONFIGS["sliding_window"], 40)
    q, k, v = _qkv(40, 2, 2)
    with pytest.warns(UserWarning, match="could not be built.*eager PyTorch path"):
        out = block_sparse_attention(q, k, v, layout)
    _compare(out, _masked_dense(q, k, v, layout.token_mask()), (q, k, v))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        block_sparse_attention(q, k, v, layout)
    monkeypatch.setattr(sparse, "CPU_IMPL", "native")
    with pytest.raises(RuntimeError, match="could not be built"):
        block_sparse_attention(q, k, v, layout)


def test_a_build_lock_left_by_a_killed_builder_is_removed_before_the_kernel_loads(monkeypatch, tmp_path):
    """torch's loader waits as long as the build's lock file exists: one that no process holds open (its builder
    was killed mid-build) is removed, with a warning, before the load; one a live builder holds stays."""
    import torch.utils.cpp_extension as cpp
    from moe_lst.kernels.build import build_lock

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(sparse.cpu, "_native_state", {})
    seen = []
    monkeypatch.setattr(cpp, "load", lambda name, **_: seen.append(build_lock(name).exists()) or "module")
    lock = build_lock(f"moe_lst_block_sparse_{sparse.cpu._cpu_tag(sparse.cpu._NATIVE_SOURCE)}")
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()  # (no process holds it: a killed builder's)
    with pytest.warns(UserWarning, match="removed the stale build lock"):
        assert sparse.cpu.native_kernel() == "module"
    assert seen == [False]
    held = os.open(lock, os.O_CREAT | os.O_EXCL)  # (as a live builder holds it)
    try:
        monkeypatch.setattr(sparse.cpu, "_native_state", {})
        assert sparse.cpu.native_kernel() == "module" and seen == [False, True]
    finally:
        os.close(held)


def test_settings_set_on_the_package_take_effect(monkeypatch):
    # The settings live on moe_lst.kernels.sparse (users set them there); its modules read them at each call.
    counts = block_layout(CONFIGS["sliding_window"], 64).counts
    monkeypatch.setattr(sparse, "CHUNK_ELEMENTS", 1 << 19)
    assert len(sparse.cpu._chunks(counts, 64)) == 1
    monkeypatch.setattr(sparse, "CHUNK_ELEMENTS", 64 * 3 * 2)
    assert len(sparse.cpu._chunks(counts, 64)) > 1
    if sparse.flex.available():
        layout = block_layout(CONFIGS["sliding_window"], 300)
        assert flex_block_mask(layout, heads=2).BLOCK_SIZE[0] == 128
        monkeypatch.setattr(sparse, "FLEX_BLOCK", 64)
        assert flex_block_mask(layout, heads=2).BLOCK_SIZE[0] == 64


def test_native_kernel_checks_shapes_before_reading(monkeypatch):
    # cpu_block_sparse_attention is public: a layout for another length or batch is refused by the kernel
    # itself (it indexes raw memory), not read out of bounds.
    monkeypatch.setattr(sparse, "CPU_IMPL", "native")
    q, k, v = _qkv(40, 2, 2)
    with pytest.raises(RuntimeError, match="a layout of 5 blocks"):
        sparse.cpu_block_sparse_attention(q, k, v, block_layout(CONFIGS["sliding_window"], 80), 0.25)
    per_batch = sparse.BlockLayout("x", B, 40, True, torch.zeros(3, 1, 5, 1, dtype=torch.long),
                                   torch.ones(3, 1, 5, dtype=torch.long))
    with pytest.raises(RuntimeError, match="for batch 2"):
        sparse.cpu_block_sparse_attention(q, k, v, per_batch, 0.25)


# ------------------------------------------------------------------------------------------------------------
# Independent per-token references. Each layout's definition (README "Sparse attention", SparseConfig) written
# out directly in plain Python, without the layout-building helpers of kernels/sparse/layouts.py, so a layout that keeps
# or drops a block is caught here rather than checked against itself. Each returns a bool [seq, seq] token mask
# (query token a attends key token b). Common to all layouts: a query block attends whole key blocks; causal
# layouts keep only key blocks at or before the query block and the token-level causal mask (b <= a) inside.


def _token_mask_from(seq, B, causal, attends):
    """Per token: query token a attends key token b iff its block attends b's block (`attends(qblock, kblock)`)
    and, when causal, b <= a."""
    n = -(-seq // B)
    table = [[bool(attends(i, j)) for j in range(n)] for i in range(n)]
    return torch.tensor([[table[a // B][b // B] and (not causal or b <= a) for b in range(seq)]
                         for a in range(seq)], dtype=torch.bool).reshape(seq, seq)


def _reference_sliding_window(cfg, seq, causal):
    # the blocks within window_blocks - 1 of the query block
    return _token_mask_from(seq, cfg.block_size, causal, lambda i, j: abs(i - j) <= cfg.window_blocks - 1)


def _reference_fixed(cfg, seq, causal):
    # aligned windows of window_blocks blocks: window W holds blocks W*w .. W*w + w - 1; a query block attends its
    # own window and the last global_blocks blocks (positions w - g .. w - 1) of every window
    w, g = cfg.window_blocks, cfg.global_blocks
    n = -(-seq // cfg.block_size)
    windows = [list(range(W * w, W * w + w)) for W in range(-(-n // w))]
    own = {x: win for win in windows for x in win}
    global_blocks = {x for win in windows for x in win[w - g:]}
    return _token_mask_from(seq, cfg.block_size, causal, lambda i, j: j in own[i] or j in global_blocks)


_P = 2**31 - 1  # BigBird's random blocks: the documented hash of (seed, row, column)


def _bigbird_hash(seed, row, col):
    h = (row * 1_000_003 + col * 7_919 + (seed % _P) * 104_729 + 12_345) % _P
    for mult in (48_271, 16_807, 69_621):
        h = ((h ^ (h >> 15)) * mult) % _P
    return struct.unpack("f", struct.pack("f", h / _P))[0]  # as a float32 in [0, 1)


def _reference_bigbird(cfg, seq, causal):
    # the blocks within window_blocks - 1, the first global_blocks blocks (which also attend every block), and
    # per row random_blocks more: of the blocks the row may attend (at or before it when causal) that it does not
    # attend already, those with the highest hash(seed, row, column)
    w, g = cfg.window_blocks, cfg.global_blocks
    n = -(-seq // cfg.block_size)

    def base(i, j):
        return abs(i - j) <= w - 1 or j < g or i < g

    picked = {}
    for i in range(n):
        free = [j for j in range(n) if (j <= i or not causal) and not base(i, j)]
        free.sort(key=lambda j: -_bigbird_hash(cfg.seed, i, j))
        r = cfg.random_blocks
        if 0 < r < len(free):  # the draw is well defined: no tie across the cut
            assert _bigbird_hash(cfg.seed, i, free[r - 1]) != _bigbird_hash(cfg.seed, i, free[r]), (cfg, i)
        picked[i] = set(free[:r])
    return _token_mask_from(seq, cfg.block_size, causal, lambda i, j: base(i, j) or j in picked[i])


def _reference_longformer(cfg, seq, causal):
    # the sliding window, and the blocks holding a global token, which also attend every block
    holding = {t // cfg.block_size for t in cfg.global_tokens}
    return _token_mask_from(seq, cfg.block_size, causal,
                            lambda i, j: abs(i - j) <= cfg.window_blocks - 1 or j in holding or i in holding)


def _reference_variable(cfg, seq, causal):
    # consecutive windows of local_window_blocks[0], [1], ... blocks (the last size repeats); a query block attends
    # its own window and every block of global_block_indices
    n = -(-seq // cfg.block_size)
    sizes, window_of, start, number = cfg.local_window_blocks, {}, 0, 0
    while start < n:
        size = sizes[min(number, len(sizes) - 1)]
        for x in range(start, start + size):
            window_of[x] = number
        start, number = start + size, number + 1
    return _token_mask_from(seq, cfg.block_size, causal,
                            lambda i, j: window_of[i] == window_of[j] or j in cfg.global_block_indices)


REFERENCES = {
    "fixed": _reference_fixed,
    "bigbird": _reference_bigbird,
    "longformer": _reference_longformer,
    "sliding_window": _reference_sliding_window,
    "variable": _reference_variable,
}
# (seq, block size): whole blocks, ragged tails, a single (ragged) block, block size 1, up to 18 blocks
MASK_CASES = [(3, 4), (16, 4), (13, 4), (23, 3), (30, 8), (37, 5), (9, 1), (70, 4)]


def _sweep(name, seq, block):
    """The configs of layout `name` checked at (seq, block): every knob the layout reads, over its range."""
    n = -(-seq // block)
    if name == "sliding_window":
        return [SparseConfig(layout=name, block_size=block, window_blocks=w) for w in (1, 2, 3, 4)]
    if name == "fixed":
        return [SparseConfig(layout=name, block_size=block, window_blocks=w, global_blocks=g)
                for w in (1, 2, 3, 4) for g in (0, 1, 2) if g <= w]
    if name == "bigbird":
        return [SparseConfig(layout=name, block_size=block, window_blocks=w, global_blocks=g, random_blocks=r, seed=sd)
                for w in (1, 2, 3) for g in (0, 1, 2) for r, sd in ((0, 0), (1, 0), (2, 7), (3, 12345))
                if g <= n]
    if name == "longformer":
        tokens = [(0,), (), (seq - 1,), (seq // 2, seq // 2 + 1, 1), (seq - 1, 0, seq // 3)]
        return [SparseConfig(layout=name, block_size=block, window_blocks=w, global_tokens=t)
                for w in (1, 2, 3) for t in tokens if all(0 <= x < seq for x in t)]
    indices = [(0,), (), (n - 1,), (1, n - 1), (n // 2, 0)]
    return [SparseConfig(layout=name, block_size=block, local_window_blocks=lw, global_block_indices=gi)
            for lw in ((1,), (2,), (3,), (2, 3), (1, 2, 4), (4, 1)) for gi in indices if all(x < n for x in gi)]


def test_references_match_hand_drawn_layouts():
    # The references themselves against layouts drawn by hand from the README's table (block level, 1-token
    # blocks so the token mask is the block mask; bidirectional, and causal = the lower triangle of it).
    drawn = [
        (SparseConfig(layout="sliding_window", block_size=1, window_blocks=2), 5,
         ["##...", "###..", ".###.", "..###", "...##"]),
        (SparseConfig(layout="fixed", block_size=1, window_blocks=3, global_blocks=1), 7,
         ["###..#.", "###..#.", "###..#.", "..####.", "..####.", "..####.", "..#..##"]),
        (SparseConfig(layout="bigbird", block_size=1, window_blocks=2, global_blocks=1, random_blocks=0), 5,
         ["#####", "###..", "####.", "#.###", "#..##"]),
        (SparseConfig(layout="longformer", block_size=1, window_blocks=1, global_tokens=(2,)), 5,
         ["#.#..", ".##..", "#####", "..##.", "..#.#"]),
        (SparseConfig(layout="variable", block_size=1, local_window_blocks=(1, 2), global_block_indices=(4,)), 6,
         ["#...#.", ".##.#.", ".##.#.", "...##.", "...##.", "....##"]),
    ]
    assert len(drawn) == len(REFERENCES) == 5 and {cfg.layout for cfg, _, _ in drawn} == set(REFERENCES)
    for cfg, seq, picture in drawn:
        want = torch.tensor([[c == "#" for c in row] for row in picture])
        assert torch.equal(REFERENCES[cfg.layout](cfg, seq, False), want), cfg.layout
        assert torch.equal(REFERENCES[cfg.layout](cfg, seq, True), want.tril()), cfg.layout
    # BigBird's random blocks: one per row, among the blocks outside the window and globals, seeded
    cfg = SparseConfig(layout="bigbird", block_size=1, window_blocks=1, global_blocks=0, random_blocks=1, seed=3)
    mask = _reference_bigbird(cfg, 9, True)
    assert mask.sum(1).tolist() == [1] + [2] * 8 and mask.diagonal().all()
    other = _reference_bigbird(SparseConfig(**{**cfg.__dict__, "seed": 4}), 9, True)
    assert not torch.equal(mask, other)


@pytest.mark.parametrize("name", list(REFERENCES))
@pytest.mark.parametrize("causal", [True, False])
def test_layout_mask_equals_independent_reference(name, causal):
    assert len(MASK_CASES) == 8
    # configs per layout over all cases (fewer where a knob does not fit a 1-block sequence)
    expected = {"fixed": 88, "bigbird": 24 + 7 * 36, "longformer": 8 * 15, "sliding_window": 8 * 4,
                "variable": 24 + 7 * 30}
    checked = 0
    for seq, block in MASK_CASES:
        configs = _sweep(name, seq, block)
        assert len(configs) >= 4, (name, seq, block)
        for cfg in configs:
            got = block_layout(cfg, seq, causal).token_mask()
            want = REFERENCES[name](cfg, seq, causal)
            assert want.shape == (seq, seq) and want.diagonal().all()
            assert torch.equal(got, want), (cfg, seq, causal, (got != want).nonzero()[:5].tolist())
            checked += 1
    assert checked == expected[name]


# (seq, block, q heads, kv heads): a ragged tail with GQA, whole blocks
KERNEL_CASES = [(37, 5, 4, 2), (32, 4, 2, 2)]
KERNEL_CONFIGS = {
    "fixed": [dict(window_blocks=3, global_blocks=1), dict(window_blocks=4, global_blocks=2),
              dict(window_blocks=2, global_blocks=0)],
    "bigbird": [dict(window_blocks=2, global_blocks=1, random_blocks=2, seed=7),
                dict(window_blocks=1, global_blocks=2, random_blocks=1, seed=1),
                dict(window_blocks=3, global_blocks=0, random_blocks=3, seed=12345)],
    "longformer": [dict(window_blocks=2, global_tokens=(3, 29)), dict(window_blocks=1, global_tokens=(31, 10, 11)),
                   dict(window_blocks=3, global_tokens=())],
    "sliding_window": [dict(window_blocks=2), dict(window_blocks=3), dict(window_blocks=1)],
    "variable": [dict(local_window_blocks=(2, 3), global_block_indices=(1, 4)),
                 dict(local_window_blocks=(1, 3), global_block_indices=(6,)),
                 dict(local_window_blocks=(4,), global_block_indices=())],
}


@pytest.mark.parametrize("name", list(REFERENCES))
@pytest.mark.parametrize("causal", [True, False])
def test_kernel_equals_dense_attention_with_independent_mask(name, causal, impl, monkeypatch):
    # The kernel on the layout under test against dense attention with the *independent* reference mask:
    # forward and gradients of q, k, v (fp32 on the native kernel, fp64 on the eager path).
    dtype, atol, rtol = (torch.float32, 2e-5, 1e-5) if impl == "native" else (torch.float64, 1e-10, 1e-7)
    assert len(KERNEL_CONFIGS[name]) == 3 and len(KERNEL_CASES) == 2
    for c, kwargs in enumerate(KERNEL_CONFIGS[name]):
        for i, (s, block, h, hk) in enumerate(KERNEL_CASES):
            # the eager path in chunks of a few query blocks on the first case, so chunk boundaries are crossed
            monkeypatch.setattr(sparse, "CHUNK_ELEMENTS", 3000 if i == 0 else 1 << 19)
            cfg = SparseConfig(layout=name, block_size=block, **kwargs)
            mask = REFERENCES[name](cfg, s, causal)
            assert 0 < int(mask.sum()) < s * s  # sparse, not dense
            q, k, v = (x.detach().to(dtype).requires_grad_() for x in _qkv(s, h, hk, seed=20 + c))
            out = block_sparse_attention(q, k, v, block_layout(cfg, s, causal))
            assert out.dtype == dtype
            _compare(out, _masked_dense(q, k, v, mask), (q, k, v), atol=atol, rtol=rtol)
