"""Typed outputs: pydantic's JSON Schema for many kinds of types, enforced by the project's compiled
matchers (random walks over the real vocabulary), then parsed back; jsonschema is the independent judge."""
import dataclasses
import enum
import json
import random
from typing import Literal, Optional, Union

import jsonschema
import pytest
from pydantic import BaseModel, Field, conlist
from typing_extensions import TypedDict  # pydantic needs this one on Python < 3.12

from deepinfer_sg.grammars import JsonSchema
from deepinfer_sg.typed import constraint_for_type, json_schema_for_type, parse_output
from frontdoor_helpers import walk_spec


class Color(str, enum.Enum):
    red = "red"
    green = "grün"


class Priority(enum.IntEnum):
    low = 1
    high = 2


class Address(BaseModel):
    street: str = Field(max_length=20)
    city: str = Field(min_length=1, max_length=12)
    zip: str = Field(pattern=r"^[0-9]{5}$")


class LineItem(BaseModel):
    sku: str = Field(pattern=r"^[A-Z]{3}-[0-9]{3}$")
    qty: int = Field(ge=1, le=99)
    price: float = Field(ge=0)


class Invoice(BaseModel):
    number: str = Field(max_length=10)
    customer: Address
    items: list[LineItem] = Field(min_length=1, max_length=2)
    currency: Literal["EUR", "USD", "¥"]
    note: Optional[str] = Field(default=None, max_length=8)
    paid: bool = False


class Tree(BaseModel):
    label: str = Field(max_length=6)
    children: list["Tree"] = Field(default_factory=list, max_length=2)


@dataclasses.dataclass
class Point:
    x: int
    y: int = 0


class Movie(TypedDict):
    title: str
    year: int


class Tagged(BaseModel):
    kind: Color
    prio: Priority
    value: Union[int, str]
    naïve_ünïcode: str = Field(max_length=5)


TYPES = [Invoice, Tree, Point, Movie, Tagged, conlist(int, min_length=1, max_length=3), Literal["a", "b"],
         Color, Optional[Point], Union[Point, Movie], list[Address]]


@pytest.mark.parametrize("tp", TYPES, ids=lambda t: getattr(t, "__name__", str(t))[:30])
def test_walks_parse_into_the_type(tp):
    spec = constraint_for_type(tp)
    assert isinstance(spec, JsonSchema)
    schema = json_schema_for_type(tp)
    rng = random.Random(1)
    finished = 0
    for _ in range(3):
        text = walk_spec(spec, rng, max_steps=300)
        if text is None:
            continue
        finished += 1
        jsonschema.validate(json.loads(text), schema)     # independent: the schema pydantic emitted
        value, err = parse_output(tp, text)
        assert err is None, (text, err)
        assert value is not None or text == "null"
    assert finished >= 1


def test_field_constraints_are_in_the_schema():
    schema = json_schema_for_type(Invoice)
    line = schema["$defs"]["LineItem"]["properties"]
    assert line["sku"]["pattern"] == "^[A-Z]{3}-[0-9]{3}$" and line["qty"]["maximum"] == 99
    assert schema["properties"]["items"]["maxItems"] == 2


def test_parse_output_errors_never_raise():
    v, e = parse_output(Invoice, '{"number": "1"')
    assert v is None and e["type"] == "invalid_json" and e["position"] == 14
    v, e = parse_output(LineItem, '{"sku": "abc", "qty": 0, "price": 1}')
    assert v is None and e["type"] == "validation_error"
    assert {tuple(x["loc"]) for x in e["errors"]} == {("sku",), ("qty",)}
    v, e = parse_output(Point, None)
    assert v is None and e["type"] == "internal_error"
    v, e = parse_output(Point, b'{"x": 1}')
    assert v == Point(1, 0) and e is None
    v, e = parse_output(Tree, '{"label": "r", "children": [{"label": "ü"}]}')
    assert e is None and v.children[0].label == "ü"
    v, e = parse_output(Color, '"grün"')
    assert v is Color.green


def test_unsupported_type_is_a_clear_error():
    with pytest.raises(TypeError, match="cannot build a JSON Schema"):
        json_schema_for_type(object())


def test_closing_objects_touches_schemas_only():
    from pydantic import ConfigDict

    class Odd(BaseModel):
        properties: int
        additionalProperties: str = "x"

    class Open(BaseModel):
        model_config = ConfigDict(extra="allow")
        odd: Odd

    schema = json_schema_for_type(Open)
    odd = schema["$defs"]["Odd"]
    assert set(odd["properties"]) == {"properties", "additionalProperties"}  # field names left alone
    assert odd["additionalProperties"] is False and schema["additionalProperties"] is True
    jsonschema.validate({"odd": {"properties": 1}, "extra": 2}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"odd": {"properties": 1, "made_up": 2}}, schema)
    assert json_schema_for_type(Open, closed=False)["$defs"]["Odd"].get("additionalProperties") is None
