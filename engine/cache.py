"""Per-sequence caches for the incremental path.

One `SequenceCache` per sequence holds, per backbone layer, a `LayerCache`:
  * `win`      [m, D]  the last m window keys (= values), ending at position `length - 1`; kept to
                        `sliding_window - 1 + max_rollback` rows so a rollback still leaves a full window;
  * `comp`     CompressorState for kv-source layers (compressed entries + the open group's per-token projections);
  * `icomp`    CompressorState of V4's indexer compressor (index keys) on V4 indexer layers;
  * `ikeys`    [G, Di] index keys on V4.1 index-K source layers (one per compressed entry of the kv source).
Layers that share (V4.1 sources) keep nothing of their own for compressed KV / index keys: readers look up the
source layer's LayerCache. Also: the recent token ids (for Engram n-grams and hash routing) and a `drafter` slot
that dspark.py may fill with its own state.

`rollback(n)` forgets the last n tokens (n <= max_rollback): window rows and token projections are dropped,
compressed entries whose group is no longer complete become invisible and are removed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class CompressorState:
    ratio: int
    tok_start: int = 0                    # absolute position of tok_kv[0]
    tok_kv: torch.Tensor | None = None    # [b, Dc] fp32 per-token kv projections (recent tokens)
    tok_gate: torch.Tensor | None = None  # [b, Dc] fp32 per-token gate projections (None when ungated)
    entries: torch.Tensor | None = None   # [G, D] compressed entries (post-norm, post-RoPE)
    latents: torch.Tensor | None = None   # [G, D] pre-RoPE normalized latents (V4.1 index-K input)

    @property
    def n_entries(self) -> int:
        return 0 if self.entries is None else self.entries.shape[0]

    def truncate(self, length: int) -> None:
        keep = length // self.ratio
        if self.entries is not None:
            self.entries = self.entries[:keep]
        if self.latents is not None:
            self.latents = self.latents[:keep]
        if self.tok_kv is not None:
            n = max(0, length - self.tok_start)
            self.tok_kv = self.tok_kv[:n]
            if self.tok_gate is not None:
                self.tok_gate = self.tok_gate[:n]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.tok_kv, self.tok_gate, self.entries, self.latents)
                   if t is not None)


@dataclass
class LayerCache:
    ratio: int = 0                        # compression ratio of the layer (for truncating ikeys)
    win: torch.Tensor | None = None
    comp: CompressorState | None = None
    icomp: CompressorState | None = None
    ikeys: torch.Tensor | None = None

    def nbytes(self) -> int:
        n = 0
        for t in (self.win, self.ikeys):
            if t is not None:
                n += t.numel() * t.element_size()
        for s in (self.comp, self.icomp):
            if s is not None:
                n += s.nbytes()
        return n


@dataclass
class SequenceCache:
    layers: list[LayerCache]
    max_rollback: int = 16
    length: int = 0
    tokens: torch.Tensor | None = None   # recent token ids (last `keep_tokens`), ending at length - 1
    keep_tokens: int = 32
    drafter: object = None               # free slot for the DSpark drafter's own state
    floor: int = 0                       # earliest length a rollback may return to (data older is dropped)
    extra: dict = field(default_factory=dict)

    def recent_tokens(self) -> torch.Tensor:
        return self.tokens if self.tokens is not None else torch.zeros(0, dtype=torch.long)

    def rollback(self, n: int) -> None:
        """Forget the last n tokens. Raises ValueError if n > max_rollback or n > length."""
        if n < 0 or n > self.length:
            raise ValueError(f"rollback({n}) with cache length {self.length}")
        if n > self.max_rollback or self.length - n < self.floor:
            raise ValueError(f"rollback({n}) from length {self.length} goes past length {self.floor}: at most "
                             f"max_rollback={self.max_rollback} tokens after the last step can be rolled back")
        if n == 0:
            return
        new_len = self.length - n
        for lc in self.layers:
            if lc.win is not None:
                lc.win = lc.win[: max(0, lc.win.shape[0] - n)]
            for s in (lc.comp, lc.icomp):
                if s is not None:
                    s.truncate(new_len)
            if lc.ikeys is not None:
                lc.ikeys = lc.ikeys[: new_len // lc.ratio]
        if self.tokens is not None:
            self.tokens = self.tokens[: max(0, self.tokens.shape[0] - n)]
        if self.drafter is not None and hasattr(self.drafter, "rollback"):
            self.drafter.rollback(n)
        self.length = new_len

    def nbytes(self) -> int:
        return sum(lc.nbytes() for lc in self.layers) + (0 if self.tokens is None else self.tokens.numel() * 8)
