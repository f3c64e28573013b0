"""The `deepinfer-sg` command line.

    deepinfer-sg extract --schema schema.json|module:Model --input docs.jsonl --output out.jsonl \\
                         [--prompt-template TEXT|@file] [--model DIR] [--batch-size N] [--max-tokens N]
    deepinfer-sg generate --prompt TEXT [--schema S | --regex R | --grammar FILE] [--max-tokens N] [--model DIR]
    every command: [--speculative off|cpu|automaton] [--draft-tokens N] [--seed N] [--threads N]
    deepinfer-sg chat (--request body.json | --message TEXT [--tools tools.json]) [--stream] [--model DIR]

`--model` omitted: the bundled tiny default model (random weights: outputs are valid, not meaningful).
extract defaults: all documents of a batch of 64 in one continuous batch, up to 1024 tokens per record,
temperature 0 (greedy) with --model, 1.0 (seeded sampling) on the bundled random model, whose greedy path
cycles; one torch thread for the bundled model on CPU (--threads N to override). It ends with a one-line
summary: records, valid, errors, tokens/s, elapsed.
Test-only hook: DEEPINFER_SG_FAKE_MODEL=1 makes `extract` use an instant stand-in model (see
extract.fake_generate_batch); it exists for resume/ordering tests on big inputs and is never for real use.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys


def load_schema_arg(arg: str):
    """'schema.json' -> (schema, None); 'package.module:Model' -> (Model's JSON Schema, Model)."""
    if os.path.exists(arg) or ":" not in arg:
        try:
            with open(arg, encoding="utf-8") as f:
                return json.load(f), None
        except FileNotFoundError:
            raise SystemExit(f"--schema: no such file {arg!r} (give a JSON Schema file or module:Type)") from None
        except json.JSONDecodeError as e:
            raise SystemExit(f"--schema: {arg} is not valid JSON: {e.msg} at line {e.lineno}") from None
    module_name, _, attr = arg.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise SystemExit(f"--schema: cannot load {arg!r}: {e}") from None
    from .typed import json_schema_for_type
    return json_schema_for_type(obj), obj


def _read_text_arg(value: str | None) -> str | None:
    if value is not None and value.startswith("@"):
        with open(value[1:], encoding="utf-8") as f:
            return f.read()
    return value


def _make_llm(args):
    from .llm import LLM
    speculative = None
    if args.speculative != "off":
        from deepinfer_sg.engine.spec_decode import SpecConfig
        speculative = SpecConfig(n=args.draft_tokens, draft_masks=args.speculative)
    return LLM(args.model, seed=args.seed, speculative=speculative)


def _bundled_model_on_cpu(args) -> bool:
    import torch
    return args.model is None and not torch.cuda.is_available()


def _choose_threads(args) -> None:
    """torch intra-op threads. The bundled tiny model's matmuls are far too small to split across cores: extra
    threads only add synchronisation and compete with the grammar mask workers (measured on a 2-core machine:
    a default-model run took 22 s with torch's threads, 5 s with one). So 1 thread for it on CPU; a real
    checkpoint keeps torch's default. --threads N overrides both."""
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    elif _bundled_model_on_cpu(args):
        torch.set_num_threads(1)


def _extract_defaults(args) -> None:
    """Defaults that depend on the model. Temperature: greedy (0) for a real checkpoint, as extraction wants;
    1.0 for the bundled random-weight model, whose greedy path falls into cycles (e.g. the same digits of a
    JSON number forever, never closing it within any token budget) while sampling leaves such a loop with
    positive probability at every step. Sampling stays exact (no bias): the seed makes it reproducible."""
    if args.temperature is None:
        args.temperature = 1.0 if args.model is None else 0.0


def cmd_extract(args) -> int:
    import time

    from . import extract as ex

    t_start = time.perf_counter()
    _extract_defaults(args)
    schema, output_type = load_schema_arg(args.schema)
    config = ex.ExtractConfig(schema=schema, output_type=output_type, batch_size=args.batch_size,
                              prompt_template=_read_text_arg(args.prompt_template) or ex.DEFAULT_TEMPLATE,
                              id_field=args.id_field, text_field=args.text_field)
    if os.environ.get("DEEPINFER_SG_FAKE_MODEL") == "1":  # test-only stand-in model
        generate_batch, make_prompt = ex.fake_generate_batch, (lambda s: s)
    else:
        from .chat import model_version
        from .grammars import JsonSchema
        llm = _make_llm(args)
        generate_batch = ex.llm_generate_batch(llm, JsonSchema(schema, whitespace="compact"),
                                               max_tokens=args.max_tokens, temperature=args.temperature,
                                               seed=args.seed)
        make_prompt = ex.chat_prompt_maker(schema, model_version(llm), llm.tokenizer)
    try:
        stats = ex.run_extract(args.input, args.output, generate_batch, config, make_prompt=make_prompt,
                               progress=None if not args.no_progress else False)
    except ex.ResumeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: every finished batch is saved; run the same command again to resume",
              file=sys.stderr)
        return 130
    elapsed = time.perf_counter() - t_start
    print(json.dumps({"input_lines": stats.total_lines, "resumed": stats.resumed_lines, "written": stats.written,
                      "errors": stats.errors, "generated_tokens": stats.generated_tokens}), file=sys.stderr)
    print(summary_line(stats, elapsed, args.output), file=sys.stderr)
    return 0


def summary_line(stats, elapsed_s: float, output) -> str:
    """The one-line human summary printed at the end of `extract` (this run's records only)."""
    valid = stats.written - stats.errors
    rate = stats.generated_tokens / stats.generation_s if stats.generation_s > 0 else \
        stats.generated_tokens / max(elapsed_s, 1e-9)
    resumed = f", {stats.resumed_lines} already done" if stats.resumed_lines else ""
    return (f"extract: {stats.written} records ({valid} valid, {stats.errors} errors{resumed}), "
            f"{stats.generated_tokens} tokens at {rate:.1f} tokens/s, {elapsed_s:.1f} s elapsed -> {output}")


def cmd_generate(args) -> int:
    from .grammars import Grammar, Regex
    from .sampling_params import SamplingParams

    constraint, output_type = None, None
    if args.schema:
        schema, output_type = load_schema_arg(args.schema)
        if output_type is None:
            from .grammars import JsonSchema
            constraint = JsonSchema(schema)
    elif args.regex:
        constraint = Regex(args.regex)
    elif args.grammar:
        text = _read_text_arg("@" + args.grammar)
        constraint = Grammar(text, syntax="lark" if args.grammar.endswith(".lark") else "ebnf")
    llm = _make_llm(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    out = llm.generate([args.prompt], params, constraint=constraint, output_type=output_type)[0]
    print(json.dumps({"text": out.text, "finish_reason": out.finish_reason, "error": out.error},
                     ensure_ascii=False))
    return 0 if out.finish_reason != "error" else 1


def cmd_chat(args) -> int:
    from .chat import ChatRequestError, chat

    if args.request:
        with open(args.request, encoding="utf-8") as f:
            request = json.load(f)
    elif args.message is not None:
        tools = None
        if args.tools:
            with open(args.tools, encoding="utf-8") as f:
                tools = json.load(f)
        request = {"messages": [{"role": "user", "content": args.message}],
                   "thinking": {"type": "enabled" if args.thinking else "disabled"}}
        if tools:
            request["tools"] = tools
    else:
        raise SystemExit("chat: give --request FILE or --message TEXT")
    llm = _make_llm(args)
    try:
        result = chat(llm, request, max_tokens=args.max_tokens, seed=args.seed, stream=args.stream)
        if args.stream:
            for chunk in result:
                print(json.dumps(chunk, ensure_ascii=False), flush=True)
        else:
            print(json.dumps(result, ensure_ascii=False, indent=2))
    except ChatRequestError as e:
        print(f"error ({e.status_code}): {e}", file=sys.stderr)
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deepinfer-sg", description="Constrained generation for DeepSeek-V4 models.")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp, max_tokens, temperature=0.0):
        sp.add_argument("--model", default=None, help="checkpoint folder (default: the bundled tiny model)")
        sp.add_argument("--max-tokens", type=int, default=max_tokens)
        sp.add_argument("--temperature", type=float, default=temperature)
        sp.add_argument("--seed", type=int, default=0)
        sp.add_argument("--speculative", default="off", choices=["off", "cpu", "automaton"],
                        help="DSpark speculative decoding with grammar-aware drafts; masks for the drafts from the "
                             "CPU matchers or a device token automaton per regular constraint (default: off)")
        sp.add_argument("--draft-tokens", type=int, default=5, help="drafts per block with --speculative")
        sp.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: 1 for the bundled tiny model on CPU, else torch's)")

    e = sub.add_parser("extract", help="JSONL documents -> one typed JSON record per line (resumable)")
    e.add_argument("--schema", required=True, help="JSON Schema file or module:Model (pydantic, dataclass...)")
    e.add_argument("--input", required=True)
    e.add_argument("--output", required=True)
    e.add_argument("--prompt-template", default=None, help="str.format template over each record, or @file")
    e.add_argument("--batch-size", type=int, default=64,
                   help="documents per generate call (one continuous batch; also the resume granularity)")
    e.add_argument("--id-field", default="id")
    e.add_argument("--text-field", default="text")
    e.add_argument("--no-progress", action="store_true")
    common(e, EXTRACT_MAX_TOKENS, temperature=None)
    e.set_defaults(func=cmd_extract)

    g = sub.add_parser("generate", help="one prompt, optionally constrained")
    g.add_argument("--prompt", required=True)
    group = g.add_mutually_exclusive_group()
    group.add_argument("--schema")
    group.add_argument("--regex")
    group.add_argument("--grammar", help="grammar file (.ebnf GBNF-style or .lark)")
    common(g, 64)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="a Chat Completions / Messages / Responses request, DSML tool calls")
    c.add_argument("--request", help="JSON request body file (format detected)")
    c.add_argument("--message", help="a single user message (Chat Completions)")
    c.add_argument("--tools", help="JSON file with an OpenAI tools list (with --message)")
    c.add_argument("--thinking", action="store_true", help="thinking mode (with --message)")
    c.add_argument("--stream", action="store_true")
    common(c, 128)
    c.set_defaults(func=cmd_chat)
    return p


# Token budget per extracted record. A schema whose strings are bounded (maxLength) still has unbounded JSON
# numbers; 1024 tokens lets even the bundled random model close every field (its records average ~200 tokens)
# while a record that does run out still becomes a structured error record, never a lost line.
EXTRACT_MAX_TOKENS = 1024


def main(argv=None) -> int:
    import torch

    args = build_parser().parse_args(argv)
    threads = torch.get_num_threads()
    _choose_threads(args)
    try:
        return args.func(args)
    finally:
        torch.set_num_threads(threads)   # main() is also called in-process (tests, notebooks)


if __name__ == "__main__":
    sys.exit(main())
