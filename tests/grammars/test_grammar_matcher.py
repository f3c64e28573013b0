"""The matcher protocol on the default (llguidance) backend with the real DeepSeek-V4 tokenizer."""
import torch

from deepinfer_sg.grammars import Grammar, JsonSchema, Regex, allocate_bitmask, bitmask_to_bool

from grammar_testutil import DEEPSEEK_VOCAB, EOS, encode

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def allowed(m):
    mask = allocate_bitmask(1, DEEPSEEK_VOCAB)
    m.fill_mask(mask, 0)
    return bitmask_to_bool(mask, DEEPSEEK_VOCAB)[0]


def test_bitmask_shape():
    mask = allocate_bitmask(3, DEEPSEEK_VOCAB)
    assert mask.dtype == torch.int32 and mask.shape == (3, (DEEPSEEK_VOCAB + 31) // 32) and not mask.any()


def test_accepts_valid_json_and_terminates(compiler, ds_tokenizer):
    m = compiler.compile(JsonSchema(SCHEMA)).matcher()
    for t in encode(ds_tokenizer, '{"name": "Ada", "age": 36}'):
        assert not m.is_terminated()
        assert allowed(m)[t], "a token of a valid instance must be in the mask"
        assert m.accept(t)
    assert allowed(m)[EOS]
    assert m.accept(EOS) and m.is_terminated()
    assert not m.accept(EOS), "nothing after termination"


def test_reject_leaves_state_unchanged(compiler, ds_tokenizer):
    m = compiler.compile(JsonSchema(SCHEMA)).matcher()
    ids = encode(ds_tokenizer, '{"name"')
    assert all(m.accept(t) for t in ids)
    before = allowed(m)
    bad = encode(ds_tokenizer, "}")[0]
    assert not before[bad] and not m.accept(bad)
    assert not m.accept(EOS), "EOS only where the grammar is complete"
    assert torch.equal(allowed(m), before)


def test_rollback_restores_masks(compiler, ds_tokenizer):
    m = compiler.compile(JsonSchema(SCHEMA)).matcher()
    ids = encode(ds_tokenizer, '{"name": "Bob", "age": 7}') + [EOS]
    masks = []
    for t in ids:
        masks.append(allowed(m))
        assert m.accept(t)
    assert m.is_terminated()
    for back in range(1, min(17, len(ids)) + 1):
        m.rollback(1)
        assert not m.is_terminated()
        assert torch.equal(allowed(m), masks[-back])
    m.rollback(0)


def test_padding_and_special_ids_never_allowed_in_json(compiler, ds_tokenizer):
    m = compiler.compile(JsonSchema({"type": "string"})).matcher()
    a = allowed(m)
    added = ds_tokenizer.get_added_tokens_decoder()
    specials = [i for i, t in added.items() if t.special]
    assert len(specials) > 1000  # placeholders, chat markers, ...
    assert not a[specials].any()
    assert not a[ds_tokenizer.get_vocab_size():].any()  # ids beyond the tokenizer (if the model pads)
    assert not m.accept(DEEPSEEK_VOCAB - 1)  # <｜image｜>, a special token
    assert m.accept(encode(ds_tokenizer, '"')[0])
    inside = allowed(m)
    assert inside.sum() > 100_000  # inside a string nearly every text token is fine...
    assert not inside[specials].any() and not inside[ds_tokenizer.get_vocab_size():].any()  # ...but no special


def test_special_token_allowed_where_lark_grammar_names_it(compiler, ds_tokenizer):
    user = ds_tokenizer.token_to_id("<｜User｜>")
    m = compiler.compile(Grammar('start: "hi" <｜User｜> "x"', syntax="lark")).matcher()
    assert all(m.accept(t) for t in encode(ds_tokenizer, "hi"))
    a = allowed(m)
    assert a[user] and a.sum() == 1
    assert m.accept(user)
    assert m.accept(encode(ds_tokenizer, "x")[0]) and m.accept(EOS)


def test_check_draft_matches_step_by_step(compiler, ds_tokenizer):
    m = compiler.compile(JsonSchema(SCHEMA)).matcher()
    good = encode(ds_tokenizer, '{"name": "Eve", "age": 5}') + [EOS]
    assert m.check_draft(good) == len(good)
    prefix = encode(ds_tokenizer, '{"name":')
    bad = prefix + encode(ds_tokenizer, "5") + good
    assert m.check_draft(bad) == len(prefix)  # a number where the schema wants a string
    assert m.check_draft([]) == 0
    assert not m.is_terminated() and allowed(m)[good[0]]  # state unchanged


def test_forced_tokens_are_the_only_choice(compiler, ds_tokenizer):
    m = compiler.compile(JsonSchema(SCHEMA, whitespace="compact")).matcher()
    forced = m.forced_tokens()
    assert forced, "compact JSON with a fixed first property forces its opening"
    text = ds_tokenizer.decode(forced)
    assert '{"name":"'.startswith(text) or text.startswith('{"name"')
    probe = m.fork()
    for t in forced:
        a = allowed(probe)
        assert a[t]
        assert probe.accept(t)
    assert allowed(m)[forced[0]]  # forced_tokens() left m unchanged


def test_fork_is_independent(compiler, ds_tokenizer):
    m = compiler.compile(Regex(r"[0-9]+(\.[0-9]+)?")).matcher()
    assert m.accept(encode(ds_tokenizer, "12")[0])
    f = m.fork()
    dot = encode(ds_tokenizer, ".")[0]
    assert f.accept(dot)
    assert not f.accept(EOS)
    assert m.accept(EOS) and m.is_terminated() and not f.is_terminated()


def test_regex_full_match(compiler, ds_tokenizer):
    m = compiler.compile(Regex("ab+c")).matcher()
    assert m.check_draft(encode(ds_tokenizer, "abbbc") + [EOS]) == len(encode(ds_tokenizer, "abbbc")) + 1
    assert m.check_draft(encode(ds_tokenizer, "ac")) < len(encode(ds_tokenizer, "ac"))


def test_ebnf_grammar(compiler, ds_tokenizer):
    g = Grammar('root ::= greeting " " name\ngreeting ::= "hello" | "bye"\nname ::= [a-z]+\n')
    m = compiler.compile(g).matcher()
    ids = encode(ds_tokenizer, "hello world")
    assert m.check_draft(ids + [EOS]) == len(ids) + 1
    assert m.check_draft(encode(ds_tokenizer, "hey you")) < len(encode(ds_tokenizer, "hey you"))


def test_pydantic_model(compiler, ds_tokenizer):
    import pydantic

    class Point(pydantic.BaseModel):
        x: int
        y: float
        label: str | None = None

    spec = JsonSchema.from_model(Point)
    m = compiler.compile(spec).matcher()
    text = Point(x=1, y=2.5, label="p").model_dump_json()
    ids = encode(ds_tokenizer, text)
    assert m.check_draft(ids + [EOS]) == len(ids) + 1
    assert Point.model_validate_json(text).x == 1
    bad = encode(ds_tokenizer, '{"x":1.5')
    assert m.check_draft(bad) < len(bad)


def test_out_of_range_ids_are_rejected(compiler, xgr_compiler):
    for c in (compiler, xgr_compiler):
        m = c.compile(JsonSchema({"type": "integer"})).matcher()
        assert not m.accept(-1) and not m.accept(DEEPSEEK_VOCAB) and not m.accept(10**9) and not m.accept(1 << 40)
        assert m.check_draft([DEEPSEEK_VOCAB]) == 0
        # the rejections left the state as it was: an integer is still accepted from the start, to the end
        ids = c.vocab.tokenizer.encode("42", add_special_tokens=False).ids
        assert all(m.accept(t) for t in ids) and m.accept(EOS) and m.is_terminated()


def test_accept_fast_path_range_excludes_every_added_token(compiler, ds_tokenizer):
    """A grammar that names tokens (NamedTokensLLGuidanceMatcher) sends ids inside llguidance_matcher's plain range
    straight to llguidance; EOS and every added token (the tokenizer's own list) must fall outside it, or EOS would
    reach llguidance and an added token would skip the careful rollback. A grammar that names none (JSON, regex:
    LLGuidanceMatcher) sends every id above _EOS_TOP straight there: every EOS id must be at or below it. The
    DeepSeek vocabulary's own bounds let ordinary text ids through (the fast paths are used); the process-wide ones
    are within every registered vocabulary's."""
    from deepinfer_sg.grammars import llguidance_matcher as lm

    compiled = compiler.compile(Regex(r"[a-z]+"))  # (registers the vocabulary, as any compile does)
    assert type(compiled.matcher()) is lm.LLGuidanceMatcher and not compiled.added_ids
    added = set(ds_tokenizer.get_added_tokens_decoder())
    assert EOS in added
    lo, hi = lm.plain_range(compiler.vocab)
    assert lo <= lm._PLAIN_LO <= lm._PLAIN_HI <= hi
    assert not any(lo < i < hi for i in added)
    assert max(compiler.vocab.eos_token_ids) <= lm._EOS_TOP
    text = encode(ds_tokenizer, '{"name": "Ada Lovelace", "age": 36} and some plain words')
    assert all(lo < i < hi for i in text)
    assert all(i > max(compiler.vocab.eos_token_ids) for i in text)
