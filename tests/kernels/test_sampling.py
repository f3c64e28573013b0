"""Fused sampling: Triton vs twin (same counter-based noise, so identical tokens), and the twin's exact
distribution against q computed by hand from the definition."""
import math

import pytest
import torch

from deepinfer_sg.kernels import processed_probs, rng, sample_from_logits
from deepinfer_sg.kernels.sampling import row_params, sample_torch, sample_triton
from helpers import DEVICE, assert_matches_distribution, bit_allowed, on_dev, params_on_dev, random_bitmask


def test_rng_triton_matches_torch_bit_for_bit():
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(keys_ptr, out_ptr, N: tl.constexpr):
        key = tl.load(keys_ptr + tl.program_id(0)).to(tl.uint32)
        ids = tl.arange(0, N)
        tl.store(out_ptr + tl.program_id(0) * N + ids, rng.uniform_tl(key, ids))

    gen = torch.Generator().manual_seed(0)
    seeds = torch.randint(-2**62, 2**62, (6,), generator=gen)
    keys = rng.row_keys(seeds, torch.randint(0, 2**40, (6,), generator=gen), rng.VERIFY)
    assert (keys >= 2**31).any() and (keys < 2**31).any()          # both halves of the uint32 range
    out = on_dev(torch.full((6, 256), -1.0))
    kernel[(6,)](on_dev(keys), out, N=256)
    out = out.cpu()
    ref = rng.uniform(keys[:, None], torch.arange(256)[None, :])
    assert torch.equal(out, ref)
    u = rng.uniform(keys[:1, None], torch.arange(100000)[None, :])
    assert 0 < float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.005 and abs(float(u.var()) - 1 / 12) < 0.002


def _hand_q(logits_row, temperature, top_k, top_p, allowed):
    """q from the definition, with Python floats and loops (independent of the twin's sort/cumsum)."""
    z = [x / temperature if ok else -math.inf for x, ok in zip(logits_row.tolist(), allowed)]
    live = [v for v in range(len(z)) if z[v] > -math.inf]
    m = max(z[v] for v in live)
    e = {v: math.exp(z[v] - m) for v in live}
    total = sum(e.values())
    top = [v for v in live if top_k == 0 or len([u for u in live if z[u] > z[v]]) < top_k]    # top-k first
    total = sum(e[v] for v in top)                                                              # renormalised
    kept = []
    for v in top:
        greater = [u for u in live if z[u] > z[v]]
        if sum(e[u] for u in greater) / total < top_p:
            kept.append(v)
    s = sum(e[v] for v in kept)
    return torch.tensor([e[v] / s if v in kept else 0.0 for v in range(len(z))], dtype=torch.float64)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.6, 3, 1.0), (1.5, 0, 0.7), (1.0, 4, 0.8)])
def test_twin_samples_exact_distribution(temperature, top_k, top_p):
    gen = torch.Generator().manual_seed(7)
    vocab, n = 7, 30000
    logits = torch.randn(vocab, generator=gen) * 1.5
    bm = random_bitmask(1, vocab, gen, density=0.8)
    allowed = [bit_allowed(bm, 0, v) for v in range(vocab)]
    q = _hand_q(logits, temperature, top_k, top_p, allowed)
    public_q = processed_probs(logits[None], temperature, top_k, top_p, bitmask=bm)[0]
    assert torch.allclose(public_q.double(), q, atol=1e-6)
    rows = logits.expand(n, vocab).contiguous()
    toks = sample_from_logits(rows, temperature, top_k, top_p, seed=11, position=torch.arange(n),
                              bitmask=bm, mask_rows=torch.zeros(n, dtype=torch.int64))
    counts = torch.bincount(toks, minlength=vocab)
    assert counts[[v for v in range(vocab) if q[v] == 0]].sum() == 0
    assert_matches_distribution(counts, q, n)


@pytest.mark.parametrize("seg,lanes", [(8, 2), (4, 4), (16, 4)])
def test_lane_draw_is_exact_across_segments_and_lanes(seg, lanes):
    """The lane-level Gumbel-max and in-lane inverse CDF (module docstring of kernels/sampling.py) on a
    vocabulary spanning several segments and lanes with a partial last segment: the counts follow softmax(z) over
    the allowed tokens (computed in float64 here), and the Triton kernel draws the same tokens as the twin."""
    gen = torch.Generator().manual_seed(seg * 10 + lanes)
    vocab, n = 21, 24000
    logits = torch.randn(vocab, generator=gen) * 1.2
    logits[3] = -float("inf")                                       # a token that may never be drawn
    q = torch.softmax(logits.double() / 0.8, 0)
    rows = logits.expand(n, vocab).contiguous()
    p = row_params(n, "cpu", 0.8, 0, 1.0, seed=torch.arange(n) // 7, position=torch.arange(n) % 7)
    toks = sample_torch(rows, p, seg=seg, lanes=lanes)
    counts = torch.bincount(toks, minlength=vocab)
    assert int(counts[3]) == 0
    assert_matches_distribution(counts, q, n)
    sub = slice(0, 40)                                               # the interpreter is slow: a subset
    tri = sample_triton(on_dev(rows[sub]), params_on_dev(row_params(40, "cpu", 0.8, 0, 1.0, seed=torch.arange(40) // 7,
                                                                    position=torch.arange(40) % 7)),
                        seg=seg, lanes=lanes).cpu()
    assert torch.equal(tri, toks[sub])


def test_triton_matches_twin_on_many_rows():
    """Many rows of one small distribution: equal tokens row by row means equal distributions too."""
    gen = torch.Generator().manual_seed(8)
    n, vocab = 300, 13
    logits = (torch.randn(vocab, generator=gen) * 2).expand(n, vocab).contiguous()
    p = row_params(n, "cpu", 0.9, 0, 1.0, seed=torch.arange(n) * 7919, position=5)
    a = sample_torch(logits, p)
    b = sample_triton(on_dev(logits), params_on_dev(p)).cpu()
    assert torch.equal(a, b)
    assert len(set(a.tolist())) > 5


@pytest.mark.parametrize("vocab", [37, 300, 1000])
def test_triton_matches_twin_mixed_rows(vocab):
    gen = torch.Generator().manual_seed(vocab)
    R = 6
    logits = torch.randn(R, vocab, generator=gen) * 3
    logits[2, 5] = logits[2, 9] = logits[2].max() + 1             # greedy tie: the lower id must win
    bm = random_bitmask(R + 2, vocab, gen, density=0.6)
    mrows = torch.tensor([7, 0, -1, 3, 4, 6])
    temperature = torch.tensor([1.0, 0.7, 0.0, 1.3, 1.0, 0.5])
    top_k = torch.tensor([0, 5, 0, 0, 9, 0])
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.6, 0.9, 1.0])
    p = row_params(R, "cpu", temperature, top_k, top_p, seed=torch.arange(R) + 100, position=torch.arange(R) * 3)
    a = sample_torch(logits, p, bm, mrows, seg=256, lanes=64)       # several segments, a partial last one
    b = sample_triton(on_dev(logits), params_on_dev(p), on_dev(bm), on_dev(mrows), seg=256, lanes=64).cpu()
    assert torch.equal(a, b)
    assert torch.equal(sample_torch(logits, p, bm, mrows), sample_triton(on_dev(logits), params_on_dev(p),
                                                                          on_dev(bm), on_dev(mrows)).cpu())
    assert int(a[2]) == 5
    for r in range(R):
        if int(mrows[r]) >= 0:
            assert bit_allowed(bm, int(mrows[r]), int(a[r]))


@pytest.mark.parametrize("vocab", [9000, 8720])
@pytest.mark.parametrize("shape", [None, (256, 2), (128, 1), (64, 1), (256, 8), (64, 2), (128, 4), (128, 2, 1),
                                   (256, 2, 1), (256, 1, 1), (256, 1, 2), (256, 2, 2)])
def test_pass_shapes_draw_the_twins_tokens(shape, vocab):
    """Every program shape of the pass (lanes per program, warps: 4, 2 or 1 lanes per thread side by side, mask
    words loaded once per thread and k; a third entry: lanes side by side, the rest in sub-blocks) draws the twin's
    tokens on masked, greedy, hot and cold rows with a partial last segment. Both vocabularies matter on a GPU:
    8,720 (a multiple of 16) gets vectorised logits loads and so a layout with a thread's lanes side by side; 9,000
    does not (a thread's lanes 64 apart, in other mask words): the packed mask-word load must be right in both
    (session 4's was not in the second). Rows 2 and 4 are unmasked in a masked batch (greedy and sampled: full
    segments read row 0's words and set them all, threshold._dense_block); the same rows without any mask too."""
    gen = torch.Generator().manual_seed(14)
    R = 7
    logits = torch.randn(R, vocab, generator=gen) * 3
    bm = random_bitmask(R, vocab, gen, density=0.7)
    mrows = torch.tensor([0, 1, -1, 3, -1, 5, 6])
    p = row_params(R, "cpu", torch.tensor([1.0, 0.5, 0.0, 1.0, 2.0, 0.0, 0.7]), 0, 1.0, seed=torch.arange(R),
                   position=3)
    want = sample_torch(logits, p, bm, mrows)
    got = sample_triton(on_dev(logits), params_on_dev(p), on_dev(bm), on_dev(mrows), shape=shape)
    assert torch.equal(got.cpu(), want)
    for r in range(R):
        if int(mrows[r]) >= 0:
            assert bit_allowed(bm, int(mrows[r]), int(want[r]))
    unmasked = sample_triton(on_dev(logits), params_on_dev(p), shape=shape)
    assert torch.equal(unmasked.cpu(), sample_torch(logits, p))


@pytest.mark.parametrize("shape", [None, (128, 1)])
def test_mask_first_reads_only_allowed_tokens_and_draws_the_twins_tokens(shape):
    """MASK_FIRST (masked rows, one lane per thread: the mask words first, then only the allowed tokens' logits,
    banned ones never read): the twin's tokens on rows whose masks ban whole ranges (as grammar masks do) and on
    random masks, with a partial last segment; the banned logits are NaN (none may reach the draw)."""
    gen = torch.Generator().manual_seed(16)
    R, vocab = 5, 9000
    logits = torch.randn(R, vocab, generator=gen) * 3
    bm = random_bitmask(R, vocab, gen, density=0.7)
    bm[1:3] = 0
    bm[1, 40:44] = -1                                     # 128 allowed tokens in one range
    bm[2, 280:] = torch.randint(-2**31, 2**31 - 1, (bm.shape[1] - 280,), generator=gen, dtype=torch.int32)
    mrows = torch.tensor([0, 1, 2, -1, 4])
    p = row_params(R, "cpu", torch.tensor([1.0, 0.7, 0.0, 1.0, 1.5]), 0, 1.0, seed=torch.arange(R), position=8)
    want = sample_torch(logits, p, bm, mrows)
    bits = (bm.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    banned = bits.reshape(R, -1)[:, :vocab] == 0                     # per mask row
    poisoned = logits.masked_fill(banned[mrows.clamp_min(0)] & (mrows >= 0)[:, None], float("nan"))
    got = sample_triton(on_dev(poisoned), params_on_dev(p), on_dev(bm), on_dev(mrows), shape=shape, filters=False,
                        mask_first=True)
    assert torch.equal(got.cpu(), want)


def test_host_params_moved_in_two_copies_draw_the_same_tokens():
    """sample_from_logits builds host-given parameters on the host and moves them in two packed copies (greedy
    as an integer): the kernels draw the twin's tokens from that form too."""
    from deepinfer_sg.kernels.sampling import to_device
    gen = torch.Generator().manual_seed(15)
    R, vocab = 6, 700
    logits = torch.randn(R, vocab, generator=gen) * 2
    p = row_params(R, "cpu", torch.tensor([1.0, 0.0, 0.7, 1.0, 0.0, 2.0]), torch.tensor([0, 0, 5, 0, 3, 0]),
                   torch.tensor([1.0, 1.0, 1.0, 0.8, 1.0, 1.0]), seed=torch.arange(R) * 5, position=11)
    moved = to_device(p, DEVICE)
    assert moved.greedy.dtype == torch.int64 and moved.greedy.cpu().tolist() == [0, 1, 0, 0, 1, 0]
    got = sample_triton(on_dev(logits), moved, seg=256, lanes=64).cpu()
    assert torch.equal(got, sample_torch(logits, p, seg=256, lanes=64))


def test_batch_composition_does_not_change_samples():
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(5, 200, generator=gen)
    seeds, pos = torch.tensor([3, 1, 4, 1, 5]), torch.tensor([10, 20, 30, 40, 50])
    alone = [int(sample_from_logits(logits[i:i + 1].contiguous(), 1.0, 0, 1.0, seeds[i:i + 1], pos[i:i + 1]))
             for i in range(5)]
    perm = torch.tensor([4, 2, 0, 3, 1])
    p = row_params(5, "cpu", 1.0, 0, 1.0, seeds[perm], pos[perm])
    together = sample_triton(on_dev(logits[perm].contiguous()), params_on_dev(p)).cpu()
    assert together.tolist() == [alone[i] for i in perm.tolist()]


def test_row_with_nothing_allowed_gives_minus_one_and_bad_params_raise():
    logits = torch.randn(2, 40)
    bm = torch.zeros(2, 2, dtype=torch.int32)
    bm[1, 0] = 1 << 3
    p = row_params(2, "cpu", 1.0, 0, 1.0, 0, 0)
    assert sample_torch(logits, p, bm).tolist() == [-1, 3]
    assert sample_triton(on_dev(logits), params_on_dev(p), on_dev(bm)).tolist() == [-1, 3]
    with pytest.raises(ValueError, match="top_p"):
        sample_from_logits(logits, 1.0, 0, 0.0, 0, 0)
    with pytest.raises(ValueError, match="temperature"):
        sample_from_logits(logits, torch.tensor([1.0, 2.0, 3.0]), 0, 1.0, 0, 0)
    with pytest.raises(ValueError, match="at least one row"):       # unmasked rows read row 0's words
        sample_from_logits(logits, 1.0, 0, 1.0, 0, 0, bm[:0], torch.tensor([-1, -1]))


def test_rng_row_keys_kernel_and_extremes():
    gen = torch.Generator().manual_seed(5)
    seeds = torch.randint(-2**62, 2**62, (300,), generator=gen)
    pos = torch.randint(0, 2**45, (300,), generator=gen)
    for stream in (rng.FRESH, rng.RESIDUAL, rng.VERIFY):
        ref = rng.row_keys_torch(seeds, pos, stream)
        assert torch.equal(rng.row_keys_triton(on_dev(seeds), on_dev(pos), stream).cpu(), ref)
    assert len(set(rng.row_keys_torch(seeds, pos, 0).tolist())) == 300
    # the largest and smallest hashes still give 0 < u < 1, hence finite noise
    h = torch.tensor([0, 2**32 - 1])
    u = rng.unit_from_hash(h)
    assert 0 < float(u[0]) and float(u[1]) < 1
    # E = -log(u) matches float64 everywhere, including the series region next to u = 1
    keys = rng.row_keys_torch(seeds[:1], pos[:1], 0)
    ids = torch.arange(200000)
    e = rng.exponential(keys, ids).double()
    exact = -torch.log(rng.uniform(keys, ids).double())
    assert torch.allclose(e, exact, rtol=1e-6, atol=0)
    assert float(exact.min()) < 1 / 64                       # the sample reached the series region


def test_unit_and_gumbel_from_bits_match_twin_bit_for_bit():
    """The kernels build u from bits (no int->float conversion) and v = 1 - u; both must equal the twin's integer
    formulas exactly, including the extreme hashes; the Gumbel noise (accurate log path) agrees to an ulp of the
    logs (NumPy's and torch's log2 differ in the last bit on some inputs)."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(h_ptr, keys_ptr, u_ptr, g_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        h = tl.load(h_ptr + i).to(tl.uint32)
        tl.store(u_ptr + i, rng._unit_tl(h))
        key = tl.load(keys_ptr).to(tl.uint32)
        tl.store(g_ptr + i, rng.gumbel_tl(key, i, False))

    gen = torch.Generator().manual_seed(12)
    h = torch.randint(0, 2**32, (4096,), generator=gen)
    h[:4] = torch.tensor([0, 2**32 - 1, 511, 2**32 - 512])
    keys = rng.row_keys_torch(torch.tensor([5]), torch.tensor([77]), rng.FRESH)
    u, g = on_dev(torch.full((4096,), -1.0)), on_dev(torch.full((4096,), -1.0))
    kernel[(1,)](on_dev(h), on_dev(keys), u, g, N=4096)
    assert torch.equal(u.cpu(), rng.unit_from_hash(h))
    ref = rng.gumbel(keys, torch.arange(4096))
    assert torch.allclose(g.cpu(), ref, rtol=1e-6, atol=1e-6) and float(ref.max()) > 5   # reached the series region


@pytest.mark.parametrize("seg,lanes,lane_shape", [(64, 4, None), (4096, 256, None), (4096, 256, (256, 2))])
def test_top_k_rows_drawn_by_the_merge_match_twin_and_pass(seg, lanes, lane_shape, monkeypatch):
    """draw=True: rows with 0 < top_k <= 64 get their token from the top-k merge (the sampling rule on the lanes
    it gathered, restricted to the kept tokens; the pass skips those rows); lane_only (every row such a row): the
    merge's tokens are the result, no pass at all. On a layout where kept tokens share lanes (64 lanes of 16 for
    1000 tokens) and on the default one, with masks and temperatures: the same tokens as the twin and as the pass
    with tau."""
    from deepinfer_sg.kernels import threshold
    from deepinfer_sg.kernels.threshold import thresholds_and_paths
    if lane_shape:                                                  # another lane-maxima program shape
        monkeypatch.setattr(threshold, "LANE_SHAPE", lane_shape)
    gen = torch.Generator().manual_seed(31 + seg)
    R, vocab = 12, 1000
    logits = torch.randn(R, vocab, generator=gen) * 2
    bm = random_bitmask(R, vocab, gen, density=0.8)
    mrows = torch.arange(R)
    mrows[::5] = -1
    top_k = torch.randint(1, 65, (R,), generator=gen)
    top_k[3] = 0                                                     # one row on the histogram path
    top_p = torch.where(torch.rand(R, generator=gen) < 0.5, torch.rand(R, generator=gen) * 0.9 + 0.05,
                        torch.ones(R))
    temperature = torch.rand(R, generator=gen) + 0.5
    p = row_params(R, "cpu", temperature, top_k, top_p, seed=torch.arange(R) * 17 + 2, position=21)
    want = sample_torch(logits, p, None if lanes < 32 else bm, None if lanes < 32 else mrows, seg=seg, lanes=lanes)
    masks = () if lanes < 32 else (on_dev(bm), on_dev(mrows))
    merged = sample_triton(on_dev(logits), params_on_dev(p), *masks, seg=seg, lanes=lanes, draw=True).cpu()
    passed = sample_triton(on_dev(logits), params_on_dev(p), *masks, seg=seg, lanes=lanes, draw=False).cpu()
    assert torch.equal(merged, want) and torch.equal(passed, want)
    drawn = thresholds_and_paths(on_dev(logits), params_on_dev(p), *(masks or (None, None)), draw=(seg, lanes))[2]
    assert int((drawn.cpu() != -2).sum()) == R - 1                   # every top-k row came from the merge
    keep = torch.tensor([r for r in range(R) if r != 3])
    sub = row_params(R - 1, "cpu", temperature[keep], top_k[keep], top_p[keep], seed=keep * 17 + 2, position=21)
    sub_masks = () if lanes < 32 else (on_dev(bm), on_dev(mrows[keep]))
    only = sample_triton(on_dev(logits[keep].contiguous()), params_on_dev(sub), *sub_masks, seg=seg, lanes=lanes,
                         lane_only=True).cpu()
    assert torch.equal(only, want[keep])


def test_top_k_merge_draws_the_twins_tokens_on_clustered_and_sparse_rows():
    """The top-k merge (lane_only): the twin's tokens on flat rows, a row whose top tokens cluster in low ids (many
    in few lanes), a masked row with 64 allowed tokens in two words, k from 1 to 64."""
    gen = torch.Generator().manual_seed(77)
    R, vocab = 6, 9000                                   # 2,272 lanes of 4
    logits = torch.randn(R, vocab, generator=gen) * 2
    logits[1, :60] += 10                                 # top tokens clustered at low ids
    bm = random_bitmask(R, vocab, gen, density=0.9)
    bm[4] = 0
    bm[4, :2] = -1                                       # 64 allowed tokens in two words
    mrows = torch.tensor([-1, -1, 2, 3, 4, -1])
    top_k = torch.tensor([50, 20, 1, 64, 40, 7])
    top_p = torch.tensor([0.9, 0.95, 1.0, 0.8, 1.0, 0.5])
    p = row_params(R, "cpu", torch.tensor([1.0, 1.0, 0.7, 1.3, 1.0, 0.9]), top_k, top_p, seed=torch.arange(R) * 3,
                   position=9)
    want = sample_torch(logits, p, bm, mrows, seg=128, lanes=32)
    got = sample_triton(on_dev(logits), params_on_dev(p), on_dev(bm), on_dev(mrows), seg=128, lanes=32,
                        lane_only=True).cpu()
    assert torch.equal(got, want)


def test_top_k_merge_draws_follow_the_exact_distribution():
    """The top-k merge's own draws (lane_only: no sampling pass at all) over many seeds follow q from the
    definition (top-k, then top-p on the renormalised top-k set, in float64 by hand), on a vocabulary spanning
    several segments and lanes with masked tokens: binomial bounds per token, and no token outside the kept set."""
    gen = torch.Generator().manual_seed(71)
    vocab, n = 21, 300                                              # (the interpreter runs one merge per row)
    logits = torch.randn(vocab, generator=gen) * 1.2
    logits[3] = -float("inf")                                       # never drawn
    q = _hand_q(logits, 0.8, 6, 0.9, [True] * vocab)
    rows = logits.expand(n, vocab).contiguous()
    p = row_params(n, "cpu", 0.8, 6, 0.9, seed=torch.arange(n) // 5, position=torch.arange(n) % 5)
    toks = sample_triton(on_dev(rows), params_on_dev(p), seg=8, lanes=2, lane_only=True).cpu()
    counts = torch.bincount(toks, minlength=vocab)
    assert counts[[v for v in range(vocab) if q[v] == 0]].sum() == 0
    assert_matches_distribution(counts, q, n, sigmas=4.5)
    assert torch.equal(toks[:60], sample_torch(rows[:60], row_params(60, "cpu", 0.8, 6, 0.9, seed=torch.arange(60) // 5,
                                                                       position=torch.arange(60) % 5), seg=8, lanes=2))
