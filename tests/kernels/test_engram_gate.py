"""Engram's device half (kernels/engram_gate.py): the decode twin vs every E4M3 byte and UE8M0 scale decoded by hand
(all 256 byte codes, scales from 2^-20 to 2^20), the gate twin vs engine/engram.py's Engram.mix written per row in
float64; the Triton kernels vs the twins (stream widths not powers of two, strided kv rows, bf16 and fp32).
Outputs start poisoned (conftest)."""
import math

import pytest
import torch

from deepinfer_sg.kernels import engram_gate
from deepinfer_sg.kernels.engram_gate import (engram_gate_torch, engram_gate_triton, gather_rows_torch,
                                              gather_rows_triton, hashed_rows_torch, hashed_rows_triton,
                                              unpack_rows_torch, unpack_rows_triton)
from helpers import on_dev, to_cpu


def _e4m3(byte):
    sign = -1.0 if byte & 0x80 else 1.0
    e, m = (byte >> 3) & 15, byte & 7
    if e == 15 and m == 7:
        return math.nan
    return sign * (m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


def _packed(rows, width, gen):
    data = torch.randint(0, 256, (rows, width), generator=gen, dtype=torch.uint8)
    data[0, :256 if width >= 256 else width] = torch.arange(min(width, 256), dtype=torch.uint8)   # every code
    scales = torch.randint(107, 148, (rows, -(-width // 32)), generator=gen, dtype=torch.uint8)
    return torch.cat([data, scales], dim=1)


def test_twin_decodes_every_byte_like_the_format():
    g = torch.Generator().manual_seed(0)
    p = _packed(3, 256, g)
    got = unpack_rows_torch(p, 256, torch.float32)
    for r in range(3):
        for i in range(256):
            want = _e4m3(int(p[r, i])) * 2.0 ** (int(p[r, 256 + i // 32]) - 127)
            assert (math.isnan(want) and math.isnan(float(got[r, i]))) or float(got[r, i]) == want


@pytest.mark.parametrize("width,dtype", [(256, torch.bfloat16), (64, torch.float32), (96, torch.bfloat16)])
def test_triton_unpack_matches_twin(width, dtype):
    g = torch.Generator().manual_seed(width)
    p = _packed(7, width, g).view(7, 1, -1).expand(7, 2, -1).contiguous()      # [N, rows, bytes]
    want = unpack_rows_torch(p, width, dtype)
    got = to_cpu(unpack_rows_triton(on_dev(p), width, dtype))
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("width,dtype", [(256, torch.bfloat16), (96, torch.float32)])
def test_triton_gather_matches_twin(width, dtype):
    """Table rows read by the kernel (repeated ids, the last row, [T, R] ids) equal the twin's gather + decode, and the
    twin equals unpack_rows of the gathered bytes. On CUDA the table sits in pinned host memory, as the engine keeps it
    (engine/engram.py: EngramTable.device_arrays)."""
    g = torch.Generator().manual_seed(width)
    p = _packed(37, width, g)
    weight, scale = p[:, :width].contiguous(), p[:, width:].contiguous()
    ids = torch.randint(0, 37, (5, 6), generator=g)
    ids[0, :3] = torch.tensor([36, 0, 36])
    want = gather_rows_torch(ids, weight, scale, dtype)
    assert torch.equal(want.nan_to_num(), unpack_rows_torch(p[ids], width, dtype).nan_to_num())
    dev_ids = on_dev(ids)
    if dev_ids.is_cuda:
        weight, scale = weight.pin_memory(), scale.pin_memory()
    got = to_cpu(gather_rows_triton(dev_ids, weight, scale, dtype))
    assert got.dtype == dtype and got.shape == (5, 6, width)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("block", [1, 2, 8])
@pytest.mark.parametrize("T,N,H,width", [(5, 4, 3, 64), (2, 3, 8, 96), (1, 2, 1, 32)])
def test_triton_hash_matches_twin(T, N, H, width, block, monkeypatch):
    """Windows hashed, read and decoded in one launch equal the twin (ids from this step and from the tail, negative
    ids hashed as the pad, large multipliers: the int64 products and xors of engine/engram.py's hash); the twin's
    rows equal the hash written out per token and row in Python integers. At 1, 2 and 8 table rows a program, the
    table in host memory (pinned when compiled) and, compiled, in device memory."""
    monkeypatch.setattr(engram_gate, "HASH_ROWS_HOST_BLOCK", block)
    monkeypatch.setattr(engram_gate, "HASH_ROWS_BLOCK", block)
    g = torch.Generator().manual_seed(T * 100 + N)
    V = 50
    classes = torch.randint(0, 40, (V,), generator=g)
    mult = torch.randint(1, 2 ** 55, (N,), generator=g)
    prime = torch.randint(3, 13, ((N - 1) * H,), generator=g)
    offset = torch.cumsum(prime, 0) - prime
    rows = int(prime.sum())
    p = _packed(rows, width, g)
    weight, scale = p[:, :width].contiguous(), p[:, width:].contiguous()
    ids = torch.randint(0, V, (T,), generator=g)
    earlier = torch.randint(-1, V, (T, N), generator=g)          # (-1: before the sequence start)
    k = torch.where(torch.rand(T, N, generator=g) < 0.5, torch.randint(0, T, (T, N), generator=g), -1)
    src = torch.stack([k, earlier])
    consts = (classes, mult, prime, offset)
    want = hashed_rows_torch(src, ids, consts, 3, weight, scale, torch.float32)
    w = torch.where(k >= 0, ids[k.clamp(min=0)], earlier)
    for t in range(T):
        acc, c = 0, [int(classes[3 if int(x) < 0 else int(x)]) for x in w[t]]
        for n in range(1, N):
            acc = (c[0] * int(mult[0]) if n == 1 else acc) ^ (c[n] * int(mult[n]))
            for h in range(H):
                j = (n - 1) * H + h
                row = acc % int(prime[j]) + int(offset[j])
                by_hand = unpack_rows_torch(p[row], width, torch.float32)
                assert torch.equal(want[t, j].nan_to_num(), by_hand.nan_to_num())
    dev = [on_dev(x) for x in (src, ids, *consts)]
    tables = ([(weight.pin_memory(), scale.pin_memory()), (on_dev(weight), on_dev(scale))] if dev[0].is_cuda
              else [(weight, scale)])
    for tw, ts in tables:
        got = to_cpu(hashed_rows_triton(dev[0], dev[1], tuple(dev[2:]), 3, tw, ts, torch.float32))
        assert got.shape == want.shape == (T, (N - 1) * H, width)
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


def _gate_by_hand(R, kv, w, eps):
    T, M, H = R.shape
    out = torch.empty(T, M, H, dtype=torch.float64)
    for t in range(T):
        value = kv[t, M * H:].double()
        for m in range(M):
            r, key = R[t, m].double(), kv[t, m * H:(m + 1) * H].double()
            d = float((r * w[m].double() * key).sum())
            d /= math.sqrt(float((r * r).mean()) + eps) * math.sqrt(float((key * key).mean()) + eps) * math.sqrt(H)
            z = math.copysign(math.sqrt(max(abs(d), 1e-6)), d) if d else 0.0
            out[t, m] = r + value / (1 + math.exp(-z))
    return out


def test_gate_twin_is_the_formula():
    g = torch.Generator().manual_seed(1)
    R, kv, w = torch.randn(3, 4, 20, generator=g), torch.randn(3, 100, generator=g), torch.rand(4, 20, generator=g)
    assert torch.allclose(engram_gate_torch(R, kv, w, 1e-6).double(), _gate_by_hand(R, kv, w, 1e-6), atol=1e-5)


@pytest.mark.parametrize("T,M,H", [(1, 4, 64), (8, 4, 2048), (5, 3, 100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_gate_matches_twin(T, M, H, dtype):
    g = torch.Generator().manual_seed(T * M * H)
    R = (torch.randn(T, M, H, generator=g) * 2).to(dtype)
    wide = torch.randn(T, (M + 1) * H + 7, generator=g).to(dtype)
    kv = wide[:, 3:3 + (M + 1) * H]                                   # strided rows
    w = torch.rand(M, H, generator=g) + 0.5
    want = engram_gate_torch(R, kv, w, 1e-6)
    got = to_cpu(engram_gate_triton(on_dev(R), on_dev(wide)[:, 3:3 + (M + 1) * H], on_dev(w), 1e-6))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=1e-2)
    assert got.dtype == dtype and torch.allclose(got.float(), want.float(), **tol)


def test_the_engines_engram_mix_is_the_formula():
    """engine/engram.py's Engram.mix (decode, the wkv GEMM, the gate) against the table bytes decoded by hand, the
    GEMM and the gate in float64."""
    from deepinfer_sg.engine import engram as eg
    from deepinfer_sg.engine import testing
    from deepinfer_sg.engine.config import ModelConfig
    torch.manual_seed(5)
    module = eg.Engram(ModelConfig.from_dict(testing.tiny_v41_config()), 1)
    with torch.no_grad():
        module.wkv.weight.normal_(0, 0.05)
        module.q_weight.uniform_(0.5, 1.5)
    windows = torch.randint(0, 500, (6, module.spec.max_ngram_size))
    packed = module.packed_values(windows)                              # [6, rows, W + W/32] bytes
    R = torch.randn(6, module.hc_mult, module.hidden_size)
    got = module.mix(R, packed)
    W = module.spec.head_dim
    e = torch.tensor([[[_e4m3(int(b)) * 2.0 ** (int(row[W + i // 32]) - 127) for i, b in enumerate(row[:W])]
                       for row in tok] for tok in packed.tolist()], dtype=torch.float64).reshape(6, -1)
    kv = e @ module.wkv.weight.detach().double().T
    want = _gate_by_hand(R, kv, module.q_weight.detach() * module.k_weight.detach(), module.eps)
    assert torch.allclose(got.double(), want, atol=1e-4)


def test_bad_shapes_are_refused_with_the_shapes():
    with pytest.raises(ValueError, match="engram_gate"):
        engram_gate_triton(torch.randn(2, 4, 8), torch.randn(2, 39), torch.rand(4, 8), 1e-6)
    with pytest.raises(ValueError, match="unpack_rows"):
        unpack_rows_triton(torch.zeros(2, 10, dtype=torch.uint8), 8, torch.float32)
