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

from typing import Callable

import torch
from torch import nn

from .cache import CompressorState
from .norm import RMSNorm
from .transfer import to_device


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
        keep_from = max(0, ((end - max_rollback) // r - (1 if self.overlap else 0)) * r)
        if keep_from > state.tok_start:
            cut = keep_from - state.tok_start
            state.tok_kv = state.tok_kv[cut:]
            state.tok_gate = state.tok_gate[cut:] if state.tok_gate is not None else None
            state.tok_start = keep_from
        return max(new, 0)

    def step_many(self, states: list[CompressorState], x: torch.Tensor, spans: list[tuple[int, int, int]],
                  rotate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], keep_latents: bool,
                  max_rollback: int) -> tuple[list[int], torch.Tensor | None]:
        """Batched `step` for many sequences at once (the decode / verify fast path): same results.

        x [T, H] holds every sequence's new rows; spans[s] = (start position, row offset in x, rows) of
        sequence s, with rows <= max_rollback. The projections run once over all rows, every completed group of
        every sequence is pooled, normalized and rotated in one go, and the states' rows (token projections kept,
        entries, latents) are rebuilt as one gather per tensor kind for all sequences: each state then points at
        its rows of that buffer (CompressorState.set_rows; no per-sequence tensor operations).
        Returns (new entries per sequence, the buffer holding every state's entries in order, i.e. the attention
        pool of this layer, or None when no group completed)."""
        r, D = self.ratio, self.out_dim
        ov = 1 if self.overlap else 0
        kv_all = self.wkv(x).float()
        gate_all = self.wgate(x).float() if self.gated else None
        dev = x.device
        # 1. token rows still needed (for this step's groups or later ones / rollbacks), one gather from
        #    [this step's rows, the states' current buffers]
        src = Sources(kv_all.shape[0])
        idx, cur, prev, has_prev, gpos, news, views = [], [], [], [], [], [], []
        for st, (start, off, n) in zip(states, spans):
            old = st.rows("tok_kv")
            tok_start = st.tok_start if old else start
            assert not old or tok_start + old == start, "compressor state out of sync with the cache"
            end = start + n
            g0, g1 = st.n_entries, end // r
            keep_from = max(tok_start, ((end - max_rollback) // r - ov) * r)
            lo = min(keep_from, (g0 - ov) * r) if g1 > g0 else keep_from
            lo = max(lo, tok_start)
            b0 = len(idx)
            if old and lo < start:
                buf, o, _ = st._tok_kv
                base = src.base(buf, st._tok_gate[0] if self.gated else None)
                idx.extend(range(base + o + lo - tok_start, base + o + old))
            idx.extend(range(off, off + n))
            news.append(max(g1 - g0, 0))
            for g in range(g0, g1):
                rows = [b0 + g * r + j - lo for j in range(r)]
                cur.append(rows)
                prev.append([q - r for q in rows] if g > 0 else rows)
                has_prev.append(g > 0)
                gpos.append(g * r)
            views.append((b0 + keep_from - lo, end - keep_from, keep_from))
        idx_t = to_device(idx, dev)
        kv_buf = src.cat(kv_all, 0)[idx_t]
        g_buf = src.cat(gate_all, 1)[idx_t] if self.gated else None
        for st, (o, m, tok_start) in zip(states, views):
            st.tok_start = tok_start
            st.set_rows("tok_kv", kv_buf, o, m)
            if self.gated:
                st.set_rows("tok_gate", g_buf, o, m)
        if not cur:
            return news, None
        # 2. every completed group at once
        cur_t = to_device(cur, dev)
        ckv = kv_buf[cur_t]                                                    # [G, r, W]
        cg = g_buf[cur_t] + (self.ape.float() if self.ape is not None else 0.0) if self.gated else None
        if self.overlap:
            prev_t = to_device(prev, dev)
            hp = to_device(has_prev, dev, torch.bool)[:, None, None]
            pkv = torch.where(hp, kv_buf[prev_t][..., :D], 0.0)
            pg = torch.where(hp, g_buf[prev_t][..., :D] + self.ape.float()[:, :D], float("-inf"))
            ckv = torch.cat([pkv, ckv[..., D:]], dim=1)                        # [G, 2r, D]
            cg = torch.cat([pg, cg[..., D:]], dim=1)
        pooled = (ckv * cg.softmax(dim=1)).sum(dim=1) if self.gated else ckv.sum(dim=1)
        latent = self.norm(pooled.to(x.dtype))
        entries = rotate(latent, to_device(gpos, dev))
        # 3. appends: one gather per kind for all sequences
        buf = append_rows(states, "entries", entries, news)
        if keep_latents:
            append_rows(states, "latents", latent, news)
        return news, buf


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
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def append_rows(states: list, name: str, new: torch.Tensor, news: list[int]) -> torch.Tensor:
    """state.<name> += its news[s] rows of `new` (in state order), for every state with ONE gather; each state
    then points at its rows of the result (set_rows). Returns the result: every state's rows in order."""
    src = Sources(new.shape[0])
    idx, views, at = [], [], 0
    for st, k in zip(states, news):
        b0 = len(idx)
        old = st.rows(name)
        if old:
            buf, o, _ = getattr(st, "_" + name)
            base = src.base(buf, None)
            idx.extend(range(base + o, base + o + old))
        if k:
            idx.extend(range(at, at + k))
            at += k
        views.append((b0, old + k))
    out = src.cat(new, 0)[to_device(idx, new.device)]
    for st, (b0, m) in zip(states, views):
        if m:
            st.set_rows(name, out, b0, m)
    return out
