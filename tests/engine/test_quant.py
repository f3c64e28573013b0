"""Codecs of engine/quant.py against independent computations: bit-level decoding by hand, torch's float8 dtypes,
brute-force nearest-value search, and transformers' own FP8/FP4 dequantizer."""
import math

import pytest
import torch

from deepinfer_sg.engine import quant


def e2m1_by_hand(code: int) -> float:
    """Decode an E2M1 nibble from its bits: s e1 e0 m, exponent bias 1, subnormal when e == 0."""
    s, e, m = (code >> 3) & 1, (code >> 1) & 3, code & 1
    mag = m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
    return -mag if s else mag


MAGS = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def nearest_e2m1_code(v: float) -> int:
    """Brute force: nearest magnitude, ties to the even code; saturate; sign bit for negatives (not for zero)."""
    a = min(abs(v), 6.0)
    best = min(range(8), key=lambda c: (abs(MAGS[c] - a), c % 2))
    return best | (8 if v < 0 and best else 0)


def test_e2m1_table_matches_bit_decoding():
    for code in range(16):
        assert quant.E2M1_VALUES[code] == e2m1_by_hand(code)
    got = quant.e2m1_to_float(torch.arange(16))
    assert got.tolist() == [e2m1_by_hand(c) for c in range(16)]


def test_float_to_e2m1_round_to_nearest_even():
    # every representable value, every midpoint (ties), values just around midpoints, saturation, random
    mids = [(a + b) / 2 for a, b in zip(MAGS, MAGS[1:])]
    vals = MAGS + mids + [m + 1e-3 for m in mids] + [m - 1e-3 for m in mids] + [7.0, 100.0]
    vals = vals + [-v for v in vals]
    g = torch.Generator().manual_seed(0)
    vals += (torch.randn(2000, generator=g) * 3).tolist()
    got = quant.float_to_e2m1(torch.tensor(vals)).tolist()
    want = [nearest_e2m1_code(v) for v in torch.tensor(vals).tolist()]
    assert got == want
    # named ties from the spec's format: .25->0, .75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert quant.e2m1_to_float(quant.float_to_e2m1(ties)).tolist() == [0, 1, 1, 2, 2, 4, 4]


def test_fp4_pack_low_nibble_first():
    codes = torch.tensor([[1, 2, 15, 0, 7, 8]], dtype=torch.uint8)
    packed = quant.pack_fp4(codes)
    assert packed.dtype == torch.int8
    assert packed.view(torch.uint8).tolist() == [[0x21, 0x0F, 0x87]]
    assert torch.equal(quant.unpack_fp4(packed), codes)


def test_ue8m0_scale_bytes():
    e = torch.tensor([1, 100, 126, 127, 128, 140, 254], dtype=torch.uint8)
    want = [2.0 ** (int(v) - 127) for v in e]
    assert quant.ue8m0_to_float(e).tolist() == want
    assert quant.ue8m0_to_float(e.view(torch.float8_e8m0fnu)).tolist() == want
    # torch's own e8m0 dtype decodes the same bytes the same way
    assert quant.ue8m0_to_float(e).tolist() == e.view(torch.float8_e8m0fnu).to(torch.float32).tolist()
    back = quant.float_to_ue8m0(torch.tensor(want))
    assert back.view(torch.uint8).tolist() == e.tolist()
    with pytest.raises(ValueError):
        quant.float_to_ue8m0(torch.tensor([3.0]))


def test_dequantize_fp8_blocks_by_hand():
    g = torch.Generator().manual_seed(1)
    rows, cols = 40, 70  # partial edge blocks on both dims
    w8 = (torch.randn(rows, cols, generator=g) * 50).to(torch.float8_e4m3fn)
    s_bytes = torch.randint(110, 140, (2, 3), generator=g, dtype=torch.uint8)
    got = quant.dequantize_fp8_blocks(w8, s_bytes.view(torch.float8_e8m0fnu))
    w = w8.to(torch.float32).tolist()
    for i in (0, 31, 32, 39):
        for j in (0, 31, 32, 63, 64, 69):
            assert got[i, j].item() == w[i][j] * 2.0 ** (int(s_bytes[i // 32, j // 32]) - 127)
    with pytest.raises(ValueError, match="block scale"):
        quant.dequantize_fp8_blocks(w8, s_bytes[:, :2].view(torch.float8_e8m0fnu))


def test_dequant_matches_transformers_dequantizer():
    """transformers' Fp8Dequantize (written independently) decodes FP8 blocks and packed FP4 the same way."""
    fp8mod = pytest.importorskip("transformers.integrations.finegrained_fp8")
    deq = fp8mod.Fp8Dequantize(hf_quantizer=None)
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 96, generator=g)
    q8, s8 = quant.quantize_fp8_blocks(w)
    ref = deq._dequantize_one(q8, s8, output_dtype=torch.float32)
    assert torch.equal(quant.dequantize_fp8_blocks(q8, s8), ref)
    q4, s4 = quant.quantize_fp4_blocks(w)
    ref4 = deq._dequantize_one(q4, s4, output_dtype=torch.float32)
    assert torch.equal(quant.dequantize_fp4_blocks(q4, s4), ref4)


def test_fp8_block_round_trip_exact_on_representable_values():
    g = torch.Generator().manual_seed(3)
    # values on the E4M3 grid times a per-block power of two, each block containing its max 448*2^k
    grid = (torch.rand(64, 64, generator=g) * 896 - 448).to(torch.float8_e4m3fn).to(torch.float32)
    k = torch.randint(-10, 5, (2, 2), generator=g).to(torch.float32)
    scale = (2.0 ** k).repeat_interleave(32, 0).repeat_interleave(32, 1)
    grid[::32, ::32] = 448.0
    w = grid * scale
    q, s = quant.quantize_fp8_blocks(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu and s.shape == (2, 2)
    assert s.view(torch.uint8).to(torch.float32).sub(127).tolist() == k.tolist()
    assert torch.equal(quant.dequantize_fp8_blocks(q, s), w)
    assert torch.equal(quant.dequantize_fp8_blocks(q, s, torch.bfloat16), w.to(torch.bfloat16))


def test_fp8_block_quantize_is_nearest_grid_value():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(33, 65, generator=g) * 0.02
    q, s = quant.quantize_fp8_blocks(w)
    assert s.shape == (2, 3)
    deq = quant.dequantize_fp8_blocks(q, s)
    for (bi, bj) in [(0, 0), (1, 2), (0, 1)]:
        blk = w[bi * 32:(bi + 1) * 32, bj * 32:(bj + 1) * 32]
        sf = 2.0 ** math.ceil(math.log2(blk.abs().max().item() / 448))
        assert quant.ue8m0_to_float(s)[bi, bj].item() == sf
        want = (blk / sf).to(torch.float8_e4m3fn).to(torch.float32) * sf  # torch's own RNE cast
        assert torch.equal(deq[bi * 32:(bi + 1) * 32, bj * 32:(bj + 1) * 32], want)


def test_fp4_blocks_by_hand_and_round_trip():
    g = torch.Generator().manual_seed(5)
    rows, cols = 3, 64
    codes = torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.uint8)
    codes[:, 0] = 7  # each 1x32 group holds its max magnitude 6
    codes[:, 32] = 15
    e = torch.randint(100, 130, (rows, 2), generator=g, dtype=torch.uint8)
    packed = quant.pack_fp4(codes)
    got = quant.dequantize_fp4_blocks(packed, e.view(torch.float8_e8m0fnu))
    for i in range(rows):
        for j in range(cols):
            assert got[i, j].item() == e2m1_by_hand(int(codes[i, j])) * 2.0 ** (int(e[i, j // 32]) - 127)
    q, s = quant.quantize_fp4_blocks(got)
    assert torch.equal(s.view(torch.uint8), e)
    assert torch.equal(quant.dequantize_fp4_blocks(q, s), got)
    with pytest.raises(ValueError, match="1x32"):
        quant.dequantize_fp4_blocks(packed, e[:, :1].view(torch.float8_e8m0fnu))


def test_fp8_groups_engram_layout():
    g = torch.Generator().manual_seed(6)
    w8 = torch.randn(5, 64, generator=g).to(torch.float8_e4m3fn)
    e = torch.randint(120, 135, (5, 2), generator=g, dtype=torch.uint8)
    got = quant.dequantize_fp8_groups(w8, e.view(torch.float8_e8m0fnu))
    want = w8.to(torch.float32) * (2.0 ** (e.to(torch.float32) - 127)).repeat_interleave(32, 1)
    assert torch.equal(got, want)


# ---------------- runtime QDQ recipes, recomputed group by group with Python floats ----------------

def _by_groups(x, group, fn):
    rows = x.reshape(-1, group).tolist()
    return torch.tensor([fn(r) for r in rows]).reshape(x.shape)


def test_qdq_fp8_ue8m0():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4, 96, generator=g) * torch.logspace(-6, 3, 96)
    x[0, :32] = 0.0  # all-zero group: amax clamp keeps it finite and zero

    def ref(r):
        amax = max(max(abs(v) for v in r), 1e-4)
        sf = 2.0 ** math.ceil(math.log2(amax / 448))
        q = torch.tensor([max(-448.0, min(448.0, v / sf)) for v in r]).to(torch.float8_e4m3fn)
        return (q.to(torch.float32) * sf).tolist()

    assert torch.equal(quant.qdq_fp8_ue8m0(x), _by_groups(x, 32, ref))
    assert quant.qdq_fp8_ue8m0(x.to(torch.bfloat16)).dtype == torch.bfloat16


def test_qdq_fp4_ue8m0():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(6, 64, generator=g) * 3

    def ref(r):
        amax = max(abs(v) for v in r)
        sf = 2.0 ** math.ceil(math.log2(amax / 6))
        return [MAGS[nearest_e2m1_code(v / sf) & 7] * (-1 if nearest_e2m1_code(v / sf) & 8 else 1) * sf for v in r]

    assert torch.allclose(quant.qdq_fp4_ue8m0(x), _by_groups(x, 32, ref), rtol=0, atol=0)


def test_qdq_fp4_e4m3():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(5, 48, generator=g) * 0.7

    def ref(r):
        amax = max(max(abs(v) for v in r), 6 * 2.0 ** -9)
        sf = torch.tensor(min(amax / 6, 448.0)).to(torch.float8_e4m3fn).to(torch.float32).item()
        out = []
        for v in r:
            c = nearest_e2m1_code(torch.tensor(v * (1.0 / sf), dtype=torch.float32).item())
            out.append(e2m1_by_hand(c) * sf)
        return out

    got = quant.qdq_fp4_e4m3(x)
    assert torch.equal(got, _by_groups(x, 16, ref))
    # the scale is an E4M3 value, generally NOT a power of two: the result is not on a power-of-two grid
    assert not torch.equal(got, quant.qdq_fp4_ue8m0(x, group=16))
    with pytest.raises(ValueError, match="multiple of the group"):
        quant.qdq_fp4_e4m3(torch.zeros(3, 10))


# ---------------------------------------------------------------- routed experts kept in fp8 (loader)

def test_fp4_to_fp8_is_lossless_by_hand():
    """Every E2M1 code becomes the same value in E4M3 (decoded by hand), the scale bytes pass through, and the
    kept form (row scale * 2**-shift per group) reproduces the FP4 dequantization exactly."""
    from deepinfer_sg.kernels.moe import dequantize_expert
    g = torch.Generator().manual_seed(7)
    rows, cols = 5, 96
    codes = torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.uint8)
    codes[0, :16] = torch.arange(16, dtype=torch.uint8)                 # every code at least once
    e = torch.randint(110, 135, (rows, cols // 32), generator=g, dtype=torch.uint8)
    packed = quant.pack_fp4(codes)
    w8, exps = quant.fp4_to_fp8(packed, e.view(torch.float8_e8m0fnu))
    assert w8.dtype == torch.float8_e4m3fn and torch.equal(exps, e)
    for i in range(rows):
        for j in range(cols):
            assert w8[i, j].float().item() == e2m1_by_hand(int(codes[i, j]))
    w8b, rs, sh = quant.expert_to_fp8(packed, e.view(torch.float8_e8m0fnu), "fp4", 1)
    assert torch.equal(w8b.float(), w8.float())
    for i in range(rows):
        top = int(e[i].max())
        assert rs[i].item() == 2.0 ** (top - 127)
        assert sh[:, i].tolist() == [top - int(x) for x in e[i]]                   # group-major shifts
    ref = quant.dequantize_fp4_blocks(packed, e.view(torch.float8_e8m0fnu))
    assert torch.equal(dequantize_expert(w8b, rs, sh, 1), ref)


@pytest.mark.parametrize("rows_per_block", [32, 1])
def test_fp8_expert_kept_blocks_equal_dequantization(rows_per_block):
    """FP8 32x32 blocks kept as (row scale, shift per 32x32 block) or expanded per row: exact, partial blocks
    included (70 x 100 weights)."""
    from deepinfer_sg.kernels.moe import dequantize_expert
    g = torch.Generator().manual_seed(8)
    w = torch.randn(70, 100, generator=g) * torch.exp2(torch.randint(-6, 6, (70, 100), generator=g).float())
    q, s = quant.quantize_fp8_blocks(w)
    w8, rs, sh = quant.expert_to_fp8(q, s, "fp8", rows_per_block)
    assert tuple(sh.shape) == (4, -(-70 // rows_per_block)) and int(sh.min()) == 0
    assert torch.equal(dequantize_expert(w8, rs, sh, rows_per_block), quant.dequantize_fp8_blocks(q, s))
    with pytest.raises(ValueError, match="rows_per_block"):
        quant.expert_to_fp8(q, s, "fp8", 16)


def test_split_block_scales_by_hand():
    exps = torch.tensor([[130, 127, 128], [1, 200, 3]], dtype=torch.uint8)
    rs, sh = quant.split_block_scales(exps, 2, 3)
    assert rs.tolist() == [8.0, 8.0, 2.0 ** 73]
    assert sh.tolist() == [[0, 126], [3, 0], [2, 126]]        # group-major; 199 and 197 capped at 126


def test_fold_shifts_exact_or_refused():
    """Shifts folded into e4m3 values only when exact: E2M1 values survive shifts up to 8 (0.5 * 2**-8 = 2**-9,
    e4m3's smallest subnormal); a shift of 9 on a 0.5 is refused; 1.0 and larger still fold at 9."""
    vals = torch.tensor([[0.5, 1.5, 6.0, -3.0] * 8 + [1.0] * 32], dtype=torch.float32)
    w8 = vals.to(torch.float8_e4m3fn)
    ok = quant.fold_shifts(w8, torch.tensor([[8], [0]], dtype=torch.uint8), 1)      # [in/32, out]
    assert ok is not None and torch.equal(ok[0, :32].float(), vals[0, :32] * 2.0 ** -8)
    assert torch.equal(ok[0, 32:].float(), vals[0, 32:])
    assert quant.fold_shifts(w8, torch.tensor([[9], [0]], dtype=torch.uint8), 1) is None
    assert quant.fold_shifts(w8, torch.tensor([[0], [9]], dtype=torch.uint8), 1) is not None   # 1.0 * 2**-9
    assert quant.fold_shifts(w8, torch.zeros(2, 1, dtype=torch.uint8), 1) is w8
