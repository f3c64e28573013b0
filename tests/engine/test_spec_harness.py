"""Exact enumeration of the WHOLE speculative procedure on a toy world: drafting (the real
MaskedDraftSampler, driven with explicit uniforms on every cell of every proposal), confidences,
grammar rules, scheduling (the real schedulers), the cut, packing and verification (the real `verify`,
driven through `exact_verify_outcomes`), round after round until every request is done.

The toy world: target q(x | prefix) = softmax(WT[last] + PT[len % 2]) over V tokens, masked by a DFA
grammar when one is given (the non-speculative constrained law is the product of the masked, renormalised
conditionals); drafter logits WD[prev] + PD[k] (a Markov head), confidence sigmoid(CD[prev] + ED[k]) (it
reads the previous draft, which is what makes non-anticipation matter).
"""
import itertools
from dataclasses import dataclass, field
from typing import Optional

import torch

from deepinfer_sg.engine import grammar_drafting as G
from deepinfer_sg.engine import speculative as S
from deepinfer_sg.engine import verify_schedule as VS
from test_spec_toys import DfaMatcher, exact_verify_outcomes


@dataclass
class World:
    v: int
    horizon: int
    seed: int = 0
    grammar: Optional[dict] = None      # DfaMatcher kwargs
    eos: Optional[int] = None
    prompt: tuple = (1,)
    sharp: float = 1.0                  # drafter/target agreement knobs: WD = sharp * WT + noise * N(0, 1)
    noise: float = 1.0
    tables: dict = field(default_factory=dict)

    def __post_init__(self):
        g = torch.Generator().manual_seed(self.seed)
        v = self.v
        wt = torch.randn(v, v, generator=g, dtype=torch.float64) * 1.5
        self.tables = dict(
            WT=wt, PT=torch.randn(2, v, generator=g, dtype=torch.float64),
            WD=wt * self.sharp + self.noise * torch.randn(v, v, generator=g, dtype=torch.float64),
            PD=self.noise * torch.randn(8, v, generator=g, dtype=torch.float64),
            CD=torch.randn(v, generator=g, dtype=torch.float64) * 2, ED=torch.randn(8, generator=g, dtype=torch.float64))

    # ---- target
    def matcher(self, gen):
        """The grammar state after `gen` (None: dead). grammar = DfaMatcher kwargs, or {"factory": f} with
        f() -> a fresh matcher that also offers `after(tokens)` and `allowed_now()`."""
        if self.grammar is None:
            return None
        base = self.grammar["factory"]() if "factory" in self.grammar else DfaMatcher(**self.grammar)
        return base.after(list(gen))

    def target(self, gen):
        """q(. | prompt + gen): the grammar-masked target (unmasked where the grammar state is dead or
        terminated: such rows are never the source of a committed token)."""
        t = self.tables
        last = (self.prompt + tuple(gen))[-1]
        q = torch.softmax(t["WT"][last] + t["PT"][len(gen) % 2], 0)
        m = self.matcher(gen)
        if m is not None and not m.is_terminated():
            allowed = torch.zeros(self.v, dtype=torch.bool)
            allowed[list(m.allowed_now())] = True
            q = torch.where(allowed, q, torch.zeros_like(q))
            q = q / q.sum()
        return q

    def done(self, gen):
        return len(gen) >= self.horizon or (self.eos is not None and len(gen) > 0 and gen[-1] == self.eos)

    def target_law(self):
        """Exact law of non-speculative (constrained) sampling: sequences up to the horizon or EOS."""
        law = {}

        def rec(gen, w):
            if self.done(gen):
                law[gen] = law.get(gen, 0.0) + w
                return
            q = self.target(gen)
            for t in range(self.v):
                if q[t] > 0:
                    rec(gen + (t,), w * float(q[t]))
        rec((), 1.0)
        return law

    # ---- drafter
    def draft_logits(self, k, prev):
        return self.tables["WD"][prev] + self.tables["PD"][k]

    def draft_conf(self, k, prev):
        return torch.sigmoid(self.tables["CD"][prev] + self.tables["ED"][k])


@dataclass
class Procedure:
    gamma: int = 2
    extension: int = 0                  # forced-token chain past gamma
    mask_drafts: bool = False
    force_tokens: bool = False
    cut: bool = False                   # scheme C
    naive_cut: bool = False             # scheme B (biased): cut, then sample the final row fresh
    zero_own_rate: bool = False         # biased variant: also zero the violating draft's own rate
    draft_masks: str = "cpu"            # "cpu": MaskedDraftSampler on matchers; "automaton": AutomatonDraftSampler
    grammar_rates: bool = False         # mechanism 4
    schedule: str = "fixed"             # fixed | sync | async | naive_scan
    model: Optional[VS.StepTimeModel] = None
    seen_lengths: set = field(default_factory=set)     # verify lengths chosen (to check they vary)
    seen_forced_rejects: int = 0


def enumerate_drafts(world, proc, gens):
    """All draft blocks of each request (state gens[i]) with their exact probabilities:
    per request, a list of (weight, DraftBlock row). Iterative deepening over the proposal cells."""
    total = proc.gamma + proc.extension
    out = []
    for gen in gens:
        branches = [((), 1.0, ())]      # (uniform prefix, weight, expected tokens)
        for k in range(total):
            block = _run_drafter(world, proc, gen, [b[0] for b in branches])
            new = []
            for b, (us, w, toks) in enumerate(branches):
                if int(block.lengths[b]) <= k:
                    new.append((us, w, toks))
                    continue
                dist = block.probs[b, k].double()
                dist = dist / dist.sum()
                cdf = torch.cumsum(dist, 0)
                lo = 0.0
                for t in range(world.v):
                    hi = float(cdf[t])
                    if dist[t] > 0:
                        new.append((us + (0.5 * (lo + hi),), w * float(dist[t]), toks + (t,)))
                    lo = hi
            branches = new
        block = _run_drafter(world, proc, gen, [b[0] for b in branches])
        rows = []
        for b, (us, w, toks) in enumerate(branches):
            n = int(block.lengths[b])
            assert tuple(block.tokens[b, :n].tolist()) == toks, "the drafter did not sample from its proposal"
            rows.append((w, dict(tokens=block.tokens[b], probs=block.probs[b].double(), conf=block.confidences[b],
                                 forced=block.forced[b], length=n, valid=int(block.valid_lengths[b]))))
        out.append(rows)
    return out


def toy_automaton(grammar: dict):
    """The TokenAutomaton of a DfaMatcher grammar (its states keep their ids: they are 0..S-1 already)."""
    from deepinfer_sg.engine.token_automaton import from_transitions
    trans = {s: dict(row) for s, row in grammar["trans"].items()}
    for s in grammar["accepting"]:
        trans.setdefault(s, {})[grammar["eos"]] = s
    return from_transitions(trans, grammar.get("start", 0), sorted(grammar["accepting"]), grammar["vocab_size"],
                            [grammar["eos"]])


def _run_drafter(world, proc, gen, uniform_prefixes):
    total = proc.gamma + proc.extension
    nb = len(uniform_prefixes)
    u = torch.full((nb, total), 0.5, dtype=torch.float64)
    for b, us in enumerate(uniform_prefixes):
        u[b, :len(us)] = torch.tensor(us, dtype=torch.float64)
    m = world.matcher(gen)
    stops = [[world.eos]] * nb if world.eos is not None else None
    if proc.draft_masks == "automaton" and m is not None:
        from deepinfer_sg.engine.automaton_drafting import AutomatonDraftSampler
        a = toy_automaton(world.grammar)
        state, _, term = m.history[-1]
        states = torch.full((nb,), a.terminated if term else state, dtype=torch.long)
        sampler = AutomatonDraftSampler([m] * nb, a, states, torch.zeros(nb, dtype=torch.long),
                                        torch.zeros(nb, dtype=torch.long), world.v, force_tokens=proc.force_tokens,
                                        stop_token_ids=stops, uniforms=u)
    else:
        sampler = G.MaskedDraftSampler([m] * nb if m is not None else [None] * nb, torch.zeros(nb, dtype=torch.long),
                                       torch.zeros(nb, dtype=torch.long), world.v, mask_drafts=proc.mask_drafts,
                                       force_tokens=proc.force_tokens, stop_token_ids=stops, uniforms=u)
    anchors = torch.full((nb,), (world.prompt + tuple(gen))[-1], dtype=torch.long)
    return G.masked_draft_loop(world.draft_logits, anchors, proc.gamma, sampler, world.draft_conf,
                               max_forced_extension=proc.extension)


def _schedule(proc, blocks, history, world):
    """Verify lengths for the requests of one joint draft combination."""
    width = max(b["tokens"].numel() for b in blocks)
    conf = torch.zeros(len(blocks), width, dtype=torch.float64)
    forced = torch.zeros(len(blocks), width, dtype=torch.bool)
    toks = torch.full((len(blocks), width), -1, dtype=torch.long)
    for i, b in enumerate(blocks):
        n = b["tokens"].numel()
        conf[i, :n], forced[i, :n], toks[i, :n] = b["conf"], b["forced"], b["tokens"]
    lengths = torch.tensor([b["length"] for b in blocks])
    valid = torch.tensor([b["valid"] for b in blocks])
    if proc.grammar_rates:
        stops = torch.tensor([[world.eos if world.eos is not None else -1]] * len(blocks))
        conf = VS.grammar_confidences(conf, forced, valid - 1 if proc.zero_own_rate else valid, toks, stops)
    rates = VS.cumulative_rates(conf, lengths)
    if proc.schedule == "fixed":
        ell = VS.schedule_fixed(lengths)
    elif proc.schedule == "sync":
        ell = VS.schedule_sync(rates, proc.model)
    elif proc.schedule == "async":
        ell = VS.schedule_async(history, rates, proc.model)
    elif proc.schedule == "naive_scan":
        ell = VS.allocate_top_k(rates, VS.verify_budget(rates, proc.model))
    else:
        raise ValueError(proc.schedule)
    proc.seen_lengths.update(ell.tolist())
    return ell, rates


def _verify_case(world, proc, gen, block, ell):
    """The packed verification rows of one request (through the real cut and pack functions)."""
    n = block["length"]
    toks, probs = block["tokens"][:n].unsqueeze(0), block["probs"][:n].unsqueeze(0)
    forced = torch.zeros(1, dtype=torch.bool)
    ell = torch.tensor([ell])
    if proc.cut or proc.naive_cut:
        ell, forced = G.cut_at_violation(ell, torch.tensor([block["valid"]]))
        if proc.naive_cut:
            forced = torch.zeros_like(forced)          # scheme B: the final row samples fresh from q
        proc.seen_forced_rejects += int(forced.sum())
    if n == 0:
        toks, probs = torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, 0, world.v, dtype=torch.float64)
    row_toks, row_probs, counts = S.pack_verify_rows(toks, probs, ell, forced)
    drafts = toks[0, :int(ell[0])].tolist()
    q = torch.stack([world.target(gen + tuple(drafts[:j])) for j in range(int(counts[0]))])
    p = row_probs if row_probs is not None else torch.zeros_like(q)
    return dict(q=q, p=p.double(), tokens=row_toks, stop=[world.eos] if world.eos is not None else [],
                max_new=world.horizon - len(gen))


def exact_procedure_law(world, proc, num_requests=1, greedy=False):
    """Exact joint law of the generated sequences of `num_requests` identical requests run together."""
    start = tuple(((), tuple([1.0] * (proc.gamma + proc.extension))) for _ in range(num_requests))
    states = {start: 1.0}
    final = {}
    while states:
        nxt = {}
        for state, w in states.items():
            active = [i for i, (gen, _) in enumerate(state) if not world.done(gen)]
            if not active:
                key = tuple(gen for gen, _ in state)
                final[key] = final.get(key, 0.0) + w
                continue
            gens = [state[i][0] for i in active]
            drafts = enumerate_drafts(world, proc, gens)
            width = proc.gamma + proc.extension
            history = torch.tensor([list(state[i][1]) for i in active], dtype=torch.float64)
            combos, cases = [], []
            for combo in itertools.product(*drafts):
                cw = 1.0
                for dw, _ in combo:
                    cw *= dw
                blocks = [b for _, b in combo]
                ell, rates = _schedule(proc, blocks, history, world)
                idx = []
                for i, (gen, b) in enumerate(zip(gens, blocks)):
                    idx.append(len(cases))
                    cases.append(_verify_case(world, proc, gen, b, int(ell[i])))
                hist = [tuple(torch.nn.functional.pad(rates[i], (0, width - rates.shape[1])).tolist())
                        if proc.schedule == "async" else state[a][1] for i, a in enumerate(active)]
                combos.append((cw, idx, hist))
            outcomes = exact_verify_outcomes(cases, greedy=greedy)
            for cw, idx, hist in combos:
                per_req = [outcomes[c] for c in idx]
                for choice in itertools.product(*per_req):
                    pw = cw
                    new_state = list(state)
                    for k, (i, (ow, _, committed, _)) in enumerate(zip(active, choice)):
                        pw *= ow
                        new_state[i] = (state[i][0] + committed, hist[k])
                    key = tuple(new_state)
                    nxt[key] = nxt.get(key, 0.0) + w * pw
        states = nxt
    return final


def max_abs_diff(law, target):
    keys = set(law) | set(target)
    return max(abs(law.get(k, 0.0) - target.get(k, 0.0)) for k in keys)


def product_law(single, n):
    out = {}
    for combo in itertools.product(single.items(), repeat=n):
        key = tuple(k for k, _ in combo)
        w = 1.0
        for _, x in combo:
            w *= x
        out[key] = w
    return out


def test_target_law_is_a_distribution():
    w = World(v=5, horizon=4, grammar=dict(trans={0: {1: 1, 3: 3, 4: 2}, 1: {2: 2}, 2: {1: 1, 3: 3, 4: 2},
                                                  3: {1: 4}, 4: {2: 2}}, accepting={2}, eos=0, vocab_size=5), eos=0)
    law = w.target_law()
    assert abs(sum(law.values()) - 1) < 1e-12
    assert all(DfaMatcher(**w.grammar).after(list(s)) is not None for s in law)
