"""Grammar-aware speculation (issue 7): masked drafting, forced tokens as free drafts, cut at the first
violation, grammar-aware scheduling, each lossless against NON-speculative constrained sampling (exact
enumeration over a 5-token vocabulary and a small DFA grammar), and the naive schemes detectably biased."""
import pytest
import torch

from deepinfer_sg.engine import grammar_drafting as G
from deepinfer_sg.engine import speculative as S
from deepinfer_sg.engine import verify_schedule as VS
from test_spec_harness import Procedure, World, enumerate_drafts, exact_procedure_law, max_abs_diff
from test_spec_lossless import chi_square_pvalue, run_sampled
from test_spec_toys import GRAMMAR, DfaMatcher, exact_verify_outcomes, make_matcher

MODEL = VS.StepTimeModel.from_table({1: 1.0, 2: 1.3, 3: 1.5, 4: 1.9, 5: 2.0, 6: 2.6, 8: 3.0, 12: 4.0})
MECHANISMS = {
    "verify_masks_only": dict(),                                   # scheme A: plain DSpark
    "masked_drafting": dict(mask_drafts=True),
    "forced_tokens": dict(force_tokens=True, extension=2),
    "cut_at_violation": dict(cut=True),
    "cut_and_grammar_rates": dict(cut=True, grammar_rates=True),
    "all_four": dict(mask_drafts=True, force_tokens=True, extension=2, cut=True, grammar_rates=True),
}


def _world(seed=0, **kw):
    return World(v=5, horizon=3, eos=0, seed=seed, grammar=GRAMMAR, **kw)


def _target(world):
    return {(k,): w for k, w in world.target_law().items()}


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("mechanism", list(MECHANISMS))
def test_mechanism_is_lossless_exactly(mechanism, mode):
    world = _world()
    proc = Procedure(gamma=2, schedule=mode, model=MODEL, **MECHANISMS[mechanism])
    assert max_abs_diff(exact_procedure_law(world, proc), _target(world)) < 1e-12
    if "cut" in mechanism and not proc.mask_drafts:
        assert proc.seen_forced_rejects > 0              # the forced-rejection path was really taken


@pytest.mark.parametrize("mechanism", ["cut_at_violation", "all_four"])
def test_mechanism_is_lossless_with_fixed_verification(mechanism):
    world = _world(seed=1)
    proc = Procedure(gamma=2, schedule="fixed", **MECHANISMS[mechanism])
    assert max_abs_diff(exact_procedure_law(world, proc), _target(world)) < 1e-12


def test_naive_prefilter_scheme_b_is_biased():
    """Cutting at the violation but sampling the final row FRESH from q (scheme B) changes the law:
    the exact enumeration that certifies the lossless schemes sees an error of several percent."""
    world = _world()
    err = max_abs_diff(exact_procedure_law(world, Procedure(gamma=2, schedule="fixed", naive_cut=True)), _target(world))
    assert err > 1e-2


def test_zeroing_the_violating_drafts_own_rate_is_biased():
    """Why grammar_confidences keeps the violating draft's own entry: zeroing it lets the draft's value
    decide its own admission, which the exact law detects under confidence scheduling."""
    world = _world()
    proc = Procedure(gamma=2, schedule="sync", model=MODEL, cut=True, grammar_rates=True, zero_own_rate=True)
    assert max_abs_diff(exact_procedure_law(world, proc), _target(world)) > 1e-4


def test_trigger_landing_mid_block_is_lossless():
    """A Triggered constraint: free text until token 3, then the grammar; drafts cross the trigger."""
    world = World(v=5, horizon=3, eos=0, seed=5, grammar=dict(GRAMMAR, trigger=3))
    target = _target(world)
    assert any(3 in seq[0][:-1] for seq in target)           # the trigger really fires before the end
    for mech in ("verify_masks_only", "all_four"):
        proc = Procedure(gamma=2, schedule="sync", model=MODEL, **MECHANISMS[mech])
        assert max_abs_diff(exact_procedure_law(world, proc), target) < 1e-12


# ------------------------------------------------------------------------------------------ mechanism details
def _expected_accepted_first_round(world, proc):
    """Exact E[accepted drafts] of the first round (all drafts verified)."""
    [rows] = enumerate_drafts(world, proc, [()])
    cases, weights = [], []
    for w, b in rows:
        n = b["length"]
        row_toks, row_probs, _ = S.pack_verify_rows(b["tokens"][:n].unsqueeze(0), b["probs"][:n].unsqueeze(0),
                                                    torch.tensor([n]))
        toks = b["tokens"][:n].tolist()
        q = torch.stack([world.target(tuple(toks[:j])) for j in range(n + 1)])
        cases.append(dict(q=q, p=row_probs.double(), tokens=row_toks))
        weights.append(w)
    return sum(w * sum(pw * acc for pw, acc, _, _ in o) for w, o in zip(weights, exact_verify_outcomes(cases)))


def test_masked_drafts_are_grammatical_and_accept_more():
    world = _world(seed=2)
    masked = Procedure(gamma=3, mask_drafts=True)
    for w, b in enumerate_drafts(world, masked, [()])[0]:
        n = b["length"]
        assert make_matcher().check_draft(b["tokens"][:n].tolist()) == n
        assert b["valid"] == n
        for k in range(n):                      # the proposal is zero off the grammar at every position
            allowed = make_matcher().after(b["tokens"][:k].tolist()).allowed_now()
            assert all(float(b["probs"][k, t]) == 0 for t in range(5) if t not in allowed)
            assert float(b["probs"][k].sum()) == pytest.approx(1.0)
    plain = _expected_accepted_first_round(world, Procedure(gamma=3))
    better = _expected_accepted_first_round(world, masked)
    assert better > plain + 0.05


def test_forced_chain_extends_past_the_block():
    """After 'c' the grammar forces 'a' then 'b': with one drafter step and an extension of 2 the block
    is [c, a, b] with delta proposals and confidence 1 at the forced positions, accepted with certainty."""
    v = 5
    logits = torch.tensor([0.0, 0.0, 0.0, 5.0, 0.0])
    sampler = G.MaskedDraftSampler([make_matcher()], torch.tensor([0]), torch.tensor([0]), v,
                                   to_probs=lambda z: torch.nn.functional.one_hot(z.argmax(-1), v).float())
    block = G.masked_draft_loop(lambda k, prev: logits.expand(len(prev), v), torch.tensor([2]), 1, sampler,
                                lambda k, prev: torch.full((len(prev),), 0.25), max_forced_extension=2)
    assert block.tokens.tolist() == [[3, 1, 2]] and block.forced.tolist() == [[False, True, True]]
    assert block.confidences.tolist() == [[0.25, 1.0, 1.0]] and block.lengths.tolist() == [3]
    assert block.probs[0, 1].tolist() == [0, 1, 0, 0, 0] and block.probs[0, 2].tolist() == [0, 0, 1, 0, 0]
    world = _world()
    q = torch.stack([world.target(()), world.target((3,)), world.target((3, 1)), world.target((3, 1, 2))])
    rows, probs, counts = S.pack_verify_rows(block.tokens, block.probs.double(), block.lengths)
    [outcomes] = exact_verify_outcomes([dict(q=q, p=probs, tokens=rows)])
    # the forced drafts are never the reason of a rejection: P(accept a, b | c accepted) = 1
    p_c = sum(w for w, n, _, _ in outcomes if n >= 1)
    assert p_c > 0 and sum(w for w, n, _, _ in outcomes if n == 3) == pytest.approx(p_c, abs=1e-12)


def test_block_ends_at_termination_and_forced_positions_in_masked_block():
    """A grammar that forces EOS: the forced EOS is drafted with confidence 1 and the block ends there."""
    m = DfaMatcher(trans={0: {1: 1}}, accepting={1}, eos=0, vocab_size=3)
    m2 = m.fork()
    sampler = G.MaskedDraftSampler([m], torch.tensor([0]), torch.tensor([0]), 3, stop_token_ids=[[0]])
    block = G.masked_draft_loop(lambda k, prev: torch.zeros(len(prev), 3), torch.tensor([2]), 4, sampler,
                                lambda k, prev: torch.full((len(prev),), 0.4))
    # state 0 allows only 'a' (forced), then state 1 allows only EOS (forced), then terminated
    assert block.tokens.tolist() == [[1, 0, -1, -1]] and block.lengths.tolist() == [2]
    assert block.forced.tolist() == [[True, True, False, False]]
    assert block.confidences.tolist() == [[1.0, 1.0, 0.0, 0.0]]
    assert m2.history == m.history                           # the engine's matcher was not touched


def test_first_violations_and_cut():
    m = make_matcher()
    drafts = torch.tensor([[1, 2, 3, 1], [1, 1, 2, 2], [3, 1, 2, 0], [2, 0, 0, 0]])
    valid = G.first_violations([m, m, m, None], drafts, torch.tensor([4, 4, 4, 2]))
    assert valid.tolist() == [4, 1, 4, 2]
    ell, forced = G.cut_at_violation(torch.tensor([4, 3, 1, 2]), valid)
    assert ell.tolist() == [4, 1, 1, 2] and forced.tolist() == [False, True, False, False]
    rows, _, counts = S.pack_verify_rows(drafts, None, ell, forced)
    assert counts.tolist() == [5, 2, 2, 3]
    assert rows.tolist() == [1, 2, 3, 1, S.FRESH, 1, S.FORCED_REJECT, 3, S.FRESH, 2, 0, S.FRESH]


# ------------------------------------------------------------------------------------------ sampled
def test_sampled_constrained_run_statistics_and_matcher_states():
    """2000 requests, horizon 7, all four mechanisms, async scheduling: chi-square of whole sequences
    against exact non-speculative constrained sampling (p > 1e-3), every output accepted token by token by
    a fresh matcher, ending terminated exactly when EOS was committed (also when EOS landed inside a
    verify window)."""
    world = World(v=5, horizon=7, eos=0, seed=3, grammar=GRAMMAR, noise=0.3)
    model = VS.StepTimeModel.from_table({b: 1.0 + 1e-4 * b for b in range(1, 2000 * 6)})
    proc = Procedure(gamma=3, schedule="async", model=model, **MECHANISMS["all_four"])
    gens, rounds = run_sampled(world, proc, 2000)
    assert rounds < 5
    for g in gens:
        m = make_matcher()
        assert all(m.accept(t) for t in g)
        assert m.is_terminated() == (len(g) > 0 and g[-1] == 0)
    assert chi_square_pvalue(gens, world.target_law()) > 1e-3


def test_masked_sampler_drives_the_dspark_markov_loop():
    """The sampler plugged into the real DSpark Markov loop (engine/dspark.py) with stub heads: drafts are
    grammatical, each proposal equals softmax(base + Markov bias) restricted to the grammar and renormalised
    (computed here from the stub weights), forced positions get confidence 1, the rest keep the head's value."""
    dspark = pytest.importorskip("deepinfer_sg.engine.dspark")
    from types import SimpleNamespace
    from torch import nn
    v, r, h, n = 5, 3, 4, 4
    torch.manual_seed(0)
    layer = nn.Module()
    layer.markov_head = dspark.MarkovHead(v, r)
    layer.confidence_head = dspark.ConfidenceHead(h + r)
    model = SimpleNamespace(mtp=nn.ModuleList([layer]))
    backbone = dspark.DraftBackbone(h_pre=torch.randn(2, n, h), base_logits=torch.randn(2, n, v))
    golden = torch.tensor([2, 4])
    sampler = G.MaskedDraftSampler([make_matcher(), make_matcher().after([3])], torch.tensor([5, 6]),
                                   torch.tensor([10, 20]), v)
    result = dspark.markov_draft(model, backbone, golden, sampler)
    block = sampler.finish(result.confidences)
    assert bool(block.forced.any())                  # request 1 starts in the single-token state after 'c'
    for i, start in enumerate([[], [3]]):
        toks = block.tokens[i, :int(block.lengths[i])].tolist()
        assert make_matcher().check_draft(start + toks) == len(start) + len(toks)
        prev = int(golden[i])
        for k, t in enumerate(toks):
            with torch.no_grad():
                bias = layer.markov_head.head.weight @ layer.markov_head.embed.weight[prev]
            logits = backbone.base_logits[i, k] + bias
            allowed = sorted(make_matcher().after(start + toks[:k]).allowed_now())
            want = torch.zeros(v)
            want[allowed] = torch.softmax(logits[allowed], 0)
            assert torch.allclose(block.probs[i, k].float(), want, atol=1e-6)
            forced = len(allowed) == 1
            assert bool(block.forced[i, k]) == forced
            assert float(block.confidences[i, k]) == (1.0 if forced else pytest.approx(float(result.confidences[i, k])))
            prev = t


# ------------------------------------------------------------------------------------------ real matchers
class OracleView:
    """A grammars-package matcher (helper A's llguidance backend) plus the two queries the exact harness
    needs, both answered through the protocol itself: after(tokens) and allowed_now() (via fill_mask)."""

    def __init__(self, m, vocab_size):
        self.m, self.V = m, vocab_size

    def __getattr__(self, name):
        return getattr(self.m, name)

    def fork(self):
        return OracleView(self.m.fork(), self.V)

    def after(self, toks):
        f = self.fork()
        return f if all(f.accept(t) for t in toks) else None

    def allowed_now(self):
        if self.m.is_terminated():
            return set()
        bm = torch.zeros(1, (self.V + 31) // 32, dtype=torch.int32)
        self.m.fill_mask(bm, 0)
        return {t for t in range(self.V) if (int(bm[0, t // 32]) >> (t % 32)) & 1}


def _tiny_compiled(pattern):
    """Helper A's ConstraintCompiler on a 5-token byte-level tokenizer {<eos>, a, b, c, d}."""
    tokenizers = pytest.importorskip("tokenizers")
    grammars = pytest.importorskip("deepinfer_sg.grammars")
    tk = tokenizers.Tokenizer(tokenizers.models.BPE({"<eos>": 0, "a": 1, "b": 2, "c": 3, "d": 4}, merges=[]))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = tokenizers.decoders.ByteLevel()
    tk.add_special_tokens([tokenizers.AddedToken("<eos>", special=True)])
    try:
        compiler = grammars.ConstraintCompiler(tk, vocab_size=5, eos_token_ids=[0])
        return compiler.compile(grammars.Regex(pattern))
    except Exception as e:          # the grammars package is written in parallel; its absence is not ours
        pytest.skip(f"grammars compiler unavailable on a tiny tokenizer: {e}")


@pytest.mark.parametrize("mechanism", ["verify_masks_only", "all_four"])
def test_lossless_with_the_real_grammar_matcher(mechanism):
    """The same exact check with helper A's compiled regex matcher (llguidance) instead of the test DFA;
    every finished output also matches the regex by Python's `re` (an independent oracle for the mask)."""
    import re
    pattern = "(ab|cab|d)*(b|d)"
    compiled = _tiny_compiled(pattern)
    world = World(v=5, horizon=3, eos=0, seed=6, grammar={"factory": lambda: OracleView(compiled.matcher(), 5)})
    target = _target(world)
    letters = "_abcd"
    for (seq,) in target:
        if seq and seq[-1] == 0:
            assert re.fullmatch(pattern, "".join(letters[t] for t in seq[:-1]))
    proc = Procedure(gamma=2, schedule="sync", model=MODEL, **MECHANISMS[mechanism])
    assert max_abs_diff(exact_procedure_law(world, proc), target) < 1e-12
