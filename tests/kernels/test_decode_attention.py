"""Sparse decode attention with sink: twin vs the formula written out per row and head; Triton vs twin."""
import math

import pytest
import torch

from deepinfer_sg.kernels.decode_attention import (default_config, sparse_attention, sparse_attention_torch,
                                                   sparse_attention_triton)
from deepinfer_sg.kernels.backend import tickets
from deepinfer_sg.kernels.index_rows import entry_rows_torch
from deepinfer_sg.kernels.rope import apply_rope_torch, apply_rope_triton
from helpers import DEVICE, on_dev


def _inputs(gen, N=5, H=6, D=32, Pw=40, Pc=30, Kw=9, Kc=7, dtype=torch.float32):
    q = torch.randn(N, H, D, generator=gen).to(dtype)
    win_kv = torch.randn(Pw, D, generator=gen).to(dtype)
    cmp_kv = torch.randn(Pc, D, generator=gen).to(dtype)
    win_idx = torch.randint(0, Pw, (N, Kw), generator=gen)
    cmp_idx = torch.randint(0, Pc, (N, Kc), generator=gen)
    # different lengths per row: pad with -1 (row 1: window only partly full; row 3: no compressed entries;
    # row 4: no keys at all -> output 0)
    win_idx[1, 4:] = -1
    cmp_idx[3, :] = -1
    win_idx[4, :] = -1
    cmp_idx[4, :] = -1
    cmp_idx[0, 2] = cmp_idx[0, 1]              # a duplicate counts twice
    sink = torch.randn(H, generator=gen) * 2
    return q, win_kv, win_idx, cmp_kv, cmp_idx, sink


def _naive(q, win_kv, win_idx, cmp_kv, cmp_idx, sink):
    """The formula of the architecture doc, one row and head at a time, in float64."""
    N, H, D = q.shape
    out = torch.zeros(N, H, D, dtype=torch.float64)
    for n in range(N):
        keys = [win_kv[i].double() for i in win_idx[n].tolist() if i >= 0]
        keys += [cmp_kv[i].double() for i in cmp_idx[n].tolist() if i >= 0]
        for h in range(H):
            s = [float(q[n, h].double() @ k) / math.sqrt(D) for k in keys]
            m = max(s + [float(sink[h])])
            num = sum((math.exp(sj - m) * k for sj, k in zip(s, keys)), torch.zeros(D, dtype=torch.float64))
            den = sum(math.exp(sj - m) for sj in s) + math.exp(float(sink[h]) - m)
            out[n, h] = num / den
    return out


def test_twin_matches_formula():
    gen = torch.Generator().manual_seed(0)
    x = _inputs(gen)
    ref = _naive(*x)
    out = sparse_attention_torch(x[0], x[1], x[2], x[5], x[3], x[4])
    assert torch.allclose(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert out[4].abs().max() == 0


@pytest.mark.parametrize("H,D,Kw,Kc,dtype,tol", [(6, 32, 9, 7, torch.float32, 1e-5), (20, 64, 40, 33, torch.float32,
                                                                                        1e-5),
                                                 (16, 64, 17, 0, torch.bfloat16, 2e-2)])
def test_triton_matches_twin(H, D, Kw, Kc, dtype, tol):
    gen = torch.Generator().manual_seed(H * D)
    q, win_kv, win_idx, cmp_kv, cmp_idx, sink = _inputs(gen, H=H, D=D, Kw=Kw, Kc=max(Kc, 3), dtype=dtype)
    if Kc == 0:
        cmp_kv = cmp_idx = None
    ref = sparse_attention_torch(q.float(), win_kv.float(), win_idx, sink,
                                 None if cmp_kv is None else cmp_kv.float(), cmp_idx)
    out = sparse_attention_triton(*on_dev((q, win_kv, win_idx, sink, cmp_kv, cmp_idx)), block_h=16,
                                  block_k=16).cpu()
    assert out.dtype == dtype
    err = (out.float() - ref).norm() / ref.norm()
    assert err < tol, err
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("splits,unchain", [(1, False), (2, True), (3, False)])
def test_entry_ids_match_pool_rows(splits, unchain):
    """Compressed keys given as entry ids (cmp_start / cmp_count: the kernel makes the pool rows, as
    kernels/index_rows.py's `entry_rows_torch`): int64 ids in a column slice (as the select hands them), ids at or past
    a row's count and -1 not keys, a row with count 0; the same bits as the rows form, and the twin's form agrees."""
    gen = torch.Generator().manual_seed(60 + splits)
    q, win_kv, win_idx, cmp_kv, _, sink = _inputs(gen, N=5, H=20, D=32, Kw=12)
    start = torch.tensor([0, 7, 3, 12, 9])
    count = torch.tensor([9, 0, 11, 18, 4])
    ids = torch.randint(-1, 19, (5, 40), generator=gen)[:, 3:36]           # 33 ids a row, row stride 40
    rows = entry_rows_torch(ids, start, count, ids.shape[1])
    assert torch.equal(sparse_attention_torch(q, win_kv, win_idx, sink, cmp_kv, ids, cmp_start=start,
                                              cmp_count=count),
                       sparse_attention_torch(q, win_kv, win_idx, sink, cmp_kv, rows))
    kw = dict(block_h=16, block_k=16, splits=splits, unchain=unchain)
    want = sparse_attention_triton(*on_dev((q, win_kv, win_idx, sink, cmp_kv, rows)), **kw).cpu()
    got = sparse_attention_triton(*on_dev((q, win_kv, win_idx, sink, cmp_kv, ids)), cmp_start=on_dev(start),
                                  cmp_count=on_dev(count), **kw).cpu()
    assert torch.equal(got, want)
    assert torch.allclose(got.double(), _naive(q, win_kv, win_idx, cmp_kv, rows, sink), atol=1e-5, rtol=1e-5)


def test_bad_shapes_raise():
    gen = torch.Generator().manual_seed(1)
    q, win_kv, win_idx, cmp_kv, cmp_idx, sink = _inputs(gen)
    with pytest.raises(ValueError, match="sink"):
        sparse_attention(q, win_kv, win_idx, sink[:-1], cmp_kv, cmp_idx)
    with pytest.raises(ValueError, match="win_idx"):
        sparse_attention(q, win_kv, win_idx[:-1], sink)
    with pytest.raises(ValueError, match="cmp_start"):
        sparse_attention(q, win_kv, win_idx, sink, cmp_kv, cmp_idx, cmp_start=torch.zeros(5, dtype=torch.long))


@pytest.mark.parametrize("splits,unchain,lazy,block_h", [
    (1, False, False, 16), (3, False, False, 16), (5, False, False, 16), (3, True, False, 16), (4, True, False, 16),
    (1, True, True, 16), (3, True, True, 16), (1, False, False, 32), (3, False, False, 32)])
def test_key_splits_match_formula(splits, unchain, lazy, block_h):
    """Flash-decoding splits (a split straddling the window/compressed boundary, splits with no valid keys, a row
    with no keys at all), chained and unchained, the denominators summed per block or once after the loop
    (lazy), 16-head programs and 32-head ones of 4 warps (the default for 32 heads once the rows fill the SMs; 20
    heads here, so 12 masked rows of the tile), against the float64 formula."""
    gen = torch.Generator().manual_seed(40 + splits)
    q, win_kv, win_idx, cmp_kv, cmp_idx, sink = _inputs(gen, N=5, H=20, D=32, Kw=40, Kc=33)
    win_idx[2, 10:] = -1                                   # row 2: the later window splits see only padding
    ref = _naive(q, win_kv, win_idx, cmp_kv, cmp_idx, sink)
    out = sparse_attention_triton(*on_dev((q, win_kv, win_idx, sink, cmp_kv, cmp_idx)), block_h=block_h,
                                  block_k=16, splits=splits, unchain=unchain, lazy_sum=lazy,
                                  **({"num_warps": 4} if block_h == 32 else {})).cpu()
    assert torch.allclose(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert out[4].abs().max() == 0


@pytest.mark.parametrize("splits,block_h", [(3, 16), (2, 64)])
def test_key_split_combine_over_dim_chunks(splits, block_h):
    """Head dim 256: the split combine runs over 4 chunks of 64 output dims, each chunk's partials loaded before
    the previous chunk is stored (3 splits), or two splits of all heads merge from the last program's registers in
    4 column chunks of the accumulator; against the float64 formula (a row with no keys at all, a row with
    padding)."""
    gen = torch.Generator().manual_seed(256 + splits)
    q, win_kv, win_idx, cmp_kv, cmp_idx, sink = _inputs(gen, N=5, H=20, D=256, Kw=24, Kc=21)
    ref = _naive(q, win_kv, win_idx, cmp_kv, cmp_idx, sink)
    out = sparse_attention_triton(*on_dev((q, win_kv, win_idx, sink, cmp_kv, cmp_idx)), block_h=block_h,
                                  block_k=16, splits=splits, unchain=block_h == 64, lazy_sum=True).cpu()
    assert torch.allclose(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert out[4].abs().max() == 0


def test_default_launch_and_repeat_calls():
    """The default launch parameters, then key splits twice in a row with the same split count: the fused
    combine's ticket counters must be back at zero after each launch."""
    gen = torch.Generator().manual_seed(7)
    q, win_kv, win_idx, cmp_kv, cmp_idx, sink = _inputs(gen, N=5, H=20, D=32, Kw=24, Kc=20)
    ref = _naive(q, win_kv, win_idx, cmp_kv, cmp_idx, sink)
    args = on_dev((q, win_kv, win_idx, sink, cmp_kv, cmp_idx))
    out = sparse_attention_triton(*args).cpu()
    assert torch.allclose(out.double(), ref, atol=1e-5, rtol=1e-5)
    for _ in range(2):
        out = sparse_attention_triton(*args, block_k=16, splits=2).cpu()
        assert torch.allclose(out.double(), ref, atol=1e-5, rtol=1e-5)
        assert int(tickets(DEVICE, 5, site="attention").abs().sum()) == 0    # kernels.backend's shared counters


def test_all_heads_program_matches_formula():
    """block_h 64 (every head of a row in one program; 20 heads here, so 44 masked rows of the tile), keys pool by
    pool, against the float64 formula."""
    gen = torch.Generator().manual_seed(64)
    q, win_kv, win_idx, cmp_kv, cmp_idx, sink = _inputs(gen, N=5, H=20, D=32, Kw=40, Kc=33)
    ref = _naive(q, win_kv, win_idx, cmp_kv, cmp_idx, sink)
    out = sparse_attention_triton(*on_dev((q, win_kv, win_idx, sink, cmp_kv, cmp_idx)), block_h=64, block_k=32,
                                  num_warps=8, splits=1).cpu()
    assert torch.allclose(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert out[4].abs().max() == 0


@pytest.mark.parametrize("splits,block_k", [(1, 16), (3, 16), (4, 32)])
def test_all_heads_unchained_matches_formula(splits, block_k):
    """All heads of a row per program (20 heads in a 64-head tile), unchained (the default form at 64 heads),
    with fused key splits, against the float64 formula: a row whose later keys are all padding, a row with no
    keys at all, a row with large scores (its running max jumps); also without compressed keys."""
    gen = torch.Generator().manual_seed(90 + splits)
    q, win_kv, win_idx, cmp_kv, cmp_idx, sink = _inputs(gen, N=5, H=20, D=32, Kw=40, Kc=33)
    win_idx[2, 10:] = -1
    win_idx[4], cmp_idx[4] = -1, -1
    q[1] *= 12.0
    for with_cmp in (True, False):
        ci = cmp_idx if with_cmp else torch.full_like(cmp_idx, -1)
        ref = _naive(q, win_kv, win_idx, cmp_kv, ci, sink)
        args = (q, win_kv, win_idx, sink) + ((cmp_kv, cmp_idx) if with_cmp else (None, None))
        out = sparse_attention_triton(*on_dev(args), block_h=64, block_k=block_k, num_warps=8, splits=splits,
                                      unchain=True).cpu().double()
        assert torch.isfinite(out).all()
        assert float((out - ref).norm() / ref.norm()) < 1e-5
        assert out[4].abs().max() == 0


def test_all_heads_two_head_blocks():
    """80 heads: two 64-head tiles per row (the second with 48 masked rows), with two key splits, unchained (the
    ticket first, the last program merging from its registers): twice, the same bits, the counters back at 0.
    (Which program arrives second is up to the GPU: the two runs need not take both orders.)"""
    gen = torch.Generator().manual_seed(80)
    q, win_kv, win_idx, cmp_kv, cmp_idx, sink = _inputs(gen, N=5, H=80, D=32, Kw=20, Kc=17)
    ref = _naive(q, win_kv, win_idx, cmp_kv, cmp_idx, sink)
    args = on_dev((q, win_kv, win_idx, sink, cmp_kv, cmp_idx))
    first = sparse_attention_triton(*args, block_h=64, block_k=16, splits=2, unchain=True).cpu()
    assert torch.allclose(first.double(), ref, atol=1e-5, rtol=1e-5)
    again = sparse_attention_triton(*args, block_h=64, block_k=16, splits=2, unchain=True).cpu()
    assert torch.equal(again, first)
    assert int(tickets(DEVICE, 2 * 5 * 2, site="attention").abs().sum()) == 0    # two counters a row and tile


@pytest.mark.parametrize("splits,block_k,dtype,lazy", [(1, 16, torch.float32, False), (2, 32, torch.float32, False),
                                                       (1, 64, torch.bfloat16, False), (2, 64, torch.bfloat16, False),
                                                       (3, 16, torch.bfloat16, False), (1, 64, torch.bfloat16, True),
                                                       (2, 64, torch.bfloat16, True), (3, 16, torch.float32, True)])
def test_unchained_matches_formula(splits, block_k, dtype, lazy):
    """The unchained form (P and the rescale factors handed to the P@V dot through a per-program scratch, a barrier
    between, two buffers by key-block parity) against the float64 formula: several key blocks per program (a
    parity reuse race would show), a row whose later keys are padding, a row with no keys, a row whose running
    max jumps; the denominators summed per block or kept per column until the end (lazy, the default at 64
    heads). Compiled, only bf16 pools take the unchained path (fp32 ones fall back to the chained form)."""
    _check_twice(70 + splits + block_k, dtype, block_h=64, block_k=block_k, num_warps=8, splits=splits, unchain=True,
                 lazy_sum=lazy)


def _check_twice(seed, dtype, **kw):
    """Two launches with `kw` (scratch buffers and tickets reused) against the float64 formula: several key blocks
    per program, a row whose later keys are padding (row 2), a row with no keys (row 4: exactly 0), a row whose
    running max jumps (row 1)."""
    gen = torch.Generator().manual_seed(seed)
    q, win_kv, win_idx, cmp_kv, cmp_idx, sink = _inputs(gen, N=5, H=20, D=32, Kw=70, Kc=61, dtype=dtype)
    win_idx[2, 10:] = -1
    q[1] *= 12.0 if dtype == torch.float32 else 3.0
    ref = _naive(q, win_kv, win_idx, cmp_kv, cmp_idx, sink)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for _ in range(2):
        out = sparse_attention_triton(*on_dev((q, win_kv, win_idx, sink, cmp_kv, cmp_idx)), **kw).cpu().double()
        assert torch.isfinite(out).all()
        assert float((out - ref).norm() / ref.norm()) < tol
        assert out[4].abs().max() == 0


@pytest.mark.skipif(DEVICE == "cpu", reason="V4 decode shapes: too slow for the interpreter; runs compiled")
@pytest.mark.parametrize("N,H", [(64, 64), (200, 64), (8, 64), (33, 64), (64, 32), (128, 32), (256, 32), (8, 32)])
def test_default_dispatch_at_v4_decode_shapes(N, H):
    """The dispatched launch (default_config) at the models' shapes (V4.1's 64 heads, the mid-size model's 32; D =
    512, 128 window + 512 gathered compressed keys, bf16) against the twin in fp32: the configurations the engine
    runs (64 heads: two splits merged from registers at 64 rows, one at 200, 16-head programs with five / two
    splits stored and merged by the last program at 8 / 33 rows; 32 heads: 16-head programs with two key splits
    at 64 rows and five at 8,
    32-head programs with two splits at 128 rows and one at 256); then the engine's form of each (RoPE inside, the
    window from each row's (first, skip))."""
    gen = torch.Generator().manual_seed(N + H)
    q = torch.randn(N, H, 512, generator=gen).bfloat16()
    win = torch.randn(N * 128, 512, generator=gen).bfloat16()
    cmp_ = torch.randn(N * 600, 512, generator=gen).bfloat16()
    wi = torch.arange(N)[:, None] * 128 + torch.arange(128)
    ci = torch.arange(N)[:, None] * 600 + torch.randperm(600, generator=gen)[:512]
    wi[3, 100:] = -1
    sink = torch.randn(H, generator=gen)
    ref = sparse_attention_torch(q.float(), win.float(), wi, sink, cmp_.float(), ci)
    out = sparse_attention(*on_dev((q, win, wi, sink, cmp_, ci))).cpu().float()
    assert float((out - ref).norm() / ref.norm()) < 1e-2
    # the engine's form: RoPE inside (64 rotated channels) and the window from each row's (first, skip)
    rows = torch.stack([torch.arange(N) * 128, torch.zeros(N, dtype=torch.int64)], 1)
    rows[3] = torch.tensor([3 * 128 - 28, 28])     # row 3: wi's 100 keys, at the window's last 100 places
    turn, _ = _turns(gen, N, 64)
    ref = sparse_attention_torch(q.float(), win.float(), wi, sink, cmp_.float(), ci, turn=turn)
    out = sparse_attention(*on_dev((q, win, rows, sink, cmp_, ci)), turn=on_dev(turn), window=128).cpu().float()
    assert float((out - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.parametrize("N,n_keys,want", [(32, 640, (16, 4)), (64, 640, (16, 2)), (128, 640, (32, 2)),
                                           (256, 640, (32, 1)), (64, 57, (16, 1)), (256, 57, (32, 1))])
def test_default_config_for_32_heads(N, n_keys, want):
    """default_config's rule for fewer than 64 heads (its docstring's table: 16-head programs while they can take
    two key splits of at least two 64-key blocks each, else 32-head programs once they fill the SMs) on an H200's
    132 SMs: (block_h, splits) at the mid-size model's 32 heads, D = 512, 128 + 512 keys and the step's short rows."""
    cfg = default_config(N, 32, 512, n_keys)
    assert (cfg["block_h"], cfg["splits"]) == want and cfg["num_warps"] == 4 and cfg["block_k"] == 64


@pytest.mark.parametrize("N,want", [(8, (16, 5, 4)), (16, (16, 4, 4)), (33, (16, 2, 4)), (34, (64, 3, 8)),
                                    (64, (64, 2, 8)), (256, (64, 1, 8))])
def test_default_config_for_64_heads(N, want):
    """At V4.1's 64 heads (D = 512, 128 + 512 keys, 132 SMs) few rows take the 16-head programs while every (row,
    16-head block) has an SM (their docstring's session-15 table), more rows the all-head programs with sms // N
    key splits: (block_h, splits, num_warps)."""
    cfg = default_config(N, 64, 512, 640)
    assert (cfg["block_h"], cfg["splits"], cfg["num_warps"]) == want


@pytest.mark.parametrize("N", [8, 16])
def test_default_config_above_64_heads_keeps_all_head_programs(N):
    """The 16-head rule was measured at 32 and 64 heads only: 128 heads at few rows (8 / 16 rows, 8 x 8 / 16 x 8
    (row, 16-head block) pairs within 132 SMs) keep the 64-head programs with min(8, sms // N) key splits."""
    cfg = default_config(N, 128, 512, 640)
    assert (cfg["block_h"], cfg["splits"], cfg["num_warps"]) == (64, 8, 8) and cfg["unchain"] and cfg["lazy_sum"]


def test_scale_is_a_run_time_argument():
    """Two scales through the same compiled kernel (the scale is a plain float argument, not a constexpr) against
    the twin at each."""
    gen = torch.Generator().manual_seed(77)
    q, win_kv, win_idx, cmp_kv, cmp_idx, sink = _inputs(gen, N=5, H=16, D=32, Kw=24, Kc=20)
    for scale in (0.05, 0.3):
        ref = sparse_attention_torch(q, win_kv, win_idx, sink, cmp_kv, cmp_idx, scale=scale).double()
        out = sparse_attention_triton(*on_dev((q, win_kv, win_idx, sink, cmp_kv, cmp_idx)), scale=scale,
                                      block_h=16, block_k=16, num_warps=4).cpu().double()
        assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5), scale


def _turns(gen, N, R):
    """A random turn per row, fp32 [N, R/2, 2] (kernels/rope.py's table), and its conjugate."""
    ang = torch.rand(N, R // 2, generator=gen) * 6.283
    return torch.stack([ang.cos(), ang.sin()], -1), torch.stack([ang.cos(), -ang.sin()], -1)


@pytest.mark.parametrize("D,R,H,kw", [
    (32, 8, 20, dict(block_h=16, splits=1)), (32, 8, 20, dict(block_h=16, splits=3)),
    (32, 8, 20, dict(block_h=32, splits=1, num_warps=4)),
    (32, 8, 20, dict(block_h=64, splits=2, unchain=True, lazy_sum=True)),
    (32, 8, 20, dict(block_h=64, splits=1, unchain=True, lazy_sum=True)),
    (128, 16, 6, dict(block_h=16, splits=3)), (256, 64, 6, dict(block_h=64, splits=2, unchain=True))])
def test_rope_inside_matches_three_steps(D, R, H, kw):
    """RoPE inside (turn): q's last R channels turned as they load, the output's turned back before it is stored,
    in every store path (one split; the last of three splits merging their stored partials, the rotated channels in
    the last of the 64-dim chunks at D = 128 / 256; two splits of all heads merged from registers, the rotated
    channels in two of the four column chunks at D = 32, in one at D = 256), with entry ids, against the twin's
    three steps (rope on q, attention, the inverse rope): the twin's turn form is those steps with one rounding
    (fp32 here: the same bits), and the kernel matches it; rows with padding and no keys as elsewhere."""
    gen = torch.Generator().manual_seed(D + R + len(kw))
    q, win_kv, win_idx, cmp_kv, _, sink = _inputs(gen, N=5, H=H, D=D, Kw=40, Kc=33)
    start, count = torch.tensor([0, 7, 3, 12, 9]), torch.tensor([9, 0, 11, 18, 4])
    ids = torch.randint(-1, 19, (5, 33), generator=gen)
    ids[4] = -1                                                    # row 4: no keys at all
    turn, inv = _turns(gen, 5, R)
    three = apply_rope_torch(sparse_attention_torch(apply_rope_torch(q, turn), win_kv, win_idx, sink, cmp_kv, ids,
                                                    cmp_start=start, cmp_count=count), inv)
    twin = sparse_attention_torch(q, win_kv, win_idx, sink, cmp_kv, ids, cmp_start=start, cmp_count=count, turn=turn)
    assert torch.equal(twin, three)
    out = sparse_attention_triton(*on_dev((q, win_kv, win_idx, sink, cmp_kv, ids)), cmp_start=on_dev(start),
                                  cmp_count=on_dev(count), turn=on_dev(turn), block_k=16, **kw).cpu()
    assert torch.allclose(out, twin, atol=1e-5, rtol=1e-5)
    assert out[4].abs().max() == 0


def test_rope_inside_bf16_rounds_once():
    """bf16: q turned and rounded as kernels/rope.py's kernel turns it (the unturned output channels are the bits
    of the kernel run on a q that kernel turned), the output's turned channels rounded once (within one bf16 step
    of the three launches' double rounding)."""
    gen = torch.Generator().manual_seed(16)
    q, win_kv, win_idx, cmp_kv, cmp_idx, sink = _inputs(gen, N=5, H=16, D=64, Kw=24, Kc=20, dtype=torch.bfloat16)
    turn, inv = _turns(gen, 5, 16)
    args = on_dev((win_kv, win_idx, sink, cmp_kv, cmp_idx))
    kw = dict(block_h=16, block_k=16, splits=1)
    out = sparse_attention_triton(on_dev(q), *args, turn=on_dev(turn), **kw).cpu()
    plain = sparse_attention_triton(apply_rope_triton(*on_dev((q, turn))), *args, **kw).cpu()
    assert torch.equal(out[..., :48], plain[..., :48])
    assert torch.allclose(out[..., 48:].float(), apply_rope_torch(plain, inv)[..., 48:].float(), atol=2e-2, rtol=1e-2)
    twin = sparse_attention_torch(q, win_kv, win_idx, sink, cmp_kv, cmp_idx, turn=turn)
    assert float((out.float() - twin.float()).norm() / twin.float().norm()) < 1e-2


def test_rope_inside_wants_a_power_of_two_rotated_width():
    """The Triton path turns q's rotated channels as a tl.arange of R: R = 24 (a multiple of 8, not a power of two)
    is refused before any launch, with a message naming the width."""
    gen = torch.Generator().manual_seed(23)
    q, win_kv, win_idx, cmp_kv, cmp_idx, sink = _inputs(gen, N=5, H=4, D=32)
    turn, _ = _turns(gen, 5, 24)
    with pytest.raises(ValueError, match="24 rotated channels \\(want a power of two >= 8\\)"):
        sparse_attention_triton(*on_dev((q, win_kv, win_idx, sink, cmp_kv, cmp_idx)), turn=on_dev(turn))


def test_rope_inside_with_a_misaligned_q():
    """q's staged load claims 16-byte aligned rows: a q view starting 4 bytes into its buffer (data_ptr % 16 != 0)
    gives the bits of the same launch on an aligned copy."""
    gen = torch.Generator().manual_seed(24)
    q, win_kv, win_idx, cmp_kv, cmp_idx, sink = _inputs(gen, N=5, H=16, D=32)
    turn, _ = _turns(gen, 5, 8)
    buf = on_dev(torch.empty(q.numel() + 1))
    shifted = buf[1:].view(q.shape).copy_(on_dev(q))
    assert shifted.data_ptr() % 16 != 0
    args = on_dev((win_kv, win_idx, sink, cmp_kv, cmp_idx))
    kw = dict(turn=on_dev(turn), block_h=16, block_k=16, splits=1)
    got = sparse_attention_triton(shifted, *args, **kw).cpu()
    assert torch.equal(got, sparse_attention_triton(on_dev(q), *args, **kw).cpu())


@pytest.mark.parametrize("kw", [dict(block_h=16, splits=1), dict(block_h=16, splits=3),
                                dict(block_h=64, splits=2, unchain=True, lazy_sum=True)])
def test_window_rows_match_window_ids(kw):
    """window W: each row's (first, skip) (int64 [N, 2], batched.window_index's rows) instead of its [W] window ids;
    the gather makes the pool rows first + j for skip <= j < W, its loop starting at the row's first key: a row
    whose window reaches back past its first key (skip < 0), one starting at 0 (these two: the ids form's key
    blocks, so its bits), two partly filled ones, one with no window keys (skip = W); splits cutting the window;
    against the float64 formula, and the twin's form agrees."""
    gen = torch.Generator().manual_seed(41 + kw["splits"])
    q, win_kv, _, cmp_kv, cmp_idx, sink = _inputs(gen, N=5, H=20, D=32, Pw=200, Kc=21)
    W = 40
    rows = torch.tensor([[150, -30], [3, 0], [90, 7], [0, 39], [60, 40]])
    j = torch.arange(W)
    ids = torch.where(j >= rows[:, 1:2], rows[:, :1] + j, -1)
    assert torch.equal(sparse_attention_torch(q, win_kv, rows, sink, cmp_kv, cmp_idx, window=W),
                       sparse_attention_torch(q, win_kv, ids, sink, cmp_kv, cmp_idx))
    args = on_dev((q, win_kv, rows, sink, cmp_kv, cmp_idx))
    got = sparse_attention_triton(*args, window=W, block_k=16, **kw).cpu()
    want = sparse_attention_triton(*on_dev((q, win_kv, ids, sink, cmp_kv, cmp_idx)), block_k=16, **kw).cpu()
    assert torch.equal(got[:2], want[:2])
    assert torch.allclose(got.double(), _naive(q, win_kv, ids, cmp_kv, cmp_idx, sink), atol=1e-5, rtol=1e-5)
    assert got[4].abs().max() == 0 and torch.allclose(got, want, atol=1e-5, rtol=1e-5)    # (row 4: no keys at all)


@pytest.mark.parametrize("kw", [dict(block_h=16, splits=1), dict(block_h=16, splits=3),
                                dict(block_h=64, splits=2, unchain=True, lazy_sum=True)])
def test_visible_entries_match_their_ids(kw):
    """visible (positions, ratio, G): the compressed keys are every entry id g < G with g < (p + 1) // ratio (the
    "all"-kind layers), made in the gather, against the engine's id list (batched.span's where over an arange):
    rows seeing all their entries, some, none (count 0, position 0), one whose position sees past its count; G
    past every row's count; with the window keys from each row's (first, skip) and RoPE inside as the step runs it.
    The same bits as the id form when the loop's blocks are the same (rows whose visible entries reach G's last
    block), else to round-off; the float64 formula; the twin's form agrees."""
    gen = torch.Generator().manual_seed(17 + kw["splits"])
    q, win_kv, _, cmp_kv, _, sink = _inputs(gen, N=5, H=20, D=32, Pw=200, Pc=80)
    W, G, ratio = 24, 48, 2
    rows = torch.tensor([[150, -3], [3, 0], [90, 7], [0, 20], [60, 24]])
    start, count = torch.tensor([0, 7, 3, 12, 30]), torch.tensor([40, 0, 30, 45, 50])
    positions = torch.tensor([79, 100, 30, 200, 95])
    g = torch.arange(G)[None, :]
    ids = torch.where(g < ((positions + 1) // ratio)[:, None], g, -1)
    turn, _ = _turns(gen, 5, 8)
    vis = (positions, ratio, G)
    assert torch.equal(sparse_attention_torch(q, win_kv, rows, sink, cmp_kv, None, cmp_start=start, cmp_count=count,
                                              window=W, visible=vis, turn=turn),
                       sparse_attention_torch(q, win_kv, rows, sink, cmp_kv, ids, cmp_start=start, cmp_count=count,
                                              window=W, turn=turn))
    common = dict(cmp_start=on_dev(start), cmp_count=on_dev(count), window=W, turn=on_dev(turn), block_k=16, **kw)
    got = sparse_attention_triton(*on_dev((q, win_kv, rows, sink, cmp_kv)), visible=on_dev(vis), **common).cpu()
    want = sparse_attention_triton(*on_dev((q, win_kv, rows, sink, cmp_kv, ids)), **common).cpu()
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[3], want[3])
    j = torch.arange(W)
    win_ids = torch.where(j >= rows[:, 1:2], rows[:, :1] + j, -1)
    ref = _naive(apply_rope_torch(q, turn), win_kv, win_ids, cmp_kv,
                 entry_rows_torch(ids, start, count, G), sink)
    assert torch.allclose(apply_rope_torch(got, turn).double(), ref, atol=1e-5, rtol=1e-5)
