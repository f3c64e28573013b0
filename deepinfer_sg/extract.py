"""Extraction at scale: JSONL documents in, one typed JSON record out per input line, resumable.

    stats = run_extract("docs.jsonl", "out.jsonl", generate_batch, ExtractConfig(schema=..., batch_size=32))

Guarantees:
* exactly one output line per input line, in input order: {"line": n, "id": <the input's id>, "output": {...}}
  or {"line": n, "id": ..., "error": {"type": ..., "message": ...}}. A malformed input line (not JSON, not
  an object, no text field, a template field missing) gets an error record; the run goes on.
* interrupted (Ctrl-C, SIGKILL, power loss) and re-run with the same arguments, it resumes: the existing
  output is read and checked line by line against the input (line numbers and ids), a torn last line is
  truncated away, and work continues after the last complete line. Each batch is appended with one write
  and fsync'ed before the next batch starts, so at most the batch in flight is redone, never duplicated.
* the input is streamed (never loaded whole); memory is O(batch_size).

`generate_batch(prompts) -> list[Generation]` does the model work; prompts are token-id lists (or strings)
and results come back in the same order. `llm_generate_batch(llm, ...)` adapts an LLM; tests pass fakes.
Cost: one JSON parse per input line plus the generation; the resume scan reads the output file once.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

DEFAULT_TEMPLATE = ("Extract the information from the document below as JSON matching the schema.\n\n"
                    "Document:\n{text}")


@dataclass
class Generation:
    """One model result: the generated text, why it stopped, and an error message if generation failed."""

    text: str
    finish_reason: str = "stop"
    error: Optional[str] = None
    num_tokens: int = 0


@dataclass
class ExtractConfig:
    """schema: JSON Schema (dict) the outputs follow; output_type: optional Python type (pydantic model...)
    used to validate each output; prompt_template: str.format template over the input record's fields."""

    schema: dict
    output_type: Any = None
    prompt_template: str = DEFAULT_TEMPLATE
    batch_size: int = 16
    id_field: str = "id"
    text_field: str = "text"


@dataclass
class ExtractStats:
    total_lines: int = 0        # input lines seen (including resumed ones)
    resumed_lines: int = 0      # lines already present in the output at start
    written: int = 0            # lines written by this run
    errors: int = 0             # error records written by this run
    generated_tokens: int = 0
    generation_s: float = 0.0   # wall time inside generate_batch (model work), for tokens/s
    truncated_bytes: int = 0    # size of a torn last line removed at start


class ResumeError(RuntimeError):
    """The existing output does not belong to this input (a line number or id differs)."""


@dataclass
class _Item:
    line: int
    id: Any
    prompt: Any = None
    error: Optional[dict] = None
    output: Any = field(default=None)


# ----------------------------------------------------------------------------------------------------------
# reading input


def iter_input_lines(path) -> Iterator[tuple[int, str]]:
    """(line number from 0, raw text without the newline) for every line; bytes that are not UTF-8 are
    kept as replacement characters so the line still gets its (error) record."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f):
            yield n, raw.rstrip(b"\r\n").decode("utf-8", errors="replace")


def parse_input_line(n: int, raw: str, config: ExtractConfig, make_prompt: Callable[[str], Any]) -> _Item:
    """An input line -> an item with a prompt, or with an error record (never raises)."""
    try:
        record = json.loads(raw)
    except (json.JSONDecodeError, RecursionError) as e:
        return _Item(n, None, error={"type": "bad_input", "message": f"line {n + 1} is not JSON: {e}"})
    if not isinstance(record, dict):
        return _Item(n, None, error={"type": "bad_input",
                                     "message": f"line {n + 1} is a JSON {type(record).__name__}, not an object"})
    rid = record.get(config.id_field, n)
    if config.text_field not in record and "{" + config.text_field + "}" in config.prompt_template:
        return _Item(n, rid, error={"type": "bad_input",
                                    "message": f"line {n + 1} has no {config.text_field!r} field"})
    try:
        text = config.prompt_template.format_map(_Fields(record))
        return _Item(n, rid, prompt=make_prompt(text))
    except KeyError as e:
        return _Item(n, rid, error={"type": "bad_input", "message": f"line {n + 1} lacks template field {e}"})
    except Exception as e:  # noqa: BLE001 - one bad line never stops the run
        return _Item(n, rid, error={"type": "bad_input", "message": f"line {n + 1}: {type(e).__name__}: {e}"})


class _Fields(dict):
    """Template fields: the record's values, with nested values as JSON."""

    def __getitem__(self, key):
        value = dict.__getitem__(self, key)
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


# ----------------------------------------------------------------------------------------------------------
# resume


def scan_existing_output(path) -> tuple[list[Any], int]:
    """Read an existing output file: returns (ids of its complete lines in order, bytes truncated).

    A last line without its newline, or one that is not a JSON object, is a torn write: it is cut off
    (the file is truncated to the end of the last good line). A bad line *before* the last one means the
    file is not ours: ResumeError.
    """
    if not os.path.exists(path):
        return [], 0
    ids, good_end, pos, torn = [], 0, 0, False
    with open(path, "rb") as f:
        for k, raw in enumerate(f):
            if torn:  # a bad line followed by more lines: not a torn tail
                raise ResumeError(f"{path}: line {k} is not a complete record for input line {k}; "
                                  "is this the output of another input? (delete it to start over)")
            rec = None
            if raw.endswith(b"\n"):
                try:
                    rec = json.loads(raw.decode("utf-8"))
                except (UnicodeDecodeError, json.JSONDecodeError):
                    rec = None
            pos += len(raw)
            if not isinstance(rec, dict) or rec.get("line") != k:
                torn = True
                continue
            ids.append(rec.get("id"))
            good_end = pos
    truncated = pos - good_end
    if truncated:
        with open(path, "r+b") as f:
            f.truncate(good_end)
            f.flush()
            os.fsync(f.fileno())
    return ids, truncated


def _append_lines(f, records: list[dict]) -> None:
    """One write per batch, then fsync: a crash leaves at most one torn line, which resume removes."""
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
    f.write(data)
    f.flush()
    os.fsync(f.fileno())


# ----------------------------------------------------------------------------------------------------------
# the loop


def finish_item(item: _Item, gen: Generation, config: ExtractConfig) -> dict:
    """The output record of one item from its generation (never raises)."""
    base = {"line": item.line, "id": item.id}
    if gen.error is not None or gen.finish_reason == "error":
        return {**base, "error": {"type": "generation_error", "message": gen.error or "generation failed"}}
    if config.output_type is not None:
        from .typed import parse_output
        value, err = parse_output(config.output_type, gen.text)
        if err is not None:
            return {**base, "error": {**err, "finish_reason": gen.finish_reason}}
        try:
            from pydantic import TypeAdapter
            return {**base, "output": TypeAdapter(config.output_type).dump_python(value, mode="json")}
        except Exception as e:  # noqa: BLE001
            return {**base, "error": {"type": "internal_error", "message": str(e)}}
    try:
        return {**base, "output": json.loads(gen.text)}
    except json.JSONDecodeError as e:
        return {**base, "error": {"type": "invalid_json", "message": e.msg, "position": e.pos,
                                  "finish_reason": gen.finish_reason, "text": gen.text}}


def run_extract(input_path, output_path, generate_batch: Callable[[list], list[Generation]],
                config: ExtractConfig, *, make_prompt: Callable[[str], Any] = lambda s: s,
                progress: Optional[bool] = None) -> ExtractStats:
    """Stream `input_path`, batch it, write one record per line to `output_path` (resuming if it exists).

    make_prompt: prompt text -> what generate_batch takes (e.g. token ids of the chat-rendered prompt).
    progress: tqdm bar with throughput; default on only when stderr is a terminal.
    """
    stats = ExtractStats()
    done_ids, stats.truncated_bytes = scan_existing_output(output_path)
    stats.resumed_lines = len(done_ids)
    if progress is None:
        progress = sys.stderr.isatty()
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=_count_lines(input_path), initial=len(done_ids), unit="doc", desc="extract",
                   dynamic_ncols=True)
    os.makedirs(os.path.dirname(os.path.abspath(output_path)), exist_ok=True)
    try:
        with open(output_path, "ab") as out:
            batch: list[_Item] = []
            for n, raw in iter_input_lines(input_path):
                stats.total_lines += 1
                if n < len(done_ids):
                    _check_resumed(n, raw, done_ids[n], config, output_path)
                    continue
                batch.append(parse_input_line(n, raw, config, make_prompt))
                if len(batch) >= config.batch_size:
                    _run_batch(batch, generate_batch, config, out, stats, bar)
                    batch = []
            if batch:
                _run_batch(batch, generate_batch, config, out, stats, bar)
            if len(done_ids) > stats.total_lines:
                raise ResumeError(f"{output_path} has {len(done_ids)} records but the input has only "
                                  f"{stats.total_lines} lines")
    finally:
        if bar is not None:
            bar.close()
    return stats


def _check_resumed(n: int, raw: str, done_id, config: ExtractConfig, output_path) -> None:
    try:
        record = json.loads(raw)
    except (json.JSONDecodeError, RecursionError):
        return
    if isinstance(record, dict):
        expected = record.get(config.id_field, n)
        if expected != done_id:
            raise ResumeError(f"{output_path} line {n + 1} has id {done_id!r} but input line {n + 1} has "
                              f"id {expected!r}; the output belongs to another input")


def _run_batch(batch: list[_Item], generate_batch, config: ExtractConfig, out, stats: ExtractStats, bar) -> None:
    todo = [it for it in batch if it.error is None]
    results: list[Generation] = []
    if todo:
        t0 = time.perf_counter()
        try:
            results = list(generate_batch([it.prompt for it in todo]))
            if len(results) != len(todo):
                raise RuntimeError(f"generate_batch returned {len(results)} results for {len(todo)} prompts")
        except Exception as e:  # noqa: BLE001 - a failing batch becomes error records, the run goes on
            results = [Generation("", "error", f"{type(e).__name__}: {e}") for _ in todo]
        stats.generation_s += time.perf_counter() - t0
    by_line = {it.line: g for it, g in zip(todo, results)}
    records = []
    for it in batch:
        if it.error is not None:
            records.append({"line": it.line, "id": it.id, "error": it.error})
        else:
            gen = by_line[it.line]
            stats.generated_tokens += gen.num_tokens
            records.append(finish_item(it, gen, config))
    _append_lines(out, records)
    stats.written += len(records)
    stats.errors += sum("error" in r for r in records)
    if bar is not None:
        bar.update(len(records))
        bar.set_postfix(errors=stats.errors, tokens=stats.generated_tokens, refresh=False)


def _count_lines(path) -> int:
    n = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            n += chunk.count(b"\n")
    return n


# ----------------------------------------------------------------------------------------------------------
# adapters


def llm_generate_batch(llm, spec, *, max_tokens: int = 256, temperature: float = 0.0, seed: int = 0):
    """generate_batch over an LLM: every prompt constrained by `spec` (e.g. a JsonSchema)."""
    from .sampling_params import SamplingParams

    def generate_batch(prompts: list) -> list[Generation]:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
        outs = llm.generate(list(prompts), params, constraint=spec, use_tqdm=False)
        return [Generation(o.text, o.finish_reason or "stop", o.error, len(o.token_ids)) for o in outs]

    return generate_batch


def chat_prompt_maker(schema: dict, version: str = "v4.1", tokenizer=None):
    """Prompt text -> token ids of a one-turn, non-thinking chat prompt (deepseek-recipe's encoding), with the
    schema rendered as the response format, as DeepSeek's template does for json_schema requests."""
    from .chat import prepare_chat

    def make(text: str) -> list[int]:
        body = {"messages": [{"role": "user", "content": text}], "thinking": {"type": "disabled"},
                "response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}}
        return prepare_chat(body, format="chat", version=version, tokenizer=tokenizer).prompt_token_ids

    return make


def fake_generate_batch(prompts: list) -> list[Generation]:
    """TEST-ONLY stand-in model (enabled by DEEPINFER_SG_FAKE_MODEL=1 in the CLI): returns a small JSON object
    derived from each prompt, instantly, so resume/ordering logic can be tested on big inputs without a model.
    DEEPINFER_SG_FAKE_DELAY_S adds a per-batch sleep so a test can kill the process mid-run."""
    import hashlib
    import time

    delay = float(os.environ.get("DEEPINFER_SG_FAKE_DELAY_S", "0") or 0)
    if delay:
        time.sleep(delay)
    out = []
    for p in prompts:
        text = p if isinstance(p, str) else json.dumps(p)
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]
        out.append(Generation(json.dumps({"digest": digest, "chars": len(text)}), "stop", None, 1))
    return out
