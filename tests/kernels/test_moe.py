"""Routed experts: twin vs the formula per token and expert; Triton grouped kernels vs twin."""
import pytest
import torch

from deepinfer_sg.kernels import moe as moe_mod
from deepinfer_sg.kernels.moe import (align_pairs, align_pairs_triton, default_block_m, dequantize_expert, moe_experts,
                                      moe_experts_torch, moe_experts_triton, quantize_fp8_rows, tma_ok)
from helpers import on_dev


def _inputs(gen, T=7, H=40, F=24, E=5, K=3, dtype=torch.float32):
    x = (torch.randn(T, H, generator=gen) * 2).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    weights = torch.rand(T, K, generator=gen) + 0.1
    w1 = (torch.randn(E, F, H, generator=gen) * 0.6).to(dtype)    # large enough that the clamps at L bite
    w3 = (torch.randn(E, F, H, generator=gen) * 0.6).to(dtype)
    w2 = (torch.randn(E, H, F, generator=gen) * 0.2).to(dtype)
    return x, ids, weights, w1, w3, w2


def test_twin_matches_formula():
    gen = torch.Generator().manual_seed(0)
    x, ids, wts, w1, w3, w2 = _inputs(gen)
    out = moe_experts_torch(x, ids, wts, w1, w3, w2, swiglu_limit=4.0)
    clamped = 0
    for t in range(x.shape[0]):
        ref = torch.zeros(x.shape[1], dtype=torch.float64)
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            g = w1[e].double() @ x[t].double()
            u = w3[e].double() @ x[t].double()
            clamped += int((g > 4).sum() + (u.abs() > 4).sum())
            g = torch.minimum(g, torch.tensor(4.0, dtype=torch.float64))
            a = g / (1 + torch.exp(-g)) * u.clamp(-4, 4)
            ref += float(wts[t, k]) * (w2[e].double() @ a)
        assert torch.allclose(out[t].double(), ref, rtol=1e-4, atol=1e-4)
    assert clamped > 0


def test_align_pairs_groups_every_pair_once():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 6, (9, 2), generator=gen)
    slot_pair, block_expert = align_pairs(ids, 6, 4)
    seen = slot_pair[slot_pair >= 0]
    assert sorted(seen.tolist()) == list(range(18))
    for s, p in enumerate(slot_pair.tolist()):
        if p >= 0:
            assert int(block_expert[s // 4]) == int(ids.view(-1)[p])


@pytest.mark.parametrize("T,H,F,E,K,dtype,tol", [(7, 40, 24, 5, 3, torch.float32, 1e-5),
                                                 (19, 70, 50, 9, 2, torch.float32, 1e-5),
                                                 (5, 64, 32, 4, 2, torch.bfloat16, 2e-2)])
def test_triton_matches_twin(T, H, F, E, K, dtype, tol):
    gen = torch.Generator().manual_seed(T * H)
    x, ids, wts, w1, w3, w2 = _inputs(gen, T, H, F, E, K, dtype)
    ref = moe_experts_torch(x.float(), ids, wts, w1.float(), w3.float(), w2.float(), swiglu_limit=4.0)
    out = moe_experts_triton(*on_dev((x, ids, wts, w1, w3, w2)), swiglu_limit=4.0, block_m=16, block_n=32,
                             block_k=32).cpu()
    assert out.dtype == dtype
    err = (out.float() - ref).norm() / ref.norm()
    assert err < tol, err


@pytest.mark.parametrize("T,K,E,bm", [(9, 2, 6, 4), (40, 3, 7, 16), (1, 1, 3, 16), (33, 6, 64, 16)])
def test_align_kernel_matches_torch_align(T, K, E, bm):
    """The one-launch Triton alignment writes exactly align_pairs' layout (stable order inside an expert, -1
    padding, -1 blocks past the end); skewed routing makes one expert span several blocks."""
    gen = torch.Generator().manual_seed(T * E)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    ids[: T // 2, 0] = 0                                     # expert 0 gets many pairs (several blocks when T >= 2bm)
    ref_pairs, ref_blocks = align_pairs(ids, E, bm)
    pairs, blocks = align_pairs_triton(on_dev(ids), E, bm)
    assert torch.equal(pairs.cpu().long(), ref_pairs) and torch.equal(blocks.cpu().long(), ref_blocks)


@pytest.mark.parametrize("tma", [False, True])
def test_triton_skewed_routing_and_options(tma):
    """An expert with more pairs than one block (weights read once per block), separate down-kernel tiles, the
    automatic block size, activations loaded a step ahead or not, and (aligned shapes) the tensor-descriptor
    weight loads."""
    gen = torch.Generator().manual_seed(5)
    T, H, F, E, K = 37, 64, 48, 6, 2
    x, ids, wts, w1, w3, w2 = _inputs(gen, T, H, F, E, K)
    ids[:, 0] = 3                                            # every token picks expert 3 first
    ids[:, 1] = torch.where(ids[:, 1] == 3, torch.full_like(ids[:, 1], 5), ids[:, 1])
    ref = moe_experts_torch(x, ids, wts, w1, w3, w2, swiglu_limit=4.0)
    for bm, down, pf in ((16, (32, 32, 4, 2), True), (None, None, False)):   # tiles that do not divide F = 48
        out = moe_experts_triton(*on_dev((x, ids, wts, w1, w3, w2)), swiglu_limit=4.0, block_m=bm, block_n=32,
                                 block_k=32, down=down, tma=tma, prefetch=pf).cpu()
        err = (out - ref).norm() / ref.norm()
        assert err < 1e-5, (bm, err)
    assert default_block_m(64, 6, 64) == 16 and default_block_m(256, 6, 64) == 32 and default_block_m(256, 6, 384) == 16


@pytest.mark.parametrize("tma,compute", [(False, "bf16"), (True, "bf16"), (True, "fp16")])
def test_fp8_weights_match_dequantized_twin(tma, compute):
    """fp8 weights with per-row scales: the kernel equals the bf16 path on the dequantized weights (checked
    against the twin given the same fp8 weights, and the twin against the formula on the dequantized copies)."""
    gen = torch.Generator().manual_seed(8)
    T, H, F, E, K = 21, 64, 48, 5, 2
    x, ids, wts, w1, w3, w2 = _inputs(gen, T, H, F, E, K)
    (q1, s1), (q3, s3), (q2, s2) = quantize_fp8_rows(w1), quantize_fp8_rows(w3), quantize_fp8_rows(w2)
    ref = moe_experts_torch(x, ids, wts, q1, q3, q2, swiglu_limit=4.0, scales=(s1, s3, s2))
    deq = moe_experts_torch(x, ids, wts, q1.float() * s1[..., None], q3.float() * s3[..., None],
                            q2.float() * s2[..., None], swiglu_limit=4.0)
    assert torch.allclose(ref, deq, atol=1e-5, rtol=1e-5)
    assert (ref - moe_experts_torch(x, ids, wts, w1, w3, w2, swiglu_limit=4.0)).norm() / ref.norm() < 0.1
    x16 = x.to(torch.bfloat16)
    out = moe_experts_triton(*on_dev((x16, ids, wts, q1, q3, q2)), swiglu_limit=4.0, block_n=32, block_k=32,
                             tma=tma, scales=on_dev((s1, s3, s2)), fp8_compute=compute).cpu()
    ref16 = moe_experts_torch(x16.float(), ids, wts, q1, q3, q2, swiglu_limit=4.0, scales=(s1, s3, s2))
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref16).norm() / ref16.norm() < 2e-2
    with pytest.raises(ValueError, match="scales"):
        moe_experts(x, ids, wts, q1, q3, q2)


def _block_scaled(gen, E, N, K, R, max_shift):
    """fp8 weights with block scales as the loader keeps them: row scale 2**r (the row's largest block scale) and
    per-(R rows x 32 columns) shifts in [0, max_shift], every shift value present."""
    w = (torch.randn(E, N, K, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    kg = -(-K // 32)
    ng = -(-N // R)
    shift = torch.randint(0, max_shift + 1, (E, kg, ng), generator=gen, dtype=torch.int64)   # group-major
    shift.view(-1)[: max_shift + 1] = torch.arange(max_shift + 1)
    shift[:, 0, :] = 0                                           # the row's largest scale has shift 0
    row = torch.exp2(torch.randint(-14, -8, (E, ng), generator=gen).float()).repeat_interleave(R, 1)[:, :N]
    return w, row.contiguous(), shift.to(torch.uint8)


# shifts scale fp32 partial products (not the widened weights), so fp16 widening stays exact for large shifts
@pytest.mark.parametrize("R,max_shift,compute,tma", [(1, 15, "fp16", True), (32, 15, "fp16", False),
                                                     (1, 40, "bf16", True), (32, 15, "bf16", True),
                                                     (1, 60, "fp16", False), (32, 19, "fp16", True)])
def test_block_scaled_fp8_matches_hand_dequantization(R, max_shift, compute, tma):
    """Block scales (FP4 experts' 1x32 groups as R=1, FP8 experts' 32x32 blocks as R=32): the twin equals the
    formula on weights dequantized here by hand (w8 * row scale * 2**-shift of the element's block), and the
    kernel equals the twin. Shapes leave partial 32-blocks (F=48); shifts past fp16's range with fp16 widening."""
    gen = torch.Generator().manual_seed(R + max_shift)
    T, H, F, E, K = 23, 64, 48, 5, 2
    x, ids, wts, _, _, _ = _inputs(gen, T, H, F, E, K)
    ws = [_block_scaled(gen, E, n, k, R, max_shift) for n, k in ((F, H), (F, H), (H, F))]
    hand = []
    for w, row, shift in ws:
        full = torch.empty(w.shape)
        for e in range(E):
            for i in range(w.shape[1]):
                for j in range(w.shape[2]):
                    full[e, i, j] = float(w[e, i, j].float()) * float(row[e, i]) * 2.0 ** -int(shift[e, j // 32, i // R])
        hand.append(full)
    assert torch.equal(dequantize_expert(ws[2][0][1], ws[2][1][1], ws[2][2][1], R), hand[2][1])
    kw = dict(scales=tuple(w[1] for w in ws), shifts=tuple(w[2] for w in ws), shift_rows=R)
    q = tuple(w[0] for w in ws)
    ref = moe_experts_torch(x, ids, wts, *q, swiglu_limit=4.0, **kw)
    assert torch.allclose(ref, moe_experts_torch(x, ids, wts, *hand, swiglu_limit=4.0), atol=1e-5, rtol=1e-5)
    x16 = x.to(torch.bfloat16)
    ref16 = moe_experts_torch(x16.float(), ids, wts, *q, swiglu_limit=4.0, **kw)
    out = moe_experts_triton(*on_dev((x16, ids, wts) + q), swiglu_limit=4.0, block_n=32, block_k=32, tma=tma,
                             fp8_compute=compute, prefetch=max_shift > 15, **on_dev(kw)).cpu()
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref16).norm() / ref16.norm() < 1e-2
    with pytest.raises(ValueError, match="shifts must be uint8"):
        moe_experts_torch(x, ids, wts, *q, scales=kw["scales"], shifts=(kw["shifts"][0].int(),) + kw["shifts"][1:],
                          shift_rows=R)


def _e2m1_by_hand(code: int) -> float:
    s, e, m = (code >> 3) & 1, (code >> 1) & 3, code & 1
    mag = m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
    return -mag if s else mag


@pytest.mark.parametrize("tma,H,F,bk", [(True, 64, 64, 32), (False, 96, 80, 64), (True, 64, 96, 128),
                                        (True, 96, 64, 64)])
def test_packed_fp4_weights(tma, H, F, bk):
    """Packed FP4 experts (two E2M1 codes a byte, low nibble first) with 1x32 group shifts up to 23 (and a row
    of 126): the twin decodes them as the bit formula says; the kernels decode them in registers with the shifts
    folded in (compiled: the inline-PTX bf16 decode; the interpreter: the plain one) and equal both the twin and
    the same weights repacked to fp8 (the same values: e2m1 is a subset of e4m3) up to the order of the fp32 sums
    (at most one bf16 rounding step apart). Row 1 of expert 0's three weights has every group at shift 126 and a
    row scale of 2**120, so its decoded weights are bf16 subnormals (codes 0.5, 1) and small normals that carry
    its output channel: a decode that flushed them or clamped the shift fails the per-element check. H=96 /
    F=80 leave a partial 32-group, and steps of bk = 64 / 128 columns partial steps; F=80's 40-byte rows rule out
    tensor descriptors."""
    gen = torch.Generator().manual_seed(11 + H + F)
    T, E, K = 19, 4, 2
    x, ids, wts, _, _, _ = _inputs(gen, T, H, F, E, K)
    packed, fp8, scales, shifts = [], [], [], []
    for n, k in ((F, H), (F, H), (H, F)):
        codes = torch.randint(0, 16, (E, n, k), generator=gen, dtype=torch.uint8)
        codes.view(-1)[:16] = torch.arange(16, dtype=torch.uint8)
        packed.append((codes[..., 0::2] | (codes[..., 1::2] << 4)).view(torch.int8))
        fp8.append(torch.tensor([_e2m1_by_hand(c) for c in range(16)])[codes.long()].to(torch.float8_e4m3fn))
        g = torch.randint(0, 24, (E, -(-k // 32), n), generator=gen, dtype=torch.uint8)
        g[:, 0, :] = 0
        g[0, :, 1] = 126                         # the largest exact shift (bf16 subnormals for codes 0.5 and 1)
        shifts.append(g)
        sc = torch.exp2(torch.randint(-12, -6, (E, n), generator=gen).float())
        sc[0, 1] = 2.0 ** 120                    # ... in a row of its own, so that its products count (below)
        scales.append(sc)
    kw = dict(scales=tuple(scales), shifts=tuple(shifts), shift_rows=1)
    e, r, c = 2, 5, 7                                                    # one weight decoded by hand
    code = (int(packed[2][e, r, c // 2].view(torch.uint8)) >> (4 * (c % 2))) & 15
    assert dequantize_expert(packed[2][e], scales[2][e], shifts[2][e])[r, c].item() == \
        _e2m1_by_hand(code) * float(scales[2][e, r]) * 2.0 ** -int(shifts[2][e, c // 32, r])
    assert (ids == 0).any()                                              # expert 0's row 1 is used
    ref = moe_experts_torch(x, ids, wts, *packed, swiglu_limit=4.0, **kw)
    assert torch.equal(ref, moe_experts_torch(x, ids, wts, *fp8, swiglu_limit=4.0, **kw))
    x16 = x.to(torch.bfloat16)
    ref16 = moe_experts_torch(x16.float(), ids, wts, *packed, swiglu_limit=4.0, **kw)
    common = dict(swiglu_limit=4.0, block_n=32, block_k=32, tma=tma, **on_dev(kw))
    out = moe_experts_triton(*on_dev((x16, ids, wts) + tuple(packed)), **dict(common, block_k=bk)).cpu()
    out8 = moe_experts_triton(*on_dev((x16, ids, wts) + tuple(fp8)), **common).cpu()
    assert (out.float() - ref16).norm() / ref16.norm() < 1e-2
    assert ((out.float() - out8.float()).abs() <= out8.float().abs() * 2.0 ** -7 + 1e-30).all()
    with pytest.raises(ValueError, match="group shifts"):
        moe_experts_torch(x, ids, wts, *packed, scales=kw["scales"])
    if H == 64:                                      # the kernels read int32 words of 8 codes
        with pytest.raises(ValueError, match="multiples of 8"):
            moe_experts_triton(x16[:, :60], ids, wts, packed[0][..., :30], packed[1][..., :30], packed[2][:, :60],
                               scales=(scales[0], scales[1], scales[2][:, :60]),
                               shifts=(shifts[0][:, :2], shifts[1][:, :2], shifts[2][:, :, :60]))


@pytest.mark.parametrize("T,E", [(24, 2), (5, 3), (40, 2)])
def test_packed_fp4_tiles_per_shape(T, E, monkeypatch):
    """w4_tiles' rules (8 uncapped warps for 32-row blocks; no caps for 64-row blocks; 64-row gate/up tiles under
    one wave of programs) hold at the mid-size shape and leave V4.1's decode alone; moe_experts (CUDA's dispatch
    forced, the kernels interpreted) launches exactly the tiles w4_tiles picks, and those builds give the twin's
    results: T=24 pairs of each of 2 experts make 32-row blocks, 3 experts of 128 rows a small grid, T=40 of 2
    experts 64-row blocks."""
    mid = dict(K=6, E=64, F=1024, device="cpu")
    assert moe_mod.w4_tiles(256, **mid)["num_warps"] == 8 and moe_mod.w4_tiles(256, **mid)["maxnreg"] is None
    assert moe_mod.w4_tiles(8, **mid)["block_n"] == 64 and moe_mod.w4_tiles(8, **mid)["down"][0] == 128
    assert moe_mod.w4_tiles(64, **mid) is moe_mod.W4_TILES
    assert all(moe_mod.w4_tiles(t, 6, 384, 2304, "cpu") is moe_mod.W4_TILES for t in (8, 64, 256))  # V4.1 decode
    assert moe_mod.w4_tiles(4096, 6, 384, 2304, "cpu") == dict(moe_mod.W4_TILES, maxnreg=None)   # prefill
    gen = torch.Generator().manual_seed(T * E)
    H = F = 128
    K = 2
    x, ids, wts, _, _, _ = _inputs(gen, T, H, F, E, K)
    ws = tuple(torch.randint(0, 256, (E, n, k // 2), generator=gen, dtype=torch.uint8) for n, k in ((F, H), (F, H),
                                                                                                    (H, F)))
    kw = dict(scales=tuple(torch.exp2(torch.randint(-8, -4, (E, n), generator=gen).float()) for n in (F, F, H)),
              shifts=tuple(torch.randint(0, 8, (E, k // 32, n), generator=gen, dtype=torch.uint8)
                           for n, k in ((F, H), (F, H), (H, F))), shift_rows=1)
    tiles = moe_mod.w4_tiles(T, K, E, F, on_dev(x).device)
    assert (tiles["num_warps"] == 8) == (T == 24) and (tiles["block_n"] == 64) == (T == 5)
    assert (tiles["maxnreg"] is None) == (T != 5) and moe_mod.default_block_m(T, K, E) == {24: 32, 5: 16, 40: 64}[T]
    picked = []
    real = moe_mod.moe_experts_triton
    monkeypatch.setattr(moe_mod, "use_triton", lambda t: True)
    monkeypatch.setattr(moe_mod, "moe_experts_triton", lambda *a, **k: picked.append(k) or real(*a, **k))
    x16 = x.to(torch.bfloat16)
    ref = moe_experts_torch(x16.float(), ids, wts, *ws, swiglu_limit=4.0, **kw)
    out = moe_experts(*on_dev((x16, ids, wts) + ws), swiglu_limit=4.0, **on_dev(kw)).cpu()
    assert len(picked) == 1 and {k: picked[0][k] for k in tiles} == tiles
    assert (out.float() - ref).norm() / ref.norm() < 1e-2


def test_tma_preconditions():
    """The bulk-copy rules the kernel relies on (checked here by hand from the rule, no GPU needed): 16-byte
    aligned base and row stride, an inner box of >= 16 bytes, and box bytes a multiple of 128 (back-to-back
    pipelined shared-memory slots, each copy's destination 128-byte aligned). Session 3's shift boxes ([1, 32]
    and [2, 32] bytes) broke the last rule and faulted with "misaligned address" on the H200."""
    u8 = torch.zeros(4, 64, 32, dtype=torch.uint8)
    assert not tma_ok(u8.view(-1, 32), (1, 32)) and not tma_ok(u8.view(-1, 32), (2, 32))   # 32 / 64-byte boxes
    assert tma_ok(u8.view(-1, 32), (32, 16)) and not tma_ok(u8.view(-1, 32), (32, 8))        # inner box >= 16 B
    f8 = torch.zeros(4, 48, 40).to(torch.float8_e4m3fn)
    assert not tma_ok(f8.view(-1, 40), (32, 32))                                   # 40-byte rows: not 16-aligned
    bf = torch.zeros(2, 64, 72, dtype=torch.bfloat16)
    assert tma_ok(bf.view(-1, 72), (64, 64)) and not tma_ok(bf.view(-1, 72)[:, 1:], (64, 64))  # offset base
    # the engine's tiles at V4.1-Flash's shape (H=5120, F=2304): every weight box is legal, so all take TMA
    for packed in (False, True):
        for tiles in (moe_mod.FP8_TILES, moe_mod.FP8_SHIFT_TILES):
            c = 2 if packed else 1
            for n, k in ((2304, 5120), (5120, 2304)):
                w = torch.empty(2, n, k // c, dtype=torch.uint8 if packed else torch.float8_e4m3fn)
                assert tma_ok(w.view(-1, k // c), (tiles["block_n"], tiles["block_k"] // c)), (packed, tiles, n)
    for n, k in ((2304, 5120), (5120, 2304)):                       # packed FP4 as int32 words (swapped kernels)
        w4 = torch.empty(2, n, k // 8, dtype=torch.int32)
        assert tma_ok(w4.view(-1, k // 8), (moe_mod.W4_TILES["block_n"], moe_mod.W4_TILES["block_k"] // 8)), n
    assert moe_mod.FP8_SHIFT_TILES["block_k"] == 32                  # block shifts: one 32-group per K tile


def test_block_shifts_need_group_wide_k_tiles():
    gen = torch.Generator().manual_seed(3)
    x, ids, wts, _, _, _ = _inputs(gen, 5, 64, 32, 3, 2)
    ws = [_block_scaled(gen, 3, n, k, 1, 4) for n, k in ((32, 64), (32, 64), (64, 32))]
    with pytest.raises(ValueError, match="one 32-group"):
        moe_experts_triton(x.bfloat16(), ids, wts, *(w[0] for w in ws), scales=tuple(w[1] for w in ws),
                           shifts=tuple(w[2] for w in ws), block_k=64)


def test_bad_shapes_raise():
    gen = torch.Generator().manual_seed(2)
    x, ids, wts, w1, w3, w2 = _inputs(gen)
    with pytest.raises(ValueError, match="w2 must be"):
        moe_experts(x, ids, wts, w1, w3, w2.transpose(1, 2))
