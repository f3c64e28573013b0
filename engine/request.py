"""The engine's data: sampling parameters, one request's evolving state, and what comes back.

Everything a step needs to know about a request lives in `Request` (a plain dataclass), so the step
loop (schedule -> forward -> masks -> sample/verify -> commit/rollback) stays explicit and the
speculative decoder can add its own per-request fields next to these ones.
"""
from __future__ import annotations

import enum
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Optional

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_CONSTRAINT_COMPLETE = "constraint_complete"
FINISH_ERROR = "error"


@dataclass
class SamplingParams:
    """How to pick each output token of one request.

    temperature 0 means greedy (argmax of the masked logits). top_k <= 0 and top_p == 1 switch those
    filters off. `seed` makes sampling reproducible: the random number used at output position i depends
    only on (seed, i), never on which other requests share the batch. seed=None draws one per request.
    `stop` strings end generation (the stop string itself is not included in the text);
    `stop_token_ids` end it too (the token is kept in token_ids, not in text). The tokenizer's EOS
    ends it unless `ignore_eos`. `logprobs=True` reports the model's log-probability (raw logits,
    before masks and temperature) of every chosen token.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not (self.temperature >= 0.0):
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int):
            raise ValueError(f"SamplingParams.top_k must be an int (<= 0 means off), got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"SamplingParams.seed must be an int or None, got {self.seed!r}")
        if any(not s for s in self.stop):
            raise ValueError("SamplingParams.stop must not contain empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


class RequestState(enum.Enum):
    COMPILING = "compiling"      # constraint still compiling on a worker thread; not schedulable yet
    WAITING = "waiting"          # ready, no cache (new or preempted)
    RUNNING = "running"          # holds a cache; prefilling or decoding
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    arrival_time: float = 0.0
    ready_time: Optional[float] = None          # constraint compiled (or arrival when none)
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    num_preemptions: int = 0

    def summary(self, num_output_tokens: int) -> dict:
        """TTFT, end-to-end latency and output tokens per second (None where not yet known)."""
        end = self.finish_time or time.perf_counter()
        ttft = None if self.first_token_time is None else self.first_token_time - self.arrival_time
        e2e = end - self.arrival_time
        decode_s = None if self.first_token_time is None else end - self.first_token_time
        return {
            "ttft_s": ttft,
            "e2e_s": e2e,
            "tokens_per_s": (num_output_tokens / e2e) if e2e > 0 else None,
            "decode_tokens_per_s": ((num_output_tokens - 1) / decode_s) if decode_s and num_output_tokens > 1 else None,
            "compile_s": None if self.ready_time is None else self.ready_time - self.arrival_time,
            "num_output_tokens": num_output_tokens,
            "num_preemptions": self.num_preemptions,
        }


@dataclass
class Request:
    """One request's whole life. The engine mutates it; nothing else should."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: Optional[str] = None
    constraint: Any = None                      # a grammars spec (Regex, JsonSchema, Grammar, Triggered...)
    seed: int = 0                               # resolved seed (params.seed or drawn by the engine)
    arrival_index: int = 0                      # admission order; preemption evicts the newest first

    state: RequestState = RequestState.WAITING
    compile_future: Optional[Future] = None
    matcher: Any = None                         # grammars Matcher, None when unconstrained
    automaton_key: Any = None                   # its device automaton's key (automata.py), None: CPU draft masks
    cache: Any = None                           # the model's SequenceCache while RUNNING
    num_computed: int = 0                       # tokens of all_token_ids already in the cache
    suspect: bool = False                       # was in a batch whose step failed: runs alone until it samples

    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    text: str = ""
    detokenizer: Any = None
    num_text_emitted: int = 0                   # streaming bookkeeping: chars / tokens already handed out
    num_tokens_emitted: int = 0
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return self.num_tokens - self.num_computed

    @property
    def finished(self) -> bool:
        return self.state is RequestState.FINISHED


@dataclass
class RequestOutput:
    """What a caller sees of a request: a snapshot (finished or not).

    token_ids: the generated ids (a stop token that ended the request is included; text excludes it).
    finish_reason: None while running, then "stop" | "length" | "constraint_complete" | "error".
    error: the message when finish_reason == "error" (for a bad constraint: the ConstraintError text).
    parsed: the typed object when the front door was given output_type=, else None.
    metrics: dict with ttft_s, e2e_s, tokens_per_s, decode_tokens_per_s, compile_s, num_preemptions.
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: Optional[str]
    error: Optional[str] = None
    logprobs: Optional[list[float]] = None
    metrics: dict = field(default_factory=dict)
    parsed: Any = None
    parse_error: Any = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StreamDelta:
    """What one step added to one request: new tokens, new text, and the finish reason if it ended."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: Optional[str] = None
    error: Optional[str] = None


def snapshot(req: Request) -> RequestOutput:
    return RequestOutput(
        request_id=req.request_id,
        prompt=req.prompt,
        prompt_token_ids=list(req.prompt_token_ids),
        text=req.text,
        token_ids=list(req.output_token_ids),
        finish_reason=req.finish_reason,
        error=req.error,
        logprobs=list(req.output_logprobs) if req.params.logprobs else None,
        metrics=req.metrics.summary(len(req.output_token_ids)),
    )


@dataclass
class StepChunkFallback:
    """Duck-typed stand-in for the model's StepChunk (cache, token_ids, logit_rows), used only when the
    model module does not define one."""

    cache: Any
    token_ids: Any
    logit_rows: int
