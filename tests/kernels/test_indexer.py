"""Indexer score + top-k: twin vs a per-entry loop of the doc's formula; Triton vs twin."""
import pytest
import torch

from deepinfer_sg.kernels.indexer import indexer_scores_torch, indexer_topk, indexer_topk_torch, indexer_topk_triton
from helpers import on_dev, to_cpu


def _inputs(gen, N=4, Hi=5, Di=32, lens=(0, 7, 70, 33), dtype=torch.float32):
    starts, pool = [], 0
    for n in lens:
        starts.append(pool)
        pool += n + 3                               # gaps between sequences: must never be read
    iq = torch.randn(N, Hi, Di, generator=gen).to(dtype)
    w = torch.randn(N, Hi, generator=gen)
    keys = torch.randn(pool, Di, generator=gen).to(dtype)
    return iq, w, keys, torch.tensor(starts), torch.tensor(lens)


def test_twin_matches_formula():
    gen = torch.Generator().manual_seed(0)
    iq, w, keys, start, length = _inputs(gen)
    idx, val = indexer_topk_torch(iq, w, keys, start, length, k=10)
    for n in range(4):
        scores = []
        for g in range(int(length[n])):
            key = keys[int(start[n]) + g].double()
            scores.append(sum(float(w[n, h]) * max(0.0, float(iq[n, h].double() @ key)) for h in range(5)))
        best = sorted(range(len(scores)), key=lambda g: -scores[g])[:10]
        assert idx[n, :len(best)].tolist() == best
        assert torch.allclose(val[n, :len(best)].double(), torch.tensor([scores[g] for g in best], dtype=torch.float64),
                              rtol=1e-5, atol=1e-5)
        assert (idx[n, len(best):] == -1).all() and (val[n, len(best):] == float("-inf")).all()


@pytest.mark.parametrize("Hi,Di,k,dtype", [(5, 32, 10, torch.float32), (32, 16, 40, torch.float32),
                                           (3, 64, 8, torch.bfloat16)])
def test_triton_matches_twin(Hi, Di, k, dtype):
    gen = torch.Generator().manual_seed(Hi * Di)
    iq, w, keys, start, length = _inputs(gen, Hi=Hi, Di=Di, dtype=dtype)
    ref_idx, ref_val = indexer_topk_torch(iq.float(), w, keys.float(), start, length, k)
    idx, val = to_cpu(indexer_topk_triton(*on_dev((iq, w, keys, start, length)), k, block_g=32))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(val, ref_val, rtol=tol, atol=tol * 10)
    assert torch.equal(idx < 0, ref_idx < 0)
    if dtype == torch.float32:
        # entries whose score is 0 (every head's relu at 0) tie, and top-k may pick any of them: check that each
        # chosen entry really has the reported score instead of comparing ids
        full = indexer_scores_torch(iq, w, keys, start, length, int(length.max()))
        chosen = full.gather(1, idx.clamp_min(0))
        assert torch.allclose(torch.where(idx >= 0, chosen, val), val, rtol=1e-5, atol=1e-5)
        assert all(len(set(r[r >= 0].tolist())) == int((r >= 0).sum()) for r in idx)


def test_bad_shapes_raise():
    gen = torch.Generator().manual_seed(2)
    iq, w, keys, start, length = _inputs(gen)
    with pytest.raises(ValueError, match="head weights"):
        indexer_topk(iq, w[:, :-1], keys, start, length, 4)


@pytest.mark.parametrize("L,k,chunk", [(1000, 20, 128), (777, 64, 256), (300, 5, 512)])
def test_two_stage_select_is_exact(L, k, chunk):
    """Two-stage top-k (per-slice top-k, then top-k of the candidates) picks the same scores as one wide top-k,
    with -1 / -inf padding where fewer entries are visible, and indices that point at those scores."""
    from deepinfer_sg.kernels.indexer import _select, select_two_stage
    gen = torch.Generator().manual_seed(L + k)
    scores = torch.randn(4, L, generator=gen)
    scores[1, 10:] = float("-inf")                           # only 10 visible entries in row 1
    scores[2] = scores[2].round()                            # many ties
    i1, v1 = _select(scores, k)
    i2, v2 = select_two_stage(scores, k, chunk=chunk)
    assert torch.equal(v1, v2)
    ok = i2 >= 0
    assert torch.equal(ok, v2 > float("-inf"))
    assert torch.equal(scores.gather(1, i2.clamp_min(0))[ok], v2[ok])
    assert all(len(set(r[r >= 0].tolist())) == int((r >= 0).sum()) for r in i2)   # no entry twice
