"""The engine on the real tiny V4.1 default model (random weights, real 129,280-token vocabulary) with
real constraints. Oracles: jsonschema, re.fullmatch, pydantic, an EBNF's language written out by hand,
solo runs of the same request, and the unconstrained greedy run (for trigger constraints)."""
from __future__ import annotations

import json
import re

import jsonschema
import pydantic
import pytest

from deepinfer_sg import LLM, SamplingParams
from deepinfer_sg.engine.default_model import build_default_model
from deepinfer_sg.grammars import Grammar, JsonSchema, Regex, Triggered


class Person(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=4)
    age: int = pydantic.Field(ge=0, le=99)


PERSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4},
                                                  "age": {"type": "integer", "minimum": 0, "maximum": 99}},
                 "required": ["name", "age"], "additionalProperties": False}
COLOR_SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                                 "ok": {"type": "boolean"}},
                "required": ["color", "ok"], "additionalProperties": False}
REGEXES = [r"[a-z]{1,6}", r"(yes|no), [0-9]{1,3}", r"[A-Z][a-z]{0,3}-[0-9]{2}"]
EBNF = 'root ::= answer " " digit\nanswer ::= "yes" | "no" | "maybe"\ndigit ::= [0-9]'
EBNF_LANGUAGE = {f"{a} {d}" for a in ("yes", "no", "maybe") for d in "0123456789"}


@pytest.fixture(scope="module")
def llm():
    engine_llm = LLM(model=build_default_model(seed=0), max_num_batched_tokens=512)
    yield engine_llm
    engine_llm.engine.close()


def strip_eos(out):
    return out.token_ids[:-1] if out.token_ids and out.token_ids[-1] == 1 else out.token_ids


def make_requests(llm, n=64):
    """n mixed requests: (prompt, params, constraint, kind, extra)."""
    reqs = []
    for i in range(n):
        kind = ["free", "regex", "json", "pydantic", "ebnf", "trigger", "json2", "free_sampled"][i % 8]
        prompt = f"Item {i}: describe it."
        greedy = SamplingParams(max_tokens=32, temperature=0.0)
        sampled = SamplingParams(max_tokens=32, temperature=0.8, top_p=0.9, seed=100 + i)
        params = sampled if i % 3 == 0 else greedy
        if kind == "free":
            reqs.append((prompt, SamplingParams(max_tokens=12, temperature=0.0), None, kind, None))
        elif kind == "free_sampled":
            reqs.append((prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=i), None, kind, None))
        elif kind == "regex":
            pat = REGEXES[i % 3]
            reqs.append((prompt, params, Regex(pat), kind, pat))
        elif kind == "json":
            reqs.append((prompt, params, JsonSchema(PERSON_SCHEMA, whitespace="compact"), kind, PERSON_SCHEMA))
        elif kind == "json2":
            reqs.append((prompt, params, JsonSchema(COLOR_SCHEMA, whitespace="compact"), kind, COLOR_SCHEMA))
        elif kind == "pydantic":
            reqs.append((prompt, params, JsonSchema.from_model(Person, whitespace="compact"), kind, Person))
        elif kind == "ebnf":
            reqs.append((prompt, params, Grammar(EBNF), kind, None))
        else:
            reqs.append((prompt, greedy, "TRIGGER", kind, None))   # filled in below (needs a free run)
    return reqs


def check_valid(out, kind, extra, tok):
    assert out.finish_reason == "constraint_complete", (kind, out.finish_reason, out.error, out.text)
    assert out.token_ids[-1] == 1                                   # the grammar ended on EOS
    assert out.text == tok.decode(strip_eos(out), skip_special_tokens=False)
    if kind == "regex":
        assert re.fullmatch(extra, out.text), (extra, out.text)
    elif kind in ("json", "json2"):
        jsonschema.validate(json.loads(out.text), extra)
    elif kind == "pydantic":
        extra.model_validate_json(out.text)
    elif kind == "ebnf":
        assert out.text in EBNF_LANGUAGE


def test_64_mixed_requests_valid_and_equal_to_solo_runs(llm):
    tok = llm.tokenizer
    reqs = make_requests(llm)
    # trigger requests: the trigger is the 3rd token the model emits unconstrained (greedy), so the
    # trigger fires for sure; before it the output must equal the free run, after it match the regex
    trig_prompts = [r[0] for r in reqs if r[3] == "trigger"]
    free_runs = llm.generate(trig_prompts, SamplingParams(max_tokens=3, temperature=0.0))
    trig = iter(free_runs)
    filled = []
    for prompt, params, c, kind, extra in reqs:
        if kind == "trigger":
            free = next(trig)
            trigger = free.token_ids[2]
            c, extra = Triggered(Regex(r"[0-9]{1,3}"), [trigger]), free.token_ids
        filled.append((prompt, params, c, kind, extra))

    outs = llm.generate([r[0] for r in filled], [r[1] for r in filled], constraint=[r[2] for r in filled])
    assert len(outs) == 64
    for out, (prompt, params, c, kind, extra) in zip(outs, filled):
        assert out.error is None, (kind, out.error)
        if kind.startswith("free"):
            assert out.finish_reason in ("length", "stop")
        elif kind == "trigger":
            k = out.token_ids.index(extra[2])
            assert out.token_ids[:k + 1] == extra[:k + 1]
            assert out.finish_reason == "constraint_complete" and out.token_ids[-1] == 1
            inner = tok.decode(out.token_ids[k + 1:-1], skip_special_tokens=False)
            assert re.fullmatch(r"[0-9]{1,3}", inner), inner
        else:
            check_valid(out, kind, extra, tok)

    # batch composition must not change any output: rerun one request of each kind alone
    for i in range(8):   # one request of each kind (0 greedy free, 3 and 6 sampled)
        prompt, params, c, kind, extra = filled[i]
        solo = llm.generate([prompt], params, constraint=c)[0]
        assert solo.token_ids == outs[i].token_ids, (i, kind)


def test_seeded_sampling_reproducible_across_runs_and_orders(llm):
    prompts = [f"Seed test {i}" for i in range(6)]
    params = [SamplingParams(max_tokens=10, temperature=1.0, top_k=40 if i % 2 else -1, seed=7 + i) for i in range(6)]
    cons = [Regex(r"[a-z ]{1,12}") if i % 3 == 0 else None for i in range(6)]
    a = llm.generate(prompts, params, constraint=cons)
    b = llm.generate(prompts[::-1], params[::-1], constraint=cons[::-1])[::-1]
    c = [llm.generate([p], sp, constraint=cc)[0] for p, sp, cc in zip(prompts[:2], params[:2], cons[:2])]
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.token_ids for o in a[:2]] == [o.token_ids for o in c]


def test_bad_schema_fails_alone(llm):
    bad = JsonSchema({"type": "object", "properties": {"a": {"type": "strin"}}})
    outs = llm.generate(["a", "b", "c"], SamplingParams(max_tokens=8, temperature=0.0),
                        constraint=[Regex("[a-z]{1,4}"), bad, None])
    assert outs[1].finish_reason == "error"
    assert "ConstraintError" in outs[1].error and "/properties/a/type" in outs[1].error
    assert outs[0].finish_reason == "constraint_complete" and re.fullmatch("[a-z]{1,4}", outs[0].text)
    assert outs[2].finish_reason in ("length", "stop") and outs[2].error is None


def test_max_tokens_mid_json_finishes_with_length(llm):
    schema = JsonSchema({"type": "object", "properties": {"text": {"type": "string", "minLength": 30}},
                         "required": ["text"]}, whitespace="compact")
    out = llm.generate(["long json"], SamplingParams(max_tokens=5, temperature=0.0), constraint=schema)[0]
    assert out.finish_reason == "length" and out.error is None
    assert len(out.token_ids) == 5 and out.text.startswith('{"text":"')
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


def test_output_type_parses_to_pydantic(llm):
    outs = llm.generate(["a person", "another"], SamplingParams(max_tokens=40, temperature=0.0), output_type=Person)
    for o in outs:
        if o.finish_reason == "constraint_complete":
            assert isinstance(o.parsed, Person) and o.parse_error is None
            assert o.parsed == Person.model_validate_json(o.text)
        else:   # whitespace may run the budget out on random weights: then a structured error, no exception
            assert o.finish_reason == "length" and o.parsed is None and o.parse_error is not None


def test_memory_pressure_preempts_without_changing_outputs(llm):
    """Budgets below what the six requests take together (their peak in an unlimited run, counted as cache_pool
    counts it: rows plus the slab / arena slots they reserve): requests are preempted and recomputed, and the
    outputs stay those of the unlimited run."""
    from deepinfer_sg.engine.engine import EngineConfig, LLMEngine

    prompts = [f"Pressure {i}" for i in range(6)]
    params = [SamplingParams(max_tokens=10, temperature=0.0 if i % 2 else 0.9, seed=i) for i in range(6)]
    cons = [Regex(r"[a-z]{2,9}") if i % 3 == 0 else None for i in range(6)]
    free = llm.generate(prompts, params, constraint=cons)
    peak = None
    preempted = 0
    for share in (None, 0.3, 0.4, 0.5, 0.6):     # None: unlimited, for the peak
        limit = None if share is None else int(peak * share)
        tight = LLMEngine(llm.model, llm.tokenizer, EngineConfig(cache_limit_bytes=limit),
                          compiler=llm.engine.compiler)
        ids = [tight.add_request(p, sp, c) for p, sp, c in zip(prompts, params, cons)]
        outs = tight.run_until_done(ids)
        tight.close()
        peak = peak or tight.pool.peak_bytes
        preempted += tight.stats.num_preemptions
        assert [o.error for o in outs] == [None] * 6
        assert [o.token_ids for o in outs] == [o.token_ids for o in free]
    assert preempted > 0