"""llguidance backend (the default): derivative-based lexer + Earley parser, compiles in ~ms, refuses
JSON Schema keywords it does not implement instead of ignoring them.

Compile = building one `LLMatcher` (lexer and grammar checks, bounded by `LLParserLimits`); every
`matcher()` is a cheap `deep_copy` of it. EOS is handled here, not by llguidance: EOS is allowed exactly
when the grammar is in an accepting state, and accepting it only sets a flag (so rollback over EOS is free).
"""
from __future__ import annotations

import threading
from functools import lru_cache

import torch
from llguidance import LLExecutor, LLMatcher, LLParserLimits, LLTokenizer

from .matcher import check_bitmask, set_only
from .specs import ConstraintError, Grammar, JsonSchema, Regex
from .vocab import TokenizerVocab

# Whitespace between JSON tokens. "bounded": a few spaces/tabs, then at most one newline and an indent;
# enough for compact and pretty-printed JSON, but a model cannot emit runaway newlines or spaces.
BOUNDED_WS = r"[ \t]{0,4}(\r?\n[ \t]{0,128})?"
INDENTED_WS = r"(\n[ ]{0,128})?"


def json_options(spec: JsonSchema) -> dict:
    """llguidance JSON compile options (applied as overrides of any x-guidance in the schema)."""
    opts = {"coerce_one_of": "oneOf-as-anyOf" in spec.approximations, "lenient": False}
    if spec.whitespace == "compact":
        opts.update(whitespace_flexible=False, item_separator=",", key_separator=":")
    elif spec.whitespace == "indented":
        opts.update(whitespace_flexible=True, whitespace_pattern=INDENTED_WS, item_separator=",", key_separator=": ")
    else:
        opts.update(whitespace_flexible=True, whitespace_pattern=BOUNDED_WS, item_separator=",", key_separator=":")
    return opts


def default_limits() -> LLParserLimits:
    # Defaults from llguidance, but fewer lexer states: ~1-2 kB each, so 100k states caps one grammar's
    # lexer near 200 MB (a hostile schema fails with an error instead of eating the machine).
    return LLParserLimits(max_lexer_states=100_000, verbose_errors=False)


def grammar_text(spec) -> str:
    """llguidance grammar (JSON-wrapped) for a spec; raises ConstraintError for EBNF it cannot convert."""
    if isinstance(spec, Regex):
        return LLMatcher.grammar_from_regex(spec.pattern)
    if isinstance(spec, JsonSchema):
        schema = spec.schema
        if isinstance(schema, dict) and "x-guidance" in schema:
            schema = {k: v for k, v in schema.items() if k != "x-guidance"}
        return LLMatcher.grammar_from_json_schema(schema if isinstance(schema, dict) else ({} if schema else {"not": {}}),
                                                  overrides=json_options(spec))
    if isinstance(spec, Grammar):
        if spec.syntax == "lark":
            return LLMatcher.grammar_from_lark(spec.text)
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            lark = gbnf_to_lark(spec.text)
        except Exception as e:  # the converter raises plain exceptions, sometimes without a line
            raise ConstraintError(f"EBNF grammar: {e}{_rule_location(spec.text, str(e))}") from None
        return LLMatcher.grammar_from_lark(lark)
    raise ConstraintError(f"llguidance backend cannot compile {type(spec).__name__}")


@lru_cache(maxsize=8)
def _lltokenizer(vocab_key: str, tokenizer_json: str, vocab_size: int, eos: tuple) -> LLTokenizer:
    return LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos))


def lltokenizer(vocab: TokenizerVocab) -> LLTokenizer:
    """The LLTokenizer for a vocab (built once per tokenizer, ~1 s for DeepSeek-V4)."""
    return _lltokenizer(vocab.fingerprint, vocab.tokenizer_json, vocab.vocab_size, vocab.eos_token_ids)


class LLGuidanceCompiled:
    """A compiled llguidance constraint: a template matcher that `matcher()` copies."""

    backend = "llguidance"

    def __init__(self, vocab: TokenizerVocab, grammar: str, template: LLMatcher):
        self.vocab = vocab
        self.grammar = grammar
        self._template = template
        # Rough memory estimate for the byte-bounded cache: the serialized grammar and lexer tables.
        self.nbytes = 4 * len(grammar) + 64 * 1024

    def matcher(self) -> "LLGuidanceMatcher":
        return LLGuidanceMatcher(self._template.deep_copy(), self.vocab)


def compile_spec(spec, vocab: TokenizerVocab, limits: LLParserLimits | None = None) -> LLGuidanceCompiled:
    """Compile a Regex/JsonSchema/Grammar; ConstraintError with llguidance's message (it names the
    schema pointer / grammar line) when the constraint is invalid or not supported exactly."""
    try:
        grammar = grammar_text(spec)
    except ValueError as e:
        raise ConstraintError(f"llguidance: {e}") from None
    m = LLMatcher(lltokenizer(vocab), grammar, log_level=0, limits=limits or default_limits())
    if m.is_error():
        raise ConstraintError(f"llguidance: {_clean_error(m.get_error())}")
    return LLGuidanceCompiled(vocab, grammar, m)


def _rule_location(text: str, msg: str) -> str:
    """' (line N: ...)' for the first line that uses the rule named in "Rule 'x' not found"."""
    import re

    m = re.search(r"Rule '([^']+)' not found", msg)
    if not m:
        return ""
    name = re.escape(m.group(1))
    for i, line in enumerate(text.splitlines(), 1):
        rhs = line.split("::=", 1)[-1]
        if re.search(rf"(?<![\w-]){name}(?![\w-])", rhs):
            return f" (used at line {i}: {line.strip()!r})"
    return ""


def _clean_error(msg: str) -> str:
    # Drop the parser-state dump llguidance appends after the first line(s).
    return msg.split("\n<state>")[0].strip()


class LLGuidanceMatcher:
    """Matcher protocol over an `LLMatcher` (see matcher.Matcher)."""

    __slots__ = ("m", "vocab", "vocab_size", "_words", "_nbytes", "_eos", "_done", "_ptr", "_rows")

    def __init__(self, m: LLMatcher, vocab: TokenizerVocab, done: bool = False):
        self.m = m
        self.vocab = vocab
        self.vocab_size = vocab.vocab_size
        self._words = vocab.bitmask_words
        self._eos = vocab.eos_token_ids
        self._done = done  # EOS accepted
        self._nbytes = self._words * 4
        self._ptr = self._rows = None  # the last bitmask validated (checked once per tensor: ~2 µs)

    def fill_mask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        ptr, rows = bitmask.data_ptr(), bitmask.shape[0]
        if ptr != self._ptr or rows != self._rows:
            check_bitmask(bitmask, 1, self._words)
            self._ptr, self._rows = ptr, rows
        if not 0 <= row < rows:
            raise ValueError(f"bitmask row {row} out of range for {rows} rows")
        if self._done:
            set_only(bitmask, row, self._eos)
            return
        self.m.unsafe_compute_mask_ptr(ptr + row * self._nbytes, self._nbytes)

    def accept(self, token_id: int) -> bool:
        if self._done:
            return False
        if not 0 <= token_id < self.vocab_size:
            return False
        if token_id in self._eos:
            if self.m.is_accepting():
                self._done = True
                return True
            return False
        return self.m.try_consume_tokens((token_id,)) == 1

    def rollback(self, n: int) -> None:
        if n <= 0:
            return
        if self._done:
            self._done = False
            n -= 1
        if n and not self.m.rollback(n):
            raise ValueError(f"llguidance cannot roll back {n} tokens: {self.m.get_error()}")

    def is_terminated(self) -> bool:
        return self._done

    def is_accepting(self) -> bool:
        return self._done or self.m.is_accepting()

    def is_constrained(self) -> bool:
        return True

    def forced_tokens(self) -> list:
        if self._done:
            return []
        return list(self.m.compute_ff_tokens())

    def check_draft(self, token_ids) -> int:
        if self._done or not token_ids:
            return 0
        token_ids = list(token_ids)
        n = self.m.validate_tokens(token_ids)
        if n < len(token_ids) and token_ids[n] in self._eos:
            probe = self.m.deep_copy()
            if n == 0 or probe.try_consume_tokens(token_ids[:n]) == n:
                if probe.is_accepting():
                    n += 1
        return n

    def fork(self) -> "LLGuidanceMatcher":
        return LLGuidanceMatcher(self.m.deep_copy(), self.vocab, self._done)

    @staticmethod
    def fill_batch(batch, out: torch.Tensor) -> list:
        """fill_masks for a group of llguidance matchers: [(matcher, draft, first_row)] -> counts."""
        return _executor().fill_batch(batch, out)


class _LLGuidanceBatch:
    """Fills many llguidance matchers' masks (with draft rows) on llguidance's rayon thread pool."""

    def __init__(self, num_threads=None):
        self.executor = LLExecutor(num_threads=num_threads)

    def fill_batch(self, batch, out: torch.Tensor) -> list:
        words = out.shape[1]
        plain, drafted, counts, slow = [], [], [], []
        for m, draft, start in batch:
            if not draft and not m._done:
                counts.append(0)
                plain.append((m.m, start))
                continue
            n = m.check_draft(draft) if draft else 0
            counts.append(n)
            if m._done or (n and draft[n - 1] in m._eos):
                slow.append((m, draft, start, n))  # EOS inside the draft: our flag, not llguidance's state
            elif n:
                # A private copy walks the draft: llguidance's executor consumes the draft and rolls it back,
                # and its rollback can fail (llguidance 1.9.1: "<" then the DSML special token, consumed one
                # by one, cannot be rolled back: "rollback: too many bytes 11 > 10"), leaving the matcher in
                # an error state. A copy costs ~0.5 µs against ~25 µs per mask row.
                drafted.append((m.m.deep_copy(), start, draft[:n], m, n))
            else:
                plain.append((m.m, start))
        if plain:
            self.executor.unsafe_compute_mask_ptr(plain, out.data_ptr(), words * 4, out.shape[0])
        if drafted:
            self.executor.unsafe_compute_mask_ptr_with_draft_token(
                [d[:3] for d in drafted], out.data_ptr(), words * 4, out.shape[0])
            for copy, start, draft, m, n in drafted:
                if copy.is_error():  # the executor's walk failed part-way: redo these rows token by token
                    slow.append((m, draft, start, n))
        for m, draft, start, n in slow:
            m.fill_mask(out, start)
            w = m.fork()
            for j in range(n):
                w.accept(draft[j])
                w.fill_mask(out, start + j + 1)
        return counts


_EXECUTOR = None
_EXECUTOR_LOCK = threading.Lock()


def _executor() -> _LLGuidanceBatch:
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = _LLGuidanceBatch()
        return _EXECUTOR
