"""Checking a compiled constraint against JSON instances: serialize an instance the ways a constraint's
whitespace and property-order rules allow, tokenize with the real tokenizer, and walk the matcher.

Used by the tests and benchmarks (MaskBench, JSON-Schema-Test-Suite); costs one matcher walk per text
(tens of µs per token).
"""
from __future__ import annotations

import json
import re

from .schema_support import resolve_ref


def serializations(value, whitespace: str, schema=None, indent: int = 2, integral_as_int: bool = True) -> list:
    """Texts of `value` a constraint with this whitespace mode must accept if `value` is valid: compact
    and (unless compact) pretty-printed; each in the instance's own key order and in schema order; and
    with integral floats written as integers (integral_as_int: only for valid instances, since draft-04
    calls 1.0 a non-integer, so rewriting an invalid 1.0 as 1 could make it valid)."""
    values = [value]
    integral = _integral_floats_as_ints(value) if integral_as_int else value
    if json.dumps(integral) != json.dumps(value):
        values.append(integral)  # 75.0 is the integer 75 in JSON Schema; an integer grammar writes "75"
    if schema is not None:
        for v in list(values):
            ordered = order_like_schema(v, schema, schema)
            if json.dumps(ordered) != json.dumps(v):
                values.append(ordered)
    out = []
    for v in values:
        if whitespace == "compact":
            out.append(json.dumps(v, separators=(",", ":"), ensure_ascii=False))
        elif whitespace == "indented":
            out.append(json.dumps(v, indent=indent, ensure_ascii=False))
        else:
            out.append(json.dumps(v, separators=(",", ":"), ensure_ascii=False))
            out.append(json.dumps(v, indent=indent, ensure_ascii=False))
    return out


def _integral_floats_as_ints(value):
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    if isinstance(value, list):
        return [_integral_floats_as_ints(v) for v in value]
    if isinstance(value, dict):
        return {k: _integral_floats_as_ints(v) for k, v in value.items()}
    return value


def accepts_text(matcher, tokenizer, text: str, eos_token_id: int) -> bool:
    """True if the matcher accepts the tokens of `text` and then EOS (and so terminates)."""
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    for t in ids:
        if not matcher.accept(t):
            return False
    return matcher.accept(eos_token_id) and matcher.is_terminated()


def order_like_schema(value, schema, root):
    """`value` with object keys in the order the schema declares properties (declared first, others after)."""
    schema = _pick_branch(_resolve(schema, root), value, root)
    if isinstance(value, dict) and isinstance(schema, dict):
        names = _property_names(schema, root, depth=0)
        # llguidance's layout: declared properties in schema order, then required-but-undeclared
        # ones in `required` order, then any other additional properties
        required = [k for k in _required_names(schema, root) if k not in names]
        names = names + required
        keys = [k for k in names if k in value] + [k for k in value if k not in names]
        return {k: order_like_schema(value[k], _property_schema(schema, k, root), root) for k in keys}
    if isinstance(value, list) and isinstance(schema, dict):
        prefix = schema.get("prefixItems", [])
        items = schema.get("items", {})
        return [order_like_schema(v, prefix[i] if i < len(prefix) else items, root) for i, v in enumerate(value)]
    return value


def _pick_branch(schema, value, root):
    """For an anyOf/oneOf without own properties/items, the branch that best fits value (type, then
    matching const/enum discriminators, then most shared property names)."""
    if not isinstance(schema, dict) or "properties" in schema or "items" in schema:
        return schema
    kind = {dict: "object", list: "array"}.get(type(value))
    if kind is None:
        return schema
    best, best_score = schema, -1
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key, []) or []:
            sub = _resolve(sub, root)
            if not isinstance(sub, dict):
                continue
            t = sub.get("type")
            if not (t == kind or (isinstance(t, list) and kind in t) or (t is None and ("properties" in sub) == (kind == "object"))):
                continue
            score = 0
            if kind == "object":
                props = sub.get("properties") or {}
                score = sum(k in props for k in value)
                for k, p in props.items():
                    p = _resolve(p, root)
                    if isinstance(p, dict) and k in value and ("const" in p or "enum" in p):
                        score += 100 if value[k] in ([p["const"]] if "const" in p else p["enum"]) else -100
            if score > best_score:
                best, best_score = sub, score
    return best


def _resolve(schema, root, depth=0):
    while isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and depth < 32:
        target = resolve_ref(schema["$ref"], root)
        if target is None:
            return schema
        schema, depth = target, depth + 1
    return schema


def _property_names(schema, root, depth) -> list:
    schema = _resolve(schema, root)
    if not isinstance(schema, dict) or depth > 8:
        return []
    names = list(schema.get("properties", {}) or {})
    for key in ("allOf", "anyOf", "oneOf"):
        for sub in schema.get(key, []) or []:
            names += [n for n in _property_names(sub, root, depth + 1) if n not in names]
    return names


def _required_names(schema, root, depth=0) -> list:
    schema = _resolve(schema, root)
    if not isinstance(schema, dict) or depth > 8:
        return []
    names = list(schema.get("required", []) or [])
    for sub in schema.get("allOf", []) or []:
        names += [n for n in _required_names(sub, root, depth + 1) if n not in names]
    return names


def _property_schema(schema, name, root):
    schema = _resolve(schema, root)
    if not isinstance(schema, dict):
        return {}
    props = schema.get("properties", {}) or {}
    if name in props:
        return props[name]
    for pattern, sub in (schema.get("patternProperties") or {}).items():
        try:
            if re.search(pattern, name):
                return sub
        except re.error:
            pass
    for key in ("allOf", "anyOf", "oneOf"):
        for sub in schema.get(key, []) or []:
            sub = _resolve(sub, root)
            if isinstance(sub, dict) and name in (sub.get("properties") or {}):
                return sub["properties"][name]
    extra = schema.get("additionalProperties")
    return extra if isinstance(extra, dict) else {}


def run_cases(compiler, schema, cases, whitespace: str = "bounded") -> dict:
    """Compile `schema` and check each case {"data", "valid"}.

    Returns {"refused": error text or None, "backend": name, "outcomes": [per case: "pass",
    "false_negative" (valid instance rejected), "false_positive" (invalid instance accepted) or
    "runtime_refused" (the matcher raised ConstraintError on the way: the constraint compiled but
    refused this text, e.g. llguidance's lexer ran out of fuel)], "runtime_errors": [messages]}.
    A valid case passes if some serialization is accepted; an invalid one if none can terminate.
    """
    from .specs import ConstraintError, JsonSchema

    try:
        compiled = compiler.compile(JsonSchema(schema, whitespace=whitespace))
    except ConstraintError as e:
        return {"refused": str(e), "backend": None, "outcomes": []}
    tok = compiler.vocab.tokenizer
    eos = compiler.vocab.eos_token_ids[0]
    outcomes, runtime_errors = [], []
    for case in cases:
        texts = serializations(case["data"], whitespace, schema if isinstance(schema, dict) else None,
                               integral_as_int=case["valid"])
        try:
            accepted = any(accepts_text(compiled.matcher(), tok, t, eos) for t in texts)
        except ConstraintError as e:
            outcomes.append("runtime_refused")
            runtime_errors.append(str(e))
            continue
        if accepted == case["valid"]:
            outcomes.append("pass")
        else:
            outcomes.append("false_negative" if case["valid"] else "false_positive")
    return {"refused": None, "backend": compiled.backend, "outcomes": outcomes, "runtime_errors": runtime_errors}
