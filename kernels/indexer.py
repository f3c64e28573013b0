"""Lightning-indexer scores and top-k selection of compressed entries (architecture doc section 2.5).

For query row n (one decode/verify token) and each visible compressed entry g of its sequence:
  I[n, g] = sum_h w[n, h] * relu(iq[n, h] . ik[g])
then the k highest-scoring entries (fewer if fewer are visible; the rest -1). Ties: the lower entry id wins (the
doc leaves ties open; the engine's stable `topk_mask` fixes them this way, and relu makes exact-zero ties common).

Shapes: iq [N, Hi, Di], w [N, Hi] (any float dtype, read at its row stride, times w_scale), index_keys [P, Di] (a pool; row n's entries are
index_keys[key_start[n] + g] for g < key_len[n]), k int. Returns (idx int64 [N, k] entry numbers g, -1 padded;
scores fp32 [N, k], -inf padded), best first.
Triton, two launches:
  * the score kernel (grid rows x chunks of blocks_per_program * BLOCK_G entries; per block one
    [Hi, Di] x [Di, BLOCK_G] product, relu and the head-weighted sum in registers; the row's queries loaded once
    per program, the key loads pipelined) writes scores [N, max_len] (fp32: 64 KB a row at 16384 entries,
    L2-resident): 68 us at N=64, L=16384 on an H200 = 94% of copy bandwidth;
  * `topk_select_triton`, exact, the same selection as a stable sort: each chunk of a row (`default_chunks`:
    2 chunks of 8 warps at L=16384, k=512) picks its own exact top-k, then one program per row picks the top-k of
    those chunks * k candidates (the row's top-k is among them: an entry beaten by k entries of its own chunk is
    beaten by k in the row), in the same launch for unsorted output (each row's last chunk program to take its
    ticket merges; for at most TREE_ROWS rows of at least TREE_CHUNKS chunks through a tree: the last of each group
    of 4 merges the group, the last group the row; other rows of more than 4 chunks take a second launch); unsorted
    winners are written straight from registers. Each pick finds its cut by an interpolation search (`_cut_key`):
    three counting thresholds per CTA-wide reduction, the first from a normal fit of the scores, then at the
    interpolated key of rank k in the
    bracket, and a top-4 reduction once at most 4 ranks are left above the bracket's upper end or at most 3 above
    its lower end (then of the smallest keys): ~3-4 dependent reductions on random scores (the slowest of 256 chunks
    ~6), against ~10 (12-15) for the two-bit radix search of sessions 3-7 (the search replayed in float64 on the
    score kernel's rows, L=16384, k=512: the slowest chunk's reductions plus the merge's, 4 chunks 7.1, with the
    lower-end end game 6.6; 2 chunks 7.0 / 6.7).
    Session 9 (H200, N=64, L=16384, k=512, R1-R2): 2 chunks of 8 warps 17.9-18.3 us alone against 18.5-18.7
    for 4 of 4 warps, on the score kernel's rows 19.5 against 20.4, behind the scores 88.2 against 89.4-90.9;
    one row alone 13.3-13.6 (its chunk stage alone 8.0-8.8, the merge alone 5.5-6.2). Longer rows (R2, the tree
    against one flat merge of 16 chunks' 8192 candidates, which spilled): N=8, L=131072 select alone 33.1 us,
    scores + select 123.5 against 162.6 (51%); N=64, L=65536 323.1 against 348.7 (78%); N=64, L=131072 629.4
    (80%); N=8, L=65536 74.4 (42%; scores alone 36.9): at 8 rows the select's latency (~30 us: a chunk, a group
    merge, a final merge of 4096) is what is left. Measured and removed (session 9 R1): scores and select in one
    launch of the score kernel (the last score program of each 4096-entry chunk selects it, the row's last chunk
    merges): 95.2 us against 90.3 for the two launches (212 registers: 2 score programs per SM instead of 3);
    capped at 168 registers 91.3; the chunk's last piece in launch order selecting once the others counted in
    (no reply awaited by the others) 93.4, capped 90.1; rows together 93.1; 2048-entry chunks 98.1; sorted 99.5;
    a running top-k per row (each chunk keeps only its entries above the running k-th and merges) 110.4-126.6;
    at N=8, L=131072 the one launch 150.0 against 162.6 (before the tree), at N=64, L=131072 706.9 against 656.7.
    Session 8 round 1: select alone (scores
    in L2) 19.2 us unsorted / 21.8 sorted against 25.1 / 27.7 for the two-bit search; one row alone 12.5 (two-bit
    19.0), 8 rows 15.6 (21.1); behind the score kernel 91.1 unsorted / 93.8 sorted (69% / 67%) against 94.2 /
    96.8. The same search without the top-4 end game: 25.1 (the slowest chunks' last passes are the latency).
    Measured and removed: one program per row finding a threshold from its 16-entry group maxima and selecting
    among the candidates above it (24.7-24.8 us alone, 95.5-96.8 behind the scores, session 7-8), the threshold
    select run by the score kernel's last program of each row (one launch: 157-158 us against ~96), the chunk
    stage folded into the score kernel (99 us against 100), programmatic dependent launch between the score
    kernel and the select launches (35.8 against 28.7 alone, 103.7 against 98.4 after the scores: the
    early-launched programs wait on SMs the producer needs); session 6: four bits per counting reduction (15
    counts in one reduction: 24.7 -> 42.4 us, the select is instruction-bound), the merge run by each row's last
    chunk program (25.0), and scores + select in one launch (programs take tickets: score pieces first, then
    select chunks that wait for their row's scores, so the selects of early rows overlap the scoring of the last:
    94.4 us against 93.4 for the two launches; 8 / 2 chunks 105-106), and a shrinking search (6 reductions over
    the chunk, then the bucket holding the k-th key compacted to 512 entries and searched alone: 26.8 against
    25.2; behind the scores 95.3 against 92.8); session 7: scores + select in one launch again with the tickets
    interleaved (row s's select chunks queued behind row s + lag's score pieces, the row's last chunk merging)
    95.4-110 us against 93.4 for the two launches (lag 4-32: 100.2-96.8, 8 chunks 101.5-102.5, 8-block pieces
    95.4-97.0, 2 stages 108-110, sorted 101.6). Why overlap cannot pay: a select is latency, not work, so at
    least one row's select stays after the last scores, and the chunk programs that run during the scoring take
    score-program slots (3 per SM by shared memory). ncu of one row's two-bit select (session 7): the chunk stage
    ~5,700 instructions per warp (4 warps, 32 entries a thread) at 3.5 cycles each, mostly fixed-latency
    dependencies; the merge ~2,340 per warp (8 warps) at 6.1. Score grids measured: 4 blocks a program 67.9 us,
    2 blocks 67.7, 3 blocks (a full last wave) 69.3, 5-8 blocks 69.0-70.7.
Programmatic dependent launch (session 12): both kernels wait before their first load (every input is written
earlier in the step); the select lets the next kernel launch once its chunk is selected, the score kernel never
triggers (a long row's grid is many waves), so unlike session 5's form (removed above) no select program takes an
SM while scores remain to be computed. H200 (R2, back to back, PDL off -> on, us): scores N=64 / 256, L=1024 5.3 ->
5.1 / 22.2 -> 22.0, select 6.3 -> 6.1 / 7.6 -> 7.3; the select layer's chain in benchmarks/kernels_attention.py.
The engine's form (session 13, `indexer_scores_triton`'s keywords): the score kernel reads the head weights as
weights_proj gives them (bf16, a column slice of the stacked product) and scales them (Hi^-0.5 Di^-0.5), rotates the
queries' RoPE channels itself (kernels/rope.py's products), and scores only the entries each row's position sees
(and its candidates), -inf elsewhere: the torch multiply, the rope launch and kernels/index_rows.py's visible
launch before it are gone, and with the attention kernel making the selected entries' pool rows in its gather the
select layer is three launches (scores, select, attention) instead of seven. H200, the chain back to back against
session 12's files in the same run (mid-size: 32 index heads of 128, 32 attention heads of 512, 128 window keys,
k = 512; us): R3 N=64 / 256, G=64 (the mid-size step's shape) 31.8 / 59.6 -> 22.9 / 46.7, N=64 G=1024 57.6 ->
46.5-46.6, G=16384 133.7 -> 132.6 (24% -> 30% / 55% of the bytes); R1 N=8 G=64 26.1-26.2 -> 23.8-23.9 (with the
attention's first entries form, which spilled: kernels/decode_attention.py).
The candidate-block restriction of layers 24/28/... is expressed by the caller through `cand` (a [N, max_len] mask
of the entries each row may score), key_start/key_len of a gathered pool, or -inf scores (not selectable).
Cost: N * max_len * Di * bytes(keys) read once, + N * max_len * 4 written and re-read from L2 by the select,
+ N * chunks * k * 12 bytes of candidates (L2).
"""
import torch
import triton
import triton.language as tl

from .backend import empty, INTERPRETING, check, pdl_kw, pdl_trigger, pdl_wait, tickets, use_triton
from .index_rows import visible_scores_torch
from .rope import apply_rope_torch, turned


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
def indexer_scores_torch(iq, w, keys, key_start, key_len, max_len, w_scale=1.0, turn=None, positions=None, ratio=1,
                         cand=None):
    """The twin of `indexer_scores_triton` (its keywords: the head weights times w_scale, the queries rotated by
    turn first, only the entries visible to each row's position and in cand scored)."""
    if turn is not None:
        iq = apply_rope_torch(iq, turn)
    g = torch.arange(max_len, device=iq.device)
    rows = (key_start[:, None] + g[None, :]).clamp(0, max(keys.shape[0] - 1, 0))
    k = keys[rows].float()                                              # [N, L, Di]
    s = torch.relu(torch.einsum("nhd,nld->nhl", iq.float(), k))
    scores = torch.einsum("nh,nhl->nl", w.float() * w_scale, s)
    if positions is not None:        # (its mask bounds the entries by key_len too)
        return visible_scores_torch(scores, positions, key_len, ratio, cand)[1]
    return scores.masked_fill(g[None, :] >= key_len[:, None], float("-inf"))


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
def _queries(iq_ptr, n, HI, turn_ptr, turn_stride, HP: tl.constexpr, DI: tl.constexpr, ROT: tl.constexpr):
    """Row n's queries [HP, DI] in iq's dtype; ROT > 0: their last ROT channels (interleaved pairs) turned by the
    row's rotation first, in fp32 and rounded back (kernels/rope.py's `turned`)."""
    h = tl.arange(0, HP)[:, None]
    d = tl.arange(0, DI)[None, :]
    at = iq_ptr + (n * HI + h) * DI
    q = tl.load(at + d, mask=h < HI, other=0.0)
    if ROT > 0:
        q = turned(q, at, d, h < HI, turn_ptr + n * turn_stride, DI, ROT).to(q.dtype)
    return q


@triton.jit
def _indexer_score_kernel(iq_ptr, w_ptr, keys_ptr, start_ptr, len_ptr, out_ptr, max_len, HI, w_stride, w_scale,
                          turn_ptr, turn_stride, pos_ptr, ratio, cand_ptr, cand_stride,
                          HP: tl.constexpr, DI: tl.constexpr, BLOCK_G: tl.constexpr, F32: tl.constexpr,
                          BPP: tl.constexpr, ROT: tl.constexpr = 0, VIS: tl.constexpr = False,
                          HAS_CAND: tl.constexpr = False, PDL: tl.constexpr = False):
    """Program (row, chunk of BPP blocks of BLOCK_G entries): the row's queries are loaded once per program;
    BPP > 1 loops over the blocks (the key loads pipelined by num_stages). The head weights are read at a row
    stride and scaled here (w_scale), the queries rotated here (ROT), and with VIS only the entries the row's
    position sees (g < (p + 1) // ratio, and cand) are scored (their keys alone read), the others -inf: what the
    engine's select reads, without the launches that made each of those inputs. PDL: its every input is written
    earlier in the step (queries, head weights, the index keys, the rows' starts, lengths and positions, the
    candidates), so it waits first. No early trigger: a long row's grid is many waves, and a trigger in the block
    loop is a branch in the pipelined loop."""
    n = tl.program_id(0).to(tl.int64)
    g0 = tl.program_id(1) * (BPP * BLOCK_G)
    pdl_wait(PDL)
    n_keys = tl.load(len_ptr + n)
    if VIS:
        n_keys = tl.minimum(n_keys, (tl.load(pos_ptr + n) + 1) // ratio)
    start = tl.load(start_ptr + n).to(tl.int64)
    h = tl.arange(0, HP)
    if g0 < n_keys:
        q = _queries(iq_ptr, n, HI, turn_ptr, turn_stride, HP, DI, ROT)
        w = tl.load(w_ptr + n * w_stride + h, mask=h < HI, other=0.0).to(tl.float32) * w_scale
        for b in range(0, BPP):
            g = g0 + b * BLOCK_G + tl.arange(0, BLOCK_G)
            ok = g < n_keys
            if HAS_CAND:
                ok = ok & (tl.load(cand_ptr + n * cand_stride + g, mask=ok & (g < max_len), other=0) != 0)
            score = _score_block(q, w, keys_ptr, start, g, ok, DI, F32)
            tl.store(out_ptr + n * max_len + g, score, mask=g < max_len)
    else:
        for b in range(0, BPP):
            g = g0 + b * BLOCK_G + tl.arange(0, BLOCK_G)
            tl.store(out_ptr + n * max_len + g, tl.full([BLOCK_G], float("-inf"), tl.float32), mask=g < max_len)


def indexer_scores_triton(iq, w, keys, key_start, key_len, max_len, block_g: int = 128, num_warps: int = 4,
                          blocks_per_program: int = 4, num_stages: int = 3, *, w_scale: float = 1.0,
                          turn: torch.Tensor | None = None, positions: torch.Tensor | None = None, ratio: int = 1,
                          cand: torch.Tensor | None = None):
    """The score kernel alone: fp32 [N, max_len], -inf where not visible. blocks_per_program > 1: each program
    loops over that many blocks (queries loaded once, key loads pipelined by num_stages). Defaults: the H200
    sweeps (N=64, L=16384: 128-entry blocks, 4 per program, 4 warps, 3 stages 68-70 us = 92-94% of copy
    bandwidth; one block per program with 8 warps, the session-2 form, 74-77 us).
    The engine's form (each a launch less): w any float dtype at any row stride (a column slice of a product),
    times w_scale in fp32; turn fp32 [N, R/2, 2] (kernels/rope.py's table): the queries' last R channels rotated
    first; positions [N] (with ratio, and cand bool [N, max_len]): only the entries g < (p + 1) // ratio (and in
    cand) scored, the others -inf (kernels/index_rows.py's `visible_scores` masked scores)."""
    N, Hi, Di = iq.shape
    check(w.shape == (N, Hi), f"index head weights must be [{N}, {Hi}], got {tuple(w.shape)}")
    check(turn is None or (turn.dim() == 3 and turn.shape[0] == N and turn.shape[2] == 2 and 2 * turn.shape[1] <= Di
                           and turn.dtype == torch.float32 and turn.stride(1) == 2 and turn.stride(2) == 1),
          f"index scores: turn {None if turn is None else (turn.dtype, tuple(turn.shape), turn.stride())} for "
          f"queries {tuple(iq.shape)} (want fp32 [{N}, R/2, 2], R <= {Di}, pairs adjacent)")
    check((cand is None or positions is not None) and (positions is None or positions.shape == (N,)),
          f"index scores: positions {None if positions is None else tuple(positions.shape)} for {N} rows "
          f"(candidates only with positions)")
    check(cand is None or (cand.shape == (N, max_len) and cand.dtype == torch.bool and cand.stride(1) == 1),
          f"index scores: candidate mask {None if cand is None else (cand.dtype, tuple(cand.shape))} for "
          f"[{N}, {max_len}]")
    scores = empty((N, max_len), torch.float32, iq.device)
    if max_len > 0:
        w = w if w.stride(1) == 1 else w.contiguous()
        key_len = key_len.to(torch.int64).contiguous()
        grid = (N, triton.cdiv(max_len, block_g * blocks_per_program))
        _indexer_score_kernel[grid](iq.contiguous(), w, keys.contiguous(), key_start.to(torch.int64).contiguous(),
                                    key_len, scores, max_len, Hi, w.stride(0), float(w_scale),
                                    scores if turn is None else turn, 0 if turn is None else turn.stride(0),
                                    key_len if positions is None else positions, ratio,
                                    scores if cand is None else cand, 0 if cand is None else cand.stride(0),
                                    HP=max(16, triton.next_power_of_2(Hi)), DI=Di,
                                    BLOCK_G=block_g, F32=keys.dtype == torch.float32 or INTERPRETING,
                                    BPP=blocks_per_program, ROT=0 if turn is None else 2 * turn.shape[1],
                                    VIS=positions is not None, HAS_CAND=cand is not None, num_warps=num_warps,
                                    num_stages=num_stages, **pdl_kw())
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
def _stats5(a0, a1, a2, a3, a4, b0, b1, b2, b3, b4):
    return a0 + b0, tl.maximum(a1, b1), tl.minimum(a2, b2), a3 + b3, a4 + b4


@triton.jit
def _key_stats(base, n, keys, offs, BLOCK: tl.constexpr, RESIDENT: tl.constexpr):
    """(number of selectable keys, their largest, their smallest, sum and sum of squares of their scores) in ONE
    reduction (0 = not selectable). The scores are decoded back from the keys (no second register copy)."""
    if RESIDENT:
        sel = keys != 0
        x = tl.where(sel, _order_value(keys), 0.0)
        cnt, mx, mn, sx, sxx = tl.reduce((sel.to(tl.int32), keys, tl.where(sel, keys, 0xFFFFFFFF), x, x * x), 0,
                                         _stats5)
    else:
        cnt = tl.zeros([], tl.int32)
        mx = tl.zeros([], tl.uint32)
        mn = tl.full([], 0xFFFFFFFF, tl.uint32)
        sx = tl.zeros([], tl.float32)
        sxx = tl.zeros([], tl.float32)
        for start in range(0, n, BLOCK):
            kb = _load_keys(base, 0, start + offs, n)
            sel = kb != 0
            x = tl.where(sel, _order_value(kb), 0.0)
            c1, x1, n1, s1, s2 = tl.reduce((sel.to(tl.int32), kb, tl.where(sel, kb, 0xFFFFFFFF), x, x * x), 0,
                                           _stats5)
            cnt += c1
            mx = tl.maximum(mx, x1)
            mn = tl.minimum(mn, n1)
            sx += s1
            sxx += s2
    return cnt, mx, mn, sx, sxx


@triton.jit
def _order_value(key):
    """The inverse of `_order_key` (for selectable keys): the score whose order key this is."""
    bits = tl.where((key & 0x80000000) != 0, key ^ 0x80000000, key ^ 0xFFFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _upper_normal_quantile(p):
    """z with P(Z >= z) = p for a standard normal Z (Abramowitz-Stegun 26.2.23, |error| < 4.5e-4): only a first
    guess of the search below, never a result."""
    pp = tl.minimum(p, 1.0 - p)
    t = tl.sqrt(-2.0 * tl.log(tl.maximum(pp, 1e-30)))
    z = t - (2.515517 + t * (0.802853 + t * 0.010328)) / (1.0 + t * (1.432788 + t * (0.189269 + t * 0.001308)))
    return tl.where(p <= 0.5, z, -z)


@triton.jit
def _guess_key(mean, sd, p, lo, hi):
    """The order key of mean + sd * (upper p-quantile), clamped strictly inside (lo, hi) (int64)."""
    x = mean + sd * _upper_normal_quantile(p)
    t = _order_key(x).to(tl.int64)
    return tl.minimum(tl.maximum(t, lo + 1), hi - 1)


@triton.jit
def _top4(a0, a1, a2, a3, b0, b1, b2, b3):
    """The 4 largest of two descending 4-lists, descending: max(a_i, b_3-i) is bitonic and holds them; two
    half-cleaner stages sort it (in-thread, where b = (x, 0, 0, 0), most of it folds away)."""
    d0 = tl.maximum(a0, b3)
    d1 = tl.maximum(a1, b2)
    d2 = tl.maximum(a2, b1)
    d3 = tl.maximum(a3, b0)
    e0 = tl.maximum(d0, d2)
    e2 = tl.minimum(d0, d2)
    e1 = tl.maximum(d1, d3)
    e3 = tl.minimum(d1, d3)
    return tl.maximum(e0, e1), tl.minimum(e0, e1), tl.maximum(e2, e3), tl.minimum(e2, e3)


@triton.jit
def _top4_between(base, n, keys, lo, top, flip, offs, BLOCK: tl.constexpr, RESIDENT: tl.constexpr):
    """The 4 largest order keys in [lo, top] (lo >= 1), descending, 0 where there are fewer, in ONE reduction;
    flip: of top + 1 - key instead (>= 1), i.e. the 4 smallest keys."""
    if RESIDENT:
        v = tl.where((keys >= lo) & (keys <= top), tl.where(flip, top + 1 - keys, keys), 0)
        z = tl.zeros_like(v)
        a0, a1, a2, a3 = tl.reduce((v, z, z, z), 0, _top4)
    else:
        a0 = tl.zeros([], tl.uint32)
        a1 = tl.zeros([], tl.uint32)
        a2 = tl.zeros([], tl.uint32)
        a3 = tl.zeros([], tl.uint32)
        for start in range(0, n, BLOCK):
            kb = _load_keys(base, 0, start + offs, n)
            v = tl.where((kb >= lo) & (kb <= top), tl.where(flip, top + 1 - kb, kb), 0)
            z = tl.zeros_like(v)
            b0, b1, b2, b3 = tl.reduce((v, z, z, z), 0, _top4)
            a0, a1, a2, a3 = _top4(a0, a1, a2, a3, b0, b1, b2, b3)
    return a0, a1, a2, a3


@triton.jit
def _cut_key(base, n, keys, need, n_sel, mx, mn, sx, sxx, offs, BLOCK: tl.constexpr, RESIDENT: tl.constexpr,
             FW: tl.constexpr, WIDTH: tl.constexpr, TOPR: tl.constexpr):
    """A cut for the `need` largest of the n order keys (1 <= need <= n_sel, the selectable keys, which lie in
    [mn, mx]): (cut, rem) such that the winners are every key > cut and the `rem` lowest-id keys == cut.
    Interpolation search over a bracket lo <= answer < hi (count(keys >= lo) = clo >= need > chi = count(keys >=
    hi)), three thresholds per counting reduction: the first pass from a normal fit of the scores (mean and
    variance from `_key_stats`), then each pass places its thresholds at the interpolated key of rank `need` in
    the bracket and +-WIDTH standard deviations of that rank around it. A pass that shrank the key range less than
    4x is followed by one that quarters it, so the search ends within 32 passes on any input (ties, constant
    rows); it stops at an exact cut (count(keys >= t) == need: every key >= t wins) or at hi == lo + 1 (the
    answer is lo; count(keys > lo) = chi). TOPR = 4: once need - chi <= 4 the answer is among the 4 largest keys
    of the bracket, and once clo - need <= TOPR - 2 it is among the bracket's smallest keys (the flipped search);
    one reduction finds either (`_top4_between`). Random scores need ~3-4 reductions (the two-bit
    search ~9-10; the slowest of 256 chunks ~6 against 12-15)."""
    lo = mn.to(tl.int64)
    hi = mx.to(tl.int64) + 1
    clo = n_sel
    chi = tl.zeros([], tl.int32)
    nf = tl.maximum(n_sel, 1).to(tl.float32)
    mean = sx / nf
    sd = tl.sqrt(tl.maximum(sxx / nf - mean * mean, 0.0))
    q = need.to(tl.float32) / nf
    g1 = _guess_key(mean, sd, tl.minimum(q * (1.0 + FW), 1.0 - 0.5 / nf), lo, hi)
    g2 = _guess_key(mean, sd, q, lo, hi)
    g3 = _guess_key(mean, sd, q * (1.0 - FW), lo, hi)
    cut = lo
    rem = need
    done = ((n_sel <= need) | (hi - lo <= 1)).to(tl.int32)
    prev = (hi - lo) * 8                         # the first pass never counts as "did not shrink"
    first = tl.full([], 1, tl.int32)
    while (done == 0) & (need - chi > TOPR) & (clo - need >= TOPR - 1):
        rng = hi - lo
        m = (clo - chi).to(tl.float32)
        j = (need - chi).to(tl.float32)
        d = tl.maximum(1.0, WIDTH * tl.sqrt(j * (m - j) / m))
        rf = rng.to(tl.float32)
        i1 = tl.minimum(tl.maximum(hi - (rf * tl.minimum((j + d) / m, 1.0)).to(tl.int64), lo + 1), hi - 1)
        i2 = tl.minimum(tl.maximum(hi - (rf * (j / m)).to(tl.int64), lo + 1), hi - 1)
        i3 = tl.minimum(tl.maximum(hi - (rf * tl.maximum((j - d) / m, 0.0)).to(tl.int64), lo + 1), hi - 1)
        slow = rng * 4 > prev
        i1 = tl.where(slow, lo + tl.maximum(rng // 4, 1), i1)
        i2 = tl.where(slow, tl.minimum(lo + rng // 2, hi - 1), i2)
        i3 = tl.where(slow, tl.minimum(lo + (3 * rng) // 4, hi - 1), i3)
        i1 = tl.where(first != 0, g1, i1)
        i2 = tl.where(first != 0, g2, i2)
        i3 = tl.where(first != 0, g3, i3)
        first = first * 0
        prev = rng
        i2 = tl.maximum(i2, i1)
        i3 = tl.maximum(i3, i2)
        c1, c2, c3 = _count3(base, 0, n, keys, i1.to(tl.uint32), i2.to(tl.uint32), i3.to(tl.uint32), offs, BLOCK,
                             RESIDENT)
        c1 = c1.to(tl.int32)
        c2 = c2.to(tl.int32)
        c3 = c3.to(tl.int32)
        # an exact cut: every key >= it wins
        ex = tl.where(c3 == need, i3, tl.where(c2 == need, i2, tl.where(c1 == need, i1, -1)))
        # the bracket's new ends (counts do not increase with t, and i1 <= i2 <= i3)
        lo2 = tl.where(c3 >= need, i3, tl.where(c2 >= need, i2, tl.where(c1 >= need, i1, lo)))
        clo = tl.where(c3 >= need, c3, tl.where(c2 >= need, c2, tl.where(c1 >= need, c1, clo)))
        hi2 = tl.where(c1 < need, i1, tl.where(c2 < need, i2, tl.where(c3 < need, i3, hi)))
        chi = tl.where(c1 < need, c1, tl.where(c2 < need, c2, tl.where(c3 < need, c3, chi)))
        lo = lo2
        hi = hi2
        cut = tl.where(ex >= 0, ex, lo)
        rem = tl.where(ex >= 0, need, need - chi)
        done = ((ex >= 0) | (hi - lo <= 1)).to(tl.int32)
    if TOPR > 0:
        if done == 0:
            # the answer is the j-th largest key in [lo, hi), or (bottom) the jb-th smallest, jb <= TOPR - 1
            j = need - chi
            bottom = j > TOPR
            top = (hi - 1).to(tl.uint32)
            a0, a1, a2, a3 = _top4_between(base, n, keys, lo.to(tl.uint32), top, bottom, offs, BLOCK, RESIDENT)
            jj = tl.where(bottom, clo - need + 1, j)
            a = tl.where(jj == 1, a0, tl.where(jj == 2, a1, tl.where(jj == 3, a2, a3)))
            before = (a0 > a).to(tl.int32) + (a1 > a).to(tl.int32) + (a2 > a).to(tl.int32)   # ranked ahead of a
            if bottom:
                # cut = the key a stands for; the keys ahead of a are the bracket's keys below it, so clo - before
                # keys are >= cut; those equal to it all show among a0..a3 unless a3 ties with a (then count)
                cut = (top + 1 - a).to(tl.int64)
                ties = ((a0 == a).to(tl.int32) + (a1 == a).to(tl.int32) + (a2 == a).to(tl.int32)
                        + (a3 == a).to(tl.int32))
                rem = need - (clo - before - ties)
                if a3 == a:
                    c1, c2, c3 = _count3(base, 0, n, keys, (cut + 1).to(tl.uint32), (cut + 1).to(tl.uint32),
                                         (cut + 1).to(tl.uint32), offs, BLOCK, RESIDENT)
                    rem = need - tl.where(cut >= 0xFFFFFFFF, 0, c1.to(tl.int32))   # no key is above the top key
            else:
                cut = a.to(tl.int64)
                rem = need - (chi + before)
    return cut.to(tl.uint32), rem


@triton.jit
def _select_chunk(base, n, k, idx_ptr, val_ptr, out, map_base, seg0, BLOCK: tl.constexpr, RESIDENT: tl.constexpr,
                  SORTED: tl.constexpr, KP: tl.constexpr, MAP: tl.constexpr, FW: tl.constexpr, WIDTH: tl.constexpr,
                  TOPR: tl.constexpr):
    """The exact k best of the n scores at `base` (ties: lower id) -> idx/val slots out .. out + k (-1 / -inf
    padded). One statistics reduction (`_key_stats`), the cut found by `_cut_key` (3-4 counting reductions and a
    top-4 one on random scores), then one compaction pass in entry order takes every key above the cut and the
    lowest-id keys equal to it. RESIDENT (n <= BLOCK): the scores are loaded once and stay in registers;
    otherwise every pass streams them (from L2 at decode sizes). SORTED: the winners are re-ordered best first
    by one in-register sort of (key, -id) (KP = next pow2 of k). Ids written: seg0 + the entry's position, or
    map_base[position] when MAP."""
    offs = tl.arange(0, BLOCK)
    keys = tl.zeros([BLOCK], tl.uint32)
    if RESIDENT:
        keys = _load_keys(base, 0, offs, n)
    n_sel, mx, mn, sx, sxx = _key_stats(base, n, keys, offs, BLOCK, RESIDENT)
    n_take = tl.minimum(n_sel, k)
    # the winners: every key > prefix and the `rem` lowest-id keys == prefix
    prefix, rem = _cut_key(base, n, keys, tl.maximum(n_take, 1), n_sel, mx, mn, sx, sxx, offs, BLOCK, RESIDENT, FW,
                           WIDTH, TOPR)
    rem = tl.minimum(rem, n_take)
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
def _topk_select_kernel(scores_ptr, L, CL, k, idx_ptr, val_ptr, map_ptr, fin_idx_ptr, fin_val_ptr, cnt_ptr,
                        BLOCK: tl.constexpr, RESIDENT: tl.constexpr, SORTED: tl.constexpr, KP: tl.constexpr,
                        MAP: tl.constexpr, FW: tl.constexpr, WIDTH: tl.constexpr, TOPR: tl.constexpr,
                        FUSE: tl.constexpr = False, MBLOCK: tl.constexpr = 16, MSORTED: tl.constexpr = False,
                        FAN: tl.constexpr = 0, GBLOCK: tl.constexpr = 16, grp_idx_ptr=None, grp_val_ptr=None,
                        PDL: tl.constexpr = False):
    """Program (row, chunk): `_select_chunk` over entries [c * CL, c * CL + CL) of row `row` of scores [N, L],
    written to output slots (row * chunks + c) * k... With MAP (the second stage of the chunked select) the row
    holds the first stage's candidates, whose positions increase with the original ids (so position ties are id
    ties), and map [N, L] their ids. FUSE: the row's last chunk program to finish (an atomic ticket, reset to 0
    after) also runs the second stage over the row's chunks * k candidates (MBLOCK slots, sorted when MSORTED)
    into fin_idx / fin_val [N, k]: one launch. FAN > 0 (rows of many chunks): the last chunk of each group of
    FAN merges the group's candidates (GBLOCK slots) into grp_idx / grp_val [N, groups * k], and the last group of
    the row merges those (MBLOCK slots): each merge holds at most FAN * k or groups * k candidates in registers.
    PDL: the scores (and tickets) come from earlier kernels, so it waits first; every program lets the next kernel
    launch once its chunk is selected (only the merges are left then)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    seg0 = c * CL
    pdl_wait(PDL)
    _select_chunk(scores_ptr + row * L + seg0, tl.minimum(CL, L - seg0), k, idx_ptr, val_ptr,
                  (row * tl.num_programs(1) + c) * k, map_ptr + row * L + seg0, seg0, BLOCK, RESIDENT, SORTED, KP,
                  MAP, FW, WIDTH, TOPR)
    pdl_trigger(PDL)
    if FUSE:
        chunks = tl.num_programs(1)
        C = chunks * k
        if FAN == 0:
            _merge_row(cnt_ptr + row, chunks, k, idx_ptr + row * C, val_ptr + row * C, fin_idx_ptr, fin_val_ptr,
                       row * k, KP, FW, WIDTH, TOPR, MBLOCK, MSORTED)
        else:     # a tree: the last chunk of each FAN merges the group, the last group the row
            G = tl.cdiv(chunks, FAN)
            g = c // FAN
            at = row * C + g * FAN * k
            if _merge_row(cnt_ptr + row * (G + 1) + 1 + g, tl.minimum(FAN, chunks - g * FAN), k, idx_ptr + at,
                          val_ptr + at, grp_idx_ptr, grp_val_ptr, (row * G + g) * k, KP, FW, WIDTH, TOPR, GBLOCK,
                          False):
                _merge_row(cnt_ptr + row * (G + 1), G, k, grp_idx_ptr + row * G * k, grp_val_ptr + row * G * k,
                           fin_idx_ptr, fin_val_ptr, row * k, KP, FW, WIDTH, TOPR, MBLOCK, MSORTED)


@triton.jit
def _merge_row(ticket_ptr, n_in, k, cand_idx_ptr, cand_val_ptr, out_idx_ptr, out_val_ptr, out, KP: tl.constexpr,
               FW: tl.constexpr, WIDTH: tl.constexpr, TOPR: tl.constexpr, MBLOCK: tl.constexpr,
               MSORTED: tl.constexpr):
    """Called by each of n_in programs once its k candidates are stored (at cand_*_ptr, in entry order, program
    after program): the last to take a ticket (reset to 0 after) selects the k best of the n_in * k candidates
    (MBLOCK slots, in registers; sorted when MSORTED) into out_idx / out_val[out...], ids through the candidates'
    ids; returns whether this program did."""
    tl.debug_barrier()                           # every thread's candidate stores precede the release below
    go = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu") == n_in - 1
    if go:
        tl.atomic_xchg(ticket_ptr, 0, sem="relaxed", scope="gpu")
        _select_chunk(cand_val_ptr, n_in * k, k, out_idx_ptr, out_val_ptr, out, cand_idx_ptr, 0, MBLOCK, True,
                      MSORTED, KP, True, FW, WIDTH, TOPR)
    return go


SELECT_BLOCK = 4096      # entries per streamed block; rows up to RESIDENT_MAX stay in registers
RESIDENT_MAX = 16384     # < 2**16: `_count3`'s 16-bit fields
SORT_MAX = 4096          # largest k ordered in-kernel (a bitonic sort in registers); larger k: torch.sort after
KMAX = 1 << 16           # the output row is one register block


def _select_launch(scores, k, chunks, sorted, block, num_warps, id_map=None, search=None):
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
    search = search or SEARCH
    _topk_select_kernel[(N, chunks)](scores, L, cl, k, idx, val, scores if id_map is None else id_map, idx, val,
                                     idx, BLOCK=block, RESIDENT=resident, SORTED=in_kernel_sort, KP=kp,
                                     MAP=id_map is not None, FW=search[0], WIDTH=search[1], TOPR=search[2],
                                     num_warps=num_warps or (16 if block > 8192 else 8 if block >= 2048 else 4),
                                     **pdl_kw())
    return _sort_after(idx, val, sorted, in_kernel_sort)


FAN = 4                  # chunks merged per group in the fused select's tree (rows of more than FAN chunks)


def _fused_launch(scores, k, chunks, sorted, num_warps, search, cnt, fan=FAN):
    """Both stages in one launch of `_topk_select_kernel` (FUSE: each row's last chunk program merges; more than
    `fan` chunks: a two-level tree, each group of `fan` chunks merged by its last, then the groups by the row's
    last) -> (idx, val) [N, k]. Chunks of at most RESIDENT_MAX entries; every merge at most RESIDENT_MAX slots.
    cnt: zeroed tickets, N (one per row) or with the tree N * (groups + 1) (the row's, then one per group)."""
    N, L = scores.shape
    cl = triton.cdiv(L, chunks)
    tree = chunks > fan
    groups = triton.cdiv(chunks, fan) if tree else 1
    cand_idx = empty((N, chunks * k), torch.int64, scores.device)
    cand_val = empty((N, chunks * k), torch.float32, scores.device)
    grp_idx = empty((N, groups * k), torch.int64, scores.device) if tree else None
    grp_val = empty((N, groups * k), torch.float32, scores.device) if tree else None
    idx = empty((N, k), torch.int64, scores.device)
    val = empty((N, k), torch.float32, scores.device)
    kp = max(16, triton.next_power_of_2(k))
    in_kernel_sort = sorted and kp <= SORT_MAX
    _topk_select_kernel[(N, chunks)](scores, L, cl, k, cand_idx, cand_val, scores, idx, val,
                                     cnt, BLOCK=max(16, triton.next_power_of_2(cl)),
                                     RESIDENT=True, SORTED=False, KP=kp, MAP=False, FW=search[0], WIDTH=search[1],
                                     TOPR=search[2], FUSE=True,
                                     MBLOCK=max(16, triton.next_power_of_2((groups if tree else chunks) * k)),
                                     MSORTED=in_kernel_sort, FAN=fan if tree else 0,
                                     GBLOCK=max(16, triton.next_power_of_2(fan * k)), grp_idx_ptr=grp_idx,
                                     grp_val_ptr=grp_val, num_warps=num_warps or 4, **pdl_kw())
    return _sort_after(idx, val, sorted, in_kernel_sort)


def default_chunks(L: int, k: int) -> int:
    """Chunks per row for the first select stage: rows much longer than k are split so that many programs share
    the row, in chunks of 16 * k entries (8192 at k = 512; 8 warps each): 2 chunks at L=16384, and at most 8 *
    FAN = 32 (the fused select's tree then merges at most 8 groups' candidates: 4096 at k = 512). Session 10 R2,
    H200, k=512, scores + select (unsorted), against 4096-entry chunks: N=64, L=65536 8 chunks in two launches
    318.4-319.5 us against 327.6-330.5 for 16 (4 chunks 339.0); N=64, L=131072 16 chunks in two launches
    627.1-627.2 against 646.3-648.0 for 32 (8 chunks 657.6-658.3); N=8, L=131072 16 chunks (tree) 100.0-100.2
    against 121.6-121.9 for 32. R3, against session 9's default in the same run: N=8, L=65536 63.1 us against 76.4
    (50% / 41% of the bytes); N=64, L=65536 309.4-309.7 against 323.3-323.5 (82% / 78%); N=8, L=131072 99.6-99.7
    against 119.9 (63% / 53%); N=64, L=131072 611.7-612.5 against 631.8-632.0 (83% / 80%)."""
    return min(8 * FAN, triton.cdiv(L, 16 * k))


# launches of at most TREE_ROWS rows of at least TREE_CHUNKS chunks merge in the same launch through the tree; other
# rows of more than FAN chunks take a second launch. Session 11 (H200, k=512, scores + select unsorted, R1-R2): at 8
# chunks (L=65536) the tree's two merge levels lose to a second launch at every row count measured: 8 rows 63.2-63.3
# us against 59.2-59.3 (a flat one-launch merge of the 4096 candidates 59.2), 12 rows 78.9 against 76.1, 16 94.5
# against 90.8, 32 176.1 against 166.6; at 16 chunks (L=131072) it ties at 8 rows (99.3-99.5 against 99.5-99.6;
# groups of 2 105.9, of 8 103.7), wins at 12 (137.9 against 139.8) and loses from 16 (175.4 against 170.4; 32
# rows 324.1 against 317.4).
TREE_ROWS = 12
TREE_CHUNKS = 16


# `_cut_key`'s (first-guess spread FW, rank spread WIDTH, top-4 end game TOPR: 4 or 0). H200, N=64, L=16384,
# k=512, scores in L2 (session 8 round 1): 19.2 us; (0.3, 1.0, 4) 20.6, (0.5, 2.0, 4) 19.6, (0.3, 1.0, 0) 25.1
SEARCH = (0.3, 2.0, 4)


def _sort_after(idx, val, sorted, in_kernel_sort):
    """Best-first order by torch when the kernel could not sort in registers (k > SORT_MAX)."""
    if sorted and not in_kernel_sort:
        val, order = val.sort(dim=1, descending=True, stable=True)
        idx = idx.gather(1, order)
    return idx, val


def topk_select_triton(scores: torch.Tensor, k: int, sorted: bool = True, block: int | None = None,
                       num_warps: int | None = None, chunks: int | None = None, num_warps2: int | None = None,
                       search: tuple = SEARCH, fused: bool | None = None):
    """Exact top-k of fp32 scores [N, L] (-inf = not selectable) -> (idx int64 [N, k], val fp32 [N, k]), -1 / -inf
    padded; the same selection as the stable-sort twin `_select` (ties: lower id). sorted=False: winners in
    ascending entry order (what a mask needs). chunks > 1 (default `default_chunks`): two launches, each chunk's
    exact top-k by its own program, then the top-k of those chunks * k candidates per row (they contain the row's
    top-k: an entry beaten by k entries of its own chunk is beaten by k in the row). Cost: the row read once
    (L2 at decode sizes) + chunks * k * 12 bytes of candidates written and read back, plus k * 12 written.
    search: `SEARCH`'s parameters (for the benchmark's sweep). fused (default: when not sorted, the chunks and
    candidates fit in registers, and there are at most FAN chunks, or at most TREE_ROWS rows of at least
    TREE_CHUNKS chunks): both stages in one launch, each row's last chunk program merging (`_fused_launch`; H200,
    N=64, L=16384, k=512, scores in L2, session 8 round 2: 18.4 us unsorted against 18.9 for two launches, 2 chunks
    of 8 warps 18.2; sorted 21.6 against 21.3, so sorted stays two launches)."""
    check(scores.dim() == 2 and scores.dtype == torch.float32, f"scores must be fp32 [rows, entries], got "
          f"{scores.dtype} {tuple(scores.shape)}")
    check(k >= 1, f"top-k must be >= 1, got {k}")
    N, L = scores.shape
    check(max(16, triton.next_power_of_2(k)) <= KMAX, f"top-k of at most {KMAX} entries per row, got {k}")
    check(L < 1 << 21, f"at most {(1 << 21) - 1} entries per row, got {L}")
    scores = scores.contiguous()
    if N == 0:
        return empty((N, k), torch.int64, scores.device), empty((N, k), torch.float32, scores.device)
    chunks = default_chunks(L, k) if chunks is None else max(1, min(chunks, triton.cdiv(L, k)))
    if chunks == 1:
        return _select_launch(scores, k, 1, sorted, block, num_warps, search=search)
    groups = triton.cdiv(chunks, FAN) if chunks > FAN else 1
    fits = (block is None and triton.cdiv(L, chunks) <= RESIDENT_MAX
            and max(min(chunks, FAN), groups) * k <= RESIDENT_MAX)
    if fused:
        check(fits, f"the fused select holds a chunk and each merge's candidates in registers: chunks of at most "
              f"{RESIDENT_MAX} entries, min(chunks, {FAN}) * k and ceil(chunks / {FAN}) * k at most {RESIDENT_MAX}; "
              f"got {L} entries in {chunks} chunks, k={k}")
    # the fused launch's tickets; None while a CUDA graph is captured before any warm-up made them: two launches
    # (the tree only for few rows of many chunks, `TREE_ROWS`; session 10 R2, N=64, 8 chunks of L=65536: two
    # launches 318.4-319.5 us against 327.1-327.5, 16 of L=131072: 627.1-627.2 against 633.6-637.9 with the scores)
    one_launch = fused or (fused is None and fits and not sorted
                           and (chunks <= FAN or (N <= TREE_ROWS and chunks >= TREE_CHUNKS)))
    # (a tree takes a ticket per group and one per row; the flat merge one per row)
    n_cnt = N * (groups + 1) if chunks > FAN else N
    cnt = tickets(scores.device, n_cnt, site="indexer") if one_launch else None
    # chunk programs of 32 entries a thread: 4 warps up to 4096 entries, 8 above (H200, N=64, L=16384, k=512,
    # scores in L2: 4 chunks of 8 warps 22.4 us, of 4 warps 19.2; 2 chunks of 8 warps 17.9-18.3 against 18.5-18.7
    # for 4 of 4 warps (session 9 R1-R2), on the score kernel's rows 19.5 against 20.4 and behind the scores
    # 88.2 against 90.9 (R2); 8 chunks 21.0-21.6, one program per row 23.4-24.5)
    num_warps = num_warps or (8 if triton.cdiv(L, chunks) > 4096 else 4)
    if cnt is not None:
        return _fused_launch(scores, k, chunks, sorted, num_warps, search, cnt)
    cand_idx, cand_val = _select_launch(scores, k, chunks, False, block, num_warps, search=search)
    return _select_launch(cand_val, k, 1, sorted, None, num_warps2, id_map=cand_idx, search=search)


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
