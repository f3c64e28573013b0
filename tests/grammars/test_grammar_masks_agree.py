"""Our masks equal the wrapped backend's own masks on seeded random walks (with rollbacks).

The oracles are raw llguidance `LLMatcher`s and raw xgrammar `GrammarMatcher`s built here straight from
the backends' public APIs (xgrammar's tokenizer info from transformers, not from our vocab.py), so the
adapter's row offsets, EOS handling, rollback bookkeeping and vocabulary decoding are all re-checked.
"""
import json
import random

import numpy as np
import pytest
import torch

from deepinfer_sg.grammars import JsonSchema, Regex, allocate_bitmask
from grammar_testutil import DATA, DEEPSEEK_VOCAB, EOS

WORDS = (DEEPSEEK_VOCAB + 31) // 32
COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


@pytest.fixture(scope="module")
def picked_schemas(raw_lltokenizer):
    return maskbench_schemas(raw_lltokenizer)


def maskbench_schemas(lltok, n=4):
    """n MaskBench schemas spread over the splits that raw llguidance compiles as they are."""
    from llguidance import LLMatcher

    files = sorted((DATA / "maskbench-dev").glob("*.json"))
    out = []
    for p in files[:: len(files) // (3 * n)]:
        schema = json.loads(p.read_text())["schema"]
        if not LLMatcher(lltok, LLMatcher.grammar_from_json_schema(schema, overrides=COMPACT), log_level=0).is_error():
            out.append(schema)
    return out[:: max(1, len(out) // n)][:n]


def raw_llg_mask(raw):
    words = torch.from_numpy(np.frombuffer(raw.compute_bitmask(), dtype=np.int32).copy())
    assert not words[WORDS:].any()  # llguidance may round up to one more word; never any bit there
    return words[:WORDS]


def random_walk(ours, raw_mask, raw_accept, raw_rollback, steps, seed):
    """Walk both matchers with random allowed tokens; compare masks each step; roll back sometimes."""
    rng = random.Random(seed)
    out = allocate_bitmask(3, DEEPSEEK_VOCAB)
    history = 0
    for step in range(steps):
        row = rng.randrange(3)
        out.zero_()
        ours.fill_mask(out, row)
        expected = raw_mask()
        assert torch.equal(out[row], expected), f"mask differs at step {step}"
        assert not out[(row + 1) % 3].any(), "fill_mask wrote outside its row"
        allowed = torch.nonzero(_unpack(expected)).flatten().tolist()
        if not allowed:
            break
        if history >= 3 and rng.random() < 0.15:
            k = rng.randint(1, min(history, 3))
            ours.rollback(k)
            raw_rollback(k)
            history -= k
            continue
        non_eos = [t for t in allowed if t != EOS]
        tok = EOS if EOS in allowed and (not non_eos or rng.random() < 0.05) else rng.choice(non_eos)
        assert ours.accept(tok)
        if tok == EOS:
            assert ours.is_terminated()
            break
        raw_accept(tok)
        history += 1
    return step


def _unpack(words):
    shifts = torch.arange(32, dtype=torch.int32)
    return ((words.unsqueeze(-1) >> shifts) & 1).flatten()[:DEEPSEEK_VOCAB].bool()


@pytest.mark.parametrize("which", range(4))
def test_llguidance_masks_agree(compiler, raw_lltokenizer, picked_schemas, which):
    from llguidance import LLMatcher

    schema = picked_schemas[which]
    ours = compiler.compile(JsonSchema(schema, whitespace="compact")).matcher()
    raw = LLMatcher(raw_lltokenizer, LLMatcher.grammar_from_json_schema(schema, overrides=COMPACT), log_level=0)
    random_walk(ours, lambda: raw_llg_mask(raw), lambda t: raw.consume_token(t), lambda k: raw.rollback(k), steps=60, seed=which)


def test_llguidance_regex_masks_agree(compiler, raw_lltokenizer):
    from llguidance import LLMatcher

    pattern = r"(\+|-)?[0-9]{1,6}(\.[0-9]{1,4})? (apples|pears)"
    ours = compiler.compile(Regex(pattern)).matcher()
    for seed in range(3):
        ours = compiler.compile(Regex(pattern)).matcher()
        raw = LLMatcher(raw_lltokenizer, LLMatcher.grammar_from_regex(pattern), log_level=0)
        random_walk(ours, lambda: raw_llg_mask(raw), lambda t: raw.consume_token(t), lambda k: raw.rollback(k), steps=30, seed=seed)


@pytest.fixture(scope="module")
def raw_xgr_info(ds_tokenizer):
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=ds_tokenizer, eos_token="<｜end▁of▁sentence｜>")
    return xgr.TokenizerInfo.from_huggingface(hf, vocab_size=DEEPSEEK_VOCAB, stop_token_ids=[EOS])


@pytest.mark.parametrize("which", range(2))
def test_xgrammar_masks_agree(xgr_compiler, raw_xgr_info, which):
    import xgrammar as xgr

    schema = [{"type": "object", "properties": {"id": {"type": "integer"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
               "required": ["id"]},
              {"type": "array", "items": {"anyOf": [{"type": "boolean"}, {"type": "null"}, {"type": "number"}]}, "maxItems": 3}][which]
    ours = xgr_compiler.compile(JsonSchema(schema, whitespace="compact")).matcher()
    assert ours.__class__.__name__ == "XGrammarMatcher"
    compiled = xgr.GrammarCompiler(raw_xgr_info, cache_enabled=False).compile_json_schema(
        json.dumps(schema), any_whitespace=False, separators=(",", ":"), strict_mode=False)
    raw = xgr.GrammarMatcher(compiled)
    buf = xgr.allocate_token_bitmask(1, DEEPSEEK_VOCAB)

    def raw_mask():
        raw.fill_next_token_bitmask(buf, 0)
        return buf[0].clone()

    random_walk(ours, raw_mask, lambda t: raw.accept_token(t), lambda k: raw.rollback(k), steps=50, seed=which)


def test_outlines_masks_agree(ds_tokenizer):
    """outlines-core: our adapter (EOS, rollback, row offsets) vs a raw Guide on the same index."""
    from outlines_core import Guide

    from deepinfer_sg.grammars import ConstraintCompiler

    c = ConstraintCompiler(ds_tokenizer, vocab_size=DEEPSEEK_VOCAB, backend="outlines")
    compiled = c.compile(Regex(r"(yes|no|maybe) [0-9]{1,3}"))
    ours = compiled.matcher()
    raw = Guide(compiled.index, max_rollback=32)
    buf = allocate_bitmask(1, DEEPSEEK_VOCAB)

    def raw_mask():
        buf.zero_()
        raw.write_mask_into(buf.data_ptr(), buf.shape[1], 4)
        return buf[0].clone()

    def raw_accept(t):
        raw.advance(t, return_tokens=False)

    random_walk(ours, raw_mask, raw_accept, lambda k: raw.rollback_state(k), steps=20, seed=0)
    c.close()
