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
