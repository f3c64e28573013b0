"""Shared oracles for the speculation tests: a tiny exact DFA matcher (the grammars Matcher protocol) and
exact enumeration of `speculative.verify` driven by explicit uniforms.

Exact enumeration: verification is piecewise constant in each uniform, with breakpoints the spec states
(accept iff U < min(1, q(d)/p(d)); the final token by inverse CDF of the residual max(q - p, 0) or of q).
We evaluate `verify` at interior points of every cell (and near both cell edges) and weight each outcome by
the cell's length computed here from the spec, so the law we obtain is the exact law of the code.
"""
import itertools

import torch

from deepinfer_sg.engine import speculative as S


# ------------------------------------------------------------------------------------------ DFA matcher
class DfaMatcher:
    """Exact token-level DFA implementing the grammars Matcher protocol.

    trans: {state: {token: next_state}}; accepting: states where `eos` may follow; after eos the matcher
    is terminated and allows nothing. trigger: optional token id; while it has not been seen the matcher is
    unconstrained (is_constrained() False, accepts everything), like a Triggered constraint.
    """

    def __init__(self, trans, accepting, eos, vocab_size, start=0, trigger=None):
        self.trans, self.accepting, self.eos, self.V = trans, set(accepting), eos, vocab_size
        self.trigger = trigger
        self.history = [(start, trigger is None, False)]   # (state, constrained, terminated)

    def _allowed(self, state):
        a = set(self.trans.get(state, {}))
        if state in self.accepting:
            a.add(self.eos)
        return a

    def allowed_now(self):
        state, constrained, term = self.history[-1]
        if term:
            return set()
        if not constrained:
            return set(range(self.V))
        return self._allowed(state)

    def fill_mask(self, bitmask, row=0):
        words = bitmask.shape[1]
        vals = [0] * words
        for t in self.allowed_now():
            vals[t // 32] |= 1 << (t % 32)
        bitmask[row] = torch.tensor([v - (1 << 32) if v >= (1 << 31) else v for v in vals], dtype=torch.int32)

    def accept(self, tok):
        state, constrained, term = self.history[-1]
        if term:
            return False
        if not constrained:
            self.history.append((state, tok == self.trigger, False))
            return True
        if tok not in self._allowed(state):
            return False
        if tok == self.eos:
            self.history.append((state, True, True))
        else:
            self.history.append((self.trans[state][tok], True, False))
        return True

    def rollback(self, n):
        assert 0 <= n < len(self.history)
        del self.history[len(self.history) - n:]

    def is_terminated(self):
        return self.history[-1][2]

    def is_constrained(self):
        return self.history[-1][1]

    def forced_tokens(self):
        f = self.fork()
        out = []
        while f.is_constrained() and len(f.allowed_now()) == 1:
            t = next(iter(f.allowed_now()))
            out.append(t)
            f.accept(t)
        return out

    def check_draft(self, toks):
        f = self.fork()
        for i, t in enumerate(toks):
            if not f.accept(t):
                return i
        return len(toks)

    def fork(self):
        m = DfaMatcher.__new__(DfaMatcher)
        m.trans, m.accepting, m.eos, m.V, m.trigger = self.trans, self.accepting, self.eos, self.V, self.trigger
        m.history = list(self.history)
        return m

    def after(self, toks):
        f = self.fork()
        for t in toks:
            if not f.accept(t):
                return None
        return f


# A small grammar over V = 5 tokens {0: EOS, 1: a, 2: b, 3: c, 4: d}:  ( a b | c a b | d )* ending in b or d,
# so there are single-token states (after a: b; after c: a then b, a forced chain) and free choices.
EOS = 0
GRAMMAR = dict(trans={0: {1: 1, 3: 3, 4: 2}, 1: {2: 2}, 2: {1: 1, 3: 3, 4: 2}, 3: {1: 4}, 4: {2: 2}},
               accepting={2}, eos=EOS, vocab_size=5)


def make_matcher(**kw):
    return DfaMatcher(**{**GRAMMAR, **kw})


# ------------------------------------------------------------------------------------------ exact verify law
def spec_final_dist(q_row, p_row, kind_fresh):
    """The spec's distribution of the final token (float64): q for a fresh row, else the normalised
    residual max(q - p, 0) (q when it is empty)."""
    q = q_row.double()
    if kind_fresh:
        return q / q.sum()
    r = (q - p_row.double()).clamp_min(0)
    return r / r.sum() if r.sum() > 0 else q / q.sum()


def _cells(dist):
    """[(token, lo, hi)] CDF intervals of the positive entries of dist (float64, normalised)."""
    cdf = torch.cumsum(dist, 0)
    out, lo = [], 0.0
    for t in range(dist.numel()):
        hi = float(cdf[t])
        if dist[t] > 0:
            out.append((t, lo, hi))
        lo = hi
    return out


def _probes(lo, hi):
    w = hi - lo
    return [lo + 1e-4 * w, 0.5 * (lo + hi), hi - 1e-4 * w]


def exact_verify_outcomes(cases, greedy=False):
    """Exact law of `verify` for independent single-request cases.

    cases: list of dicts with q [rows, V], p [rows, V], tokens [rows] (drafts, last row FRESH/FORCED_REJECT),
    optional stop (list of ids) and max_new (int).
    Returns, per case, a list of (probability, num_accepted, committed tuple, finish) with equal outcomes merged.
    All branches of all cases run through ONE packed `verify` call; it also asserts that every probe of a
    cell gives the same outcome (the law really is piecewise constant on the spec's cells).
    """
    reqs = []   # (case index, weight, uniforms for the rows, u_residual, u_fresh, expected n, expected tok)
    for ci, c in enumerate(cases):
        q, p, toks = c["q"].double(), c["p"].double(), c["tokens"].tolist()
        rows = len(toks)
        n_drafts = next(i for i, t in enumerate(toks) if t < 0)
        accept_p = []
        for j in range(n_drafts):
            d = toks[j]
            if greedy:
                accept_p.append(1.0 if d == int(torch.argmax(q[j])) else 0.0)
            else:
                accept_p.append(min(1.0, float(q[j, d] / p[j, d])) if p[j, d] > 0 else 1.0)
        for n in range(n_drafts + 1):
            w = 1.0
            for j in range(n):
                w *= accept_p[j]
            if n < n_drafts:
                w *= 1.0 - accept_p[n]
            if w <= 0:
                continue
            fresh = toks[n] == S.FRESH
            if greedy:
                tok = int(torch.argmax(q[n]))
                finals = [(tok, 0.0, 1.0)]
            else:
                finals = _cells(spec_final_dist(q[n], p[n], fresh))
            for tok, lo, hi in finals:
                probes = _probes(lo, hi) if not greedy else [0.5]
                for k, probe in enumerate(probes):
                    uv = [0.0] * rows      # rows after the final one would accept: the prefix rule must ignore them
                    for j in range(n):     # interior and near-edge points of the accept cell [0, a)
                        a = accept_p[j]
                        uv[j] = [0.5 * a, a * (1 - 1e-4), 1e-4 * a][k]
                    if n < n_drafts:       # ... and of the reject cell [a, 1)
                        a = accept_p[n]
                        uv[n] = [0.5 * (1 + a), a + 1e-4 * (1 - a), 1 - 1e-4 * (1 - a)][k]
                    reqs.append((ci, w * (hi - lo), uv, probe, probe, n, tok, len(probes)))
    if not reqs:
        return [[] for _ in cases]
    q_all = torch.cat([cases[r[0]]["q"] for r in reqs]).double()
    p_all = torch.cat([cases[r[0]]["p"] for r in reqs]).double()
    t_all = torch.cat([cases[r[0]]["tokens"] for r in reqs]).long()
    counts = torch.tensor([cases[r[0]]["tokens"].numel() for r in reqs])
    stop_w = max([len(c.get("stop", [])) for c in cases] + [1])
    stops = torch.full((len(reqs), stop_w), -1, dtype=torch.long)
    for i, r in enumerate(reqs):
        s = cases[r[0]].get("stop", [])
        stops[i, :len(s)] = torch.tensor(s, dtype=torch.long)
    max_new = torch.tensor([cases[r[0]].get("max_new", 1 << 30) for r in reqs])
    batch = S.VerifyBatch(q_all, p_all, t_all, counts, greedy=torch.full((len(reqs),), greedy),
                          stop_token_ids=stops, max_new_tokens=max_new)
    uni = S.VerifyUniforms(torch.tensor(sum((r[2] for r in reqs), []), dtype=torch.float64),
                           torch.tensor([r[3] for r in reqs], dtype=torch.float64),
                           torch.tensor([r[4] for r in reqs], dtype=torch.float64))
    res = S.verify(batch, uni)
    out = [dict() for _ in cases]
    for i, r in enumerate(reqs):
        ci, w, _, _, _, n, tok, nprobe = r
        assert int(res.num_accepted[i]) == n, f"case {ci}: expected {n} accepted drafts, got {int(res.num_accepted[i])}"
        toks = cases[ci]["tokens"].tolist()
        expect = toks[:n] + [tok]
        stop = cases[ci].get("stop", [])
        cut = next((k + 1 for k, t in enumerate(expect) if t in stop), len(expect))
        cut = min(cut, cases[ci].get("max_new", 1 << 30))
        got = tuple(res.tokens[i, :int(res.num_committed[i])].tolist())
        assert got == tuple(expect[:cut]), f"case {ci}: expected committed {expect[:cut]}, got {got}"
        key = (n, got, int(res.finish[i]))
        out[ci][key] = out[ci].get(key, 0.0) + w / nprobe
    return [[(w, *k) for k, w in o.items()] for o in out]


def random_dist(gen, v, zeros=0):
    """A random distribution over v tokens with `zeros` random entries set to 0."""
    x = torch.rand(v, generator=gen, dtype=torch.float64) + 0.05
    if zeros:
        x[torch.randperm(v, generator=gen)[:zeros]] = 0
    return x / x.sum()


def all_cells(v, n):
    return list(itertools.product(range(v), repeat=n))


def test_dfa_matcher_protocol():
    m = make_matcher()
    assert m.allowed_now() == {1, 3, 4}
    assert m.accept(3) and m.forced_tokens() == [1, 2]
    assert m.check_draft([1, 2, 0]) == 3 and not m.is_terminated()
    f = m.fork()
    assert f.accept(1) and f.accept(2) and f.accept(0) and f.is_terminated() and not f.accept(1)
    assert not m.accept(2) and m.accept(1)
    m.rollback(2)
    assert m.allowed_now() == {1, 3, 4}
    bm = torch.zeros(1, 1, dtype=torch.int32)
    m.fill_mask(bm, 0)
    assert int(bm[0, 0]) == (1 << 1) | (1 << 3) | (1 << 4)
