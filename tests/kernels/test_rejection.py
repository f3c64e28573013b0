"""Top-p alone by rejection (kernels/rejection.py): the rule's law against q computed by hand from the definition
(ties at the cut, banned tokens, small p so that the fallback after NMAX proposals runs), the kernels' tokens
against the twin's (fast path, the finish's loops, mixed batches). The speculative bonus follows the rule too
(tests/kernels/test_speculative.py)."""
import pytest
import torch

from deepinfer_sg.kernels import rejection, threshold
from deepinfer_sg.kernels.sampling import (_proposal_torch, host_flags, lanes_view, masked_z_torch, open_rows_torch,
                                           processed_probs, rejection_draw_torch, row_params, sample_torch,
                                           sample_triton)
from helpers import assert_matches_distribution, bit_allowed, on_dev, params_on_dev, random_bitmask
from test_sampling import _hand_q


@pytest.mark.parametrize("top_p,temperature", [(0.9, 1.0), (0.3, 0.7), (0.05, 1.3)])
def test_rejection_rule_follows_the_exact_distribution(top_p, temperature):
    """Many seeds of one row (ties at the top and in the middle, one banned token, one -inf): the rule's draws
    (the twin: proposals, then the restricted fallback on an independent key) follow q from the definition by
    hand and never leave the kept set. p = 0.05 keeps only the two tokens tied at the top (ties stay in), and
    at p = 0.3 a share of the rows reaches the fallback after NMAX proposals: both branches are in the law."""
    gen = torch.Generator().manual_seed(int(top_p * 100))
    vocab, n = 23, 40000
    logits = torch.randn(vocab, generator=gen)
    logits[4] = logits[9] = logits.max() + 0.5                   # a tie at the top
    logits[11] = logits[12] = logits[13] = float(logits.median())  # a tie in the middle
    logits[17] = -float("inf")
    bm = random_bitmask(1, vocab, gen, density=1.0)
    bm[0, 0] &= ~(1 << 6)                                          # token 6 banned
    allowed = [bit_allowed(bm, 0, v) for v in range(vocab)]
    q = _hand_q(logits, temperature, 0, top_p, allowed)
    rows = logits.expand(n, vocab).contiguous()
    p = row_params(n, "cpu", temperature, 0, top_p, seed=torch.arange(n) // 7, position=torch.arange(n) % 7)
    toks = sample_torch(rows, p, bm, torch.zeros(n, dtype=torch.int64), seg=8, lanes=2)
    counts = torch.bincount(toks, minlength=vocab)
    assert counts[[v for v in range(vocab) if q[v] == 0]].sum() == 0
    assert_matches_distribution(counts, q, n, sigmas=5.0)


def test_fallback_draws_are_independent_of_the_proposals():
    """Rows where every proposal misses (p tiny on a flat row): the fallback's token is the restricted draw with
    key NMAX, which must not be one of the (rejected) proposals more often than q says: on two tokens tied at the
    top with p tiny, the kept set is exactly those two, each drawn half the time."""
    n, vocab = 6000, 400
    logits = torch.zeros(n, vocab)
    logits[:, 7] = logits[:, 300] = 1.0                           # kept set {7, 300}: mass ~ 2e / (398 + 2e)
    p = row_params(n, "cpu", 1.0, 0, 0.001, seed=torch.arange(n), position=3)
    toks = sample_torch(logits, p, seg=256, lanes=64)
    assert set(toks.tolist()) == {7, 300}
    assert abs(int((toks == 7).sum()) - n / 2) <= 5 * (n / 4) ** 0.5


@pytest.mark.parametrize("proposals,hot,hotcap,shape", [(1, True, 32, None), (3, True, 32, None), (4, True, 32, None),
                                                       (8, True, 32, None), (4, True, 2, None), (4, False, 32, None),
                                                       (4, True, 32, (32, 1)), (4, False, 32, (32, 1))])
def test_kernels_draw_the_twins_tokens_with_fallbacks_and_mixed_rows(proposals, hot, hotcap, shape, monkeypatch):
    """Top-p-alone rows at several p (0.01 on flat rows: the finish's loops over the row run, up to the bisection
    and the restricted draw), masked and unmasked, a row with nothing allowed, beside greedy, plain, top-k (the
    lane merge draws them) and top-k > 64 rows (tau first: the pass cuts at it, so the pick inside the winning
    lane must too): the kernels' tokens are the twin's, with the mass-above pass gathering only the lanes above
    the smallest proposal (HOT_LANES; HOTCAP 2 sends most segments to the whole read) or reading every lane; with
    programs of 32 lanes (shape) a segment is two programs of the pass (PER 2, as the engine's default shapes).
    1 - 8 proposals in the pass (8: what the engine sends when a top-p-alone row has p < P_MORE, as here)."""
    monkeypatch.setattr(rejection, "HOT_LANES", hot)
    monkeypatch.setattr(rejection, "HOTCAP", hotcap)
    gen = torch.Generator().manual_seed(proposals)
    R, vocab = 10, 1000
    logits = torch.randn(R, vocab, generator=gen) * 3
    logits[5] = torch.randn(vocab, generator=gen) * 0.05          # nearly flat: p 0.01 misses for many keys
    bm = random_bitmask(R, vocab, gen, density=0.6)
    bm[8] = 0                                                       # nothing allowed
    mrows = torch.tensor([0, -1, 2, 3, -1, -1, 6, 7, 8, -1])
    temperature = torch.tensor([1.0, 0.8, 0.0, 1.2, 1.0, 1.0, 0.7, 1.0, 1.0, 1.0])
    top_k = torch.tensor([0, 0, 0, 0, 5, 0, 100, 0, 0, 0])
    top_p = torch.tensor([0.9, 0.95, 1.0, 0.5, 0.9, 0.01, 0.8, 1.0, 0.7, 0.02])
    p = row_params(R, "cpu", temperature, top_k, top_p, seed=torch.arange(R) * 31 + 1, position=torch.arange(R) + 4)
    want = sample_torch(logits, p, bm, mrows, seg=256, lanes=64)
    got = sample_triton(on_dev(logits), params_on_dev(p), on_dev(bm), on_dev(mrows), seg=256, lanes=64,
                        proposals=proposals, shape=shape).cpu()
    assert torch.equal(got, want)
    assert int(got[8]) == -1
    for r in range(R):
        if int(mrows[r]) >= 0 and int(got[r]) >= 0:
            assert bit_allowed(bm, int(mrows[r]), int(got[r]))
    q = processed_probs(logits, temperature, top_k, top_p, bm, mrows)
    assert bool((q[torch.arange(R)[got >= 0], got[got >= 0]] > 0).all())        # every token in its kept set


@pytest.mark.parametrize("proposals,cmax,lc,small,wave", [(8, None, None, None, False), (8, 256, 16, None, False),
                                                          (4, 64, 32, None, False), (8, None, None, 0, False),
                                                          (4, None, None, None, True)])
def test_rows_past_the_tested_proposals_draw_from_the_lane_maxima(proposals, cmax, lc, small, wave, monkeypatch):
    """Small p (0.05 - 0.4) on flat rows, where many rows miss the four proposals the mass-above pass tests: the
    finish takes them from the tokens above the best missed proposal (gathered from the lanes whose max lies above
    it, the pass's lane maxima): proposals 4 - 7 tested on them (with 4 proposals in the pass: loops over the row
    for those); two rows miss all eight (80 and 187 candidates) and take tau from the candidates
    (threshold._top_p_cut: all pairs up to KP = 128 of them; more are narrowed by the histogram on a block of
    >= 1024, else bisected on the block), the kept lanes drawn by the pass's rule; masked and unmasked, with ties
    at the top, over four segments: the twin's tokens, each inside its kept set. Open rows hold 63 - 187
    candidates: the default (OPEN_CMAX 1024 here, OPEN_SMALL 512) takes tau on the small block (no histogram:
    the 187 bisect); small 0 on the 1024 block with the histogram narrowing the 187 (the engine's path at
    V = 129,280: a block of OPEN_SMALL = 1024 with the histogram); cmax 256 (small 128) on both blocks; cmax 64
    sends both to the row-wide bisection (then the same draw); lc < 64 runs the sweeps over several blocks; wave:
    the finish with its launch options for more rows than SMs (rejection.FINISH_WAVE, 4 proposals)."""
    if wave:
        monkeypatch.setattr(rejection, "one_wave", lambda programs, device: programs <= 1)
    if cmax:
        monkeypatch.setattr(rejection, "OPEN_CMAX", cmax)
    if lc:
        monkeypatch.setattr(rejection, "OPEN_LC", lc)
    if small is not None:
        monkeypatch.setattr(rejection, "OPEN_SMALL", small)
    gen = torch.Generator().manual_seed(8)
    R, vocab = 12, 1000
    logits = torch.randn(R, vocab, generator=gen) * 0.4
    logits[3, [10, 700]] = logits[3].max() + 0.7                   # a tie at the top
    logits[9, 500:] = logits[9, :500]                               # every value twice
    bm = random_bitmask(R, vocab, gen, density=0.7)
    mrows = torch.tensor([0, -1, 2, -1, 4, -1, 6, -1, 8, -1, 10, -1])
    temperature = torch.tensor([1.0, 0.8, 1.0, 1.0, 1.3, 1.0, 0.9, 1.0, 1.0, 1.0, 0.7, 1.0])
    top_p = torch.tensor([0.05, 0.1, 0.05, 0.2, 0.1, 0.05, 0.15, 0.3, 0.1, 0.05, 0.4, 0.1])
    p = row_params(R, "cpu", temperature, 0, top_p, seed=torch.arange(R) * 13 + 5, position=torch.arange(R) + 2)
    z = masked_z_torch(logits, p.inv_temperature, bm, mrows)
    open4, open8 = open_rows_torch(z, p, 256, 64, 4), open_rows_torch(z, p, 256, 64)
    assert int(open8.sum()) >= 2 and int((open4 & ~open8).sum()) >= 2      # both branches of the finish
    t_lo = torch.stack([z.gather(1, _proposal_torch(z, p, 0.0, j, 256, 64)[0][:, None])[:, 0]
                        for j in range(4)]).amax(0)
    n_cand = (z > t_lo[:, None]).sum(1)                                      # the finish's candidates
    assert int(n_cand[open8].max()) > threshold.KP >= int(n_cand[open8].min())   # narrowed / all pairs at once
    want = sample_torch(logits, p, bm, mrows, seg=256, lanes=64)
    got = sample_triton(on_dev(logits), params_on_dev(p), on_dev(bm), on_dev(mrows), seg=256, lanes=64,
                        proposals=proposals).cpu()
    assert torch.equal(got, want)
    q = processed_probs(logits, temperature, 0, top_p, bm, mrows)
    assert bool((q[torch.arange(R), got] > 0).all())


def test_host_asks_more_proposals_for_small_p_alone():
    """host_flags: MORE_PROPOSALS when a top-p-alone row has p < P_MORE; p at P_MORE, a top-k row's p or a greedy
    row's does not count."""
    def proposals(temperature, top_k, top_p):
        return host_flags(row_params(2, "cpu", torch.tensor(temperature), torch.tensor(top_k), torch.tensor(top_p),
                                     seed=0, position=0), 1000)["proposals"]
    assert proposals([1.0, 1.0], [0, 0], [0.9, rejection.P_MORE - 0.01]) == rejection.MORE_PROPOSALS == 8
    assert proposals([1.0, 1.0], [0, 2000], [0.9, 0.5]) == rejection.MORE_PROPOSALS     # top-k >= V: off
    assert proposals([1.0, 1.0], [0, 0], [0.9, rejection.P_MORE]) == rejection.PROPOSALS == 4
    assert proposals([1.0, 1.0], [0, 50], [0.9, 0.5]) == rejection.PROPOSALS
    assert proposals([1.0, 0.0], [0, 0], [0.9, 0.5]) == rejection.PROPOSALS


def test_kernel_rule_law_on_many_rows():
    """The kernels' own draws (one small distribution over many seeds, several segments and lanes) are the twin's
    and follow q by hand (top-p alone with a tie at the cut; few rows: the interpreter runs every program)."""
    gen = torch.Generator().manual_seed(41)
    vocab, n = 19, 120
    logits = torch.randn(vocab, generator=gen)
    logits[2] = logits[5] = logits.max() + 0.3
    q = _hand_q(logits, 1.0, 0, 0.6, [True] * vocab)
    rows = logits.expand(n, vocab).contiguous()
    p = row_params(n, "cpu", 1.0, 0, 0.6, seed=torch.arange(n) // 4, position=torch.arange(n) % 4)
    toks = sample_triton(on_dev(rows), params_on_dev(p), seg=8, lanes=2).cpu()
    assert torch.equal(toks, sample_torch(rows, p, seg=8, lanes=2))
    counts = torch.bincount(toks, minlength=vocab)
    assert counts[[v for v in range(vocab) if q[v] == 0]].sum() == 0
    assert_matches_distribution(counts, q, n, sigmas=4.5)


def test_proposal_keys_triton_match_torch():
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(keys_ptr, out_ptr, J: tl.constexpr):
        key = tl.load(keys_ptr + tl.program_id(0)).to(tl.uint32)
        for j in tl.static_range(1, J):
            tl.store(out_ptr + tl.program_id(0) * J + j,
                     rejection.proposal_key_tl(key, tl.full([], j, tl.int32)).to(tl.int64))

    keys = torch.tensor([0, 1, 2**31 + 5, 2**32 - 1, 123456789])
    out = on_dev(torch.full((5, 9), -1, dtype=torch.int64))
    kernel[(5,)](on_dev(keys), out, J=9)
    want = torch.stack([rejection.proposal_keys(keys, j) for j in range(9)], 1)
    assert torch.equal(out.cpu()[:, 1:], want[:, 1:])
    assert torch.equal(rejection.proposal_keys(keys, 0), keys)
    assert len(set(want.flatten().tolist())) == want.numel()        # distinct keys per (row, j)


def test_rejection_draw_twin_gives_minus_one_on_empty_rows():
    z = torch.full((2, 50), -float("inf"))
    z[1, 3] = 0.0
    p = row_params(2, "cpu", 1.0, 0, 0.5, seed=torch.tensor([1, 2]), position=0)
    assert rejection_draw_torch(z, p, seg=16, lanes=4).tolist() == [-1, 3]


@pytest.mark.parametrize("shape", [None, (32, 1)])
def test_mass_above_pass_skips_cold_segments(shape, monkeypatch):
    """The mass-above pass never reads a segment whose program maxima (the pass's) lie at or below every proposal,
    neither its logits nor its lane maxima: peaked rows whose leaders sit in the first of four segments, masked
    and unmasked, beside a nearly uniform row, with the other segments' logits and lane maxima replaced by a huge
    value for that pass alone: their parts are zeros and every token is the twin's. The lane maxima the pass
    stored are the definition's. shape (32, 1): two programs of the pass a segment (PER 2)."""
    gen = torch.Generator().manual_seed(5)
    R, vocab = 6, 1000
    logits = torch.randn(R, vocab, generator=gen) * 0.5
    logits[:5, :24] += 9 + 2 * torch.rand(5, 24, generator=gen)        # leaders in segment 0 of 4
    logits[5] = torch.randn(vocab, generator=gen) * 0.02               # nearly uniform
    bm = random_bitmask(R, vocab, gen, density=0.9)
    bm[:, 0] = -1                                                       # leaders allowed
    mrows = torch.tensor([0, -1, 2, -1, 4, 5])
    p = row_params(R, "cpu", torch.tensor([1.0, 0.9, 1.1, 1.0, 0.8, 1.0]), 0,
                   torch.tensor([0.9, 0.95, 0.5, 0.8, 0.99, 0.3]), seed=torch.arange(R) * 7 + 3, position=torch.arange(R))
    want = sample_torch(logits, p, bm, mrows, seg=256, lanes=64)
    real = rejection._above_kernel
    seen = {}

    class Spy:                   # the lane maxima the pass stored; the mass-above pass on poisoned cold segments
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen["lane_max"] = args[11].clone().cpu()
                poisoned = args[0].clone()
                poisoned[:5, 256:] = 50.0
                args[11][:5, 64:] = 50.0
                args[3].fill_(float("nan"))                              # the parts, poisoned
                real[grid](poisoned, *args[1:], **kw)
                seen["part"] = args[3].clone().cpu()
            return launch
    monkeypatch.setattr(rejection, "_above_kernel", Spy())
    got = sample_triton(on_dev(logits), params_on_dev(p), on_dev(bm), on_dev(mrows), seg=256, lanes=64,
                        shape=shape).cpu()
    assert torch.equal(got, want)
    part = seen["part"]
    assert not bool(part.isnan().any())                                  # every part written
    assert bool((part[:5, 1:] == 0).all()) and bool((part[:5, 0] > 0).any())
    z = masked_z_torch(logits, p.inv_temperature, bm, mrows)
    assert torch.equal(seen["lane_max"], lanes_view(z, float("-inf"), 256, 64).amax(-1))
