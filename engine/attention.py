"""Attention of one DeepSeek-V4 / V4.1 layer.

Per token: low-rank query (`wq_a` -> `q_norm` -> `wq_b`, V4 also normalizes every head), one shared 512-dim
KV vector (`wkv` -> `kv_norm`, K = V), RoPE on the last rope dims, keys = own sliding window (W keys incl.
self) plus, on compressed layers, the kv source's compressed entries (all visible ones, or the index source's
top-k). Softmax with a per-head sink logit (extra logit, no value), inverse RoPE on the output, then the grouped
low-rank output projection (`wo_a` block-diagonal per head group, `wo_b` dense).

The parameter names are DeepSeek's: `attn.{wq_a,q_norm,wq_b,wkv,kv_norm,wo_a,wo_b}.weight`, `attn.attn_sink`,
`attn.compressor.*`, `attn.indexer.*`.

Building blocks are public for the DSpark drafter: `project_q`, `project_kv`, `attend`, `output`.
Cost per token: the projections (H*Lq + Lq*nh*D + H*D + nh*D*Lo + G*Lo*H multiply-adds) plus nh*D*(W + k)
for attention over W window keys and k selected compressed entries.
"""
from __future__ import annotations

import torch
from torch import nn

from deepinfer_sg.kernels.rmsnorm import rms_norm, rms_norm_pair

from .compressor import Compressor
from .config import LayerSpec, ModelConfig
from .indexer import Indexer
from .norm import RMSNorm, rms_normalize
from .rope import apply_rope, turn_table


def rope_inside(model) -> bool:
    """Whether the batched step's attention kernel applies the RoPE of q and the inverse RoPE of its output
    (kernels.sparse_attention's `turn`: q's rope channels turned as they load, the output's turned back before it
    is stored, instead of a rope launch on each side: two launches a layer fewer; the output's turned channels
    rounded once instead of twice). With model.fused_rope, unless quant_sim (that path keeps the separate
    rotations, rounded as the reference rounds them before its FP8 QDQ of the wo_a input). Measured:
    kernels/decode_attention.py's docstring."""
    return model.fused_rope and not model.quant_sim


def attend_with_sink(q: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor, sinks: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q [n, nh, D], keys [S, D] (also the values), bias [n, S] additive (0 or -inf), sinks [nh] -> [n, nh, D].

    softmax over [q.k * scale + bias, sink]; the sink's probability mass is dropped (it has no value)."""
    s = torch.einsum("nhd,sd->nhs", q, keys).float() * scale + bias.unsqueeze(1).float()
    sink = sinks.float().view(1, -1, 1).expand(s.shape[0], -1, 1)
    logits = torch.cat([s, sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    p = torch.softmax(logits, dim=-1)[..., :-1]
    return torch.einsum("nhs,sd->nhd", p.to(keys.dtype), keys).to(q.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, spec: LayerSpec, layer_id: int | None):
        super().__init__()
        c = config
        self.config, self.spec, self.layer_id = c, spec, layer_id
        self.nh, self.D = c.num_heads, c.head_dim
        eps = c.rms_norm_eps
        self.wq_a = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(c.q_lora_rank, eps)
        self.wq_b = nn.Linear(c.q_lora_rank, c.num_heads * c.head_dim, bias=False)
        self.wkv = nn.Linear(c.hidden_size, c.head_dim, bias=False)
        self.kv_norm = RMSNorm(c.head_dim, eps)
        self.wo_a = nn.Linear(c.num_heads * c.head_dim // c.o_groups, c.o_groups * c.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(c.o_groups * c.o_lora_rank, c.hidden_size, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(c.num_heads, dtype=torch.float32))
        self.scale = c.head_dim ** -0.5
        self.act_qdq = None   # set by Model.quant_sim: FP8 QDQ of the wo_a input (the attention context)
        r = spec.ratio
        v4 = c.compressor_style == "v4"
        if layer_id is not None and spec.kv_source == layer_id:
            overlap = v4 and spec.index_source == layer_id
            self.compressor = Compressor(c.hidden_size, c.head_dim, r, overlap=overlap, gated=v4 or r > 1,
                                         ape=v4, eps=eps)
        if layer_id is not None and (spec.index_source == layer_id or spec.index_k_source == layer_id):
            self.indexer = Indexer(hidden=c.hidden_size, q_lora_rank=c.q_lora_rank, head_dim=c.head_dim,
                                   n_heads=c.index_n_heads, idx_dim=c.index_head_dim, ratio=r, eps=eps,
                                   own_compressor=v4 and spec.index_source == layer_id,
                                   owns_keys=(not v4) and spec.index_k_source == layer_id)
            if not v4 and spec.index_source != layer_id:
                # an index-K-only layer owns wk/k_norm but no query side
                del self.indexer.wq_b, self.indexer.weights_proj

    # ---- building blocks ----
    def project_q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, xa: torch.Tensor | None = None,
                  rope: bool = True):
        """x [T, H] (attn-norm output) -> (q [T, nh, D] rotated, qr [T, Lq] for the indexer). xa: wq_a(x) when
        already computed (engine/projections.py). rope=False: q before its RoPE (`rope_inside`)."""
        return self._q_heads(self.q_norm(self.wq_a(x) if xa is None else xa), cos, sin, rope)

    def project_q_store_kv(self, x: torch.Tensor, cos, sin, pool: torch.Tensor, rows: torch.Tensor, xa: torch.Tensor,
                           xkv: torch.Tensor, rope: bool = True):
        """`project_q` and `store_kv` from the stacked products xa = wq_a(x) and xkv = wkv(x): q_norm and the window
        kv's norm + rotation + slab write as one kernels.rmsnorm launch on CUDA (`rms_norm_pair`: the two launches'
        bits at the mid-size widths; its docstring says when) -> (q, qr) as project_q."""
        qn, kn = self.q_norm, self.kv_norm
        qr, _ = rms_norm_pair(xa, qn.weight_fp32(), qn.eps, xkv, kn.weight_fp32(), kn.eps,
                              turn_table(cos, sin).to(x.device), out=pool, rows=rows)
        return self._q_heads(qr, cos, sin, rope)

    def _q_heads(self, qr: torch.Tensor, cos, sin, rope: bool):
        """q_norm's output qr [T, Lq] -> (q [T, nh, D], rotated unless rope=False, qr)."""
        q = self.wq_b(qr).view(qr.shape[0], self.nh, self.D)
        if self.config.q_norm:
            q = rms_normalize(q, self.config.rms_norm_eps)
        return apply_rope(q, cos, sin) if rope else q, qr

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   xkv: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H] -> window key/value [T, D], normalized and rotated. xkv: wkv(x) when already computed."""
        return apply_rope(self.kv_norm(self.wkv(x) if xkv is None else xkv), cos, sin)

    def store_kv(self, x: torch.Tensor, cos, sin, pool: torch.Tensor, rows: torch.Tensor,
                 xkv: torch.Tensor | None = None) -> None:
        """`project_kv` written straight to rows `rows` [T] of pool [P, D] (the window slab): norm, rotation and
        the scatter as one kernels.rmsnorm launch on CUDA (instead of three); the same three steps elsewhere."""
        w = self.kv_norm
        rms_norm(self.wkv(x) if xkv is None else xkv, w.weight_fp32(), w.eps, turn_table(cos, sin).to(x.device),
                 out=pool, rows=rows)

    def attend(self, q: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor, block: int = 256) -> torch.Tensor:
        """q [n, nh, D] against keys [S, D] with additive bias [n, S] -> [n, nh, D]; queries in blocks of `block`."""
        outs = [attend_with_sink(q[i:i + block], keys, bias[i:i + block], self.attn_sink, self.scale)
                for i in range(0, q.shape[0], block)]
        return torch.cat(outs) if outs else q.new_zeros(q.shape)

    def output(self, o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope: bool = True) -> torch.Tensor:
        """o [T, nh, D] -> [T, H]: inverse RoPE at the query positions (rope=False: o has had it, `rope_inside`),
        then the grouped low-rank projection.
        (Measured and dropped, session 7: the rotation inside a few-row Triton GEMM for `wo_a` (kernels.skinny),
        35 / 129 us at 8 / 64 rows of the mid-size model against 14 / 15 us for rope + bmm + copy; session 8 R1:
        wo_a, wo_b, wq_b and the stacked xn projections all by split-K kernels.skinny, the whole mid-size step
        5.21 / 4.61 ms at batch 8 (bf16 / fp8 experts) and 8.17 ms at 64 (fp8) against 5.15 / 4.58 / 7.93 ms with
        the GEMM library.)"""
        T = o.shape[0]
        G = self.config.o_groups
        if rope:
            o = apply_rope(o, cos, sin, inverse=True)
        g = o.reshape(T, G, -1)                                            # heads 0..nh/G-1 -> group 0, ...
        if self.act_qdq is not None:
            g = self.act_qdq(g)
        w = self.wo_a.weight.view(G, -1, g.shape[-1])                      # [G, Lo, nh/G*D]
        # the per-group products written straight into their columns of u [T, G*Lo] (the batched GEMM takes the
        # strided output; an einsum's [G, T, Lo] result needed one more launch to copy it into place)
        u = g.new_empty(T, G * w.shape[1])
        torch.bmm(g.transpose(0, 1), w.transpose(1, 2), out=u.view(T, G, -1).transpose(0, 1))
        return self.wo_b(u)
