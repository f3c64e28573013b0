"""xgrammar backend: pushdown automaton with precomputed per-state token masks (fast masks, slower compile).

Used by `backend="auto"` only for schemas whose every keyword xgrammar implements exactly
(schema_support.py); always with strict_mode=False (JSON Schema semantics: extra properties allowed unless
the schema says otherwise). xgrammar's own compile cache is off: ours is bounded in bytes.
"""
from __future__ import annotations

import os
import threading
from operator import countOf

import torch
import xgrammar as xgr

from .matcher import check_draft_on_fork, row_address, set_only
from .specs import ConstraintError, Grammar, JsonSchema, Regex
from .vocab import TokenizerVocab

# xgrammar >= 0.2 keeps unlimited rollback history (max_rollback_tokens is deprecated)
BOUNDED_WS_COUNT = 64  # at most this many whitespace characters between two JSON tokens

_INFO_CACHE: dict = {}
_INFO_LOCK = threading.Lock()


def tokenizer_info(vocab: TokenizerVocab) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocab: raw token bytes; special tokens as empty strings (never allowed)."""
    with _INFO_LOCK:
        info = _INFO_CACHE.get(vocab.fingerprint)
        if info is None:
            info = xgr.TokenizerInfo(vocab.token_bytes, xgr.VocabType.RAW, vocab_size=vocab.vocab_size,
                                     stop_token_ids=list(vocab.eos_token_ids))
            _INFO_CACHE[vocab.fingerprint] = info
        return info


def compile_spec(spec, vocab: TokenizerVocab):
    compiler = xgr.GrammarCompiler(tokenizer_info(vocab), max_threads=1, cache_enabled=False)
    try:
        if isinstance(spec, Regex):
            compiled = compiler.compile_regex(spec.pattern)
        elif isinstance(spec, JsonSchema):
            import json

            kwargs = dict(strict_mode=False)
            if spec.whitespace == "compact":
                kwargs.update(any_whitespace=False, separators=(",", ":"))
            elif spec.whitespace == "indented":
                kwargs.update(any_whitespace=False, indent=spec.indent, separators=(",", ": "))
            else:
                kwargs.update(any_whitespace=True, max_whitespace_cnt=BOUNDED_WS_COUNT)
            compiled = compiler.compile_json_schema(json.dumps(spec.schema), **kwargs)
        elif isinstance(spec, Grammar):
            if spec.syntax != "ebnf":
                raise ConstraintError("xgrammar backend takes EBNF grammars only (use llguidance for Lark)")
            compiled = compiler.compile_grammar(spec.text, root_rule_name="root")
        else:
            raise ConstraintError(f"xgrammar backend cannot compile {type(spec).__name__}")
    except ConstraintError:
        raise
    except Exception as e:  # xgrammar raises RuntimeError/ValueError with its parser's message
        raise ConstraintError(f"xgrammar: {str(e).strip()}") from None
    return XGrammarCompiled(vocab, compiled)


class XGrammarCompiled:
    backend = "xgrammar"

    def __init__(self, vocab: TokenizerVocab, compiled: xgr.CompiledGrammar):
        self.vocab = vocab
        self.compiled = compiled
        self.nbytes = int(compiled.memory_size_bytes) if hasattr(compiled, "memory_size_bytes") else 1 << 20

    def matcher(self) -> "XGrammarMatcher":
        return XGrammarMatcher(xgr.GrammarMatcher(self.compiled), self.vocab)


def _forward_fill(m: xgr.GrammarMatcher):
    """fill(bitmask, row, debug_print) through xgrammar's public method (an xgrammar without `_handle`)."""
    return lambda bitmask, row, debug_print: m.fill_next_token_bitmask(bitmask, row, debug_print=debug_print)


class XGrammarMatcher:
    """Matcher protocol over `xgr.GrammarMatcher` (EOS = xgrammar stop token; terminated after it)."""

    __slots__ = ("m", "_fill", "vocab", "vocab_size", "_words", "_bm", "_ptr", "_rows")

    def __init__(self, m: xgr.GrammarMatcher, vocab: TokenizerVocab):
        self.m = m
        # xgrammar's fill_next_token_bitmask is one Python frame forwarding to its C++ matcher's method
        # (`_handle`): call that directly (a frame less per mask; the same checks, in C++)
        handle = getattr(m, "_handle", None)
        self._fill = handle.fill_next_token_bitmask if handle is not None else _forward_fill(m)
        self.vocab = vocab
        self.vocab_size = vocab.vocab_size
        self._words = vocab.bitmask_words
        self._bm = self._ptr = None  # the last bitmask validated (checked once per tensor)
        self._rows = 0

    def fill_mask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        # xgrammar checks dtype, width and row itself, but not contiguity (it writes a strided view as if it were
        # dense): our check, once per tensor, the same as the llguidance matcher's
        if not (bitmask is self._bm and 0 <= row < self._rows and bitmask.data_ptr() == self._ptr):
            row_address(self, bitmask, row)
        try:
            self._fill(bitmask, row, False)
        except RuntimeError:  # xgrammar refuses a mask after the stop token (checked before writing anything)
            if not self.m.is_terminated():
                raise
            set_only(bitmask, row, self.vocab.eos_token_ids)

    @staticmethod
    def fill_batch(matchers, drafts, starts, out: torch.Tensor, errors: dict):
        """fill_masks without drafts (None with drafts, or unless every matcher is an XGrammarMatcher: fill_masks
        then goes one by one): the live matchers' masks in one xgrammar batch call on its own thread pool, the
        finished ones EOS alone. `out` is validated by fill_masks."""
        if drafts is not None or countOf(map(type, matchers), XGrammarMatcher) != len(matchers):
            return None
        live, rows = [], []
        for m, row in zip(matchers, starts):
            if m.m.is_terminated():  # (xgrammar refuses a mask after the stop token)
                set_only(out, row, m.vocab.eos_token_ids)
            else:
                live.append(m.m)
                rows.append(row)
        if live:
            _batch_matcher().batch_fill_next_token_bitmask(live, out, indices=rows)
        return [0] * len(matchers)

    def accept(self, token_id: int) -> bool:
        if self.m.is_terminated() or not 0 <= token_id < self.vocab_size:
            return False
        return self.m.accept_token(int(token_id))

    def rollback(self, n: int) -> None:
        if n > 0:
            self.m.rollback(n)

    def is_terminated(self) -> bool:
        return self.m.is_terminated()

    def is_constrained(self) -> bool:
        return True

    def forced_tokens(self) -> list:
        if self.m.is_terminated():
            return []
        text = self.m.find_jump_forward_string()
        if not text:
            return []
        # Only whole tokens whose bytes the grammar forces: tokenize the forced text and keep the tokens
        # the matcher accepts (a fork, so the state is unchanged).
        ids = self.vocab.tokenizer.encode(text, add_special_tokens=False).ids
        probe = self.fork()
        out = []
        for t in ids[:-1]:  # the last token may continue past the forced text: not certain
            if not probe.accept(t):
                break
            out.append(t)
        return out

    def check_draft(self, token_ids) -> int:
        return check_draft_on_fork(self, token_ids)

    def fork(self) -> "XGrammarMatcher":
        return XGrammarMatcher(self.m.fork(), self.vocab)


_BATCH = None


def _batch_matcher() -> "xgr.BatchGrammarMatcher":
    """One xgrammar batch matcher (its thread pool) for the process, made on first use."""
    global _BATCH
    if _BATCH is None:
        _BATCH = xgr.BatchGrammarMatcher(max_threads=max(1, min(8, (os.cpu_count() or 2) - 1)))
    return _BATCH
