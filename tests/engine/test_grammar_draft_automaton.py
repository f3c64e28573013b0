"""The GPU-resident token automaton (engine/token_automaton.py, issue 7 option b) against independent oracles:
hand-computed tables on a toy DFA, xgrammar's masks on the real DeepSeek-V4 vocabulary (exact equality on random
walks), llguidance's masks (a subset: llguidance also drops non-canonical tokenizations of forced text, but it
accepts every token the automaton allows), and an independent bit unpacking."""
import pytest
import torch

from deepinfer_sg.engine import token_automaton as TA
from deepinfer_sg.engine.grammar_drafting import unpack_bitmask


def _bits(row, vocab):
    return {t for t in range(vocab) if (int(row[t // 32]) >> (t % 32)) & 1}


def _toy():
    # states 10 -(3)-> 20 -(4)-> 30(final), 10 -(5)-> 30, 30 -(3)-> 20 ; EOS = 0 listed in the final state
    return TA.from_transitions({10: {3: 20, 5: 30}, 20: {4: 30}, 30: {3: 20, 0: 30}}, 10, [30], 40, [0])


def test_toy_tables_by_hand():
    a = _toy()
    assert a.num_states == 3 and a.terminated == 3
    s10, s20, s30 = 0, 1, 2                       # dense ids in sorted order of the original ids
    assert a.initial == s10
    assert _bits(a.masks[s10], 40) == {3, 5}
    assert _bits(a.masks[s20], 40) == {4}
    assert _bits(a.masks[s30], 40) == {0, 3}      # EOS where the language may end
    assert _bits(a.masks[a.terminated], 40) == {0}
    assert a.final.tolist() == [False, False, True, True]
    assert a.nbytes == 4 * 2 * 4 + 8 * 4 + 4 * 4 + 4   # masks (4 rows x 2 words) + 4 keys + 4 targets + finals


def test_toy_advance_by_hand():
    a = _toy()
    states = torch.tensor([0, 0, 1, 2, 2, 0, 1, 2, a.terminated])
    tokens = torch.tensor([3, 5, 4, 3, 0, 4, 0, -1, 0])
    want = [1, 2, 2, 1, a.terminated, TA.DEAD, TA.DEAD, 2, TA.DEAD]
    assert a.advance(states, tokens).tolist() == want
    assert a.advance(torch.tensor([TA.DEAD]), torch.tensor([3])).tolist() == [TA.DEAD]   # dead stays dead
    rows = a.mask_rows(torch.tensor([TA.DEAD, 1]))
    assert _bits(rows[0], 40) == set() and _bits(rows[1], 40) == {4}


def test_size_bound_refuses():
    with pytest.raises(TA.AutomatonTooLarge, match="3 states, 4 transitions"):
        TA.from_transitions({10: {3: 20, 5: 30}, 20: {4: 30}, 30: {3: 20}}, 10, [30], 40, [0], max_bytes=16)


def test_pack_bits_roundtrip_with_sign_bit():
    g = torch.Generator().manual_seed(0)
    allowed = torch.rand(7, 96, generator=g) < 0.5
    allowed[:, 31] = True                         # bit 31 is the int32 sign bit
    allowed[3] = False
    packed = TA.pack_bits(allowed)
    assert packed.dtype == torch.int32 and packed.shape == (7, 3)
    assert torch.equal(unpack_bitmask(packed, 96), allowed)


# ------------------------------------------------------------------------------------------ the real vocabulary
REGEX = r"(Yes|No)\. Score: (0\.[0-9]{1,2}|1\.0)\. Why: [a-z ,]{3,12}\."


@pytest.fixture(scope="module")
def real():
    grammars = pytest.importorskip("deepinfer_sg.grammars")
    outlines_core = pytest.importorskip("outlines_core")
    from deepinfer_sg import load_tokenizer
    from deepinfer_sg.grammars.backend_outlines import outlines_vocabulary
    tok = load_tokenizer()
    V = 129_280
    llg = grammars.ConstraintCompiler(tok, vocab_size=V, eos_token_ids=[1], timeout_s=300)
    xgr = grammars.ConstraintCompiler(tok, vocab_size=V, eos_token_ids=[1], backend="xgrammar", timeout_s=300)
    index = outlines_core.Index(REGEX, outlines_vocabulary(llg.vocab))
    a = TA.from_index(index, V, [1])
    return dict(V=V, a=a, tok=tok, llg=llg.compile(grammars.Regex(REGEX)), xgr=xgr.compile(grammars.Regex(REGEX)))


def _mask(m, V):
    bm = torch.zeros(1, (V + 31) // 32, dtype=torch.int32)
    m.fill_mask(bm, 0)
    return bm[0]


def test_masks_equal_xgrammar_and_contain_llguidance_on_random_walks(real):
    V, a = real["V"], real["a"]
    g = torch.Generator().manual_seed(1)
    steps = finished = subset_strict = 0
    for walk in range(6):
        xm, lm = real["xgr"].matcher(), real["llg"].matcher()
        s = a.initial_states(1)
        while True:
            row = a.mask_rows(s)[0]
            assert torch.equal(row, _mask(xm, V)), f"walk {walk} step {steps}: automaton != xgrammar"
            lrow = _mask(lm, V)
            assert torch.equal(lrow & ~row, torch.zeros_like(row)), "llguidance allows a token the automaton does not"
            subset_strict += int(not torch.equal(lrow, row))
            allowed = unpack_bitmask(row.unsqueeze(0), V)[0].nonzero().flatten()
            # prefer leaving the free-text loop now and then so that walks finish
            t = int(allowed[torch.randint(allowed.numel(), (1,), generator=g)])
            if 1 in allowed.tolist() and torch.rand(1, generator=g).item() < 0.3:
                t = 1
            assert xm.accept(t) and lm.accept(t), f"a backend rejects the automaton's token {t}"
            s = a.advance(s, torch.tensor([t]))
            assert int(s) != TA.DEAD
            steps += 1
            if t == 1:
                assert int(s) == a.terminated and xm.is_terminated() and lm.is_terminated()
                finished += 1
                break
    assert finished == 6 and steps > 60
    assert subset_strict > 0       # the known llguidance difference shows up (else this test checks less)


def test_disallowed_tokens_go_dead_like_the_matchers_reject_them(real):
    V, a = real["V"], real["a"]
    lm = real["llg"].matcher()
    s = a.initial_states(1)
    g = torch.Generator().manual_seed(2)
    row = unpack_bitmask(a.mask_rows(s), V)[0]
    banned = (~row).nonzero().flatten()
    for t in banned[torch.randperm(banned.numel(), generator=g)[:50]].tolist():
        assert int(a.advance(s, torch.tensor([t]))) == TA.DEAD
        assert not lm.fork().accept(t)


def test_refined_masks_equal_llguidance_on_random_walks(real):
    """refine_masks narrows every state's row to the verifier's mask (llguidance, the oracle here): on random
    walks through the refined automaton, its rows equal llguidance's masks exactly and llguidance accepts every
    token, up to termination."""
    import outlines_core
    from deepinfer_sg.grammars.backend_outlines import outlines_vocabulary
    V = real["V"]
    index = outlines_core.Index(REGEX, outlines_vocabulary(real["llg"].vocab))
    a = TA.from_index(index, V, [1], reference=real["llg"].matcher)
    g = torch.Generator().manual_seed(4)
    steps = 0
    for walk in range(6):
        lm = real["llg"].matcher()
        s = a.initial_states(1)
        while True:
            row = a.mask_rows(s)[0]
            assert torch.equal(row, _mask(lm, V)), f"walk {walk} step {steps}: refined automaton != llguidance"
            allowed = unpack_bitmask(row.unsqueeze(0), V)[0].nonzero().flatten()
            t = int(allowed[torch.randint(allowed.numel(), (1,), generator=g)])
            if 1 in allowed.tolist() and torch.rand(1, generator=g).item() < 0.3:
                t = 1
            assert lm.accept(t)
            s = a.advance(s, torch.tensor([t]))
            steps += 1
            if t == 1:
                assert int(s) == a.terminated and lm.is_terminated()
                break
    assert steps > 60
