"""Decode attention for V4's sparse pattern: a query row attends to a gathered key set with a per-head sink.

Each query row n (one decode token, or one verify row of a speculative request) has its own key set, given as
indices into up to two key pools: the sequence's sliding-window keys (win_idx into win_kv) and its top-k
compressed entries (cmp_idx into cmp_kv). Index -1 = no key. K = V: every pool row is the single shared KV
vector of that position (MQA, one KV head), so a key is read once and used for both scores and values.

  s_j = scale * (q_h . k_j);   m = max(max_j s_j, sink_h)
  o_h = sum_j exp(s_j - m) k_j / (sum_j exp(s_j - m) + exp(sink_h - m))        (empty key set: o_h = 0)

Shapes: q [N, H, D], win_kv [Pw, D], win_idx [N, Kw] int, cmp_kv [Pc, D], cmp_idx [N, Kc] int (optional),
sink [H] fp32; returns [N, H, D] in q's dtype. Duplicate keys count twice (they are different vectors in V4).
Triton: grid (head blocks, rows, key splits); the online softmax gathers BLOCK_K keys per step and does two small
matmuls per step. With one split it starts from the sink (m = sink, l = 1) and writes the output; with several
(flash-decoding: D's first version, one split, measured 27-30% of copy bandwidth on an H200 because 64 rows x 4
head blocks do not fill 132 SMs) each split writes its partial (m, l, acc) and a combine launch merges them with
the sink. The rope/inverse-rope and output projection stay in the model.
Cost: keys x D x bytes per (row, head block) — with H = 64 heads in 4 blocks of 16 the key set is read 4 times,
from L2 after the first.
"""
import torch
import triton
import triton.language as tl

from .backend import empty, INTERPRETING, check, use_triton


def _check(q, win_kv, win_idx, cmp_kv, cmp_idx, sink):
    check(q.dim() == 3, f"q must be [rows, heads, head_dim], got {tuple(q.shape)}")
    N, H, D = q.shape
    check(win_kv.dim() == 2 and win_kv.shape[1] == D, f"win_kv must be [pool, {D}], got {tuple(win_kv.shape)}")
    check(win_idx.dim() == 2 and win_idx.shape[0] == N, f"win_idx must be [{N}, keys], got {tuple(win_idx.shape)}")
    if cmp_kv is not None or cmp_idx is not None:
        check(cmp_kv is not None and cmp_idx is not None, "cmp_kv and cmp_idx come together")
        check(cmp_kv.dim() == 2 and cmp_kv.shape[1] == D, f"cmp_kv must be [pool, {D}], got {tuple(cmp_kv.shape)}")
        check(cmp_idx.dim() == 2 and cmp_idx.shape[0] == N,
              f"cmp_idx must be [{N}, keys], got {tuple(cmp_idx.shape)}")
    check(sink.shape == (H,), f"sink must be [{H}] (one logit per head), got {tuple(sink.shape)}")


# ---------------------------------------------------------------------------------------------- torch twin
def sparse_attention_torch(q, win_kv, win_idx, sink, cmp_kv=None, cmp_idx=None, scale=None):
    _check(q, win_kv, win_idx, cmp_kv, cmp_idx, sink)
    N, H, D = q.shape
    scale = D ** -0.5 if scale is None else scale
    keys = [win_kv[win_idx.long().clamp_min(0)]]
    valid = [win_idx >= 0]
    if cmp_kv is not None:
        keys.append(cmp_kv[cmp_idx.long().clamp_min(0)])
        valid.append(cmp_idx >= 0)
    k = torch.cat(keys, 1).float()                                   # [N, K, D]
    ok = torch.cat(valid, 1)                                         # [N, K]
    s = torch.einsum("nhd,nkd->nhk", q.float(), k) * scale
    s = s.masked_fill(~ok[:, None, :], float("-inf"))
    s = torch.cat([s, sink.float()[None, :, None].expand(N, H, 1)], 2)
    p = torch.softmax(s, 2)[:, :, :-1]
    return torch.einsum("nhk,nkd->nhd", p, k).to(q.dtype)


# ---------------------------------------------------------------------------------------------- Triton
@triton.jit
def _attend_pool(q, m, l, acc, kv_ptr, idx_ptr, n_keys, k0, k1, row, scale, D: tl.constexpr, BLOCK_K: tl.constexpr,
                 IEEE: tl.constexpr):
    """Online softmax over the pool's keys [k0, k1) of this row."""
    dims = tl.arange(0, D)
    for start in range(k0, k1, BLOCK_K):
        kk = start + tl.arange(0, BLOCK_K)
        idx = tl.load(idx_ptr + row * n_keys + kk, mask=kk < k1, other=-1).to(tl.int64)
        ok = idx >= 0
        k = tl.load(kv_ptr + tl.maximum(idx, 0)[:, None] * D + dims[None, :], mask=ok[:, None], other=0.0)
        if IEEE:   # fp32 pools (and the interpreter): exact fp32 products
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale                                 # [BH, BLOCK_K]
        s = tl.where(ok[None, :], s, float("-inf"))
        new_m = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - new_m)
        p = tl.exp(s - new_m[:, None])
        l = l * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, k.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k)
        m = new_m
    return m, l, acc


@triton.jit
def _sparse_attention_kernel(q_ptr, out_ptr, sink_ptr, win_kv_ptr, win_idx_ptr, n_win, cmp_kv_ptr, cmp_idx_ptr,
                             n_cmp, H, scale, per_split, part_m_ptr, part_l_ptr, part_acc_ptr,
                             D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                             HAS_CMP: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr):
    """Program (head block, row, split): the split's slice [lo, hi) of the row's keys (window keys first, then
    compressed). Without SPLIT the one split starts from the sink and writes the output; with SPLIT it writes its
    partial (m, l, acc) and `_combine_kernel` merges the splits and the sink."""
    row = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    heads = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    hok = heads < H
    dims = tl.arange(0, D)
    q = tl.load(q_ptr + (row * H + heads[:, None]) * D + dims[None, :], mask=hok[:, None], other=0.0)
    q = q.to(win_kv_ptr.dtype.element_ty)
    if SPLIT:
        m = tl.full([BLOCK_H], -1e30, tl.float32)           # finite: exp(m - new_m) stays 0, never NaN
        l = tl.zeros([BLOCK_H], tl.float32)
    else:
        # the sink is a key with logit sink_h and value 0: start the online softmax from it
        m = tl.load(sink_ptr + heads, mask=hok, other=0.0).to(tl.float32)
        l = tl.full([BLOCK_H], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    lo = split * per_split
    hi = lo + per_split
    m, l, acc = _attend_pool(q, m, l, acc, win_kv_ptr, win_idx_ptr, n_win, tl.minimum(lo, n_win),
                             tl.minimum(hi, n_win), row, scale, D, BLOCK_K, IEEE)
    if HAS_CMP:
        m, l, acc = _attend_pool(q, m, l, acc, cmp_kv_ptr, cmp_idx_ptr, n_cmp, tl.maximum(lo - n_win, 0),
                                 tl.minimum(tl.maximum(hi - n_win, 0), n_cmp), row, scale, D, BLOCK_K, IEEE)
    if SPLIT:
        n_split = tl.num_programs(2)
        o = (row * H + heads) * n_split + split
        tl.store(part_m_ptr + o, m, mask=hok)
        tl.store(part_l_ptr + o, l, mask=hok)
        tl.store(part_acc_ptr + o[:, None] * D + dims[None, :], acc, mask=hok[:, None])
    else:
        tl.store(out_ptr + (row * H + heads[:, None]) * D + dims[None, :], (acc / l[:, None]).to(out_ptr.dtype.element_ty),
                 mask=hok[:, None])


@triton.jit
def _combine_kernel(out_ptr, sink_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, H, n_split,
                    D: tl.constexpr, BLOCK_S: tl.constexpr):
    """Program (row, head): o = sum_s exp(m_s - M) acc_s / (exp(sink - M) + sum_s exp(m_s - M) l_s)."""
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    sok = sp < n_split
    base = (row * H + h) * n_split
    ms = tl.load(part_m_ptr + base + sp, mask=sok, other=-1e30)
    ls = tl.load(part_l_ptr + base + sp, mask=sok, other=0.0)
    sink = tl.load(sink_ptr + h).to(tl.float32)
    big = tl.maximum(tl.max(ms, 0), sink)
    w = tl.exp(ms - big)
    denom = tl.exp(sink - big) + tl.sum(w * ls, 0)
    dims = tl.arange(0, D)
    acc = tl.load(part_acc_ptr + (base + sp)[:, None] * D + dims[None, :], mask=sok[:, None], other=0.0)
    o = tl.sum(acc * w[:, None], 0) / denom
    tl.store(out_ptr + (row * H + h) * D + dims, o.to(out_ptr.dtype.element_ty))


def default_splits(N: int, H: int, n_keys: int, block_h: int, block_k: int, device) -> int:
    """Key splits per row. Measured on the H200 (benchmarks/kernels.py, N=64 and 256, H=64, 128+512 keys): one
    split 44/160 us against 61 us with 3 splits and 200 us with 2, so the combine launch and the fp32 partials cost
    more than the extra parallelism buys at decode sizes; splits stay available for long key sets."""
    return 1


def sparse_attention_triton(q, win_kv, win_idx, sink, cmp_kv=None, cmp_idx=None, scale=None,
                            block_h: int = 16, block_k: int = 64, num_warps: int | None = None, num_stages: int = 2,
                            splits: int | None = None):
    """splits: key splits per row (None: `default_splits`); > 1 adds a combine launch and an fp32 partial
    [N, H, splits, D] that stays in L2 at decode sizes. num_warps None: 4 (D's H200 sweep: 43.8 us against 50.3 us
    with 8 at N=64, although at D = 512 the 4-warp sm_90 build spills ~600 bytes per thread and the 8-warp one
    does not, by the ptxas resource report)."""
    _check(q, win_kv, win_idx, cmp_kv, cmp_idx, sink)
    N, H, D = q.shape
    check(D >= 16 and D & (D - 1) == 0, f"head_dim must be a power of two >= 16 for the Triton path, got {D}")
    check(cmp_kv is None or cmp_kv.dtype == win_kv.dtype, "window and compressed pools must share a dtype")
    scale = D ** -0.5 if scale is None else scale
    q, win_kv, win_idx = q.contiguous(), win_kv.contiguous(), win_idx.to(torch.int32).contiguous()
    has_cmp = cmp_kv is not None
    if has_cmp:
        cmp_kv, cmp_idx = cmp_kv.contiguous(), cmp_idx.to(torch.int32).contiguous()
    n_win, n_cmp = win_idx.shape[1], cmp_idx.shape[1] if has_cmp else 0
    n_keys = n_win + n_cmp
    if splits is None:
        splits = default_splits(N, H, n_keys, block_h, block_k, q.device)
    per_split = triton.cdiv(triton.cdiv(max(n_keys, 1), splits), block_k) * block_k   # whole key blocks per split
    splits = max(1, triton.cdiv(n_keys, per_split))
    out = empty(q.shape, q.dtype, q.device)
    if splits > 1:
        part_m = torch.empty((N, H, splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((N, H, splits, D), dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = out
    grid = (triton.cdiv(H, block_h), N, splits)   # head blocks of one row launch together: its keys are read once
    _sparse_attention_kernel[grid](
        q, out, sink.float().contiguous(), win_kv, win_idx, n_win,
        cmp_kv if has_cmp else win_kv, cmp_idx if has_cmp else win_idx, n_cmp,
        H, float(scale), per_split, part_m, part_l, part_acc, D=D, BLOCK_H=block_h, BLOCK_K=block_k,
        HAS_CMP=has_cmp, IEEE=win_kv.dtype == torch.float32 or INTERPRETING, SPLIT=splits > 1,
        num_warps=num_warps or 4, num_stages=num_stages)
    if splits > 1 and N:
        _combine_kernel[(N, H)](out, sink.float().contiguous(), part_m, part_l, part_acc, H, splits, D=D,
                                BLOCK_S=max(2, triton.next_power_of_2(splits)), num_warps=4)
    return out


def sparse_attention(q: torch.Tensor, win_kv: torch.Tensor, win_idx: torch.Tensor, sink: torch.Tensor,
                     cmp_kv: torch.Tensor | None = None, cmp_idx: torch.Tensor | None = None,
                     scale: float | None = None) -> torch.Tensor:
    """Sparse MQA decode attention with per-head sink (module docstring). scale defaults to D**-0.5."""
    if use_triton(q):
        return sparse_attention_triton(q, win_kv, win_idx, sink, cmp_kv, cmp_idx, scale)
    return sparse_attention_torch(q, win_kv, win_idx, sink, cmp_kv, cmp_idx, scale)
