"""Lightning-indexer scores and top-k selection of compressed entries (architecture doc section 2.5).

For query row n (one decode/verify token) and each visible compressed entry g of its sequence:
  I[n, g] = sum_h w[n, h] * relu(iq[n, h] . ik[g])
then the k highest-scoring entries (fewer if fewer are visible; the rest -1). Ties: the lower entry id wins (the
doc leaves ties open; the engine's stable `topk_mask` fixes them this way, and relu makes exact-zero ties common).

Shapes: iq [N, Hi, Di], w [N, Hi] (fp32), index_keys [P, Di] (a pool; row n's entries are
index_keys[key_start[n] + g] for g < key_len[n]), k int. Returns (idx int64 [N, k] entry numbers g, -1 padded;
scores fp32 [N, k], -inf padded), best first.
Triton, two launches:
  * the score kernel (grid rows x chunks of blocks_per_program * BLOCK_G entries; per block one
    [Hi, Di] x [Di, BLOCK_G] product, relu and the head-weighted sum in registers; the row's queries loaded once
    per program, the key loads pipelined) writes scores [N, max_len] (fp32: 64 KB a row at 16384 entries,
    L2-resident): 68 us at N=64, L=16384 on an H200 = 94% of copy bandwidth;
  * `topk_select_triton`, exact, the same selection as a stable sort. Its k-th-key searches find two bits per
    counting reduction, starting below the leading bits that the largest and smallest selectable keys share.
    With cap (rows up to RESIDENT_MAX entries, `threshold_cap`): one program per row, a threshold from its group
    maxima keeps a few k candidates, whose exact top-k is taken (`_threshold_select_row`); by default each chunk of a row
    (`default_chunks`) picks its own exact top-k, then one program per row picks the top-k of those chunks * k
    candidates (the row's top-k is among them: an entry beaten by k entries of its own chunk is beaten by k in
    the row). Each chunk search stops at the first exact cut (count(keys >= t) == k: random scores meet one
    several two-bit steps before the last), and unsorted winners are written straight from registers.
    H200 at N=64, L=16384, k=512 (scores in L2): session 5 round 2, chunked 24.8 us unsorted with 4-warp chunk
    programs (8 warps 28.7; round 1, before the direct writes: 26.0 with 8 warps, stage 1 alone 16.9, stage 2
    9.3), threshold 24.7; session 4: chunked 29.3 / 32.0 sorted, threshold 26.4 / 30.3, one program per row
    36-41, torch.topk 77. Both are chains of ~20-30 dependent CTA-wide reductions, latency-bound. Measured and
    removed: the threshold select run by the score kernel's last program of each row (one launch: 157-158 us
    against ~96), the chunk stage folded into the score kernel (99 us against 100), programmatic dependent launch
    between the score kernel and the select launches (35.8 against 28.7 alone, 103.7 against 98.4 after the
    scores: the early-launched programs wait on SMs the producer needs); session 6: four bits per counting
    reduction (15 counts in one reduction: 24.7 -> 42.4 us, the select is instruction-bound), the merge run by
    each row's last chunk program (25.0), and scores + select in one launch (programs take tickets: score pieces
    first, then select chunks that wait for their row's scores, so the selects of early rows overlap the scoring
    of the last: 94.4 us against 93.4 for the two launches; 8 / 2 chunks 105-106), and a shrinking search (6
    reductions over the chunk, then the bucket holding the k-th key compacted to 512 entries and searched alone:
    26.8 against 25.2; behind the scores 95.3 against 92.8); session 7: scores + select in one launch again with
    the tickets interleaved (row s's select chunks queued behind row s + lag's score pieces, the row's last chunk
    merging) 95.4-110 us against 93.4 for the two launches (lag 4-32: 100.2-96.8, 8 chunks 101.5-102.5, 8-block
    pieces 95.4-97.0, 2 stages 108-110, sorted 101.6). Why overlap cannot pay: a select is latency, not work (one
    row alone 18.8 us, 8 rows 21.4, 64 rows 25.0), so at least one row's select stays after the last scores, and
    the chunk programs that run during the scoring take score-program slots (3 per SM by shared memory) for their
    ~10 us each. ncu of one row's select: the chunk stage ~5,700 instructions per warp (4 warps, 32 entries a
    thread, 254 registers) at 3.5 cycles each, mostly fixed-latency dependencies; the merge ~2,340 per warp (8
    warps) at 6.1: ~10.5 + 7.5 us of dependent chains. Score grids measured: 4 blocks a program 67.9 us, 2 blocks
    67.7, 3 blocks (a full last wave) 69.3, 5-8 blocks 69.0-70.7.
The candidate-block restriction of layers 24/28/... is expressed by the caller through key_start/key_len of a
gathered pool, or by -inf scores (not selectable).
Cost: N * max_len * Di * bytes(keys) read once, + N * max_len * 4 written and re-read from L2 by the select,
+ N * (chunks * k or cap) * 12 bytes of candidates (L2).
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
def _score_block(q, w, keys_ptr, start, g, visible, DI: tl.constexpr, F32: tl.constexpr):
    """Scores of entries g (visible ones; -inf elsewhere): sum_h w_h relu(q_h . k_g)."""
    d = tl.arange(0, DI)
    kt = tl.load(keys_ptr + (start + g[None, :]) * DI + d[:, None], mask=visible[None, :], other=0.0)
    if F32:
        s = tl.dot(q.to(tl.float32), kt.to(tl.float32), input_precision="ieee")    # [HP, BLOCK_G]
    else:
        s = tl.dot(q.to(kt.dtype), kt)
    score = tl.sum(tl.maximum(s, 0.0) * w[:, None], 0)
    return tl.where(visible, score, float("-inf"))


@triton.jit
def _indexer_score_kernel(iq_ptr, w_ptr, keys_ptr, start_ptr, len_ptr, out_ptr, max_len, HI,
                          HP: tl.constexpr, DI: tl.constexpr, BLOCK_G: tl.constexpr, F32: tl.constexpr,
                          BPP: tl.constexpr):
    """Program (row, chunk of BPP blocks of BLOCK_G entries): the row's queries are loaded once per program;
    BPP > 1 loops over the blocks (the key loads pipelined by num_stages)."""
    n = tl.program_id(0).to(tl.int64)
    g0 = tl.program_id(1) * (BPP * BLOCK_G)
    n_keys = tl.load(len_ptr + n)
    start = tl.load(start_ptr + n).to(tl.int64)
    h = tl.arange(0, HP)
    if g0 < n_keys:
        q = tl.load(iq_ptr + (n * HI + h[:, None]) * DI + tl.arange(0, DI)[None, :], mask=h[:, None] < HI,
                    other=0.0)
        w = tl.load(w_ptr + n * HI + h, mask=h < HI, other=0.0).to(tl.float32)
        for b in range(0, BPP):
            g = g0 + b * BLOCK_G + tl.arange(0, BLOCK_G)
            score = _score_block(q, w, keys_ptr, start, g, g < n_keys, DI, F32)
            tl.store(out_ptr + n * max_len + g, score, mask=g < max_len)
    else:
        for b in range(0, BPP):
            g = g0 + b * BLOCK_G + tl.arange(0, BLOCK_G)
            tl.store(out_ptr + n * max_len + g, tl.full([BLOCK_G], float("-inf"), tl.float32), mask=g < max_len)


def indexer_scores_triton(iq, w, keys, key_start, key_len, max_len, block_g: int = 128, num_warps: int = 4,
                          blocks_per_program: int = 4, num_stages: int = 3):
    """The score kernel alone: fp32 [N, max_len], -inf where not visible. blocks_per_program > 1: each program
    loops over that many blocks (queries loaded once, key loads pipelined by num_stages). Defaults: the H200
    sweeps (N=64, L=16384: 128-entry blocks, 4 per program, 4 warps, 3 stages 68-70 us = 92-94% of copy
    bandwidth; one block per program with 8 warps, the session-2 form, 74-77 us)."""
    N, Hi, Di = iq.shape
    scores = empty((N, max_len), torch.float32, iq.device)
    if max_len > 0:
        grid = (N, triton.cdiv(max_len, block_g * blocks_per_program))
        _indexer_score_kernel[grid](iq.contiguous(), w.contiguous(), keys.contiguous(),
                                    key_start.to(torch.int64).contiguous(), key_len.to(torch.int64).contiguous(),
                                    scores, max_len, Hi, HP=max(16, triton.next_power_of_2(Hi)), DI=Di,
                                    BLOCK_G=block_g, F32=keys.dtype == torch.float32 or INTERPRETING,
                                    BPP=blocks_per_program, num_warps=num_warps, num_stages=num_stages)
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
def _add_pair(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _count3(scores_ptr, row, L, keys, t1, t2, t3, offs, BLOCK: tl.constexpr, RESIDENT: tl.constexpr):
    """Counts of keys >= t1, >= t2, >= t3 in ONE reduction. Resident (< 2**16 entries): two int32 sums reduced
    together (t1 and t2 counts as 16-bit fields of one word: the fewest instructions per entry); streamed (a row
    of < 2**21 entries, checked by the caller): three 21-bit fields of an int64."""
    if RESIDENT:
        lo = tl.where(keys >= t1, 1, 0) + tl.where(keys >= t2, 65536, 0)
        hi = tl.where(keys >= t3, 1, 0)
        s_lo, s_hi = tl.reduce((lo, hi), 0, _add_pair)
        return s_lo & 0xFFFF, s_lo >> 16, s_hi
    else:
        packed = tl.zeros([], tl.int64)
        for start in range(0, L, BLOCK):
            kb = _load_keys(scores_ptr, row, start + offs, L)
            packed += tl.sum((kb >= t1).to(tl.int64) + ((kb >= t2).to(tl.int64) << 21)
                             + ((kb >= t3).to(tl.int64) << 42), 0)
        return packed & 0x1FFFFF, (packed >> 21) & 0x1FFFFF, packed >> 42


@triton.jit
def _range3(a0, a1, a2, b0, b1, b2):
    return a0 + b0, tl.maximum(a1, b1), tl.minimum(a2, b2)


@triton.jit
def _key_range(base, n, keys, offs, BLOCK: tl.constexpr, RESIDENT: tl.constexpr):
    """(number of selectable keys, their largest, their smallest) in ONE reduction (0 = not selectable)."""
    if RESIDENT:
        cnt, mx, mn = tl.reduce(((keys != 0).to(tl.int32), keys, tl.where(keys != 0, keys, 0xFFFFFFFF)), 0,
                                _range3)
    else:
        cnt = tl.zeros([], tl.int32)
        mx = tl.zeros([], tl.uint32)
        mn = tl.full([], 0xFFFFFFFF, tl.uint32)
        for start in range(0, n, BLOCK):
            kb = _load_keys(base, 0, start + offs, n)
            c1, x1, n1 = tl.reduce(((kb != 0).to(tl.int32), kb, tl.where(kb != 0, kb, 0xFFFFFFFF)), 0, _range3)
            cnt += c1
            mx = tl.maximum(mx, x1)
            mn = tl.minimum(mn, n1)
    return cnt, mx, mn


@triton.jit
def _kth_key(base, n, keys, n_take, mx, mn, offs, BLOCK: tl.constexpr, RESIDENT: tl.constexpr,
             PASSES: tl.constexpr = 16):
    """A cut t for the n_take largest of the n order keys (1 <= n_take <= the selectable keys, which lie in
    [mn, mx]): the n_take-th largest key, or any t above the (n_take+1)-th largest and at most the n_take-th
    (count(keys >= t) == n_take: the same winners; the search stops as soon as it meets one, which random scores
    do several reductions before the last; `exact` (returned second) says it did). Two bits per counting
    reduction: the largest t with count(keys >= t) >= n_take. The leading bits mn and mx share are the answer's
    too, so the search starts below them. PASSES < 16: stop after that many reductions with the bits found so far
    and zeros below: a lower bound of the answer (never above it)."""
    x = mx ^ mn
    b0 = tl.zeros([], tl.int32)
    same = tl.full([], 1, tl.int32)
    for b in tl.static_range(16):
        same = same & (((x >> (30 - 2 * b)) & 3) == 0).to(tl.int32)
        b0 += same
    low = (tl.full([], 1, tl.uint64) << (32 - 2 * b0).to(tl.uint64)) - 1      # the bits still to find
    prefix = (mx.to(tl.uint64) - (mx.to(tl.uint64) & low)).to(tl.uint32)
    b_end = tl.minimum(b0 + PASSES, 16)
    b = b0
    exact = tl.zeros([], tl.int32)
    while b < b_end:
        step = tl.full([], 1, tl.uint32) << (30 - 2 * b)
        t1 = prefix | step
        t2 = prefix | (2 * step)
        t3 = prefix | (3 * step)
        c1, c2, c3 = _count3(base, 0, n, keys, t1, t2, t3, offs, BLOCK, RESIDENT)
        prefix = tl.where(c3 >= n_take, t3, tl.where(c2 >= n_take, t2, tl.where(c1 >= n_take, t1, prefix)))
        exact = ((c1 == n_take) | (c2 == n_take) | (c3 == n_take)).to(tl.int32)
        b = tl.where(exact != 0, b_end, b + 1)                                   # exact cut found: stop
    return prefix, exact


@triton.jit
def _select_chunk(base, n, k, idx_ptr, val_ptr, out, map_base, seg0, BLOCK: tl.constexpr, RESIDENT: tl.constexpr,
                  SORTED: tl.constexpr, KP: tl.constexpr, MAP: tl.constexpr):
    """The exact k best of the n scores at `base` (ties: lower id) -> idx/val slots out .. out + k (-1 / -inf
    padded). The k-th best order key T is found two bits at a time (16 counting reductions: T = the largest t
    with count(keys >= t) >= k; only sum reductions over a register-resident chunk), then one compaction pass in
    entry order takes every key > T and the lowest-id keys == T. RESIDENT (n <= BLOCK): the scores are loaded
    once and stay in registers; otherwise every pass streams them (from L2 at decode sizes). SORTED: the winners
    are re-ordered best first by one in-register sort of (key, -id) (KP = next pow2 of k). Ids written: seg0 +
    the entry's position, or map_base[position] when MAP."""
    offs = tl.arange(0, BLOCK)
    keys = tl.zeros([BLOCK], tl.uint32)
    if RESIDENT:
        keys = _load_keys(base, 0, offs, n)
    n_sel, mx, mn = _key_range(base, n, keys, offs, BLOCK, RESIDENT)
    n_take = tl.minimum(n_sel, k)
    prefix, exact = _kth_key(base, n, keys, tl.maximum(n_take, 1), mx, mn, offs, BLOCK, RESIDENT)
    # prefix = the n_take-th largest key (or an exact cut: then every key >= it wins); take every key above it and
    # the `rem` lowest-id keys equal to it
    rem = n_take
    if exact == 0:
        rem = n_take - _count_at_least(base, 0, n, keys, prefix + 1, offs, BLOCK, RESIDENT)
    at = tl.arange(0, KP)                              # k <= KP: the output row in one block
    if RESIDENT:
        # one scan for both running counts (keys above the cut in the low 16 bits, keys equal to it above: a
        # resident block has < 2**16 entries); the first `rem` equal keys are taken
        gt = keys > prefix
        eq = (keys == prefix) & (keys != 0)
        cs = tl.cumsum(gt.to(tl.int32) + (eq.to(tl.int32) << 16), 0)
        sel = (gt | (eq & ((cs >> 16) <= rem))) & (n_take > 0)
        pos = (cs & 0xFFFF) + tl.minimum(cs >> 16, rem) - 1
        if not SORTED:
            # winners in entry order: written straight from registers (no store / barrier / reload round trip)
            if MAP:
                ids = tl.load(map_base + offs, mask=sel, other=-1)
            else:
                ids = seg0 + offs.to(tl.int64)
            tl.store(idx_ptr + out + pos, ids, mask=sel)
            tl.store(val_ptr + out + pos, tl.load(base + offs, mask=sel, other=float("-inf")), mask=sel)
            tl.store(idx_ptr + out + at, -1, mask=(at >= n_take) & (at < k))
            tl.store(val_ptr + out + at, float("-inf"), mask=(at >= n_take) & (at < k))
            return
        tl.store(idx_ptr + out + pos, offs.to(tl.int64), mask=sel)
    else:
        taken_eq = tl.zeros([], tl.int32)
        cnt = tl.zeros([], tl.int32)
        for start in range(0, n, BLOCK):
            kb = _load_keys(base, 0, start + offs, n)
            eq = (kb == prefix) & (kb != 0)
            sel = ((kb > prefix) | (eq & (tl.cumsum(eq.to(tl.int32), 0) + taken_eq <= rem))) & (n_take > 0)
            pos = cnt + tl.cumsum(sel.to(tl.int32), 0) - 1
            tl.store(idx_ptr + out + pos, (start + offs).to(tl.int64), mask=sel)
            taken_eq += tl.sum(eq.to(tl.int32), 0)
            cnt += tl.sum(sel.to(tl.int32), 0)
    tl.store(idx_ptr + out + at, -1, mask=(at >= n_take) & (at < k))     # padding after the winners
    tl.debug_barrier()                                 # this program's index stores are visible to all its threads
    got = at < n_take
    gi = tl.load(idx_ptr + out + at, mask=got, other=0)                 # positions in this chunk
    v = tl.load(base + gi, mask=got, other=float("-inf"))
    if SORTED:
        # (key, -id) as one int64: key ^ 0x80000000 read as int32 keeps the order, the low word orders ids
        kv = _order_key(v)
        comp = ((kv ^ 0x80000000).to(tl.int32, bitcast=True).to(tl.int64) << 32) | (0xFFFFFFFF - gi)
        comp = tl.sort(tl.where(got, comp, -9223372036854775807), descending=True)
        gi = 0xFFFFFFFF - (comp & 0xFFFFFFFF)
        v = tl.load(base + gi, mask=got, other=float("-inf"))
    if MAP:
        ids = tl.load(map_base + gi, mask=got, other=-1)
    else:
        ids = seg0 + gi
    tl.debug_barrier()                                 # every thread has read the unsorted ids before any store
    tl.store(idx_ptr + out + at, ids, mask=got)
    tl.store(val_ptr + out + at, v, mask=at < k)


@triton.jit
def _topk_select_kernel(scores_ptr, L, CL, k, idx_ptr, val_ptr, map_ptr, BLOCK: tl.constexpr,
                        RESIDENT: tl.constexpr, SORTED: tl.constexpr, KP: tl.constexpr, MAP: tl.constexpr):
    """Program (row, chunk): `_select_chunk` over entries [c * CL, c * CL + CL) of row `row` of scores [N, L],
    written to output slots (row * chunks + c) * k... With MAP (the second stage of the chunked select) the row
    holds the first stage's candidates, whose positions increase with the original ids (so position ties are id
    ties), and map [N, L] their ids."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    seg0 = c * CL
    _select_chunk(scores_ptr + row * L + seg0, tl.minimum(CL, L - seg0), k, idx_ptr, val_ptr,
                  (row * tl.num_programs(1) + c) * k, map_ptr + row * L + seg0, seg0, BLOCK, RESIDENT, SORTED, KP,
                  MAP)


@triton.jit
def _threshold_select_row(base, row, L, k, cand_val_ptr, cand_idx_ptr, idx_ptr, val_ptr, NGB: tl.constexpr,
                          GS: tl.constexpr, CB: tl.constexpr, FB: tl.constexpr, CAP: tl.constexpr,
                          SORTED: tl.constexpr, KP: tl.constexpr):
    """The exact top-k of one row's L scores at `base` -> idx/val row `row`. T = the k-th largest of the row's
    group maxima (NGB groups of GS entries, held in registers) is at most the row's k-th largest score (the k best
    groups' maxima are k entries >= T), so every winner scores >= T; those candidates (a few k at random scores)
    are compacted in entry order into cand (L2), CB entries at a time, and the exact select runs over them alone
    (ids mapped back: ties stay lower-id first). More than CAP candidates (many equal scores): the exact select
    streams the whole row instead, FB entries at a time."""
    goffs = tl.arange(0, NGB)
    g = goffs[:, None] * GS + tl.arange(0, GS)[None, :]
    gmax = tl.max(tl.load(base + g, mask=g < L, other=float("-inf")), 1)
    gkeys = tl.where(gmax > float("-inf"), _order_key(gmax), 0)
    t = tl.full([], 1, tl.uint32)                  # fewer than k groups hold a selectable entry: take them all
    n_groups, mx, mn = _key_range(base, 0, gkeys, goffs, NGB, True)
    if n_groups >= k:
        # 6 reductions below the maxima's common leading bits: a lower bound of their k-th largest, close enough
        # (12 more bits) that few extra candidates pass, for 10 reductions less
        t = tl.maximum(_kth_key(base, 0, gkeys, k, mx, mn, goffs, NGB, True, 6)[0], 1)
    c0 = row * CAP
    offs = tl.arange(0, CB)
    cnt = tl.zeros([], tl.int32)
    for start in tl.static_range(0, NGB * GS, CB):     # unrolled: the blocks' loads are in flight together
        x = tl.load(base + start + offs, mask=start + offs < L, other=float("-inf"))         # L1 hits
        sel = (x > float("-inf")) & (_order_key(x) >= t)
        pos = cnt + tl.cumsum(sel.to(tl.int32), 0) - 1
        tl.store(cand_val_ptr + c0 + pos, x, mask=sel & (pos < CAP))
        tl.store(cand_idx_ptr + c0 + pos, (start + offs).to(tl.int64), mask=sel & (pos < CAP))
        cnt += tl.sum(sel.to(tl.int32), 0)
    tl.debug_barrier()                             # the candidates are visible to every thread of the program
    if cnt <= CAP:
        _select_chunk(cand_val_ptr + c0, cnt, k, idx_ptr, val_ptr, row * k, cand_idx_ptr + c0, 0, CAP, True,
                      SORTED, KP, True)
    else:
        _select_chunk(base, L, k, idx_ptr, val_ptr, row * k, base, 0, FB, False, SORTED, KP, False)


@triton.jit
def _threshold_select_kernel(scores_ptr, L, k, cand_val_ptr, cand_idx_ptr, idx_ptr, val_ptr, NGB: tl.constexpr,
                             GS: tl.constexpr, CB: tl.constexpr, FB: tl.constexpr, CAP: tl.constexpr,
                             SORTED: tl.constexpr, KP: tl.constexpr):
    """Program per row: `_threshold_select_row`."""
    row = tl.program_id(0).to(tl.int64)
    _threshold_select_row(scores_ptr + row * L, row, L, k, cand_val_ptr, cand_idx_ptr, idx_ptr, val_ptr, NGB, GS, CB,
                          FB, CAP, SORTED, KP)


SELECT_BLOCK = 4096      # entries per streamed block; rows up to RESIDENT_MAX stay in registers
RESIDENT_MAX = 16384     # < 2**16: `_count3`'s 16-bit fields
SORT_MAX = 4096          # largest k ordered in-kernel (a bitonic sort in registers); larger k: torch.sort after
KMAX = 1 << 16           # the output row is one register block


def _select_launch(scores, k, chunks, sorted, block, num_warps, id_map=None):
    """One launch of `_topk_select_kernel` over [N, L] scores in `chunks` chunks per row -> (idx, val) [N, chunks
    * k] (each chunk's k slots; ids from id_map when given)."""
    N, L = scores.shape
    cl = triton.cdiv(L, chunks)
    idx = empty((N, chunks * k), torch.int64, scores.device)
    val = empty((N, chunks * k), torch.float32, scores.device)
    resident = cl <= RESIDENT_MAX if block is None else cl <= block
    block = block or (max(16, triton.next_power_of_2(cl)) if resident else SELECT_BLOCK)
    kp = max(16, triton.next_power_of_2(k))
    in_kernel_sort = sorted and kp <= SORT_MAX
    _topk_select_kernel[(N, chunks)](scores, L, cl, k, idx, val, scores if id_map is None else id_map,
                                     BLOCK=block, RESIDENT=resident, SORTED=in_kernel_sort, KP=kp,
                                     MAP=id_map is not None,
                                     num_warps=num_warps or (16 if block >= 8192 else 8 if block >= 2048 else 4))
    return _sort_after(idx, val, sorted, in_kernel_sort)


def default_chunks(L: int, k: int) -> int:
    """Chunks per row for the first select stage: rows much longer than k are split so that many programs share
    the row (H200, N=64, L=16384, k=512: 4 chunks 27.5 us, 8 chunks 31-32, 2 chunks 29-34, one program per row
    36-41)."""
    return max(1, min(16, L // (8 * k)))


GROUP = 16               # entries per group maximum in the threshold select



def _sort_after(idx, val, sorted, in_kernel_sort):
    """Best-first order by torch when the kernel could not sort in registers (k > SORT_MAX)."""
    if sorted and not in_kernel_sort:
        val, order = val.sort(dim=1, descending=True, stable=True)
        idx = idx.gather(1, order)
    return idx, val


def _threshold_launch(scores, k, sorted, cap, num_warps):
    """One launch of `_threshold_select_kernel` (rows of at most RESIDENT_MAX entries) -> (idx, val) [N, k]."""
    N, L = scores.shape
    ngb = max(16, triton.next_power_of_2(triton.cdiv(L, GROUP)))
    cap = max(16, triton.next_power_of_2(cap))
    cand_val = empty((N, cap), torch.float32, scores.device)
    cand_idx = empty((N, cap), torch.int64, scores.device)
    idx = empty((N, k), torch.int64, scores.device)
    val = empty((N, k), torch.float32, scores.device)
    kp = max(16, triton.next_power_of_2(k))
    in_kernel_sort = sorted and kp <= SORT_MAX
    _threshold_select_kernel[(N,)](scores, L, k, cand_val, cand_idx, idx, val, NGB=ngb, GS=GROUP,
                                   CB=min(SELECT_BLOCK, ngb * GROUP), FB=min(SELECT_BLOCK, ngb * GROUP), CAP=cap,
                                   SORTED=in_kernel_sort, KP=kp,
                                   num_warps=num_warps or (8 if cap >= 1024 else 4))
    return _sort_after(idx, val, sorted, in_kernel_sort)


def threshold_cap(L: int, k: int) -> int | None:
    """Candidates per row for the threshold select (4k rounded up: random scores leave about 1.4k), or None where
    the chunked select is used instead: rows shorter than twice that (the filter would not pay) or longer than
    RESIDENT_MAX."""
    cap = max(16, triton.next_power_of_2(4 * k))
    return cap if 2 * cap <= L <= RESIDENT_MAX else None


def topk_select_triton(scores: torch.Tensor, k: int, sorted: bool = True, block: int | None = None,
                       num_warps: int | None = None, chunks: int | None = None, num_warps2: int | None = None,
                       cap: int | None = None):
    """Exact top-k of fp32 scores [N, L] (-inf = not selectable) -> (idx int64 [N, k], val fp32 [N, k]), -1 / -inf
    padded; the same selection as the stable-sort twin `_select` (ties: lower id). sorted=False: winners in
    ascending entry order (what a mask needs). chunks > 1 (default `default_chunks`): two launches, each chunk's
    exact top-k by its own program, then the top-k of those chunks * k candidates per row (they contain the row's
    top-k: an entry beaten by k entries of its own chunk is beaten by k in the row). Cost: the row read once
    (L2 at decode sizes) + chunks * k * 12 bytes of candidates written and read back, plus k * 12 written.
    cap (`threshold_cap` gives one): the one-launch threshold select (`_threshold_select_kernel`) keeping at most
    cap candidates per row; not the default: 26.6 / 30.5 us alone vs 29.3 chunked, but behind the score kernel
    104.0 / 115.9 us against the chunked path's 98.2 / 100.1 (H200, session 4 round 3; cause not found)."""
    check(scores.dim() == 2 and scores.dtype == torch.float32, f"scores must be fp32 [rows, entries], got "
          f"{scores.dtype} {tuple(scores.shape)}")
    check(k >= 1, f"top-k must be >= 1, got {k}")
    N, L = scores.shape
    check(max(16, triton.next_power_of_2(k)) <= KMAX, f"top-k of at most {KMAX} entries per row, got {k}")
    check(L < 1 << 21, f"at most {(1 << 21) - 1} entries per row, got {L}")
    scores = scores.contiguous()
    if N == 0:
        return empty((N, k), torch.int64, scores.device), empty((N, k), torch.float32, scores.device)
    if cap is not None:
        check(L <= RESIDENT_MAX, f"the threshold select holds a row in registers: at most {RESIDENT_MAX} entries, "
              f"got {L}")
        return _threshold_launch(scores, k, sorted, cap, num_warps)
    chunks = default_chunks(L, k) if chunks is None else max(1, min(chunks, triton.cdiv(L, k)))
    if chunks == 1:
        return _select_launch(scores, k, 1, sorted, block, num_warps)
    # first stage: 4 warps per chunk program (H200, N=64, L=16384, k=512, scores in L2: 24.8 us for both stages
    # against 28.7 with 8 warps; before the direct winner writes 8 warps were faster, 26.0 vs 27.2)
    cand_idx, cand_val = _select_launch(scores, k, chunks, False, block, num_warps or 4)
    return _select_launch(cand_val, k, 1, sorted, None, num_warps2, id_map=cand_idx)


def indexer_topk_triton(iq, w, keys, key_start, key_len, k, max_len=None, block_g: int = 128,
                        select: str = "kernel"):
    """select: "kernel" (scores, then `topk_select_triton`: exact, ties -> lower id) or "topk" (torch.topk: the
    session-1 path, kept for the benchmark's before/after; its ties are unspecified)."""
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
