"""SamplingParams: how each output token is chosen (max_tokens, temperature, top_p, top_k, seed, stop,
stop_token_ids, ignore_eos, logprobs). Defined in the engine (which consumes it) and re-exported here,
the front door users import from. See `deepinfer_sg.engine.request.SamplingParams` for the contract."""
from deepinfer_sg.engine.request import SamplingParams

__all__ = ["SamplingParams"]
