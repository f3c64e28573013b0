"""ConstraintCompiler: byte-bounded cache, async compile, timeout that leaves the process healthy."""
import threading

import pytest

from deepinfer_sg.grammars import ConstraintCompiler, ConstraintError, JsonSchema, Regex
from grammar_testutil import EOS, encode


def test_cache_hit_returns_same_object(compiler):
    a = compiler.compile(Regex("cached[0-9]"))
    assert compiler.compile(Regex("cached[0-9]")) is a
    assert compiler.compile(Regex("cached[0-8]")) is not a


def test_cache_is_bounded_in_bytes(ds_tokenizer):
    c = ConstraintCompiler(ds_tokenizer, cache_bytes=300_000)
    sizes = []
    for i in range(20):
        sizes.append(c.compile(Regex(f"item{i}")).nbytes)
        assert c.cached_bytes <= 300_000
    assert sum(sizes) > 300_000  # so eviction really happened
    assert c.compile(Regex("item19")) is c.compile(Regex("item19"))  # most recent one still cached
    c.close()


def test_compile_async_and_shared_inflight(compiler, ds_tokenizer):
    spec = JsonSchema({"type": "array", "items": {"type": "integer"}, "maxItems": 4})
    futures = [compiler.compile_async(spec) for _ in range(4)]
    results = [f.result(timeout=30) for f in futures]
    assert all(r is results[0] for r in results)
    m = results[0].matcher()
    ids = encode(ds_tokenizer, "[1,2,3,4]")
    assert m.check_draft(ids + [EOS]) == len(ids) + 1


def test_async_error_is_constraint_error(compiler):
    future = compiler.compile_async(Regex("[unclosed"))
    with pytest.raises(ConstraintError):
        future.result(timeout=30)


def test_timeout_refuses_and_process_stays_healthy(ds_tokenizer):
    c = ConstraintCompiler(ds_tokenizer, timeout_s=0.05, max_workers=1)
    gate = threading.Event()
    original = c._compile_now

    def slow(spec):  # stands in for a pathological schema: the worker is busy past the timeout
        if getattr(spec, "pattern", "") == "slow":
            gate.wait(10)
        return original(spec)

    c._compile_now = slow
    with pytest.raises(ConstraintError, match="longer than 0.05 s"):
        c.compile(Regex("slow"))
    gate.set()
    c.timeout_s = 30
    m = c.compile(Regex("fine")).matcher()  # the same compiler keeps working afterwards
    ids = encode(ds_tokenizer, "fine")
    assert m.check_draft(ids + [EOS]) == len(ids) + 1
    c.close()


def test_vocab_size_and_eos(ds_tokenizer):
    with pytest.raises(ConstraintError, match="smaller"):
        ConstraintCompiler(ds_tokenizer, vocab_size=1000)
    c = ConstraintCompiler(ds_tokenizer)
    assert c.vocab_size == 129_280 and c.vocab.eos_token_ids == (1,)
    c.close()


def test_backend_choice(ds_tokenizer):
    with pytest.raises(ConstraintError, match="backend"):
        ConstraintCompiler(ds_tokenizer, backend="fast")
    c = ConstraintCompiler(ds_tokenizer, backend="xgrammar")
    # xgrammar gets `pattern` wrong (full match instead of search): refused, with the pointer
    with pytest.raises(ConstraintError, match="'pattern' at pointer '/properties/a/pattern'"):
        c.compile(JsonSchema({"type": "object", "properties": {"a": {"type": "string", "pattern": "x"}}}))
    c.close()


def test_property_order_is_part_of_the_cache_key(compiler, ds_tokenizer):
    """Schemas equal but for the order of `properties` are equal specs, yet each generates its own order
    (a shared cache entry would make the second reject its own key order)."""
    ab = JsonSchema({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                     "required": ["a", "b"], "additionalProperties": False}, whitespace="compact")
    ba = JsonSchema({"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}},
                     "required": ["a", "b"], "additionalProperties": False}, whitespace="compact")
    assert ab == ba
    for spec, text in ((ab, '{"a":1,"b":2}'), (ba, '{"b":1,"a":2}')):
        ids = encode(ds_tokenizer, text)
        assert compiler.compile(spec).matcher().check_draft(ids + [EOS]) == len(ids) + 1


def test_small_specs_compile_inline_and_hostile_ones_end_cleanly(ds_tokenizer, monkeypatch):
    """A blocking compile of a small spec that llguidance handles runs on the caller's thread (no worker is
    started); llguidance's parser limits bound its work, so hostile small schemas end with a result or a
    ConstraintError. The slow xgrammar fallback still runs on a worker, under the timeout."""
    import json

    from deepinfer_sg.grammars import backend_xgrammar

    c = ConstraintCompiler(ds_tokenizer)
    hostile = [
        JsonSchema({"allOf": [{"anyOf": [{"type": "object", "properties": {f"a{i}": {"type": "integer"}}, "required": [f"a{i}"]},
                                         {"type": "object", "properties": {f"b{i}": {"type": "string"}}, "required": [f"b{i}"]}]}
                              for i in range(20)]}),  # 2^20 combinations
        JsonSchema({"allOf": [{"type": "string", "pattern": f"^.*{chr(97 + i)}.*$"} for i in range(20)]}),
        JsonSchema({"type": "string", "pattern": "^((a|b){1,100}c){1,100}$", "maxLength": 100000}),
        JsonSchema(json.loads('{"type":"array","items":' * 60 + '{"type":"integer"}' + '}' * 60)),
        JsonSchema({"type": "number", "multipleOf": 0.0001234}),
        Regex("(a|aa)*(b|bb)*" * 50),
    ]
    outcomes = []
    for spec in hostile:
        try:
            c.compile(spec)
            outcomes.append("ok")
        except ConstraintError:
            outcomes.append("refused")
    assert "refused" in outcomes and "ok" in outcomes
    assert not c._pool._threads  # all of it on the caller's thread

    threads = []
    original = backend_xgrammar.compile_spec

    def spy(spec, vocab):
        threads.append(threading.current_thread().name)
        return original(spec, vocab)

    monkeypatch.setattr(backend_xgrammar, "compile_spec", spy)
    with pytest.raises(ConstraintError, match="Unsatisfiable"):  # llguidance refuses; xgrammar is tried too
        c.compile(JsonSchema({"type": "integer", "minimum": 5, "maximum": 3}))
    assert threads and all(t.startswith("grammar-compile") for t in threads)
    c.close()


@pytest.mark.parametrize("schema", [{}, {"type": "string"},
                                    {"type": "object", "properties": {"é": {"enum": ["ü", 1]}}},
                                    {"$defs": {"n": {"type": "integer"}}, "items": {"$ref": "#/$defs/n"}}])
@pytest.mark.parametrize("whitespace", ["compact", "bounded", "indented"])
def test_json_grammar_text_is_what_llguidance_builds_from_the_schema_text(compiler, schema, whitespace):
    """We wrap the schema's JSON text into llguidance's top-level grammar ourselves (cheaper than its call); the
    result must parse to exactly what LLMatcher.grammar_from_json_schema builds from the same schema with our
    options as overrides (llguidance's own construction, the oracle)."""
    import json

    from llguidance import LLMatcher

    from deepinfer_sg.grammars import backend_llguidance

    spec = JsonSchema(schema, whitespace=whitespace)
    ours = json.loads(compiler.compile(spec).grammar)
    theirs = json.loads(LLMatcher.grammar_from_json_schema(schema, overrides=backend_llguidance.json_options(spec)))
    (g_ours,), (g_theirs,) = ours["grammars"], theirs["grammars"]
    assert g_ours["json_schema"] == g_theirs["json_schema"]
    assert all(v is None for k, v in g_theirs.items() if k not in g_ours and k != "name")
    assert all(v is None for k, v in theirs.items() if k != "grammars")


@pytest.fixture(scope="module")
def cache_off_compiler(ds_tokenizer):
    c = ConstraintCompiler(ds_tokenizer, cache_bytes=0)
    yield c
    c.close()


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"d": {"type": "string", "format": "date"}}, "required": ["d"]},  # rewritten
    {"oneOf": [{"type": "string"}, {"type": "integer"}], "description": "two disjoint branches"},  # rewritten
    {"type": "array", "items": {"type": "integer"}, "maxItems": 3},  # as given
])
def test_cache_off_compiles_the_same_grammar_inline(cache_off_compiler, compiler, schema):
    """With the cache off, compile() builds no cache key (the schema's own text is never encoded when it is
    rewritten); llguidance gets the very grammar the caching compiler hands it, on the caller's thread."""
    spec = JsonSchema(schema, whitespace="compact")
    a, b = cache_off_compiler.compile(spec), cache_off_compiler.compile(spec)
    assert a is not b and a.grammar == b.grammar == compiler.compile(JsonSchema(schema, whitespace="compact")).grammar
    assert not cache_off_compiler._pool._threads


def test_cache_off_large_schema_goes_to_a_worker(cache_off_compiler, monkeypatch):
    """An inline compile measures the grammar text it made (the rewrite's, with the cache off): past
    INLINE_MAX_CHARS the compile runs on a worker, under the timeout."""
    from deepinfer_sg.grammars import backend_llguidance, compiler as compiler_module

    threads = []
    original = backend_llguidance.compile_spec

    def spy(spec, vocab, *args):
        threads.append(threading.current_thread().name)
        return original(spec, vocab, *args)

    monkeypatch.setattr(backend_llguidance, "compile_spec", spy)
    props = {f"p{i}": {"type": "string", "format": "date", "description": "x" * 40} for i in range(200)}
    schema = {"type": "object", "properties": props}
    assert len(JsonSchema(schema).layout_key()) > compiler_module.INLINE_MAX_CHARS
    cache_off_compiler.compile(JsonSchema(schema))
    assert threads and threads[-1].startswith("grammar-compile")


@pytest.mark.parametrize("schema,message", [
    ({"enum": ["a", {1, 2}]}, "not JSON-serializable"),  # handed to llguidance as given
    ({"oneOf": [{"const": 1}, {"const": {1}}]}, "not JSON-serializable"),  # rewritten first
    ({"enum": ["a\udcff"]}, "not valid UTF-8"),  # a lone surrogate
])
def test_a_schema_that_is_not_json_is_refused_by_compile(cache_off_compiler, compiler, schema, message):
    """JsonSchema encodes its schema on first use, not at construction: compile() refuses one that is not JSON,
    with or without the cache."""
    for c in (compiler, cache_off_compiler):
        with pytest.raises(ConstraintError, match=message):
            c.compile(JsonSchema(schema))


def test_a_schema_that_contains_itself_is_refused(cache_off_compiler, compiler):
    schema = {"type": "object", "properties": {}}
    schema["properties"]["a"] = schema
    for c in (compiler, cache_off_compiler):
        with pytest.raises(ConstraintError, match="nested too deeply"):
            c.compile(JsonSchema(schema))
