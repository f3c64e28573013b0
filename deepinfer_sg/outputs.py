"""What `LLM.generate` and `LLM.stream` hand back.

RequestOutput: .request_id .prompt .prompt_token_ids .text .token_ids .finish_reason
("stop" | "length" | "constraint_complete" | "error") .error .logprobs .metrics (ttft_s, e2e_s,
tokens_per_s, decode_tokens_per_s, compile_s, num_preemptions) .parsed / .parse_error (with output_type=).
StreamDelta: .request_id .text .token_ids .finish_reason .error (one step's increment).
Both are engine dataclasses, re-exported so user code never imports from the engine."""
from deepinfer_sg.engine.request import (FINISH_CONSTRAINT_COMPLETE, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP,
                                          RequestOutput, StreamDelta)

FINISH_REASONS = (FINISH_STOP, FINISH_LENGTH, FINISH_CONSTRAINT_COMPLETE, FINISH_ERROR)

__all__ = ["RequestOutput", "StreamDelta", "FINISH_REASONS"]
