"""Stand-ins used by the engine tests (no tests in this module).

`PrefixHashModel` implements the model interface (new_cache / forward_step / StepChunk) with logits
that are an exact function of the whole prefix: row = table[hash(prefix) % rows]. Prefill, decode,
chunking and batching therefore give bit-identical logits, which lets the tests check the engine's
bookkeeping (caches, chunking, preemption, row order) independently of model numerics. The real tiny
V4.1 model is used in test_engine_model.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

MOD = (1 << 61) - 1


@dataclass
class StepChunk:
    cache: "PrefixHashCache"
    token_ids: torch.Tensor
    logit_rows: int


class PrefixHashCache:
    def __init__(self, bytes_per_token: int):
        self.hashes: list[int] = []
        self.bytes_per_token = bytes_per_token
        self.extra: dict = {}          # per-sequence side state, as SequenceCache.extra (no speculation here)

    @property
    def length(self) -> int:
        return len(self.hashes)

    def rollback(self, n: int) -> None:
        del self.hashes[len(self.hashes) - n:]

    def nbytes(self) -> int:
        return 1024 + self.bytes_per_token * len(self.hashes)


class PrefixHashModel(torch.nn.Module):
    def __init__(self, vocab_size: int = 129280, rows: int = 101, seed: int = 0, bytes_per_token: int = 256,
                 max_seq_len: int = 4096):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.table = torch.nn.Parameter(torch.randn(rows, vocab_size, generator=g) * 4, requires_grad=False)
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.bytes_per_token = bytes_per_token
        self.num_forward_tokens = 0

    def new_cache(self) -> PrefixHashCache:
        return PrefixHashCache(self.bytes_per_token)

    def forward_step(self, chunks):
        rows = []
        for ch in chunks:
            ids = ch.token_ids.tolist()
            assert ids, "empty chunk"
            h = ch.cache.hashes[-1] if ch.cache.hashes else 7
            for t in ids:
                h = (h * 1000003 + t + 1) % MOD
                ch.cache.hashes.append(h)
            self.num_forward_tokens += len(ids)
            for hh in ch.cache.hashes[len(ch.cache.hashes) - ch.logit_rows:] if ch.logit_rows else []:
                rows.append(self.table[hh % self.table.shape[0]])
        logits = torch.stack(rows) if rows else torch.empty(0, self.vocab_size)
        return SimpleNamespace(logits=logits.float().clone())
