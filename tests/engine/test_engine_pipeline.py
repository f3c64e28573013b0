"""The engine's plan-ahead (engine/step_pipeline.py wired into LLMEngine._forward): steady decode steps are planned
while the previous step runs. Oracle: the same requests through an engine whose every step is a plain
`model.forward_step` (no plan made ahead), on the real tiny V4.1 default model; requests finish at different steps,
some constrained, so plans are made, used, and cancelled by finishes."""
from __future__ import annotations

import pytest

from deepinfer_sg import SamplingParams, load_tokenizer
from deepinfer_sg.engine.default_model import build_default_model
from deepinfer_sg.engine.engine import EngineConfig, LLMEngine
from deepinfer_sg.grammars import Regex


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return build_default_model(seed=0), load_tokenizer()


def _run(model, tokenizer, plan_ahead: bool):
    engine = LLMEngine(model, tokenizer, EngineConfig())
    if not plan_ahead:
        forward = engine.pipeline.forward
        engine.pipeline.forward = lambda chunks, plan_next=True: forward(chunks, plan_next=False)
    prompts = [f"Plan ahead {i}" for i in range(5)]
    params = [SamplingParams(max_tokens=3 + 3 * i, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True)
              for i in range(5)]
    constraints = [Regex(r"[a-z]{1,20}") if i in (1, 4) else None for i in range(5)]
    ids = [engine.add_request(p, sp, c) for p, sp, c in zip(prompts, params, constraints)]
    outs = engine.run_until_done(ids)
    engine.close()
    return outs, engine.pipeline


def test_plan_ahead_gives_the_plain_steps_tokens_and_leaves_no_plan_open(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    plain, plain_pipe = _run(model, tokenizer, plan_ahead=False)
    ahead, pipe = _run(model, tokenizer, plan_ahead=True)
    assert plain_pipe.hits == 0
    assert pipe.hits > 0, "no decode step was launched with a plan made ahead"
    assert pipe.misses > 0, "finishing requests should have cancelled plans made ahead"
    assert [o.error for o in ahead] == [None] * 5
    assert [o.token_ids for o in ahead] == [o.token_ids for o in plain]
    assert len({len(o.token_ids) for o in ahead}) >= 3, "requests should finish at different steps"
    # the engine is idle: no plan (and none of the finished requests' caches) is held
    assert pipe._ahead is None and getattr(model, "_open_plan", None) is None
