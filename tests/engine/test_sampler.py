"""Sampler: distributions against hand-computed softmax/top-k/top-p (chi-square), masks, batch independence
(mask filling itself: test_mask_fill.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from deepinfer_sg.engine import sampler as S
from deepinfer_sg.engine.mask_fill import MaskJob
from deepinfer_sg.engine.sampler import SamplingRow, apply_token_bitmask_torch, counter_uniform, sample_batch

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def expected_probs(logits, temperature, top_k, top_p):
    """The spec by hand: softmax(logits / T), keep the top_k best, then the smallest prefix (by prob)
    whose mass before each kept token is < top_p; renormalise."""
    p = np.exp(np.array(logits, dtype=np.float64) / temperature)
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros_like(p, dtype=bool)
    k = len(p) if top_k <= 0 else top_k
    kept_mass = p[order[:k]].sum()
    before = 0.0
    for rank, i in enumerate(order[:k]):
        if before / kept_mass < top_p:
            keep[i] = True
        before += p[i]
    q = np.where(keep, p, 0.0)
    return q / q.sum()


def draw(n, temperature, top_k, top_p, use_fused, monkeypatch):
    logits = LOGITS.repeat(n, 1)
    rows = [SamplingRow(temperature, top_k, top_p, seed=s, position=3) for s in range(n)]
    monkeypatch.setattr(S, "FUSED_ON_CPU", use_fused)
    return np.array(sample_batch(logits, rows))


@pytest.mark.parametrize("use_fused", [False, True])
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, -1, 1.0), (1.0, 3, 1.0),
                                                     (1.0, -1, 0.8), (1.3, 4, 0.9)])
def test_sampling_distribution_matches_spec(temperature, top_k, top_p, use_fused, monkeypatch):
    if use_fused and S._FUSED is None:
        pytest.skip("kernels.sample_from_logits not available")
    n = 6000
    got = draw(n, temperature, top_k, top_p, use_fused, monkeypatch)
    q = expected_probs(LOGITS.tolist(), temperature, top_k, top_p)
    counts = np.bincount(got, minlength=len(q))
    assert counts[q == 0].sum() == 0, (counts, q)          # filtered tokens never drawn
    live = q > 0
    if live.sum() > 1:
        chi2, pval = stats.chisquare(counts[live], q[live] * n)
        assert pval > 1e-4, (counts, q * n)


@pytest.mark.parametrize("use_fused", [False, True])
def test_greedy_is_masked_argmax_and_dead_rows_give_minus_one(use_fused, monkeypatch):
    monkeypatch.setattr(S, "FUSED_ON_CPU", use_fused)
    logits = torch.tensor([[0.0, 5.0, 1.0, 3.0], [1.0, 2.0, 3.0, 4.0]])
    bitmask = torch.tensor([[0b1101], [0]], dtype=torch.int32)       # row 0: tokens 0, 2, 3; row 1: nothing
    job = MaskJob(num_rows=2, rows=[0, 1], bitmask=bitmask)
    rows = [SamplingRow(0.0, -1, 1.0, 1, 0), SamplingRow(1.0, -1, 1.0, 1, 0)]
    assert sample_batch(logits.clone(), rows, job) == [3, -1]


def test_counter_uniform_is_a_function_of_seed_and_position_only():
    a = [counter_uniform(7, p) for p in range(5000)]
    assert a == [counter_uniform(7, p) for p in range(5000)]
    assert a != [counter_uniform(8, p) for p in range(5000)]
    assert stats.kstest(a, "uniform").pvalue > 1e-4


@pytest.mark.parametrize("use_fused", [False, True])
def test_sample_batch_rows_do_not_depend_on_neighbours(use_fused, monkeypatch):
    monkeypatch.setattr(S, "FUSED_ON_CPU", use_fused)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(10, 5000, generator=g) * 3
    rows = [SamplingRow(0.9, 50 if i % 2 else -1, 0.9 if i % 3 else 1.0, seed=100 + i, position=7 + i) for i in range(10)]
    together = sample_batch(logits.clone(), rows)
    perm = list(reversed(range(10)))
    shuffled = sample_batch(logits[perm].clone(), [rows[i] for i in perm])
    alone = [sample_batch(logits[i:i + 1].clone(), [rows[i]])[0] for i in range(10)]
    assert together == alone == [shuffled[perm.index(i)] for i in range(10)]


def test_bitmask_torch_reference_against_bool_expansion():
    g = torch.Generator().manual_seed(1)
    V = 100
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 4), generator=g, dtype=torch.int64).to(torch.int32)
    logits = torch.randn(3, V, generator=g)
    out = logits.clone()
    apply_token_bitmask_torch(out, bitmask, torch.tensor([0, 2]))
    for r in range(3):
        for v in range(V):
            allowed = (int(bitmask[r, v // 32]) >> (v % 32)) & 1
            if r == 1 or allowed:
                assert out[r, v] == logits[r, v]
            else:
                assert out[r, v] == float("-inf")


# ---------------------------------------------------------------- inverse-CDF draws over a real-sized row

def numpy_inverse_cdf(w, u):
    """Oracle: the token t with cdf[t-1] <= u * total < cdf[t] over float64 numpy cumulative sums, plus the
    distance of u * total to the nearest boundary (draws that close to a boundary may round either way)."""
    cdf = np.cumsum(np.asarray(w, dtype=np.float64))
    target = u * cdf[-1]
    t = int(np.searchsorted(cdf, target, side="right"))
    return t, np.min(np.abs(cdf - target)) / cdf[-1]


def test_blocked_inverse_cdf_matches_numpy_search_for_many_uniforms():
    g = torch.Generator().manual_seed(3)
    V = 5000                                    # 4 full blocks of 1024 and a partial one
    w = torch.rand(4, V, generator=g) ** 4
    w[0, 1000:3100] = 0.0                       # whole empty blocks
    w[1, :4096] = 0.0                           # only the partial block has mass
    w[2, 4095] = 50.0                           # one heavy token on a block edge
    w[3, ::7] = 0.0
    u = torch.rand(4, 400, generator=g, dtype=torch.float64)
    u[:, 0], u[:, 1] = 0.0, 1.0 - 2.0 ** -53    # the extreme uniforms
    checked = 0
    for k in range(u.shape[1]):
        got = S.inverse_cdf_blocked(w, u[:, k]).tolist()
        for r in range(4):
            want, margin = numpy_inverse_cdf(w[r].numpy(), float(u[r, k]))
            assert w[r, got[r]] > 0                   # never a zero-weight token
            if margin > 1e-6:
                assert got[r] == want, (r, k, got[r], want)
                checked += 1
    assert checked > 1500
    assert S.inverse_cdf_blocked(torch.zeros(2, V), torch.tensor([0.3, 0.9], dtype=torch.float64)).tolist() == [-1, -1]


def test_plain_row_is_the_inverse_cdf_of_softmax_at_the_counter_uniform():
    """The CPU draw of a plain row is fully specified: softmax(logits / T) searched at U = counter_uniform(
    seed, position) (the speculative verifier's generator; seeds cut to 63 bits like the fused kernel and the
    speculative decoder). Checked against numpy for many (seed, position)."""
    g = torch.Generator().manual_seed(4)
    V = 3000
    logits = torch.randn(V, generator=g) * 2.5
    for seed, pos in [(s, 11 * s + 3) for s in range(60)] + [(2**64 - 5, 9), (2**63 + 1, 0)]:
        for temp in (1.0, 0.6):
            tok = S.sample_rows(logits.unsqueeze(0).clone(), [SamplingRow(temp, -1, 1.0, seed, pos)])[0][0]
            p = np.exp((logits.double().numpy() - logits.max().item()) / temp)
            want, margin = numpy_inverse_cdf(p, counter_uniform(seed & (2**63 - 1), pos))
            if margin > 1e-6:
                assert tok == want, (seed, pos, temp)


def test_sampling_distribution_over_many_blocks():
    """Chi-square over a 20,000-token row (20 of the sampler's 1024-token blocks): 12 heavy tokens spread over
    different blocks and block edges, the rest of the mass in one 'other' bin; top-k and top-p against the spec."""
    V = 20000
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(V, generator=g) - 4.0
    heavy = torch.tensor([3, 1023, 1024, 2047, 5000, 9215, 9216, 12345, 15000, 19455, 19456, 19999])
    logits[heavy] = torch.linspace(4.0, 6.0, len(heavy))
    n = 2000
    for temperature, top_k, top_p in [(1.0, -1, 1.0), (0.8, 8, 1.0), (1.0, -1, 0.7)]:
        rows = [SamplingRow(temperature, top_k, top_p, seed=10_000 + s, position=17) for s in range(n)]
        got = np.array(sample_rows_chunked(logits, rows))
        q = expected_probs(logits.tolist(), temperature, top_k, top_p) if top_k > 0 or top_p < 1 else \
            torch.softmax(logits.double() / temperature, -1).numpy()
        bins = list(heavy.tolist())
        expected = np.array([q[t] for t in bins] + [1.0 - q[bins].sum()]) * n
        counts = np.array([(got == t).sum() for t in bins] + [(~np.isin(got, bins)).sum()])
        live = expected > 1e-9
        if (~live).any():
            assert counts[~live].sum() == 0, (temperature, top_k, top_p, counts)
        pval = stats.chisquare(counts[live], expected[live] * n / expected[live].sum()).pvalue
        assert pval > 1e-4, (temperature, top_k, top_p, counts, expected)


def sample_rows_chunked(logits, rows, chunk=250):
    out = []
    for i in range(0, len(rows), chunk):
        part = rows[i:i + chunk]
        out += S.sample_rows(logits.expand(len(part), -1).contiguous(), part)[0]
    return out


def test_draws_equal_the_speculative_verifiers_fresh_draw():
    """The bonus token of speculative decoding is drawn from the processed distribution (spec_decode.
    processed_probs) at counter_uniforms(seed, position, CASE_FRESH) by inverse CDF; the plain sampler must
    give the same token for the same request state (plain, top-k and top-p rows), except within float
    rounding of a CDF boundary."""
    from deepinfer_sg.engine import spec_decode, speculative
    g = torch.Generator().manual_seed(6)
    V, n = 4000, 40
    logits = torch.randn(n, V, generator=g) * 2
    rows = [SamplingRow([1.0, 0.7][i % 2], [-1, 40, -1][i % 3], [1.0, 1.0, 0.85][i % 3], seed=2**63 + 77 * i,
                        position=5 + i) for i in range(n)]
    got = S.sample_rows(logits.clone(), rows)[0]
    q = spec_decode.processed_probs(logits.clone(), torch.tensor([r.temperature for r in rows]),
                                    torch.tensor([r.top_k for r in rows]), torch.tensor([r.top_p for r in rows]))
    seeds = torch.tensor([r.seed & (2**63 - 1) for r in rows])
    u = speculative.counter_uniforms(seeds, torch.tensor([r.position for r in rows]), speculative.CASE_FRESH)
    want = speculative.sample_inverse_cdf(q, u).tolist()
    compared = 0
    for i in range(n):
        _, margin = numpy_inverse_cdf(q[i].double().numpy(), float(u[i]))
        if margin > 1e-5:
            assert got[i] == want[i], (i, rows[i])
            compared += 1
    assert compared >= n - 2
