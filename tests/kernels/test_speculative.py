"""Speculative acceptance: Triton path vs twin on packed batches, and the twin's losslessness measured exactly:
the committed tokens must be distributed as the target, whatever the drafter did."""
import pytest
import torch

from deepinfer_sg.kernels import speculative_accept
from deepinfer_sg.kernels import speculative as spec_mod
from deepinfer_sg.kernels.sampling import probs_torch, row_params
from helpers import DEVICE, assert_matches_distribution, bit_allowed, on_dev, params_on_dev, random_bitmask, to_cpu


def _batch(gen, vocab, rows_per_req, noise=0.5):
    """Target logits, a draft distribution close to it, and drafts sampled from that distribution."""
    cu = torch.tensor([0] + rows_per_req).cumsum(0)
    R = int(cu[-1])
    logits = torch.randn(R, vocab, generator=gen) * 2
    draft_probs = torch.softmax(logits + noise * torch.randn(R, vocab, generator=gen), 1)
    drafts = torch.multinomial(draft_probs, 1, generator=gen)[:, 0]
    return cu, logits, draft_probs, drafts


@pytest.mark.parametrize("vocab", [50, 700])
@pytest.mark.parametrize("case", ["probs", "onehot", "greedy", "filtered", "masked"])
def test_triton_matches_twin(vocab, case, monkeypatch):
    if vocab == 700:          # several segments (and a partial last one) for the segment-level draws
        monkeypatch.setattr(spec_mod, "LAYOUT", (256, 64))
    gen = torch.Generator().manual_seed(vocab)
    cu, logits, probs, drafts = _batch(gen, vocab, [4, 1, 3, 6, 2], noise=0.3)
    B = cu.numel() - 1
    kw = dict(temperature=torch.tensor([1.0, 0.8, 1.2, 1.0, 0.9]), top_k=0, top_p=1.0,
              seed=torch.arange(B) * 31 + 1, position=torch.arange(B) * 100)
    bm = mrows = None
    if case == "onehot":
        probs = None
    if case == "greedy":
        kw["temperature"] = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0])
        drafts = logits.argmax(1)
        drafts[10] = (drafts[10] + 1) % vocab                     # request 3 (rows 8-13) rejects its 3rd draft
    if case == "filtered":
        kw["top_k"] = torch.tensor([0, 5, 0, 20, 0])
        kw["top_p"] = torch.tensor([0.9, 1.0, 1.0, 0.95, 0.8])
    if case == "masked":
        bm = random_bitmask(int(cu[-1]), vocab, gen, density=0.7)
        mrows = torch.arange(int(cu[-1]))
        mrows[3] = -1
    a = speculative_accept(logits, cu, drafts, probs, bitmask=bm, mask_rows=mrows, backend="torch", **kw)
    b = speculative_accept(*on_dev((logits, cu, drafts, probs)), bitmask=on_dev(bm), mask_rows=on_dev(mrows),
                           backend="triton", **on_dev(kw))
    b = type(b)(*to_cpu((b.num_accepted, b.tokens, b.final_tokens)))
    assert torch.equal(a.num_accepted, b.num_accepted)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.final_tokens, b.final_tokens)
    # layout: accepted drafts then the final token, -1 after
    for i in range(B):
        n = int(a.num_accepted[i])
        seg = a.tokens[cu[i]:cu[i + 1]].tolist()
        assert seg[:n] == drafts[cu[i]:cu[i] + n].tolist()
        assert seg[n] == int(a.final_tokens[i]) >= 0 and all(t == -1 for t in seg[n + 1:])
    if case == "greedy":
        assert a.num_accepted.tolist()[0] == 3 and a.num_accepted.tolist()[3] == 2
        assert int(a.final_tokens[3]) == int(logits[10].argmax())
    if case == "masked":
        for i in range(B):
            row = int(cu[i] + a.num_accepted[i])
            if int(mrows[row]) >= 0:
                assert bit_allowed(bm, int(mrows[row]), int(a.final_tokens[i]))


def _target_probs(logits, temperature, top_k=0, top_p=1.0):
    return probs_torch(logits, row_params(logits.shape[0], "cpu", temperature, top_k, top_p, 0, 0)).double()


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (3, 0.9)])
def test_lossless_with_draft_distribution(top_k, top_p):
    """L = 2 drafts from a distribution unlike the target: first token ~ q0; second (when present) ~ q1."""
    gen = torch.Generator().manual_seed(1)
    vocab, n = 6, 20000
    target = torch.randn(3, vocab, generator=gen) * 1.5
    draft_p = torch.softmax(torch.randn(3, vocab, generator=gen), 1)
    logits = target.repeat(n, 1)
    probs = draft_p.repeat(n, 1)
    drafts = torch.multinomial(probs, 1, generator=gen)[:, 0]
    cu = torch.arange(n + 1) * 3
    res = speculative_accept(logits, cu, drafts, probs, 1.0, top_k, top_p, seed=torch.arange(n) + 5, position=7)
    q = _target_probs(target, 1.0, top_k, top_p)
    toks = res.tokens.view(n, 3)
    assert_matches_distribution(torch.bincount(toks[:, 0], minlength=vocab), q[0], n)
    second = toks[:, 1][res.num_accepted >= 1]
    assert len(second) > 1000
    assert_matches_distribution(torch.bincount(second, minlength=vocab), q[1], len(second))
    assert 0 < float((res.num_accepted == 2).float().mean()) < 1


def test_lossless_with_certain_drafts():
    """One-hot drafts (grammar-forced or greedy drafter): output still ~ q, and d is accepted w.p. q(d)."""
    gen = torch.Generator().manual_seed(2)
    vocab, n = 5, 20000
    target = torch.randn(2, vocab, generator=gen)
    logits = target.repeat(n, 1)
    drafts = torch.full((2 * n,), 3)
    cu = torch.arange(n + 1) * 2
    res = speculative_accept(logits, cu, drafts, None, 0.8, 0, 1.0, seed=torch.arange(n), position=0)
    q = _target_probs(target, 0.8)
    assert_matches_distribution(torch.bincount(res.tokens.view(n, 2)[:, 0], minlength=vocab), q[0], n)
    acc = int((res.num_accepted == 1).sum())
    assert_matches_distribution(torch.tensor([n - acc, acc]), torch.tensor([1 - q[0, 3], q[0, 3]]), n)


def test_grammar_banned_draft_is_always_rejected():
    gen = torch.Generator().manual_seed(3)
    cu, logits, probs, drafts = _batch(gen, 64, [3, 3])
    bm = random_bitmask(6, 64, gen, density=0.8)
    d0 = int(drafts[0])
    bm[0, d0 // 32] &= ~(1 << (d0 % 32)) if d0 % 32 != 31 else 0x7FFFFFFF   # ban request 0's first draft
    for backend in ("torch", "triton"):
        args = (logits, cu, drafts, probs) if backend == "torch" else on_dev((logits, cu, drafts, probs))
        res = speculative_accept(*args, 1.0, 0, 1.0, 0, 0, bitmask=on_dev(bm) if backend == "triton" else bm,
                                 backend=backend)
        assert int(res.num_accepted[0]) == 0
        assert bit_allowed(bm, 0, int(res.final_tokens[0]))


def test_bad_layout_raises():
    logits = torch.randn(4, 10)
    with pytest.raises(ValueError, match="cu_rows"):
        speculative_accept(logits, torch.tensor([0, 2, 2, 4]), torch.zeros(4, dtype=torch.long), None, 1.0, 0, 1.0,
                           0, 0)
    with pytest.raises(ValueError, match="draft_tokens"):
        speculative_accept(logits, torch.tensor([0, 4]), torch.zeros(3, dtype=torch.long), None, 1.0, 0, 1.0, 0, 0)


def test_fused_path_invalid_drafts_filters_and_masks_together():
    """The fused Triton path (one ratio-test kernel per request) on awkward input: drafts out of range (-1, V),
    single-row requests, top-k/top-p with masks and unmasked rows, all in one batch; equal to the twin."""
    gen = torch.Generator().manual_seed(77)
    vocab = 333
    cu, logits, probs, drafts = _batch(gen, vocab, [3, 1, 5, 1, 4, 2, 6], noise=0.2)
    B, R = cu.numel() - 1, int(cu[-1])
    drafts[0] = -1                                          # request 0 must reject at once
    drafts[12] = vocab                                      # request 4 (rows 10-13): its 3rd draft is out of range
    bm = random_bitmask(R, vocab, gen, density=0.8)
    mrows = torch.arange(R)
    mrows[[2, 7]] = -1
    kw = dict(temperature=torch.tensor([1.0, 0.7, 1.1, 0.0, 1.0, 0.9, 1.3]),
              top_k=torch.tensor([0, 10, 40, 0, 7, 0, 100]), top_p=torch.tensor([0.9, 1.0, 0.95, 1.0, 0.85, 0.7, 1.0]),
              seed=torch.arange(B) * 7 + 3, position=torch.arange(B) * 11)
    a = speculative_accept(logits, cu, drafts, probs, bitmask=bm, mask_rows=mrows, backend="torch", **kw)
    b = speculative_accept(*on_dev((logits, cu, drafts, probs)), bitmask=on_dev(bm), mask_rows=on_dev(mrows),
                           backend="triton", **on_dev(kw))
    assert int(a.num_accepted[0]) == 0 and int(a.num_accepted[4]) <= 2
    assert torch.equal(a.num_accepted, b.num_accepted.cpu())
    assert torch.equal(a.tokens, b.tokens.cpu()) and torch.equal(a.final_tokens, b.final_tokens.cpu())
    assert bool((a.final_tokens >= 0).all())


def _seeds_positions(B):
    """The bonus tests' per-request seeds and first positions."""
    return torch.arange(B) * 13 + 2, torch.arange(B) * 50 + 4


def _assert_bonus_is_the_plain_sample(logits, B, L, temperature, top_k, top_p, gen, host_params=False):
    """Drafts sampled from q itself with draft probabilities q are always accepted (u * q(d) < q(d)); the bonus
    token of each request's last row must then be exactly what sample_from_logits draws for that row at position
    + L (same stream), on both backends. host_params: the Triton call gets the parameters on the host (it then
    knows the proposal count: sampling.proposal_count), else on the kernels' device."""
    from deepinfer_sg.kernels import processed_probs, sample_from_logits
    q = processed_probs(logits, temperature, top_k.repeat_interleave(L + 1), top_p.repeat_interleave(L + 1))
    drafts = torch.multinomial(q, 1, generator=gen)[:, 0]
    cu = torch.arange(B + 1) * (L + 1)
    seed, pos = _seeds_positions(B)
    last = cu[1:] - 1
    want = sample_from_logits(logits[last].contiguous(), temperature, top_k, top_p, seed, pos + L)
    for backend in ("torch", "triton"):
        args = (logits, cu, drafts, q) if backend == "torch" else on_dev((logits, cu, drafts, q))
        kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, position=pos)
        res = speculative_accept(*args, backend=backend, **(kw if backend == "torch" or host_params else on_dev(kw)))
        assert res.num_accepted.cpu().tolist() == [L] * B
        assert torch.equal(res.final_tokens.cpu(), want)


def test_bonus_token_is_the_plain_sample_at_that_position():
    gen = torch.Generator().manual_seed(5)
    vocab, B, L = 300, 5, 3
    logits = torch.randn(B * (L + 1), vocab, generator=gen) * 2
    _assert_bonus_is_the_plain_sample(logits, B, L, 0.9, torch.tensor([0, 7, 0, 20, 0]),
                                      torch.tensor([1.0, 1.0, 0.8, 0.9, 1.0]), gen)


@pytest.mark.parametrize("proposals,host_params", [
    (4, True), (8, True),
    pytest.param(8, False, marks=pytest.mark.skipif(DEVICE != "cuda", reason="CPU tensors are host values"))])
def test_top_p_alone_bonus_follows_the_rejection_rule_with_its_fallback(proposals, host_params, monkeypatch):
    """Top-p-alone requests draw their bonus by kernels/rejection.py's rule (the plain sample's rule), also when p
    is so small on a flat row that every one of the NMAX proposals misses (request 3; checked): the statistics pass
    drew 8 proposals (the host knows p < P_MORE) or 4 (MORE_PROPOSALS set to 4, or the parameters on the GPU,
    where the host cannot look: rejection.PROPOSALS; the accept kernel loops over the row for proposals 4 .. 7),
    then the rule's last draw, made by the statistics pass. (On the interpreter's CPU tensors the parameters are
    host values: the GPU's case only.)"""
    from deepinfer_sg.kernels import rejection
    from deepinfer_sg.kernels.sampling import open_rows_torch
    monkeypatch.setattr(rejection, "MORE_PROPOSALS", proposals)
    gen = torch.Generator().manual_seed(12)
    vocab, B, L = 600, 4, 2
    logits = torch.randn(B * (L + 1), vocab, generator=gen) * 2
    logits[3 * (L + 1):] = torch.randn(L + 1, vocab, generator=gen) * 0.05      # request 3: flat
    top_k, top_p = torch.tensor([0, 0, 9, 0]), torch.tensor([0.9, 0.3, 1.0, 0.01])
    last = torch.arange(1, B + 1) * (L + 1) - 1
    seed, pos = _seeds_positions(B)
    p = row_params(B, "cpu", 1.0, top_k, top_p, seed, pos + L)
    assert open_rows_torch(logits[last], p).tolist() == [False, False, False, True]
    _assert_bonus_is_the_plain_sample(logits, B, L, 1.0, top_k, top_p, gen, host_params=host_params)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_requests_longer_than_one_ratio_test_chunk(temperature):
    """A request with more rows than the ratio test takes at once (8): every draft accepted (greedy: the argmax;
    sampled: near-certain drafts), so the final token comes from a row past the first chunk; same as the twin."""
    gen = torch.Generator().manual_seed(41)
    vocab = 300
    cu = torch.tensor([0, 11, 13, 23])
    R = int(cu[-1])
    logits = torch.randn(R, vocab, generator=gen)
    logits[torch.arange(R), torch.randint(0, vocab, (R,), generator=gen)] += 30.0     # one dominant token per row
    drafts = logits.argmax(1)
    drafts[20] = (drafts[20] + 1) % vocab                            # request 2 rejects at its 8th row (j = 7)
    kw = dict(temperature=temperature, top_k=0, top_p=1.0, seed=torch.tensor([3, 4, 5]),
              position=torch.tensor([0, 50, 90]))
    a = speculative_accept(logits, cu, drafts, None, backend="torch", **kw)
    b = speculative_accept(*on_dev((logits, cu, drafts)), None, backend="triton", **on_dev(kw))
    assert a.num_accepted.tolist() == [10, 1, 7]
    assert torch.equal(a.num_accepted, b.num_accepted.cpu()) and torch.equal(a.tokens, b.tokens.cpu())
    assert torch.equal(a.final_tokens, b.final_tokens.cpu())


@pytest.mark.parametrize("shape", [(128, 4), (256, 8), (128, 1)])
def test_pass_shapes_match_twin(shape, monkeypatch):
    """The statistics and residual passes at other program shapes (parts of a segment per program, lanes per
    thread): same acceptance, tokens and final tokens as the twin, with masks, draft probabilities and a partial
    last segment."""
    monkeypatch.setattr(spec_mod, "SPEC_SHAPE", shape)
    gen = torch.Generator().manual_seed(43)
    vocab = 4500
    cu, logits, probs, drafts = _batch(gen, vocab, [3, 1, 4], noise=0.4)
    R = int(cu[-1])
    bm = random_bitmask(R, vocab, gen, density=0.8)
    mrows = torch.arange(R)
    mrows[2] = -1
    kw = dict(temperature=torch.tensor([1.0, 0.0, 0.7]), top_k=0, top_p=1.0, seed=torch.tensor([1, 2, 3]),
              position=torch.tensor([5, 6, 7]))
    a = speculative_accept(logits, cu, drafts, probs, bitmask=bm, mask_rows=mrows, backend="torch", **kw)
    b = speculative_accept(*on_dev((logits, cu, drafts, probs)), bitmask=on_dev(bm), mask_rows=on_dev(mrows),
                           backend="triton", **on_dev(kw))
    assert torch.equal(a.num_accepted, b.num_accepted.cpu()) and torch.equal(a.tokens, b.tokens.cpu())
    assert torch.equal(a.final_tokens, b.final_tokens.cpu())


def test_residual_finish_folded_into_the_residual_pass(monkeypatch):
    """ONE_LAUNCH_RESIDUAL (the residual pass folds its winners into per-request words by atomic maxima and the
    request's last program writes the final token): the twin's result, twice in a row (the workspace is left
    clean), with requests that accept everything (no residual) beside rejecting ones."""
    monkeypatch.setattr(spec_mod, "ONE_LAUNCH_RESIDUAL", True)
    gen = torch.Generator().manual_seed(31)
    for noise in (0.8, 0.8, 3.0):
        cu, logits, probs, drafts = _batch(gen, 700, [3, 1, 4, 2, 5, 2], noise)
        kw = dict(temperature=torch.tensor([1.0, 0.8, 1.2, 1.0, 0.9, 0.7]), top_k=0, top_p=1.0,
                  seed=torch.arange(6) + 3, position=torch.arange(6) * 9)
        a = speculative_accept(logits, cu, drafts, probs, backend="torch", **kw)
        b = speculative_accept(*on_dev((logits, cu, drafts, probs)), backend="triton", **on_dev(kw))
        assert torch.equal(a.num_accepted, b.num_accepted.cpu())
        assert torch.equal(a.tokens, b.tokens.cpu()) and torch.equal(a.final_tokens, b.final_tokens.cpu())


def test_top_k_merge_writes_the_statistics_the_pass_skips():
    """The speculative step's top-k merge (threshold.lane_path with stats) solves its sampled top-k rows: solved = 1
    and part 0 holds the statistics pass's outputs from the twin's definition (kept max, kept mass sum exp(z - m)
    over the kept set, the packed bonus draw: the sampling rule's token on the kept set); every other row (top-p
    alone, top_k > KMAX, greedy, unfiltered, nothing allowed) is left to the pass (solved = 0). Outputs poisoned."""
    from deepinfer_sg.kernels import threshold
    from deepinfer_sg.kernels.sampling import sample_torch
    gen = torch.Generator().manual_seed(17)
    seg, lanes = 256, 64
    R, vocab = 9, 700
    logits = torch.randn(R, vocab, generator=gen) * 2
    bm = random_bitmask(R, vocab, gen, density=0.7)
    bm[8] = 0                                                       # nothing allowed
    mrows = torch.tensor([0, -1, 2, -1, 4, -1, 6, -1, 8])
    temperature = torch.tensor([1.0, 0.7, 1.3, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    top_k = torch.tensor([5, 20, 64, 10, 0, 7, 100, 0, 3])
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.8, 0.9, 1.0, 1.0, 1.0, 1.0])
    p = row_params(R, "cpu", temperature, top_k, top_p, seed=torch.arange(R) * 5 + 1, position=torch.arange(R) + 2)
    n_prog, np_ = 3, 4
    mc = on_dev(torch.full((R, n_prog), 123.0))
    sc = on_dev(torch.full((R, n_prog), -5.0))
    pack = on_dev(torch.full((R, n_prog, np_), 77, dtype=torch.int64))
    solved = on_dev(torch.full((R,), 9, dtype=torch.int8))
    tok = threshold.thresholds_and_paths(on_dev(logits), params_on_dev(p), on_dev(bm), on_dev(mrows), draw=(seg, lanes),
                                         stats=(mc, sc, pack, solved))[2].cpu()
    mc, sc, pack, solved = to_cpu((mc, sc, pack, solved))
    # sampled with 0 < top_k <= KMAX (row 8 too, but nothing is allowed there)
    top = torch.tensor([True, True, True, True, False, False, False, False, False])
    assert solved.tolist() == top.to(torch.int8).tolist()
    _, m, s, _ = spec_mod._stats_torch(logits, p, bm, mrows)        # the twin's kept max and mass
    want = sample_torch(logits, p, bm, mrows, seg=seg, lanes=lanes)
    assert torch.equal(mc[top, 0], m[top])
    assert torch.allclose(sc[top, 0], s[top], rtol=1e-5, atol=0)
    packed = pack[top, 0, 0]
    assert bool(((packed >> 32) > threshold.NEG_INF_KEY).all())
    assert torch.equal(4294967295 - (packed & 4294967295), want[top]) and torch.equal(tok[top], want[top])
