"""Constraint compilation: specs (Regex, JsonSchema, Grammar, Triggered) -> compiled constraints ->
matchers that fill token bitmasks. Backends: llguidance (default), xgrammar, outlines-core.

    compiler = ConstraintCompiler(tokenizer)            # tokenizers.Tokenizer; vocab_size=129280 for V4
    m = compiler.compile(JsonSchema(schema)).matcher()
    mask = allocate_bitmask(1, compiler.vocab_size); m.fill_mask(mask, 0); m.accept(token_id)
"""
from .compiler import ConstraintCompiler
from .matcher import Matcher, allocate_bitmask, bitmask_to_bool, fill_masks
from .specs import ConstraintError, Grammar, JsonSchema, Regex, Triggered
from .vocab import TokenizerVocab

__all__ = ["ConstraintCompiler", "ConstraintError", "Grammar", "JsonSchema", "Matcher", "Regex",
           "TokenizerVocab", "Triggered", "allocate_bitmask", "bitmask_to_bool", "fill_masks"]
