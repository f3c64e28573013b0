"""Indexer score + top-k: twin vs a per-entry loop of the doc's formula; Triton vs twin."""
import pytest
import torch

from deepinfer_sg.kernels.indexer import indexer_scores_torch, indexer_topk, indexer_topk_torch, indexer_topk_triton
from deepinfer_sg.kernels.backend import tickets
from helpers import DEVICE, on_dev, to_cpu


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


def _in_entry_order(ref_i, ref_v, L):
    """The stable-sort selection re-ordered by entry id (padding last): what sorted=False returns."""
    order = torch.where(ref_i >= 0, ref_i, L).argsort(1)
    return ref_i.gather(1, order), ref_v.gather(1, order)


def _check_select(s, k, sorted_, **kw):
    """topk_select_triton(s, k, **kw) == the stable-sort selection (in entry order when not sorted_)."""
    from deepinfer_sg.kernels.indexer import topk_select_triton
    ref_i, ref_v = _stable_topk(s, k)
    i, v = to_cpu(topk_select_triton(on_dev(s), k, sorted=sorted_, **kw))
    if not sorted_:
        ref_i, ref_v = _in_entry_order(ref_i, ref_v, s.shape[1])
    assert torch.equal(i, ref_i)
    assert torch.equal(v, ref_v)


@pytest.mark.parametrize("N,L,k,block", [(4, 100, 10, None), (4, 600, 33, 256), (3, 50, 80, None), (3, 1500, 300, 512),
                                         (2, 40, 1, None)])
@pytest.mark.parametrize("sorted_", [True, False])
def test_select_kernel_matches_stable_sort(N, L, k, block, sorted_):
    """The radix-select kernel (in registers, or streamed in blocks when block < L) picks exactly the entries a
    stable sort picks: many exact ties (rounded scores, zeros and -0.0 as relu produces them), rows with fewer
    selectable entries than k, a row with none. sorted_=False returns the same set in ascending entry order."""
    gen = torch.Generator().manual_seed(N * L + k)
    s = torch.randn(N, L, generator=gen)
    s[0] = s[0].round()                                          # ties among non-zero values
    s[1, L // 3:] = float("-inf")                                # fewer selectable entries than k (sometimes)
    if N > 2:
        s[2] = torch.where(torch.rand(L, generator=gen) < 0.5, torch.zeros(L), s[2])
        s[2, ::7] = -0.0                                         # -0.0 ties with +0.0 (lower id first)
    s[-1, :] = float("-inf") if N > 3 else s[-1, :]              # a row with nothing selectable
    _check_select(s, k, sorted_, block=block)


def test_twin_select_is_stable():
    from deepinfer_sg.kernels.indexer import _select
    gen = torch.Generator().manual_seed(5)
    s = torch.randn(3, 300, generator=gen).round()
    s[1, 100:] = float("-inf")
    ref_i, ref_v = _stable_topk(s, 150)
    i, v = _select(s, 150)
    assert torch.equal(i, ref_i) and torch.equal(v, ref_v)


def test_engine_topk_ids_through_the_kernel():
    """engine/indexer.py's CUDA selection (`topk_ids` through the select kernel) gives the entries of the
    reference's stable `topk_mask`, ascending and -1 padded, with ties, zeros / -0.0, entries not allowed and rows
    with fewer allowed entries than k."""
    from deepinfer_sg.engine.indexer import topk_ids, topk_mask
    gen = torch.Generator().manual_seed(11)
    for T, G, k in ((5, 300, 40), (5, 240, 12)):
        s = torch.randn(T, G, generator=gen).round() * torch.randn(T, 1, generator=gen).sign()
        s[1] = torch.where(s[1] > 0, s[1], torch.zeros(G)) * -1.0      # relu-style zeros, many -0.0
        allowed = torch.rand(T, G, generator=gen) < 0.7
        allowed[2, 30:] = False                                          # fewer allowed entries than k
        allowed[3] = False                                               # none
        got = topk_ids(on_dev(s), on_dev(allowed), k, triton=True).cpu()
        mask = topk_mask(s, allowed, k)
        want = torch.full((T, min(k, G)), -1)
        for t in range(T):
            ids = mask[t].nonzero().flatten()
            want[t, :len(ids)] = ids
        assert torch.equal(got, want)


@pytest.mark.parametrize("N,L,k,chunks,block", [(3, 500, 20, 4, None), (3, 600, 30, 7, None), (3, 333, 16, 16, None),
                                                (2, 900, 30, 3, 128), (3, 64, 5, 13, None)])
@pytest.mark.parametrize("sorted_", [True, False])
def test_chunked_select_matches_stable_sort(N, L, k, chunks, block, sorted_):
    """The two-launch select (each chunk's exact top-k, then the top-k of the candidates, ids mapped back) picks
    exactly what a stable sort picks: ties spread over chunk boundaries (rounded scores, a constant row, zeros and
    -0.0), a row whose selectable entries all sit in its last chunk, chunks with nothing selectable."""
    gen = torch.Generator().manual_seed(N * L + k + chunks)
    s = torch.randn(N, L, generator=gen).round()                 # many ties, across chunks
    s[1] = 2.0                                                   # one value everywhere: the lowest ids win
    s[1, : L - L // 5] = float("-inf")                           # ... among the last entries only
    s[-1] = torch.where(torch.rand(L, generator=gen) < 0.5, torch.zeros(L), s[-1] * 0.0)  # +0.0 and -0.0 only
    s[-1, ::3] = float("-inf")
    _check_select(s, k, sorted_, block=block, chunks=chunks)


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


@pytest.mark.parametrize("dtype,with_cand", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, True)])
def test_engine_form_of_the_score_kernel(dtype, with_cand):
    """The score kernel as the batched step runs it (engine/indexer.py's `select_ids`): head weights in bf16 at a
    row stride (a column slice of the stacked product) times w_scale, the queries' last 16 channels rotated by the
    rows' turns in the kernel, and only the entries each row's position sees (and its candidates) scored, -inf
    elsewhere: against the twin (rope, scores, visible mask one after the other), and in fp32 against the kernels
    it replaces (kernels/rope.py, the plain score kernel, kernels/index_rows.py) to round-off."""
    from deepinfer_sg.kernels.index_rows import visible_scores_triton
    from deepinfer_sg.kernels.indexer import indexer_scores_triton
    from deepinfer_sg.kernels.rope import apply_rope_triton
    gen = torch.Generator().manual_seed(3 + with_cand)
    iq, _, keys, start, length = _inputs(gen, Hi=5, Di=32, dtype=dtype)
    w = torch.randn(4, 9, generator=gen).to(torch.bfloat16)[:, 2:7]
    ang = torch.rand(4, 8, generator=gen) * 6.3
    turn = torch.stack([ang.cos(), ang.sin()], -1)
    pos = torch.tensor([5, 13, 200, 40])                         # (row 2 sees all its entries, the others fewer)
    cand = torch.rand(4, 70, generator=gen) < 0.6 if with_cand else None
    kw = dict(w_scale=0.3, turn=turn, positions=pos, ratio=2, cand=cand)
    ref = indexer_scores_torch(iq, w, keys, start, length, 70, **kw)
    got = to_cpu(indexer_scores_triton(*on_dev((iq, w, keys, start, length)), 70, block_g=16, blocks_per_program=2,
                                       **on_dev(kw)))
    assert torch.equal(torch.isinf(got), torch.isinf(ref)) and bool(torch.isinf(ref).any())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got, ref, rtol=tol, atol=tol * 10)
    if dtype == torch.float32:
        d = on_dev((iq, w, keys, start, length, turn, pos, cand))
        old = indexer_scores_triton(apply_rope_triton(d[0], d[5]), d[1].float() * 0.3, *d[2:5], 70)
        old = to_cpu(visible_scores_triton(old, d[6], d[4], 2, d[7])[1])
        assert torch.equal(torch.isinf(got), torch.isinf(old))
        assert torch.allclose(got, old, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("G,k,chunks", [(200, 24, None), (330, 16, 3), (20, 32, None)])
def test_unsorted_select_is_already_in_id_order(G, k, chunks):
    """sorted=False returns the winners as ascending entry ids, then -1 padding, on every select path (one program
    per row, the chunked two-launch select, k > G): exactly what engine/indexer.py's `topk_ids` gets after
    re-sorting, so that sort is the identity (and `idx[:, :min(k, G)]` is its result)."""
    from deepinfer_sg.kernels.indexer import topk_select_triton
    gen = torch.Generator().manual_seed(G + k)
    s = torch.randn(5, G, generator=gen).round()                  # ties across chunks
    s[1, G // 3:] = float("-inf")                                  # fewer selectable entries than k
    s[2] = float("-inf")                                           # none
    s[3] = torch.where(torch.rand(G, generator=gen) < 0.5, torch.zeros(G), -torch.zeros(G))   # +0.0 / -0.0
    idx, _ = to_cpu(topk_select_triton(on_dev(s), k, sorted=False, chunks=chunks))
    resorted = torch.where(idx >= 0, idx, G).sort(dim=1).values[:, :min(k, G)]
    resorted = torch.where(resorted < G, resorted, -1)
    assert torch.equal(idx[:, :min(k, G)], resorted)
    ref_i, _ = _in_entry_order(*_stable_topk(s, k), G)
    assert torch.equal(idx, ref_i)



@pytest.mark.parametrize("search", [None, (0.0, 0.1, 0)])
def test_select_search_on_hostile_rows(search):
    """The interpolation search (whose first guess is a normal fit) picks exactly what a stable sort picks on rows
    where a normal fit is a bad guess: a bimodal row, magnitudes from 1e-38 (subnormal) to 1e38 with +inf among
    them, a row of two values (the cut inside a run of ties), one huge outlier above near-equal values, and
    negative scores only. (0, 0.1, 0): all three first-guess thresholds at one key, a tiny spread and no top-4
    end game, so the search leans on its quartering passes."""
    from deepinfer_sg.kernels.indexer import SEARCH
    search = search or SEARCH
    gen = torch.Generator().manual_seed(7)
    L, k = 96, 16
    s = torch.randn(6, L, generator=gen)
    s[0] = torch.where(torch.rand(L, generator=gen) < 0.9, s[0] - 50.0, s[0] + 50.0)          # bimodal
    s[1] = torch.exp(torch.empty(L).uniform_(-87.0, 87.0, generator=gen)) * s[1].sign()   # 1e-38 .. 1e38
    s[1, 5] = 1e-40                                                                          # subnormal
    s[1, 9] = float("inf")
    s[2] = torch.where(torch.rand(L, generator=gen) < 0.5, torch.full((L,), 3.0), torch.full((L,), 2.0))
    s[3] = 1.0 + s[3] * 1e-6
    s[3, 70] = 1e30
    s[4] = -s[4].abs() - 1.0
    s[5, ::2] = float("-inf")
    for sorted_ in (True, False):                     # two chunks: the chunk stage, then the merge over its ids
        _check_select(s, k, sorted_, chunks=2, search=search)
        _check_select(_bottom_end_rows(), k, sorted_, chunks=1, search=search)


def _bottom_end_rows():
    """Two rows of 96 on which the default search ends 1-3 ranks above its bracket's lower end (the end game
    then takes the bracket's smallest keys), the second with a run of ties at the cut longer than the end game
    sees (its rank is counted once more): numbers 1 and 21 of a stream of tie-heavy rows (found by replaying the
    search's arithmetic, and checked to take that branch in the interpreter)."""
    import numpy as np
    rng = np.random.default_rng(1)
    rows = []
    for trial in range(22):
        kind = trial % 3
        rows.append(rng.integers(0, 12, 96).astype(np.float32) if kind == 0 else
                    rng.standard_normal(96).astype(np.float32).round(1) if kind == 1 else
                    rng.standard_normal(96).astype(np.float32))
    return torch.tensor(np.stack([rows[1], rows[21]]))


@pytest.mark.parametrize("N,L", [(3, 520), (13, 520), (3, 170)])
def test_default_select_of_many_chunks(N, L, monkeypatch):
    """Rows of more than 4 default chunks (16 * k entries each), unsorted: at most TREE_ROWS rows of at least
    TREE_CHUNKS chunks merge through the fused tree (one _fused_launch), more rows or fewer chunks in a second
    launch (none); both pick exactly what a stable sort picks and leave the tickets at 0."""
    from deepinfer_sg.kernels import indexer
    k = 2
    chunks = indexer.default_chunks(L, k)
    assert chunks > indexer.FAN and 3 <= indexer.TREE_ROWS < 13
    fused = []
    real = indexer._fused_launch
    monkeypatch.setattr(indexer, "_fused_launch", lambda *a, **kw: fused.append(1) or real(*a, **kw))
    gen = torch.Generator().manual_seed(N)
    s = torch.randn(N, L, generator=gen).round()
    s[1, 40:] = float("-inf")
    _check_select(s, k, False)
    assert len(fused) == (1 if N <= indexer.TREE_ROWS and chunks >= indexer.TREE_CHUNKS else 0)
    assert int(tickets(DEVICE, (chunks // 4 + 2) * N, site="indexer").abs().sum()) == 0


@pytest.mark.parametrize("sorted_,chunks", [(True, 3), (False, 3), (False, 7)])
def test_fused_select_matches_stable_sort(sorted_, chunks):
    """The one-launch select (each row's last chunk program to take its ticket merges the row's candidates; with
    more than 4 chunks a tree: the last chunk of each group of 4 merges the group, the last group the row) picks
    exactly what a stable sort picks: ties across chunks, a constant row whose selectable entries sit in its last
    chunks, a row with nothing selectable; and leaves its tickets (kernels.backend's shared counters) at 0 for
    the next launch (the sorted case runs twice on them)."""
    gen = torch.Generator().manual_seed(12)
    s = torch.randn(4, 300, generator=gen).round()
    s[1] = 2.0
    s[1, :200] = float("-inf")
    s[2] = float("-inf")
    for _ in range(2 if sorted_ else 1):
        _check_select(s, 24, sorted_, chunks=chunks, fused=True)
        assert int(tickets(DEVICE, 12, site="indexer").abs().sum()) == 0


@pytest.mark.parametrize("G,block,top", [(64, 8, 8), (64, 8, 9), (61, 8, 8), (200, 8, 6), (200, 8, 30), (5, 8, 1)])
def test_candidate_blocks_are_the_rule(G, block, top):
    """engine/indexer.py's `candidate_block_mask` against the rule written out per row: block score = max over
    its visible entries, the block of the row's last visible entry always kept, the `top` best blocks kept (ties
    -> lower block), entries of kept blocks that are visible; at most `top` blocks (its shortcut: the mask is
    `visible` itself) and more."""
    from deepinfer_sg.engine.indexer import candidate_block_mask
    gen = torch.Generator().manual_seed(G + block + top)
    T = 7
    s = torch.randn(T, G, generator=gen).round()                         # ties between blocks
    n_vis = torch.randint(0, G + 1, (T,), generator=gen)
    n_vis[0] = 0
    visible = torch.arange(G)[None, :] < n_vis[:, None]
    got = candidate_block_mask(s, visible, block, top)
    # the fused path's form: scores already -inf outside visible, not masked again
    assert torch.equal(candidate_block_mask(s.masked_fill(~visible, float("-inf")), visible, block, top, masked=True),
                       got)
    for t in range(T):
        n = int(n_vis[t])
        best = {}
        for g in range(n):
            best[g // block] = max(best.get(g // block, float("-inf")), float(s[t, g]))
        if n:
            best[(n - 1) // block] = float("inf")
        kept = sorted(best, key=lambda b: (-best[b], b))[:top]
        assert got[t].tolist() == [g < n and g // block in kept for g in range(G)]
