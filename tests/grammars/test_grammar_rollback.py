"""rollback(n) works for every n up to the tokens accepted, on every backend, after termination and across the
trigger of a Triggered matcher, including where llguidance's own rollback fails.

Oracles: raw backend matchers built here (llguidance `LLMatcher` from the grammar text, xgrammar
`GrammarMatcher`, outlines-core `Guide`) fed only the kept prefix and never rolled back; for Triggered,
a fresh matcher fed the kept prefix (its trigger logic is ours, so "rolled back == never accepted").
"""
import numpy as np
import pytest
import torch
from llguidance import LLMatcher

from deepinfer_sg.grammars import ConstraintCompiler, JsonSchema, Regex, Triggered, allocate_bitmask
from deepinfer_sg.grammars.dsml import dsml_grammar

from grammar_testutil import DEEPSEEK_VOCAB, EOS, encode

DSML = 128825
THINK_END = 128822  # `</think>`: a special added token
TOOLS = [{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                "required": ["city"]}}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "integer"}}},
          "required": ["name", "tags"]}


def ours_mask(m):
    b = allocate_bitmask(1, DEEPSEEK_VOCAB)
    m.fill_mask(b, 0)
    return b[0]


WORDS = (DEEPSEEK_VOCAB + 31) // 32


def fed(compiled, prefix):
    """A fresh matcher of `compiled` fed `prefix`, with a mask computed before each token (as an engine does)."""
    m = compiled.matcher()
    for t in prefix:
        ours_mask(m)
        assert m.accept(t)
    return m


def raw_llg_mask(raw):
    words = torch.from_numpy(np.frombuffer(raw.compute_bitmask(), dtype=np.int32).copy())
    assert not words[WORDS:].any()  # llguidance may round up to one more word; never any bit there
    return words[:WORDS]


def raw_llg_at(lltok, grammar, prefix):
    raw = LLMatcher(lltok, grammar, log_level=0)
    assert raw.try_consume_tokens(prefix) == len(prefix)
    return raw


@pytest.fixture(scope="module")
def dsml(compiler, ds_tokenizer):
    compiled = compiler.compile(dsml_grammar(TOOLS, "get_weather", starts_in_tool_calls=True))
    lt = encode(ds_tokenizer, "<")
    assert len(lt) == 1
    return compiled, lt[0]


def test_raw_llguidance_rollback_bug(dsml, raw_lltokenizer):
    """The upstream bug our wrapper repairs (llguidance 1.9.1). If this starts failing, llguidance fixed it and
    the repair path is no longer exercised by the DSML case (the tests below still check the behaviour)."""
    compiled, lt = dsml
    raw = LLMatcher(raw_lltokenizer, compiled.grammar, log_level=0)
    raw.compute_bitmask()
    assert raw.try_consume_tokens([lt]) == 1
    raw.compute_bitmask()
    assert raw.try_consume_tokens([DSML]) == 1
    assert not raw.rollback(2)
    assert raw.is_error() and "rollback" in raw.get_error()


def raw_rollbacks_gone_wrong(lltok, grammar, seq):
    """(back, masks) pairs for which raw llguidance, fed `seq` (a mask computed before each token and after the
    last, or none), then rolled back `back` tokens, fails or differs from a fresh matcher fed the kept prefix."""
    wrong = []
    for back in range(1, len(seq) + 1):
        for masks in (True, False):
            m = LLMatcher(lltok, grammar, log_level=0)
            for t in seq:
                if masks:
                    m.compute_bitmask()
                assert m.try_consume_tokens([t]) == 1
            if masks:
                m.compute_bitmask()
            fresh = raw_llg_at(lltok, grammar, seq[: len(seq) - back])
            if not m.rollback(back) or not torch.equal(raw_llg_mask(m), raw_llg_mask(fresh)):
                wrong.append((back, masks))
    return wrong


def test_raw_llguidance_rollback_bug_needs_a_non_special_token_named_by_id(ds_tokenizer, raw_lltokenizer):
    """What exactly llguidance 1.9.1 rolls back wrongly, on raw llguidance alone (which is why only Grammar specs,
    the ones that can name tokens by id, make their matchers check the ids a rollback drops: compiled.added_ids):
    `｜DSML｜` (a NON-special added token) named by id (`<[128825]>`), with masks computed during the walk, fails
    or lands wrong when a rollback crosses it, whatever precedes it; the same token matched as text (a lark
    literal, a JSON string) and a special token named by id (`</think>`) roll back right at every depth."""
    assert not raw_lltokenizer.is_special_token(DSML) and raw_lltokenizer.is_special_token(THINK_END)
    lt, a, x = (encode(ds_tokenizer, c)[0] for c in ("<", "a", "x"))
    for before in ([lt], [a], []):
        grammar = LLMatcher.grammar_from_lark(
            'start: ' + " ".join([f'"{ds_tokenizer.decode([t])}"' for t in before] + [f'<[{DSML}]> "x"']))
        wrong = raw_rollbacks_gone_wrong(raw_lltokenizer, grammar, before + [DSML, x])
        assert wrong and all(masks for _, masks in wrong), (before, wrong)
    named_special = LLMatcher.grammar_from_lark(f'start: "<" <[{THINK_END}]> "x"')
    assert raw_rollbacks_gone_wrong(raw_lltokenizer, named_special, [lt, THINK_END, x]) == []
    as_text = encode(ds_tokenizer, "<｜DSML｜x")
    assert DSML in as_text
    literal = LLMatcher.grammar_from_lark('start: "<｜DSML｜x"')
    assert raw_rollbacks_gone_wrong(raw_lltokenizer, literal, as_text) == []
    string = LLMatcher.grammar_from_json_schema({"type": "string"}, overrides={"whitespace_flexible": False})
    in_string = encode(ds_tokenizer, '"a<｜DSML｜ x<｜DSML｜"')
    assert in_string.count(DSML) == 2
    assert raw_rollbacks_gone_wrong(raw_lltokenizer, string, in_string) == []


@pytest.mark.parametrize("back", [1, 2])
def test_wrapper_rolls_back_over_dsml(dsml, raw_lltokenizer, back):
    compiled, lt = dsml
    m = compiled.matcher()
    for t in (lt, DSML):
        ours_mask(m)  # a mask between the accepts is what triggers the upstream bug
        assert m.accept(t)
    ours_mask(m)
    m.rollback(back)
    kept = [lt, DSML][: 2 - back]
    assert torch.equal(ours_mask(m), raw_llg_mask(raw_llg_at(raw_lltokenizer, compiled.grammar, kept)))
    assert all(m.accept(t) for t in [lt, DSML][2 - back:])  # and the path is open again
    assert torch.equal(ours_mask(m), raw_llg_mask(raw_llg_at(raw_lltokenizer, compiled.grammar, [lt, DSML])))


def test_deep_rollback_across_the_repair(dsml, ds_tokenizer, raw_lltokenizer):
    """24 tokens into the DSML block, masks at every step, then back to every depth 1..24 in one call each."""
    compiled, lt = dsml
    text = ('<｜DSML｜ invoke name="get_weather">\n<｜DSML｜ parameter name="city" string="true">Paris'
            '</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>')
    seq = encode(ds_tokenizer, text)
    assert seq[:2] == [lt, DSML] and seq.count(DSML) == 5
    seq = seq[:24]
    assert len(seq) == 24 and seq.count(DSML) >= 3
    for back in range(1, len(seq) + 1):
        m = compiled.matcher()
        for t in seq:
            ours_mask(m)
            assert m.accept(t)
        m.rollback(back)
        raw = raw_llg_at(raw_lltokenizer, compiled.grammar, seq[: len(seq) - back])
        assert torch.equal(ours_mask(m), raw_llg_mask(raw)), back


def test_llguidance_rollback_after_termination(compiler, ds_tokenizer, raw_lltokenizer):
    compiled = compiler.compile(JsonSchema(SCHEMA, whitespace="compact"))
    seq = encode(ds_tokenizer, '{"name":"Ada","tags":[1,22,333]}')
    assert len(seq) >= 12
    for back in range(1, len(seq) + 2):
        m = compiled.matcher()
        for t in seq + [EOS]:
            ours_mask(m)
            assert m.accept(t)
        assert m.is_terminated()
        m.rollback(back)
        assert not m.is_terminated()
        raw = raw_llg_at(raw_lltokenizer, compiled.grammar, seq[: len(seq) + 1 - back])
        assert torch.equal(ours_mask(m), raw_llg_mask(raw)), back
    with pytest.raises(ValueError, match="only"):
        compiled.matcher().rollback(1)


def test_xgrammar_rollback_after_termination(xgr_compiler, ds_tokenizer):
    import xgrammar as xgr

    compiled = xgr_compiler.compile(JsonSchema(SCHEMA, whitespace="compact"))
    seq = encode(ds_tokenizer, '{"name":"Bo","tags":[4,5,6,7,8]}')
    assert len(seq) >= 12
    buf = xgr.allocate_token_bitmask(1, DEEPSEEK_VOCAB)
    for back in range(1, len(seq) + 2, 3):
        m = compiled.matcher()
        for t in seq + [EOS]:
            assert m.accept(t)
        assert m.is_terminated()
        m.rollback(back)
        assert not m.is_terminated()
        raw = xgr.GrammarMatcher(compiled.compiled)
        assert all(raw.accept_token(t) for t in seq[: len(seq) + 1 - back])
        raw.fill_next_token_bitmask(buf, 0)
        assert torch.equal(ours_mask(m), buf[0]), back


def test_outlines_rollback_after_termination(ds_tokenizer):
    from outlines_core import Guide

    c = ConstraintCompiler(ds_tokenizer, vocab_size=DEEPSEEK_VOCAB, backend="outlines")
    compiled = c.compile(Regex(r"[a-z]{1,40}"))
    seq = encode(ds_tokenizer, "the quick brown fox jumps over the lazy dog".replace(" ", ""))
    buf = allocate_bitmask(1, DEEPSEEK_VOCAB)
    for back in range(1, len(seq) + 2):
        m = compiled.matcher()
        for t in seq + [EOS]:
            assert m.accept(t)
        assert m.is_terminated()
        m.rollback(back)
        assert not m.is_terminated()
        raw = Guide(compiled.index, max_rollback=32)
        for t in seq[: len(seq) + 1 - back]:
            raw.advance(t, return_tokens=False)
        buf.zero_()
        raw.write_mask_into(buf.data_ptr(), buf.shape[1], 4)
        assert torch.equal(ours_mask(m), buf[0]), back
    c.close()


@pytest.mark.parametrize("inner", ["json", "dsml"])
def test_triggered_rollback_across_trigger_and_termination(compiler, ds_tokenizer, inner):
    """Free text, the trigger, the inner grammar to EOS; rolled back to every depth (one call, and one token
    at a time) it equals a fresh matcher fed the kept prefix."""
    trigger = [128806, 128808]
    if inner == "json":
        spec, body = JsonSchema(SCHEMA, whitespace="compact"), encode(ds_tokenizer, '{"name":"x","tags":[]}')
    else:
        spec = dsml_grammar(TOOLS, "get_weather", starts_in_tool_calls=True)
        body = encode(ds_tokenizer, "<") + [DSML]  # the llguidance rollback bug, inside a Triggered matcher
    compiled = compiler.compile(Triggered(spec, trigger))
    seq = encode(ds_tokenizer, "hi there") + trigger + body + ([EOS] if inner == "json" else [])

    full = fed(compiled, seq)
    assert full.is_terminated() == (inner == "json")
    for back in range(1, len(seq) + 1):
        m = fed(compiled, seq)
        m.rollback(back)
        ref = fed(compiled, seq[: len(seq) - back])
        assert m.is_constrained() == ref.is_constrained() and not m.is_terminated()
        assert torch.equal(ours_mask(m), ours_mask(ref)), back
    m = fed(compiled, seq)
    for back in range(1, len(seq) + 1):
        m.rollback(1)
        ref = fed(compiled, seq[: len(seq) - back])
        assert torch.equal(ours_mask(m), ours_mask(ref)), back


def test_fork_keeps_its_own_history(dsml, raw_lltokenizer):
    """A fork rolled back past the point of forking (through the repair path) leaves the parent untouched."""
    compiled, lt = dsml
    m = compiled.matcher()
    ours_mask(m)
    assert m.accept(lt)
    f = m.fork()
    ours_mask(f)
    assert f.accept(DSML)
    ours_mask(f)
    f.rollback(2)
    assert torch.equal(ours_mask(f), raw_llg_mask(raw_llg_at(raw_lltokenizer, compiled.grammar, [])))
    assert torch.equal(ours_mask(m), raw_llg_mask(raw_llg_at(raw_lltokenizer, compiled.grammar, [lt])))


def test_random_walks_with_rollbacks_match_fresh_matchers(compiler, raw_lltokenizer):
    """Seeded random walks through DSML grammars (tokens drawn from our masks, the special token preferred),
    rolling back 1-5 tokens now and then: every mask equals a fresh raw matcher fed the kept tokens."""
    import random

    tools = TOOLS + [{"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}]
    rng = random.Random(7)
    for spec in (dsml_grammar(tools, "auto"), dsml_grammar(tools, "required", starts_in_tool_calls=True)):
        compiled = compiler.compile(spec)
        for _ in range(2):
            m, kept = compiled.matcher(), []
            for _ in range(40):
                mask = ours_mask(m)
                allowed = [i for i in torch.nonzero(bitmask_ids(mask)).flatten().tolist() if i != EOS]
                if not allowed:
                    break
                t = DSML if DSML in allowed and rng.random() < 0.5 else rng.choice(allowed)
                assert m.accept(t)
                kept.append(t)
                if rng.random() < 0.3:
                    k = rng.randint(1, min(5, len(kept)))
                    ours_mask(m)
                    m.rollback(k)
                    del kept[-k:]
                    raw = raw_llg_at(raw_lltokenizer, compiled.grammar, kept)
                    assert torch.equal(ours_mask(m), raw_llg_mask(raw)), kept


def bitmask_ids(words):
    """bool [vocab] from one int32 mask row."""
    shifts = torch.arange(32, dtype=torch.int32)
    return (((words.unsqueeze(-1) >> shifts) & 1).reshape(-1)[:DEEPSEEK_VOCAB]).bool()


@pytest.mark.parametrize("with_masks,fork_every", [(False, 0), (True, 0), (False, 23), (True, 41)])
def test_long_history_rollback_and_repair(dsml, ds_tokenizer, raw_lltokenizer, with_masks, fork_every):
    """A history longer than a few HISTORY_CHUNKs: rollbacks within and across chunk boundaries, through the
    repair path (over the closing DSML token) and not, from a forked matcher too. With fork_every, the walk forks
    every that many tokens (each fork freezes the history so far into shared chunks: chunk boundaries at many
    places), and the early forks must stay at their own prefix whatever the later matchers do."""
    from deepinfer_sg.grammars.llguidance_matcher import HISTORY_CHUNK

    compiled, lt = dsml
    value = " ".join(f"word{i}" for i in range(90))
    text = (f'<｜DSML｜ invoke name="get_weather">\n<｜DSML｜ parameter name="city" string="true">{value}'
            '</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>')
    seq = encode(ds_tokenizer, text)
    assert len(seq) > 2 * HISTORY_CHUNK + 10
    first_closing = len(seq) - seq[::-1].index(DSML) - 1  # the last DSML token
    for back in (1, 2, HISTORY_CHUNK, HISTORY_CHUNK + 1, len(seq) - first_closing, len(seq) - first_closing + 3,
                 2 * HISTORY_CHUNK + 5, len(seq)):
        m = compiled.matcher()
        early = []  # (fork, its prefix length)
        for i, t in enumerate(seq):
            if with_masks:
                ours_mask(m)
            assert m.accept(t)
            if fork_every and i % fork_every == fork_every - 1:
                early.append((m.fork(), i + 1))
        f = m.fork()
        for w in (m, f):
            w.rollback(back)
            raw = raw_llg_at(raw_lltokenizer, compiled.grammar, seq[: len(seq) - back])
            assert torch.equal(ours_mask(w), raw_llg_mask(raw)), back
        for e, n in early[::2]:  # untouched by the rollbacks of the matchers they share history chunks with
            assert torch.equal(ours_mask(e), raw_llg_mask(raw_llg_at(raw_lltokenizer, compiled.grammar, seq[:n]))), n
            e.rollback(min(back, n))
            raw = raw_llg_at(raw_lltokenizer, compiled.grammar, seq[: n - min(back, n)])
            assert torch.equal(ours_mask(e), raw_llg_mask(raw)), (n, back)
        assert all(m.accept(t) for t in seq[len(seq) - back:])  # and forward again
        assert torch.equal(ours_mask(m), raw_llg_mask(raw_llg_at(raw_lltokenizer, compiled.grammar, seq)))


def test_added_token_inside_a_json_string_rolls_back_right(compiler, ds_tokenizer, raw_lltokenizer):
    """`｜DSML｜` is a non-special added token, so a JSON string may hold it (as text: llguidance's own rollback
    is right there, see test_raw_llguidance_rollback_bug_needs_a_non_special_token_named_by_id, so the matcher
    keeps its one-call rollback). Walked with masks, then rolled back to every depth (one call, one token at a
    time, from a fork, and across EOS); each mask equals a fresh raw matcher fed the kept prefix."""
    compiled = compiler.compile(JsonSchema({"type": "string"}, whitespace="compact"))
    seq = encode(ds_tokenizer, '"a<｜DSML｜ x<｜DSML｜"')
    assert seq.count(DSML) == 2

    def expect(m, kept):
        assert torch.equal(ours_mask(m), raw_llg_mask(raw_llg_at(raw_lltokenizer, compiled.grammar, kept))), kept

    for back in range(1, len(seq) + 1):
        m = fed(compiled, seq)
        ours_mask(m)
        m.rollback(back)
        expect(m, seq[: len(seq) - back])
        assert all(m.accept(t) for t in seq[len(seq) - back:])  # and forward again
        expect(m, seq)
    m = fed(compiled, seq + [EOS])
    f = m.fork()
    for back in range(1, len(seq) + 1):
        for w in (m, f):
            ours_mask(w)
            w.rollback(1)
        expect(m, seq[: len(seq) + 1 - back])
        expect(f, seq[: len(seq) + 1 - back])


def test_json_random_walks_with_rollbacks_forks_and_history(compiler, ds_tokenizer, raw_lltokenizer):
    """The plain (no added token) path: seeded walks through a JSON schema with masks, rollbacks of 1-4 tokens,
    forks and re-accepts; every mask equals a fresh raw matcher fed the kept tokens, the history (what a repair
    replays) equals them too, and rolling back past them is refused with ValueError."""
    import random

    compiled = compiler.compile(JsonSchema(SCHEMA, whitespace="compact"))
    seq = encode(ds_tokenizer, '{"name":"Grace Hopper","tags":[1,22,333,4444,55555]}')
    rng = random.Random(3)
    for _ in range(3):
        m, kept, pos = compiled.matcher(), [], 0
        while pos < len(seq):
            ours_mask(m)
            assert m.accept(seq[pos])
            kept.append(seq[pos])
            pos += 1
            if rng.random() < 0.35:
                k = rng.randint(1, min(4, len(kept)))
                m.rollback(k)
                del kept[-k:]
                pos -= k
                if rng.random() < 0.5:
                    m = m.fork()
                assert m.history() == kept
                raw = raw_llg_at(raw_lltokenizer, compiled.grammar, kept)
                assert torch.equal(ours_mask(m), raw_llg_mask(raw)), kept
        with pytest.raises(ValueError, match="only"):
            m.rollback(len(kept) + 1)
        assert m.history() == kept and torch.equal(ours_mask(m), raw_llg_mask(
            raw_llg_at(raw_lltokenizer, compiled.grammar, kept)))
