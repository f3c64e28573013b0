"""The engine builds device token automata for regular constraints (SpecConfig(draft_masks="automaton")) and
drafts with them: outputs equal the plain (non-speculative) engine's and the CPU-mask speculative engine's,
token for token, and the drafts really came from the automaton. Oracle: the plain engine (greedy) and the
same engine with draft_masks="cpu" (same masks, same counter draws) on the bundled model, real vocabulary."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_spec_engine import TABLE, big  # noqa: E402,F401  (module fixture: bundled model, tokenizer, compiler)

from deepinfer_sg.engine import spec_decode as SD  # noqa: E402
from deepinfer_sg.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from deepinfer_sg.engine.request import SamplingParams  # noqa: E402

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "ok": {"type": "boolean"}},
          "required": ["id", "ok"], "additionalProperties": False}


def engine_outputs(big, specs, temperature, draft_masks=None):
    model, tok, compiler = big
    spec_cfg = None if draft_masks is None else SD.SpecConfig(n=3, schedule="fixed", drafter="dspark",
                                                              step_times=TABLE, draft_masks=draft_masks)
    eng = LLMEngine(model, tok, EngineConfig(speculative=spec_cfg, eos_token_id=1), compiler=compiler)
    prompt = tok.encode("Extract the record:", add_special_tokens=False).ids
    ids = [eng.add_request(prompt, SamplingParams(max_tokens=16, temperature=temperature, seed=7 + i), s)
           for i, s in enumerate(specs)]
    if draft_masks == "automaton":           # let the background builds finish so the first step can use them
        while eng.compiling:
            eng.step()
        eng.automata.wait(120)
    outs = eng.run_until_done(ids)
    eng.close()
    return outs, eng


def _specs(kind):
    from deepinfer_sg.grammars import JsonSchema, Regex
    if kind == "json":
        return [JsonSchema(SCHEMA, whitespace="compact")] * 2
    return [Regex(r"[a-c]{2}-[0-9]{2}(ok|no)?")] * 2


# sampled runs equal the CPU-mask runs token for token only where the refined automaton's masks equal the
# matcher's in every state reached (the regex); for the JSON Schema the automaton's language (outlines-core's
# regex) is wider in places, so sampled drafts differ while staying exact in law (test_grammar_draft_automaton_
# sampler.py enumerates that law); greedy outputs must be identical everywhere.
@pytest.mark.parametrize("kind,temperature", [("json", 0.0), ("regex", 0.0), ("regex", 1.0)])
def test_engine_drafts_with_device_automata(big, kind, temperature):
    from deepinfer_sg.grammars import JsonSchema, Regex
    specs = _specs(kind)
    auto, eng = engine_outputs(big, specs, temperature, "automaton")
    cpu, _ = engine_outputs(big, specs, temperature, "cpu")
    assert [o.token_ids for o in auto] == [o.token_ids for o in cpu]
    assert all(o.error is None and o.finish_reason in ("constraint_complete", "stop") for o in auto)
    assert eng.spec.stats.automaton_blocks > 0
    if temperature == 0.0:
        plain, _ = engine_outputs(big, specs, temperature)
        assert [o.token_ids for o in auto] == [o.token_ids for o in plain]
    if kind == "json":   # two different regular constraints in one batch: no shared automaton -> CPU masks
        # (once one request finishes, the other drafts with its own automaton)
        mixed = [JsonSchema(SCHEMA, whitespace="compact"), Regex(r"[a-c]{2}-[0-9]{2}")]
        auto, eng = engine_outputs(big, mixed, temperature, "automaton")
        cpu, _ = engine_outputs(big, mixed, temperature, "cpu")
        assert [o.token_ids for o in auto] == [o.token_ids for o in cpu]
        st = eng.spec.stats      # only blocks after the regex request finished may use the JSON automaton
        assert st.automaton_blocks < st.request_steps


def test_output_outside_the_automaton_language_falls_back(big):
    """A request whose committed output the automaton does not accept (its regex narrower than the verifier's
    language) stops using it instead of drafting from a DEAD state."""
    from deepinfer_sg.engine.request import Request
    from deepinfer_sg.grammars import Regex
    model, tok, compiler = big
    eng = LLMEngine(model, tok, EngineConfig(speculative=SD.SpecConfig(draft_masks="automaton"), eos_token_id=1),
                    compiler=compiler)
    wide, narrow = Regex(r"[a-c]{2}-[0-9]{2}"), Regex(r"a[a-c]-[0-9]{2}")
    key = eng.automata.request(narrow, compiler.compile(narrow))
    eng.automata.wait(120)
    assert eng.automata.get(key) is not None and key not in eng.automata.failures
    req = Request("r", [5], SamplingParams(), constraint=wide, automaton_key=key)
    req.cache = model.new_cache()
    req.output_token_ids = tok.encode("ab", add_special_tokens=False).ids
    assert eng._automaton_for(req) is not None and req.cache.extra["automaton_state"] >= 0
    req.cache, req.output_token_ids = model.new_cache(), tok.encode("ba", add_special_tokens=False).ids
    assert eng._automaton_for(req) is None and req.automaton_key is None
    eng.close()


def test_builds_are_bounded_and_failures_are_named(big):
    """Untrusted constraints: outlines-core's index runs in a child process under a time and a memory bound, and
    tables over the byte bound are refused; each failure is a reason, never an exception or a hang."""
    from deepinfer_sg.engine.automata import AutomatonLimits, build_automaton
    from deepinfer_sg.grammars import JsonSchema, Regex
    _, _, compiler = big
    ok = Regex(r"[a-c]{2}-[0-9]{2}")
    a, why = build_automaton(ok, compiler.compile(ok), compiler, "cpu")
    assert a is not None and why is None and a.num_states >= 5
    cases = [(Regex(r"(a|b)*"), AutomatonLimits(max_bytes=1 << 14), "over the bound"),
             (Regex(r"[a-z]{1,400}x"), AutomatonLimits(timeout_s=0.05), "time bound"),
             (JsonSchema({"type": "string", "maxLength": 64}), AutomatonLimits(memory_bytes=64 << 20), "memory bound")]
    for spec, limits, reason in cases:
        a, why = build_automaton(spec, compiler.compile(spec), compiler, "cpu", limits)
        assert a is None and reason in why, (spec, why)
