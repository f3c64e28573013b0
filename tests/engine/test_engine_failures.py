"""A step that raises (model forward, sampler) fails only the request that causes it; the others finish with
exactly the tokens they would have produced without it. Oracle: the same engine run without the bad request
(the prefix-hash stand-in's logits depend only on the prefix, and sampling is seeded per request, so the
innocent requests' outputs are fully determined)."""
from __future__ import annotations

import pytest
import torch

from deepinfer_sg.engine.engine import EngineConfig, LLMEngine
from deepinfer_sg.engine.request import SamplingParams
from deepinfer_sg.tokenizer import load_tokenizer
from test_engine_fakes import PrefixHashModel

TOK = load_tokenizer()
POISON = 4242          # a prompt token the faulty model cannot process


class FaultyModel(PrefixHashModel):
    """Raises while a chunk holds the poison token, or when a sequence reaches `bad_length` (a decode-time
    fault), or once on the first step with more than `flaky_batch` chunks (a transient fault like an OOM)."""

    def __init__(self, bad_length: int = 0, flaky_batch: int = 0):
        super().__init__()
        self.bad_length, self.flaky_batch = bad_length, flaky_batch
        self.armed = False         # off while the engine probes cache growth at construction

    def forward_step(self, chunks):
        for ch in chunks if self.armed else ():
            if POISON in ch.token_ids.tolist():
                raise RuntimeError("kernel fault on token 4242")
            if self.bad_length and ch.cache.length + len(ch.token_ids) >= self.bad_length:
                raise RuntimeError(f"cache overflow at {self.bad_length}")
        if self.armed and self.flaky_batch and len(chunks) > self.flaky_batch:
            self.flaky_batch = 0
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return super().forward_step(chunks)


def params(n: int) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=8, temperature=0.7 if i % 2 else 0.0, seed=100 + i, ignore_eos=True)
            for i in range(n)]


def run(model, prompts, sps, **cfg):
    eng = LLMEngine(model, TOK, EngineConfig(**cfg))
    model.armed = True
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, sps)]
    return eng, {o.request_id: o for o in eng.run_until_done(ids)}


GOOD = [[5, 6, 7, 8 + i] for i in range(5)]


@pytest.mark.parametrize("cfg", [{}, {"max_num_batched_tokens": 6}])
def test_poisoned_prompt_fails_alone(cfg):
    prompts = GOOD[:2] + [[9, POISON, 10]] + GOOD[2:]
    sps = params(len(prompts))
    _, clean = run(PrefixHashModel(), GOOD, sps[:2] + sps[3:], **cfg)
    eng, outs = run(FaultyModel(), prompts, sps, **cfg)
    bad = outs["2"] if "2" in outs else list(outs.values())[2]
    got = [o for o in outs.values() if o is not bad]
    assert bad.finish_reason == "error" and "4242" in bad.error and "alone" in bad.error
    assert [o.token_ids for o in got] == [o.token_ids for o in clean.values()]
    assert all(o.finish_reason == "length" for o in got)
    assert eng.stats.num_step_failures >= 2      # the batched failure, then the solo one


def test_decode_time_fault_names_the_request_that_reached_it():
    # the second faults when feeding its 6th output (cache 11 -> 12); the first (2 + 8 tokens) never gets there
    prompts = [[5, 6], [5, 6, 7, 8, 9, 10]]
    sps = params(2)
    _, clean = run(PrefixHashModel(), prompts[:1], sps[:1])
    eng, outs = run(FaultyModel(bad_length=12), prompts, sps)
    first, second = outs.values()
    assert first.token_ids == list(clean.values())[0].token_ids and first.finish_reason == "length"
    assert second.finish_reason == "error" and "cache overflow" in second.error
    assert len(second.token_ids) == 6              # everything sampled before the fault is kept


def test_transient_batch_fault_loses_nothing():
    sps = params(len(GOOD))
    _, clean = run(PrefixHashModel(), GOOD, sps)
    eng, outs = run(FaultyModel(flaky_batch=3), GOOD, sps)
    assert eng.stats.num_step_failures == 1
    assert [o.token_ids for o in outs.values()] == [o.token_ids for o in clean.values()]
    assert all(o.finish_reason == "length" and o.error is None for o in outs.values())
