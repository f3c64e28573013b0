"""Which JSON Schema keywords each backend implements exactly, and exact rewrites that widen support.

`walk(schema)` yields every (keyword, JSON pointer, value) of every subschema. `prepare(schema, ...)`
returns an equivalent schema that llguidance accepts more often (rewrites that keep the set of valid
instances identical: annotation-only keywords dropped, no-op assertions dropped, `dependentRequired`
expanded, `unevaluated*` without applicators turned into `additional*`/`items`). `unsupported(schema,
backend)` lists the keywords a backend would ignore or get wrong, with pointers, so `backend="auto"`
can pick one that is exact or refuse with a ConstraintError naming the keyword.
Cost: linear in the schema size (a walk per call).
"""
from __future__ import annotations

import json

from .specs import ConstraintError

# Subschema-holding keywords: value is a schema, a list of schemas, or a map name -> schema.
# (frozensets: every walk tests each key of each subschema against them, ~10x cheaper than tuple scans)
SCHEMA_KEYS = frozenset({"additionalProperties", "items", "contains", "not", "if", "then", "else", "propertyNames",
                         "unevaluatedItems", "unevaluatedProperties", "contentSchema", "additionalItems"})
SCHEMA_LIST_KEYS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems"})
SCHEMA_MAP_KEYS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
_SUBSCHEMA_KEYS = SCHEMA_KEYS | SCHEMA_LIST_KEYS  # a schema or a list of schemas
_MAP_OR_DEPENDENCIES = SCHEMA_MAP_KEYS | {"dependencies"}  # name -> schema (dependencies: -> schema or names)

# Keywords with no effect on validity (draft 2020-12 annotations, and `format` values nobody asserts).
ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
               "writeOnly", "$schema", "contentMediaType", "contentEncoding", "contentSchema", "$vocabulary"}

# Formats the backends assert. Under draft 2020-12's default vocabulary `format` is an annotation; we
# assert the ones a backend implements and drop others (exactly what the spec says a validator may do).
LLG_FORMATS = {"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri"}

# xgrammar (strict_mode=False) keywords we trust to be exact. Deliberately excluded, from its known bugs:
# pattern (full-match instead of search, xgrammar#838), min/maxLength (rejects escapes, xgrammar#800),
# format (drops pattern), allOf (partial), oneOf (becomes anyOf), multipleOf on numbers, and all
# keywords it ignores (not, if/then/else, uniqueItems, contains, dependent*, unevaluated*).
XGR_EXACT = {"type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems",
             "maxItems", "enum", "const", "anyOf", "$ref", "$defs", "definitions", "minimum", "maximum",
             "exclusiveMinimum", "exclusiveMaximum"} | ANNOTATIONS | {"$id"}

# outlines-core: a schema is one regex; numeric ranges and most assertions are dropped silently.
OUTLINES_EXACT = {"type", "properties", "required", "enum", "const", "items", "$defs", "definitions"} | ANNOTATIONS


def walk(schema, pointer: str = ""):
    """Yield (keyword, pointer_of_keyword, value) for every keyword in every subschema (document order)."""
    for key, value, path in keywords(schema):
        yield key, pointer + to_pointer(path), value


def keywords(schema) -> list:
    """[(keyword, value, path)] for every keyword in every subschema, in document order. `path` is a linked
    list (last step, (previous step, ...)); `to_pointer(path)` turns it into a JSON pointer only where one
    is needed (error messages), which makes this ~3x cheaper than building every pointer."""
    out: list = []
    _collect(schema, None, out)
    return out


def _collect(node, path, out) -> None:
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        here = (key, path)
        out.append((key, value, here))
        if key in SCHEMA_KEYS:
            if isinstance(value, list):  # draft 4-7 tuple `items` (and malformed values: nothing to walk)
                for i, sub in enumerate(value):
                    _collect(sub, (i, here), out)
            else:
                _collect(value, here, out)
        elif key in SCHEMA_LIST_KEYS:
            if isinstance(value, list):
                for i, sub in enumerate(value):
                    _collect(sub, (i, here), out)
        elif key in _MAP_OR_DEPENDENCIES:
            if isinstance(value, dict):
                for name, sub in value.items():
                    _collect(sub, (name, here), out)


def to_pointer(path) -> str:
    """JSON pointer of a `keywords()` path."""
    parts = []
    while path is not None:
        parts.append(_escape(path[0]))
        path = path[1]
    return "/" + "/".join(reversed(parts)) if parts else ""


def _escape(name: str) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")


def find_keyword(schema, keyword: str):
    """JSON pointer of the first occurrence of `keyword`, or None."""
    for key, pointer, _ in walk(schema):
        if key == keyword:
            return pointer
    return None


# Assertion keywords llguidance does not implement. llguidance refuses most of them, but silently
# ignores some when the schema declares an older draft (e.g. `dependentSchemas` under draft-07), so we
# refuse them ourselves, before llguidance sees the schema.
LLG_UNSUPPORTED = {"not", "if", "then", "else", "contains", "minContains", "maxContains", "uniqueItems",
                   "unevaluatedItems", "unevaluatedProperties", "dependentSchemas", "dependentRequired",
                   "dependencies", "propertyNames", "$dynamicRef", "$dynamicAnchor", "$recursiveRef",
                   "$recursiveAnchor", "additionalItems"}


def unsupported(schema, backend: str) -> list:
    """[(keyword, pointer)] the backend would not implement exactly (empty list = exact)."""
    if backend == "llguidance":
        return [(key, to_pointer(path)) for key, _, path in keywords(schema) if key in LLG_UNSUPPORTED]
    allowed = {"xgrammar": XGR_EXACT, "outlines": OUTLINES_EXACT}[backend]
    out = []
    for key, pointer, value in walk(schema):
        if key.startswith("x-"):
            continue
        if key not in allowed:
            out.append((key, pointer))
        elif key == "$ref" and not (isinstance(value, str) and value.startswith("#")):
            out.append((key, pointer))
        elif key == "$id" and pointer != "/$id":
            out.append((key, pointer))
        elif key == "type" and backend == "outlines" and value in ("number", "integer"):
            pass
    return out


def prepare(schema, approximations=frozenset(), ref_siblings: bool = True, text: str | None = None,
            dirty: set | None = None):
    """An equivalent schema (same valid instances) that backends support more often; never loosens.
    ref_siblings=False: the caller knows (scan_details) that no draft 4-7 `$ref` has siblings (skips that walk).
    text: the schema as JSON text, if the caller has it (JsonSchema.layout_key()): the working copy is then parsed
    from it (C speed, ~40% less than copying the dict in Python).
    dirty (with ref_siblings=False): scan_marks()' set of the subschemas with something to rewrite at or below
    them; only those are copied and rewritten, the rest is shared with `schema` (never written) and keeps its
    annotations, which llguidance ignores: the result equals the full rewrite up to annotations."""
    if isinstance(schema, bool):
        return schema
    if dirty is not None and not ref_siblings and id(schema) in dirty:
        root = dict(schema)
        return _rewrite_marked(schema, dirty, "ignore-format" in approximations, root, root)
    schema = _copy_json(schema) if text is None else json.loads(text)
    declared = str(schema.get("$schema", ""))
    if ref_siblings and any(d in declared for d in ("draft-04", "draft-06", "draft-07")):
        _drop_ref_siblings(schema)
    _rewrite(schema, "ignore-format" in approximations, schema)
    return schema


def _copy_json(value):
    """Deep copy of JSON data (dicts and lists; leaves are immutable): ~2.5x faster than copy.deepcopy."""
    if isinstance(value, dict):
        return {k: _copy_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_copy_json(v) for v in value]
    return value


def _drop_ref_siblings(s) -> None:
    """Drafts 4-7: keywords beside `$ref` are ignored. Keep only the ref (and definitions, which other
    refs may point into), so the 2020-12 reading the backends use means the same."""
    if isinstance(s, list):
        for sub in s:
            _drop_ref_siblings(sub)
        return
    if not isinstance(s, dict):
        return
    for key, value in list(s.items()):
        if key in _SUBSCHEMA_KEYS:
            _drop_ref_siblings(value)
        elif key in _MAP_OR_DEPENDENCIES and isinstance(value, dict):
            for sub in value.values():
                _drop_ref_siblings(sub)
    if "$ref" in s:
        for key in [k for k in s if k not in ("$ref", "definitions", "$defs", "$schema", "$id", "id")]:
            del s[key]


def _rewrite(s, ignore_format: bool, root) -> None:
    if isinstance(s, list):
        for sub in s:
            _rewrite(sub, ignore_format, root)
        return
    if isinstance(s, dict):
        _rewrite_node(s, ignore_format, root)


def _rewrite_node(s: dict, ignore_format: bool, root) -> None:
    """_rewrite of one subschema (a plain dict: prepare's working copy holds only plain dicts and lists), its
    subschemas first; children that are not dicts are looked at only where they are (no call per leaf)."""
    for key, value in s.items():  # (children are rewritten in place; this node's keys change only below)
        if key in _SUBSCHEMA_KEYS:
            if value.__class__ is dict:
                _rewrite_node(value, ignore_format, root)
            elif value.__class__ is list:
                for sub in value:
                    if sub.__class__ is dict:
                        _rewrite_node(sub, ignore_format, root)
        elif key in _MAP_OR_DEPENDENCIES and value.__class__ is dict:
            for sub in value.values():
                if sub.__class__ is dict:
                    _rewrite_node(sub, ignore_format, root)
    _rewrite_local(s, ignore_format, root)


def _rewrite_marked(node: dict, dirty: set, ignore_format: bool, root, s: dict | None = None) -> dict:
    """prepare()'s rewrite of a subschema scan_marks() marked (it or a subschema below it has something to
    rewrite), as a new dict: its marked subschemas rewritten the same way first, the others shared with the
    input, unchanged (their annotations kept: llguidance ignores them). The containers the local rules change in
    place (schema lists and maps, dependentRequired) are new here, so the input is never written. `root` is the
    new top-level dict (its $refs resolve to rewritten subschemas where the full walk's would); `s`: the copy of
    `node` to fill (the root's, made first), else a new one."""
    if s is None:
        s = dict(node)
    for key, value in s.items():
        if key in _SUBSCHEMA_KEYS:
            if value.__class__ is dict:
                if id(value) in dirty:
                    s[key] = _rewrite_marked(value, dirty, ignore_format, root)
            elif value.__class__ is list:
                s[key] = [_rewrite_marked(sub, dirty, ignore_format, root) if id(sub) in dirty else sub
                          for sub in value]
        elif key in _MAP_OR_DEPENDENCIES and value.__class__ is dict:
            s[key] = {name: _rewrite_marked(sub, dirty, ignore_format, root) if id(sub) in dirty else sub
                      for name, sub in value.items()}
        elif key == "dependentRequired" and value.__class__ is dict:
            s[key] = dict(value)
    _rewrite_local(s, ignore_format, root)
    return s


def _rewrite_local(s: dict, ignore_format: bool, root) -> None:
    """The rewrite rules of one subschema, its subschemas already rewritten."""
    keys = s.keys()
    if not keys.isdisjoint(ANNOTATIONS):
        for key in keys & _DROPPED_ANNOTATIONS:  # (the order of deletion does not change the dict's order)
            del s[key]
    if keys.isdisjoint(_REWRITTEN_KEYS_BUT_ONE_OF) and not isinstance(s.get("items"), list):
        if "oneOf" in keys:  # (a node whose only rewrite is its oneOf: the rules below all pass it by)
            _one_of_as_any_of(s, root)
        return  # most nodes: nothing below applies (saves ~20 dict operations per node)
    for key in _NONNEG_INT_KEYS & keys:
        if isinstance(s[key], float) and s[key] == int(s[key]):
            s[key] = int(s[key])  # `maxItems: 2.0` means 2; llguidance would not apply a float bound
    if s.get("uniqueItems") is False:
        del s["uniqueItems"]
    fmt = s.get("format")
    if fmt in FORMAT_PATTERNS:
        # our exact regex instead of the backend's looser one (leap years, hostname label rules)
        del s["format"]
        if "pattern" in s:
            s.setdefault("allOf", []).append({"pattern": FORMAT_PATTERNS[fmt]})
        else:
            s["pattern"] = FORMAT_PATTERNS[fmt]
        if fmt == "hostname":
            s["maxLength"] = min(253, s.get("maxLength", 253))
    elif isinstance(fmt, str) and fmt not in LLG_FORMATS and (ignore_format or fmt not in _KNOWN_FORMATS):
        # unknown formats are annotations in 2020-12; known-but-unasserted ones only with "ignore-format"
        del s["format"]
    if s.get("minContains") == 0 and "contains" in s and "maxContains" not in s:
        del s["minContains"], s["contains"]
    if isinstance(s.get("dependencies"), dict):
        # draft 7: array values are dependentRequired, schema values dependentSchemas
        deps = s.pop("dependencies")
        required = {k: v for k, v in deps.items() if isinstance(v, list)}
        schemas = {k: v for k, v in deps.items() if not isinstance(v, list)}
        if required:
            s.setdefault("dependentRequired", {}).update(required)
        if schemas:
            s.setdefault("dependentSchemas", {}).update(schemas)
    n_deps = len(s.get("dependentSchemas") or {}) + len(s.get("dependentRequired") or {})
    if n_deps > MAX_DEPENDENT_CLAUSES:
        return  # left in place: refused below (llguidance mis-handles many intersected anyOf clauses)
    if isinstance(s.get("dependentSchemas"), dict):
        # "if `name` is present, the object must also match S" == (name absent) or S; non-objects pass both
        deps = s.pop("dependentSchemas")
        clauses = [{"anyOf": [{"properties": {name: False}}, sub]} for name, sub in deps.items() if sub is not True and sub != {}]
        if clauses:
            s.setdefault("allOf", []).extend(clauses)
    if isinstance(s.get("items"), list):
        # draft 4-7 tuple form -> 2020-12: items[] is prefixItems, additionalItems is items
        s["prefixItems"] = s.pop("items")
        if "additionalItems" in s:
            s["items"] = s.pop("additionalItems")
    else:
        s.pop("additionalItems", None)  # without a tuple `items` it asserts nothing
    if "dependentRequired" in s:
        deps = s.pop("dependentRequired")
        clauses = [{"anyOf": [{"properties": {name: False}}, {"required": [name] + list(req)}]}
                   for name, req in deps.items() if req]
        if clauses:
            s.setdefault("allOf", []).extend(clauses)
    if "unevaluatedProperties" in s and keys.isdisjoint(_APPLICATORS) and "additionalProperties" not in s:
        s["additionalProperties"] = s.pop("unevaluatedProperties")
    if "unevaluatedItems" in s and keys.isdisjoint(_APPLICATORS) and "items" not in s and "contains" not in s:
        s["items"] = s.pop("unevaluatedItems")
    if "if" in s and "then" not in s and "else" not in s:
        del s["if"]  # `if` alone asserts nothing
    if "if" not in s:
        s.pop("then", None), s.pop("else", None)  # `then`/`else` without `if` assert nothing
    if "not" in s:
        negated = _negate(s["not"], root)
        if negated is not None:
            del s["not"]
            s.setdefault("allOf", []).append(negated)
    _one_of_as_any_of(s, root)


def _one_of_as_any_of(s: dict, root) -> None:
    """A `oneOf` whose branches are pairwise disjoint becomes an `anyOf` (no instance can match two branches, so
    "exactly one" == "at least one")."""
    if isinstance(s.get("oneOf"), list) and _pairwise_disjoint(s["oneOf"], root):
        branches = s.pop("oneOf")
        if "anyOf" in s:
            s.setdefault("allOf", []).append({"anyOf": branches})
        else:
            s["anyOf"] = branches


_DROPPED_ANNOTATIONS = frozenset(ANNOTATIONS - {"$schema"})  # prepare() keeps `$schema` (the draft it names)
# Keywords that evaluate properties/items in place: with any of them beside `unevaluated*`, it is not plain
# `additional*`/`items`.
_APPLICATORS = frozenset({"allOf", "anyOf", "oneOf", "$ref", "if", "dependentSchemas", "$dynamicRef", "not"})
# The keys _rewrite() acts on beyond annotations (a node with none of them, and no tuple-form `items`, is left as is).
_REWRITTEN_KEYS_BUT_ONE_OF = frozenset({
    "minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties", "minContains", "maxContains",
    "uniqueItems", "format", "contains", "dependencies", "dependentSchemas", "additionalItems", "dependentRequired",
    "unevaluatedProperties", "unevaluatedItems", "if", "then", "else", "not"})


# Exact regexes (RFC 3339 dates with leap years; RFC 1123 host names) for formats where a backend's own
# check is looser than the RFC. Leap seconds are accepted only at 23:59:60 UTC (Z or +/-00:00): a leap
# second written with another offset is refused (a false negative, never a false positive).
_DATE = (r"([0-9]{4}-((0[1-9]|1[0-2])-(0[1-9]|1[0-9]|2[0-8])|(0[13-9]|1[0-2])-(29|30)|(0[13578]|1[02])-31)"
         r"|([0-9]{2}(0[48]|[2468][048]|[13579][26])|([02468][048]|[13579][26])00)-02-29)")
_TIME = (r"(([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]+)?([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
         r"|23:59:60(\.[0-9]+)?([Zz]|[+-]00:00))")
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9]|[A-Za-z0-9-][A-Za-z0-9]([A-Za-z0-9-]{0,59}[A-Za-z0-9])?|[A-Za-z0-9-]-[A-Za-z0-9]([A-Za-z0-9-]{0,58}[A-Za-z0-9])?)?"
FORMAT_PATTERNS = {
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DATE}[Tt]{_TIME}$",
    "hostname": f"^{_LABEL}(\\.{_LABEL})*$",
}

# Formats defined by draft 2020-12 that no backend asserts: kept, so a backend refuses them loudly.
_KNOWN_FORMATS = LLG_FORMATS | {"idn-email", "idn-hostname", "iri", "iri-reference", "uri-reference",
                                "uri-template", "json-pointer", "relative-json-pointer", "regex"}

_ALL_TYPES = ("null", "boolean", "object", "array", "number", "string")
# Keywords that constrain an instance independently of their siblings (so a schema made of them is the
# plain conjunction of one-keyword schemas). Excluded: properties/patternProperties/additionalProperties,
# items/prefixItems, contains/min/maxContains, if/then/else, unevaluated*: they interact.
_INDEPENDENT_KEYS = {"type", "enum", "const", "required", "minLength", "maxLength", "minItems", "maxItems",
                     "minProperties", "maxProperties", "minimum", "maximum", "exclusiveMinimum",
                     "exclusiveMaximum", "anyOf", "allOf", "not"}  # not $ref: draft-7 ignores its siblings


_NEGATE_BOUND = {  # keyword -> (instance type it applies to, negated keyword, offset)
    "maxItems": ("array", "minItems", 1), "minItems": ("array", "maxItems", -1),
    "maxLength": ("string", "minLength", 1), "minLength": ("string", "maxLength", -1),
    "maxProperties": ("object", "minProperties", 1), "minProperties": ("object", "maxProperties", -1),
    "maximum": ("number", "exclusiveMinimum", 0), "minimum": ("number", "exclusiveMaximum", 0),
    "exclusiveMaximum": ("number", "minimum", 0), "exclusiveMinimum": ("number", "maximum", 0),
}


def _others(types) -> list:
    """All JSON types outside `types` (integer counts as inside number)."""
    return [t for t in _ALL_TYPES if t not in types and not (t == "number" and "integer" in types and "number" in types)]


def _negate(sub, root, depth=0):
    """An exact schema for `not sub` when sub is simple enough, else None (then a backend refuses)."""
    if depth > 8:
        return None
    if sub is True or sub == {}:
        return False
    if sub is False:
        return True
    if not isinstance(sub, dict):
        return None
    sub = {k: v for k, v in sub.items() if k not in ANNOTATIONS}
    if set(sub) == {"$ref"}:
        target = resolve_ref(sub["$ref"], root)
        return None if target is None or target is sub else _negate(target, root, depth + 1)
    if set(sub) == {"type"}:
        types = sub["type"] if isinstance(sub["type"], list) else [sub["type"]]
        if "integer" in types and "number" not in types:
            return None  # "not integer" includes non-integral numbers: not a type union
        rest = _others(types)
        return {"type": rest} if rest else False
    if len(sub) == 1 and next(iter(sub)) in _NEGATE_BOUND:
        key, value = next(iter(sub.items()))
        applies, neg_key, offset = _NEGATE_BOUND[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        bound = value + offset
        if offset < 0 and bound < 0:
            return False  # e.g. not minItems 0: every instance satisfies minItems 0
        return {"type": applies, neg_key: bound}
    if len(sub) > 1 and set(sub) <= _INDEPENDENT_KEYS:
        # a schema is the conjunction of its (independent) keywords: not(A and B) = not A or not B
        parts = [_negate({k: v}, root, depth + 1) for k, v in sub.items()]
        return None if any(p is None for p in parts) else {"anyOf": parts}
    if set(sub) == {"not"}:
        return sub["not"]
    if set(sub) == {"anyOf"} and isinstance(sub["anyOf"], list):
        parts = [_negate(x, root, depth + 1) for x in sub["anyOf"]]
        return None if any(p is None for p in parts) else {"allOf": parts}
    if set(sub) == {"allOf"} and isinstance(sub["allOf"], list):
        parts = [_negate(x, root, depth + 1) for x in sub["allOf"]]
        return None if any(p is None for p in parts) else {"anyOf": parts}
    if set(sub) in ({"const"}, {"enum"}):
        values = [sub["const"]] if "const" in sub else sub["enum"]
        if not isinstance(values, list) or not all(v is None or isinstance(v, (bool, int, float)) for v in values):
            return None  # excluding particular strings/arrays/objects needs a complement we cannot write
        clauses = []
        for v in values:
            if v is None:
                clauses.append({"not_null": True})
            elif isinstance(v, bool):
                clauses.append({"anyOf": [{"type": _others(["boolean"])}, {"const": not v}]})
            else:
                clauses.append({"anyOf": [{"type": _others(["number"])}, {"type": "number", "exclusiveMinimum": v},
                                          {"type": "number", "exclusiveMaximum": v}]})
        clauses = [{"type": _others(["null"])} if c == {"not_null": True} else c for c in clauses]
        return clauses[0] if len(clauses) == 1 else {"allOf": clauses}
    if set(sub) == {"required"} and sub["required"]:
        return {"type": "object", "anyOf": [{"properties": {name: False}} for name in sub["required"]]}
    if set(sub) <= {"properties", "type"} and len(sub.get("properties", {})) == 1 and sub.get("type", "object") == "object":
        (name, prop), = sub["properties"].items()
        negated = _negate(prop, root, depth + 1)
        if negated is None:
            return None
        # valid for `not sub`: non-objects are valid for sub (vacuous) so invalid here, unless `type` was
        # in sub, in which case every non-object satisfies `not sub`.
        obj = {"type": "object", "required": [name], "properties": {name: negated}}
        if "type" in sub:
            return {"anyOf": [{"type": _others(["object"])}, obj]}
        return obj
    return None


def resolve_ref(ref, root):
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    target = root
    for part in ref[1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and part in target:
            target = target[part]
        elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        else:
            return None
    return target


def _deref(s, root, depth=0):
    while isinstance(s, dict) and "$ref" in s and depth < 16:
        target = resolve_ref(s["$ref"], root)
        if target is None:
            return s
        others = {k: v for k, v in s.items() if k != "$ref" and k not in ANNOTATIONS}
        if others:
            return {"allOf": [target, others]}
        s, depth = target, depth + 1
    return s


def _types(s, root, depth=0) -> set:
    """A superset of the JSON types of instances valid under s ("integer" folded into "number"); a set not to be
    modified (the common branch, one `type` name and nothing else that narrows it, returns a shared frozenset)."""
    if s.__class__ is dict and s.keys().isdisjoint(_COMBINING):  # (oneOf branches: ~4x cheaper than the walk)
        t = s.get("type")
        if t is None or t.__class__ is str:
            out = _ANY_TYPE if t is None else _TYPE_OF.get(t, _NO_TYPE)
            values = _values(s)
            return out if values is None else out & {_json_type(v) for v in values}
    s = _deref(s, root)
    if s is False:
        return set()
    if not isinstance(s, dict) or depth > 16:
        return set(_ALL_TYPES)
    out = set(_ALL_TYPES)
    if "type" in s:
        names = s["type"] if isinstance(s["type"], list) else [s["type"]]
        out &= {"number" if n == "integer" else n for n in names}
    values = _values(s)
    if values is not None:
        out &= {_json_type(v) for v in values}
    for sub in s.get("allOf", []) or []:
        out &= _types(sub, root, depth + 1)
    for key in ("anyOf", "oneOf"):
        if isinstance(s.get(key), list):
            union = set()
            for sub in s[key]:
                union |= _types(sub, root, depth + 1)
            out &= union
    return out


# keywords _types() must walk into; the types of one `type` name, and of any or none
_COMBINING = frozenset({"$ref", "allOf", "anyOf", "oneOf"})
_TYPE_OF = {n: frozenset({"number" if n == "integer" else n}) for n in _ALL_TYPES + ("integer",)}
_ANY_TYPE, _NO_TYPE = frozenset(_ALL_TYPES), frozenset()


def _json_type(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    return "array" if isinstance(v, list) else "object"


def _values(s):
    """The finite set of allowed values (as canonical JSON texts -> values) or None."""
    if not isinstance(s, dict):
        return None
    if "const" in s:
        return [s["const"]]
    if isinstance(s.get("enum"), list):
        return list(s["enum"])
    return None


def _canon(v) -> str:
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (int, float)):
        return repr(float(v))  # 1 and 1.0 are the same JSON number
    return json.dumps(v, sort_keys=True)


def disjoint(a, b, root, depth=0) -> bool:
    """True only if provably no instance is valid under both a and b."""
    if depth > 8:
        return False
    return _disjoint(_facts(a, root), _facts(b, root), root, depth)


def _facts(s, root) -> list:
    """[s dereferenced, its _types, its _values, their canonical texts]; the last three filled on first use (by
    _disjoint), so a schema compared with many others (a oneOf's branches, pairwise) is analysed once."""
    return [_deref(s, root), None, None, None]


def _disjoint(fa: list, fb: list, root, depth: int) -> bool:
    a, b = fa[0], fb[0]
    if a is False or b is False:
        return True
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    for f in (fa, fb):
        if f[1] is None:
            f[1] = _types(f[0], root)
    ta, tb = fa[1], fb[1]
    if not ta & tb:
        return True
    for f in (fa, fb):
        if f[2] is None:
            f[2] = (_values(f[0]),)
    if fa[2][0] is not None and fb[2][0] is not None:
        for f in (fa, fb):
            if f[3] is None:
                f[3] = {_canon(v) for v in f[2][0]}
        if not fa[3] & fb[3]:
            return True
    if ta | tb <= {"object"}:
        ra, rb = set(a.get("required", []) or []), set(b.get("required", []) or [])
        pa, pb = a.get("properties", {}) or {}, b.get("properties", {}) or {}
        for name in ra & rb:
            if name in pa and name in pb and disjoint(pa[name], pb[name], root, depth + 1):
                return True
        if any(_forbids(b, name) for name in ra) or any(_forbids(a, name) for name in rb):
            return True
    return False


def _forbids(s, name) -> bool:
    """True if an object valid under s can never have property `name`."""
    props = s.get("properties", {}) or {}
    if name in props:
        return props[name] is False
    return s.get("additionalProperties") is False and not s.get("patternProperties")


def _pairwise_disjoint(branches, root) -> bool:
    if len(branches) > 64:
        return False  # quadratic check; large oneOfs are left to the backend
    facts = [_facts(b, root) for b in branches]  # each branch analysed once, not once per pair
    if len(facts) == 2:  # (the usual oneOf: one pair, without the generator)
        return _disjoint(facts[0], facts[1], root, 0)
    return all(_disjoint(facts[i], facts[j], root, 0) for i in range(len(facts)) for j in range(i + 1, len(facts)))


def refuse(keyword: str, pointer: str, why: str = "no backend implements it exactly") -> ConstraintError:
    return ConstraintError(f"JSON Schema keyword '{keyword}' at pointer '{pointer}' is not supported: {why}")


# Each dependent* entry becomes an `allOf` clause with a two-way `anyOf`; llguidance intersects them as a
# product, and with many of them it was seen to reject valid instances (JsonSchemaStore tmlanguage, 8
# clauses). Up to this many are exact in our tests; more are refused.
MAX_DEPENDENT_CLAUSES = 3

_TYPE_NAMES = {"null", "boolean", "object", "array", "number", "string", "integer"}
_NONNEG_INT_KEYS = {"minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
                    "minContains", "maxContains"}
_NUMBER_KEYS = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}


def check_schema(schema) -> None:
    """Structural checks of keyword values (the metaschema's basics), with the offending pointer."""
    if isinstance(schema, bool):
        return
    for key, value, path in keywords(schema):
        if key not in _CHECKED_KEYS or (key == "type" and value.__class__ is str and value in _TYPE_NAMES):
            continue  # nothing to check / the common valid case, without a call
        problem = _keyword_problem(key, value)
        if problem:
            raise ConstraintError(f"invalid JSON Schema: '{key}' at pointer '{to_pointer(path)}' {problem}")


_CHECKED_KEYS = ({"type", "required", "pattern", "$ref", "format", "allOf", "anyOf", "oneOf"} | _NONNEG_INT_KEYS
                 | _NUMBER_KEYS | set(SCHEMA_MAP_KEYS) | set(SCHEMA_KEYS))


def _keyword_problem(key, value):
    """What is wrong with one keyword's value, or None."""
    if key == "type":
        names = value if isinstance(value, list) else [value]
        bad = [n for n in names if n not in _TYPE_NAMES]
        if bad or not names:
            return f"has unknown type {bad[0] if bad else value!r}"
    elif key in _NONNEG_INT_KEYS:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or value != int(value):
            return f"must be a non-negative integer, got {value!r}"
    elif key in _NUMBER_KEYS:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"must be a number, got {value!r}"
        if key == "multipleOf" and value <= 0:
            return "must be > 0"
    elif key == "required":
        if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            return "must be a list of strings"
    elif key in ("pattern", "$ref", "format"):
        if not isinstance(value, str):
            return "must be a string"
    elif key in SCHEMA_MAP_KEYS:
        if not isinstance(value, dict):
            return "must be an object"
    elif key in ("allOf", "anyOf", "oneOf"):
        if not (isinstance(value, list) and value):
            return "must be a non-empty array"
    elif key in SCHEMA_KEYS:
        if not isinstance(value, (dict, bool)) and not (key == "items" and isinstance(value, list)):
            return "must be a schema (object or boolean)"
    return None


SCAN_AS_IS, SCAN_PREPARE, SCAN_INVALID = 0, 1, 2


def scan(schema) -> int:
    """One cheap walk over every subschema: check_schema's value checks, and whether `prepare()` or the refusal
    checks have anything to do. SCAN_AS_IS: valid, and prepare() would only drop annotations (which llguidance
    ignores), so the compiler can hand the schema to llguidance as it is. SCAN_PREPARE: valid, but it has
    keywords to rewrite or refuse (check_schema can be skipped). SCAN_INVALID: run check_schema, which names the
    keyword and its pointer. Cost: ~0.1 µs per keyword (no copy, no pointers: a fraction of check_schema +
    prepare + unsupported, which it lets the common schema skip)."""
    return scan_details(schema)[0]


def scan_details(schema) -> tuple:
    """scan(schema), plus what it saw that lets the full path skip walks: (SCAN_* code, has_unsupported: some
    keyword llguidance does not implement (LLG_UNSUPPORTED) is present, ref_siblings: a draft 4-7 `$ref` has
    siblings to drop). Both flags are True when the code is not SCAN_PREPARE (nothing to skip then)."""
    return scan_marks(schema)[:3]  # (`false` / non-schemas: SCAN_PREPARE, the full path)


def scan_marks(schema) -> tuple:
    """scan_details(schema) + the set of id()s of the subschemas prepare(dirty=...) must rewrite: those with a
    keyword to rewrite or refuse, and every subschema above one (empty unless the code is SCAN_PREPARE)."""
    if not isinstance(schema, dict):
        return (SCAN_AS_IS if schema is True else SCAN_PREPARE), True, True, set()
    declared = str(schema.get("$schema", ""))
    # [prepare, old draft, an LLG_UNSUPPORTED keyword, a draft 4-7 $ref with siblings, the marked subschemas]
    flags = [False, any(d in declared for d in ("draft-04", "draft-06", "draft-07")), False, False, set()]
    try:
        _scan(schema, flags)
    except _Invalid:
        return SCAN_INVALID, True, True, set()
    if not flags[0]:
        return SCAN_AS_IS, True, True, set()
    return SCAN_PREPARE, flags[2], flags[3], flags[4]


def needs_prepare(schema) -> bool:
    """True unless scan() says the schema can go to llguidance as it is."""
    return scan(schema) != SCAN_AS_IS


class _Invalid(Exception):
    """A keyword value check failed during scan (check_schema reports it)."""


# Keys that make scan() say SCAN_PREPARE: every keyword prepare() rewrites or drops beyond annotations, every
# keyword llguidance does not implement (refused by the full path) and annotation-only subschemas (contentSchema:
# prepare drops it; its contents must not be mistaken for assertions).
_PREPARE_KEYS = frozenset(LLG_UNSUPPORTED | {"oneOf", "contentSchema", "dependencies"})
# format values prepare() leaves in place (llguidance asserts them and our regexes do not replace them).
_KEPT_FORMATS = frozenset(LLG_FORMATS - set(FORMAT_PATTERNS))
# $ref siblings that drafts 4-7 tolerate (prepare's _drop_ref_siblings keeps them; annotations are ignored anyway).
_REF_SIBLINGS = frozenset({"$ref", "definitions", "$defs", "$schema", "$id", "id"} | ANNOTATIONS)
# What scan() does per keyword (the same checks and the same recursion as check_schema's walk).
_SUB, _SUB_LIST, _SUB_MAP, _TYPE, _NONNEG, _REQUIRED, _STR, _NUMBER, _FORMAT, _OTHER = range(10)
_PREP = 16  # added to the code of a key in _PREPARE_KEYS (one int test per keyword instead of a set lookup)
_SCAN = {}
_SCAN.update((k, _NUMBER) for k in _NUMBER_KEYS)
_SCAN.update((k, _NONNEG) for k in _NONNEG_INT_KEYS)
_SCAN.update((k, _SUB) for k in SCHEMA_KEYS)
_SCAN.update((k, _SUB_LIST) for k in SCHEMA_LIST_KEYS)
_SCAN.update((k, _SUB_MAP) for k in _MAP_OR_DEPENDENCIES)
_SCAN.update(type=_TYPE, format=_FORMAT, required=_REQUIRED, pattern=_STR)
_SCAN["$ref"] = _STR
_SCAN.update((k, _SCAN.get(k, _OTHER) + _PREP) for k in _PREPARE_KEYS)
_IS_STR = str.__instancecheck__


def _scan(node: dict, flags: list) -> bool:
    """Check and look at one subschema and those below it; True (and its id in flags[4]) if prepare() has
    something to do at or below it. (The branches in order of how often MaskBench keywords take them; a value
    that fails a branch's inline test goes to _keyword_problem, which decides.)"""
    mark = False
    if flags[1] and "$ref" in node and not node.keys() <= _REF_SIBLINGS:
        mark = flags[3] = True  # drafts 4-7 ignore $ref's siblings: prepare() drops them
    for key, value in node.items():
        code = _SCAN.get(key)
        if code is None:
            continue  # annotations, unknown and extension keywords: nothing to check
        if code >= _PREP:
            mark = True
            if key in LLG_UNSUPPORTED:
                flags[2] = True
            code -= _PREP
        if code == _TYPE:
            if not (value.__class__ is str and value in _TYPE_NAMES) and _keyword_problem(key, value):
                raise _Invalid
        elif code == _SUB_MAP:
            if not isinstance(value, dict):
                if key != "dependencies":
                    raise _Invalid
            else:
                for sub in value.values():
                    if isinstance(sub, dict) and _scan(sub, flags):
                        mark = True
        elif code == _SUB:
            if isinstance(value, dict):
                if _scan(value, flags):
                    mark = True
            elif value is not True and value is not False:
                if not isinstance(value, list) or key != "items":
                    raise _Invalid
                mark = True  # draft 4-7 tuple form: prepare() turns it into prefixItems
                for sub in value:
                    if isinstance(sub, dict):
                        _scan(sub, flags)
        elif code == _REQUIRED:
            if not (value.__class__ is list and all(map(_IS_STR, value))) and _keyword_problem(key, value):
                raise _Invalid
        elif code == _STR:
            if value.__class__ is not str and _keyword_problem(key, value):
                raise _Invalid
        elif code == _NONNEG:
            if value.__class__ is not int or value < 0:
                if _keyword_problem(key, value):
                    raise _Invalid
                mark = True  # an integral float bound: prepare() makes it an int
        elif code == _NUMBER:
            if (value.__class__ is not int and value.__class__ is not float or key == "multipleOf") \
                    and _keyword_problem(key, value):
                raise _Invalid
        elif code == _SUB_LIST:
            if key != "prefixItems" and _keyword_problem(key, value):
                raise _Invalid
            if isinstance(value, list):
                for sub in value:
                    if isinstance(sub, dict) and _scan(sub, flags):
                        mark = True
        elif code == _FORMAT:
            if value.__class__ is not str:
                raise _Invalid
            if value not in _KEPT_FORMATS:
                mark = True  # replaced by our exact regex, dropped, or refused
    if mark:
        flags[0] = True
        flags[4].add(id(node))
    return mark
