"""Bad input raises ConstraintError naming what and where (keyword + JSON pointer, grammar line, ...)."""
import pytest

from deepinfer_sg.grammars import ConstraintError, Grammar, JsonSchema, Regex, Triggered


def test_constraint_error_is_value_error():
    assert issubclass(ConstraintError, ValueError)


def test_invalid_regex_names_position(compiler):
    with pytest.raises(ConstraintError, match="unclosed group"):
        compiler.compile(Regex("ab(c"))


def test_non_utf8_pattern():
    with pytest.raises(ConstraintError, match="not valid UTF-8.*offset 2"):
        Regex(b"ab\xff")
    with pytest.raises(ConstraintError, match="UTF-8"):
        Regex("a\udcff")  # lone surrogate, e.g. from surrogateescape decoding


def test_non_utf8_grammar_text():
    with pytest.raises(ConstraintError, match="UTF-8"):
        Grammar(b'root ::= "\xc3"')


def test_schema_text_not_json():
    with pytest.raises(ConstraintError, match="not valid JSON.*line 1"):
        JsonSchema('{"type": "object",')


def test_schema_not_object():
    with pytest.raises(ConstraintError, match="object or a boolean"):
        JsonSchema("[1, 2]")


def test_invalid_schema_keyword_value(compiler):
    with pytest.raises(ConstraintError, match="'type' at pointer '/properties/a/type'.*integr"):
        compiler.compile(JsonSchema({"type": "object", "properties": {"a": {"type": "integr"}}}))


def test_invalid_keyword_inside_tuple_items(compiler):
    """Draft 4-7 tuple `items` are subschemas too: the checks reach into them."""
    with pytest.raises(ConstraintError, match="'minItems' at pointer '/items/1/minItems' must be a non-negative"):
        compiler.compile(JsonSchema({"type": "array", "items": [{"type": "string"}, {"type": "array", "minItems": -1}]}))
    with pytest.raises(ConstraintError, match="'maxItems' at pointer '/items/maxItems'"):
        compiler.compile(JsonSchema({"type": "array", "items": {"type": "array", "maxItems": -1}}))


def test_unknown_ref_names_pointer(compiler):
    with pytest.raises(ConstraintError, match="/\\$defs/missing"):
        compiler.compile(JsonSchema({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}))


def test_unsupported_keyword_names_keyword_and_pointer(compiler):
    schema = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(ConstraintError, match="'uniqueItems' at pointer '/properties/tags/uniqueItems'"):
        compiler.compile(JsonSchema(schema))


def test_undefined_rule_names_line(compiler):
    text = 'root ::= "a" item\nitem ::= "b" missing\n'
    with pytest.raises(ConstraintError, match="'missing'.*line 2"):
        compiler.compile(Grammar(text))


def test_lark_undefined_rule_names_line(compiler):
    with pytest.raises(ConstraintError, match=r"at 2\(4\): unknown name: \"c\""):
        compiler.compile(Grammar('start: "a" b\nb: "x" c\n', syntax="lark"))


def test_bad_options():
    with pytest.raises(ConstraintError, match="whitespace"):
        JsonSchema({}, whitespace="pretty")
    with pytest.raises(ConstraintError, match="approximations"):
        JsonSchema({}, approximations={"everything"})
    with pytest.raises(ConstraintError, match="syntax"):
        Grammar("root ::= x", syntax="peg")


def test_trigger_ids_checked(compiler):
    with pytest.raises(ConstraintError, match="outside the tokenizer"):
        compiler.compile(Triggered(Regex("a"), [10**7]))
    with pytest.raises(ConstraintError, match="non-empty"):
        Triggered(Regex("a"), [])


def test_not_a_spec(compiler):
    with pytest.raises(ConstraintError, match="not a constraint spec"):
        compiler.compile({"type": "object"})


def test_one_bad_constraint_leaves_compiler_healthy(compiler, ds_tokenizer):
    with pytest.raises(ConstraintError):
        compiler.compile(Regex("(("))
    m = compiler.compile(Regex("ok")).matcher()
    assert all(m.accept(t) for t in ds_tokenizer.encode("ok", add_special_tokens=False).ids)
    assert m.accept(1) and m.is_terminated()


def test_approximations_are_opt_in(compiler, ds_tokenizer):
    overlapping = {"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 0}]}  # 5 matches both
    with pytest.raises(ConstraintError, match="oneOf"):
        compiler.compile(JsonSchema(overlapping))
    m = compiler.compile(JsonSchema(overlapping, approximations={"oneOf-as-anyOf"})).matcher()
    ids = ds_tokenizer.encode("5", add_special_tokens=False).ids
    assert m.check_draft(ids + [1]) == len(ids) + 1  # documented: accepted although it matches two branches
    with pytest.raises(ConstraintError, match="uri-reference"):
        compiler.compile(JsonSchema({"type": "string", "format": "uri-reference"}))
    compiler.compile(JsonSchema({"type": "string", "format": "uri-reference"}, approximations={"ignore-format"}))


def test_disjoint_oneof_is_exact_without_opt_in(compiler, ds_tokenizer):
    m = compiler.compile(JsonSchema({"oneOf": [{"type": "string"}, {"type": "integer"}]})).matcher()
    for text in ('"x"', "7"):
        ids = ds_tokenizer.encode(text, add_special_tokens=False).ids
        assert m.check_draft(ids + [1]) == len(ids) + 1
