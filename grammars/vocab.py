"""What the backends need to know about a tokenizer: the bytes of every token id, which ids are special,
the EOS ids, and the model's logit width.

DeepSeek-V4: the tokenizer knows 129,280 ids and the model has 129,280 logits; ids 128,000.. are added
tokens, most of them special (`<｜User｜>`, placeholders `<｜place▁holder▁no▁N｜>`...). Special tokens are
never allowed inside JSON/regex text; llguidance lets a Lark grammar name them (`<|...|>` / `<[id]>`).
Logit ids at or beyond the tokenizer's size (padding) are never allowed by any backend.
Building a `TokenizerVocab` decodes all ids once (~0.5 s for 129k ids); the compiler builds it once.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property

from .specs import ConstraintError


def _byte_level_decoder() -> dict[str, int]:
    # GPT-2 byte-to-unicode table: printable bytes map to themselves, the rest to U+0100.. in order.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


@dataclass
class TokenizerVocab:
    """A `tokenizers.Tokenizer` seen by the grammar backends.

    vocab_size: the model's logit width (>= number of tokenizer ids); ids beyond the tokenizer are padding.
    eos_token_ids: ids that end generation (default: the tokenizer's EOS, `<｜end▁of▁sentence｜>` = 1).
    """

    tokenizer: object
    vocab_size: int
    eos_token_ids: tuple
    tokenizer_json: str = field(repr=False)
    n_tokens: int = 0
    special_ids: frozenset = frozenset()
    never_ids: frozenset = frozenset()  # placeholder / padding tokens: never allowed, even in free text

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size=None, eos_token_ids=None) -> "TokenizerVocab":
        if not hasattr(tokenizer, "to_str"):
            # transformers fast tokenizers wrap a tokenizers.Tokenizer
            inner = getattr(tokenizer, "backend_tokenizer", None)
            if inner is None:
                raise ConstraintError(f"need a tokenizers.Tokenizer (or HF fast tokenizer), got {type(tokenizer).__name__}")
            tokenizer = inner
        n_tokens = tokenizer.get_vocab_size(with_added_tokens=True)
        added = tokenizer.get_added_tokens_decoder()
        special = frozenset(i for i, t in added.items() if t.special)
        if vocab_size is None:
            vocab_size = n_tokens
        if vocab_size < n_tokens:
            raise ConstraintError(f"vocab_size {vocab_size} is smaller than the tokenizer's {n_tokens} ids")
        if eos_token_ids is None:
            eos_token_ids = _default_eos(tokenizer, added)
        eos = tuple(int(e) for e in ([eos_token_ids] if isinstance(eos_token_ids, int) else eos_token_ids))
        for e in eos:
            if not 0 <= e < n_tokens:
                raise ConstraintError(f"EOS id {e} is outside the tokenizer's {n_tokens} ids")
        never = frozenset(i for i, t in added.items() if _is_placeholder(t.content))
        return cls(tokenizer=tokenizer, vocab_size=int(vocab_size), eos_token_ids=eos,
                   tokenizer_json=tokenizer.to_str(), n_tokens=n_tokens, special_ids=special, never_ids=never)

    @property
    def bitmask_words(self) -> int:
        return (self.vocab_size + 31) // 32

    @cached_property
    def bitmask_nbytes(self) -> int:
        """Bytes per bitmask row."""
        return self.bitmask_words * 4

    @cached_property
    def fingerprint(self) -> str:
        h = hashlib.sha256(self.tokenizer_json.encode())
        h.update(f"{self.vocab_size}:{self.eos_token_ids}".encode())
        return h.hexdigest()[:16]

    @cached_property
    def added_ids(self) -> frozenset:
        """Ids of the tokenizer's added tokens (special or not: `<｜User｜>`, `｜DSML｜`, ...)."""
        return frozenset(self.tokenizer.get_added_tokens_decoder())

    @cached_property
    def rare_ids(self) -> frozenset:
        """The added tokens and EOS: the ids a matcher's accept() must send down its rare path."""
        return self.added_ids | frozenset(self.eos_token_ids)

    @cached_property
    def token_bytes(self) -> list:
        """bytes of each tokenizer id when it appears in text; b"" for special tokens (never text)."""
        model = json.loads(self.tokenizer_json)
        decoder = model.get("decoder") or {}
        kinds = _decoder_kinds(decoder)
        byte_level = _byte_level_decoder() if "ByteLevel" in kinds else None
        out = []
        for i in range(self.n_tokens):
            if i in self.special_ids:
                out.append(b"")
                continue
            piece = self.tokenizer.id_to_token(i)
            if piece is None:
                out.append(b"")
            elif byte_level is not None and all(c in byte_level for c in piece):
                out.append(bytes(byte_level[c] for c in piece))
            elif "ByteFallback" in kinds and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                out.append(bytes([int(piece[3:5], 16)]))
            elif "Metaspace" in kinds or "Replace" in kinds:
                out.append(piece.replace("\u2581", " ").encode("utf-8"))
            else:
                out.append(piece.encode("utf-8"))
        return out


def _decoder_kinds(decoder: dict) -> set:
    kinds = {decoder.get("type")}
    for d in decoder.get("decoders", []) or []:
        kinds |= _decoder_kinds(d)
    return kinds


def _default_eos(tokenizer, added) -> tuple:
    for name in ("<｜end▁of▁sentence｜>", "</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|im_end|>"):
        i = tokenizer.token_to_id(name)
        if i is not None:
            return (i,)
    raise ConstraintError("cannot find the tokenizer's EOS token; pass eos_token_ids explicitly")


def _is_placeholder(content: str) -> bool:
    c = content.lower().replace("\u2581", "_")
    return "place_holder" in c or "placeholder" in c or c in ("<｜_pad_｜>", "<pad>", "[pad]", "<|pad|>")
