"""Decode attention for V4's sparse pattern: a query row attends to a gathered key set with a per-head sink.

Each query row n (one decode token, or one verify row of a speculative request) has its own key set, given as
indices into up to two key pools: the sequence's sliding-window keys (win_idx into win_kv) and its top-k
compressed entries (cmp_idx into cmp_kv). Index -1 = no key. K = V: every pool row is the single shared KV
vector of that position (MQA, one KV head), so a key is read once and used for both scores and values.

  s_j = scale * (q_h . k_j);   m = max(max_j s_j, sink_h)
  o_h = sum_j exp(s_j - m) k_j / (sum_j exp(s_j - m) + exp(sink_h - m))        (empty key set: o_h = 0)

Shapes: q [N, H, D], win_kv [Pw, D], win_idx [N, Kw] int, cmp_kv [Pc, D], cmp_idx [N, Kc] int (optional),
sink [H] fp32; returns [N, H, D] in q's dtype. Duplicate keys count twice (they are different vectors in V4).
Triton: grid (head blocks, rows, key splits); a program runs an online softmax over its slice of the row's keys
for block_h heads (block_h = 64 = all heads reads each gathered key once, as a wgmma tile; `default_config` says
what the H200 preferred). Optionally (splits > 1; the H200 sweeps found one split fastest at decode sizes) the
row's keys are split over programs (flash-decoding): each split keeps its online softmax (m, l, acc), writes it as an fp32 (or bf16 normalized)
partial, and the last program of the row to finish (an atomic ticket per row and head block, reset to 0 after)
merges the partials with the sink in split order (deterministic) in the same launch; the two-launch form (a
`_combine_kernel` launch) stays available. The rope/inverse-rope and output projection stay in the model.
Cost: keys x D x bytes per (row, head block) (from L2 after the first head block) + splits x H x D x 8 bytes of
partials (written and read back from L2); 4 x H x D flops per key (tensor cores), 128 flops per key byte at
H = 64, D = 512: close to the H200's ridge (~165), so the matrix work is ~0.65x the byte time and must overlap
the loads.
`sparse_attention_tc` is a second form (all heads of a row as the M of the tensor-core dots, one loop over
window + compressed keys, key splits, optional D split of P @ V): measured no faster on the H200 (N=64: 48-49 us
vs 44; N=256: 148 us, equal), so `sparse_attention` does not dispatch to it; it stays, tested, with its ablation
switch, for the next attempt (benchmarks/kernels_attention.py has the numbers and what bounds both forms).
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
def _softmax_step(q, m, l, acc, k, ok, scale, IEEE: tl.constexpr):
    """One block of keys k [BLOCK_K, D] (ok: which are real) into the online softmax (m, l, acc)."""
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
    return new_m, l, acc


@triton.jit
def _gather(kv_ptr, idx_ptr, n_keys, row, kk, k1, D: tl.constexpr):
    """Key block kk of the row: (keys [BLOCK_K, D], ok [BLOCK_K]); positions >= k1 and index -1 are not keys."""
    idx = tl.load(idx_ptr + row * n_keys + kk, mask=kk < k1, other=-1).to(tl.int64)
    ok = idx >= 0
    k = tl.load(kv_ptr + tl.maximum(idx, 0)[:, None] * D + tl.arange(0, D)[None, :], mask=ok[:, None], other=0.0)
    return k, ok


@triton.jit
def _attend_pool(q, m, l, acc, kv_ptr, idx_ptr, n_keys, k0, k1, row, scale, D: tl.constexpr, BLOCK_K: tl.constexpr,
                 IEEE: tl.constexpr, PREFETCH: tl.constexpr):
    """Online softmax over the pool's keys [k0, k1) of this row. PREFETCH: the next block's gather is issued
    before this block's math (register double buffer), so the load latency overlaps the dots even where the
    compiler's pipeliner does not multi-buffer the indirect loads (H200 round 1: num_stages 2/3/4 timed the same
    and took the same shared memory)."""
    if PREFETCH:
        k, ok = _gather(kv_ptr, idx_ptr, n_keys, row, k0 + tl.arange(0, BLOCK_K), k1, D)
        for start in range(k0, k1, BLOCK_K):
            k_next, ok_next = _gather(kv_ptr, idx_ptr, n_keys, row, start + BLOCK_K + tl.arange(0, BLOCK_K), k1, D)
            m, l, acc = _softmax_step(q, m, l, acc, k, ok, scale, IEEE)
            k, ok = k_next, ok_next
    else:
        for start in range(k0, k1, BLOCK_K):
            k, ok = _gather(kv_ptr, idx_ptr, n_keys, row, start + tl.arange(0, BLOCK_K), k1, D)
            m, l, acc = _softmax_step(q, m, l, acc, k, ok, scale, IEEE)
    return m, l, acc


@triton.jit
def _combine_heads(out_ptr, sink_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, row, heads, hok, H, n_split,
                   D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, DC: tl.constexpr,
                   NORMED: tl.constexpr):
    """o_h = sum_s exp(m_s - M) acc_s / (exp(sink_h - M) + sum_s exp(m_s - M) l_s) for a block of heads, in split
    order (deterministic), DC output dims at a time. Partials are read with .cg (from L2, never a stale L1 line:
    another program wrote them in this launch when fused)."""
    sp = tl.arange(0, BLOCK_S)
    base = (row * H + heads) * n_split                                          # [BLOCK_H]
    ok = hok[:, None] & (sp[None, :] < n_split)
    ms = tl.load(part_m_ptr + base[:, None] + sp[None, :], mask=ok, other=-1e30, cache_modifier=".cg")
    ls = tl.load(part_l_ptr + base[:, None] + sp[None, :], mask=ok, other=0.0, cache_modifier=".cg")
    sink = tl.load(sink_ptr + heads, mask=hok, other=0.0).to(tl.float32)
    big = tl.maximum(tl.max(ms, 1), sink)
    w = tl.exp(ms - big[:, None])
    w = w / (tl.exp(sink - big) + tl.sum(w * ls, 1))[:, None]                    # [BLOCK_H, BLOCK_S]
    if NORMED:                                   # partials hold acc / l (bf16): weight them by l
        w = w * ls
    for dc in tl.static_range(0, D, DC):
        dims = dc + tl.arange(0, DC)
        o = tl.zeros([BLOCK_H, DC], tl.float32)
        for s in range(0, n_split):
            ws = tl.sum(tl.where(sp[None, :] == s, w, 0.0), 1)
            a = tl.load(part_acc_ptr + (base + s)[:, None] * D + dims[None, :], mask=hok[:, None], other=0.0,
                        cache_modifier=".cg").to(tl.float32)
            o += ws[:, None] * a
        tl.store(out_ptr + (row * H + heads[:, None]) * D + dims[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=hok[:, None])


@triton.jit
def _sparse_attention_kernel(q_ptr, out_ptr, sink_ptr, win_kv_ptr, win_idx_ptr, n_win, cmp_kv_ptr, cmp_idx_ptr,
                             n_cmp, H, scale, per_split, part_m_ptr, part_l_ptr, part_acc_ptr, cnt_ptr,
                             D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                             HAS_CMP: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr, FUSE: tl.constexpr,
                             BLOCK_S: tl.constexpr, DC: tl.constexpr, NORMED: tl.constexpr,
                             PREFETCH: tl.constexpr):
    """Program (head block, row, split): the split's slice [lo, hi) of the row's keys (window keys first, then
    compressed). Without SPLIT the one split starts from the sink and writes the output; with SPLIT it writes its
    partial (m, l, acc); then either `_combine_kernel` merges the splits and the sink (a second launch) or, FUSE,
    the last program of the (row, head block) to finish does it in this launch (ticket counter, reset to 0)."""
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
                             tl.minimum(hi, n_win), row, scale, D, BLOCK_K, IEEE, PREFETCH)
    if HAS_CMP:
        m, l, acc = _attend_pool(q, m, l, acc, cmp_kv_ptr, cmp_idx_ptr, n_cmp, tl.maximum(lo - n_win, 0),
                                 tl.minimum(tl.maximum(hi - n_win, 0), n_cmp), row, scale, D, BLOCK_K, IEEE,
                                 PREFETCH)
    if SPLIT:
        n_split = tl.num_programs(2)
        o = (row * H + heads) * n_split + split
        tl.store(part_m_ptr + o, m, mask=hok)
        tl.store(part_l_ptr + o, l, mask=hok)
        if NORMED:       # half the partial bytes: acc / l in bf16 (an empty split has l = 0 and acc = 0)
            acc = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(part_acc_ptr + o[:, None] * D + dims[None, :], acc.to(part_acc_ptr.dtype.element_ty),
                 mask=hok[:, None])
        if FUSE:
            tl.debug_barrier()                   # every thread's partial stores precede the release below
            ticket_ptr = cnt_ptr + row * tl.num_programs(0) + tl.program_id(0)
            ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
            if ticket == n_split - 1:
                tl.atomic_xchg(ticket_ptr, 0, sem="relaxed", scope="gpu")
                _combine_heads(out_ptr, sink_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, row, heads, hok, H,
                               n_split, D, BLOCK_H, BLOCK_S, DC, NORMED)
    else:
        tl.store(out_ptr + (row * H + heads[:, None]) * D + dims[None, :], (acc / l[:, None]).to(out_ptr.dtype.element_ty),
                 mask=hok[:, None])


@triton.jit
def _combine_kernel(out_ptr, sink_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, H, n_split,
                    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, DC: tl.constexpr,
                    NORMED: tl.constexpr):
    """Second launch of the unfused split form: program (row, head block)."""
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    _combine_heads(out_ptr, sink_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, row, heads, heads < H, H, n_split,
                   D, BLOCK_H, BLOCK_S, DC, NORMED)


# ---------------------------------------------------------------------------------------------- tensor-core form
@triton.jit
def _key_rows(win_kv_ptr, win_idx_ptr, n_win, cmp_kv_ptr, cmp_idx_ptr, n_cmp, row, jj, hi, D: tl.constexpr,
              HAS_CMP: tl.constexpr):
    """Positions jj of the row's key list (window keys first, then compressed): the key rows' base pointers [BK]
    and which are real keys (position < hi and index >= 0). One loop over both pools: one pipelined gather."""
    in_w = jj < n_win
    iw = tl.load(win_idx_ptr + row * n_win + jj, mask=in_w & (jj < hi), other=-1).to(tl.int64)
    if HAS_CMP:
        jc = jj - n_win
        ic = tl.load(cmp_idx_ptr + row * n_cmp + jc, mask=(jc >= 0) & (jj < hi), other=-1).to(tl.int64)
        ok = tl.where(in_w, iw, ic) >= 0
        base = tl.where(in_w, win_kv_ptr + tl.maximum(iw, 0) * D, cmp_kv_ptr + tl.maximum(ic, 0) * D)
    else:
        ok = iw >= 0
        base = win_kv_ptr + tl.maximum(iw, 0) * D
    return base, ok


@triton.jit
def _attn_tc_kernel(q_ptr, out_ptr, sink_ptr, win_kv_ptr, win_idx_ptr, n_win, cmp_kv_ptr, cmp_idx_ptr, n_cmp, H,
                    scale, per_split, part_m_ptr, part_l_ptr, part_acc_ptr, cnt_ptr,
                    D: tl.constexpr, DV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                    HAS_CMP: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr, FUSE: tl.constexpr,
                    BLOCK_S: tl.constexpr, DC: tl.constexpr, NORMED: tl.constexpr, SKIP_PV: tl.constexpr = False,
                    LAZY: tl.constexpr = False):
    """Program (head block x value block, row, split). The head block (64 heads: the M of the tensor-core dots)
    shares every gathered key tile [BLOCK_K, D]: S = Q K^T over all D, online softmax, O += P K over this
    program's DV output columns. DV = D / 2 splits the P@V accumulator over two programs (half the registers;
    both compute the full Q K^T: 1.5x the tensor-core work, and the second reads the key tile from L2)."""
    N_DV: tl.constexpr = D // DV
    pid0 = tl.program_id(0)
    hb = pid0 // N_DV
    dv0 = (pid0 % N_DV) * DV
    row = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hok = heads < H
    own = dv0 + tl.arange(0, DV)                       # this program's output columns
    oth = (DV - dv0) + tl.arange(0, DV)                # the other half of D (N_DV = 2): only for Q K^T
    qrow = q_ptr + (row * H + heads[:, None]) * D
    q_own = tl.load(qrow + own[None, :], mask=hok[:, None], other=0.0).to(win_kv_ptr.dtype.element_ty)
    if N_DV == 2:
        q_oth = tl.load(qrow + oth[None, :], mask=hok[:, None], other=0.0).to(win_kv_ptr.dtype.element_ty)
    if IEEE:
        q_own = q_own.to(tl.float32)
        if N_DV == 2:
            q_oth = q_oth.to(tl.float32)
    if SPLIT:
        m = tl.full([BLOCK_H], -1e30, tl.float32)      # finite: exp(m - new_m) stays 0, never NaN
        l = tl.zeros([BLOCK_H], tl.float32)
    else:   # the sink is a key with logit sink_h and value 0: start the online softmax from it
        m = tl.load(sink_ptr + heads, mask=hok, other=0.0).to(tl.float32)
        l = tl.full([BLOCK_H], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_H, DV], tl.float32)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, n_win + n_cmp)
    for start in range(lo, hi, BLOCK_K):
        jj = start + tl.arange(0, BLOCK_K)
        base, ok = _key_rows(win_kv_ptr, win_idx_ptr, n_win, cmp_kv_ptr, cmp_idx_ptr, n_cmp, row, jj, hi, D,
                             HAS_CMP)
        k_own = tl.load(base[:, None] + own[None, :], mask=ok[:, None], other=0.0)
        if IEEE:
            k_own = k_own.to(tl.float32)
            s = tl.dot(q_own, tl.trans(k_own), input_precision="ieee")
        else:
            s = tl.dot(q_own, tl.trans(k_own))
        if N_DV == 2:
            k_oth = tl.load(base[:, None] + oth[None, :], mask=ok[:, None], other=0.0)
            if IEEE:
                s += tl.dot(q_oth, tl.trans(k_oth.to(tl.float32)), input_precision="ieee")
            else:
                s += tl.dot(q_oth, tl.trans(k_oth))
        s = tl.where(ok[None, :], s * scale, float("-inf"))
        new_m = tl.maximum(m, tl.max(s, 1))
        if LAZY:
            # rescale (acc, l) only when some head's running max grew by more than 8: below that the stale max
            # keeps every p <= e^8 (no overflow in fp32 or bf16) and acc / l is unchanged (FA4's lazy rescale)
            if tl.max(new_m - m, 0) > 8.0:
                alpha = tl.exp(m - new_m)
                acc = acc * alpha[:, None]
                l = l * alpha
                m = new_m
            p = tl.exp(s - m[:, None])
            l = l + tl.sum(p, 1)
        else:
            alpha = tl.exp(m - new_m)
            p = tl.exp(s - new_m[:, None])
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            m = new_m
        if SKIP_PV:      # benchmark ablation only (wrong output): the time without the P @ V dot
            acc = acc
        elif IEEE:
            acc = acc + tl.dot(p, k_own, input_precision="ieee")
        else:
            acc = tl.dot(p.to(k_own.dtype), k_own, acc)
    if SPLIT:
        n_split = tl.num_programs(2)
        o = ((row * N_DV + pid0 % N_DV) * H + heads) * n_split + split      # m, l: [N, N_DV, H, S]
        tl.store(part_m_ptr + o, m, mask=hok)
        tl.store(part_l_ptr + o, l, mask=hok)
        if NORMED:       # half the partial bytes: acc / l in bf16 (an empty split has l = 0 and acc = 0)
            acc = acc / tl.where(l > 0, l, 1.0)[:, None]
        pa = ((row * H + heads) * n_split + split)[:, None] * D + own[None, :]          # acc: [N, H, S, D]
        tl.store(part_acc_ptr + pa, acc.to(part_acc_ptr.dtype.element_ty), mask=hok[:, None])
        if FUSE:
            tl.debug_barrier()                   # every thread's partial stores precede the release below
            ticket_ptr = cnt_ptr + row * tl.num_programs(0) + pid0
            ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
            if ticket == n_split - 1:
                tl.atomic_xchg(ticket_ptr, 0, sem="relaxed", scope="gpu")
                _combine_tc(out_ptr, sink_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, row, pid0 % N_DV, dv0, heads,
                            hok, H, n_split, D, DV, BLOCK_H, BLOCK_S, DC, NORMED)
    else:
        tl.store(out_ptr + (row * H + heads[:, None]) * D + own[None, :],
                 (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=hok[:, None])


@triton.jit
def _combine_tc(out_ptr, sink_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, row, dvb, dv0, heads, hok, H, n_split,
                D: tl.constexpr, DV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, DC: tl.constexpr,
                NORMED: tl.constexpr):
    """Merge the splits of `_attn_tc_kernel` with the sink for a head block's DV columns, in split order
    (deterministic). Partials are read with .cg (L2: another program of this launch wrote them)."""
    N_DV: tl.constexpr = D // DV
    sp = tl.arange(0, BLOCK_S)
    ok = hok[:, None] & (sp[None, :] < n_split)
    o = ((row * N_DV + dvb) * H + heads) * n_split
    ms = tl.load(part_m_ptr + o[:, None] + sp[None, :], mask=ok, other=-1e30, cache_modifier=".cg")
    ls = tl.load(part_l_ptr + o[:, None] + sp[None, :], mask=ok, other=0.0, cache_modifier=".cg")
    sink = tl.load(sink_ptr + heads, mask=hok, other=0.0).to(tl.float32)
    big = tl.maximum(tl.max(ms, 1), sink)
    w = tl.exp(ms - big[:, None])
    w = w / (tl.exp(sink - big) + tl.sum(w * ls, 1))[:, None]                    # [BLOCK_H, BLOCK_S]
    if NORMED:                                   # partials hold acc / l (bf16): weight them by l
        w = w * ls
    base = (row * H + heads) * n_split
    for dc in tl.static_range(0, DV, DC):
        dims = dv0 + dc + tl.arange(0, DC)
        acc = tl.zeros([BLOCK_H, DC], tl.float32)
        for s in range(0, n_split):
            ws = tl.sum(tl.where(sp[None, :] == s, w, 0.0), 1)
            a = tl.load(part_acc_ptr + (base + s)[:, None] * D + dims[None, :], mask=hok[:, None], other=0.0,
                        cache_modifier=".cg").to(tl.float32)
            acc += ws[:, None] * a
        tl.store(out_ptr + (row * H + heads[:, None]) * D + dims[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=hok[:, None])


def sparse_attention_tc(q, win_kv, win_idx, sink, cmp_kv=None, cmp_idx=None, scale=None, block_k: int = 64,
                        dv: int | None = None, splits: int = 1, num_warps: int = 8, num_stages: int = 2,
                        bf16_partials: bool = False, block_h: int = 64, lazy: bool = False,
                        _skip_pv: bool = False):
    """The tensor-core form (`_attn_tc_kernel`): all heads of a row (blocks of block_h = 64) read each gathered
    key tile once; dv = D (default) or D // 2 output columns per program; splits > 1: key splits combined by the
    last program of each (row, head block, value block) in the same launch."""
    _check(q, win_kv, win_idx, cmp_kv, cmp_idx, sink)
    N, H, D = q.shape
    check(D >= 32 and D & (D - 1) == 0, f"head_dim must be a power of two >= 32 for the Triton path, got {D}")
    check(cmp_kv is None or cmp_kv.dtype == win_kv.dtype, "window and compressed pools must share a dtype")
    dv = dv or D
    check(dv in (D, D // 2), f"dv must be D or D // 2, got {dv}")
    scale = D ** -0.5 if scale is None else scale
    q, win_kv, win_idx = q.contiguous(), win_kv.contiguous(), win_idx.to(torch.int32).contiguous()
    has_cmp = cmp_kv is not None
    if has_cmp:
        cmp_kv, cmp_idx = cmp_kv.contiguous(), cmp_idx.to(torch.int32).contiguous()
    n_win, n_cmp = win_idx.shape[1], cmp_idx.shape[1] if has_cmp else 0
    n_keys = n_win + n_cmp
    per_split = triton.cdiv(triton.cdiv(max(n_keys, 1), splits), block_k) * block_k   # whole key blocks per split
    splits = max(1, triton.cdiv(n_keys, per_split))
    out = empty(q.shape, q.dtype, q.device)
    n_dv = D // dv
    n_p0 = triton.cdiv(H, block_h) * n_dv
    if splits > 1:
        part_m = torch.empty((N, n_dv, H, splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((N, H, splits, D), dtype=torch.bfloat16 if bf16_partials else torch.float32,
                               device=q.device)
        cnt = _counters(q.device, N * n_p0)
    else:
        part_m = part_l = part_acc = cnt = out
    sink = sink.float().contiguous()
    _attn_tc_kernel[(n_p0, N, splits)](
        q, out, sink, win_kv, win_idx, n_win, cmp_kv if has_cmp else win_kv, cmp_idx if has_cmp else win_idx,
        n_cmp, H, float(scale), per_split, part_m, part_l, part_acc, cnt, D=D, DV=dv, BLOCK_H=block_h,
        BLOCK_K=block_k, HAS_CMP=has_cmp, IEEE=win_kv.dtype == torch.float32 or INTERPRETING, SPLIT=splits > 1,
        FUSE=splits > 1, BLOCK_S=max(2, triton.next_power_of_2(splits)), DC=min(dv, 64),
        NORMED=bf16_partials, SKIP_PV=_skip_pv, LAZY=lazy, num_warps=num_warps, num_stages=num_stages)
    return out


_COUNTERS: dict = {}    # device -> int32 zeros: the fused split launch's tickets (each launch leaves them at 0)


def _counters(device, n: int) -> torch.Tensor:
    """Zeroed ticket counters, made once per device and grown when needed (outside CUDA-graph capture: the first
    call at a size allocates). One stream at a time: concurrent fused launches on two streams would share them."""
    c = _COUNTERS.get(device)
    if c is None or c.numel() < n:
        c = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = c
    return c


def default_tc_config(N: int, H: int, D: int, n_keys: int) -> dict:
    """Launch parameters of `sparse_attention_tc` at a shape: the H200 sweeps' best (N=64: 48-49 us with 64-key
    tiles and 2 splits; N=256: 148 us with one split; 32-key tiles 58.8 / 173 us, 128-key tiles 65 / 173 us)."""
    return dict(block_k=64, dv=D, splits=2 if N < 128 else 1, num_warps=8, num_stages=2)


def default_config(N: int, H: int, D: int, n_keys: int, device, elem_bytes: int = 2) -> dict:
    """Launch parameters at a shape, from the H200 sweeps (H = 64, D = 512, 128 + 512 keys, bf16):
      N = 64:  D's head blocks of 16 (bk64, 4 warps, one split) 43.8 us; all heads in one program (bh64 bk64
               w8, 2 splits) 44.5; bh64 bk32 2 splits 51.2 (42.9 with every key an L2 hit: latency-bound);
               bh16 with splits 70-98; register-prefetched gathers slower everywhere (98-160).
      N = 256: all heads in one program (bh64 bk32 w8, one split) 146.6 us; D's version 158.6; bh16 bk32 206.
    So: all heads per program from N >= 192 rows (each key read once, wgmma tiles), D's configuration below.
    fp32 pools at D = 512 take 16-key blocks (the key stages must fit shared memory)."""
    if elem_bytes * D > 1024:
        return dict(block_h=16, block_k=16, num_warps=4, num_stages=2, splits=1, fuse=True, bf16_partials=False,
                    prefetch=False)
    if N >= 192 and H >= 64:
        return dict(block_h=64, block_k=32, num_warps=8, num_stages=2, splits=1, fuse=True, bf16_partials=False,
                    prefetch=False)
    return dict(block_h=16, block_k=64, num_warps=4, num_stages=2, splits=1, fuse=True, bf16_partials=False,
                prefetch=False)


def sparse_attention_triton(q, win_kv, win_idx, sink, cmp_kv=None, cmp_idx=None, scale=None,
                            block_h: int | None = None, block_k: int | None = None, num_warps: int | None = None,
                            num_stages: int | None = None, splits: int | None = None, fuse: bool | None = None,
                            bf16_partials: bool | None = None, prefetch: bool | None = None):
    """Launch parameters left None come from `default_config`. splits > 1: key splits per row with fp32 partials
    [N, H, splits, D] (L2-resident at decode sizes), combined by the last program of each (row, head block)
    (fuse=True) or by a second launch (fuse=False). bf16_partials: store each split's normalized output acc / l
    in bf16 instead of acc in fp32 (half the partial bytes; adds one bf16 rounding per split before the merge).
    prefetch: gather the next key block into registers before this block's math (see `_attend_pool`)."""
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
    cfg = default_config(N, H, D, n_keys, q.device, win_kv.element_size())
    block_h = block_h or cfg["block_h"]
    block_k = block_k or cfg["block_k"]
    splits = splits or cfg["splits"]
    fuse = cfg["fuse"] if fuse is None else fuse
    normed = cfg["bf16_partials"] if bf16_partials is None else bf16_partials
    prefetch = cfg["prefetch"] if prefetch is None else prefetch
    per_split = triton.cdiv(triton.cdiv(max(n_keys, 1), splits), block_k) * block_k   # whole key blocks per split
    splits = max(1, triton.cdiv(n_keys, per_split))
    out = empty(q.shape, q.dtype, q.device)
    n_hb = triton.cdiv(H, block_h)
    if splits > 1:
        part_m = torch.empty((N, H, splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((N, H, splits, D), dtype=torch.bfloat16 if normed else torch.float32, device=q.device)
        cnt = _counters(q.device, N * n_hb) if fuse else part_m
    else:
        part_m = part_l = part_acc = cnt = out
    sink = sink.float().contiguous()
    block_s = max(2, triton.next_power_of_2(splits))
    dc = min(D, 64)
    grid = (n_hb, N, splits)   # head blocks of one row launch together: its keys are read once
    _sparse_attention_kernel[grid](
        q, out, sink, win_kv, win_idx, n_win, cmp_kv if has_cmp else win_kv, cmp_idx if has_cmp else win_idx,
        n_cmp, H, float(scale), per_split, part_m, part_l, part_acc, cnt, D=D, BLOCK_H=block_h, BLOCK_K=block_k,
        HAS_CMP=has_cmp, IEEE=win_kv.dtype == torch.float32 or INTERPRETING, SPLIT=splits > 1,
        FUSE=splits > 1 and fuse, BLOCK_S=block_s, DC=dc, NORMED=normed, PREFETCH=prefetch,
        num_warps=num_warps or cfg["num_warps"],
        num_stages=num_stages or cfg["num_stages"])
    if splits > 1 and not fuse and N:
        _combine_kernel[(N, n_hb)](out, sink, part_m, part_l, part_acc, H, splits, D=D, BLOCK_H=block_h,
                                   BLOCK_S=block_s, DC=dc, NORMED=normed, num_warps=4)
    return out


def sparse_attention(q: torch.Tensor, win_kv: torch.Tensor, win_idx: torch.Tensor, sink: torch.Tensor,
                     cmp_kv: torch.Tensor | None = None, cmp_idx: torch.Tensor | None = None,
                     scale: float | None = None) -> torch.Tensor:
    """Sparse MQA decode attention with per-head sink (module docstring). scale defaults to D**-0.5."""
    if use_triton(q):
        return sparse_attention_triton(q, win_kv, win_idx, sink, cmp_kv, cmp_idx, scale)
    return sparse_attention_torch(q, win_kv, win_idx, sink, cmp_kv, cmp_idx, scale)
