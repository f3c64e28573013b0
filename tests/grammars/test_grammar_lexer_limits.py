"""When llguidance's lexer runs out of fuel, the request gets a clear ConstraintError (never a silently wrong
mask or a silent rejection of valid text), and the other requests of the same compiled constraint go on.

llguidance 1.9.1 shares one lazily built lexer (and one fuel budget) between every copy of a compiled
matcher; once exhausted, every copy fails ("too many expressions constructed") and a plain consume silently
rejects valid tokens. Oracles: jsonschema (the texts are valid), raw llguidance matchers with lexers of their
own fed the same prefix, and MaskBench's own valid/invalid labels.
"""
import json

import jsonschema
import numpy as np
import pytest
import torch
from llguidance import LLMatcher

from deepinfer_sg.grammars import ConstraintError, JsonSchema, allocate_bitmask, fill_masks
from deepinfer_sg.grammars.conformance import run_cases

from grammar_testutil import DATA, DEEPSEEK_VOCAB, EOS, encode

WORDS = (DEEPSEEK_VOCAB + 31) // 32
# Short texts fit in the lexer's default fuel; a 16-word text fed without masks in between exhausts it
# (measured on llguidance 1.9.1; with a mask before each token the same text fits).
SCHEMA = {"type": "string", "pattern": r"^(\S+\s+){0,20}\S+$", "maxLength": 400}
LONG = json.dumps("one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen")
SHORT = json.dumps("alpha beta")


def ours_mask(m):
    b = allocate_bitmask(1, DEEPSEEK_VOCAB)
    m.fill_mask(b, 0)
    return b[0]


def raw_mask_at(lltok, grammar, prefix):
    raw = LLMatcher(lltok, grammar, log_level=0)  # a lexer of its own, never exhausted by anyone else
    assert raw.try_consume_tokens(prefix) == len(prefix)
    words = torch.from_numpy(np.frombuffer(raw.compute_bitmask(), dtype=np.int32).copy())
    return words[:WORDS]


def walk_until_refused(m, ids, with_masks):
    """Feed ids; a valid token may only be refused with ConstraintError, never with accept() == False."""
    for i, t in enumerate(ids):
        if with_masks:
            ours_mask(m)
        assert m.accept(t), f"valid token {i} silently rejected"
    return m.accept(EOS)


def test_exhausted_lexer_refuses_clearly(compiler, ds_tokenizer):
    jsonschema.validate(json.loads(LONG), SCHEMA)
    compiled = compiler.compile(JsonSchema(SCHEMA, whitespace="compact"))
    with pytest.raises(ConstraintError, match="lexer"):  # consumes without masks: llguidance's silent path
        walk_until_refused(compiled.matcher(), encode(ds_tokenizer, LONG), with_masks=False)
    assert compiled.renewals >= 1  # the shared lexer was replaced for everyone else
    for with_masks in (False, True):  # new requests are fine
        assert walk_until_refused(compiled.matcher(), encode(ds_tokenizer, SHORT), with_masks)


def test_exhausted_lexer_refuses_clearly_when_filling_masks(compiler, ds_tokenizer):
    item = json.loads((DATA / "maskbench-dev" / "Github_easy---o21053.json").read_text())
    valid = next(t["data"] for t in item["tests"] if t["valid"])
    jsonschema.validate(valid, item["schema"])
    compiled = compiler.compile(JsonSchema(item["schema"], whitespace="compact"))
    with pytest.raises(ConstraintError, match="lexer"):
        walk_until_refused(compiled.matcher(), encode(ds_tokenizer, json.dumps(valid, separators=(",", ":"))), True)


def test_other_requests_survive_an_exhausted_lexer(compiler, ds_tokenizer, raw_lltokenizer):
    compiled = compiler.compile(JsonSchema(SCHEMA, whitespace="bounded"))
    short = encode(ds_tokenizer, SHORT)
    a = compiled.matcher()  # in flight on the shared lexer when b exhausts it
    for t in short[:2]:
        ours_mask(a)
        assert a.accept(t)
    b = compiled.matcher()
    with pytest.raises(ConstraintError, match="lexer"):
        walk_until_refused(b, encode(ds_tokenizer, LONG), with_masks=False)
    # a's next masks (single and batched) equal a raw matcher's fed the same prefix, and a finishes its text
    assert torch.equal(ours_mask(a), raw_mask_at(raw_lltokenizer, compiled.grammar, short[:2]))
    errors = {}
    out = fill_masks([a, b], [[short[2]], []], errors=errors)
    assert list(errors) == [1] and "lexer" in errors[1]
    assert torch.equal(out[0], raw_mask_at(raw_lltokenizer, compiled.grammar, short[:2]))
    assert torch.equal(out[1], raw_mask_at(raw_lltokenizer, compiled.grammar, short[:3]))
    assert not out[2].any()  # b's row: nothing allowed
    with pytest.raises(ConstraintError, match="matcher 1"):
        fill_masks([a, b])  # without an errors dict the failure is raised
    # a batch large enough that fill_masks looks for failures among the rows allowing EOS only: b is found, and
    # every other row (some at the end of their text, allowing EOS themselves) is raw llguidance's
    others = []
    for i in range(120):
        m = compiled.matcher()
        assert all(m.accept(t) for t in short[: i % (len(short) + 1)])
        others.append((m, short[: i % (len(short) + 1)]))
    batch = [m for m, _ in others[:57]] + [b] + [m for m, _ in others[57:]]
    errors = {}
    out = fill_masks(batch, errors=errors)
    assert list(errors) == [57] and "lexer" in errors[57] and not out[57].any()
    for k in (0, 1, 2, 3, 4, 5, 6, 56, 58, 100, 120):
        _, prefix = others[k if k < 57 else k - 1]
        assert torch.equal(out[k], raw_mask_at(raw_lltokenizer, compiled.grammar, prefix)), k
    assert sum(bool(out[k, EOS // 32] & (1 << EOS % 32)) for k in range(121)) >= 10  # EOS rows besides b's
    assert all(a.accept(t) for t in short[2:]) and a.accept(EOS)


def test_a_failed_matchers_row_allows_eos_alone(compiler, ds_tokenizer, raw_lltokenizer):
    """What fill_masks relies on to look for failures only in rows that allow EOS: llguidance writes a row allowing
    EOS alone for a matcher in error, through the batch executor as through a single fill."""
    from llguidance import LLExecutor

    compiled = compiler.compile(JsonSchema(SCHEMA, whitespace="compact"))
    bad = LLMatcher(raw_lltokenizer, compiled.grammar, log_level=0)
    ids = encode(ds_tokenizer, LONG)
    assert bad.try_consume_tokens(ids) < len(ids)  # its lexer ran out of fuel: a silent rejection ...
    bad.compute_bitmask()
    assert bad.is_error()  # ... flagged by the next mask
    ok = LLMatcher(raw_lltokenizer, compiled.grammar, log_level=0)
    eos_only = torch.zeros(WORDS, dtype=torch.int32)
    eos_only[EOS // 32] = 1 << (EOS % 32)
    out = torch.full((2, WORDS), -1, dtype=torch.int32)
    LLExecutor().unsafe_compute_mask_ptr([(ok, 0), (bad, 1)], out.data_ptr(), WORDS * 4, 2)
    assert torch.equal(out[1], eos_only) and not torch.equal(out[0], eos_only)
    out.fill_(-1)
    bad.unsafe_compute_mask_ptr(out.data_ptr(), WORDS * 4)
    assert torch.equal(out[0], eos_only)


def test_maskbench_fuel_schema_has_no_wrong_answer(compiler):
    """Github_easy---o21053 (maxLength 5000 & a 100-word pattern): every valid instance is accepted or refused
    with ConstraintError, no invalid instance is accepted (before: valid text silently rejected)."""
    item = json.loads((DATA / "maskbench-dev" / "Github_easy---o21053.json").read_text())
    res = run_cases(compiler, item["schema"], item["tests"])
    assert res["refused"] is None
    assert set(res["outcomes"]) <= {"pass", "runtime_refused"}, res["outcomes"]
    assert all("lexer" in e for e in res["runtime_errors"])


def test_survivor_with_rollbacks_is_rebuilt_at_its_kept_prefix(compiler, ds_tokenizer, raw_lltokenizer):
    """A matcher that rolled back (some of it not yet dropped from its history: no accept since) when another
    sequence exhausts the shared lexer is rebuilt at exactly the tokens it kept (oracle: raw llguidance fed them)."""
    compiled = compiler.compile(JsonSchema(SCHEMA, whitespace="bounded"))
    short = encode(ds_tokenizer, SHORT)
    assert len(short) >= 4
    a = compiled.matcher()
    for t in short[:4]:
        ours_mask(a)
        assert a.accept(t)
    a.rollback(2)
    ours_mask(a)
    assert a.accept(short[2])  # kept: short[:3]
    a.rollback(1)  # kept: short[:2], with the last rollback still pending in the history
    f = a.fork()
    b = compiled.matcher()
    with pytest.raises(ConstraintError, match="lexer"):
        walk_until_refused(b, encode(ds_tokenizer, LONG), with_masks=False)
    for m in (a, f):
        assert torch.equal(ours_mask(m), raw_mask_at(raw_lltokenizer, compiled.grammar, short[:2]))
        assert all(m.accept(t) for t in short[2:]) and m.accept(EOS)
