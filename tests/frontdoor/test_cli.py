"""The CLI entry points on the real default model (shared LLM, tiny outputs): extract, generate, chat."""
import json

import jsonschema
import pytest

from deepinfer_sg import cli
from deepinfer_sg.extract import ExtractConfig, chat_prompt_maker, llm_generate_batch, run_extract
from deepinfer_sg.grammars import JsonSchema

SCHEMA = {"type": "object", "properties": {"label": {"enum": ["spam", "ham"]}, "score": {"type": "integer"}},
          "required": ["label", "score"], "additionalProperties": False}


@pytest.fixture
def cli_llm(default_llm, monkeypatch):
    monkeypatch.setattr(cli, "_make_llm", lambda args: default_llm)
    return default_llm


def test_extract_on_default_model(tmp_path, default_llm):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text('{"id": 7, "text": "WIN MONEY NOW"}\nnot json\n')
    gen = llm_generate_batch(default_llm, JsonSchema(SCHEMA, whitespace="compact"), max_tokens=8)
    stats = run_extract(inp, out, gen, ExtractConfig(schema=SCHEMA, batch_size=2),
                        make_prompt=chat_prompt_maker(SCHEMA, "v4.1", default_llm.tokenizer), progress=False)
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["line"] for r in recs] == [0, 1] and recs[0]["id"] == 7
    assert recs[1]["error"]["type"] == "bad_input" and stats.errors >= 1
    for r in recs[:1]:
        if "output" in r:
            jsonschema.validate(r["output"], SCHEMA)
        else:  # only max_tokens may stop a record short of valid JSON
            assert r["error"]["type"] == "invalid_json" and r["error"]["finish_reason"] == "length"


def test_generate_command(cli_llm, capsys):
    assert cli.main(["generate", "--prompt", "Answer:", "--regex", "(yes|no)", "--max-tokens", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["text"] in ("yes", "no", "y", "n", "") or out["finish_reason"] == "length"


def test_chat_command_with_tools(cli_llm, tmp_path, capsys):
    tools = tmp_path / "tools.json"
    params = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    tools.write_text(json.dumps([{"type": "function", "function": {"name": "f", "parameters": params}}]))
    req = tmp_path / "req.json"
    req.write_text(json.dumps({"messages": [{"role": "user", "content": "call f"}], "tools": json.loads(tools.read_text()),
                               "tool_choice": "required", "thinking": {"type": "disabled"}}))
    assert cli.main(["chat", "--request", str(req), "--max-tokens", "10"]) == 0
    resp = json.loads(capsys.readouterr().out)
    choice = resp["choices"][0]
    for call in choice["message"].get("tool_calls") or []:
        if choice["finish_reason"] == "tool_calls":
            jsonschema.validate(json.loads(call["function"]["arguments"]), params)


def test_chat_command_streams(cli_llm, capsys):
    assert cli.main(["chat", "--message", "Hi", "--stream", "--max-tokens", "4"]) == 0
    chunks = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert chunks and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"] == [] or chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop", None)
    assert any(c["choices"] and c["choices"][0]["finish_reason"] == "length" for c in chunks)


def test_schema_argument_forms(tmp_path, monkeypatch):
    f = tmp_path / "s.json"
    f.write_text(json.dumps(SCHEMA))
    assert cli.load_schema_arg(str(f)) == (SCHEMA, None)
    (tmp_path / "mymodels.py").write_text("from pydantic import BaseModel\nclass M(BaseModel):\n    a: int\n")
    monkeypatch.chdir(tmp_path)
    schema, tp = cli.load_schema_arg("mymodels:M")
    assert tp.__name__ == "M" and schema["required"] == ["a"]
    with pytest.raises(SystemExit, match="cannot load"):
        cli.load_schema_arg("mymodels:Nope")
    with pytest.raises(SystemExit, match="no such file"):
        cli.load_schema_arg(str(tmp_path / "missing.json"))


def test_generate_with_speculation_and_device_automaton(monkeypatch, capsys):
    """--speculative automaton: the LLM gets a SpecConfig with device draft masks, and generation through it still
    produces text of the constraint's language (re.fullmatch is the oracle)."""
    import re
    args = cli.build_parser().parse_args(["generate", "--prompt", "Code:", "--regex", "x", "--speculative",
                                          "automaton", "--draft-tokens", "3"])
    llm = cli._make_llm(args)
    cfg = llm.engine.spec.config
    assert (cfg.draft_masks, cfg.n) == ("automaton", 3)
    monkeypatch.setattr(cli, "_make_llm", lambda a: llm)
    pattern = r"[a-c]{2}-[0-9]{2}"
    assert cli.main(["generate", "--prompt", "Code:", "--regex", pattern, "--max-tokens", "12",
                     "--speculative", "automaton"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert re.fullmatch(pattern, out["text"]) and out["finish_reason"] in ("stop", "constraint_complete")
