"""Routed experts: twin vs the formula per token and expert; Triton grouped kernels vs twin."""
import pytest
import torch

from deepinfer_sg.kernels.moe import align_pairs, moe_experts, moe_experts_torch, moe_experts_triton
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


def test_bad_shapes_raise():
    gen = torch.Generator().manual_seed(2)
    x, ids, wts, w1, w3, w2 = _inputs(gen)
    with pytest.raises(ValueError, match="w2 must be"):
        moe_experts(x, ids, wts, w1, w3, w2.transpose(1, 2))
