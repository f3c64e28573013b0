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


def _stable_topk(scores, k):
    """Independent oracle: Python's stable sort of (-score, id) over the selectable (> -inf) entries."""
    out_i, out_v = [], []
    for row in scores.tolist():
        order = sorted((g for g, v in enumerate(row) if v > float("-inf")), key=lambda g: -row[g])[:k]
        out_i.append(order + [-1] * (k - len(order)))
        out_v.append([row[g] for g in order] + [float("-inf")] * (k - len(order)))
    return torch.tensor(out_i), torch.tensor(out_v)


@pytest.mark.parametrize("N,L,k,block", [(4, 100, 10, None), (4, 600, 33, 256), (3, 50, 80, None), (3, 1500, 300, 512),
                                         (2, 40, 1, None)])
@pytest.mark.parametrize("sorted_", [True, False])
def test_select_kernel_matches_stable_sort(N, L, k, block, sorted_):
    """The radix-select kernel (in registers, or streamed in blocks when block < L) picks exactly the entries a
    stable sort picks: many exact ties (rounded scores, zeros and -0.0 as relu produces them), rows with fewer
    selectable entries than k, a row with none. sorted_=False returns the same set in ascending entry order."""
    from deepinfer_sg.kernels.indexer import topk_select_triton
    gen = torch.Generator().manual_seed(N * L + k)
    s = torch.randn(N, L, generator=gen)
    s[0] = s[0].round()                                          # ties among non-zero values
    s[1, L // 3:] = float("-inf")                                # fewer selectable entries than k (sometimes)
    if N > 2:
        s[2] = torch.where(torch.rand(L, generator=gen) < 0.5, torch.zeros(L), s[2])
        s[2, ::7] = -0.0                                         # -0.0 ties with +0.0 (lower id first)
    s[-1, :] = float("-inf") if N > 3 else s[-1, :]              # a row with nothing selectable
    ref_i, ref_v = _stable_topk(s, k)
    i, v = to_cpu(topk_select_triton(on_dev(s), k, sorted=sorted_, block=block))
    if not sorted_:
        key = torch.where(ref_i >= 0, ref_i, L)
        order = key.argsort(1)
        ref_i, ref_v = ref_i.gather(1, order), ref_v.gather(1, order)
    assert torch.equal(i, ref_i)
    assert torch.equal(v, ref_v)


def test_twin_select_is_stable():
    from deepinfer_sg.kernels.indexer import _select
    gen = torch.Generator().manual_seed(5)
    s = torch.randn(3, 300, generator=gen).round()
    s[1, 100:] = float("-inf")
    ref_i, ref_v = _stable_topk(s, 150)
    i, v = _select(s, 150)
    assert torch.equal(i, ref_i) and torch.equal(v, ref_v)


def test_engine_topk_mask_through_the_kernel(monkeypatch):
    """engine/batched.py's CUDA selection (select kernel + scatter) gives the same mask as the reference's stable
    `topk_mask`, with ties, zeros / -0.0, entries not allowed and rows with fewer allowed entries than k."""
    import deepinfer_sg.kernels.indexer as kindexer
    from deepinfer_sg.engine import batched
    from deepinfer_sg.engine.indexer import topk_mask
    gen = torch.Generator().manual_seed(11)
    T, G, k = 5, 300, 40
    s = torch.randn(T, G, generator=gen).round() * torch.randn(T, 1, generator=gen).sign()
    s[1] = torch.where(s[1] > 0, s[1], torch.zeros(G)) * -1.0          # relu-style zeros, many -0.0
    allowed = torch.rand(T, G, generator=gen) < 0.7
    allowed[2, 30:] = False                                              # fewer allowed entries than k
    allowed[3] = False                                                   # none
    monkeypatch.setattr(kindexer, "use_triton", lambda t: True)         # the CUDA branch, interpreted
    got = batched._topk_mask(on_dev(s), on_dev(allowed), k).cpu()
    assert torch.equal(got, topk_mask(s, allowed, k))


@pytest.mark.parametrize("N,L,k,chunks,block", [(3, 700, 20, 4, None), (3, 1000, 50, 7, None), (3, 333, 16, 16, None),
                                                (2, 900, 30, 3, 128), (3, 64, 5, 13, None)])
@pytest.mark.parametrize("sorted_", [True, False])
def test_chunked_select_matches_stable_sort(N, L, k, chunks, block, sorted_):
    """The two-launch select (each chunk's exact top-k, then the top-k of the candidates, ids mapped back) picks
    exactly what a stable sort picks: ties spread over chunk boundaries (rounded scores, a constant row, zeros and
    -0.0), a row whose selectable entries all sit in its last chunk, chunks with nothing selectable."""
    from deepinfer_sg.kernels.indexer import topk_select_triton
    gen = torch.Generator().manual_seed(N * L + k + chunks)
    s = torch.randn(N, L, generator=gen).round()                 # many ties, across chunks
    s[1] = 2.0                                                   # one value everywhere: the lowest ids win
    s[1, : L - L // 5] = float("-inf")                           # ... among the last entries only
    s[-1] = torch.where(torch.rand(L, generator=gen) < 0.5, torch.zeros(L), s[-1] * 0.0)  # +0.0 and -0.0 only
    s[-1, ::3] = float("-inf")
    ref_i, ref_v = _stable_topk(s, k)
    i, v = to_cpu(topk_select_triton(on_dev(s), k, sorted=sorted_, block=block, chunks=chunks))
    if not sorted_:
        key = torch.where(ref_i >= 0, ref_i, L)
        order = key.argsort(1)
        ref_i, ref_v = ref_i.gather(1, order), ref_v.gather(1, order)
    assert torch.equal(i, ref_i)
    assert torch.equal(v, ref_v)


@pytest.mark.parametrize("block_g,bpp", [(16, 3), (32, 2)])
def test_looped_score_kernel_matches_twin(block_g, bpp):
    """Score programs that loop over several entry blocks (queries loaded once): same scores as the twin, -inf
    past each row's length (a row of length 0, rows ending inside and past a program's blocks)."""
    from deepinfer_sg.kernels.indexer import indexer_scores_triton
    gen = torch.Generator().manual_seed(block_g + bpp)
    iq, w, keys, start, length = _inputs(gen)
    ref = indexer_scores_torch(iq, w, keys, start, length, 70)
    got = indexer_scores_triton(*on_dev((iq, w, keys, start, length)), 70, block_g=block_g,
                                blocks_per_program=bpp).cpu()
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_g,bpp,k,sorted_", [(16, 2, 10, True), (16, 4, 33, False), (32, 1, 8, True)])
def test_fused_score_select_matches_stable_sort(block_g, bpp, k, sorted_):
    """Scores fused with the first select stage (chunks of block_g * bpp entries), then the candidates' top-k:
    exactly the stable-sort selection over the twin's scores (rows of length 0, shorter than a chunk, longer than
    several), ties included (keys rounded so that scores repeat)."""
    from deepinfer_sg.kernels.indexer import indexer_topk_fused
    gen = torch.Generator().manual_seed(block_g * bpp + k)
    iq, w, keys, start, length = _inputs(gen, lens=(0, 7, 150, 33))
    iq, w, keys = iq.round(), w.round(), keys.round()                 # integer scores: exact, many ties
    ref = indexer_scores_torch(iq, w, keys, start, length, 150)
    ref_i, ref_v = _stable_topk(ref, k)
    i, v = to_cpu(indexer_topk_fused(*on_dev((iq, w, keys, start, length)), k, max_len=150, block_g=block_g,
                                     bpp=bpp, sorted=sorted_))
    if not sorted_:
        key = torch.where(ref_i >= 0, ref_i, 150)
        order = key.argsort(1)
        ref_i, ref_v = ref_i.gather(1, order), ref_v.gather(1, order)
    assert torch.equal(i, ref_i)
    assert torch.allclose(v, ref_v, rtol=1e-6, atol=1e-6)
