"""JSON whitespace modes: bounded (no runaway newlines/spaces), compact, indented."""
import json

from deepinfer_sg.grammars import JsonSchema
from deepinfer_sg.grammars.conformance import accepts_text
from grammar_testutil import EOS

SCHEMA = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}}, "b": {"type": "boolean"}}}
VALUE = {"a": [1, 2], "b": True}


def accepts(compiler, tok, ws, text):
    return accepts_text(compiler.compile(JsonSchema(SCHEMA, whitespace=ws)).matcher(), tok, text, EOS)


def test_bounded_accepts_compact_and_pretty(compiler, ds_tokenizer):
    for text in (json.dumps(VALUE), json.dumps(VALUE, separators=(",", ":")), json.dumps(VALUE, indent=2),
                 json.dumps(VALUE, indent=4), json.dumps(VALUE, indent="\t")):
        assert accepts(compiler, ds_tokenizer, "bounded", text), text


def test_bounded_refuses_runaway_whitespace(compiler, ds_tokenizer):
    assert not accepts(compiler, ds_tokenizer, "bounded", '{\n\n"a": [1]}')
    assert not accepts(compiler, ds_tokenizer, "bounded", "{" + " " * 200 + '"a": [1]}')
    assert not accepts(compiler, ds_tokenizer, "bounded", '{"a": [1]\n\n\n}')
    # and a generation cannot loop: after some whitespace, more whitespace runs out
    m = compiler.compile(JsonSchema(SCHEMA)).matcher()
    nl = ds_tokenizer.encode("\n", add_special_tokens=False).ids[0]
    assert m.accept(ds_tokenizer.encode("{", add_special_tokens=False).ids[0])
    assert m.accept(nl) and not m.accept(nl)


def test_compact_allows_no_whitespace(compiler, ds_tokenizer):
    assert accepts(compiler, ds_tokenizer, "compact", json.dumps(VALUE, separators=(",", ":")))
    assert not accepts(compiler, ds_tokenizer, "compact", json.dumps(VALUE))
    assert not accepts(compiler, ds_tokenizer, "compact", json.dumps(VALUE, indent=2))


def test_indented_accepts_json_dumps_indent(compiler, ds_tokenizer):
    assert accepts(compiler, ds_tokenizer, "indented", json.dumps(VALUE, indent=2))
    assert not accepts(compiler, ds_tokenizer, "indented", '{"a":\t[1]}')


def test_our_whitespace_options_win_over_the_schemas_own(compiler, ds_tokenizer):
    """The options reach llguidance as the schema's "x-guidance" entry: a schema's own entry (here asking for
    flexible whitespace) is replaced, and the empty schema (no other keys) gets them too."""
    own = dict(SCHEMA, **{"x-guidance": {"whitespace_flexible": True, "lenient": True}})
    m = compiler.compile(JsonSchema(own, whitespace="compact")).matcher()
    assert not accepts_text(m, ds_tokenizer, json.dumps(VALUE), EOS)
    m = compiler.compile(JsonSchema(own, whitespace="compact")).matcher()
    assert accepts_text(m, ds_tokenizer, json.dumps(VALUE, separators=(",", ":")), EOS)
    for text, ok in ((json.dumps(VALUE, separators=(",", ":")), True), (json.dumps(VALUE), False)):
        m = compiler.compile(JsonSchema({}, whitespace="compact")).matcher()
        assert accepts_text(m, ds_tokenizer, text, EOS) == ok, text
