"""Triggered constraints: KMP over token ids, bound-token forcing, rollback of trigger progress."""
import random

import torch

from deepinfer_sg.grammars import Regex, Triggered, allocate_bitmask, bitmask_to_bool
from deepinfer_sg.grammars.trigger import kmp_failure, kmp_step
from grammar_testutil import DEEPSEEK_VOCAB, EOS, encode


def first_match_end(seq, pattern):
    """Oracle: index just after the first occurrence of pattern in seq (naive search), or None."""
    for end in range(len(pattern), len(seq) + 1):
        if tuple(seq[end - len(pattern): end]) == tuple(pattern):
            return end
    return None


def test_kmp_finds_first_occurrence_like_naive_search():
    rng = random.Random(0)
    for _ in range(500):
        pattern = tuple(rng.choice([1, 2, 3]) for _ in range(rng.randint(1, 4)))
        seq = [rng.choice([1, 2, 3]) for _ in range(rng.randint(0, 12))]
        fail, progress, found = kmp_failure(pattern), 0, None
        for i, t in enumerate(seq):
            progress = kmp_step(pattern, fail, progress, t)
            if progress == len(pattern):
                found = i + 1
                break
        assert found == first_match_end(seq, pattern), (pattern, seq)


def allowed(m):
    mask = allocate_bitmask(1, DEEPSEEK_VOCAB)
    m.fill_mask(mask, 0)
    return bitmask_to_bool(mask, DEEPSEEK_VOCAB)[0]


def test_free_text_then_grammar(compiler, ds_tokenizer):
    trigger = [128806, 128808]  # <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>
    m = compiler.compile(Triggered(Regex("[0-9]{2}"), trigger)).matcher()
    assert not m.is_constrained()
    free = allowed(m)
    assert free[: ds_tokenizer.get_vocab_size()].sum() > 127_000 and free[EOS]
    placeholder = ds_tokenizer.token_to_id("<｜place▁holder▁no▁0｜>")
    assert placeholder is not None and not free[placeholder] and not m.accept(placeholder)
    for t in encode(ds_tokenizer, "let me call ") + [128806, 5, 128806]:  # partial, broken, restarted
        assert m.accept(t)
    assert not m.is_constrained()
    assert m.accept(128808)
    assert m.is_constrained()
    digits = allowed(m)
    assert not digits[EOS] and digits[encode(ds_tokenizer, "4")[0]]
    for t in encode(ds_tokenizer, "42"):
        assert m.accept(t)
    assert m.accept(EOS) and m.is_terminated()


def test_bound_token_forces_rest_of_trigger(compiler, ds_tokenizer):
    trigger = [128806, 128808]
    m = compiler.compile(Triggered(Regex("ok"), trigger, bound_token_id=128806)).matcher()
    assert m.accept(128806)
    assert m.is_constrained()
    only = allowed(m)
    assert only.sum() == 1 and only[128808]
    assert m.forced_tokens()[0] == 128808
    assert not m.accept(5)
    assert m.accept(128808)
    ok = encode(ds_tokenizer, "ok")
    assert m.check_draft(ok + [EOS]) == len(ok) + 1


def test_rollback_restores_trigger_progress(compiler, ds_tokenizer):
    trigger = [128806, 128808]
    m = compiler.compile(Triggered(Regex("[a-z]+"), trigger, bound_token_id=128806)).matcher()
    prefix = encode(ds_tokenizer, "hi")
    seq = prefix + trigger + encode(ds_tokenizer, "abc")
    masks = []
    for t in seq:
        masks.append((allowed(m), m.is_constrained()))
        assert m.accept(t)
    for back in range(1, len(seq) + 1):
        m.rollback(1)
        mask, constrained = masks[-back]
        assert m.is_constrained() == constrained
        assert torch.equal(allowed(m), mask)
