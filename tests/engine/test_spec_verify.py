"""speculative.verify: exact laws on small vocabularies, greedy identity, stop/max_tokens, counter RNG."""
import itertools

import pytest
import torch
from scipy.stats import chisquare

from deepinfer_sg.engine import speculative as S
from test_spec_toys import exact_verify_outcomes, random_dist

M64 = (1 << 64) - 1


def ref_splitmix64(x):
    """SplitMix64 finaliser in plain Python integers (independent of the torch int64 emulation)."""
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def ref_uniform(seed, pos, case):
    return (ref_splitmix64((ref_splitmix64(seed & M64) + 3 * pos + case) & M64) >> 11) / float(1 << 53)


def test_counter_uniforms_match_python_reference():
    seeds = [0, 1, 7, 2**31 - 1, 2**40 + 3, 2**63 - 1, -5]
    pos = [0, 1, 17, 4096, 2**33]
    for case in (0, 1, 2):
        s = torch.tensor([a for a in seeds for _ in pos])
        p = torch.tensor([b for _ in seeds for b in pos])
        got = S.counter_uniforms(s, p, case).tolist()
        want = [ref_uniform(a, b, case) for a in seeds for b in pos]
        assert got == want


def test_bonus_uses_the_engine_samplers_uniform():
    """A fresh (bonus) row draws with the same uniform plain sampling uses at that position."""
    sampler = pytest.importorskip("deepinfer_sg.engine.sampler")
    if not hasattr(sampler, "counter_uniform"):
        pytest.skip("engine sampler has no counter_uniform")
    for seed, pos in [(0, 0), (3, 11), (2**40, 123456)]:
        got = float(S.counter_uniforms(torch.tensor([seed]), torch.tensor([pos]), S.CASE_FRESH)[0])
        assert got == sampler.counter_uniform(seed, pos, sampler.CASE_FRESH)


def test_sample_inverse_cdf_cells_and_zero_weights():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]] * 6 + [[0.0] * 5])
    u = torch.tensor([0.0, 0.2499, 0.25, 0.9, 0.999999999, 1.0 - 2**-53, 0.3], dtype=torch.float64)
    assert S.sample_inverse_cdf(probs, u).tolist() == [1, 1, 3, 3, 3, 3, -1]


# ------------------------------------------------------------------------------------------ exact laws
def _tables(gen, v, depth, zeros=0):
    """A random conditional distribution for every prefix of length <= depth (dict prefix -> dist)."""
    return {pre: random_dist(gen, v, zeros) for n in range(depth + 1) for pre in itertools.product(range(v), repeat=n)}


@pytest.mark.parametrize("v,L,zeros", [(3, 1, 0), (4, 2, 0), (3, 3, 0), (4, 2, 1), (5, 2, 2)])
def test_one_round_is_lossless_exactly(v, L, zeros):
    """Drafts d_j ~ p(.|d_<j), verification against q(.|d_<j); the committed block, completed to length
    L+1 by sampling from q, has exactly the target law q(x_1) q(x_2|x_1) ... (all paths enumerated)."""
    gen = torch.Generator().manual_seed(100 * v + L + zeros)
    q = _tables(gen, v, L, zeros)       # target; zeros: tokens the target never emits (like a grammar mask)
    p = _tables(gen, v, L)              # drafter
    cases, weights = [], []
    for drafts in itertools.product(range(v), repeat=L):
        w = 1.0
        for j in range(L):
            w *= float(p[drafts[:j]][drafts[j]])
        rows_q = torch.stack([q[drafts[:j]] for j in range(L + 1)])
        rows_p = torch.stack([p[drafts[:j]] if j < L else torch.zeros(v, dtype=torch.float64) for j in range(L + 1)])
        cases.append(dict(q=rows_q, p=rows_p, tokens=torch.tensor(list(drafts) + [S.FRESH])))
        weights.append(w)
    law = {}
    for w, outcomes in zip(weights, exact_verify_outcomes(cases)):
        for prob, n, committed, _ in outcomes:
            # complete the block to length L+1 with the target itself
            for tail in itertools.product(range(v), repeat=L + 1 - len(committed)):
                seq = committed + tail
                t = 1.0
                for j in range(len(committed), L + 1):
                    t *= float(q[seq[:j]][seq[j]])
                law[seq] = law.get(seq, 0.0) + w * prob * t
    for seq in itertools.product(range(v), repeat=L + 1):
        target = 1.0
        for j in range(L + 1):
            target *= float(q[seq[:j]][seq[j]])
        assert abs(law.get(seq, 0.0) - target) < 1e-12, (seq, law.get(seq, 0.0), target)


def test_forced_rejection_draws_the_residual_of_the_cut_draft():
    q = torch.tensor([[0.5, 0.3, 0.2, 0.0]], dtype=torch.float64)
    p = torch.tensor([[0.1, 0.1, 0.2, 0.6]], dtype=torch.float64)      # the cut draft was token 3 (q = 0 there)
    [outcomes] = exact_verify_outcomes([dict(q=q, p=p, tokens=torch.tensor([S.FORCED_REJECT]))])
    law = {c[0]: w for w, n, c, _ in outcomes}
    resid = (q[0] - p[0]).clamp_min(0)
    resid /= resid.sum()
    assert all(n == 0 for _, n, _, _ in outcomes)
    for t in range(4):
        assert abs(law.get(t, 0.0) - float(resid[t])) < 1e-12


def test_empty_residual_falls_back_to_q():
    q = torch.tensor([[0.25, 0.75]])
    res = S.verify(S.VerifyBatch(q, q.clone(), torch.tensor([S.FORCED_REJECT]), torch.tensor([1])),
                   S.VerifyUniforms(torch.tensor([0.5], dtype=torch.float64), torch.tensor([0.1], dtype=torch.float64),
                                    torch.tensor([0.9], dtype=torch.float64)))
    assert res.tokens.tolist() == [[0]] and res.finish.tolist() == [S.FINISH_NONE]


# ------------------------------------------------------------------------------------------ greedy
def test_greedy_equals_plain_argmax_decoding():
    gen = torch.Generator().manual_seed(3)
    v, L, n_req = 6, 4, 200
    logits = torch.randn(n_req, L + 1, v, generator=gen)
    logits[:, :, 2] = logits[:, :, 1]                 # ties: the lowest id must win, as in plain argmax
    argmax = logits.argmax(-1)
    # drafts agree with the argmax with probability ~0.7 per position
    agree = torch.rand(n_req, L, generator=gen) < 0.7
    drafts = torch.where(agree, argmax[:, :L], (argmax[:, :L] + 1) % v)
    q = torch.softmax(logits, -1).reshape(-1, v)
    rows = torch.cat([drafts, torch.full((n_req, 1), S.FRESH)], 1).reshape(-1)
    res = S.verify(S.VerifyBatch(q, None, rows, torch.full((n_req,), L + 1), seeds=torch.arange(n_req),
                                 positions=torch.zeros(n_req, dtype=torch.long), greedy=torch.ones(n_req, dtype=torch.bool)))
    for i in range(n_req):
        # plain decoding: target argmax at each position while the drafts agree, then the argmax
        n = 0
        while n < L and drafts[i, n] == argmax[i, n]:
            n += 1
        want = argmax[i, :n + 1].tolist()
        assert res.tokens[i, :int(res.num_committed[i])].tolist() == want
        assert int(res.num_accepted[i]) == n and int(res.cache_rollback[i]) == L - n


# ------------------------------------------------------------------------------------------ stop / max_tokens
def _greedy_block(drafts, v=6, accept=True, **kw):
    """A one-request greedy batch whose target argmax agrees with every draft, then picks token 5."""
    L = len(drafts)
    q = torch.full((L + 1, v), 0.01)
    for j, d in enumerate(drafts):
        q[j, d] = 1.0
    q[L, 5] = 1.0
    rows = torch.tensor(list(drafts) + [S.FRESH])
    return S.verify(S.VerifyBatch(q, None, rows, torch.tensor([L + 1]), seeds=torch.tensor([0]),
                                  positions=torch.tensor([0]), greedy=torch.tensor([True]), **kw))


def test_stop_token_inside_accepted_block():
    res = _greedy_block([3, 1, 4], stop_token_ids=torch.tensor([[1, -1]]))
    assert res.tokens[0, :int(res.num_committed[0])].tolist() == [3, 1]
    assert res.finish.tolist() == [S.FINISH_STOP] and res.num_accepted.tolist() == [3]
    res = _greedy_block([3, 2, 4], stop_token_ids=torch.tensor([[5]]))       # the bonus token is the stop
    assert res.tokens[0].tolist() == [3, 2, 4, 5] and res.finish.tolist() == [S.FINISH_STOP]


def test_max_tokens_inside_accepted_block():
    res = _greedy_block([3, 2, 4], max_new_tokens=torch.tensor([2]))
    assert res.tokens[0].tolist() == [3, 2, -1, -1] and res.finish.tolist() == [S.FINISH_LENGTH]
    res = _greedy_block([3, 1, 4], max_new_tokens=torch.tensor([2]), stop_token_ids=torch.tensor([[1]]))
    assert res.num_committed.tolist() == [2] and res.finish.tolist() == [S.FINISH_STOP]   # stop is the last kept
    res = _greedy_block([3, 2, 1], max_new_tokens=torch.tensor([2]), stop_token_ids=torch.tensor([[1]]))
    assert res.num_committed.tolist() == [2] and res.finish.tolist() == [S.FINISH_LENGTH]  # stop cut away
    res = _greedy_block([3, 2, 4], max_new_tokens=torch.tensor([9]))
    assert res.num_committed.tolist() == [4] and res.finish.tolist() == [S.FINISH_NONE]


def test_stop_and_length_exact_law_with_sampling():
    """Sampling mode: the committed tokens are cut exactly after the first stop / at max_new (every path)."""
    gen = torch.Generator().manual_seed(11)
    v, L = 4, 3
    cases = []
    for stop, max_new in [([0], 99), ([], 2), ([1, 2], 3), ([3], 1)]:
        q = torch.stack([random_dist(gen, v) for _ in range(L + 1)])
        p = torch.stack([random_dist(gen, v) for _ in range(L)] + [torch.zeros(v, dtype=torch.float64)])
        d = torch.tensor([int(torch.multinomial(p[j].float(), 1, generator=gen)) for j in range(L)] + [S.FRESH])
        cases.append(dict(q=q, p=p, tokens=d, stop=stop, max_new=max_new))
    for case, outcomes in zip(cases, exact_verify_outcomes(cases)):      # the helper asserts the cuts
        assert abs(sum(w for w, *_ in outcomes) - 1.0) < 1e-12
        for w, n, committed, finish in outcomes:
            stopped = any(t in case["stop"] for t in committed)
            assert finish == (S.FINISH_STOP if stopped else S.FINISH_LENGTH if len(committed) == case["max_new"]
                              else S.FINISH_NONE)


def test_error_only_for_the_request_with_an_empty_final_row():
    q = torch.tensor([[0.5, 0.5], [0.0, 0.0], [0.3, 0.7]])
    res = S.verify(S.VerifyBatch(q, torch.zeros_like(q), torch.tensor([S.FRESH, S.FRESH, S.FRESH]),
                                 torch.tensor([1, 1, 1]), seeds=torch.tensor([1, 2, 3]), positions=torch.tensor([0, 0, 0])))
    assert res.finish.tolist() == [S.FINISH_NONE, S.FINISH_ERROR, S.FINISH_NONE]
    assert res.num_committed.tolist() == [1, 0, 1]


def test_bad_layout_is_rejected_with_the_request_named():
    q = torch.full((3, 4), 0.25)
    with pytest.raises(ValueError, match=r"requests \[1\]"):
        S.verify(S.VerifyBatch(q, q, torch.tensor([S.FRESH, 2, 1]), torch.tensor([1, 2]),
                               seeds=torch.tensor([0, 0]), positions=torch.tensor([0, 0])))
    with pytest.raises(ValueError, match="target_probs"):
        S.verify(S.VerifyBatch(q, q, torch.tensor([S.FRESH, S.FRESH]), torch.tensor([1, 1])))


# ------------------------------------------------------------------------------------------ counter RNG
def _random_batch(gen, n_req, v=5, max_l=4):
    lens = torch.randint(0, max_l + 1, (n_req,), generator=gen)
    qs, ps, toks = [], [], []
    for i in range(n_req):
        for j in range(int(lens[i]) + 1):
            qs.append(random_dist(gen, v, 1))
            ps.append(random_dist(gen, v))
            toks.append(int(torch.multinomial(ps[-1].float(), 1, generator=gen)) if j < lens[i] else S.FRESH)
    return torch.stack(qs), torch.stack(ps), torch.tensor(toks), lens + 1


def test_results_do_not_depend_on_batch_composition():
    gen = torch.Generator().manual_seed(5)
    q, p, toks, counts = _random_batch(gen, 12)
    seeds, pos = torch.arange(100, 112), torch.arange(12) * 7
    full = S.verify(S.VerifyBatch(q, p, toks, counts, seeds=seeds, positions=pos))
    starts = torch.cumsum(counts, 0) - counts
    perm = torch.randperm(12, generator=gen)[:5]                  # a different, reordered batch
    rows = torch.cat([torch.arange(int(starts[i]), int(starts[i] + counts[i])) for i in perm])
    sub = S.verify(S.VerifyBatch(q[rows], p[rows], toks[rows], counts[perm], seeds=seeds[perm], positions=pos[perm]))
    for k, i in enumerate(perm.tolist()):
        n = int(full.num_committed[i])
        assert int(sub.num_committed[k]) == n
        assert sub.tokens[k, :n].tolist() == full.tokens[i, :n].tolist()


def test_counter_rng_matches_exact_law_statistically():
    """8000 seeds of one verification case: chi-square of the outcome counts against the exact law
    (p-value > 1e-3; seeds fixed, so the test is deterministic)."""
    gen = torch.Generator().manual_seed(8)
    v, L = 4, 3
    q = torch.stack([random_dist(gen, v) for _ in range(L + 1)])
    p = torch.stack([random_dist(gen, v) for _ in range(L)] + [torch.zeros(v, dtype=torch.float64)])
    d = torch.tensor([0, 2, 1, S.FRESH])
    [outcomes] = exact_verify_outcomes([dict(q=q, p=p, tokens=d)])
    n = 8000
    res = S.verify(S.VerifyBatch(q.repeat(n, 1), p.repeat(n, 1), d.repeat(n), torch.full((n,), L + 1),
                                 seeds=torch.arange(n) * 7919 + 1, positions=torch.full((n,), 42)))
    counts = {}
    for i in range(n):
        key = (int(res.num_accepted[i]), tuple(res.tokens[i, :int(res.num_committed[i])].tolist()))
        counts[key] = counts.get(key, 0) + 1
    keys = [(o[1], o[2]) for o in outcomes]
    assert set(counts) <= set(keys)
    expected = [o[0] * n for o in outcomes]
    observed = [counts.get(k, 0) for k in keys]
    assert chisquare(observed, expected).pvalue > 1e-3


# ------------------------------------------------------------------------------------------ D's fused kernel
def test_kernel_path_greedy_and_statistics():
    """verify_logits_kernel (helper D's speculative_accept, torch twin on CPU) + our cuts: greedy identity,
    and the first committed token follows q (chi-square over 6000 seeds, p > 1e-3)."""
    kernels = pytest.importorskip("deepinfer_sg.kernels")
    if not hasattr(kernels, "speculative_accept"):
        pytest.skip("kernels.speculative_accept not available")
    gen = torch.Generator().manual_seed(12)
    v, L, n = 5, 2, 6000
    logits = torch.randn(L + 1, v, generator=gen)
    q0 = torch.softmax(logits[0].double(), 0)
    p = torch.softmax(torch.randn(L + 1, v, generator=gen), -1)
    d = torch.multinomial(p, n, replacement=True, generator=gen)        # d_j ~ p_j for each request
    drafts = torch.stack([d[0], d[1], torch.full((n,), S.FRESH)], 1).reshape(-1)
    res = S.verify_logits_kernel(logits.repeat(n, 1), drafts, p.repeat(n, 1).contiguous(),
                                 torch.full((n,), L + 1), 1.0, 0, 1.0, torch.arange(n), torch.zeros(n, dtype=torch.long),
                                 stop_token_ids=torch.tensor([[4]] * n))
    first = res.tokens[:, 0]
    # the first committed token is d_1 when accepted, else the residual draw: overall law q0
    assert chisquare(torch.bincount(first, minlength=v).tolist(), (q0 * n).tolist()).pvalue > 1e-3
    stop_hit = (res.tokens == 4).any(1)
    assert bool((res.finish[stop_hit] == S.FINISH_STOP).all())
    g = S.verify_logits_kernel(logits, torch.tensor([int(logits[0].argmax()), 0, S.FRESH]), None, torch.tensor([L + 1]),
                               0.0, 0, 1.0, torch.tensor([0]), torch.tensor([0]))
    assert int(g.num_accepted[0]) >= 1 and int(g.tokens[0, 0]) == int(logits[0].argmax())
    with pytest.raises(ValueError, match="FORCED_REJECT"):
        S.verify_logits_kernel(logits[:1], torch.tensor([S.FORCED_REJECT]), p[:1].contiguous(), torch.tensor([1]),
                               1.0, 0, 1.0, torch.tensor([0]), torch.tensor([0]))
