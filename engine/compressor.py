"""KV compressor: gated pooling of groups of `ratio` consecutive tokens into one compressed KV entry.

Groups are aligned to absolute position 0: entry g pools tokens [g*r, (g+1)*r) and is emitted only once the
group is complete; it is rotated at position g*r and visible to a query at position p iff g < (p+1) // r.

Styles (one module, switches):
  * non-overlapping (V4 HCA, V4.1 ratio 2): per-channel softmax over the r tokens of `wgate(x) + ape[j]`
    weights `wkv(x)`; V4.1 ratio 1 has no gate (one token per entry: the entry is that token's projection).
  * overlapping (V4 CSA, ratio 4): the projections have 2*D channels: Ca = [:D] feeds the NEXT group, Cb = [D:]
    the current one, so entry g softmax-pools 2r slots: Ca of group g-1 and Cb of group g (Ca slots of
    group -1 weigh 0).
Then RMSNorm (`norm`), giving the pre-RoPE latent (kept for V4.1 index keys), then RoPE on the last rope dims.
Parameter names: `wkv.weight`, `wgate.weight`, `ape`, `norm.weight` (DeepSeek's).
Cost per token: two H x (D or 2D) projections; per entry O(r * D).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np
import torch
from torch import nn

from .cache import CompressorState
from .norm import RMSNorm
from .transfer import to_device, to_device_many

if TYPE_CHECKING:
    from .arena import RowArena


class Compressor(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, ratio: int, *, overlap: bool, gated: bool, ape: bool,
                 eps: float):
        super().__init__()
        width = out_dim * (2 if overlap else 1)
        self.ratio, self.overlap, self.gated, self.out_dim = ratio, overlap, gated, out_dim
        self.wkv = nn.Linear(in_dim, width, bias=False)
        self.wgate = nn.Linear(in_dim, width, bias=False) if gated else None
        self.ape = nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32)) if ape else None
        self.norm = RMSNorm(out_dim, eps)

    def new_state(self) -> CompressorState:
        return CompressorState(ratio=self.ratio)

    def keep_from(self, end, max_rollback: int):
        """First position whose token projections a state must keep once it holds tokens up to `end`: every group a
        rollback of up to max_rollback tokens can reopen (and, overlapping, the group before it). A ratio-1
        entry is its own token's projection: nothing to keep."""
        if self.ratio == 1 and not self.overlap:
            return end
        k = ((end - max_rollback) // self.ratio - (1 if self.overlap else 0)) * self.ratio
        return np.maximum(k, 0) if isinstance(k, np.ndarray) else max(0, k)    # (ints, or a numpy array of ends)

    def step(self, state: CompressorState, x: torch.Tensor, start: int,
             rotate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], keep_latents: bool,
             max_rollback: int) -> int:
        """Feed tokens x [n, H] at positions start.. into `state`; append every completed group's entry.

        `rotate(latents [G, D], positions [G])` applies RoPE. Returns the number of new entries."""
        r, D = self.ratio, self.out_dim
        kv = self.wkv(x).float()
        gate = self.wgate(x).float() if self.gated else None
        if state.tok_kv is None or state.tok_kv.shape[0] == 0:
            state.tok_start = start
            state.tok_kv, state.tok_gate = kv, gate
        else:
            assert state.tok_start + state.tok_kv.shape[0] == start, "compressor state out of sync with the cache"
            state.tok_kv = torch.cat([state.tok_kv, kv])
            state.tok_gate = torch.cat([state.tok_gate, gate]) if gate is not None else None
        end = start + x.shape[0]
        g0, g1 = state.n_entries, end // r
        new = g1 - g0
        if new > 0:
            groups = torch.arange(g0, g1, device=x.device)
            rows = (groups[:, None] * r + torch.arange(r, device=x.device)) - state.tok_start   # [G, r]
            ckv = state.tok_kv[rows]                                                              # [G, r, W]
            cg = state.tok_gate[rows] + (self.ape.float() if self.ape is not None else 0.0) if self.gated else None
            if self.overlap:
                prev = rows - r
                has_prev = (groups > 0)[:, None, None]
                prev_c = prev.clamp(min=0)
                pkv = torch.where(has_prev, state.tok_kv[prev_c][..., :D], 0.0)
                pg = state.tok_gate[prev_c][..., :D] + self.ape.float()[:, :D]
                pg = torch.where(has_prev, pg, float("-inf"))
                ckv = torch.cat([pkv, ckv[..., D:]], dim=1)        # [G, 2r, D]
                cg = torch.cat([pg, cg[..., D:]], dim=1)
            if self.gated:
                pooled = (ckv * cg.softmax(dim=1)).sum(dim=1)
            else:
                pooled = ckv.sum(dim=1)  # ratio 1: the token's own projection
            latent = self.norm(pooled.to(x.dtype))
            entries = rotate(latent, groups * r)
            state.entries = entries if state.entries is None else torch.cat([state.entries, entries])
            if keep_latents:
                state.latents = latent if state.latents is None else torch.cat([state.latents, latent])
        # keep only the token projections a later group (or a rollback) can still need
        keep_from = self.keep_from(end, max_rollback)
        if keep_from >= end:
            state.tok_kv = state.tok_gate = None
            state.tok_start = end
        elif keep_from > state.tok_start:
            cut = keep_from - state.tok_start
            # copies: a slice would keep every projection of a long prefill alive (cache_pool counts rows)
            state.tok_kv = state.tok_kv[cut:].clone()
            state.tok_gate = state.tok_gate[cut:].clone() if state.tok_gate is not None else None
            state.tok_start = keep_from
        return max(new, 0)

    def step_many(self, states: list[CompressorState], x: torch.Tensor, spans: list[tuple[int, int, int]],
                  rotate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], keep_latents: bool,
                  max_rollback: int, arena: Callable[[str, torch.Tensor], "RowArena"]
                  ) -> tuple[list[int], tuple[torch.Tensor, list[int]] | None]:
        """Batched `step` for many sequences at once (the decode / verify fast path): same results.

        x [T, H] holds every sequence's new rows; spans[s] = (start position, row offset in x, rows) of
        sequence s, with rows <= max_rollback. The projections run once over all rows, every completed group of
        every sequence is pooled, normalized and rotated in one go; the token projections kept are rebuilt as one
        gather for all sequences (each state then points at its rows of that buffer: CompressorState.set_rows, no
        per-sequence tensor operations), the new entries / latents are written in place into the arenas
        `arena(name, like)` gives (engine/arena.py).
        Returns (new entries per sequence, (the entries arena: this layer's attention pool, each state's first row
        in it), or None when no group completed)."""
        r, D = self.ratio, self.out_dim
        ov = 1 if self.overlap else 0
        kv_all = self.wkv(x).float()
        gate_all = self.wgate(x).float() if self.gated else None
        dev = x.device
        # 1. token rows still needed (for this step's groups or later ones / rollbacks), one gather from
        #    [this step's rows, the states' current buffers]
        src = Sources(kv_all.shape[0])
        idx, cur, prev, gpos, news, views = [], [], [], [], [], []
        for st, (start, off, n) in zip(states, spans):   # (attributes read directly: B states per layer)
            tk, en = st._tok_kv, st._entries
            old = 0 if tk is None else tk[2]
            tok_start = st.tok_start if old else start
            assert not old or tok_start + old == start, "compressor state out of sync with the cache"
            end = start + n
            g0, g1 = (0 if en is None else en[2]), end // r
            keep_from = max(tok_start, self.keep_from(end, max_rollback))
            lo = min(keep_from, (g0 - ov) * r) if g1 > g0 else keep_from
            lo = max(lo, tok_start)
            b0 = len(idx)
            if old and lo < start:
                base = src.base(tk[0], st._tok_gate[0] if self.gated else None)
                idx.extend(range(base + tk[1] + lo - tok_start, base + tk[1] + old))
            idx.extend(range(off, off + n))
            news.append(max(g1 - g0, 0))
            for g in range(g0, g1):
                rows = list(range(b0 + g * r - lo, b0 + g * r - lo + r))
                cur.append(rows)
                if ov:
                    prev.append([q - r for q in rows] if g > 0 else rows)
                gpos.append(g * r)
            views.append((b0 + keep_from - lo, end - keep_from, keep_from))
        if cur:   # every index list of the step in one copy
            idx_t, cur_t, gpos_t, *prev_t = to_device_many([idx, cur, gpos] + ([prev] if self.overlap else []), dev)
        else:
            idx_t = to_device(idx, dev)
        kv_buf = src.cat(kv_all, 0)[idx_t]
        g_buf = src.cat(gate_all, 1)[idx_t] if self.gated else None
        for st, (o, m, tok_start) in zip(states, views):
            st.tok_start = tok_start
            st._tok_kv = (kv_buf, o, m) if m else None
            if self.gated:
                st._tok_gate = (g_buf, o, m) if m else None
        if not cur:
            return news, None
        # 2. every completed group at once
        ckv = kv_buf[cur_t]                                                    # [G, r, W]
        cg = g_buf[cur_t] + (self.ape.float() if self.ape is not None else 0.0) if self.gated else None
        if self.overlap:
            hp = (gpos_t > 0)[:, None, None]                                   # group g > 0 has a previous one
            pkv = torch.where(hp, kv_buf[prev_t[0]][..., :D], 0.0)
            pg = torch.where(hp, g_buf[prev_t[0]][..., :D] + self.ape.float()[:, :D], float("-inf"))
            ckv = torch.cat([pkv, ckv[..., D:]], dim=1)                        # [G, 2r, D]
            cg = torch.cat([pg, cg[..., D:]], dim=1)
        pooled = (ckv * cg.softmax(dim=1)).sum(dim=1) if self.gated else ckv.sum(dim=1)
        latent = self.norm(pooled.to(x.dtype))
        entries = rotate(latent, gpos_t)
        # 3. appends, in place
        if keep_latents:
            arena("latents", latent).append(states, latent, news)
        return news, arena("entries", entries).append(states, entries, news)


class Sources:
    """The buffers a gather reads, after this step's new rows: each distinct (kv, gate) buffer pair once."""

    def __init__(self, first_rows: int):
        self.at, self.bases, self.bufs = first_rows, {}, []

    def base(self, buf: torch.Tensor, gate: torch.Tensor | None) -> int:
        """Row of buf[0] in the concatenation."""
        b = self.bases.get(id(buf))
        if b is None:
            b = self.bases[id(buf)] = self.at
            self.bufs.append((buf, gate))
            self.at += buf.shape[0]
        return b

    def cat(self, new: torch.Tensor | None, which: int) -> torch.Tensor:
        """[new (if given), each buffer] (kv buffers: which=0, gate buffers: which=1), one tensor."""
        parts = ([] if new is None else [new]) + [pair[which] for pair in self.bufs]
        parts = [t.to(parts[0].device) for t in parts]    # (token ids: host and device buffers can meet)
        return parts[0] if len(parts) == 1 else torch.cat(parts)
