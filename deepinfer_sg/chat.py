"""Chat requests in, API-shaped responses out, through DeepSeek's own translation layer (deepseek-recipe).

What deepseek-recipe already does, and we only call: converting Chat Completions / Messages / Responses
requests into one Conversation (tools moved onto the system message, tool_choice, thinking, reasoning effort,
sampling defaults), rendering and encoding it with the V4 or V4.1 prompt encoding, naming the constraint the
output must satisfy (`OutputConstraint`: json / regex / tool_call / tool_call_required), and parsing model
output (token ids, streamed or not) back into response objects or stream events of the requested format.

What this module adds: choosing the encoding from the *model we run* (V4 or V4.1) whatever the request's
model name says, turning the OutputConstraint into a grammars spec that our engine enforces token by token
(DSML tool-call grammars typed by each tool's schema, see grammars/dsml.py), and running the request on an LLM.

    prepared = prepare_chat({"model": "x", "messages": [...], "tools": [...]}, version="v4.1")
    out = llm.generate([prepared.prompt_token_ids], SamplingParams(...), constraint=prepared.constraint)[0]
    response = parse_completion(prepared, out.token_ids, out.finish_reason)     # a dict in the request's format

or simply `chat(llm, request)` / `chat(llm, messages, tools=[...])`, and `chat(..., stream=True)` for chunks.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterator

import deepseek_recipe as dr

from deepinfer_sg.grammars.dsml import after_reasoning_grammar, dsml_grammar
from deepinfer_sg.grammars.specs import ConstraintError, JsonSchema, Regex

FORMATS = ("chat", "messages", "responses")
_REQUEST_CLASS = {"chat": dr.ChatCompletionRequest, "messages": dr.MessagesRequest, "responses": dr.ResponsesRequest}
_RESPONSE_CLASS = {"chat": dr.ChatCompletionResponse, "messages": dr.MessagesResponse,
                   "responses": dr.ResponsesResponse}
_VERSION = {"v4": dr.ModelVersion.DeepseekV4Pro, "v4.1": dr.ModelVersion.DeepseekV41Flash}


class ChatRequestError(ValueError):
    """A chat request deepseek-recipe rejected or that cannot be run; `status_code` follows HTTP usage."""

    def __init__(self, message: str, status_code: int = 400):
        super().__init__(message)
        self.status_code = status_code


@dataclass
class PreparedChat:
    """Everything needed to run one chat request and to parse its output.

    prompt / prompt_token_ids: the rendered prompt and its ids (template pieces as special tokens, message
    text as plain BPE). constraint: a grammars spec (or None) for the whole completion. max_tokens etc.: the
    sampling values recipe resolved (temperature is 1.0 in thinking mode, as DeepSeek serves it).
    """

    format: str
    model_name: str
    version: str
    thinking: bool
    prompt: str
    prompt_token_ids: list[int]
    constraint: Any
    output_constraint_kind: str | None
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    seed: int | None
    stream: bool
    request: Any = field(repr=False)           # recipe ConversationRequest (makes chunk generators)
    parsing_options: Any = field(repr=False)
    tokenizer: Any = field(repr=False)         # recipe Tokenizer that decodes output ids


def detect_format(body: dict) -> str:
    """'responses' if the body has `input`; 'messages' for Anthropic-shaped bodies; else 'chat'."""
    if "input" in body and "messages" not in body:
        return "responses"
    if "system" in body or any(isinstance(t, dict) and "input_schema" in t for t in body.get("tools") or []):
        return "messages"
    for m in body.get("messages") or []:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(isinstance(b, dict) and b.get("type") in ("tool_use", "tool_result")
                                             for b in content):
            return "messages"
    return "chat"


def model_version(llm_or_model) -> str:
    """'v4.1' or 'v4' for an LLM, a Model or a ModelConfig (V4.1 networks use the V4.1 compressor style)."""
    obj = getattr(llm_or_model, "model", llm_or_model)
    cfg = getattr(obj, "config", obj)
    style = getattr(cfg, "compressor_style", None)
    if style is not None:
        return "v4.1" if style == "v41" else "v4"
    return "v4.1"


# id(tokenizers.Tokenizer) -> (that tokenizer, recipe Tokenizer). The strong reference keeps the id from being
# reused; serializing a 129k vocabulary to build recipe's copy costs ~0.5 s, so it happens once per tokenizer.
_RECIPE_TOKENIZERS: dict[int, tuple] = {}


def recipe_tokenizer(tokenizer=None):
    """deepseek-recipe's Tokenizer for a `tokenizers.Tokenizer` (default: the bundled DeepSeek-V4 one)."""
    if tokenizer is None:
        from deepinfer_sg.tokenizer import load_tokenizer
        tokenizer = load_tokenizer()
    if isinstance(tokenizer, dr.Tokenizer):
        return tokenizer
    hit = _RECIPE_TOKENIZERS.get(id(tokenizer))
    if hit is None or hit[0] is not tokenizer:
        hit = (tokenizer, dr.Tokenizer.from_str(tokenizer.to_str()))
        _RECIPE_TOKENIZERS[id(tokenizer)] = hit
    return hit[1]


_ENCODINGS: dict[tuple, Any] = {}


def _encoding(version: str, rtok):
    """The recipe encoding for `version` with `rtok` attached (attaching copies the vocabulary: ~80 ms)."""
    key = (version, id(rtok))
    hit = _ENCODINGS.get(key)
    if hit is None or hit[0] is not rtok:
        enc = dr.DeepseekV41Encoding() if version == "v4.1" else dr.DeepseekV4Encoding()
        hit = (rtok, enc.with_tokenizer(rtok))
        _ENCODINGS[key] = hit
    return hit[1]


def build_body(messages, *, model: str = "deepinfer-sg", tools=None, tool_choice=None, thinking=None,
               response_format=None, **extra) -> dict:
    """A Chat Completions body from a message list and options."""
    body = {"model": model, "messages": list(messages), **extra}
    if tools:
        body["tools"] = [t if "type" in t else {"type": "function", "function": t} for t in tools]
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    if thinking is not None:
        body["thinking"] = {"type": "enabled" if thinking else "disabled"}
    if response_format is not None:
        body["response_format"] = response_format
    return body


def prepare_chat(request, *, format: str | None = None, version: str = "v4.1", tokenizer=None,
                 default_thinking: bool = True, hf_tokenizer=None) -> PreparedChat:
    """Convert, render, encode and constrain one request.

    request: a dict/JSON body of the given `format` (detected when None), or a recipe ChatCompletionRequest /
    MessagesRequest / ResponsesRequest object (consumed, as recipe does). The request's model name is mapped
    to `version`, the model actually run. Raises ChatRequestError (recipe's message and status) on bad input.
    """
    if version not in _VERSION:
        raise ValueError(f"version must be 'v4' or 'v4.1', got {version!r}")
    if isinstance(request, (str, bytes)):
        try:
            request = json.loads(request)
        except json.JSONDecodeError as e:
            raise ChatRequestError(f"request body is not valid JSON: {e.msg} at column {e.colno}") from None
    any_tool = False  # Anthropic tool_choice {"type": "any"}: a tool call is mandatory
    if isinstance(request, dict):
        fmt = format or detect_format(request)
        choice = request.get("tool_choice")
        any_tool = fmt == "messages" and isinstance(choice, dict) and choice.get("type") == "any"
        if fmt not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
        body = dict(request)
        body.setdefault("model", "deepinfer-sg")
        try:
            req = _REQUEST_CLASS[fmt](body)
        except ValueError as e:  # recipe parses the body eagerly and names the bad field
            raise ChatRequestError(f"{fmt} request rejected: {e}") from None
    else:
        fmt = next((f for f, c in _REQUEST_CLASS.items() if isinstance(request, c)), None)
        if fmt is None:
            raise TypeError(f"expected a request dict or a deepseek_recipe request, got {type(request).__name__}")
        req = request
    name = req.model
    options = dr.ConversionOptions(default_thinking_mode=default_thinking).with_model_alias(name, _VERSION[version])
    try:
        conv_req = req.convert(options)
    except dr.ConversionError as e:
        raise ChatRequestError(f"{fmt} request rejected: {e}", getattr(e, "status_code", 400)) from None
    conv = conv_req.conversation
    rtok = recipe_tokenizer(tokenizer)
    encoding = _encoding(version, rtok)
    rendered = encoding.render_conversation(conv)
    try:
        ids = list(encoding.encode(conv))
    except RuntimeError:
        # e.g. the V4.1 template's <｜System｜> is not in the V4 vocabulary: encode piece by piece instead.
        ids = _encode_rendered(rendered, hf_tokenizer or _hf_tokenizer(tokenizer))
    opts = conv_req.inference_options
    po = conv_req.parsing_options
    thinking = po.thinking_initial_stage is not None
    oc = opts.output_constraint
    return PreparedChat(
        format=fmt, model_name=name, version=version, thinking=thinking, prompt=rendered.prompt,
        prompt_token_ids=ids, constraint=constraint_from_output_constraint(
            oc, version=version, thinking=thinking, starts_in_tool_calls=po.starts_in_tool_calls,
            json_object=conv.response_format == "json_object", require_tool=any_tool),
        output_constraint_kind=oc.kind if oc is not None else None, max_tokens=opts.max_tokens,
        temperature=opts.temperature, top_p=opts.top_p, seed=opts.seed, stream=conv_req.stream,
        request=conv_req, parsing_options=po, tokenizer=rtok)


def constraint_from_output_constraint(oc, *, version: str = "v4.1", thinking: bool = False,
                                      starts_in_tool_calls: bool = False, json_object: bool = False,
                                      require_tool: bool = False):
    """Map recipe's OutputConstraint (or None) to a grammars spec for the whole completion.

    json  -> JsonSchema (chat mode) or reasoning + `</think>` + JSON (thinking mode); empty schema = any JSON
             value (an object for json_object); regex -> Regex, likewise; tool_call -> DSML grammar with free
             text until the block starts; tool_call_required -> DSML grammar, block mandatory (starting at the
             first invoke when recipe pre-filled the block opener into the prompt). require_tool upgrades
             tool_call to a mandatory block (recipe 0.2 maps Anthropic's tool_choice "any" to plain auto).
    """
    if oc is None:
        return None
    kind, payload = oc.kind, oc.schema
    if kind == "json":
        schema = json.loads(payload) if payload else ({"type": "object"} if json_object else {})
        return after_reasoning_grammar(json_schema=schema) if thinking else JsonSchema(schema)
    if kind == "regex":
        return after_reasoning_grammar(regex=payload) if thinking else Regex(payload)
    if kind in ("tool_call", "tool_call_required"):
        choice = "auto" if kind == "tool_call" and not require_tool else "required"
        return dsml_grammar(payload, choice, thinking=thinking, version=version,
                            starts_in_tool_calls=starts_in_tool_calls and kind == "tool_call_required")
    raise ConstraintError(f"unknown OutputConstraint kind {kind!r}")


def _hf_tokenizer(tokenizer):
    if tokenizer is not None and hasattr(tokenizer, "token_to_id"):
        return tokenizer
    from deepinfer_sg.tokenizer import load_tokenizer
    return load_tokenizer()


def _encode_rendered(rendered, tok) -> list[int]:
    """Encode a rendered prompt: special ranges as their token (or plain BPE when the vocabulary lacks
    it), the text between them as plain BPE."""
    ids, pos, text = [], 0, rendered.prompt
    for start, end in rendered.special_ranges:
        if start > pos:
            ids += tok.encode(text[pos:start], add_special_tokens=False).ids
        tid = tok.token_to_id(text[start:end])
        ids += [tid] if tid is not None else tok.encode(text[start:end], add_special_tokens=False).ids
        pos = end
    if pos < len(text):
        ids += tok.encode(text[pos:], add_special_tokens=False).ids
    return ids


# ----------------------------------------------------------------------------------------------------------
# output parsing


_FINISH = {"length": "Length"}


def _finish_chunk(finish_reason: str | None):
    return dr.InferenceChunk.finish(getattr(dr.InferenceFinishReason, _FINISH.get(finish_reason or "", "Stop")))


def _generator(prepared: PreparedChat, response_id: str):
    return _REQUEST_CLASS[prepared.format].chunk_generator(prepared.request, response_id, prepared.model_name)


def parse_completion(prepared: PreparedChat, token_ids=None, finish_reason: str | None = "stop", *,
                     text: str | None = None, response_id: str | None = None) -> dict:
    """Parse one completion (token ids, or text) into a response dict of the request's format, using
    recipe's StreamProcessor: reasoning, content, tool calls (arguments as JSON), finish reason, usage."""
    response_id = response_id or f"dsg-{uuid.uuid4().hex[:16]}"
    sp = dr.StreamProcessor(_generator(prepared, response_id), prepared.parsing_options, prepared.tokenizer)
    chunks = sp.push(dr.InferenceChunk.ready(prompt_usage=dr.PromptUsage(
        prompt_tokens=len(prepared.prompt_token_ids))))
    if token_ids:
        chunks += sp.push(dr.InferenceChunk.tokens([int(t) for t in token_ids]))
    if text:
        chunks += sp.push(dr.InferenceChunk.text(text, 0))
    chunks += sp.push(_finish_chunk(finish_reason))
    chunks += sp.finish()
    resp = _RESPONSE_CLASS[prepared.format](response_id, prepared.model_name, int(time.time()),
                                            len(prepared.prompt_token_ids), 0)
    for c in chunks:
        resp.accumulate(c)
    return json.loads(resp.to_json())


def stream_completion(prepared: PreparedChat, deltas, *, response_id: str | None = None) -> Iterator[dict]:
    """Turn a stream of (token_ids, finish_reason) pairs, or objects with those attributes, into the
    request format's stream chunks/events (dicts), as recipe's stream processor emits them."""
    response_id = response_id or f"dsg-{uuid.uuid4().hex[:16]}"
    sp = dr.StreamProcessor(_generator(prepared, response_id), prepared.parsing_options, prepared.tokenizer)
    for c in sp.push(dr.InferenceChunk.ready(prompt_usage=dr.PromptUsage(
            prompt_tokens=len(prepared.prompt_token_ids)))):
        yield json.loads(c.to_json())
    finish = None
    for d in deltas:
        ids, fin = (d if isinstance(d, tuple) else (getattr(d, "token_ids", None), getattr(d, "finish_reason", None)))
        if ids:
            for c in sp.push(dr.InferenceChunk.tokens([int(t) for t in ids])):
                yield json.loads(c.to_json())
        if fin is not None:
            finish = fin
            break
    for c in sp.push(_finish_chunk(finish)) + sp.finish():
        yield json.loads(c.to_json())


# ----------------------------------------------------------------------------------------------------------
# running on an LLM


def chat(llm, request, *, format: str | None = None, tools=None, tool_choice=None, thinking=None,
         response_format=None, max_tokens: int | None = None, temperature: float | None = None,
         seed: int | None = None, stream: bool = False, model: str = "deepinfer-sg"):
    """Run one chat request on `llm` and return the response dict (or, with stream=True, an iterator of
    chunk dicts). `request` is a request body/object, or a plain message list (then tools, tool_choice,
    thinking, response_format build a Chat Completions body). Keyword sampling values override the request's.
    The completion is constrained by the request's OutputConstraint (tool schemas, JSON schema, regex)."""
    if isinstance(request, list):
        request = build_body(request, model=model, tools=tools, tool_choice=tool_choice, thinking=thinking,
                             response_format=response_format)
        format = "chat"
    prepared = prepare_chat(request, format=format, version=model_version(llm), tokenizer=llm.tokenizer)
    from deepinfer_sg.sampling_params import SamplingParams
    limit = max_tokens or prepared.max_tokens
    if limit is None:
        context = getattr(getattr(llm.engine, "config", None), "max_model_len", None) or (1 << 20)
        limit = prepared.request.resolve_max_tokens(len(prepared.prompt_token_ids), context)
    sp = SamplingParams(max_tokens=int(limit),
                        temperature=prepared.temperature if temperature is None else temperature,
                        top_p=prepared.top_p if prepared.top_p is not None else 1.0,
                        seed=seed if seed is not None else prepared.seed)
    if stream:
        return stream_completion(prepared, llm.stream(prepared.prompt_token_ids, sp, constraint=prepared.constraint))
    out = llm.generate([prepared.prompt_token_ids], sp, constraint=prepared.constraint)[0]
    if out.finish_reason == "error":
        raise ChatRequestError(f"generation failed: {out.error}", 500)
    return parse_completion(prepared, out.token_ids, out.finish_reason)
