"""Chat front door: requests of all three API formats are converted and rendered by deepseek-recipe, the
OutputConstraint becomes our grammar spec, and completions (whole or streamed) parse back through recipe."""
import json
import random

import jsonschema
import pytest

import deepseek_recipe as dr
from deepinfer_sg.chat import (ChatRequestError, build_body, constraint_from_output_constraint, detect_format,
                               parse_completion, prepare_chat, stream_completion)
from deepinfer_sg.grammars import Grammar, JsonSchema
from frontdoor_helpers import DSML, EOS, hf_tokenizer, matcher_for_lark, random_walk

PARAMS = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "opts": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
             "additionalProperties": False}}, "required": ["city"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "w", "parameters": PARAMS}},
              {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}]
SCHEMAS = {"get_weather": PARAMS, "ping": {"type": "object", "properties": {}}}


def _bodies(choice="auto"):
    """The same tool request in the three formats, thinking off."""
    chat = {"model": "m", "messages": [{"role": "user", "content": "Weather?"}], "tools": CHAT_TOOLS,
            "tool_choice": choice, "thinking": {"type": "disabled"}}
    msgs = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "Weather?"}],
            "tools": [{"name": t["function"]["name"], "description": "d", "input_schema": t["function"]["parameters"]}
                      for t in CHAT_TOOLS], "thinking": {"type": "disabled"}}
    resp = {"model": "m", "input": "Weather?", "reasoning": {"effort": "none"},
            "tools": [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
                      for t in CHAT_TOOLS]}
    if choice == "required":
        msgs["tool_choice"] = {"type": "any"}
        resp["tool_choice"] = "required"
    return {"chat": chat, "messages": msgs, "responses": resp}


def _tool_calls(fmt, response):
    if fmt == "chat":
        return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in response["choices"][0]["message"].get("tool_calls") or []]
    if fmt == "messages":
        return [(b["name"], b["input"]) for b in response["content"] if b["type"] == "tool_use"]
    return [(o["name"], json.loads(o["arguments"])) for o in response["output"] if o["type"] == "function_call"]


def test_detect_format():
    b = _bodies()
    assert [detect_format(b[k]) for k in ("chat", "messages", "responses")] == ["chat", "messages", "responses"]


@pytest.mark.parametrize("fmt,version,choice", [
    ("chat", "v4", "auto"), ("chat", "v4.1", "required"), ("messages", "v4.1", "auto"),
    ("messages", "v4", "required"), ("responses", "v4", "auto"), ("responses", "v4.1", "required")])
def test_grammar_walks_parse_in_every_format(fmt, version, choice):
    prepared = prepare_chat(_bodies(choice)[fmt], version=version)
    assert prepared.format == fmt and not prepared.thinking
    assert isinstance(prepared.constraint, Grammar)
    # the prompt is recipe's rendering; its ids are what recipe's encoder gives (or the piecewise fallback)
    prefilled = prepared.parsing_options.starts_in_tool_calls
    assert prefilled == (choice == "required" and fmt != "messages")  # recipe maps Anthropic "any" to auto
    assert prepared.prompt.endswith(">\n" if prefilled else "</think>")
    assert hf_tokenizer().decode(prepared.prompt_token_ids, skip_special_tokens=False).replace(
        "<｜begin▁of▁sentence｜>", "") == prepared.prompt.replace("<｜begin▁of▁sentence｜>", "")
    rng = random.Random(len(fmt) + len(version))
    got = 0
    for i in range(3):
        m = matcher_for_lark(prepared.constraint.text)
        pre = []
        if not prefilled:
            pre = hf_tokenizer().encode("Checking.\n\n<", add_special_tokens=False).ids + [DSML]
        assert all(m.consume_token(t) for t in pre)
        ids = random_walk(m, rng)
        if ids is None:
            continue
        response = parse_completion(prepared, pre + ids + [EOS], "stop")
        calls = _tool_calls(fmt, response)
        assert calls or choice == "auto"
        for name, args in calls:
            jsonschema.validate(args, SCHEMAS[name])
        got += 1
    assert got >= 2


def test_streamed_chunks_accumulate_to_the_same_response():
    prepared = prepare_chat(_bodies()["chat"], version="v4.1")
    D = "｜DSML｜ "
    text = (f'Let me look.\n\n<{D}calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">'
            f'Zürich</｜DSML｜ parameter>\n<{D}parameter name="days" string="false">2</｜DSML｜ parameter>\n'
            f'</｜DSML｜ invoke>\n</｜DSML｜ calls>')
    ids = hf_tokenizer().encode(text, add_special_tokens=False).ids + [EOS]
    whole = parse_completion(prepared, ids, "stop", response_id="r1")
    chunks = list(stream_completion(prepared, [(ids[i:i + 3], None) for i in range(0, len(ids), 3)] + [([], "stop")],
                                    response_id="r1"))
    assert len(chunks) > 3
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    assert content == whole["choices"][0]["message"]["content"] == "Let me look."
    args = "".join(tc["function"].get("arguments") or "" for c in chunks if c.get("choices")
                   for tc in c["choices"][0]["delta"].get("tool_calls") or [])
    assert json.loads(args) == {"city": "Zürich", "days": 2}
    assert json.loads(whole["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]) == json.loads(args)


def test_output_constraint_mapping():
    body = {"model": "m", "messages": [{"role": "user", "content": "give json"}], "thinking": {"type": "disabled"},
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}}
    p = prepare_chat(body)
    assert isinstance(p.constraint, JsonSchema) and p.constraint.schema["required"] == ["a"]
    body["thinking"] = {"type": "enabled"}
    p = prepare_chat(body)
    assert p.thinking and isinstance(p.constraint, Grammar) and "<[128822]>" in p.constraint.text
    # thinking + JSON: reasoning is free, then </think>, then the schema
    m = matcher_for_lark(p.constraint.text)
    ids = hf_tokenizer().encode('hmm, ok</think>{"a": 5}', add_special_tokens=False).ids
    assert all(m.consume_token(t) for t in ids) and m.consume_token(EOS)
    body.pop("response_format")
    body["thinking"] = {"type": "disabled"}
    assert prepare_chat(body).constraint is None
    with pytest.raises(Exception):
        constraint_from_output_constraint(type("OC", (), {"kind": "weird", "schema": ""})())


def test_tool_choice_none_and_named():
    b = _bodies()["chat"]
    b["tool_choice"] = "none"
    assert prepare_chat(b).constraint is None  # recipe drops the tools; the model answers in text
    b["tool_choice"] = {"type": "function", "function": {"name": "ping"}}
    p = prepare_chat(b)
    assert p.output_constraint_kind == "tool_call_required"
    assert 'name=\\"ping\\"' in p.constraint.text and "get_weather" not in p.constraint.text


def test_bad_requests_are_clear_errors():
    with pytest.raises(ChatRequestError, match="rejected"):
        prepare_chat({"model": "m", "messages": [{"role": "wizard", "content": "x"}]})
    with pytest.raises(ChatRequestError):
        prepare_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": CHAT_TOOLS,
                      "tool_choice": "required"})  # required is refused in thinking mode, as DeepSeek does
    with pytest.raises(ChatRequestError, match="not valid JSON"):
        prepare_chat("{oops")


def test_recipe_request_objects_are_accepted():
    req = dr.ChatCompletionRequest(_bodies()["chat"])
    p = prepare_chat(req, version="v4")
    assert p.format == "chat" and "<｜DSML｜tool_calls>" in p.prompt


def test_build_body_wraps_bare_functions():
    body = build_body([{"role": "user", "content": "x"}], tools=[CHAT_TOOLS[1]["function"]], thinking=False)
    assert body["tools"][0]["type"] == "function" and body["thinking"] == {"type": "disabled"}
