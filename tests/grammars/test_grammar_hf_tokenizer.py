"""Any HF `tokenizers` tokenizer works: a small byte-level BPE trained here, with a padded logit width."""
import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from deepinfer_sg.grammars import ConstraintCompiler, JsonSchema, Regex, allocate_bitmask, bitmask_to_bool
from deepinfer_sg.grammars.conformance import accepts_text


@pytest.fixture(scope="module")
def small_tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [json.dumps({"name": f"item {i}", "price": i * 1.5, "tags": ["a", "b"]}) for i in range(200)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return tok


def test_small_tokenizer_json_and_padding(small_tokenizer):
    n = small_tokenizer.get_vocab_size()
    c = ConstraintCompiler(small_tokenizer, vocab_size=n + 61)  # model logits padded past the tokenizer
    eos = small_tokenizer.token_to_id("<eos>")
    assert c.vocab.eos_token_ids == (eos,)
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "price": {"type": "number"}}, "required": ["name"]}
    comp = c.compile(JsonSchema(schema))
    assert accepts_text(comp.matcher(), small_tokenizer, '{"name": "item 7", "price": 10.5}', eos)
    assert not accepts_text(comp.matcher(), small_tokenizer, '{"price": 10.5}', eos)
    m = comp.matcher()
    mask = allocate_bitmask(1, c.vocab_size)
    m.fill_mask(mask, 0)
    allowed = bitmask_to_bool(mask, c.vocab_size)[0]
    assert allowed.any() and not allowed[n:].any(), "padding ids are never allowed"
    assert not allowed[small_tokenizer.token_to_id("<pad>")]
    c.close()


def test_small_tokenizer_vocab_bytes_match_decode(small_tokenizer):
    c = ConstraintCompiler(small_tokenizer)
    for i in range(2, small_tokenizer.get_vocab_size()):
        assert c.vocab.token_bytes[i].decode("utf-8", "replace") == small_tokenizer.decode([i]) or \
            b"\xef\xbf\xbd" in small_tokenizer.decode([i]).encode()
    m = c.compile(Regex("(ab|cd)+")).matcher()
    ids = small_tokenizer.encode("abcdab").ids
    assert m.check_draft(ids) == len(ids)
    c.close()


def test_xgrammar_backend_with_small_tokenizer(small_tokenizer):
    c = ConstraintCompiler(small_tokenizer, backend="xgrammar")
    eos = small_tokenizer.token_to_id("<eos>")
    comp = c.compile(JsonSchema({"type": "array", "items": {"type": "integer"}, "maxItems": 2}, whitespace="compact"))
    assert accepts_text(comp.matcher(), small_tokenizer, "[1,22]", eos)
    assert not accepts_text(comp.matcher(), small_tokenizer, "[1,2,3]", eos)
    c.close()
