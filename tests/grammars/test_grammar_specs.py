"""Spec values: equal specs share a cache key and a hash, whatever form the schema came in."""
import enum
from typing import Literal

import jsonschema

from deepinfer_sg.grammars import JsonSchema, Regex, Triggered


def test_schema_text_and_dict_are_the_same_spec():
    a = JsonSchema({"type": "object", "properties": {"x": {"type": "integer"}}})
    b = JsonSchema('{"properties": {"x": {"type": "integer"}}, "type": "object"}')
    assert a == b and hash(a) == hash(b) and a.cache_key() == b.cache_key()
    assert JsonSchema(a.schema, whitespace="compact").cache_key() != a.cache_key()
    assert len({a, b, Triggered(a, [5, 6]), Triggered(b, [5, 6])}) == 2
    assert Regex("a+") == Regex(b"a+")


def test_from_model_types():
    class Color(enum.Enum):
        RED = "red"
        BLUE = "blue"

    spec = JsonSchema.from_model(list[Literal["a", "b"] | Color])
    # oracle: jsonschema on pydantic's own schema
    v = jsonschema.Draft202012Validator(spec.schema)
    assert v.is_valid(["a", "red"]) and not v.is_valid(["c"])
