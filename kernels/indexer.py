"""Lightning-indexer scores and top-k selection of compressed entries (architecture doc section 2.5).

For query row n (one decode/verify token) and each visible compressed entry g of its sequence:
  I[n, g] = sum_h w[n, h] * relu(iq[n, h] . ik[g])
then the k highest-scoring entries (fewer if fewer are visible; the rest -1). Ties: the lower entry id wins (the
doc leaves ties open; the engine's stable `topk_mask` fixes them this way, and relu makes exact-zero ties common).

Shapes: iq [N, Hi, Di], w [N, Hi] (fp32), index_keys [P, Di] (a pool; row n's entries are
index_keys[key_start[n] + g] for g < key_len[n]), k int. Returns (idx int64 [N, k] entry numbers g, -1 padded;
scores fp32 [N, k], -inf padded), best first.
Triton, two launches:
  * the score kernel (grid rows x entry blocks; per program one [Hi, Di] x [Di, BLOCK_G] product, relu and the
    head-weighted sum in registers) writes scores [N, max_len] (fp32: 64 KB a row at 16384 entries, L2-resident);
  * `topk_select_triton` (one program per row): the exact k-th best order key found bit by bit (32 counting
    reductions over the register-resident row), a compaction of the winners in entry order, then an in-register
    sort best first.
    It replaces torch.topk (77 us of the 166 us at N=64, L=16384, k=512 on an H200).
The candidate-block restriction of layers 24/28/... is expressed by the caller through key_start/key_len of a
gathered pool, or by -inf scores (not selectable).
Cost: N * max_len * Di * bytes(keys) read once, + N * max_len * 4 written and re-read from L2 by the select.
"""
import torch
import triton
import triton.language as tl

from .backend import empty, INTERPRETING, check, use_triton


def _check(iq, w, keys, key_start, key_len, k):
    check(iq.dim() == 3, f"index queries must be [rows, heads, dim], got {tuple(iq.shape)}")
    N, Hi, Di = iq.shape
    check(w.shape == (N, Hi), f"index head weights must be [{N}, {Hi}], got {tuple(w.shape)}")
    check(keys.dim() == 2 and keys.shape[1] == Di, f"index keys must be [pool, {Di}], got {tuple(keys.shape)}")
    check(key_start.shape == (N,) and key_len.shape == (N,),
          f"key_start and key_len must be [{N}], got {tuple(key_start.shape)} and {tuple(key_len.shape)}")
    check(k >= 1, f"top-k must be >= 1, got {k}")


def _select(scores, k):
    """Top-k of [N, L] scores (-inf = not visible) -> (idx padded with -1, scores padded with -inf), best first;
    equal scores: the lower entry id first (a stable sort, as the engine's `topk_mask`)."""
    N, L = scores.shape
    kk = min(k, L)
    val, idx = scores.sort(dim=1, descending=True, stable=True)
    val, idx = val[:, :kk], idx[:, :kk]
    idx = torch.where(val > float("-inf"), idx, torch.full_like(idx, -1))
    if kk < k:
        val = torch.cat([val, val.new_full((N, k - kk), float("-inf"))], 1)
        idx = torch.cat([idx, idx.new_full((N, k - kk), -1)], 1)
    return idx, val


# ---------------------------------------------------------------------------------------------- torch twin
def indexer_scores_torch(iq, w, keys, key_start, key_len, max_len):
    g = torch.arange(max_len, device=iq.device)
    visible = g[None, :] < key_len[:, None]
    rows = (key_start[:, None] + g[None, :]).clamp(0, max(keys.shape[0] - 1, 0))
    k = keys[rows].float()                                              # [N, L, Di]
    s = torch.relu(torch.einsum("nhd,nld->nhl", iq.float(), k))
    scores = torch.einsum("nh,nhl->nl", w.float(), s)
    return scores.masked_fill(~visible, float("-inf"))


def indexer_topk_torch(iq, w, keys, key_start, key_len, k, max_len=None):
    _check(iq, w, keys, key_start, key_len, k)
    max_len = int(key_len.max()) if max_len is None else max_len
    return _select(indexer_scores_torch(iq, w, keys, key_start.long(), key_len.long(), max_len), k)


# ---------------------------------------------------------------------------------------------- Triton
@triton.jit
def _indexer_score_kernel(iq_ptr, w_ptr, keys_ptr, start_ptr, len_ptr, out_ptr, max_len, HI,
                          HP: tl.constexpr, DI: tl.constexpr, BLOCK_G: tl.constexpr, F32: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    gb = tl.program_id(1)
    g = gb * BLOCK_G + tl.arange(0, BLOCK_G)
    n_keys = tl.load(len_ptr + n)
    start = tl.load(start_ptr + n).to(tl.int64)
    visible = g < n_keys
    score = tl.full([BLOCK_G], float("-inf"), tl.float32)
    if gb * BLOCK_G < n_keys:
        h = tl.arange(0, HP)
        d = tl.arange(0, DI)
        q = tl.load(iq_ptr + (n * HI + h[:, None]) * DI + d[None, :], mask=h[:, None] < HI, other=0.0)
        kt = tl.load(keys_ptr + (start + g[None, :]) * DI + d[:, None], mask=visible[None, :], other=0.0)
        if F32:
            s = tl.dot(q.to(tl.float32), kt.to(tl.float32), input_precision="ieee")    # [HP, BLOCK_G]
        else:
            s = tl.dot(q.to(kt.dtype), kt)
        w = tl.load(w_ptr + n * HI + h, mask=h < HI, other=0.0).to(tl.float32)
        score = tl.sum(tl.maximum(s, 0.0) * w[:, None], 0)
        score = tl.where(visible, score, float("-inf"))
    tl.store(out_ptr + n * max_len + g, score, mask=g < max_len)


def indexer_scores_triton(iq, w, keys, key_start, key_len, max_len, block_g: int = 128, num_warps: int = 8):
    """The score kernel alone: fp32 [N, max_len], -inf where not visible. Defaults: the H200 round-1 sweep
    (N=64, L=16384: block_g 128 with 8 warps 76 us = 84% of copy bandwidth; 4 warps 77 us; 64 82 us; 256 85 us)."""
    N, Hi, Di = iq.shape
    scores = empty((N, max_len), torch.float32, iq.device)
    if max_len > 0:
        grid = (N, triton.cdiv(max_len, block_g))
        _indexer_score_kernel[grid](iq.contiguous(), w.contiguous(), keys.contiguous(),
                                    key_start.to(torch.int64).contiguous(), key_len.to(torch.int64).contiguous(),
                                    scores, max_len, Hi, HP=max(16, triton.next_power_of_2(Hi)), DI=Di,
                                    BLOCK_G=block_g, F32=keys.dtype == torch.float32 or INTERPRETING,
                                    num_warps=num_warps)
    return scores


@triton.jit
def _order_key(x):
    """fp32 -> uint32 whose unsigned order is the float order (-0.0 folded onto +0.0, so they tie as in torch);
    -inf maps to 0x007FFFFF, above 0, which the select kernel keeps for 'not selectable'."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = tl.where(bits == 0x80000000, 0, bits)
    return tl.where((bits & 0x80000000) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)


@triton.jit
def _load_keys(scores_ptr, row, g, L):
    """Order keys of one block of a row's scores; 0 (below every real key) where g >= L or the score is -inf."""
    x = tl.load(scores_ptr + row * L + g, mask=g < L, other=float("-inf"))
    return tl.where(x > float("-inf"), _order_key(x), 0)


@triton.jit
def _count_at_least(scores_ptr, row, L, keys, t, offs, BLOCK: tl.constexpr, RESIDENT: tl.constexpr):
    """Number of the row's order keys >= t (0 never counts: t >= 1)."""
    if RESIDENT:
        cnt = tl.sum((keys >= t).to(tl.int32), 0)
    else:
        cnt = tl.zeros([], tl.int32)
        for start in range(0, L, BLOCK):
            cnt += tl.sum((_load_keys(scores_ptr, row, start + offs, L) >= t).to(tl.int32), 0)
    return cnt


@triton.jit
def _count3(scores_ptr, row, L, keys, t1, t2, t3, offs, BLOCK: tl.constexpr, RESIDENT: tl.constexpr):
    """Counts of keys >= t1, >= t2, >= t3 in ONE reduction (three 21-bit fields of an int64: a row has < 2**21
    entries on this path, checked by the caller)."""
    if RESIDENT:
        packed = tl.sum((keys >= t1).to(tl.int64) + ((keys >= t2).to(tl.int64) << 21)
                        + ((keys >= t3).to(tl.int64) << 42), 0)
    else:
        packed = tl.zeros([], tl.int64)
        for start in range(0, L, BLOCK):
            kb = _load_keys(scores_ptr, row, start + offs, L)
            packed += tl.sum((kb >= t1).to(tl.int64) + ((kb >= t2).to(tl.int64) << 21)
                             + ((kb >= t3).to(tl.int64) << 42), 0)
    return packed & 0x1FFFFF, (packed >> 21) & 0x1FFFFF, packed >> 42


@triton.jit
def _topk_select_kernel(scores_ptr, L, k, idx_ptr, val_ptr, BLOCK: tl.constexpr, RESIDENT: tl.constexpr,
                        SORTED: tl.constexpr, KP: tl.constexpr):
    """Program = one row of scores [N, L]: the exact k best (ties: lower id). The k-th best order key T is found
    two bits at a time (16 counting reductions: T = the largest t with count(keys >= t) >= k; only sum
    reductions over a register-resident row; an H200 run of a 4-pass tl.histogram radix select took 173 us for
    64 rows of 16384, slower than torch.topk), then one compaction pass in entry order takes every key > T and the
    lowest-id keys == T. RESIDENT (L <= BLOCK): the row is loaded once and stays in registers; otherwise every
    pass streams it (from L2 at decode sizes). SORTED: the k winners are re-ordered best first by one in-register
    sort of (key, -id) (KP = next pow2 of k)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    keys = tl.zeros([BLOCK], tl.uint32)
    if RESIDENT:
        keys = _load_keys(scores_ptr, row, offs, L)
    n_take = tl.minimum(_count_at_least(scores_ptr, row, L, keys, 1, offs, BLOCK, RESIDENT), k)
    prefix = tl.zeros([], tl.uint32)
    for b in tl.static_range(16):                       # two bits of T per reduction
        lo = 30 - 2 * b
        t1 = prefix | (1 << lo)
        t2 = prefix | (2 << lo)
        t3 = prefix | (3 << lo)
        c1, c2, c3 = _count3(scores_ptr, row, L, keys, t1, t2, t3, offs, BLOCK, RESIDENT)
        prefix = tl.where(c3 >= n_take, t3, tl.where(c2 >= n_take, t2, tl.where(c1 >= n_take, t1, prefix)))
    # prefix = the n_take-th largest key; take every key above it and the `rem` lowest-id keys equal to it
    rem = n_take - _count_at_least(scores_ptr, row, L, keys, prefix + 1, offs, BLOCK, RESIDENT)
    if RESIDENT:
        eq = (keys == prefix) & (keys != 0)
        sel = ((keys > prefix) | (eq & (tl.cumsum(eq.to(tl.int32), 0) <= rem))) & (n_take > 0)
        pos = tl.cumsum(sel.to(tl.int32), 0) - 1
        tl.store(idx_ptr + row * k + pos, offs.to(tl.int64), mask=sel)
    else:
        taken_eq = tl.zeros([], tl.int32)
        out = tl.zeros([], tl.int32)
        for start in range(0, L, BLOCK):
            kb = _load_keys(scores_ptr, row, start + offs, L)
            eq = (kb == prefix) & (kb != 0)
            sel = ((kb > prefix) | (eq & (tl.cumsum(eq.to(tl.int32), 0) + taken_eq <= rem))) & (n_take > 0)
            pos = out + tl.cumsum(sel.to(tl.int32), 0) - 1
            tl.store(idx_ptr + row * k + pos, (start + offs).to(tl.int64), mask=sel)
            taken_eq += tl.sum(eq.to(tl.int32), 0)
            out += tl.sum(sel.to(tl.int32), 0)
    at = tl.arange(0, KP)                              # k <= KP: the output row in one block
    tl.store(idx_ptr + row * k + at, -1, mask=(at >= n_take) & (at < k))     # padding after the winners
    tl.debug_barrier()                                 # this program's index stores are visible to all its threads
    got = at < n_take
    gi = tl.load(idx_ptr + row * k + at, mask=got, other=0)
    v = tl.load(scores_ptr + row * L + gi, mask=got, other=float("-inf"))
    if SORTED:
        # (key, -id) as one int64: key ^ 0x80000000 read as int32 keeps the order, the low word orders ids
        kv = _order_key(v)
        comp = ((kv ^ 0x80000000).to(tl.int32, bitcast=True).to(tl.int64) << 32) | (0xFFFFFFFF - gi)
        comp = tl.sort(tl.where(got, comp, -9223372036854775807), descending=True)
        gi = 0xFFFFFFFF - (comp & 0xFFFFFFFF)
        v = tl.load(scores_ptr + row * L + gi, mask=got, other=float("-inf"))
        tl.debug_barrier()                             # every thread has read the unsorted ids before any store
        tl.store(idx_ptr + row * k + at, gi, mask=got)
    tl.store(val_ptr + row * k + at, v, mask=at < k)


SELECT_BLOCK = 4096      # entries per streamed block; rows up to RESIDENT_MAX stay in registers
RESIDENT_MAX = 16384
SORT_MAX = 4096          # largest k ordered in-kernel (a bitonic sort in registers); larger k: torch.sort after
KMAX = 1 << 16           # the output row is one register block


def topk_select_triton(scores: torch.Tensor, k: int, sorted: bool = True, block: int | None = None,
                       num_warps: int | None = None):
    """Exact top-k of fp32 scores [N, L] (-inf = not selectable) -> (idx int64 [N, k], val fp32 [N, k]), -1 / -inf
    padded; the same selection as the stable-sort twin `_select` (ties: lower id). sorted=False: winners in
    ascending entry order (what a mask needs), one launch. Cost: the row is read once when L <= RESIDENT_MAX
    (34 times, from L2 at decode sizes, when longer) plus k * 12 bytes written; one program per row."""
    check(scores.dim() == 2 and scores.dtype == torch.float32, f"scores must be fp32 [rows, entries], got "
          f"{scores.dtype} {tuple(scores.shape)}")
    check(k >= 1, f"top-k must be >= 1, got {k}")
    N, L = scores.shape
    scores = scores.contiguous()
    idx = empty((N, k), torch.int64, scores.device)
    val = empty((N, k), torch.float32, scores.device)
    if N == 0:
        return idx, val
    resident = L <= RESIDENT_MAX if block is None else L <= block
    block = block or (max(16, triton.next_power_of_2(L)) if resident else SELECT_BLOCK)
    kp = max(16, triton.next_power_of_2(k))
    check(kp <= KMAX, f"top-k of at most {KMAX} entries per row, got {k}")
    check(L < 1 << 21, f"at most {(1 << 21) - 1} entries per row, got {L}")
    in_kernel_sort = sorted and kp <= SORT_MAX
    _topk_select_kernel[(N,)](scores, L, k, idx, val, BLOCK=block, RESIDENT=resident, SORTED=in_kernel_sort,
                              KP=kp, num_warps=num_warps or (16 if block >= 8192 else 8))
    if sorted and not in_kernel_sort:
        val, order = val.sort(dim=1, descending=True, stable=True)
        idx = idx.gather(1, order)
    return idx, val


def indexer_topk_triton(iq, w, keys, key_start, key_len, k, max_len=None, block_g: int = 128,
                        select: str = "kernel"):
    """select: "kernel" (`topk_select_triton`, exact, ties -> lower id) or "topk" (torch.topk: the previous
    path, kept for the benchmark's before/after; its ties are unspecified)."""
    _check(iq, w, keys, key_start, key_len, k)
    N, Hi, Di = iq.shape
    check(Di >= 16 and Di & (Di - 1) == 0, f"index head dim must be a power of two >= 16, got {Di}")
    max_len = int(key_len.max()) if max_len is None else max_len
    scores = indexer_scores_triton(iq, w, keys, key_start, key_len, max_len, block_g)
    if select == "topk":
        kk = min(k, max_len)
        val, idx = scores.topk(kk, dim=1)
        idx = torch.where(val > float("-inf"), idx, torch.full_like(idx, -1))
        pad = k - kk
        return (torch.nn.functional.pad(idx, (0, pad), value=-1),
                torch.nn.functional.pad(val, (0, pad), value=float("-inf")))
    if max_len == 0:
        return _select(scores, k)
    return topk_select_triton(scores, k)


def indexer_topk(iq: torch.Tensor, w: torch.Tensor, index_keys: torch.Tensor, key_start: torch.Tensor,
                 key_len: torch.Tensor, k: int, max_len: int | None = None):
    """Scores and top-k entries per query row (module docstring). max_len: the largest key_len (pass it from the
    host to avoid a device sync)."""
    if use_triton(iq):
        return indexer_topk_triton(iq, w, index_keys, key_start, key_len, k, max_len)
    return indexer_topk_torch(iq, w, index_keys, key_start, key_len, k, max_len)
