"""Incremental detokenization against the tokenizer's own full decode, with multi-byte characters split
across byte-level tokens; stop-string search and hold-back."""
from __future__ import annotations

import random

from deepinfer_sg.engine.detokenizer import IncrementalDetokenizer, find_stop, stop_holdback
from deepinfer_sg.tokenizer import load_tokenizer

TOK = load_tokenizer()
TEXTS = ["Hello, wörld! 你好，世界。🙂🚀 naïve café — ok", "日本語のテキスト 🧑‍💻 emoji ZWJ", '{"name": "Zoë", "age": 3}']


def test_incremental_equals_full_decode_and_never_splits_a_character():
    for text in TEXTS:
        ids = TOK.encode(text, add_special_tokens=False).ids
        detok = IncrementalDetokenizer(TOK)
        pieces = [detok.add(t) for t in ids]
        pieces.append(detok.flush())
        assert "".join(pieces) == TOK.decode(ids, skip_special_tokens=False) == text
        assert all("\ufffd" not in p for p in pieces)


def test_random_token_streams_match_full_decode():
    rng = random.Random(0)
    vocab = TOK.get_vocab_size()
    for _ in range(20):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        detok = IncrementalDetokenizer(TOK)
        out = "".join(detok.add(t) for t in ids) + detok.flush()
        assert out == TOK.decode(ids, skip_special_tokens=False)


def test_byte_level_pieces_of_one_character_wait_for_the_whole_character():
    # the tokenizer's byte tokens for a 4-byte emoji, fed one byte-token at a time
    byte_ids = [TOK.token_to_id(tok) for tok in ("ðŁ", "Ļ", "Ĥ")]
    if any(i is None for i in byte_ids):
        byte_ids = TOK.encode("🙂", add_special_tokens=False).ids
    detok = IncrementalDetokenizer(TOK)
    emitted = [detok.add(t) for t in byte_ids]
    full = TOK.decode(byte_ids, skip_special_tokens=False)
    assert "".join(emitted) + detok.flush() == full
    assert all("\ufffd" not in e for e in emitted[:-1])


def test_stop_search_and_holdback():
    assert find_stop("abc END def", ["END"], 0) == 4
    assert find_stop("abc END def", ["END"], 8) is None     # the match ended before the new text
    assert find_stop("abc EN", ["END", "c E"], 0) == 2
    assert stop_holdback("abc EN", ["END"]) == 2
    assert stop_holdback("abc E", ["END", "E!"]) == 1
    assert stop_holdback("abc", ["END"]) == 0
