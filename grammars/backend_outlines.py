"""outlines-core backend: the whole constraint becomes one regex, precompiled eagerly into a token-level
DFA index (slow, memory-hungry compile; O(allowed tokens) masks). Used only when asked for explicitly
(`backend="outlines"`) or for schemas schema_support.py marks exact for it."""
from __future__ import annotations

import json
import threading

import torch
from outlines_core import Guide, Index, Vocabulary
from outlines_core.json_schema import build_regex_from_schema

from .matcher import check_bitmask, check_draft_on_fork, set_only
from .specs import ConstraintError, JsonSchema, Regex
from .vocab import TokenizerVocab

MAX_ROLLBACK = 32  # outlines-core's Guide limit

_VOCABS: dict = {}
_LOCK = threading.Lock()


def vocabulary_table(vocab: TokenizerVocab) -> tuple:
    """(eos id, {token bytes: [ids]}): what outlines-core's `Vocabulary(eos, table)` takes. Tokens with no bytes
    (special tokens, padding) and EOS stay out of the table, so outlines-core never allows them. O(vocab) (~50 ms
    for 129k tokens); plain Python data, so it can also be pickled to a child process (engine/automata.py)."""
    eos_ids = vocab.eos_token_ids
    table: dict = {}
    for i, b in enumerate(vocab.token_bytes):
        if b and i not in eos_ids:
            table.setdefault(b, []).append(i)
    return eos_ids[0], table


def outlines_vocabulary(vocab: TokenizerVocab) -> Vocabulary:
    """outlines-core's Vocabulary for a vocab (built once per tokenizer)."""
    with _LOCK:
        v = _VOCABS.get(vocab.fingerprint)
        if v is None:
            v = _VOCABS[vocab.fingerprint] = Vocabulary(*vocabulary_table(vocab))
        return v


def regex_for(spec) -> str:
    if isinstance(spec, Regex):
        return spec.pattern
    if isinstance(spec, JsonSchema):
        ws = {"compact": "", "indented": r"(\n[ ]{0,128})?"}.get(spec.whitespace, r"[ ]?")
        try:
            return build_regex_from_schema(json.dumps(spec.schema), ws)
        except Exception as e:
            raise ConstraintError(f"outlines-core: {e}") from None
    raise ConstraintError(f"outlines-core backend cannot compile {type(spec).__name__}")


def compile_spec(spec, vocab: TokenizerVocab):
    if len(vocab.eos_token_ids) != 1:
        raise ConstraintError("outlines-core supports exactly one EOS id")
    regex = regex_for(spec)
    try:
        index = Index(regex, outlines_vocabulary(vocab))
    except Exception as e:
        raise ConstraintError(f"outlines-core: {e}") from None
    return OutlinesCompiled(vocab, index, regex)


class OutlinesCompiled:
    backend = "outlines"

    def __init__(self, vocab, index, regex):
        self.vocab = vocab
        self.index = index
        self.regex = regex
        self.nbytes = 1 << 20  # outlines-core does not report its index size

    def matcher(self):
        return OutlinesMatcher(Guide(self.index, max_rollback=MAX_ROLLBACK), self.vocab, self.index)


class OutlinesMatcher:
    """Matcher protocol over an outlines-core Guide (EOS allowed in final states; terminated after it)."""

    __slots__ = ("g", "vocab", "vocab_size", "index", "_words", "_history")

    def __init__(self, guide, vocab, index, history=()):
        self.g = guide
        self.index = index
        self.vocab = vocab
        self.vocab_size = vocab.vocab_size
        self._words = vocab.bitmask_words
        self._history = list(history)  # accepted tokens, to rebuild a fork

    def fill_mask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        check_bitmask(bitmask, row + 1, self._words)
        if self.is_terminated():
            set_only(bitmask, row, self.vocab.eos_token_ids)
            return
        bitmask[row].zero_()
        self.g.write_mask_into(bitmask[row].data_ptr(), self._words, 4)

    def accept(self, token_id: int) -> bool:
        if self.is_terminated():
            return False
        if token_id in self.vocab.eos_token_ids:
            # outlines-core lists EOS in final states' masks but cannot advance on it: EOS is our flag
            if not self.index.is_final_state(self.g.get_state()):
                return False
            self._history.append(int(token_id))
            return True
        try:
            self.g.advance(int(token_id), return_tokens=False)  # raises (state unchanged) if not allowed
        except ValueError:
            return False
        self._history.append(int(token_id))
        return True

    def rollback(self, n: int) -> None:
        if n > 0:
            if self.is_terminated():
                self._history.pop()
                n -= 1
            if n:
                self.g.rollback_state(n)
                del self._history[-n:]

    def is_terminated(self) -> bool:
        return bool(self._history) and self._history[-1] in self.vocab.eos_token_ids

    def is_constrained(self) -> bool:
        return True

    def forced_tokens(self) -> list:
        probe = self.fork()
        out = []
        while len(out) < 64:
            allowed = probe.g.get_tokens()
            if len(allowed) != 1 or allowed[0] in self.vocab.eos_token_ids:
                break
            probe.accept(allowed[0])
            out.append(allowed[0])
        return out

    def check_draft(self, token_ids) -> int:
        return check_draft_on_fork(self, token_ids)

    def fork(self):
        # outlines-core Guides cannot be copied; rebuild from the index by replaying the history.
        g = Guide(self.index, max_rollback=MAX_ROLLBACK)
        for t in self._history:
            if t not in self.vocab.eos_token_ids:
                g.advance(t, return_tokens=False)
        return OutlinesMatcher(g, self.vocab, self.index, self._history)
