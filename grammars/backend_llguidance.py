"""llguidance backend (the default): derivative-based lexer + Earley parser, compiles in ~ms, refuses
JSON Schema keywords it does not implement instead of ignoring them.

Compile = building one `LLMatcher` (lexer and grammar checks, bounded by `LLParserLimits`); every
`matcher()` is a cheap `deep_copy` of it (the matcher itself: llguidance_matcher.py).
"""
from __future__ import annotations

import json
import threading
from functools import lru_cache

from llguidance import LLMatcher, LLParserLimits, LLTokenizer

from .llguidance_matcher import LLGuidanceMatcher, NamedTokensLLGuidanceMatcher, clean_error, register_vocab
from .specs import ConstraintError, Grammar, JsonSchema, Regex
from .vocab import TokenizerVocab

# Whitespace between JSON tokens. "bounded": a few spaces/tabs, then at most one newline and an indent;
# enough for compact and pretty-printed JSON, but a model cannot emit runaway newlines or spaces.
BOUNDED_WS = r"[ \t]{0,4}(\r?\n[ \t]{0,128})?"
INDENTED_WS = r"(\n[ ]{0,128})?"


def json_options(spec: JsonSchema) -> dict:
    """llguidance JSON compile options (applied as overrides of any x-guidance in the schema)."""
    return dict(_shared_json_options(spec))


def _shared_json_options(spec: JsonSchema) -> dict:
    """json_options, built once per (whitespace, oneOf-as-anyOf) and shared (read-only: llguidance copies it)."""
    key = (spec.whitespace, "oneOf-as-anyOf" in spec.approximations)
    opts = _JSON_OPTIONS.get(key)
    if opts is None:
        whitespace, coerce_one_of = key
        opts = {"coerce_one_of": coerce_one_of, "lenient": False}
        if whitespace == "compact":
            opts.update(whitespace_flexible=False, item_separator=",", key_separator=":")
        elif whitespace == "indented":
            opts.update(whitespace_flexible=True, whitespace_pattern=INDENTED_WS, item_separator=",", key_separator=": ")
        else:
            opts.update(whitespace_flexible=True, whitespace_pattern=BOUNDED_WS, item_separator=",", key_separator=":")
        _JSON_OPTIONS[key] = opts
    return opts


_JSON_OPTIONS: dict = {}
_JSON_OPTIONS_TEXT: dict = {}


# A JSON schema as llguidance's top-level grammar (its TopLevelGrammar JSON: one grammar, given as a JSON schema).
_GRAMMAR_HEAD, _GRAMMAR_TAIL = '{"grammars": [{"json_schema": ', "}}]}"


def _options_json(spec: JsonSchema) -> str:
    """json_options as JSON text (built once per option set)."""
    key = (spec.whitespace, "oneOf-as-anyOf" in spec.approximations)
    text = _JSON_OPTIONS_TEXT.get(key)
    if text is None:
        text = _JSON_OPTIONS_TEXT[key] = json.dumps(_shared_json_options(spec))
    return text


def default_limits() -> LLParserLimits:
    # Defaults from llguidance, but fewer lexer states: ~1-2 kB each, so 100k states caps one grammar's
    # lexer near 200 MB (a hostile schema fails with an error instead of eating the machine).
    return _LIMITS


_LIMITS = LLParserLimits(max_lexer_states=100_000, verbose_errors=False)  # read-only: one shared instance


def grammar_text(spec) -> str:
    """llguidance grammar (JSON-wrapped) for a spec; raises ConstraintError for EBNF it cannot convert."""
    if isinstance(spec, JsonSchema):  # (the common spec first)
        schema = spec.schema
        if isinstance(schema, dict) and "x-guidance" not in schema:
            # The common case: our options go in as the schema's own "x-guidance" entry, spliced into the JSON text
            # the spec already holds (with `overrides` llguidance would parse the schema and write it out again:
            # ~2x the Python-visible cost of this whole compile step), wrapped the way
            # LLMatcher.grammar_from_json_schema(text) wraps JSON text (it only wraps; ~1.3 µs per kB in its Rust,
            # ~0.1 µs per kB as one join here): the grammar text llguidance's LLMatcher parses.
            text = spec.layout_key()
            return "".join((_GRAMMAR_HEAD, text[:-1], ', "x-guidance": ' if schema else '"x-guidance": ',
                            _options_json(spec), _GRAMMAR_TAIL))
        if not isinstance(schema, dict):
            schema = {} if schema else {"not": {}}
        else:  # our options, not the schema's
            schema = {k: v for k, v in schema.items() if k != "x-guidance"}
        return LLMatcher.grammar_from_json_schema(schema, overrides=_shared_json_options(spec))
    if isinstance(spec, Regex):
        return LLMatcher.grammar_from_regex(spec.pattern)
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
    """The LLTokenizer for a vocab (built once per tokenizer, ~1 s for DeepSeek-V4). The last vocab's is kept
    beside the cache: an identity test instead of hashing and comparing the cache key (every compile asks)."""
    global _last_lltokenizer
    last, tok = _last_lltokenizer
    if vocab is last:
        return tok
    tok = _lltokenizer(vocab.fingerprint, vocab.tokenizer_json, vocab.vocab_size, vocab.eos_token_ids)
    _last_lltokenizer = (vocab, tok)  # one tuple, one store: safe to race
    return tok


_last_lltokenizer = (None, None)  # (vocab, its LLTokenizer) of the last lltokenizer() call


class LLGuidanceCompiled:
    """A compiled llguidance constraint: a template matcher that `matcher()` copies.

    Copies share the template's lexer, whose states are built lazily against one fuel budget
    (`LLParserLimits.initial_lexer_fuel`). When some sequence's text exhausts it, every copy is poisoned
    (llguidance 1.9.1: "lexer error: too many expressions constructed"); `renew()` then swaps in a fresh
    template so later matchers start clean, and the matchers that hit the error rebuild themselves
    (LLGuidanceMatcher._recover).
    """

    backend = "llguidance"

    def __init__(self, vocab: TokenizerVocab, grammar: str, template: LLMatcher, limits: LLParserLimits | None = None,
                 names_tokens: bool = True):
        self.vocab = vocab
        self.grammar = grammar
        self.limits = limits
        self.template = template
        self.renewals = 0  # how many times an exhausted shared lexer was replaced
        # Rough memory estimate for the byte-bounded cache: the serialized grammar and lexer tables.
        self.nbytes = 4 * len(grammar) + 64 * 1024
        # The added tokens a matcher must roll back carefully (LLGuidanceMatcher._rollback): llguidance 1.9.1 rolls
        # back wrongly only over a non-special added token that the grammar names by id (lark `<[128825]>`, DSML),
        # so only a Grammar spec has any; a JSON schema or regex matches added tokens as text at most, which rolls
        # back right (test_grammar_rollback's raw reproductions).
        self.names_tokens = names_tokens
        self.added_ids = vocab.added_ids if names_tokens else frozenset()
        self._matcher_class = NamedTokensLLGuidanceMatcher if names_tokens else LLGuidanceMatcher
        register_vocab(vocab)  # (before this constraint's first matcher: see llguidance_matcher._PLAIN_LO)

    def matcher(self) -> LLGuidanceMatcher:
        t = self.template
        return self._matcher_class(t.deep_copy(), self, t)

    def new_start(self) -> LLMatcher:
        """A start-state LLMatcher with a lexer of its own (its own fuel budget). Costs one compile."""
        return LLMatcher(lltokenizer(self.vocab), self.grammar, log_level=0, limits=self.limits or default_limits())

    def renew(self, exhausted: LLMatcher) -> None:
        """Replace the shared template if it is still `exhausted` (another thread may have renewed it)."""
        if self.template is not exhausted:
            return
        fresh = self.new_start()
        with _RENEW_LOCK:
            if self.template is exhausted:
                self.template = fresh
                self.renewals += 1


_RENEW_LOCK = threading.Lock()  # renewals are rare: one lock for all compiled constraints


def compile_spec(spec, vocab: TokenizerVocab, limits: LLParserLimits | None = None) -> LLGuidanceCompiled:
    """Compile a Regex/JsonSchema/Grammar; ConstraintError with llguidance's message (it names the
    schema pointer / grammar line) when the constraint is invalid or not supported exactly."""
    try:
        grammar = grammar_text(spec)
    except ValueError as e:
        raise ConstraintError(f"llguidance: {e}") from None
    limits = limits or _LIMITS
    m = LLMatcher(lltokenizer(vocab), grammar, log_level=0, limits=limits)
    if m.is_error():
        raise ConstraintError(f"llguidance: {clean_error(m.get_error())}")
    return LLGuidanceCompiled(vocab, grammar, m, limits, names_tokens=not isinstance(spec, (JsonSchema, Regex)))


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
