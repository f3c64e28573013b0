"""Batched fill_masks: rows equal one-matcher-at-a-time masks along each draft; invalid tails are zero."""
import torch

from deepinfer_sg.grammars import Grammar, JsonSchema, Regex, Triggered, allocate_bitmask, fill_masks
from grammar_testutil import DEEPSEEK_VOCAB, EOS, encode

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}}, "required": ["n", "s"]}


def sequential_rows(m, draft):
    """Oracle: step a fork token by token, one fill_mask per position, stop at the first rejection."""
    rows = allocate_bitmask(len(draft) + 1, DEEPSEEK_VOCAB)
    walker = m.fork()
    walker.fill_mask(rows, 0)
    ok = 0
    for j, t in enumerate(draft):
        if not walker.accept(t):
            break
        ok += 1
        walker.fill_mask(rows, j + 1)
    return rows, ok


def test_fill_masks_matches_sequential(compiler, xgr_compiler, ds_tokenizer):
    text = '{"n": 12, "s": "hello"}'
    ids = encode(ds_tokenizer, text)
    llg = compiler.compile(JsonSchema(SCHEMA))
    xgr = xgr_compiler.compile(JsonSchema(SCHEMA))
    matchers, drafts = [], []
    for i in range(6):
        comp = llg if i % 2 == 0 else xgr
        m = comp.matcher()
        for t in ids[: i + 1]:
            assert m.accept(t)
        d = ids[i + 1: i + 6]  # K=5 drafts, all grammatical
        if i == 2:
            d = d[:2] + encode(ds_tokenizer, "]]") + d[2:]  # ungrammatical from the third draft on
        if i == 4:
            d = []
        matchers.append(m)
        drafts.append(d)
    full = m.fork()
    for t in ids[6:]:
        assert full.accept(t)
    matchers.append(full)
    drafts.append([EOS, EOS])  # EOS inside a draft: terminated after the first, the second is invalid
    counts = []
    out = fill_masks(matchers, drafts, valid_counts=counts)
    assert out.shape == (sum(len(d) + 1 for d in drafts), (DEEPSEEK_VOCAB + 31) // 32)
    row = 0
    for m, d, n in zip(matchers, drafts, counts):
        expected, ok = sequential_rows(m, d)
        assert n == ok
        assert torch.equal(out[row: row + ok + 1], expected[: ok + 1])
        assert not out[row + ok + 1: row + len(d) + 1].any(), "rows after the first bad draft are zero"
        row += len(d) + 1
    assert counts[2] == 2 and counts[-1] == 1
    # matchers are unchanged: a fresh fill equals the first row again
    again = fill_masks(matchers[:1])
    assert torch.equal(again[0], out[0])


def test_fill_masks_batch_256_with_drafts(compiler, ds_tokenizer):
    ids = encode(ds_tokenizer, '{"n": 3, "s": "abc def"}')
    comp = compiler.compile(JsonSchema(SCHEMA))
    matchers, drafts = [], []
    for i in range(256):
        m = comp.matcher()
        k = i % (len(ids) - 5)
        for t in ids[:k]:
            m.accept(t)
        matchers.append(m)
        drafts.append(ids[k: k + 5])
    out = allocate_bitmask(256 * 6, DEEPSEEK_VOCAB)
    counts = []
    fill_masks(matchers, drafts, out=out, valid_counts=counts)
    assert counts == [5] * 256
    for i in (0, 7, 255):  # spot-check against the sequential oracle
        expected, _ = sequential_rows(matchers[i], drafts[i])
        assert torch.equal(out[i * 6: i * 6 + 6], expected)


def test_fill_masks_triggered_and_regex(compiler, ds_tokenizer):
    trig = encode(ds_tokenizer, "<call>")
    comp = compiler.compile(Triggered(Regex("[0-9]+"), trig))
    m = comp.matcher()
    draft = encode(ds_tokenizer, "hi ") + trig + encode(ds_tokenizer, "42")
    counts = []
    out = fill_masks([m], [draft], valid_counts=counts)
    expected, ok = sequential_rows(m, draft)
    assert counts == [ok] and ok == len(draft)
    assert torch.equal(out, expected)


def test_fill_masks_with_finished_matchers(compiler, ds_tokenizer, raw_lltokenizer):
    """Finished matchers (EOS accepted) in a batch get exactly the EOS bit (hand-computed row); the others get raw
    llguidance's own mask at the same text; rolled back over EOS, a matcher is live again."""
    from llguidance import LLMatcher

    ids = encode(ds_tokenizer, '{"n": 3, "s": "abc"}')
    comp = compiler.compile(JsonSchema(SCHEMA))
    matchers, raws = [], []
    for i in range(8):
        m, r = comp.matcher(), LLMatcher(raw_lltokenizer, comp.grammar, log_level=0)
        k = len(ids) if i % 3 == 0 else i
        for t in ids[:k]:
            assert m.accept(t) and r.consume_token(t)
        if i % 3 == 0:
            assert m.accept(EOS) and m.is_terminated()
        matchers.append(m)
        raws.append(r)
    eos_row = torch.zeros((DEEPSEEK_VOCAB + 31) // 32, dtype=torch.int32)
    eos_row[EOS // 32] = 1 << (EOS % 32)
    want = allocate_bitmask(1, DEEPSEEK_VOCAB)
    # in both orders: a finished matcher first, or a live one first (whose batch call must then notice the
    # finished ones: llguidance's executor refuses them and fill_masks falls back to per-class groups)
    for shift, drafts in ((0, None), (0, [[] if i % 3 else [EOS] for i in range(8)]), (1, None),
                          (1, [[] if i % 3 else [EOS] for i in range(1, 9)])):
        order = list(range(shift, 8)) + list(range(shift))
        out = fill_masks([matchers[i] for i in order], drafts)
        row = 0
        for j, i in enumerate(order):
            m, r = matchers[i], raws[i]
            if i % 3 == 0:
                assert torch.equal(out[row], eos_row)
            else:
                r.unsafe_compute_mask_ptr(want.data_ptr(), want.shape[1] * 4)
                assert torch.equal(out[row], want[0])
            n = 1 if drafts is None else len(drafts[j]) + 1
            assert not out[row + 1: row + n].any()  # nothing is grammatical after EOS
            row += n
    m = matchers[0]
    m.rollback(1)  # over EOS: live again, at the end of the instance
    out = fill_masks([m, matchers[1]])
    raws[0].unsafe_compute_mask_ptr(want.data_ptr(), want.shape[1] * 4)
    assert not m.is_terminated() and torch.equal(out[0], want[0])



def test_batch_led_by_a_finished_matcher_holding_other_backends_and_a_finished_risky_one(
        compiler, xgr_compiler, ds_tokenizer, raw_lltokenizer):
    """A batch whose first matcher is finished (its class picks the batch call) but which also holds an xgrammar
    matcher and a finished matcher that had accepted an added token its grammar names by id (another finished
    class): every row is what
    that matcher gives alone (EOS-only rows hand-computed; the xgrammar row from xgrammar's own GrammarMatcher at
    the same state); a rollback over EOS makes the risky one live and risky again, and its rollback over the added
    token lands where raw llguidance fed the kept prefix is."""
    from llguidance import LLMatcher

    dsml = 128825  # `｜DSML｜`: a non-special added token, named by id (what llguidance rolls back wrongly)
    string = compiler.compile(Grammar(f'start: "\\"a<" <[{dsml}]> "\\""', syntax="lark"))
    seq = encode(ds_tokenizer, '"a<') + [dsml] + encode(ds_tokenizer, '"')
    risky = string.matcher()
    assert all(risky.accept(t) for t in seq) and risky.accept(EOS) and risky.is_terminated()
    ids = encode(ds_tokenizer, '{"n":3,"s":"abc"}')
    plain = compiler.compile(JsonSchema(SCHEMA, whitespace="compact")).matcher()
    assert all(plain.accept(t) for t in ids) and plain.accept(EOS)
    xm = xgr_compiler.compile(JsonSchema(SCHEMA, whitespace="compact")).matcher()
    assert all(xm.accept(t) for t in ids[:4])
    want_x = allocate_bitmask(1, DEEPSEEK_VOCAB)
    xm.m.fork().fill_next_token_bitmask(want_x, 0)  # xgrammar's own GrammarMatcher, same state
    eos_row = torch.zeros((DEEPSEEK_VOCAB + 31) // 32, dtype=torch.int32)
    eos_row[EOS // 32] = 1 << (EOS % 32)
    out = fill_masks([plain, xm, risky])
    assert torch.equal(out[0], eos_row) and torch.equal(out[2], eos_row) and torch.equal(out[1], want_x[0])
    risky.rollback(1)  # over EOS: live again, and still risky
    assert not risky.is_terminated() and type(risky).__name__ == "RiskyLLGuidanceMatcher"
    risky.fill_mask(allocate_bitmask(1, DEEPSEEK_VOCAB), 0)  # a mask in between: what trips llguidance's rollback
    risky.rollback(2)  # over `｜DSML｜"`
    raw = LLMatcher(raw_lltokenizer, string.grammar, log_level=0)
    assert raw.try_consume_tokens(seq[:-2]) == len(seq) - 2
    got, want = allocate_bitmask(1, DEEPSEEK_VOCAB), allocate_bitmask(1, DEEPSEEK_VOCAB)
    risky.fill_mask(got, 0)
    raw.unsafe_compute_mask_ptr(want.data_ptr(), want.shape[1] * 4)
    assert torch.equal(got, want)

def test_fill_masks_at_given_rows_and_triggered_batches(compiler, ds_tokenizer, raw_lltokenizer):
    """`rows=` places each mask at its own row and leaves the others untouched; Triggered matchers in a batch
    (free text, forcing the trigger, inside the grammar) get the masks they give one at a time. Oracles: raw
    llguidance matchers fed the same prefix (inner grammar), the free-text row and the forced trigger token by
    hand."""
    import numpy as np
    from llguidance import LLMatcher

    trigger = [128806, 128808]
    spec = JsonSchema(SCHEMA, whitespace="compact")
    plain = compiler.compile(spec)
    trig = compiler.compile(Triggered(spec, trigger, bound_token_id=trigger[0]))
    ids = encode(ds_tokenizer, '{"n":3,"s":"abc"}')
    words = (DEEPSEEK_VOCAB + 31) // 32

    def raw_row(prefix):
        raw = LLMatcher(raw_lltokenizer, plain.grammar, log_level=0)
        assert raw.try_consume_tokens(prefix) == len(prefix)
        return torch.from_numpy(np.frombuffer(raw.compute_bitmask(), dtype=np.int32).copy())[:words]

    free_row = allocate_bitmask(1, DEEPSEEK_VOCAB)
    trig.matcher().fill_mask(free_row, 0)
    assert bin(int(free_row[0, 0]) & 0xFFFFFFFF).count("1") >= 30  # free text: nearly every id allowed
    forcing_row = torch.zeros(words, dtype=torch.int32)
    forcing_row[trigger[1] // 32] = 1 << (trigger[1] % 32)
    cases = []  # (matcher, expected row)
    for k in (0, 2, 5):
        m = plain.matcher()
        assert all(m.accept(t) for t in ids[:k])
        cases.append((m, raw_row(ids[:k])))
    for k in (0, 3):
        m = trig.matcher()
        assert all(m.accept(t) for t in trigger + ids[:k])
        cases.append((m, raw_row(ids[:k])))
    m = trig.matcher()
    assert m.accept(trigger[0]) and m.is_constrained()  # the bound token: the rest of the trigger is forced
    cases.append((m, forcing_row))
    m = trig.matcher()
    assert m.accept(ids[0]) and not m.is_constrained()
    cases.append((m, free_row[0]))
    for order in (list(range(len(cases))), list(reversed(range(len(cases))))):
        ms = [cases[i][0] for i in order]
        rows = [2 * j + 1 for j in range(len(ms))]  # every other row: the even rows must stay as they were
        out = torch.full((2 * len(ms) + 1, words), 7, dtype=torch.int32)
        errors: dict = {}
        fill_masks(ms, out=out, rows=rows, errors=errors)
        assert not errors
        for j, i in enumerate(order):
            assert torch.equal(out[rows[j]], cases[i][1]), (j, i)
        assert (out[0::2] == 7).all()
        for j, i in enumerate(order):  # one at a time, the same
            one = allocate_bitmask(1, DEEPSEEK_VOCAB)
            cases[i][0].fill_mask(one, 0)
            assert torch.equal(one[0], cases[i][1])
    import pytest
    with pytest.raises(ValueError):
        fill_masks([cases[0][0]], rows=[-1])
    with pytest.raises(ValueError):
        fill_masks([cases[0][0]], [[1]], rows=[0])


def test_xgrammar_batch_without_drafts(xgr_compiler, ds_tokenizer):
    """xgrammar matchers in a no-draft batch (one xgrammar batch call), at scattered rows, one of them finished:
    each row equals xgrammar's own single-matcher mask at the same prefix (a GrammarMatcher built here), the
    finished one allows EOS alone (hand-set)."""
    import xgrammar as xgr

    compiled = xgr_compiler.compile(JsonSchema(SCHEMA, whitespace="compact"))
    ids = encode(ds_tokenizer, '{"n":3,"s":"abc"}')
    words = (DEEPSEEK_VOCAB + 31) // 32
    ms, want = [], []
    for k in (0, 2, 4, len(ids)):
        m = compiled.matcher()
        assert all(m.accept(t) for t in ids[:k])
        raw = xgr.GrammarMatcher(compiled.compiled)
        assert all(raw.accept_token(t) for t in ids[:k])
        buf = xgr.allocate_token_bitmask(1, DEEPSEEK_VOCAB)
        raw.fill_next_token_bitmask(buf, 0)
        ms.append(m)
        want.append(buf[0, :words])
    assert ms[-1].accept(EOS) and ms[-1].is_terminated()
    eos_row = torch.zeros(words, dtype=torch.int32)
    eos_row[EOS // 32] = 1 << (EOS % 32)
    want[-1] = eos_row
    out = torch.full((9, words), 7, dtype=torch.int32)
    rows = [8, 1, 5, 3]
    errors: dict = {}
    fill_masks(ms, out=out, rows=rows, errors=errors)
    assert not errors
    for r, w in zip(rows, want):
        assert torch.equal(out[r], w), r
    assert (out[[0, 2, 4, 6, 7]] == 7).all()
