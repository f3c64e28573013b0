"""Constraint specs: what the user asks for, before compilation.

Specs are small frozen values. Each has a `cache_key()` (a string) so the compiler can cache compiled
constraints by (spec, tokenizer). Building a spec never compiles anything and costs microseconds, except
`JsonSchema`, which parses JSON text once to check it is a JSON object. A JsonSchema's JSON text in its own key
order (`layout_key()`: the compiler's cache key and the text llguidance parses) is made on first use, not at
construction: a compile with the cache off over a schema it rewrites never needs it (it encodes the rewrite
instead), and a schema that is not JSON (a value that does not serialize, a cycle, a lone surrogate) is refused
there, by compile(), with ConstraintError.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

WHITESPACE_MODES = ("bounded", "compact", "indented")
# Documented, opt-in approximations (never applied unless the user names them):
#   "oneOf-as-anyOf": accept instances matching one *or more* branches of a `oneOf`.
#   "ignore-format":  treat unknown/unsupported `format` values as plain strings.
APPROXIMATIONS = ("oneOf-as-anyOf", "ignore-format")
_APPROXIMATIONS = frozenset(APPROXIMATIONS)
# json.dumps(x, ensure_ascii=False) builds an encoder per call (half its cost for a typical schema); this one is reused
# (encode() keeps no state between calls, so threads can share it). No circular-reference bookkeeping (15% of the
# encode): a dict that contains itself ends in RecursionError, which JsonSchema reports like any bad schema.
_ENCODER = json.JSONEncoder(ensure_ascii=False, check_circular=False)


class ConstraintError(ValueError):
    """A constraint that cannot be compiled exactly. The message names what is wrong and where:
    a schema keyword with its JSON pointer, a grammar line, a regex position, a timeout."""


@dataclass(frozen=True)
class Regex:
    """The whole output must match `pattern` (full match, Rust/derivre regex syntax, no look-arounds)."""

    pattern: str

    def __post_init__(self):
        object.__setattr__(self, "pattern", _as_text(self.pattern, "regex pattern"))
        if not isinstance(self.pattern, str):
            raise ConstraintError(f"Regex pattern must be str, got {type(self.pattern).__name__}")
        _check_utf8(self.pattern, "regex pattern")

    def cache_key(self) -> str:
        return "regex:" + self.pattern


@dataclass(frozen=True)
class Grammar:
    """A context-free grammar. syntax="ebnf" (GBNF-style, `root ::= ...`) or "lark" (llguidance's Lark dialect)."""

    text: str
    syntax: str = "ebnf"

    def __post_init__(self):
        if self.syntax not in ("ebnf", "lark"):
            raise ConstraintError(f"Grammar syntax must be 'ebnf' or 'lark', got {self.syntax!r}")
        object.__setattr__(self, "text", _as_text(self.text, "grammar text"))
        if not isinstance(self.text, str):
            raise ConstraintError(f"Grammar text must be str, got {type(self.text).__name__}")
        _check_utf8(self.text, "grammar text")

    def cache_key(self) -> str:
        return f"grammar:{self.syntax}:" + self.text


@dataclass(frozen=True, init=False)  # (its own __init__: the fields set in one dict update, see below)
class JsonSchema:
    """A JSON value valid under a draft 2020-12 JSON Schema (dict, bool, or JSON text).

    whitespace: "bounded" (default: compact or pretty-printed output, but never more than one newline plus
    a bounded indent between tokens, so a model cannot loop on whitespace), "compact" (no whitespace at
    all: `{"a":1,"b":[2,3]}`) or "indented" (exactly `json.dumps(value, indent=indent)`'s layout).
    Object properties are emitted in the schema's `properties` order (the usual convention of every
    constrained-decoding engine); additional properties come after them.
    approximations: names from APPROXIMATIONS the user accepts; empty by default (exact or refused).
    """

    schema: Any
    whitespace: str = "bounded"
    indent: int = 2
    approximations: frozenset = frozenset()

    def __init__(self, schema: Any, whitespace: str = "bounded", indent: int = 2,
                 approximations: frozenset = frozenset()):
        # What dataclass's frozen __init__ + a __post_init__ would do, with one instance-dict update instead of a
        # call of object.__setattr__ per field (a compile with the cache off builds one spec per compile)
        if isinstance(schema, (bytes, bytearray)):
            try:
                schema = schema.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ConstraintError(f"JSON schema text is not UTF-8 (byte {e.start})") from None
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ConstraintError(f"JSON schema text is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
        if not isinstance(schema, (dict, bool)):
            raise ConstraintError(f"JSON schema must be an object or a boolean, got {type(schema).__name__} at pointer ''")
        if whitespace not in WHITESPACE_MODES:
            raise ConstraintError(f"whitespace must be one of {WHITESPACE_MODES}, got {whitespace!r}")
        approx = approximations
        if approx:
            approx = frozenset(approx)
            unknown = approx - _APPROXIMATIONS
            if unknown:
                raise ConstraintError(f"unknown approximations {sorted(unknown)}; known: {APPROXIMATIONS}")
        elif approx.__class__ is not frozenset:
            approx = frozenset()
        self.__dict__.update(schema=schema, whitespace=whitespace, indent=indent, approximations=approx,
                             _source=schema)  # _source: what cache_key() describes (kept by with_schema)

    @classmethod
    def from_model(cls, model_or_type, **kwargs) -> "JsonSchema":
        """JSON Schema of a pydantic model or any type pydantic's TypeAdapter understands."""
        import pydantic

        if isinstance(model_or_type, type) and issubclass(model_or_type, pydantic.BaseModel):
            schema = model_or_type.model_json_schema()
        else:
            schema = pydantic.TypeAdapter(model_or_type).json_schema()
        return cls(schema, **kwargs)

    def with_schema(self, schema) -> "JsonSchema":
        """The same spec over `schema`, an equivalent rewrite of this one (same valid instances): keeps this
        spec's options and cache key and skips validation (the compiler's prepared schema; ~2 µs)."""
        new = object.__new__(type(self))  # (its fields and cached keys copied as they are: ~5x cheaper than copy.copy)
        d = new.__dict__
        d.update(self.__dict__)
        d["schema"] = schema
        d.pop("_layout", None)
        return new

    def __hash__(self):  # the schema is a dict: hash the canonical text instead
        return hash(self.cache_key())

    def cache_key(self) -> str:
        """Equal for equal specs whatever the schema's key order (the canonical text: computed once, on first use)."""
        key = self.__dict__.get("_canonical")
        if key is None:
            approx = ",".join(sorted(self.approximations))
            try:
                text = json.dumps(self._source, sort_keys=True, ensure_ascii=False)
            except (TypeError, ValueError, RecursionError):  # keys that do not sort (e.g. int and str mixed): the
                text = _layout_text(self._source)  # text in its own order (not JSON at all: _layout_text says so)
            key = f"json:{self.whitespace}:{self.indent}:{approx}:" + text
            object.__setattr__(self, "_canonical", key)
        return key

    def layout_key(self) -> str:
        """The schema text in its own key order. Equal specs (same cache_key) can still differ in the order
        of `properties`, which sets the order properties are generated in, so the compiler caches by both."""
        text = self.__dict__.get("_layout")
        if text is None:
            text = _layout_text(self.schema)
            object.__setattr__(self, "_layout", text)
        return text

    def compile_key(self) -> str:
        """What the compiler caches by: the options and the schema text in its own order (determines the compile
        exactly; specs equal up to key order get separate entries). No canonical text needed (saves a sorted dump)."""
        approx = ",".join(sorted(self.approximations)) if self.approximations else ""
        return f"json:{self.whitespace}:{self.indent}:{approx}:" + self.layout_key()


@dataclass(frozen=True)
class Triggered:
    """Free text until `trigger_token_ids` appears (matched over token ids), then `inner` applies.

    If `bound_token_id` is given, sampling it commits to the trigger: the rest of the trigger is forced
    (if the bound token is part of the trigger, from just after it; otherwise the whole trigger).
    """

    inner: Any
    trigger_token_ids: tuple
    bound_token_id: int | None = None

    def __post_init__(self):
        ids = tuple(int(t) for t in self.trigger_token_ids)
        if not ids:
            raise ConstraintError("Triggered needs a non-empty trigger_token_ids")
        if isinstance(self.inner, Triggered) or not hasattr(self.inner, "cache_key"):
            raise ConstraintError(f"Triggered.inner must be a Regex, JsonSchema or Grammar, got {type(self.inner).__name__}")
        object.__setattr__(self, "trigger_token_ids", ids)

    def cache_key(self) -> str:
        return f"triggered:{list(self.trigger_token_ids)}:{self.bound_token_id}:" + self.inner.cache_key()

    def layout_key(self) -> str:
        return self.inner.layout_key() if hasattr(self.inner, "layout_key") else ""

    def compile_key(self) -> str:
        inner = self.inner.compile_key() if hasattr(self.inner, "compile_key") else self.inner.cache_key()
        return f"triggered:{list(self.trigger_token_ids)}:{self.bound_token_id}:" + inner


def _layout_text(schema) -> str:
    """The schema as JSON text in its own key order; ConstraintError if it is not JSON (a value that does not
    serialize, a cycle, a lone surrogate)."""
    try:
        text = _ENCODER.encode(schema)
    except (TypeError, ValueError) as e:
        raise ConstraintError(f"JSON schema is not JSON-serializable: {e}") from None
    except RecursionError:
        raise ConstraintError("JSON schema is nested too deeply (or contains itself)") from None
    _check_utf8(text, "JSON schema")
    return text


def _check_utf8(text: str, what: str) -> None:
    # Lone surrogates (e.g. from decoding bytes with surrogateescape) cannot be encoded as UTF-8.
    if text.isascii():  # the common case, without building the encoded copy
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConstraintError(f"{what} is not valid UTF-8: character {e.start} ({text[e.start]!r})") from None


def _as_text(value, what: str):
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConstraintError(f"{what} is not valid UTF-8: bad byte 0x{value[e.start]:02x} at offset {e.start}") from None
    return value
