"""Incremental detokenization that never splits a UTF-8 character, plus stop-string handling.

Byte-level BPE tokens can end in the middle of a multi-byte character; decoding such a prefix yields
U+FFFD. We therefore decode a small window of recent tokens and only release text once the window's
decode no longer ends in U+FFFD (the vLLM "prefix/read offset" scheme). Cost: one decode of a few
tokens per generated token, independent of the output length.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

REPLACEMENT_CHAR = "\ufffd"


@dataclass
class IncrementalDetokenizer:
    """Feed token ids one at a time; `text` is the decoded output so far (complete characters only)."""

    tokenizer: object  # tokenizers.Tokenizer
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def add(self, token_id: int) -> str:
        """Append one token; returns the newly completed text (may be '' while a character is partial)."""
        self.token_ids.append(int(token_id))
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            delta = new_text[len(prefix_text):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end of generation: release whatever is left (a truly invalid byte tail stays U+FFFD)."""
        tail = self._decode(self.token_ids[self.prefix_offset:])
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        delta = tail[len(prefix_text):] if len(tail) > len(prefix_text) else ""
        self.text += delta
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return delta


def find_stop(text: str, stops: list[str], search_from: int) -> Optional[int]:
    """Index in `text` where the earliest stop string begins, looking only at matches that end after
    `search_from` (the text before it was already checked); None if no stop string occurs."""
    best = None
    for s in stops:
        i = text.find(s, max(0, search_from - len(s) + 1))
        if i >= 0 and (best is None or i < best):
            best = i
    return best


def stop_holdback(text: str, stops: list[str]) -> int:
    """How many trailing characters of `text` might still become a stop string (so must not be
    streamed out yet): the longest proper prefix of any stop string that `text` ends with."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return hold
