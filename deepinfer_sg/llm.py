"""LLM: the front door. Prompts (+ constraints) in, RequestOutputs out.

    llm = LLM()                                        # bundled tiny default model + real tokenizer
    outs = llm.generate(["Name a city:"], SamplingParams(max_tokens=32), constraint=JsonSchema({...}))
    outs = llm.generate(prompts, output_type=Invoice)  # .parsed is an Invoice (or .parse_error says why)
    for delta in llm.stream("Hello"): print(delta.text, end="")

A bad constraint or an unparsable output never raises out of `generate`: that item comes back with
finish_reason "error" (and .error) or with .parse_error, and every other item is unaffected.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union

import torch

from deepinfer_sg.engine.engine import EngineConfig, LLMEngine
from deepinfer_sg.engine.request import RequestOutput, SamplingParams, StreamDelta

from .tokenizer import load_tokenizer

Prompt = Union[str, Sequence[int]]


def _is_single_prompt(prompts) -> bool:
    if isinstance(prompts, str):
        return True
    return bool(prompts) and isinstance(prompts[0], int)


def _per_item(value, n: int, what: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{what}: got {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n


class LLM:
    """An offline engine plus a tokenizer.

    model_dir=None: the bundled tiny random-weight V4.1 default model (seeded by `seed`); a path: an
    HF-style checkpoint folder (config.json + *.safetensors, its tokenizer.json if present).
    model=: an already built model object (tests, benchmarks). Engine knobs: max_num_seqs,
    max_num_batched_tokens, max_model_len, cache_limit_bytes, gpu_memory_utilization; speculative=
    engine.spec_decode.SpecConfig(n=5, schedule="sync", ...) turns on DSpark speculative decoding.
    """

    def __init__(self, model_dir: Optional[Union[str, Path]] = None, *, model=None, tokenizer=None,
                 device: Optional[Union[str, torch.device]] = None, dtype: torch.dtype = torch.float32,
                 seed: int = 0, max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                 max_model_len: Optional[int] = None, cache_limit_bytes: Optional[int] = None,
                 gpu_memory_utilization: float = 0.9, compiler=None, speculative=None):
        device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if model is None:
            if model_dir is None:
                from deepinfer_sg.engine.default_model import build_default_model
                model = build_default_model(seed=seed, device=device, dtype=dtype)
            else:
                from deepinfer_sg.engine.loader import load_model
                model = load_model(str(model_dir), device=str(device), dtype=dtype)
        if tokenizer is None:
            own = Path(model_dir) / "tokenizer.json" if model_dir is not None else None
            tokenizer = load_tokenizer(own if own is not None and own.is_file() else None)
        self.tokenizer = tokenizer
        self.model = model
        self.engine = LLMEngine(model, tokenizer, EngineConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            cache_limit_bytes=cache_limit_bytes, gpu_memory_utilization=gpu_memory_utilization, seed=seed,
            speculative=speculative),
            compiler=compiler)

    # ------------------------------------------------------------------ batch

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 constraint: Any = None, output_type: Any = None,
                 use_tqdm: Optional[bool] = None) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); returns one RequestOutput per prompt, in order.

        constraint: one grammars spec for all prompts, or a list (None entries = unconstrained).
        output_type: a Python type (pydantic model, dataclass, list[...], ...): its JSON Schema constrains
        the output and `.parsed` holds the typed value. Give constraint or output_type, not both.
        use_tqdm: progress bar; default on only when stderr is a terminal and there are >= 8 prompts.
        """
        plist = [prompts] if _is_single_prompt(prompts) else list(prompts)
        n = len(plist)
        params = [p if p is not None else SamplingParams() for p in _per_item(sampling_params, n, "sampling_params")]
        constraints, types = self._constraints(constraint, output_type, n)
        ids = [self.engine.add_request(p, sp, c) for p, sp, c in zip(plist, params, constraints)]
        if use_tqdm is None:
            use_tqdm = n >= 8 and sys.stderr.isatty()
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=n, desc="generate", unit="req")
        try:
            self.engine.run_until_done(ids, progress=bar)
        finally:
            if bar is not None:
                bar.close()
        outs = [self.engine.pop_output(i) for i in ids]
        for out, tp in zip(outs, types):
            if tp is not None:
                _attach_parsed(out, tp)
        return outs

    def _constraints(self, constraint, output_type, n: int) -> tuple[list, list]:
        if output_type is not None and constraint is not None:
            raise ValueError("give either constraint= or output_type=, not both")
        if output_type is None:
            return _per_item(constraint, n, "constraint"), [None] * n
        from deepinfer_sg.typed import constraint_for_type  # F's module; imported only when used
        types = _per_item(output_type, n, "output_type")
        return [constraint_for_type(t) if t is not None else None for t in types], types

    # ------------------------------------------------------------------ streaming

    def stream(self, prompt: Prompt, sampling_params: Optional[SamplingParams] = None, constraint: Any = None,
               output_type: Any = None) -> Iterator[StreamDelta]:
        """Yield StreamDelta objects for one prompt as tokens are produced; the last one has
        finish_reason set. Concatenating the deltas' text gives the final text. Other requests
        already queued on this LLM advance too, but only this prompt's deltas are yielded."""
        constraints, _ = self._constraints(constraint, output_type, 1)
        rid = self.engine.add_request(prompt, sampling_params or SamplingParams(), constraints[0])
        try:
            while True:
                for d in self.engine.step():
                    if d.request_id == rid:
                        yield d
                        if d.finish_reason is not None:
                            return
        finally:
            if not self.engine.requests[rid].finished:
                self.engine.abort(rid)
            self.engine.pop_output(rid)

    # ------------------------------------------------------------------ chat (front-door helper F)

    def chat(self, messages, **kwargs):
        """DeepSeek-V4 chat rendering and DSML tool calls; implemented in deepinfer_sg.chat."""
        from deepinfer_sg import chat as chat_module
        return chat_module.chat(self, messages, **kwargs)

    def close(self) -> None:
        """Stop the mask worker threads (optional; they are idle threads otherwise)."""
        self.engine.close()

    @property
    def stats(self) -> dict:
        d = self.engine.stats.as_dict()
        d["cache"] = self.engine.pool.stats()
        return d


def _attach_parsed(out: RequestOutput, tp) -> None:
    from deepinfer_sg.typed import parse_output
    if out.finish_reason == "error":
        out.parse_error = {"type": "generation_error", "message": out.error}
        return
    value, error = parse_output(tp, out.text)
    out.parsed, out.parse_error = value, error
