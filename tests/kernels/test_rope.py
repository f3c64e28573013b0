"""RoPE kernel: twin vs rotation of every pair by hand in float64 (cos/sin from the angle); Triton vs twin on
awkward shapes (heads not a power of two, D not a power of two, one rotated pair, nothing but rotated channels,
fp32 and bf16, non-contiguous input). Kernel outputs start poisoned (conftest), so an unwritten element fails."""
import math

import pytest
import torch

from deepinfer_sg.kernels.backend import INTERPRETING
from deepinfer_sg.kernels.rope import apply_rope_torch, apply_rope_triton
from helpers import on_dev, to_cpu


def _turn(T, R, gen, inverse=False):
    ang = torch.rand(T, R // 2, generator=gen, dtype=torch.float64) * 40 - 20
    sin = -ang.sin() if inverse else ang.sin()
    return ang, torch.stack([ang.cos(), sin], dim=-1).float()


def _by_hand(x, ang, inverse):
    """Every pair (a, b) of the last R channels -> (a cos - b sin, a sin + b cos), in float64, one by one."""
    T, D = x.shape[0], x.shape[-1]
    R = ang.shape[1] * 2
    y = x.double().reshape(T, -1, D).clone()
    for t in range(T):
        for h in range(y.shape[1]):
            for i in range(R // 2):
                th = -float(ang[t, i]) if inverse else float(ang[t, i])
                k = D - R + 2 * i
                a, b = float(y[t, h, k]), float(y[t, h, k + 1])
                y[t, h, k], y[t, h, k + 1] = a * math.cos(th) - b * math.sin(th), a * math.sin(th) + b * math.cos(th)
    return y.reshape(x.shape)


@pytest.mark.parametrize("inverse", [False, True])
def test_twin_rotates_each_pair_like_the_formula(inverse):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 12, generator=g)
    ang, turn = _turn(3, 8, g, inverse)
    got = apply_rope_torch(x, turn)
    assert torch.allclose(got.double(), _by_hand(x, ang, inverse), atol=1e-5)
    assert torch.equal(got[..., :4], x[..., :4])      # the first D - R channels pass through


SHAPES = [((7, 3, 24), 8), ((5, 40), 8), ((4, 2, 3, 20), 20), ((1, 6, 10), 2), ((9, 32, 64), 16), ((6, 160), 64)]


@pytest.mark.parametrize("shape,R", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_twin(shape, R, dtype):
    g = torch.Generator().manual_seed(sum(shape) + R)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    _, turn = _turn(shape[0], R, g)
    want = apply_rope_torch(x, turn)
    got = to_cpu(apply_rope_triton(on_dev(x), on_dev(turn)))
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.float32:
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    else:   # fp32 math then one rounding: at most one bf16 step apart (fused multiply-adds may differ; Triton
        # 3.6's interpreter rounds fp32 -> bf16 toward zero, a GPU to nearest even)
        assert torch.allclose(got.float(), want.float(), atol=1e-2, rtol=8e-3)
        if not INTERPRETING:
            assert (got == want).float().mean() > 0.95
    assert torch.equal(got[..., :shape[-1] - R], x[..., :shape[-1] - R])


def test_triton_reads_a_non_contiguous_input():
    g = torch.Generator().manual_seed(7)
    base = torch.randn(6, 4, 40, generator=g)
    x = base[:, 1:, 4:]                  # [6, 3, 36], strided
    _, turn = _turn(6, 12, g)
    got = to_cpu(apply_rope_triton(on_dev(x), on_dev(turn)))
    assert torch.allclose(got, apply_rope_torch(x, turn), atol=1e-5)


def test_bad_turn_is_refused_with_the_shapes():
    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match="turn of shape"):
        apply_rope_triton(x, torch.randn(3, 4, 2))
    with pytest.raises(ValueError, match="rotated channels"):
        apply_rope_triton(x, torch.randn(4, 9, 2))
