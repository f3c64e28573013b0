"""The compiler's fast path: `schema_support.scan()` lets a schema skip check_schema/prepare/unsupported only when
that full path would find nothing to report and nothing to rewrite but annotations; and llguidance's masks do not
depend on those annotations (oracle: raw llguidance matchers on the annotation-free schema)."""
import json

import pytest
import torch
from llguidance import LLMatcher

from deepinfer_sg.grammars import ConstraintError, JsonSchema, allocate_bitmask, schema_support
from deepinfer_sg.grammars.backend_llguidance import json_options
from grammar_testutil import DATA, DEEPSEEK_VOCAB, encode

SUITE = DATA / "json-schema-test-suite" / "draft2020-12"
MASKBENCH = DATA / "maskbench-dev"


def strip_annotations(node):
    """The schema without annotation keywords (except $schema), in every subschema: what prepare() does to a
    schema that has nothing else to rewrite (written here from the keyword lists, not with prepare's code)."""
    if isinstance(node, list):
        return [strip_annotations(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in schema_support.ANNOTATIONS and key != "$schema":
            continue
        if key in schema_support.SCHEMA_KEYS or key in schema_support.SCHEMA_LIST_KEYS:
            out[key] = strip_annotations(value)
        elif key in schema_support.SCHEMA_MAP_KEYS and isinstance(value, dict):
            out[key] = {name: strip_annotations(sub) for name, sub in value.items()}
        else:
            out[key] = value
    return out


BAD_VALUES = [{"type": "strng"}, {"minLength": -1}, {"maxItems": "2"}, {"required": "a"}, {"pattern": 5},
              {"multipleOf": 0}, {"allOf": []}, {"properties": []}, {"items": 5}, {"format": 5}, {"minimum": True}]


def corpus():
    for path in sorted(SUITE.glob("*.json")):
        for group in json.loads(path.read_text()):
            yield f"{path.stem}: {group['description']}", group["schema"]
    for i, path in enumerate(sorted(MASKBENCH.glob("*.json"))[::7]):  # every 7th MaskBench schema (~300)
        schema = json.loads(path.read_text())["schema"]
        yield path.name, schema
        if i % 10 == 0:  # plus a copy with an invalid value nested somewhere (check_schema refuses it)
            yield path.name + " + bad", {"anyOf": [schema, {"items": BAD_VALUES[(i // 10) % len(BAD_VALUES)]}]}


def test_scan_agrees_with_the_full_path():
    seen = {schema_support.SCAN_AS_IS: 0, schema_support.SCAN_PREPARE: 0, schema_support.SCAN_INVALID: 0,
            "no unsupported": 0, "no ref siblings": 0, "targeted": 0}
    for name, schema in corpus():
        found = schema_support.scan(schema)
        seen[found] += 1
        try:
            schema_support.check_schema(schema)
            invalid = False
        except ConstraintError:
            invalid = True
        assert invalid == (found == schema_support.SCAN_INVALID), name
        if found == schema_support.SCAN_AS_IS:
            prepared = schema_support.prepare(schema)
            assert prepared == strip_annotations(schema), name
            assert schema_support.unsupported(schema, "llguidance") == [], name
        code, has_unsupported, ref_siblings = schema_support.scan_details(schema)
        assert code == found, name
        if found == schema_support.SCAN_PREPARE:
            # the walks the compiler skips on scan_details' word must have had nothing to find
            prepared = schema_support.prepare(schema)
            # the compiler hands prepare() the schema's JSON text to copy from: the same result
            assert schema_support.prepare(schema, text=json.dumps(schema, ensure_ascii=False)) == prepared, name
            if not has_unsupported:
                seen["no unsupported"] += 1
                assert schema_support.unsupported(schema, "llguidance") == [], name
                assert schema_support.unsupported(prepared, "llguidance") == [], name
            if not ref_siblings:
                seen["no ref siblings"] += 1
                assert schema_support.prepare(schema, ref_siblings=False) == prepared, name
                # the targeted rewrite (only the marked subschemas): the full one up to annotations, in the same
                # key order, and the input untouched
                before = json.dumps(schema)
                *_, dirty = schema_support.scan_marks(schema)
                targeted = schema_support.prepare(schema, ref_siblings=False, dirty=dirty)
                assert json.dumps(strip_annotations(targeted)) == json.dumps(prepared), name
                assert json.dumps(schema) == before, name
                seen["targeted"] += 1
    assert all(seen.values()), seen  # the corpus exercises all three outcomes (and both skips)


@pytest.mark.parametrize("schema, want", [
    ({"type": "object", "title": "t", "properties": {"a": {"type": "string", "description": "d", "default": "x"}}},
     schema_support.SCAN_AS_IS),
    ({"type": "string", "format": "email"}, schema_support.SCAN_AS_IS),  # llguidance asserts it as is
    ({"type": "string", "format": "date"}, schema_support.SCAN_PREPARE),  # our exact regex replaces it
    ({"type": "string", "format": "made-up"}, schema_support.SCAN_PREPARE),  # dropped (an annotation)
    ({"type": "array", "maxItems": 2.0}, schema_support.SCAN_PREPARE),  # made an int (llguidance refuses 2.0)
    ({"type": "array", "items": [{"type": "string"}]}, schema_support.SCAN_PREPARE),  # tuple form
    ({"properties": {"a": {"oneOf": [{"type": "string"}, {"type": "integer"}]}}}, schema_support.SCAN_PREPARE),
    ({"$defs": {"x": {"not": {"type": "string"}}}}, schema_support.SCAN_PREPARE),
    ({"contentSchema": {"uniqueItems": True}}, schema_support.SCAN_PREPARE),
    ({"$schema": "http://json-schema.org/draft-07/schema#", "$ref": "#/definitions/a", "type": "string",
      "definitions": {"a": {}}}, schema_support.SCAN_PREPARE),  # draft 7 ignores $ref's siblings
    ({"$schema": "http://json-schema.org/draft-07/schema#", "$ref": "#/definitions/a", "description": "d",
      "definitions": {"a": {}}}, schema_support.SCAN_AS_IS),
    ({"type": "number", "multipleOf": -1}, schema_support.SCAN_INVALID),  # llguidance itself accepts this
    ({"allOf": []}, schema_support.SCAN_INVALID),  # and this
    ({"$defs": {"unused": {"type": "strng"}}}, schema_support.SCAN_INVALID),  # and this (never compiled)
    ({"items": {"minLength": -1}}, schema_support.SCAN_INVALID),
    ({"not": {"type": 5}}, schema_support.SCAN_INVALID),
])
def test_scan_cases(schema, want):
    assert schema_support.scan(schema) == want


@pytest.mark.parametrize("schema", [
    {"type": "number", "multipleOf": -1},
    {"allOf": []},
    {"type": "string", "$defs": {"unused": {"type": "strng"}}},
])
def test_schemas_llguidance_accepts_but_are_invalid_are_refused(compiler, schema):
    with pytest.raises(ConstraintError, match="at pointer"):
        compiler.compile(JsonSchema(schema))


def annotated_maskbench_schemas(n):
    out = []
    for path in sorted(MASKBENCH.glob("*.json")):
        item = json.loads(path.read_text())
        schema, valid = item["schema"], [t["data"] for t in item["tests"] if t["valid"]]
        text = json.dumps(schema)
        if valid and len(text) < 3000 and '"description"' in text and schema_support.scan(schema) == 0:
            out.append((path.name, schema, valid[0]))
            if len(out) == n:
                break
    return out


def test_annotations_do_not_change_llguidance_masks(compiler, ds_tokenizer, raw_lltokenizer):
    """Schemas the fast path hands to llguidance with their annotations: our masks along a valid instance equal a
    raw llguidance matcher's on the annotation-free schema, with the same JSON options."""
    mask, want = allocate_bitmask(1, DEEPSEEK_VOCAB), allocate_bitmask(1, DEEPSEEK_VOCAB)
    nbytes = want.shape[1] * 4
    cases = annotated_maskbench_schemas(4)
    assert len(cases) == 4
    for name, schema, value in cases:
        spec = JsonSchema(schema, whitespace="compact")
        ours = compiler.compile(spec).matcher()
        grammar = LLMatcher.grammar_from_json_schema(strip_annotations(schema), overrides=json_options(spec))
        raw = LLMatcher(raw_lltokenizer, grammar, log_level=0)
        assert not raw.is_error(), name
        for t in encode(ds_tokenizer, json.dumps(value, separators=(",", ":"), ensure_ascii=False)):
            ours.fill_mask(mask, 0)
            raw.unsafe_compute_mask_ptr(want.data_ptr(), nbytes)
            assert torch.equal(mask, want), name
            assert ours.accept(t) and raw.consume_token(t), name
