"""The gated compressor's ring write + pooling (kernels/ring_pool.py): the twin vs the pooling by hand in float64
(per row and channel: softmax of the group's gates, weighted sum of its kv rows); the Triton kernels vs the twins
(strided input rows, widths and group sizes not powers of two, rows of the step pooled after the write, bf16 out).
Outputs start poisoned (conftest); ring rows not written must stay as they were."""
import math

import pytest
import torch

from deepinfer_sg.kernels.ring_pool import ring_pool_torch, ring_pool_triton, ring_write_torch, ring_write_triton
from helpers import on_dev, to_cpu


def test_twin_pool_is_the_formula():
    g = torch.Generator().manual_seed(0)
    ring_kv, ring_g = torch.randn(10, 6, generator=g), torch.randn(10, 6, generator=g) * 3
    grp = torch.tensor([[0, 1], [4, 9], [3, 3]])
    got = ring_pool_torch(ring_kv, ring_g, grp, grp + 0, torch.float32)
    for t in range(3):
        for c in range(6):
            gs = [float(ring_g[r, c]) for r in grp[t].tolist()]
            m = max(gs)
            ws = [math.exp(x - m) for x in gs]
            want = sum(float(ring_kv[r, c]) * w / sum(ws) for r, w in zip(grp[t].tolist(), ws))
            assert abs(float(got[t, c]) - want) < 1e-5


@pytest.mark.parametrize("T,W,r", [(1, 8, 2), (7, 100, 2), (5, 512, 3), (12, 33, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_write_then_pool_matches_the_twins(T, W, r, dtype):
    g = torch.Generator().manual_seed(T * W + r)
    rows = 3 * T + 8
    ring_kv0, ring_g0 = torch.randn(rows, W, generator=g), torch.randn(rows, W, generator=g) * 2
    wide = torch.randn(T, 3 * W, generator=g).to(dtype)
    kv, gate = wide[:, :W], wide[:, W + 1:2 * W + 1]                # strided column blocks
    dst_kv = torch.randperm(rows, generator=g)[:T]
    dst_g = torch.randperm(rows, generator=g)[:T]
    grp_kv = torch.cat([dst_kv[:, None], torch.randint(0, rows, (T, r - 1), generator=g)], dim=1)  # own row too
    grp_g = torch.cat([dst_g[:, None], torch.randint(0, rows, (T, r - 1), generator=g)], dim=1)
    want_kv, want_g = ring_kv0.clone(), ring_g0.clone()
    ring_write_torch(kv, gate, want_kv, want_g, dst_kv, dst_g)
    want = ring_pool_torch(want_kv, want_g, grp_kv, grp_g, dtype)
    got_kv, got_g = on_dev(ring_kv0.clone()), on_dev(ring_g0.clone())
    ring_write_triton(on_dev(wide)[:, :W], on_dev(wide)[:, W + 1:2 * W + 1], got_kv, got_g, on_dev(dst_kv),
                      on_dev(dst_g))
    assert torch.equal(to_cpu(got_kv), want_kv) and torch.equal(to_cpu(got_g), want_g)
    got = to_cpu(ring_pool_triton(got_kv, got_g, on_dev(grp_kv), on_dev(grp_g), dtype))
    assert got.dtype == dtype
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    assert torch.allclose(got.float(), want.float(), **tol)


def test_bad_rings_are_refused_with_the_shapes():
    with pytest.raises(ValueError, match="ring_write"):
        ring_write_triton(torch.randn(3, 8), torch.randn(3, 8), torch.randn(9, 7), torch.randn(9, 8),
                          torch.arange(3), torch.arange(3))
