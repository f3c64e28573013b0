"""DSML tool-call grammars: one assistant turn of DeepSeek-V4 / V4.1, every parameter typed by its tool's schema.

`dsml_grammar(tools, tool_choice=..., thinking=..., version=...)` returns a `Grammar(text, syntax="lark")`
spec in llguidance's Lark dialect (see docs/deepseek-v4-encoding.md §4). Shape of the turn it accepts:

    [reasoning </think>]  content  [ "\\n\\n<" D "tool_calls>\\n" invoke+ "</" D "tool_calls>" ]   (then EOS)

* D (`｜DSML｜`, id 128825) and `</think>` (128822) are single special tokens (`<[id]>`): free text can never
  produce them, and may not spell them out either (the stream parser matches decoded text, so a spelled-out
  `｜DSML｜` would be read as markup): free text and raw values never contain "｜" (U+FF5C), and free text
  never contains the text `<think>` / `</think>`.
* Free text and reasoning are unconstrained until the block starts; the block then follows the tool schemas.
* `string="true"` parameters are raw text (no quotes, no escaping); string keywords (`enum`, `const`, `pattern`,
  `minLength`, `maxLength`, `format`) apply to those raw characters. `string="false"` parameters are JSON values
  of the schema restricted to its non-string types, written like `json.dumps` (", " and ": " separators).
* Parameters come in the schema's `properties` order; required ones are mandatory, optional ones may be left out.
  Parameters outside `properties` are never produced (a subset of what the schema allows, never a superset).
* Tag spelling: V4 writes `<D tool_calls>`, `<D invoke`, `<D parameter`; V4.1 writes `<D calls>`,
  `<D invoke`, `<D parameter` with a space after D (what deepseek-recipe's `DeepseekV41Encoding` renders).

Cost: building the text is pure Python, microseconds per tool; compilation happens in the ConstraintCompiler.
This module imports nothing of ours but the spec types.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .specs import ConstraintError, Grammar

DSML_TOKEN_ID = 128825
THINK_END_TOKEN_ID = 128822

# Texts the stream parser reacts to (they exist as single tokens); enum literals holding them are dropped.
_MARKER_TEXTS = ("｜DSML｜", "<think>", "</think>", "<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>")

_NON_STRING_TYPES = ["number", "boolean", "null", "array", "object"]

# One character of raw parameter text: anything but "｜" (see _raw_regex).
_RAW_CHAR = "[^｜]"
# Free text (content, reasoning): no "｜" and no spelled-out <think> / </think> (both exist as single tokens).
_FREE_TEXT = r"/[^｜]*/ & ~/(?s:.*)<\/?think>(?s:.*)/"

# Regexes for common JSON Schema string formats (raw text, full match). Unknown formats are not enforced.
_FORMAT_REGEX = {
    "date": r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    "time": r"([01][0-9]|2[0-3]):[0-5][0-9]:([0-5][0-9]|60)(\.[0-9]+)?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])",
    "date-time": r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])[Tt]([01][0-9]|2[0-3]):[0-5][0-9]:([0-5][0-9]|60)"
                 r"(\.[0-9]+)?([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])",
    "email": r"[A-Za-z0-9.!#$%&'*+/=?^_`{|}~-]+@[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)+",
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    "ipv4": r"((25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])",
    "uri": r"[A-Za-z][A-Za-z0-9+.-]*:[^ \t\r\n<>\"{}|\\^`]*",
    "hostname": r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*",
}


@dataclass(frozen=True)
class DsmlTags:
    """The text after `<D` / `</D` for the three tags of one encoding version."""

    block: str
    invoke: str
    parameter: str


V4_TAGS = DsmlTags(block="tool_calls", invoke="invoke", parameter="parameter")
V41_TAGS = DsmlTags(block=" calls", invoke=" invoke", parameter=" parameter")


def tags_for_version(version: str) -> DsmlTags:
    """'v4' -> V4 spelling; 'v4.1' (or 'v41') -> V4.1 spelling."""
    v = str(version).lower().replace("_", ".").replace("-", ".")
    if v in ("v4", "4", "v4.pro", "v4.flash"):
        return V4_TAGS
    if v in ("v4.1", "v41", "4.1", "v4.1.flash"):
        return V41_TAGS
    raise ConstraintError(f"unknown DSML version {version!r}; use 'v4' or 'v4.1'")


@dataclass(frozen=True)
class Tool:
    """One callable tool: its name and the JSON Schema of its arguments object."""

    name: str
    parameters: Any


def normalize_tools(tools) -> list[Tool]:
    """Accept OpenAI function tools, bare {"name","parameters"} dicts, Anthropic {"name","input_schema"},
    deepseek-recipe ToolDefinition objects, or the JSON text of recipe's OutputConstraint tool list."""
    if isinstance(tools, (str, bytes)):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise ConstraintError(f"tool list is not valid JSON: {e.msg} at column {e.colno}") from None
    if not isinstance(tools, (list, tuple)):
        raise ConstraintError(f"tools must be a list, got {type(tools).__name__}")
    out = []
    for i, t in enumerate(tools):
        if isinstance(t, Tool):
            out.append(t)
            continue
        if not isinstance(t, dict):  # recipe ToolDefinition or similar object
            if hasattr(t, "name"):
                out.append(Tool(str(t.name), getattr(t, "parameters", None)))
                continue
            raise ConstraintError(f"tools[{i}] must be an object, got {type(t).__name__}")
        fn = t.get("function", t) if t.get("type", "function") == "function" else t
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ConstraintError(f"tools[{i}] has no function name")
        params = fn.get("parameters", fn.get("input_schema"))
        out.append(Tool(name, params))
    seen = set()
    for t in out:
        if t.name in seen:
            raise ConstraintError(f"tool name {t.name!r} is declared twice")
        if any(c in t.name for c in '"<>\n'):
            raise ConstraintError(f"tool name {t.name!r} contains a character DSML cannot carry (\", <, > or newline)")
        seen.add(t.name)
    return out


def select_tools(tools: list[Tool], tool_choice) -> tuple[list[Tool], str]:
    """Apply an OpenAI-style tool_choice. Returns (tools, mode) with mode in auto|required|none."""
    if tool_choice is None or tool_choice == "auto":
        return tools, "auto"
    if tool_choice in ("none", "required"):
        return tools, tool_choice
    name = None
    if isinstance(tool_choice, str):
        name = tool_choice
    elif isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
    if not name:
        raise ConstraintError(f"tool_choice {tool_choice!r} is not auto, none, required or a named function")
    chosen = [t for t in tools if t.name == name]
    if not chosen:
        raise ConstraintError(f"tool_choice names {name!r}, which is not among the tools {[t.name for t in tools]}")
    return chosen, "required"


def dsml_grammar_text(tools, tool_choice="auto", *, thinking: bool = False, starts_in_tool_calls: bool = False,
                      version: str = "v4.1", dsml_token_id: int = DSML_TOKEN_ID,
                      think_end_token_id: int = THINK_END_TOKEN_ID) -> str:
    """The Lark grammar text (llguidance dialect) for one assistant turn; EOS is left to the compiler.

    tool_choice: "auto" (free text, then optionally one tool-call block), "required" (a block is mandatory),
    "none" (free text only, the DSML token can never appear), or a named function (only that tool, mandatory).
    thinking: the prompt ended with `<think>`: free reasoning, then `</think>`, then the answer.
    starts_in_tool_calls: the prompt already holds "\\n\\n<D tool_calls>\\n" (deepseek-recipe pre-fills it for
    required / named choices), so the completion starts at the first invoke.
    """
    tools, mode = select_tools(normalize_tools(tools), tool_choice)
    if mode != "none" and not tools:
        raise ConstraintError("a tool-call grammar needs at least one tool")
    tags = tags_for_version(version)
    b = _Builder(tags, f"<[{int(dsml_token_id)}]>")
    lines = [
        f"FREE: {_FREE_TEXT}",
        r'PRE_BLOCK: FREE "\n\n<"',
    ]
    if mode == "none":
        answer = "FREE"
    else:
        invokes = [b.invoke(i, t) for i, t in enumerate(tools)]
        lines.append("invoke: " + " | ".join(invokes))
        lines.append(f'block_body: invoke+ "</" {b.d} {_lit(tags.block + ">")}')
        opener = f'{b.d} {_lit(tags.block + ">" + chr(10))} block_body'
        if starts_in_tool_calls:
            answer = "block_body"
        elif mode == "required":
            answer = f"PRE_BLOCK {opener}"
        else:
            answer = f"FREE | PRE_BLOCK {opener}"
    if thinking and not starts_in_tool_calls:
        lines.insert(0, f"start: FREE <[{int(think_end_token_id)}]> answer")
    else:
        lines.insert(0, "start: answer")
    lines.insert(1, f"answer: {answer}")
    return "\n".join(lines + b.lines) + "\n"


def dsml_grammar(tools, tool_choice="auto", **kwargs) -> Grammar:
    """`dsml_grammar_text` wrapped as a `Grammar(text, syntax="lark")` spec (see that function for the args)."""
    return Grammar(dsml_grammar_text(tools, tool_choice, **kwargs), syntax="lark")


# ----------------------------------------------------------------------------------------------------------
# building blocks


class _Builder:
    """Collects the rules for each tool's invoke and each parameter value."""

    def __init__(self, tags: DsmlTags, d: str):
        self.tags, self.d, self.lines = tags, d, []

    def invoke(self, i: int, tool: Tool) -> str:
        name = f"invoke_{i}"
        root = tool.parameters if tool.parameters is not None else {}
        if root is False:
            raise ConstraintError(f"tool {tool.name!r}: parameters schema is false; no call can satisfy it")
        if root is True:
            root = {}
        if not isinstance(root, dict):
            raise ConstraintError(f"tool {tool.name!r}: parameters must be a JSON Schema object")
        root = _merge_all_of(root, root, f"tool {tool.name!r}")
        props = root.get("properties") or {}
        required = list(root.get("required") or [])
        params = []  # (rule name, required)
        undeclared = [r for r in required if r not in props]
        if undeclared and root.get("additionalProperties", True) is False:
            raise ConstraintError(f"tool {tool.name!r}: required {undeclared} are not in properties and "
                                  "additionalProperties is false; no call can satisfy it")
        order = list(props) + undeclared
        for j, key in enumerate(order):
            if any(c in key for c in '"<>\n'):
                raise ConstraintError(f"tool {tool.name!r}: parameter name {key!r} contains \", <, > or a newline")
            where = f"tool {tool.name!r} parameter {key!r} (pointer /properties/{_ptr(key)})"
            schema = props.get(key, True)
            rule = self.param(i, j, key, schema, root, where)
            if rule is None:
                if key in required:
                    raise ConstraintError(f"{where}: required but its schema admits no value")
                continue
            params.append((rule, key in required))
        head_text = self.tags.invoke + ' name="' + tool.name + '">\n'
        head = f'"<" {self.d} {_lit(head_text)}'
        tail = f'"</" {self.d} {_lit(self.tags.invoke + ">" + chr(10))}'
        extra = root.get("additionalProperties", True)
        if not props and not required and extra is not False and not root.get("minProperties"):
            # A free-form arguments object: any parameter names, values typed by additionalProperties.
            body = self.free_form_body(i, extra, root, f"tool {tool.name!r} additionalProperties")
        else:
            body = self.body(i, params)
        self.lines.append(f"{name}: {head} {body} {tail}")
        return name

    def free_form_body(self, i: int, value_schema, root: dict, where: str) -> str:
        rule = self.param(i, "x", None, True if value_schema is True else value_schema, root, where)
        if rule is None:
            return '"\\n"?'
        name = f"body_{i}"
        self.lines.append(f'{name}: "\\n"? | {rule}+')
        return name

    def body(self, i: int, params: list[tuple[str, bool]]) -> str:
        if any(req for _, req in params):
            return " ".join(r if req else f"{r}?" for r, req in params)
        # All optional: either nothing (then an optional blank line, both renderings parse) or a non-empty
        # ordered subset, written as "first present one, then the rest optional" to stay linear in size.
        alts = ['"\\n"?']
        for k, (r, _) in enumerate(params):
            alts.append(" ".join([r] + [f"{q}?" for q, _ in params[k + 1:]]))
        name = f"body_{i}"
        self.lines.append(f"{name}: " + " | ".join(f"({a})" for a in alts))
        return name

    def param(self, i: int, j: int, key: str, schema, root: dict, where: str) -> str | None:
        schema = _resolve(schema, root, where)
        raw = _raw_regex(schema, root, where)
        non_str = _non_string_schema(schema, root, where)
        if raw is None and non_str is None:
            return None
        stem = f"p_{i}_{j}"
        branches = []
        if key is None:  # free-form parameter: its name is any short identifier
            self.lines.append(f"PNAME_{i}_{str(j).upper()}: /[A-Za-z_][A-Za-z0-9_.-]{{0,63}}/")
        if raw is not None:
            term = f"RAW_{i}_{str(j).upper()}"
            # One lexeme from `true">` through the closing "</": a raw value may itself contain "</", and a
            # single greedy lexeme ends only where the D token arrives, so the value is never cut early.
            self.lines.append(f'{term}: "true\\">" ({raw}) "</"')
            branches.append(term)
        if non_str is not None:
            embedded = dict(non_str)
            for defs_key in ("$defs", "definitions"):
                if defs_key in root and defs_key not in embedded:
                    embedded[defs_key] = root[defs_key]
            embedded["x-guidance"] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
            self.lines.append(f"{stem}_json: %json {json.dumps(embedded, ensure_ascii=False)}")
            branches.append(f'"false\\">" {stem}_json "</"')
        tail = f'{self.d} {_lit(self.tags.parameter + ">" + chr(10))}'
        if key is None:
            open_text = self.tags.parameter + ' name="'
            head = f'"<" {self.d} {_lit(open_text)} PNAME_{i}_{str(j).upper()} "\\" string=\\""'
        else:
            head_text = self.tags.parameter + ' name="' + key + '" string="'
            head = f'"<" {self.d} {_lit(head_text)}'
        self.lines.append(f"{stem}: {head} ({' | '.join(branches)}) {tail}")
        return stem


def _lit(s: str) -> str:
    """A Lark string literal for `s` (llguidance reads JSON-style escapes)."""
    return json.dumps(s, ensure_ascii=False)


def _ptr(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _resolve(schema, root: dict, where: str, depth: int = 0):
    """Follow local $refs ("#/$defs/X", "#/definitions/X", "#") so the schema's kind can be read."""
    while isinstance(schema, dict) and "$ref" in schema:
        if depth > 32:
            raise ConstraintError(f"{where}: $ref chain too deep")
        ref = schema["$ref"]
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise ConstraintError(f"{where}: only local $ref are supported, got {ref!r}")
        target = root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise ConstraintError(f"{where}: $ref {ref!r} does not resolve")
            target = target[part]
        rest = {k: v for k, v in schema.items() if k != "$ref"}
        schema = {**target, **rest} if isinstance(target, dict) and rest else target
        depth += 1
    return schema


def _merge_all_of(schema, root, where):
    """Fold a top-level allOf of plain object schemas into one (properties and required are unioned)."""
    if not isinstance(schema, dict) or "allOf" not in schema:
        return schema
    merged = {k: v for k, v in schema.items() if k != "allOf"}
    for part in schema["allOf"]:
        part = _merge_all_of(_resolve(part, root, where), root, where)
        if not isinstance(part, dict):
            continue
        for k, v in part.items():
            if k == "properties":
                merged["properties"] = {**merged.get("properties", {}), **v}
            elif k == "required":
                merged["required"] = list(dict.fromkeys(list(merged.get("required", [])) + list(v)))
            else:
                merged.setdefault(k, v)
    return merged


def _types(schema: dict):
    t = schema.get("type")
    if t is None:
        return None
    return [t] if isinstance(t, str) else list(t)


def _raw_regex(schema, root: dict, where: str, depth: int = 0) -> str | None:
    """A Lark terminal expression for the raw text of the string values `schema` admits, or None."""
    if depth > 16:
        raise ConstraintError(f"{where}: schema nesting too deep for a raw string value")
    schema = _resolve(schema, root, where)
    if schema is True or schema == {}:
        return _any_text()
    if schema is False or not isinstance(schema, dict):
        return None
    schema = _merge_all_of(schema, root, where)
    if "const" in schema:
        return _alternation([schema["const"]]) if isinstance(schema["const"], str) else None
    if "enum" in schema:
        strings = [v for v in schema["enum"] if isinstance(v, str)]
        return _alternation(strings) if strings else None
    for key in ("anyOf", "oneOf"):
        if key in schema:
            subs = [_raw_regex({**{k: v for k, v in schema.items() if k not in ("anyOf", "oneOf")}, **_as_dict(b)}
                               if isinstance(b, dict) else b, root, where, depth + 1) for b in schema[key]]
            subs = [s for s in subs if s is not None]
            return " | ".join(f"({s})" for s in subs) if subs else None
    types = _types(schema)
    if types is not None and "string" not in types:
        return None
    # Raw text never holds "｜" (U+FF5C), the character every marker the stream parser looks for is spelled
    # with ("｜DSML｜", "<｜end▁of▁sentence｜>"). A plain character class keeps the lexer small: intersecting a
    # negated "contains" automaton with bounded repetition makes llguidance's lexer run out of states.
    lo, hi = schema.get("minLength"), schema.get("maxLength")
    if lo is not None or hi is not None:
        lo = int(lo or 0)
        if hi is not None and int(hi) < lo:
            return None
        parts = [f"/{_RAW_CHAR}{{{lo},{'' if hi is None else int(hi)}}}/"]
    else:
        parts = [f"/{_RAW_CHAR}*/"]
    if "pattern" in schema:
        parts.append(_pattern_terminal(schema["pattern"], where))
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt in _FORMAT_REGEX:
        parts.append(f"/{_FORMAT_REGEX[fmt].replace('/', chr(92) + '/')}/")
    return " & ".join(parts)


def _as_dict(b):
    return b if isinstance(b, dict) else {}


def _any_text() -> str:
    return f"/{_RAW_CHAR}*/"


def _alternation(strings) -> str:
    bad = [s for s in strings if any(m in s for m in _MARKER_TEXTS)]
    strings = [s for s in strings if s not in bad]
    if not strings:
        return None
    return " | ".join(_lit(s) for s in strings)


def _pattern_terminal(pattern, where: str) -> str:
    """A JSON Schema `pattern` applied to the whole raw value (anchored: a strict subset of search semantics)."""
    if not isinstance(pattern, str):
        raise ConstraintError(f"{where}: pattern must be a string")
    p = pattern
    if p.startswith("^"):
        p = p[1:]
    if p.endswith("$") and not p.endswith("\\$"):
        p = p[:-1]
    try:
        import llguidance  # only for its regex-escaping helper; the grammar stays a plain string

        p = llguidance.regex_to_lark(p, "dw")
    except ImportError:  # pragma: no cover - llguidance is a hard dependency
        p = p.replace("/", "\\/")
    except Exception as e:
        raise ConstraintError(f"{where}: pattern {pattern!r} is not supported: {e}") from None
    if "(?=" in p or "(?!" in p or "(?<" in p:
        raise ConstraintError(f"{where}: pattern {pattern!r} uses look-around, which no DFA-based matcher supports")
    return f"/{p}/"


def _non_string_schema(schema, root: dict, where: str):
    """`schema` restricted to non-string JSON values (what goes after string="false"), or None if none."""
    schema = _resolve(schema, root, where)
    if schema is True or schema == {}:
        return {"type": _NON_STRING_TYPES}
    if schema is False or not isinstance(schema, dict):
        return None
    if "const" in schema:
        return None if isinstance(schema["const"], str) else schema
    if "enum" in schema:
        values = [v for v in schema["enum"] if not isinstance(v, str)]
        return {**schema, "enum": values} if values else None
    for key in ("anyOf", "oneOf"):
        if key in schema:
            outer = {k: v for k, v in schema.items() if k != key}
            subs = []
            for branch in schema[key]:
                sub = _non_string_schema({**outer, **branch} if isinstance(branch, dict) else branch, root, where)
                if sub is not None:
                    subs.append(sub)
            if not subs:
                return None
            return subs[0] if len(subs) == 1 else {"anyOf": subs}
    types = _types(schema)
    if types is None:
        return {**schema, "type": _NON_STRING_TYPES}
    rest = [t for t in types if t != "string"]
    if not rest:
        return None
    return {**schema, "type": rest[0] if len(rest) == 1 else rest}


def after_reasoning_grammar(*, json_schema=None, regex: str | None = None,
                            think_end_token_id: int = THINK_END_TOKEN_ID) -> Grammar:
    """Thinking-mode answers for a JSON Schema or a regex: free reasoning, the `</think>` token, then the answer.

    Exactly one of json_schema (dict/bool/JSON text; written like json.dumps) or regex (full match) is given.
    In chat mode use plain JsonSchema / Regex specs instead; this exists because a thinking prompt ends in
    `<think>`, so the constrained value only starts after the reasoning.
    """
    if (json_schema is None) == (regex is None):
        raise ConstraintError("give exactly one of json_schema or regex")
    lines = [f"start: FREE <[{int(think_end_token_id)}]> answer",
             f"FREE: {_FREE_TEXT}"]
    if json_schema is not None:
        if isinstance(json_schema, (str, bytes)):
            try:
                json_schema = json.loads(json_schema) if json_schema else {}
            except json.JSONDecodeError as e:
                raise ConstraintError(f"JSON schema text is not valid JSON: {e.msg} at column {e.colno}") from None
        if json_schema is True:
            json_schema = {}
        if not isinstance(json_schema, dict):
            raise ConstraintError("json_schema must be a JSON object")
        lines.append(f"answer: %json {json.dumps(json_schema, ensure_ascii=False)}")
    else:
        lines.append(f"answer: /{_lark_regex_body(regex)}/")
    return Grammar("\n".join(lines) + "\n", syntax="lark")


def _lark_regex_body(regex: str) -> str:
    try:
        import llguidance

        return llguidance.regex_to_lark(regex, "")
    except Exception as e:
        raise ConstraintError(f"regex {regex!r} cannot be used: {e}") from None
