"""Speculative acceptance for a whole batch: ratio test, residual distribution, bonus token.

Packed row layout (as the engine's verify forward produces it): request i owns rows [cu_rows[i], cu_rows[i+1]),
n_i = L_i + 1 rows; row j < L_i verifies draft d_{j+1} (draft_tokens[row]), the last row is the fresh row.
Every row's target distribution q is the processed distribution of kernels/sampling.py (bitmask, temperature,
top-k/top-p of its request), for the token at position[i] + j.

Rule (standard speculative sampling, exact):
- row j accepts its draft d iff u * p(d) < q(d), u = Uniform(seed, position + j, stream VERIFY) and p the draft
  distribution it was sampled from (draft_probs[row]; None = every draft was certain, p one-hot: grammar-forced
  drafts and greedy drafters). Greedy requests (T <= 0): accept iff d is q's argmax. d < 0 or d >= V: reject.
- accepted = the longest accepted prefix, n_acc in [0, L_i].
- final row f = first row after that prefix: if it rejected its draft, the final token is sampled from the
  residual max(q - p, 0) (stream RESIDUAL at position + n_acc; falls back to q if the residual is empty in
  floating point); if all drafts were accepted, f is the fresh row and the final token is a bonus sample from q
  with stream FRESH at position + n_acc, i.e. exactly what sample_from_logits would draw there.
Committed tokens of request i: tokens[cu_rows[i] : cu_rows[i] + n_acc + 1] (accepted drafts, then the final
token); the rest of its rows hold -1.

Work (Triton path, `_accept_triton`): per-row statistics (max and sum of exp over the kept set: one pass over
all rows, split over vocab chunks), the ratio test in one small per-request kernel, then one pass over the B final
rows (logits + draft probs) for the residual/bonus Gumbel-max and a per-request finish: nine launches (four are
the top-k/top-p threshold, which exit at once on rows without filters; D's first version made ~80 launches, most
of them small torch ops, and measured 13% of copy bandwidth). No host synchronisation anywhere.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import rng
from .backend import INTERPRETING, check, empty, use_triton
from .sampling import (NEG_INF, NEG_INF_KEY, RowParams, check_logits_and_mask, chunking, default_mask_rows,
                       finish_argmax, kept_z_torch, load_z, masked_z_torch, pack_best, thresholds_torch,
                       thresholds_triton)


_NEG_INF_KEY = tl.constexpr(NEG_INF_KEY)


@dataclass
class AcceptResult:
    num_accepted: torch.Tensor   # int64 [B]: accepted drafts per request
    tokens: torch.Tensor         # int64 [R]: committed tokens in packed row layout, -1 elsewhere
    final_tokens: torch.Tensor   # int64 [B]: the corrected or bonus token of each request (-1: nothing allowed)


@dataclass
class _Rows:
    """Per-row view of the per-request parameters."""
    req: torch.Tensor            # int64 [R] request of each row
    step: torch.Tensor           # int64 [R] local row index j
    n_rows: torch.Tensor         # int64 [R] rows of the row's request
    params: RowParams            # keys: FRESH stream at position + j
    seed: torch.Tensor
    pos: torch.Tensor


def _rows(cu_rows, R, temperature, top_k, top_p, seed, position) -> _Rows:
    from .sampling import row_params
    dev = cu_rows.device
    B = cu_rows.numel() - 1
    r = torch.arange(R, device=dev)
    req = torch.searchsorted(cu_rows[1:].contiguous(), r, right=True).clamp_max(max(B - 1, 0))
    step = r - cu_rows[req]
    n_rows = cu_rows[req + 1] - cu_rows[req]
    per_req = row_params(B, dev, temperature, top_k, top_p, seed, position)     # validates shapes
    seed_r = torch.as_tensor(seed, dtype=torch.int64, device=dev).expand(B)[req]
    pos_r = torch.as_tensor(position, dtype=torch.int64, device=dev).expand(B)[req] + step
    params = RowParams(per_req.inv_temperature[req], per_req.greedy[req], per_req.top_k[req],
                       per_req.top_p[req], rng.row_keys(seed_r, pos_r, rng.FRESH))
    return _Rows(req, step, n_rows, params, seed_r, pos_r)


def _accept_and_finalise(logits, rows: _Rows, tau, m, s, argmax, draft_tokens, draft_probs, bitmask, mrows, B):
    """The acceptance test (torch, [R] vectors) -> (n_acc [B], final row [B], residual? [B])."""
    R, V = logits.shape
    d = draft_tokens.to(torch.int64)
    valid = (d >= 0) & (d < V)
    dc = d.clamp(0, V - 1)
    r = torch.arange(R, device=logits.device)
    z_d = logits[r, dc].float() * rows.params.inv_temperature
    if bitmask is not None:
        word = bitmask[mrows.clamp_min(0), dc // 32]
        allowed = (((word >> (dc % 32).to(torch.int32)) & 1) != 0) | (mrows < 0)
        z_d = torch.where(allowed, z_d, torch.full_like(z_d, NEG_INF))
    kept = (z_d >= tau) & (z_d > NEG_INF)
    q_d = torch.where(kept, torch.exp(z_d - m) / s, torch.zeros_like(z_d))
    q_d = torch.where(rows.params.greedy, (dc == argmax).float(), q_d)
    p_d = torch.ones_like(q_d) if draft_probs is None else draft_probs[r, dc].float()
    u = rng.uniform(rng.row_keys(rows.seed, rows.pos, rng.VERIFY), torch.zeros_like(d))
    accept = valid & (u * p_d < q_d)
    fail = ~accept | (rows.step >= rows.n_rows - 1)
    big = torch.full((B,), 1 << 40, dtype=torch.int64, device=logits.device)
    n_acc = big.scatter_reduce(0, rows.req, torch.where(fail, rows.step, torch.full_like(rows.step, 1 << 40)),
                               reduce="amin")
    return n_acc


# ---------------------------------------------------------------------------------------------- torch twin
def _stats_torch(logits, params, bitmask, mrows):
    z = masked_z_torch(logits, params.inv_temperature, bitmask, mrows)
    tau = thresholds_torch(z, params)
    zk = z.masked_fill(z < tau[:, None], NEG_INF)
    m = zk.max(1).values
    s = torch.exp(zk - m.clamp_min(-3e38)[:, None]).sum(1)
    return tau, m, s, z.argmax(1)


def _final_torch(logits, params: RowParams, rows_f, draft_f, residual, draft_probs, bitmask, mrows, keys):
    sub = RowParams(params.inv_temperature[rows_f], params.greedy[rows_f], params.top_k[rows_f],
                    params.top_p[rows_f], keys)
    zk = kept_z_torch(logits[rows_f], sub, bitmask, None if mrows is None else mrows[rows_f])
    ids = torch.arange(logits.shape[1], device=logits.device)
    g = rng.gumbel(keys[:, None], ids[None, :])
    q = torch.nan_to_num(torch.softmax(zk, 1), nan=0.0)
    if draft_probs is None:
        p = torch.zeros_like(q).scatter_(1, draft_f.clamp(0, q.shape[1] - 1)[:, None], 1.0)
        p = torch.where((draft_f >= 0)[:, None], p, torch.zeros_like(p))
    else:
        p = draft_probs[rows_f].float()
    res = q - p
    res_score = torch.where(res > 0, torch.log(res.clamp_min(1e-38)) + g, torch.full_like(res, NEG_INF))
    q_tok = finish_argmax(zk + g, ids.expand_as(zk))
    r_tok = finish_argmax(res_score, ids.expand_as(zk))
    return torch.where(residual & (r_tok >= 0), r_tok, q_tok)


# ---------------------------------------------------------------------------------------------- Triton pieces
@triton.jit
def _stats_split_kernel(logits_ptr, m_ptr, s_ptr, amax_ptr, inv_t_ptr, tau_ptr, bitmask_ptr,
                        mask_rows_ptr, bitmask_stride, V, n_chunks, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr,
                        CHUNK: tl.constexpr):
    """Program (row, chunk): max and sum exp over the chunk's kept z (per lane, one reduction at the end), and
    the packed argmax of its allowed z."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    inv_t = tl.load(inv_t_ptr + row)
    tau = tl.load(tau_ptr + row)
    mrow = -1
    if HAS_MASK:
        mrow = tl.load(mask_rows_ptr + row)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    zbest = tl.full([BLOCK], float("-inf"), tl.float32)
    zid = tl.zeros([BLOCK], tl.int32)
    for i in tl.static_range(CHUNK // BLOCK):
        cols = chunk * CHUNK + i * BLOCK + tl.arange(0, BLOCK)
        z = load_z(logits_ptr, row, cols, V, inv_t, bitmask_ptr, mrow, bitmask_stride, HAS_MASK)
        better = z > zbest
        zbest = tl.where(better, z, zbest)
        zid = tl.where(better, cols, zid)
        zk = tl.where(z >= tau, z, float("-inf"))
        new_m = tl.maximum(m, zk)
        # a lane that has seen nothing kept stays (m, s) = (-inf, 0); a finite reference avoids exp(-inf + inf)
        ref = tl.where(new_m > float("-inf"), new_m, 0.0)
        s = s * tl.exp(m - ref) + tl.exp(zk - ref)
        m = new_m
    mm = tl.max(m, 0)
    ss = tl.sum(s * tl.exp(m - tl.where(mm > float("-inf"), mm, 0.0)), 0)
    o = row * n_chunks + chunk
    tl.store(m_ptr + o, mm)
    tl.store(s_ptr + o, ss)
    tl.store(amax_ptr + o, pack_best(zbest, zid))


@triton.jit
def _final_split_kernel(logits_ptr, probs_ptr, rows_ptr, drafts_ptr, residual_ptr, keys_ptr, inv_t_ptr, tau_ptr,
                        m_ptr, s_ptr, bitmask_ptr, mask_rows_ptr, bitmask_stride, V, n_chunks, res_ptr, q_ptr,
                        HAS_MASK: tl.constexpr, HAS_PROBS: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                        FAST_LOG: tl.constexpr):
    """Program (request, chunk) on the request's final row: packed Gumbel winners of the residual max(q - p, 0)
    (only when the row rejected its draft) and of q itself (the bonus sample, and the fallback of an empty
    residual)."""
    b = tl.program_id(0)
    chunk = tl.program_id(1)
    row = tl.load(rows_ptr + b)
    inv_t = tl.load(inv_t_ptr + row)
    tau = tl.load(tau_ptr + row)
    m = tl.load(m_ptr + row)
    s = tl.load(s_ptr + row)
    d = tl.load(drafts_ptr + b)
    residual = tl.load(residual_ptr + b) != 0
    key = tl.load(keys_ptr + b).to(tl.uint32)
    mrow = -1
    if HAS_MASK:
        mrow = tl.load(mask_rows_ptr + row)
    rbest = tl.full([BLOCK], float("-inf"), tl.float32)
    rid = tl.zeros([BLOCK], tl.int32)
    qbest = tl.full([BLOCK], float("-inf"), tl.float32)
    qid = tl.zeros([BLOCK], tl.int32)
    for i in tl.static_range(CHUNK // BLOCK):
        cols = chunk * CHUNK + i * BLOCK + tl.arange(0, BLOCK)
        z = load_z(logits_ptr, row, cols, V, inv_t, bitmask_ptr, mrow, bitmask_stride, HAS_MASK)
        kept = (z >= tau) & (z > float("-inf"))
        g = rng.gumbel_tl(key, cols, FAST_LOG)
        qs = tl.where(kept, z + g, float("-inf"))
        better = qs > qbest
        qbest = tl.where(better, qs, qbest)
        qid = tl.where(better, cols, qid)
        if residual:
            q = tl.where(kept, tl.exp(z - m) / s, 0.0)
            if HAS_PROBS:
                p = tl.load(probs_ptr + row * V + cols, mask=cols < V, other=0.0).to(tl.float32)
            else:
                p = tl.where(cols == d, 1.0, 0.0)
            r = q - p
            rs = tl.where(r > 0, tl.log(tl.maximum(r, 1e-30)) + g, float("-inf"))
            better = rs > rbest
            rbest = tl.where(better, rs, rbest)
            rid = tl.where(better, cols, rid)
    o = b * n_chunks + chunk
    tl.store(res_ptr + o, pack_best(rbest, rid))
    tl.store(q_ptr + o, pack_best(qbest, qid))


@triton.jit
def _expand_rows_kernel(cu_ptr, inv_t_ptr, greedy_ptr, top_k_ptr, top_p_ptr,
                        row_inv_t_ptr, row_greedy_ptr, row_top_k_ptr, row_top_p_ptr):
    """Program (request): copy its parameters onto each of its rows (what the per-row kernels read)."""
    b = tl.program_id(0)
    start = tl.load(cu_ptr + b)
    n = tl.load(cu_ptr + b + 1) - start
    inv_t = tl.load(inv_t_ptr + b)
    greedy = tl.load(greedy_ptr + b)
    top_k = tl.load(top_k_ptr + b)
    top_p = tl.load(top_p_ptr + b)
    for j in range(0, n):
        r = start + j
        tl.store(row_inv_t_ptr + r, inv_t)
        tl.store(row_greedy_ptr + r, greedy)
        tl.store(row_top_k_ptr + r, top_k)
        tl.store(row_top_p_ptr + r, top_p)


@triton.jit
def _accept_kernel(logits_ptr, probs_ptr, drafts_ptr, cu_ptr, seed_ptr, pos_ptr, inv_t_ptr, greedy_ptr, tau_ptr,
                   m_c_ptr, s_c_ptr, amax_c_ptr, bitmask_ptr, mask_rows_ptr, bitmask_stride, V, n_chunks,
                   m_ptr, s_ptr, amax_ptr, n_acc_ptr, rows_f_ptr, draft_f_ptr, residual_ptr, keys_f_ptr, tokens_ptr,
                   C_VERIFY, C_RESIDUAL, C_FRESH,
                   HAS_MASK: tl.constexpr, HAS_PROBS: tl.constexpr, NCP: tl.constexpr):
    """Program (request): merge each row's chunk statistics (m, s, argmax), run the ratio test row by row up to
    the first rejection, write the accepted drafts (-1 on the other rows) and the final row's inputs."""
    b = tl.program_id(0)
    start = tl.load(cu_ptr + b)
    n = tl.load(cu_ptr + b + 1) - start
    seed = tl.load(seed_ptr + b)
    pos0 = tl.load(pos_ptr + b)
    inv_t = tl.load(inv_t_ptr + b)
    greedy = tl.load(greedy_ptr + b) != 0
    c = tl.arange(0, NCP)
    n_acc = n - 1
    for j in range(0, n):
        r = start + j
        ro = r.to(tl.int64)
        mc = tl.load(m_c_ptr + ro * n_chunks + c, mask=c < n_chunks, other=float("-inf"))
        sc = tl.load(s_c_ptr + ro * n_chunks + c, mask=c < n_chunks, other=0.0)
        ac = tl.load(amax_c_ptr + ro * n_chunks + c, mask=c < n_chunks, other=-9223372036854775807)
        m = tl.max(mc, 0)
        s = tl.sum(sc * tl.exp(mc - tl.where(m > float("-inf"), m, 0.0)), 0)
        best = tl.max(ac, 0)
        amax = tl.where((best >> 32) > _NEG_INF_KEY, 4294967295 - (best & 4294967295), -1)
        tl.store(m_ptr + r, m)
        tl.store(s_ptr + r, s)
        tl.store(amax_ptr + r, amax)
        if (j < n_acc) & (j < n - 1):                 # still accepting: test this row's draft
            d = tl.load(drafts_ptr + r)
            dc = tl.minimum(tl.maximum(d, 0), V - 1)
            z = tl.load(logits_ptr + ro * V + dc).to(tl.float32) * inv_t
            if HAS_MASK:
                mrow = tl.load(mask_rows_ptr + r)
                w = tl.load(bitmask_ptr + tl.maximum(mrow, 0) * bitmask_stride + dc // 32)
                z = tl.where((((w >> (dc % 32).to(tl.int32)) & 1) != 0) | (mrow < 0), z, float("-inf"))
            kept = (z >= tl.load(tau_ptr + r)) & (z > float("-inf"))
            q = tl.where(kept, tl.exp(z - m) / s, 0.0)
            q = tl.where(greedy, tl.where(dc == amax, 1.0, 0.0), q)
            p = 1.0
            if HAS_PROBS:
                p = tl.load(probs_ptr + ro * V + dc).to(tl.float32)
            u = rng.uniform_tl(rng.row_key_tl(seed, pos0 + j, C_VERIFY), pos0 * 0)        # id 0, as the twin
            if (d < 0) | (d >= V) | (u * p >= q):
                n_acc = n_acc * 0 + j
    for j in range(0, n):
        r = start + j
        d = tl.load(drafts_ptr + r)
        tl.store(tokens_ptr + r, tl.where(j < n_acc, d, -1))
    rows_f = start + n_acc
    residual = n_acc < n - 1
    tl.store(n_acc_ptr + b, n_acc.to(tl.int64))
    tl.store(rows_f_ptr + b, rows_f.to(tl.int64))
    tl.store(draft_f_ptr + b, tl.where(residual, tl.load(drafts_ptr + rows_f), -1))
    tl.store(residual_ptr + b, residual.to(tl.int8))
    key = rng.row_key_tl(seed, pos0 + n_acc, tl.where(residual, C_RESIDUAL, C_FRESH))
    tl.store(keys_f_ptr + b, key.to(tl.int64))


@triton.jit
def _finish_final_kernel(res_ptr, q_ptr, rows_f_ptr, residual_ptr, greedy_ptr, m_ptr, amax_ptr, final_ptr,
                         tokens_ptr, n_chunks, BLOCK: tl.constexpr):
    """Program (request): the final token (residual winner, else the q winner; greedy: the argmax), also written
    into the packed tokens at the final row."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    lowest = -9223372036854775807
    rbest = tl.max(tl.load(res_ptr + b * n_chunks + c, mask=c < n_chunks, other=lowest), 0)
    qbest = tl.max(tl.load(q_ptr + b * n_chunks + c, mask=c < n_chunks, other=lowest), 0)
    r_tok = tl.where((rbest >> 32) > _NEG_INF_KEY, 4294967295 - (rbest & 4294967295), -1)
    q_tok = tl.where((qbest >> 32) > _NEG_INF_KEY, 4294967295 - (qbest & 4294967295), -1)
    tok = tl.where((tl.load(residual_ptr + b) != 0) & (r_tok >= 0), r_tok, q_tok)
    row = tl.load(rows_f_ptr + b)
    greedy_tok = tl.where(tl.load(m_ptr + row) > float("-inf"), tl.load(amax_ptr + row), -1)
    tok = tl.where(tl.load(greedy_ptr + b) != 0, greedy_tok, tok)
    tl.store(final_ptr + b, tok)
    tl.store(tokens_ptr + row, tok)


def _accept_triton(logits, cu_rows, draft_tokens, draft_probs, req: RowParams, seed, position, bitmask, mrows):
    """The whole acceptance step in nine launches (four of them the top-k/top-p threshold, which exits at once on
    rows without filters) and no host synchronisation: expand parameters to rows, thresholds, per-chunk row
    statistics, the per-request ratio test, the final rows' residual/bonus Gumbel pass, the final tokens."""
    R, V = logits.shape
    B = cu_rows.numel() - 1
    dev = logits.device
    greedy = req.greedy.to(torch.int8)
    rows = RowParams(torch.empty(R, dtype=torch.float32, device=dev), torch.empty(R, dtype=torch.int8, device=dev),
                     torch.empty(R, dtype=torch.int64, device=dev), torch.empty(R, dtype=torch.float32, device=dev),
                     None)
    _expand_rows_kernel[(B,)](cu_rows, req.inv_temperature, greedy, req.top_k, req.top_p, rows.inv_temperature,
                              rows.greedy, rows.top_k, rows.top_p, num_warps=1)
    tau = thresholds_triton(logits, rows, bitmask, mrows)
    block, chunk, n_chunks = chunking(V)
    m_c = torch.empty((R, n_chunks), dtype=torch.float32, device=dev)
    s_c = torch.empty_like(m_c)
    amax_c = torch.empty((R, n_chunks), dtype=torch.int64, device=dev)
    has_mask, has_probs = bitmask is not None, draft_probs is not None
    bm = bitmask if has_mask else logits
    mr = mrows if has_mask else tau
    stride = bitmask.stride(0) if has_mask else 0
    _stats_split_kernel[(R, n_chunks)](logits, m_c, s_c, amax_c, rows.inv_temperature, tau, bm, mr, stride, V,
                                       n_chunks, HAS_MASK=has_mask, BLOCK=block, CHUNK=chunk, num_warps=4)
    m = torch.empty(R, dtype=torch.float32, device=dev)
    s = torch.empty_like(m)
    amax = torch.empty(R, dtype=torch.int64, device=dev)
    n_acc = empty((B,), torch.int64, dev)
    rows_f = torch.empty(B, dtype=torch.int64, device=dev)
    draft_f = torch.empty(B, dtype=torch.int64, device=dev)
    residual = torch.empty(B, dtype=torch.int8, device=dev)
    keys_f = torch.empty(B, dtype=torch.int64, device=dev)
    tokens = empty((R,), torch.int64, dev)
    _accept_kernel[(B,)](logits, draft_probs if has_probs else logits, draft_tokens, cu_rows, seed, position,
                         req.inv_temperature, greedy, tau, m_c, s_c, amax_c, bm, mr, stride, V, n_chunks, m, s, amax,
                         n_acc, rows_f, draft_f, residual, keys_f, tokens, rng.stream_constant(rng.VERIFY),
                         rng.stream_constant(rng.RESIDUAL), rng.stream_constant(rng.FRESH),
                         HAS_MASK=has_mask, HAS_PROBS=has_probs, NCP=max(16, triton.next_power_of_2(n_chunks)),
                         num_warps=1)
    res_c = torch.empty((B, n_chunks), dtype=torch.int64, device=dev)
    q_c = torch.empty_like(res_c)
    _final_split_kernel[(B, n_chunks)](
        logits, draft_probs if has_probs else logits, rows_f, draft_f, residual, keys_f, rows.inv_temperature, tau,
        m, s, bm, mr, stride, V, n_chunks, res_c, q_c, HAS_MASK=has_mask, HAS_PROBS=has_probs, BLOCK=block,
        CHUNK=chunk, FAST_LOG=not INTERPRETING, num_warps=4)
    final = empty((B,), torch.int64, dev)
    _finish_final_kernel[(B,)](res_c, q_c, rows_f, residual, greedy, m, amax, final, tokens, n_chunks,
                               BLOCK=max(16, triton.next_power_of_2(n_chunks)), num_warps=1)
    return AcceptResult(n_acc, tokens, final)


# ---------------------------------------------------------------------------------------------- dispatch
def speculative_accept(logits: torch.Tensor, cu_rows: torch.Tensor, draft_tokens: torch.Tensor,
                       draft_probs: torch.Tensor | None, temperature, top_k, top_p, seed, position,
                       bitmask: torch.Tensor | None = None, mask_rows=None, backend: str = "auto") -> AcceptResult:
    """Verify packed draft rows for a batch of requests (module docstring has the exact rule).

    logits fp32 [R, V] (packed rows); cu_rows int64 [B+1] (cu_rows[0] = 0, cu_rows[B] = R, every request >= 1
    row); draft_tokens int64 [R] (entries on fresh rows ignored); draft_probs [R, V] fp32 or None (one-hot
    drafts); temperature/top_k/top_p/seed/position: scalars or [B] (position: of the token row 0 predicts);
    bitmask/mask_rows as in sample_from_logits (per row; e.g. kernels.bitmask.by_step_mask_rows). backend:
    "auto" (Triton on CUDA), "triton" or "torch".
    """
    check_logits_and_mask(logits, bitmask, mask_rows)
    R, V = logits.shape
    cu_rows = torch.as_tensor(cu_rows, device=logits.device).to(torch.int64).contiguous()
    check(cu_rows.dim() == 1 and cu_rows.numel() >= 2, f"cu_rows must be [B+1] with B >= 1, got {tuple(cu_rows.shape)}")
    draft_tokens = torch.as_tensor(draft_tokens, device=logits.device).to(torch.int64).contiguous()
    check(draft_tokens.shape == (R,), f"draft_tokens must be [{R}] (one per row), got {tuple(draft_tokens.shape)}")
    if draft_probs is not None:
        check(draft_probs.shape == (R, V) and draft_probs.is_contiguous(),
              f"draft_probs must be contiguous [{R}, {V}], got {tuple(draft_probs.shape)}")
    if not logits.is_cuda:
        check(int(cu_rows[0]) == 0 and int(cu_rows[-1]) == R and bool((cu_rows.diff() >= 1).all()),
              f"cu_rows must start at 0, end at {R} and give every request >= 1 row, got {cu_rows.tolist()}")
    B = cu_rows.numel() - 1
    mrows = default_mask_rows(mask_rows, R, logits.device) if bitmask is not None else None
    triton_path = use_triton(logits) if backend == "auto" else backend == "triton"
    if triton_path:
        from .sampling import _per_row, row_params
        # device tensors stay where they are (no host copies: the step can be captured in a CUDA graph)
        seed = _per_row(seed, B, torch.int64, logits.device, "seed")
        position = _per_row(position, B, torch.int64, logits.device, "position")
        req = row_params(B, logits.device, temperature, top_k, top_p, seed, position)      # validates shapes
        return _accept_triton(logits, cu_rows, draft_tokens, draft_probs, req, seed, position, bitmask, mrows)
    rows = _rows(cu_rows, R, temperature, top_k, top_p, seed, position)
    tau, m, s, argmax = _stats_torch(logits, rows.params, bitmask, mrows)
    n_acc = _accept_and_finalise(logits, rows, tau, m, s, argmax, draft_tokens, draft_probs, bitmask, mrows, B)
    n_rows = cu_rows[1:] - cu_rows[:-1]
    rows_f = cu_rows[:-1] + n_acc
    residual = n_acc < n_rows - 1
    draft_f = torch.where(residual, draft_tokens[rows_f], torch.full_like(n_acc, -1))
    pos_f = rows.pos[rows_f]
    seed_f = rows.seed[rows_f]
    keys = torch.where(residual, rng.row_keys(seed_f, pos_f, rng.RESIDUAL), rng.row_keys(seed_f, pos_f, rng.FRESH))
    final = _final_torch(logits, rows.params, rows_f, draft_f, residual, draft_probs, bitmask, mrows, keys)
    greedy_f = rows.params.greedy[rows_f]
    final = torch.where(greedy_f, torch.where(m[rows_f] > NEG_INF, argmax[rows_f], -1), final)
    tokens = torch.where(rows.step < n_acc[rows.req], draft_tokens, torch.full_like(draft_tokens, -1))
    tokens = tokens.scatter(0, rows_f, final)
    return AcceptResult(n_acc, tokens, final)
