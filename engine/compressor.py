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
                  max_rollback: int) -> list[int]:
        """Batched `step` for many sequences at once (the decode / verify fast path): same results.

        x [T, H] holds every sequence's new rows; spans[s] = (start position, row offset in x, rows) of
        sequence s. The projections run once over all rows and every completed group of every sequence is
        pooled, normalized and rotated in one go; only the per-sequence appends stay in a Python loop.
        Returns the number of new entries per sequence."""
        r, D = self.ratio, self.out_dim
        kv_all = self.wkv(x).float()
        gate_all = self.wgate(x).float() if self.gated else None
        src_kv, src_g, cur, prev, has_prev, gpos, news, base = [], [], [], [], [], [], [], 0
        for st, (start, off, n) in zip(states, spans):
            kv = kv_all[off:off + n]
            gate = gate_all[off:off + n] if gate_all is not None else None
            if st.tok_kv is None or st.tok_kv.shape[0] == 0:
                st.tok_start, st.tok_kv, st.tok_gate = start, kv, gate
            else:
                assert st.tok_start + st.tok_kv.shape[0] == start, "compressor state out of sync with the cache"
                st.tok_kv = torch.cat([st.tok_kv, kv])
                st.tok_gate = torch.cat([st.tok_gate, gate]) if gate is not None else None
            g0, g1 = st.n_entries, (start + n) // r
            news.append(max(g1 - g0, 0))
            if g1 > g0:   # row numbers into the concatenation of the states that complete a group
                src_kv.append(st.tok_kv)
                src_g.append(st.tok_gate)
                for g in range(g0, g1):
                    rows = [base + g * r + j - st.tok_start for j in range(r)]
                    cur.append(rows)
                    prev.append([q - r for q in rows] if g > 0 else rows)
                    has_prev.append(g > 0)
                    gpos.append(g * r)
                base += st.tok_kv.shape[0]
        if cur:
            dev = x.device
            kv_src = torch.cat(src_kv)
            g_src = torch.cat(src_g) if self.gated else None
            cur_t = torch.tensor(cur, dtype=torch.long).to(dev)
            ckv = kv_src[cur_t]                                                    # [G, r, W]
            cg = g_src[cur_t] + (self.ape.float() if self.ape is not None else 0.0) if self.gated else None
            if self.overlap:
                prev_t = torch.tensor(prev, dtype=torch.long).to(dev)
                hp = torch.tensor(has_prev).to(dev)[:, None, None]
                pkv = torch.where(hp, kv_src[prev_t][..., :D], 0.0)
                pg = torch.where(hp, g_src[prev_t][..., :D] + self.ape.float()[:, :D], float("-inf"))
                ckv = torch.cat([pkv, ckv[..., D:]], dim=1)                        # [G, 2r, D]
                cg = torch.cat([pg, cg[..., D:]], dim=1)
            pooled = (ckv * cg.softmax(dim=1)).sum(dim=1) if self.gated else ckv.sum(dim=1)
            latent = self.norm(pooled.to(x.dtype))
            entries = rotate(latent, torch.tensor(gpos, dtype=torch.long).to(dev))
            at = 0
            for st, k in zip(states, news):
                if k == 0:
                    continue
                e, lat = entries[at:at + k], latent[at:at + k]
                at += k
                st.entries = e if st.entries is None else torch.cat([st.entries, e])
                if keep_latents:
                    st.latents = lat if st.latents is None else torch.cat([st.latents, lat])
        for st, (start, off, n) in zip(states, spans):
            keep_from = max(0, ((start + n - max_rollback) // r - (1 if self.overlap else 0)) * r)
            if keep_from > st.tok_start:
                cut = keep_from - st.tok_start
                st.tok_kv = st.tok_kv[cut:]
                st.tok_gate = st.tok_gate[cut:] if st.tok_gate is not None else None
                st.tok_start = keep_from
        return news
