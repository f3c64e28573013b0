"""deepinfer-sg: structured generation for the DeepSeek-V4 family.

    from deepinfer_sg import LLM, SamplingParams, JsonSchema
    llm = LLM()                                   # tiny bundled default model, real DeepSeek-V4 tokenizer
    out = llm.generate(["Give me a user:"], SamplingParams(max_tokens=64),
                       constraint=JsonSchema({"type": "object", "properties": {"name": {"type": "string"}}}))[0]
    print(out.text, out.finish_reason)

Exports: LLM, SamplingParams, RequestOutput, StreamDelta, load_tokenizer, and the constraint specs
Regex, JsonSchema, Grammar, Triggered, ConstraintError (from deepinfer_sg.grammars). Names are resolved
lazily, so `import deepinfer_sg` stays cheap.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "deepinfer_sg.llm",
    "SamplingParams": "deepinfer_sg.sampling_params",
    "RequestOutput": "deepinfer_sg.outputs",
    "StreamDelta": "deepinfer_sg.outputs",
    "load_tokenizer": "deepinfer_sg.tokenizer",
    "Regex": "deepinfer_sg.grammars",
    "JsonSchema": "deepinfer_sg.grammars",
    "Grammar": "deepinfer_sg.grammars",
    "Triggered": "deepinfer_sg.grammars",
    "ConstraintError": "deepinfer_sg.grammars",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'deepinfer_sg' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
