"""Typed outputs: a Python type in, a JSON Schema constraint out, and the generated text parsed back.

    spec = constraint_for_type(Invoice)          # JsonSchema spec, enforced token by token while decoding
    value, error = parse_output(Invoice, text)   # (Invoice(...), None) or (None, {"type": ..., ...})

Any type pydantic's `TypeAdapter` understands works: pydantic v2 models, dataclasses, TypedDict, list[...],
Literal, Enum, unions, Optional, nested and recursive models. The schema is the one pydantic emits
(`mode="validation"`), so field constraints (pattern, min/max length, ranges, formats, bounded lists) are part
of the grammar, not only checked afterwards. Building an adapter costs about a millisecond; adapters are cached.
"""
from __future__ import annotations

import functools
import json
from typing import Any

import pydantic


@functools.lru_cache(maxsize=256)
def _adapter(tp) -> pydantic.TypeAdapter:
    return pydantic.TypeAdapter(tp)


def _adapter_for(tp) -> pydantic.TypeAdapter:
    try:
        return _adapter(tp)
    except TypeError:  # unhashable type expressions: build one each time
        return pydantic.TypeAdapter(tp)


def json_schema_for_type(tp, closed: bool = True) -> dict:
    """The JSON Schema pydantic emits for `tp` (validation mode, with `$defs` for nested/recursive models).

    closed=True adds `"additionalProperties": false` to every object schema that declares `properties` and
    says nothing about extra keys (pydantic's default `extra="ignore"` models, dataclasses, TypedDicts): the
    output may then only hold the declared fields, a strict subset of what pydantic accepts, and the model
    cannot wander into made-up keys. Models with `extra="allow"` say `additionalProperties: true` and stay open.
    """
    try:
        schema = _adapter_for(tp).json_schema(mode="validation")
    except pydantic.errors.PydanticUserError as e:
        raise TypeError(f"cannot build a JSON Schema for {tp!r}: {e}") from None
    except pydantic.errors.PydanticSchemaGenerationError as e:
        raise TypeError(f"cannot build a JSON Schema for {tp!r}: {e}") from None
    return _close_objects(schema) if closed else schema


_NAME_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


def _close_objects(node):
    """Recurse through schema positions only (the values of name->schema maps, never the maps themselves)."""
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if k in _NAME_MAPS and isinstance(v, dict):
                out[k] = {name: _close_objects(sub) for name, sub in v.items()}
            elif k in ("enum", "const", "default", "examples", "required"):
                out[k] = v
            else:
                out[k] = _close_objects(v)
        if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [_close_objects(v) for v in node]
    return node


def constraint_for_type(tp, **json_schema_options):
    """A `JsonSchema` constraint spec for `tp`; extra keyword arguments go to `JsonSchema` (e.g. whitespace)."""
    try:
        from deepinfer_sg.grammars import JsonSchema
    except ImportError:  # the package __init__ may not re-export it yet
        from deepinfer_sg.grammars.specs import JsonSchema

    return JsonSchema(json_schema_for_type(tp), **json_schema_options)


def parse_output(tp, text) -> tuple[Any, dict | None]:
    """Parse and validate generated `text` as `tp`. Never raises.

    Returns (value, None) on success, or (None, error) where error is a dict:
      {"type": "invalid_json", "message", "position", "text"}      -- not JSON (e.g. cut off by max_tokens)
      {"type": "validation_error", "errors": [{"loc", "msg", "type"}...], "text"}  -- JSON, but not a valid `tp`
      {"type": "internal_error", "message", "text"}                 -- anything else (bad type, decode failure)
    """
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8", errors="replace")
    if not isinstance(text, str):
        return None, {"type": "internal_error", "message": f"expected text, got {type(text).__name__}", "text": None}
    try:
        adapter = _adapter_for(tp)
    except Exception as e:  # noqa: BLE001 - the contract is "never raises"
        return None, {"type": "internal_error", "message": f"cannot build a validator for {tp!r}: {e}", "text": text}
    try:
        json.loads(text)
    except json.JSONDecodeError as e:
        return None, {"type": "invalid_json", "message": e.msg, "position": e.pos, "text": text}
    except (RecursionError, ValueError) as e:
        return None, {"type": "invalid_json", "message": str(e), "position": None, "text": text}
    try:
        return adapter.validate_json(text), None
    except pydantic.ValidationError as e:
        errors = [{"loc": list(err.get("loc", ())), "msg": err.get("msg", ""), "type": err.get("type", "")}
                  for err in e.errors(include_url=False)]
        return None, {"type": "validation_error", "errors": errors, "text": text}
    except Exception as e:  # noqa: BLE001
        return None, {"type": "internal_error", "message": f"{type(e).__name__}: {e}", "text": text}
