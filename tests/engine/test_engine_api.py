"""The front door (LLM, SamplingParams, outputs, streaming) and asynchronous constraint compilation, on the
exact prefix-hash stand-in model with stand-in compilers (futures the test controls)."""
from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

import deepinfer_sg
from deepinfer_sg import LLM, SamplingParams
from deepinfer_sg.engine.cache_pool import CacheGrowthModel, CachePool
from deepinfer_sg.engine.engine import EngineConfig, LLMEngine
from test_engine_fakes import PrefixHashModel

MODEL = PrefixHashModel(seed=1)


class GateCompiler:
    """compile_async returns futures the test resolves by hand (a slow or failing grammar compile)."""

    def __init__(self):
        self.futures: list[Future] = []

    def compile_async(self, spec):
        f = Future()
        self.futures.append(f)
        return f


class AllowAll:
    def matcher(self):
        return self

    def is_constrained(self):
        return True

    def fill_mask(self, bitmask, row):
        pass   # leave the row all-ones

    def accept(self, token):
        return True

    def is_terminated(self):
        return False


def test_front_door_exports():
    for name in ("LLM", "SamplingParams", "RequestOutput", "StreamDelta", "load_tokenizer", "Regex", "JsonSchema",
                 "Grammar", "Triggered", "ConstraintError"):
        assert getattr(deepinfer_sg, name) is not None
    assert issubclass(deepinfer_sg.ConstraintError, ValueError)
    assert deepinfer_sg.load_tokenizer().get_vocab_size() == 129280


def test_generate_accepts_text_ids_single_and_lists():
    llm = LLM(model=MODEL)
    one = llm.generate("hello", SamplingParams(max_tokens=3, temperature=0))
    assert len(one) == 1 and len(one[0].token_ids) == 3 and one[0].prompt == "hello"
    assert one[0].prompt_token_ids[0] == 0                       # BOS prepended to text prompts
    by_ids = llm.generate([one[0].prompt_token_ids], SamplingParams(max_tokens=3, temperature=0))
    assert by_ids[0].token_ids == one[0].token_ids and by_ids[0].prompt is None
    many = llm.generate(["a", "b", "c"], [SamplingParams(max_tokens=n, temperature=0) for n in (1, 2, 3)])
    assert [len(o.token_ids) for o in many] == [1, 2, 3]
    assert all(o.finish_reason == "length" and o.metrics["ttft_s"] is not None for o in many)
    with pytest.raises(ValueError, match="2 entries for 3 prompts"):
        llm.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()])


def test_stream_yields_deltas_that_add_up():
    llm = LLM(model=MODEL)
    deltas = list(llm.stream("tell me", SamplingParams(max_tokens=8, temperature=0.5, seed=3)))
    full = llm.generate("tell me", SamplingParams(max_tokens=8, temperature=0.5, seed=3))[0]
    assert "".join(d.text for d in deltas) == full.text
    assert [t for d in deltas for t in d.token_ids] == full.token_ids
    assert deltas[-1].finish_reason == "length"


def test_compiling_request_does_not_block_others_and_failure_is_isolated():
    gate = GateCompiler()
    eng = LLMEngine(MODEL, deepinfer_sg.load_tokenizer(), EngineConfig(), compiler=gate)
    slow = eng.add_request("slow", SamplingParams(max_tokens=4, temperature=0), constraint="spec-1")
    bad = eng.add_request("bad", SamplingParams(max_tokens=4, temperature=0), constraint="spec-2")
    free = [eng.add_request(f"free {i}", SamplingParams(max_tokens=4, temperature=0)) for i in range(3)]
    for _ in range(6):
        eng.step()
    assert all(eng.output(i).finish_reason == "length" for i in free)     # finished while compiles pend
    assert eng.output(slow).finish_reason is None
    gate.futures[1].set_exception(deepinfer_sg.ConstraintError("invalid JSON Schema: 'type' at pointer '/x'"))
    gate.futures[0].set_result(AllowAll())
    while eng.has_unfinished():
        eng.step()
    assert eng.output(bad).finish_reason == "error" and "pointer '/x'" in eng.output(bad).error
    assert eng.output(slow).finish_reason == "length" and len(eng.output(slow).token_ids) == 4


def test_compile_timeout_fails_only_that_request():
    gate = GateCompiler()
    eng = LLMEngine(MODEL, deepinfer_sg.load_tokenizer(), EngineConfig(compile_timeout_s=0.0), compiler=gate)
    stuck = eng.add_request("stuck", SamplingParams(max_tokens=2), constraint="never")
    ok = eng.add_request("ok", SamplingParams(max_tokens=2, temperature=0))
    outs = eng.run_until_done([stuck, ok])
    assert outs[0].finish_reason == "error" and "timed out" in outs[0].error
    assert outs[1].finish_reason == "length"


def test_constraint_and_output_type_are_exclusive():
    llm = LLM(model=MODEL)
    with pytest.raises(ValueError, match="not both"):
        llm.generate("x", constraint=object(), output_type=int)


class OverlapModel(PrefixHashModel):
    """forward_step announces it started, then waits until every mask row was filled (with a timeout):
    this only completes if the engine fills masks on other threads while the forward runs."""

    def __init__(self):
        super().__init__(seed=2)
        self.forward_started = threading.Event()
        self.masks_filled = threading.Event()
        self.overlapped = []

    def forward_step(self, chunks):
        self.forward_started.set()
        self.overlapped.append(self.masks_filled.wait(timeout=20))
        self.masks_filled.clear()
        out = super().forward_step(chunks)
        self.forward_started.clear()
        return out


class OverlapMatcher(AllowAll):
    def __init__(self, model, allowed):
        self.model, self.allowed = model, allowed

    def fill_mask(self, bitmask, row):
        assert self.model.forward_started.wait(timeout=20)
        bitmask[row].zero_()
        bitmask[row, self.allowed // 32] = 1 << (self.allowed % 32)
        self.model.masks_filled.set()


def test_engine_fills_masks_while_the_forward_runs():
    model = OverlapModel()
    gate = GateCompiler()
    pool = CachePool(model, growth=CacheGrowthModel(fixed=1024, per_token=256))   # no probe forward
    eng = LLMEngine(model, deepinfer_sg.load_tokenizer(), EngineConfig(), compiler=gate, cache_pool=pool)
    rid = eng.add_request("x", SamplingParams(max_tokens=3, temperature=1.0, seed=0), constraint="only-77")
    gate.futures[0].set_result(SimpleCompiled(OverlapMatcher(model, 77)))
    out = eng.run_until_done([rid])[0]
    assert out.token_ids == [77, 77, 77]          # the mask was applied
    assert model.overlapped == [True, True, True]  # and was filled during each forward


class SimpleCompiled:
    def __init__(self, m):
        self.m = m

    def matcher(self):
        return self.m
