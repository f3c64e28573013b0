"""Masked drafting with device-resident automaton masks (engine/automaton_drafting.py) is lossless and drafts
exactly what MaskedDraftSampler drafts on CPU matchers with the same masks:
- exact enumeration of the whole speculative procedure with the automaton sampler (the harness of
  test_spec_harness.py) equals the non-speculative constrained law within 1e-12;
- block for block identical to MaskedDraftSampler (tokens, proposals, forced flags, confidences, lengths) on the
  toy DFA and on the real DeepSeek-V4 vocabulary (xgrammar's matcher as the CPU side: its masks equal the
  automaton's), with the valid lengths taken from llguidance's matcher (the verifier)."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_spec_grammar import MECHANISMS, MODEL, _target, _world  # noqa: E402
from test_spec_harness import Procedure, exact_procedure_law, max_abs_diff, toy_automaton  # noqa: E402
from test_spec_toys import GRAMMAR, make_matcher  # noqa: E402
from test_grammar_draft_automaton import real  # noqa: E402,F401  (a module fixture: the regex on the real vocabulary)

from deepinfer_sg.engine import grammar_drafting as G  # noqa: E402
from deepinfer_sg.engine.automaton_drafting import AutomatonDraftSampler  # noqa: E402


@pytest.mark.parametrize("mode", ["fixed", "sync"])
@pytest.mark.parametrize("mechanism", ["masked_drafting", "all_four"])
def test_exact_law_with_automaton_masks(mechanism, mode):
    world = _world(seed=3)
    proc = Procedure(gamma=2, schedule=mode, model=MODEL, draft_masks="automaton", **MECHANISMS[mechanism])
    assert max_abs_diff(exact_procedure_law(world, proc), _target(world)) < 1e-12


def _same_blocks(a, b):
    assert torch.equal(a.tokens, b.tokens)
    assert torch.equal(a.lengths, b.lengths) and torch.equal(a.valid_lengths, b.valid_lengths)
    assert torch.equal(a.forced, b.forced)
    assert torch.equal(a.confidences, b.confidences)
    assert torch.allclose(a.probs.double().cpu(), b.probs.double().cpu(), atol=1e-12, rtol=0)


@pytest.mark.parametrize("force", [False, True])
def test_same_blocks_as_cpu_masks_on_the_toy_grammar(force):
    a = toy_automaton(GRAMMAR)
    assert a.num_states == 5
    g = torch.Generator().manual_seed(5)
    # (no terminated start: the toy DfaMatcher then allows nothing, real matchers and the automaton allow EOS;
    # the engine never drafts for a finished request anyway)
    starts = [(), (1,), (3,), (1, 2), (4,), (3, 1)]
    for trial in range(20):
        R, n = len(starts), 3
        logits = torch.randn(n, R, 5, generator=g, dtype=torch.float64) * 2
        u = torch.rand(R, n + 2, generator=g, dtype=torch.float64)
        conf = torch.rand(R, n, generator=g, dtype=torch.float64)
        matchers = [make_matcher().after(list(s)) for s in starts]
        states = torch.tensor([a.terminated if m.is_terminated() else m.history[-1][0] for m in matchers])
        kw = dict(force_tokens=force, stop_token_ids=[[0]] * R, uniforms=u)
        cpu = G.MaskedDraftSampler(matchers, torch.zeros(R, dtype=torch.long), torch.zeros(R, dtype=torch.long), 5,
                                   mask_drafts=True, **kw)
        dev = AutomatonDraftSampler(matchers, a, states, torch.zeros(R, dtype=torch.long),
                                    torch.zeros(R, dtype=torch.long), 5, **kw)
        blocks = []
        for s in (cpu, dev):
            for k in range(n):
                s.step(logits[k])
            s.extend_forced(2 if force else 0)
            blocks.append(s.finish(conf))
        _same_blocks(*blocks)
        assert all(m.history == make_matcher().after(list(s)).history for m, s in zip(matchers, starts))


def test_same_blocks_as_cpu_masks_on_the_real_vocabulary(real):
    tok, V, a, lc, xc = real["tok"], real["V"], real["a"], real["llg"], real["xgr"]
    prefixes = ["", "Yes. Score:", "No. Score: 0.5. Why: ab"]
    g = torch.Generator().manual_seed(9)
    ref = tok.encode("Yes. Score: 0.75. Why: fine, ok.", add_special_tokens=False).ids + [1]
    for trial in range(3):
        R, n = len(prefixes), 5
        xm, lm, states = [], [], []
        for p in prefixes:
            ids = tok.encode(p, add_special_tokens=False).ids if p else []
            x, l = xc.matcher(), lc.matcher()
            assert all(x.accept(t) for t in ids) and all(l.accept(t) for t in ids)
            xm.append(x)
            lm.append(l)
            states.append(a.walk(a.initial, ids))
        # logits that like the reference's tokens (walks reach forced stretches and the end) plus noise
        logits = torch.randn(n, R, V, generator=g) * 0.5
        logits[:, :, ref] += 3.0
        seeds = torch.arange(R, dtype=torch.long) + 100 * trial
        kw = dict(force_tokens=True, stop_token_ids=[[1]] * R)
        cpu = G.MaskedDraftSampler(xm, seeds, torch.zeros(R, dtype=torch.long), V, mask_drafts=True, **kw)
        dev = AutomatonDraftSampler(lm, a, torch.tensor(states), seeds, torch.zeros(R, dtype=torch.long), V, **kw)
        blocks = []
        for s in (cpu, dev):
            for k in range(n):
                s.step(logits[k])
            s.extend_forced(3)
            blocks.append(s.finish())
        _same_blocks(*blocks)
        assert int(blocks[0].lengths.sum()) > 3 * R


# ------------------------------------------------------------------------------------------ wired into spec_decode
@pytest.mark.parametrize("drafter,temperature", [("self", 0.0), ("dspark", 0.0), ("self", 1.0)])
def test_spec_decode_with_device_masks(drafter, temperature):
    """SpecConfig(draft_masks="automaton") on the bundled tiny model with the real vocabulary: greedy equals plain
    constrained decoding (and equals draft_masks="cpu"), every output is accepted by the compiler's own matcher,
    the matchers end in the plain run's state, and the blocks really came from the automaton."""
    grammars = pytest.importorskip("deepinfer_sg.grammars")
    outlines_core = pytest.importorskip("outlines_core")
    from deepinfer_sg import load_tokenizer
    from deepinfer_sg.engine import spec_decode as SD
    from deepinfer_sg.engine.default_model import build_default_model
    from deepinfer_sg.engine.token_automaton import from_index
    from deepinfer_sg.grammars.backend_outlines import outlines_vocabulary
    from test_spec_engine import TABLE, plain_greedy, same_state
    model = build_default_model(seed=0)
    V = model.config.vocab_size
    tok = load_tokenizer()
    compiler = grammars.ConstraintCompiler(tok, vocab_size=V, eos_token_ids=[1], timeout_s=300)
    pattern = r"[a-c]{2}-[0-9]{2}(ok|no)?"
    compiled = compiler.compile(grammars.Regex(pattern))
    a = from_index(outlines_core.Index(pattern, outlines_vocabulary(compiler.vocab)), V, [1])
    prompt = tok.encode("Extract the code:", add_special_tokens=False).ids
    outs = {}
    for masks in ("cpu", "automaton"):
        reqs = [SD.StandaloneRequest(prompt, max_tokens=12, temperature=temperature, seed=s, stop_token_ids=(1,),
                                     matcher=compiled.matcher(), automaton=a) for s in range(3)]
        dec = SD.generate(model, reqs, SD.SpecConfig(n=3, schedule="fixed", drafter=drafter, step_times=TABLE,
                                                     draft_masks=masks))
        for r in reqs:
            assert r.error is None, r.error
            replay = compiled.matcher()
            assert all(replay.accept(t) for t in r.output)
            assert same_state(r.matcher, replay, V)
        outs[masks] = [r.output for r in reqs]
        assert (dec.stats.automaton_blocks > 0) == (masks == "automaton")
    assert outs["cpu"] == outs["automaton"]          # same masks, same counter draws: the same tokens
    if temperature == 0.0:
        ref, _ = plain_greedy(model, prompt, 12, matcher=compiled.matcher(), stop=(1,))
        assert outs["automaton"][0] == ref


def test_batched_draw_uniforms_equal_the_counter_rng():
    """The sampler evaluates its draw uniforms 16 positions at a time; each must be the counter RNG's value for
    (seed + DRAFT_SEED_OFFSET, position of d_1 + k, CASE_FRESH), evaluated here one position at a time."""
    from deepinfer_sg.engine.speculative import CASE_FRESH, DRAFT_SEED_OFFSET, counter_uniforms
    seeds, pos = torch.tensor([5, 2**62, 7]), torch.tensor([0, 100, 3])
    s = G.MaskedDraftSampler([None] * 3, seeds, pos, 10)
    for k in [0, 1, 15, 16, 17, 40, 2]:
        want = counter_uniforms(seeds + DRAFT_SEED_OFFSET, pos + k, CASE_FRESH)
        assert torch.equal(s._counter_uniforms(k, "cpu"), want), k


def test_processed_probs_with_host_rows_equals_the_device_scan():
    """The drafting loop passes the filtered / greedy rows computed from the host parameters (no device wait);
    the distributions must be those processed_probs finds scanning on the device."""
    from deepinfer_sg.engine import spec_decode as SD
    g = torch.Generator().manual_seed(2)
    params = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 3, 0.5), (1.0, 0, 1.0)]
    seqs = [SD.SpecSequence(None, 0, 0, temperature=t, top_k=k, top_p=p) for t, k, p in params]
    logits = torch.randn(len(params), 40, generator=g) * 2
    logits[5, :] = float("-inf")                                   # a dead row stays all zeros
    temp, topk, topp = SD._row_params(seqs, "cpu")
    want = SD.processed_probs(logits.clone(), temp, topk, topp)
    got = SD.processed_probs(logits.clone(), temp, topk, topp, SD.filter_and_greedy_rows(seqs, "cpu"))
    assert torch.equal(want, got)
    assert want[0].max() == 1 and (want[2] > 0).sum() == 5 and want[5].sum() == 0
