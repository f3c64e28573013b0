"""Engine bookkeeping on the exact prefix-hash stand-in model: continuous batching, chunked prefill,
preemption, seeds, stop conditions, streaming. Oracles: the stand-in's logits computed directly (greedy),
per-request solo runs, and the tokenizer's own full decode."""
from __future__ import annotations

import random

import pytest
import torch

from deepinfer_sg.engine.engine import EngineConfig, LLMEngine
from deepinfer_sg.engine.request import SamplingParams
from deepinfer_sg.tokenizer import load_tokenizer
from test_engine_fakes import MOD, PrefixHashModel

TOK = load_tokenizer()
MODEL = PrefixHashModel()
PROMPTS = [f"Request number {i}: {'word ' * (i % 7)}" for i in range(24)]


def make_engine(**kw) -> LLMEngine:
    return LLMEngine(MODEL, TOK, EngineConfig(**kw))


def direct_greedy(prompt_ids: list[int], n: int, eos: int = 1) -> list[int]:
    """Oracle: argmax of the stand-in's logits, computed without the engine."""
    h = 7
    for t in prompt_ids:
        h = (h * 1000003 + t + 1) % MOD
    out = []
    for _ in range(n):
        t = int(MODEL.table[h % MODEL.table.shape[0]].argmax())
        out.append(t)
        if t == eos:
            break
        h = (h * 1000003 + t + 1) % MOD
    return out


def run(engine: LLMEngine, prompts, params) -> list:
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    return engine.run_until_done(ids)


def test_greedy_batched_with_chunked_prefill_matches_direct_oracle():
    eng = make_engine(max_num_batched_tokens=7, max_num_seqs=5)   # forces chunked prefill and queueing
    outs = run(eng, PROMPTS, [SamplingParams(max_tokens=9, temperature=0.0)] * len(PROMPTS))
    for o in outs:
        assert o.token_ids == direct_greedy(o.prompt_token_ids, 9)
        assert o.finish_reason in ("length", "stop")
    assert eng.stats.num_steps > 9   # really batched over several steps


def test_seeded_sampling_independent_of_batch_and_order():
    prompts = PROMPTS[:12]
    params = [SamplingParams(max_tokens=6, temperature=0.9, top_p=0.95 if i % 2 else 1.0,
                             top_k=50 if i % 3 == 0 else -1, seed=1000 + i) for i in range(len(prompts))]
    batched = {o.prompt: o.token_ids for o in run(make_engine(), prompts, params)}
    order = list(range(len(prompts)))
    random.Random(3).shuffle(order)
    shuffled = {o.prompt: o.token_ids for o in run(make_engine(max_num_batched_tokens=5),
                                                    [prompts[i] for i in order], [params[i] for i in order])}
    alone = {}
    for i in (0, 5, 11):
        alone.update({o.prompt: o.token_ids for o in run(make_engine(), [prompts[i]], [params[i]])})
    assert batched == shuffled
    for p, toks in alone.items():
        assert batched[p] == toks
    assert len({tuple(v) for v in batched.values()}) > len(prompts) // 2   # seeds actually differ


def test_memory_pressure_preempts_and_resumes_identically():
    params = [SamplingParams(max_tokens=12, temperature=0.8 if i % 2 else 0.0, seed=i) for i in range(16)]
    free = run(make_engine(), PROMPTS[:16], params)
    # stand-in caches cost 1024 + 256 bytes/token; this limit holds only a few sequences at once
    tight = make_engine(cache_limit_bytes=20_000, max_num_batched_tokens=64)
    squeezed = run(tight, PROMPTS[:16], params)
    assert tight.stats.num_preemptions > 0
    assert any(o.metrics["num_preemptions"] > 0 for o in squeezed)
    assert [o.token_ids for o in squeezed] == [o.token_ids for o in free]
    assert tight.pool.peak_bytes <= 20_000 + 1024 + 256 * 64   # bounded by the limit (+ one step of slack)


def test_request_larger_than_pool_fails_alone():
    eng = make_engine(cache_limit_bytes=4_000)
    ids = [eng.add_request(list(range(10, 60)), SamplingParams(max_tokens=4)),   # 50 tokens: never fits
           eng.add_request([5, 6], SamplingParams(max_tokens=3, temperature=0))]
    big, small = eng.run_until_done(ids)
    assert big.finish_reason == "error" and "cache memory" in big.error
    assert small.finish_reason in ("length", "stop") and len(small.token_ids) >= 1


def test_stop_strings_stop_tokens_and_max_tokens():
    eng = make_engine()
    base = run(eng, ["stop test"], [SamplingParams(max_tokens=12, temperature=0.0)])[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 12
    full = TOK.decode(base.token_ids, skip_special_tokens=False)
    assert base.text == full
    # stop token: the 4th generated id
    st = run(make_engine(), ["stop test"], [SamplingParams(max_tokens=12, temperature=0.0,
                                                           stop_token_ids=[base.token_ids[3]])])[0]
    first = base.token_ids.index(base.token_ids[3])
    assert st.finish_reason == "stop" and st.token_ids == base.token_ids[:first + 1]
    assert st.text == TOK.decode(base.token_ids[:first], skip_special_tokens=False)
    # stop string: a piece of the text in the middle
    needle = full[len(full) // 2: len(full) // 2 + 3]
    ss = run(make_engine(), ["stop test"], [SamplingParams(max_tokens=12, temperature=0.0, stop=[needle])])[0]
    assert ss.finish_reason == "stop"
    assert ss.text == full[:full.index(needle)]


def test_streaming_deltas_concatenate_to_final_text():
    eng = make_engine()
    rid = eng.add_request("stream me", SamplingParams(max_tokens=15, temperature=0.7, seed=5, stop=["zz"]))
    pieces, toks, reasons = [], [], []
    while eng.has_unfinished():
        for d in eng.step():
            pieces.append(d.text)
            toks += d.token_ids
            reasons.append(d.finish_reason)
    out = eng.output(rid)
    assert "".join(pieces) == out.text
    assert toks == out.token_ids
    assert reasons[-1] == out.finish_reason and all(r is None for r in reasons[:-1])


def test_bad_prompts_raise_clear_errors():
    eng = make_engine()
    with pytest.raises(ValueError, match="outside"):
        eng.add_request([1, 2, 10**7])
    with pytest.raises(ValueError, match="empty prompt"):
        eng.add_request([])
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_logprobs_are_raw_model_logprobs():
    eng = make_engine()
    o = run(eng, ["lp"], [SamplingParams(max_tokens=4, temperature=1.0, seed=1, logprobs=True)])[0]
    assert len(o.logprobs) == len(o.token_ids)
    h = 7
    for t in o.prompt_token_ids:
        h = (h * 1000003 + t + 1) % MOD
    for t, lp in zip(o.token_ids, o.logprobs):
        expect = torch.log_softmax(MODEL.table[h % MODEL.table.shape[0]], -1)[t].item()
        assert lp == pytest.approx(expect, abs=1e-4)
        h = (h * 1000003 + t + 1) % MOD
