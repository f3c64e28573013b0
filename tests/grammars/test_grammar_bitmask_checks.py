"""Matchers write masks by address: every bitmask they are handed is checked (type, dtype, device, shape,
contiguity, row bound) before a byte is written, whichever matcher saw the tensor first, and a tensor re-pointed
in place is followed to its new memory. Oracle: raw llguidance's own mask at the same text."""
import pytest
import torch

from deepinfer_sg.grammars import JsonSchema, allocate_bitmask, fill_masks
from grammar_testutil import DEEPSEEK_VOCAB, EOS, encode

WORDS = (DEEPSEEK_VOCAB + 31) // 32
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def raw_mask(raw_lltokenizer, grammar, ids):
    from llguidance import LLMatcher

    r = LLMatcher(raw_lltokenizer, grammar, log_level=0)
    assert all(r.consume_token(t) for t in ids)
    want = allocate_bitmask(1, DEEPSEEK_VOCAB)
    r.unsafe_compute_mask_ptr(want.data_ptr(), WORDS * 4)
    return want[0]


def matchers(compiler, xgr_compiler, ds_tokenizer):
    """A live llguidance matcher, a finished one and an xgrammar one."""
    spec = JsonSchema(SCHEMA, whitespace="compact")
    live, done = compiler.compile(spec).matcher(), compiler.compile(spec).matcher()
    for t in encode(ds_tokenizer, '{"n":7}'):
        assert done.accept(t)
    assert done.accept(EOS)
    return [live, done, xgr_compiler.compile(spec).matcher()]


BAD = [
    ("not a tensor", lambda: [[0] * WORDS], 0),
    ("int64", lambda: torch.zeros((2, WORDS), dtype=torch.int64), 0),
    ("words", lambda: torch.zeros((2, WORDS + 1), dtype=torch.int32), 0),
    ("1-d", lambda: torch.zeros(WORDS, dtype=torch.int32), 0),
    ("strided", lambda: torch.zeros((2, 2 * WORDS), dtype=torch.int32)[:, ::2], 0),
    ("row -1", lambda: torch.zeros((2, WORDS), dtype=torch.int32), -1),
    ("row 2 of 2", lambda: torch.zeros((2, WORDS), dtype=torch.int32), 2),
]


@pytest.mark.parametrize("what,make,row", BAD, ids=[b[0] for b in BAD])
def test_bad_bitmasks_are_refused_before_writing(compiler, xgr_compiler, ds_tokenizer, what, make, row):
    for m in matchers(compiler, xgr_compiler, ds_tokenizer):
        good = allocate_bitmask(2, DEEPSEEK_VOCAB)
        m.fill_mask(good, 1)  # another tensor validated first (by this matcher and, globally, by the last check)
        bad = make()
        before = bad.clone() if isinstance(bad, torch.Tensor) else None
        with pytest.raises(ValueError):
            m.fill_mask(bad, row)
        if before is not None:
            assert torch.equal(bad, before), f"{what}: written although refused"


def test_a_tensor_one_matcher_checked_is_still_bounded_for_the_next(compiler, xgr_compiler, ds_tokenizer):
    """Matchers share the record of the last tensor checked: the next matcher on it still gets the row bound."""
    ms = matchers(compiler, xgr_compiler, ds_tokenizer)
    out = allocate_bitmask(3, DEEPSEEK_VOCAB)
    for i, m in enumerate(ms):
        m.fill_mask(out, i)
    for m in ms:
        with pytest.raises(ValueError):
            m.fill_mask(out, 3)
    with pytest.raises(ValueError):
        fill_masks(ms, out=allocate_bitmask(2, DEEPSEEK_VOCAB))  # 3 rows needed


def test_a_tensor_re_pointed_in_place_is_followed(compiler, raw_lltokenizer, ds_tokenizer):
    compiled = compiler.compile(JsonSchema(SCHEMA, whitespace="compact"))
    m = compiled.matcher()
    out = allocate_bitmask(1, DEEPSEEK_VOCAB)
    m.fill_mask(out, 0)
    old_storage = out.untyped_storage()
    out.set_(torch.zeros((4, WORDS), dtype=torch.int32))  # the same tensor object, new memory, more rows
    assert out.untyped_storage().data_ptr() != old_storage.data_ptr()
    m.fill_mask(out, 3)
    assert torch.equal(out[3], raw_mask(raw_lltokenizer, compiled.grammar, []))
    assert not out[:3].any()


@pytest.mark.parametrize("rows", [1, 0])
def test_a_tensor_re_pointed_in_place_is_followed_on_the_same_row(compiler, raw_lltokenizer, rows):
    """The same tensor and the same row as the last fill, but new memory (set_): fill_mask's fast path (the cached
    address) must notice, write the new memory (or refuse a tensor left with no rows) and never the old one."""
    compiled = compiler.compile(JsonSchema(SCHEMA, whitespace="compact"))
    m = compiled.matcher()
    out = allocate_bitmask(2, DEEPSEEK_VOCAB)
    m.fill_mask(out, 0)
    old = out[:]  # a view of the old storage, kept alive
    old.zero_()
    out.set_(torch.zeros((rows, WORDS), dtype=torch.int32))
    if rows:
        m.fill_mask(out, 0)
        assert torch.equal(out[0], raw_mask(raw_lltokenizer, compiled.grammar, []))
    else:
        with pytest.raises(ValueError):
            m.fill_mask(out, 0)
    assert not old.any()


def test_a_storage_shrunk_in_place_is_refused(compiler, xgr_compiler, ds_tokenizer):
    """A storage resized below its tensor's shape (the shape stays) must not be written by address: refused."""
    for m in matchers(compiler, xgr_compiler, ds_tokenizer):
        out = allocate_bitmask(2, DEEPSEEK_VOCAB)
        m.fill_mask(out, 1)
        out.untyped_storage().resize_(WORDS * 4)  # one row's bytes left; the tensor still says 2 rows
        with pytest.raises(ValueError, match="storage"):
            m.fill_mask(out, 1)
