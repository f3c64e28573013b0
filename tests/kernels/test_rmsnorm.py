"""RMSNorm kernel: twin vs the formula row by row in float64; Triton vs twin on awkward shapes (D not a power of
two, one row, many rows, 3-d input, non-contiguous input, fp32 and bf16). Outputs start poisoned (conftest)."""
import math

import pytest
import torch

from deepinfer_sg.kernels.backend import INTERPRETING
from deepinfer_sg.kernels.rmsnorm import rms_norm_torch, rms_norm_triton
from helpers import on_dev, to_cpu


def test_twin_is_the_formula():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 37, generator=g) * 3
    w = torch.rand(37, generator=g) + 0.5
    got = rms_norm_torch(x, w, 1e-6)
    for r in range(4):
        row = x[r].double()
        inv = 1 / math.sqrt(float((row * row).mean()) + 1e-6)
        assert torch.allclose(got[r].double(), row * inv * w.double(), atol=1e-5)


@pytest.mark.parametrize("shape", [(1, 64), (7, 100), (3, 5, 24), (33, 512), (2, 2048)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_twin(shape, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=g) * 2 + 0.3).to(dtype)
    w = torch.rand(shape[-1], generator=g) + 0.5
    want = rms_norm_torch(x, w, 1e-6)
    got = to_cpu(rms_norm_triton(on_dev(x), on_dev(w), 1e-6))
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.float32:
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    else:     # one bf16 rounding of nearly the same fp32 value (the interpreter rounds toward zero)
        assert torch.allclose(got.float(), want.float(), atol=1e-2, rtol=8e-3)
        if not INTERPRETING:
            assert (got == want).float().mean() > 0.95


def test_triton_reads_a_non_contiguous_input():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 2, 48, generator=g)[:, 1, 5:]
    w = torch.rand(43, generator=g) + 0.5
    assert torch.allclose(to_cpu(rms_norm_triton(on_dev(x), on_dev(w), 1e-6)), rms_norm_torch(x, w, 1e-6), atol=1e-5)
    wide = on_dev(torch.randn(6, 100, generator=g))
    block = wide[:, 30:73]                      # a column block of a wider matrix: read at its row stride
    got = to_cpu(rms_norm_triton(block, on_dev(w), 1e-6))
    assert got.is_contiguous() and torch.allclose(got, rms_norm_torch(to_cpu(block), w, 1e-6), atol=1e-5)
    x3 = on_dev(torch.randn(4, 3, 86, generator=g))[:, :, ::2]    # 3-d, last dim strided: copied first
    assert torch.allclose(to_cpu(rms_norm_triton(x3, on_dev(w), 1e-6)), rms_norm_torch(to_cpu(x3), w, 1e-6),
                          atol=1e-5)


def test_a_weight_of_another_width_is_refused():
    with pytest.raises(ValueError, match="weight of shape"):
        rms_norm_triton(torch.randn(3, 8), torch.ones(9), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_scatter_in_the_same_launch(dtype):
    """turn: the norm's output (as stored) rotated like kernels/rope.py; rows: each row lands in its out row, the
    other out rows untouched. Against the twin's three steps (norm, rope, index_copy)."""
    from deepinfer_sg.kernels.rmsnorm import rms_norm
    from deepinfer_sg.kernels.rope import apply_rope_torch
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(5, 70, generator=g) * 2)[:, 3:51].to(dtype)     # strided rows of 48 channels
    w = torch.rand(48, generator=g) + 0.5
    ang = torch.rand(5, 8, generator=g) * 20
    turn = torch.stack([ang.cos(), ang.sin()], dim=-1)
    want = apply_rope_torch(rms_norm_torch(x, w, 1e-6), turn)
    tol = dict(atol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=1e-2)
    got = to_cpu(rms_norm_triton(on_dev(x), on_dev(w), 1e-6, on_dev(turn)))
    assert torch.allclose(got.float(), want.float(), **tol)
    pool = torch.randn(9, 48, generator=g).to(dtype)
    rows = torch.tensor([8, 1, 3, 0, 5])
    ref = rms_norm(x, w, 1e-6, turn, pool.clone(), rows)              # (CPU: the twin's three steps)
    assert torch.equal(ref[rows], want)
    got = to_cpu(rms_norm_triton(on_dev(x), on_dev(w), 1e-6, on_dev(turn), on_dev(pool.clone()), on_dev(rows)))
    assert torch.allclose(got.float(), ref.float(), **tol)
    untouched = [r for r in range(9) if r not in rows.tolist()]
    assert torch.equal(got[untouched], pool[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_norms_in_one_launch(dtype):
    """rms_norm_pair: q_norm's and the window kv store's norms of the same rows, read as column blocks of one
    stacked projection output (the first block wider than the second, then narrower), each against its own twin;
    the kv one with its rotation and scatter (the kernel given int32 slab rows), the q one with neither; and the
    bits of the two separate launches (at these widths each norm's sum is reduced in its own launch's order)."""
    from deepinfer_sg.kernels.rmsnorm import rms_norm, rms_norm_pair
    g = torch.Generator().manual_seed(12)
    tol = dict(atol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=1e-2)
    for qa, kv in ((40, 24), (24, 56)):
        stacked = (torch.randn(5, qa + kv + 7, generator=g) * 2).to(dtype)
        xq, xkv = stacked[:, :qa], stacked[:, qa:qa + kv]
        wq, wkv = torch.rand(qa, generator=g) + 0.5, torch.rand(kv, generator=g) + 0.5
        ang = torch.rand(5, 4, generator=g) * 20
        turn = torch.stack([ang.cos(), ang.sin()], dim=-1)
        pool = torch.randn(9, kv, generator=g).to(dtype)
        rows = torch.tensor([8, 1, 3, 0, 5])
        want_q = rms_norm_torch(xq, wq, 1e-5)
        want_pool = rms_norm(xkv, wkv, 1e-6, turn, pool.clone(), rows)       # (CPU: the twin's three steps)
        yq, ypool = rms_norm_pair(xq, wq, 1e-5, xkv, wkv, 1e-6, turn, pool.clone(), rows)   # (CPU: the twins)
        assert torch.equal(yq, want_q) and torch.equal(ypool, want_pool)
        got_q, got_pool = rms_norm_triton(on_dev(xkv), on_dev(wkv), 1e-6, on_dev(turn), on_dev(pool.clone()),
                                          on_dev(rows.int()), also=(on_dev(xq), on_dev(wq), 1e-5))[::-1]
        got_q, got_pool = to_cpu(got_q), to_cpu(got_pool)
        assert got_q.shape == xq.shape and got_q.dtype == dtype
        assert torch.allclose(got_q.float(), want_q.float(), **tol)
        assert torch.allclose(got_pool.float(), want_pool.float(), **tol)
        alone_q = to_cpu(rms_norm_triton(on_dev(xq), on_dev(wq), 1e-5))
        alone_pool = to_cpu(rms_norm_triton(on_dev(xkv), on_dev(wkv), 1e-6, on_dev(turn), on_dev(pool.clone()),
                                            on_dev(rows)))
        assert torch.equal(got_q, alone_q) and torch.equal(got_pool, alone_pool)
