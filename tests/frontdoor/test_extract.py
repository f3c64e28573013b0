"""Extraction: one record per input line, in order, error records for bad lines, and crash-safe resume
(SIGKILL in the middle, a torn last line) checked against an uninterrupted run of the same input."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deepinfer_sg.extract import (ExtractConfig, Generation, ResumeError, run_extract, scan_existing_output)

REPO = Path(__file__).resolve().parents[2]


def _write_input(path: Path, n: int, corrupt_every: int = 97) -> set:
    """n lines; every `corrupt_every`-th line is malformed in one of several ways. Returns the bad line numbers."""
    bad = set()
    kinds = [b"{not json", b"[1, 2, 3]", b"", b'{"id": "x", "body": "no text field"}', b"\xff\xfe garbage",
             b'"just a string"']
    with open(path, "wb") as f:
        for i in range(n):
            if i % corrupt_every == 5:
                f.write(kinds[(i // corrupt_every) % len(kinds)] + b"\n")
                bad.add(i)
            else:
                rec = {"id": f"doc-{i}", "text": f"Invoice {i} from Zoë GmbH, total {i * 3 % 1000}.{i % 100:02d} EUR"}
                f.write(json.dumps(rec, ensure_ascii=False).encode() + b"\n")
    return bad


def _echo_batch(prompts):
    # An independent stand-in model: echoes the prompt's length, as JSON.
    return [Generation(json.dumps({"n": len(p)}), "stop") for p in prompts]


def _read(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_records_in_order_with_errors(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    bad = _write_input(inp, 300, corrupt_every=17)
    stats = run_extract(inp, out, _echo_batch, ExtractConfig(schema={}, batch_size=7, prompt_template="{text}"),
                        progress=False)
    recs = _read(out)
    assert [r["line"] for r in recs] == list(range(300))
    assert stats.written == 300 and stats.errors == len(bad)
    for i, r in enumerate(recs):
        if i in bad:
            assert "error" in r and r["error"]["type"] == "bad_input"
        else:
            assert r["id"] == f"doc-{i}"
            text = f"Invoice {i} from Zoë GmbH, total {i * 3 % 1000}.{i % 100:02d} EUR"
            assert r["output"] == {"n": len(text)}


def test_failing_batch_and_bad_outputs_become_error_records(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_input(inp, 20, corrupt_every=1000)
    calls = []

    def flaky(prompts):
        calls.append(len(prompts))
        if len(calls) == 2:
            raise RuntimeError("device lost")
        return [Generation('{"a": 1', "length") if i == 0 else Generation('{"a": 1}') for i, _ in enumerate(prompts)]

    run_extract(inp, out, flaky, ExtractConfig(schema={}, batch_size=5), progress=False)
    recs = _read(out)
    assert len(recs) == 20
    assert recs[5]["error"]["type"] == "bad_input"  # line 5 is a malformed input line
    assert all(r["error"]["type"] == "generation_error" for r in recs[6:10])
    assert recs[10]["error"]["type"] == "invalid_json" and recs[11]["output"] == {"a": 1}
    assert recs[0]["error"]["type"] == "invalid_json" and recs[0]["error"]["finish_reason"] == "length"
    assert recs[1]["output"] == {"a": 1}


def test_typed_output_validation(tmp_path):
    from pydantic import BaseModel, Field

    class Out(BaseModel):
        a: int = Field(ge=0)

    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_input(inp, 4, corrupt_every=1000)
    gens = iter([Generation('{"a": 3}'), Generation('{"a": -1}'), Generation('{"b": 1}'), Generation("{")])
    run_extract(inp, out, lambda ps: [next(gens) for _ in ps], ExtractConfig(schema={}, output_type=Out),
                progress=False)
    recs = _read(out)
    assert recs[0]["output"] == {"a": 3}
    assert recs[1]["error"]["type"] == "validation_error" and recs[1]["error"]["errors"][0]["loc"] == ["a"]
    assert recs[2]["error"]["type"] == "validation_error"
    assert recs[3]["error"]["type"] == "invalid_json"


def test_resume_truncates_torn_line_and_rejects_foreign_output(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_input(inp, 50, corrupt_every=1000)
    ref = tmp_path / "ref.jsonl"
    run_extract(inp, ref, _echo_batch, ExtractConfig(schema={}, batch_size=8), progress=False)
    lines = ref.read_bytes().splitlines(keepends=True)
    out.write_bytes(b"".join(lines[:21]) + lines[21][:10])  # 21 good lines + a torn one
    stats = run_extract(inp, out, _echo_batch, ExtractConfig(schema={}, batch_size=8), progress=False)
    assert stats.resumed_lines == 21 and stats.truncated_bytes == 10 and stats.written == 29
    assert out.read_bytes() == ref.read_bytes()
    # an output of a different input is refused, not silently extended
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"id": f"zzz-{i}", "text": "t"}) + "\n" for i in range(60)))
    with pytest.raises(ResumeError):
        run_extract(other, out, _echo_batch, ExtractConfig(schema={}), progress=False)
    # a bad line in the middle is not a torn tail
    broken = tmp_path / "broken.jsonl"
    broken.write_bytes(lines[0] + b"garbage\n" + lines[2])
    with pytest.raises(ResumeError):
        scan_existing_output(broken)


def _cli(args, env_extra, **kw):
    env = {**os.environ, "DEEPINFER_SG_FAKE_MODEL": "1", "PYTHONPATH": str(REPO), **env_extra}
    return subprocess.Popen([sys.executable, "-m", "deepinfer_sg.cli", *args], env=env, cwd=str(REPO),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def _count(path):
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except FileNotFoundError:
        return 0


def test_cli_10k_lines_sigkill_and_resume(tmp_path):
    inp = tmp_path / "docs.jsonl"
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object"}))
    bad = _write_input(inp, 10_000)
    args = lambda out: ["extract", "--schema", str(schema), "--input", str(inp), "--output", str(out),
                        "--batch-size", "64", "--no-progress"]
    ref = tmp_path / "ref.jsonl"
    p = _cli(args(ref), {})
    assert p.wait(timeout=120) == 0, p.stderr.read().decode()

    out = tmp_path / "out.jsonl"
    p = _cli(args(out), {"DEEPINFER_SG_FAKE_DELAY_S": "0.01"})
    deadline = time.time() + 60
    while _count(out) < 2000 and time.time() < deadline and p.poll() is None:
        time.sleep(0.01)
    assert p.poll() is None, "finished before it could be killed"
    p.send_signal(signal.SIGKILL)
    p.wait()
    killed_at = _count(out)
    assert 0 < killed_at < 10_000
    with open(out, "ab") as f:  # a torn write, as a crash mid-append leaves it
        f.write(b'{"line": ' + str(killed_at).encode() + b', "id": "doc-')
    p = _cli(args(out), {})
    assert p.wait(timeout=120) == 0, p.stderr.read().decode()

    assert out.read_bytes() == ref.read_bytes()  # nothing lost, nothing duplicated, same order
    recs = _read(out)
    assert len(recs) == 10_000 and [r["line"] for r in recs] == list(range(10_000))
    assert {r["line"] for r in recs if "error" in r} == bad
    # a third run finds everything done and writes nothing
    p = _cli(args(out), {})
    assert p.wait(timeout=120) == 0
    assert out.read_bytes() == ref.read_bytes()
