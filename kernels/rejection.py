"""Top-p alone (0 < p < 1, no top-k) by rejection: proposals from the full softmax, kept iff inside the top-p set.

Rule (part of the sampling contract, kernels/sampling.py; a row is "top-p alone" when it is sampled, top-k is off
and p < 1): proposals j = 0, 1, ..., NMAX - 1 are i.i.d. draws from the UNRESTRICTED processed softmax (mask and
temperature, no top-p), each by the sampling rule's lane draw (kernels/sampling.py) with its own row key
(`proposal_keys`: key 0 is the row key, so proposal 0 is the plain draw). The token is the first proposal v
inside the top-p set T = {v : mass(z > z_v) < p * s} = {z >= tau}; if none of the NMAX is, the token is the lane
draw restricted to T with key NMAX (today's rule with tau, on an independent key).
Exact: the proposals are i.i.d. with P(v) = e^z_v / s, and the first of them to land in T is distributed as the
proposal law conditioned on T: P(v | v in T) = e^z_v / mass(T) = q_v (the stopping index depends only on
whether earlier proposals landed in T, which is independent of the later ones). The fallback draw has law q too
and is independent of the proposals (other key), so the mixture over "accepted at j" and "none accepted" is q.
Each proposal lands in T with probability mass(T) / s >= p, so the fallback runs with probability
<= (1 - p)^NMAX (p = 0.9: 1e-8 per row; p = 0.5: 0.4%). The NMAX is part of the rule (it decides the token);
how many proposals the fast path computes (PROPOSALS, MORE_PROPOSALS) is not.
It draws other tokens for a seed than the tau-first rule (sessions <= 6) did; the speculative bonus token
follows the same rule (kernels/speculative.py), so the bonus is still exactly the plain draw.

Work on a GPU (no tau first, no histogram): pass 1 is the sampling pass itself computing PROPOSALS draws per program
(the lane weights and running sums are shared; each proposal costs a hash and two logs per lane, and one block
reduction packs every proposal's best lane: the pass keeps each proposal's best lane only) and the program's max z;
`_tokens_kernel` (per row) draws the token inside each proposal's winning lane (`lane_token`; session 7's pass made
the in-lane pick of every proposal in every lane, a compare and an add per token each: the pass with 4 proposals ran
14.9 / 52.3 us at B=64 / 256 against 11.0 / 35.2 without the picks, session 8 R1); pass 2 (`_above_kernel`, per
(row, segment), only top-p-alone rows) sums, in fp64 across lanes, the mass exp(z - m) above each proposal: with
HOT_LANES only over the lanes whose max (stored by the pass) exceeds the smallest proposal's z, gathered when they
are at most HOTCAP of the segment's lanes (peaked rows: ~none outside the leaders' segment; session 8 R2, whole call
at B=64 / 256: 24.3 / 61.8 us against 29.6 / 81.0 reading every lane; flat rows, where ~80 of 256 lanes lie above
it: 31.2 / 84.7 against 29.7 / 81.5); the row mass s comes from the pass's program masses (sum of its lane masses
rescaled to its max: the mass-above pass need not read lanes that hold nothing above a proposal); a last launch
(`_reject_finish_kernel`, per row) takes the first of the ABOVE_NP proposals the mass-above pass tested whose mass
above is < p * s (`_row_token`). A row missing them all (an "open" row) is finished in that program from the
pass's lane maxima (`_open_row_token`, session 14): every token of T lies above the best missed proposal, in a
lane whose max does; those lanes' tokens (a few hundred at p 0.5 on flat rows, a few thousand at p 0.8) are
gathered from L2 and the pass's other proposals are tested on them (the mass above one is a sum over them; the
host asks for MORE_PROPOSALS = 8 when some row has p < P_MORE); only a row missing all NMAX gets tau from them (a
histogram narrowing, then all pairs, `threshold._top_p_cut`) and the draw restricted to T over the lanes holding
it. Bounded: a few sweeps over a few lanes, where session 13 looped over the row in one program (below).
Session 13 (NMAX 8, 4 proposals in the pass, the finish's loops over the row for the rest): a row misses 4
proposals with probability up to (1 - p)^4 (flat rows, measured mass: p 0.9 1.0e-4, 0.8 1.6e-3,
0.7 8.1e-3, 0.5 6.2e-2; peaked rows a little less), so a call has such a row 0.6% / 10% / 40% / 98% of the time at
B=64 and 2.5% / 34% / 88% / 100% at B=256; misses 8 (the bisection) 1e-8 / 2.6e-6 / 6.5e-5 / 3.9e-3. Session 13,
whole call on flat rows at B=64 (us, rows from kernels_sampling.flat_logits): p 0.9 26.4, p 0.7 47.6 (R3) and 71.2
(R2), p 0.5 821 (R2: rows reach the bisection); B=256 p 0.8 80.9 (R2). The pass computing all NMAX proposals
(NP = 8) did not build: Triton 3.6 asserts in TritonGPUCoalesce (SmallVector index) on `_reject_finish_kernel`
with NP = NMAX = 8 (R3); the cause was the proposals loop left never entered (`_more_proposals` now leaves it out).
Session 14 R1 (B=64 flat rows unless said, us, tokens = twin on every row): a first form with NMAX = 4 (every
open row through tau and the restricted draw in the finish) ran p 0.9 24.6 / 24.9 against HEAD's 24.2 / 24.6,
peaked p 0.95 19.2 against 18.5, B=256 p 0.9 83.1 against 80.2; p 0.5 48.5-48.7 (6 open rows; 62.3 with tau
always on the 8,192 block) and 71.7 (5), p 0.7 / 0.8 with one open row 82.8 / 87.8, B=256 p 0.5 134.6 (18): an
open row's tau and draw cost 25-60 us in one program (~11,000 SASS instructions, 16 warps), so the rule kept
NMAX = 8 and the finish tests the pass's proposals 4 .. 7 on the gathered tokens first. R2 (this code; HEAD in
the same run): p 0.9 24.8 against 24.5 (31% / 32% of copy bandwidth); p 0.5 38.6 / 52.3 / 56.8 on three input
sets (1 / 5 / 6 rows missing the first four proposals, one of them all eight in the last); p 0.7 29.4 (no such
row; the pass with 8 proposals: +4.6 us) and 52.3 (one row) against HEAD's 267.4 on that set; p 0.8 52.0 (one
row); peaked p 0.95 19.0 against 18.3, p 0.5 31.5 (two rows); B=256 p 0.9 83.8 (HEAD 80.2 in R1: the finish's 16
warps x 128 registers leave one program per SM, two waves at 256 rows). R3: p 0.9 24.7 against 24.2. So a row
missing the first four proposals costs ~10-25 us (the gather from one program, ~3 us per 512 lanes), within
~1.2x of p 0.9 without one, ~2x with one; not the 1.5x bar yet. Written and tested compiled in R3, not timed
(R3's rows were cut by compile time), removed: the mass-above pass handing each segment's tokens above the
tested proposals to the finish (so an open row's candidates arrive in one round instead of that gather).
Session 11: the mass-above programs first compare their segment's program maxima (the pass's) with the smallest
proposal: a segment with nothing above any proposal stores zeros without loading its lane maxima (R3, B=64, twice
each: peaked p0.95 rows 24.1 / 24.1 -> 22.2 / 22.2 us, flat p0.9 rows 31.2 / 31.3 -> 30.9 / 31.4); the pass packs
its proposals' best lanes in one block reduction of [lanes, proposals] instead of one per proposal (22.8 / 22.8 ->
22.2 / 22.2 and 31.8 / 31.7 -> 30.9 / 31.4). Deleted after R3 (same runs): each lane's mass stored beside its max so
that the tokens kernel draws inside a winning lane in one sweep of its tokens instead of three, 22.2 / 22.2 and
30.9 / 31.4 against 21.9 / 21.8 and 30.5 / 30.8 without (the extra store cost more than the sweeps). So the
whole call at B=64 against HEAD in that run: peaked 23.9 / 23.9 -> 21.9 / 21.8 us (33% -> 36% of copy bandwidth),
flat 31.1 / 31.1 -> 30.5 / 30.8 (25-26%); B=256 was cut by the rounds' budgets (not measured).
Session 12, that code at B=256 (R1): peaked 56.8-56.9 us (55%), flat 87.5-87.6 (36%); B=64 21.7 / 30.7-30.8.
Session 13 (whole call, us, HEAD in the same run, twice each; copy 4,228-4,242 GB/s): the mass-above pass's weights
as one FFMA and one exp2 per token with no -inf select (`_weights`: 2,560 -> 2,048 SASS instructions, 96 -> 128
registers); the tokens kernel hands each row's (m, zmin, z of the proposals) to the mass-above programs, which load
them beside their segment's program maxima and lane maxima in one round (before: the row's 64 program maxima and the
tokens, then the tokens' logits, then the lane maxima: three more dependent rounds); the sampling pass PDL-launched
in front of the chain (kernels/sampling.py beside its launch). R2, B=64: flat p0.9 30.4 / 30.4 -> 26.4 / 26.4 (25%
-> 30% of copy bandwidth), peaked p0.95 21.5 / 21.5 -> 19.6 / 19.6 (36% -> 40%); B=256 flat 86.6 / 90.3 -> 80.6 /
80.7 (39%), peaked 55.6 / 55.6 -> 54.7 / 54.7 (57%). The arithmetic alone (R2): 28.4 / 20.7 at B=64. Measured and
deleted (R1): the new mass-above pass at 4 warps (64 registers, full occupancy): B=64 flat 27.4 / 28.1 against
27.1 / 27.6 at 2 warps, peaked 21.7 / 21.6 against 21.6 / 21.6, B=256 flat 84.3 / 84.3 against 82.5 / 82.7.
Its kernels (R1, torch.profiler, PDL off, B=64, us): peaked: pass 11.9, mass above 4.9, tokens 3.1, finish 2.3;
flat: mass above 13.6 (33 MB at 2.4 TB/s: instruction- and occupancy-bound), pass 12.3, tokens 3.3, finish 2.4.
Deleted after session 12 (whole call, us, HEAD in the same run; B=64 twice each): the mass-above programs taking
the segments last to first (what the pass read last is what the L2 still holds; R1): B=64 peaked 21.7 -> 22.7,
flat 30.7-30.8 -> 30.7-30.8, B=256 peaked 56.9 -> 58.9, flat 87.5 -> 85.0 (the leaders' segment, a peaked row's
only warm one, then starts last; the B=64 mass-above pass is instruction-bound: L2 hits do not show); each program
taking SPP segments (unrolled: in a run-time loop the compiler held 241 registers against 96), about 1024
programs in all (R3): B=64 peaked 21.1-21.2 -> 22.3 (SPP 2), flat 30.2-30.3 -> 30.6-30.7, B=256 peaked 80.8 (SPP
8; 56.9 in R1): a program's warm segments come one after another; its first version (R2, segments last to first,
the tokens kernel loading the row's parameters beside the packed lanes; the sums of a segment's two branches
merged before one store, a layout conversion through shared memory) 23.8-24.4 / 31.7 against 21.7-21.8 /
30.5-30.6, in pass order 22.5-23.1 / 30.9-31.0, with HOTCAP 128 (a flat row's ~80 hot lanes of 256 gathered
instead of the segment read whole) 22.1-23.0 / 33.8-33.9.
Deleted after session 11's R2 (whole call, us, B=64 / 256, flat p0.9 and peaked p0.95 rows, HEAD in the same run:
30.6 / 85.9 and 24.1 / 64.3): lane bounds deciding rows in the tokens kernel (the pass stored each lane's max,
second largest z and mass; a lane whose second largest z is not above a proposal adds exactly exp(max - m) or 0,
any other between exp(max - m) + exp(second - m) and its mass; a row whose first sure proposal came before any
unsure one skipped the mass-above pass: 1 of 64 flat rows left open, 7 of 256, no peaked row) ran 32.9 / 87.6
and 29.9 / 84.6: reading 12 bytes of statistics per lane in one program per row cost what the mass-above pass
saved on flat rows, and peaked rows, whose mass-above pass reads almost nothing, paid it all.
Deleted after session 7's R2 (whole call, B=64 / 256, flat p 0.9 and peaked p 0.95 rows, us): the mass-above
pass reading only the lanes above the smallest proposal (lane maxima and masses stored by pass 1) 55.4 / 151.9
and 53.8 / 142.3 against 52.5 / 141.8 and 52.3 / 136.6 reading every lane (a lane's 16 tokens sit in 16
sectors, so skipping 6% of the lanes still touched ~40% of the sectors); the finish fused into pass 2 (the row's
last program, by a per-row count) against 53.9 / 135.8 and 52.0 / 128.0 launched apart.
"""
import torch
import triton
import triton.language as tl

from . import rng, threshold
from .backend import empty, one_wave, pdl_kw, pdl_trigger, pdl_wait
from .threshold import (NEG_INF_KEY, _below, _bisect_tau, _draw_lanes, _kept_column, _top_p_cut, exp2_w, lane_block,
                        lane_keys, lane_score, load_z, pack_lanes, row_block_z, segment_pack)

NMAX = 8              # proposals of the rule (part of the contract: it decides the token)
PROPOSALS = 4         # proposals the sampling pass computes by default (the finish computes the rest when all miss)
MORE_PROPOSALS = 8    # ... when the host knows some top-p-alone row has p < P_MORE (sampling.host_flags)
P_MORE = 0.85         # (below it 4 proposals all miss often enough: (1 - p)^4 = 5e-4 at 0.85, 6e-2 at 0.5)
ABOVE_NP = 4          # proposals whose mass above the mass-above pass sums; an open row tests the rest in the finish
KEY_MUL = 0x632BE5AB  # proposal j >= 1 key: lowbias32(row key ^ j * KEY_MUL)
MIN_PACKED = -9223372036854775807
MIN_PACKED_C = tl.constexpr(MIN_PACKED)
NEG_INF_KEY_C = tl.constexpr(NEG_INF_KEY)
ABOVE_WARPS = 2       # warps of the mass-above pass ([LANES, LW] blocks: 4 lanes per thread, 16-byte loads)
FINISH_WARPS = 16     # (the open rows' lane maxima and candidates: [8192] blocks at V = 129,280; sm_90 builds: 16
                      # warps 128 registers + 112 B of spills, 8 warps 255 + 136 B, 32 warps 64 + 200 B)
# launch options of the finish for more rows than SMs when the pass drew PROPOSALS (an open row is rare there): at
# 16 warps x 128 registers one program fits an SM, so 256 rows ran in two waves; 4 warps build with 255 registers
# + 792 B of spills, 16 warps capped at 64 registers with 640 B: two programs an SM either way. Session 15 R2 (whole
# call, B=256, 4 input sets rotated, twice each, us): flat p 0.9 4 warps 80.4 / 80.4 (39% of copy bandwidth), 16
# warps capped 82.1 / 82.0, 16 warps (before) 83.5 / 83.4 (38%); peaked p 0.95 55.4 / 55.5 (57%), 57.7 / 57.6,
# 57.9 / 57.9 (54%). Tokens = twin on every row.
FINISH_WAVE = dict(num_warps=4)
# Session 7 R2 (H200, whole top-p call, B=64 / 256, flat p 0.9 and peaked p 0.95 rows; the device-side parameter
# view then still cost ~15 us in every row): the mass-above pass at 4 warps 69.2 / 193.0 and 67.4 / 178.4 against
# 52.5 / 141.8 and 52.3 / 136.6 at 2; 2 proposals 120.6 / 63.6 at B=64 (flat rows then often reach the finish's
# loops), 6 proposals 67.4 / 65.3. So: 2 warps, 4 proposals. Session 11 (B=64 only): 4 warps 21.6 / 21.6 (peaked)
# and 30.9 / 31.0 (flat) against 22.2 / 22.2 and 30.9 / 31.4 at 2 (R3), 29.9 against 31.7 once (flat, R4, tests
# running beside it); not adopted without a B=256 number.
HOT_LANES = True      # the mass-above pass gathers only the lanes above the smallest proposal when they are few
HOTCAP = 32           # most such lanes per segment gathered (more: the segment is read whole)
OPEN_CMAX = 8192      # most tokens above t_lo an open row gathers (`_open_row_token`; more: the bisection)
OPEN_SMALL = 1024     # up to this many candidates: tau from a block of this size (0: always OPEN_CMAX; session 14
                      # R1, p 0.5 flat B=64, 6 open rows: 48.7 us against 62.3 at 0)
OPEN_LC = 512         # lanes per block of its sweeps
STAGES = 2            # benchmarks time the stages by differences: 0 stops after the pass, 1 after the mass above


def proposal_keys(keys: torch.Tensor, j: int) -> torch.Tensor:
    """Row keys (int64 holding uint32) of proposal j (the row keys themselves for j = 0)."""
    if j == 0:
        return keys
    return rng.mix32(keys ^ ((j * KEY_MUL) & rng.MASK32))


def p_alone_rows(params, V: int) -> torch.Tensor:
    """bool [R]: sampled rows with top-k off and p < 1 (params: sampling.RowParams, any device)."""
    k = params.top_k
    return ~params.greedy.bool() & ((k <= 0) | (k >= V)) & (params.top_p < 1)


@triton.jit
def proposal_key_tl(key, j):
    """Triton twin of `proposal_keys` for j >= 1 (j: an int32 scalar)."""
    return rng._mix32_tl(key ^ (j.to(tl.uint32) * 0x632BE5AB))


@triton.jit
def is_p_alone(row, V, greedy_ptr, top_k_ptr, top_p_ptr, FROM_TEMP: tl.constexpr = False):
    """Is row (or request) `row` top-p alone? FROM_TEMP: greedy_ptr holds temperatures (<= 0: greedy)."""
    top_k = tl.load(top_k_ptr + row)
    if FROM_TEMP:
        sampled = tl.load(greedy_ptr + row) > 0
    else:
        sampled = tl.load(greedy_ptr + row) == 0
    return sampled & ((top_k <= 0) | (top_k >= V)) & (tl.load(top_p_ptr + row) < 1.0)


@triton.jit
def store_proposals(x, lane, pos, start, seg, inv_t, greedy, key, out_ptr, HAS_TAU: tl.constexpr,
                    LANES: tl.constexpr, LW: tl.constexpr, FAST: tl.constexpr, NP: tl.constexpr,
                    DEFER: tl.constexpr = False, pmass_ptr=None, lane_ptr=None, alone=False,
                    HOT: tl.constexpr = False, NPR: tl.constexpr = 1):
    """The sampling pass's per-program work with NP proposals (threshold.segment_pack for each): out_ptr[j] = the
    packed best lane of proposal j (greedy rows: out_ptr[0] only, with the token). The lane weights, running sums
    and masses are computed once; each proposal adds its Gumbel score and (unless DEFER) its in-lane pick and
    block reduction. DEFER (the sampling pass; the speculative statistics pass picks in-lane here and needs neither
    store below): the packed entry holds the lane's global id instead of the token (`lane_token` draws the token
    of the winning lane; ties between lanes go to the lowest id, the twin's rule), all NP in ONE block reduction
    of [lanes, NPR] (NPR: a power of two >= NP); the program's mass sum exp(z - its max z) goes to pmass_ptr (from
    the lane masses; the rejection finish's row mass), and with HOT every lane's max z to lane_ptr[g] for rows that
    are top-p alone (`alone`: the mass-above pass then gathers only the lanes above the smallest proposal)."""
    xm = tl.max(x, 1)
    if greedy:
        tl.store(out_ptr, segment_pack(x, lane, pos, start, seg, inv_t, greedy, key, HAS_TAU, LANES, LW, FAST))
    else:
        c = 1.4426950408889634
        m = xm
        if not HAS_TAU:
            c = inv_t * 1.4426950408889634
            m = xm * inv_t
        ref = tl.where(m > float("-inf"), m, 0.0) * 1.4426950408889634
        gid = seg * LANES + lane
        w = exp2_w(x * c - ref[:, None], FAST)
        cdf = tl.cumsum(w, 1)
        k = tl.arange(0, LW)[None, :]
        s = tl.max(tl.where(k == LW - 1, cdf, float("-inf")), 1)
        if DEFER:
            pm = tl.max(m, 0)
            tl.store(pmass_ptr, tl.sum(tl.where(m > float("-inf"), s * tl.exp(m - pm), 0.0), 0))
            if HOT:
                tl.store(lane_ptr + gid, m, mask=(gid == gid) & alone)
            col = tl.arange(0, NPR)[None, :]
            keys = tl.full([x.shape[0], NPR], MIN_PACKED_C, tl.int64)
            for j in tl.static_range(NP):
                kj = key
                if j > 0:
                    kj = proposal_key_tl(key, tl.full([], j, tl.int32))
                keys = tl.where(col == j, lane_keys(lane_score(m, s, kj, gid, FAST), gid)[:, None], keys)
            jr = tl.arange(0, NPR)
            tl.store(out_ptr + jr, tl.max(keys, 0), mask=jr < NP)
        else:
            for j in tl.static_range(NP):
                kj = key
                if j > 0:
                    kj = proposal_key_tl(key, tl.full([], j, tl.int32))
                target = _below(rng.uniform_tl(kj, gid + 1073741824) * s, s)          # U_ID + g
                kk = tl.sum((cdf <= target[:, None]).to(tl.int32), 1)
                tl.store(out_ptr + j, pack_lanes(lane_score(m, s, kj, gid, FAST),
                                                 start + tl.minimum(kk, LW - 1) * LANES + lane))


@triton.jit
def _unpack(best):
    return 4294967295 - (best & 4294967295)


@triton.jit
def _proposal(packed_ptr, row, n_prog, j, NP: tl.constexpr, NPP: tl.constexpr):
    """(best packed, token) of proposal j of a row: the max over the row's programs."""
    i = tl.arange(0, NPP)
    best = tl.max(tl.load(packed_ptr + (row * n_prog + i) * NP + j, mask=i < n_prog, other=MIN_PACKED_C), 0)
    return best, _unpack(best)


@triton.jit
def lane_token(logits_ptr, row, g, ok, V, inv_t, tau, key, bitmask_ptr, mrow, bitmask_stride, HAS_MASK: tl.constexpr,
               HAS_TAU: tl.constexpr, LANES: tl.constexpr, LW: tl.constexpr, FAST: tl.constexpr):
    """The token the sampling pass's in-lane pick draws in lane g (a global lane id, elementwise over g, ok and
    key; tau: the row's tau when HAS_TAU) with key `key`: the pass's own operations on the pass's own values (raw
    logits, or z cut at tau when HAS_TAU), one token column at a time (the max, then the running sum over
    k = 0 .. LW-1 in the pass's order), so it is the pass's pick bit for bit. Loads: LW tokens per lane (L2)."""
    base = (g // LANES) * (LANES * LW) + g % LANES                   # the lane's first token
    t_inv = 1.0
    t_cut = float("-inf")
    c = inv_t * 1.4426950408889634                                  # weights 2^(x * c - ref), as the pass
    if HAS_TAU:
        t_inv = inv_t
        t_cut = tau
        c = 1.4426950408889634
    xm = tl.where(ok, float("-inf"), float("-inf"))
    for k in tl.static_range(LW):
        xm = tl.maximum(xm, _kept_column(logits_ptr, row, base + k * LANES, ok, V, t_inv, t_cut, bitmask_ptr, mrow,
                                         bitmask_stride, HAS_MASK))
    m = xm
    if not HAS_TAU:
        m = xm * inv_t
    ref = tl.where(m > float("-inf"), m, 0.0) * 1.4426950408889634
    s = tl.zeros_like(xm)
    for k in tl.static_range(LW):
        s += exp2_w(_kept_column(logits_ptr, row, base + k * LANES, ok, V, t_inv, t_cut, bitmask_ptr, mrow,
                                 bitmask_stride, HAS_MASK) * c - ref, FAST)
    target = _below(rng.uniform_tl(key, g + 1073741824) * s, s)               # U_ID + g
    cdf = tl.zeros_like(xm)
    kk = tl.zeros_like(g)
    for k in tl.static_range(LW):
        cdf += exp2_w(_kept_column(logits_ptr, row, base + k * LANES, ok, V, t_inv, t_cut, bitmask_ptr, mrow,
                                   bitmask_stride, HAS_MASK) * c - ref, FAST)
        kk += (cdf <= target).to(kk.dtype)
    return base + tl.minimum(kk, LW - 1) * LANES


@triton.jit
def _row_mass(pmax_ptr, pmass_ptr, row, n_prog, NPP: tl.constexpr):
    """(m, s): a row's max z and its mass sum exp(z - m) in fp64, from the sampling pass's program maxima and
    masses (each relative to its program's max)."""
    i = tl.arange(0, NPP)
    pmx = tl.load(pmax_ptr + row * n_prog + i, mask=i < n_prog, other=float("-inf"))
    m = tl.max(pmx, 0)
    pms = tl.load(pmass_ptr + row * n_prog + i, mask=i < n_prog, other=0.0)
    return m, tl.sum(tl.where(pmx > float("-inf"), pms * tl.exp(pmx - m), 0.0).to(tl.float64), 0)


@triton.jit
def _tokens_kernel(packed_ptr, tok_ptr, dec_ptr, zrow_ptr, pmax_ptr, logits_ptr, inv_t_ptr, greedy_ptr, top_k_ptr,
                   top_p_ptr, keys_ptr, tau_ptr, bitmask_ptr, mask_rows_ptr, bitmask_stride, V, n_prog, done_ptr,
                   DONE: tl.constexpr,
                   HAS_MASK: tl.constexpr, HAS_TAU: tl.constexpr, NP: tl.constexpr, NPP: tl.constexpr,
                   NPQ: tl.constexpr, LANES: tl.constexpr, LW: tl.constexpr, FAST: tl.constexpr,
                   NA: tl.constexpr = 4, PDL: tl.constexpr = False):
    """Program (row): tok[row, j] = the token of proposal j (the best packed lane over the row's programs, its
    token drawn inside it by `lane_token`; greedy rows: the packed argmax), -1 where the best score is -inf (nothing
    allowed); only proposal 0 for rows that are not top-p alone. Once per row, so the mass-above programs and the
    finish only read its results (each (row, segment) program drawing the tokens itself cost more than the pass
    saved: session 8 R1, the mass-above pass 19.4 / 72.8 us against 16.6 / 46.3 at B=64 / 256).
    dec[row] = the row's token when known here (the top-k merge's draw, proposal 0 of a row that is not top-p
    alone), else -2: the mass-above pass and the finish decide it.
    zrow[row] = (m, zmin, z of each proposal's token) for the mass-above pass (m: the row max from the pass's
    program maxima; zmin: the smallest z of the first NA proposals, those the mass-above pass tests; +inf where no
    mass above is needed: a decided row, or one with nothing allowed), so that its programs read them in the same
    round as their segment's program maxima: a segment with nothing above zmin (every segment of a peaked row but
    the leaders') then costs one round of loads and a store."""
    pdl_wait(PDL)
    pdl_trigger(PDL)
    row = tl.program_id(0).to(tl.int64)
    dec = tl.full([], -2, tl.int64)
    if DONE:
        dec = tl.load(done_ptr + row)
    jj = tl.arange(0, NPQ)
    m = float("-inf")
    zs = tl.full([NPQ], float("inf"), tl.float32)
    if dec == -2:
        i = tl.arange(0, NPP)
        pk = tl.load(packed_ptr + (row * n_prog + i)[:, None] * NP + jj[None, :],
                     mask=(i < n_prog)[:, None] & (jj < NP)[None, :], other=MIN_PACKED_C)
        m = tl.max(tl.load(pmax_ptr + row * n_prog + i, mask=i < n_prog, other=float("-inf")), 0)
        best = tl.max(pk, 0)
        toks = _unpack(best)
        live = (best >> 32) > NEG_INF_KEY_C
        alone = is_p_alone(row, V, greedy_ptr, top_k_ptr, top_p_ptr)
        if tl.load(greedy_ptr + row) == 0:
            n = tl.where(alone, NP, 1)
            mrow = -1
            if HAS_MASK:
                mrow = tl.load(mask_rows_ptr + row)
            tau = float("-inf")
            if HAS_TAU:
                tau = tl.load(tau_ptr + row)
            key = tl.load(keys_ptr + row).to(tl.uint32)
            kj = tl.where(jj == 0, key, proposal_key_tl(key, jj))
            live = live & (jj < n)
            toks = lane_token(logits_ptr, row, toks, live, V, tl.load(inv_t_ptr + row), tau, kj, bitmask_ptr, mrow,
                              bitmask_stride, HAS_MASK, HAS_TAU, LANES, LW, FAST)
        toks = tl.where(live, toks, -1)
        tl.store(tok_ptr + row * NPQ + jj, toks, mask=jj < NP)
        dec = tl.where(alone, dec, tl.sum(tl.where(jj == 0, toks, 0), 0))
        if (dec == -2) & (m > float("-inf")):
            zs = tl.load(logits_ptr + row * V + toks, mask=jj < NP, other=float("inf")).to(tl.float32) * \
                tl.load(inv_t_ptr + row)
    tl.store(zrow_ptr + row * (NPQ + 2) + 2 + jj, zs)
    tl.store(zrow_ptr + row * (NPQ + 2), m)
    tl.store(zrow_ptr + row * (NPQ + 2) + 1, tl.min(tl.where(jj < NA, zs, float("inf")), 0))
    tl.store(dec_ptr + row, dec)


@triton.jit
def _above_sums(z, e, zs, jj, NP: tl.constexpr, NPQ: tl.constexpr):
    """[NPQ] fp64: entry j the sum of e over the block's tokens with z > zs[j] (j < NP): fp32 inside each lane
    (dim 1), fp64 across lanes, all proposals in one reduction."""
    col = tl.arange(0, NPQ)[None, :]
    acc = tl.zeros([z.shape[0], NPQ], tl.float32)
    for j in tl.static_range(NP):
        zj = tl.sum(tl.where(jj == j, zs, 0.0), 0)
        acc = tl.where(col == j, tl.sum(tl.where(z > zj, e, 0.0), 1)[:, None], acc)
    return tl.sum(acc.to(tl.float64), 0)


@triton.jit
def _weights(z, ref):
    """exp(z - m) as 2^(z log2 e - ref), ref = m log2 e: one FFMA and one MUFU.EX2 per token; a banned or padding
    token (z = -inf) weighs 2^-inf = 0 with no select. tl.exp took ~5 more instructions per token (a multiply, the
    denormal range check and its two scalings) and the -inf select two: 2,560 -> 2,128 SASS instructions in the
    mass-above kernel (4 proposals; 2,048 with the row statistics), 96 -> 128 registers (`exp2_w`'s asm: 255)."""
    return tl.exp2(z * 1.4426950408889634 - ref)


@triton.jit
def _above_kernel(logits_ptr, zrow_ptr, pmax_ptr, part_ptr, inv_t_ptr, bitmask_ptr, mask_rows_ptr,
                  bitmask_stride, V, n_prog, n_seg, lane_ptr, n_lanes, hot_ptr, HAS_MASK: tl.constexpr,
                  NP: tl.constexpr, LANES: tl.constexpr, LW: tl.constexpr, VEC: tl.constexpr,
                  FAST: tl.constexpr, NPQ: tl.constexpr = 8, HOT: tl.constexpr = False, HOTCAP: tl.constexpr = 32,
                  PER: tl.constexpr = 1, NAQ: tl.constexpr = 8, PDL: tl.constexpr = False):
    """Program (row, segment) of an open top-p-alone row (zmin < +inf, `_tokens_kernel`): part[row, segment, j] =
    the mass above proposal j < NP (the first NP of the pass's: zrow holds NPQ; NAQ, a power of two > NP, sizes the
    sums), as sum exp(z - m) (m: the row max from the pass's program maxima): fp32 inside a lane (LW terms), fp64
    across lanes (`_above_sums`). The row's (m, zmin, z of the proposals) come from
    `_tokens_kernel`, loaded beside the segment's PER program maxima (the pass's): a segment whose maxima are all at
    or below zmin holds nothing above any proposal: zeros, nothing else read. HOT: only the lanes whose max (stored
    by the pass) exceeds zmin can hold a token above a proposal; when at most HOTCAP of the segment's lanes do, only
    those are gathered (a lane list through a small scratch), else the whole segment is read (lane_ptr: the lane
    maxima). Other rows store nothing."""
    pdl_wait(PDL)
    pdl_trigger(PDL)
    row = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    zr = zrow_ptr + row * (NPQ + 2)
    jj = tl.arange(0, NAQ)
    m = tl.load(zr)
    zmin = tl.load(zr + 1)
    zs = tl.load(zr + 2 + jj)
    inv_t = tl.load(inv_t_ptr + row)
    seg_max = tl.max(tl.load(pmax_ptr + row * n_prog + seg * PER + tl.arange(0, PER)), 0)
    lane = tl.arange(0, LANES)
    lm = tl.full([LANES], float("inf"), tl.float32)
    if HOT:     # the segment's lane maxima in the same round (1 KB, read whether or not the segment needs them)
        lm = tl.load(lane_ptr + row * n_lanes + seg * LANES + lane)
    if zmin != float("inf"):   # (a NaN zmin still writes its part: the finish reads it)
        start = seg * (LANES * LW)
        ref = m * 1.4426950408889634
        o = (row * n_seg + seg) * NP
        warm = seg_max > zmin
        if warm == 0:          # (not `seg_max <= zmin`: with a NaN neither test holds and the part went unwritten)
            tl.store(part_ptr + o + jj, tl.zeros([NAQ], tl.float64), mask=jj < NP)
        n_hot = HOTCAP + 1
        if HOT & warm:
            hot = lm > zmin
            n_hot = tl.sum(hot.to(tl.int32), 0)
            if n_hot <= HOTCAP:
                hp = hot_ptr + (row * n_seg + seg) * HOTCAP
                tl.store(hp + tl.cumsum(hot.to(tl.int32), 0) - 1, lane, mask=hot)
                tl.debug_barrier()                              # the lane list's stores before its loads
                h = tl.arange(0, HOTCAP)
                hl = tl.load(hp + h, mask=h < n_hot, other=0)
                t = start + hl[:, None] + tl.arange(0, LW)[None, :] * LANES
                mrow = -1
                if HAS_MASK:
                    mrow = tl.load(mask_rows_ptr + row)
                # padding lanes point past V: load_z's one bounds check masks them
                zh = load_z(logits_ptr, row, tl.where((h < n_hot)[:, None], t, V), V, inv_t, bitmask_ptr, mrow,
                            bitmask_stride, HAS_MASK)
                tl.store(part_ptr + o + jj, _above_sums(zh, _weights(zh, ref), zs, jj, NP, NAQ), mask=jj < NP)
        if warm & (n_hot > HOTCAP):
            z, pos = row_block_z(logits_ptr, bitmask_ptr, mask_rows_ptr, inv_t_ptr, row, start, V, bitmask_stride,
                                 HAS_MASK, LANES, LW, LANES, 0, VEC, FAST)
            tl.store(part_ptr + o + jj, _above_sums(z, _weights(z, ref), zs, jj, NP, NAQ), mask=jj < NP)


@triton.jit
def _more_proposals(logits_ptr, row, V, inv_t, key, m, lim, tau, bitmask_ptr, mrow, bitmask_stride,
                    HAS_MASK: tl.constexpr, NP: tl.constexpr, NMAX: tl.constexpr, LANES: tl.constexpr,
                    LW: tl.constexpr, BLOCK: tl.constexpr, FAST: tl.constexpr, KNOWN_TAU: tl.constexpr,
                    RPL: tl.constexpr):
    """Proposals NP .. NMAX - 1 (none when the pass computed all NMAX), each a lane draw by a loop over the row,
    then its mass above in fp64 compared with lim = p * s (m the row max; KNOWN_TAU: z >= tau instead). Returns
    the first one inside the top-p set, or -2. RPL: lanes per block of the loops (small for a program of few
    warps: the blocks stay in registers)."""
    tok = tl.full([], -2, tl.int64)
    j = tl.full([], NP, tl.int32)
    n_seg = tl.cdiv(V, LANES * LW)
    if NP < NMAX:      # (Triton 3.6's TritonGPUCoalesce asserts on the loop when it is never entered)
        while (tok == -2) & (j < NMAX):
            kj = proposal_key_tl(key, j)
            best = tl.full([], MIN_PACKED_C, tl.int64)
            for cs in range(0, n_seg * (LANES // RPL)):
                c = cs // (LANES // RPL)
                lane, pos, x = lane_block(logits_ptr, bitmask_ptr, row, c * (LANES * LW), V, mrow, bitmask_stride,
                                          HAS_MASK, False, LANES, LW, RPL, cs % (LANES // RPL), 1, FAST)
                best = tl.maximum(best, segment_pack(x, lane, pos, c * (LANES * LW), c, inv_t, False, kj, False,
                                                     LANES, LW, FAST))
            t = _unpack(best)
            zt = tl.load(logits_ptr + row * V + t).to(tl.float32) * inv_t
            if KNOWN_TAU:
                tok = tl.where(zt >= tau, t, tok)
            else:
                above = tl.zeros([BLOCK], tl.float64)
                for start in range(0, V, BLOCK):
                    z = load_z(logits_ptr, row, start + tl.arange(0, BLOCK), V, inv_t, bitmask_ptr, mrow,
                               bitmask_stride, HAS_MASK)
                    above += tl.where(z > zt, tl.exp(z - m), 0.0).to(tl.float64)
                tok = tl.where(tl.sum(above, 0) < lim, t, tok)
            j += 1
    return tok


@triton.jit
def _kept_row_draw(logits_ptr, row, V, inv_t, tau, key, bitmask_ptr, mrow, bitmask_stride, HAS_MASK: tl.constexpr,
                   NMAX: tl.constexpr, LANES: tl.constexpr, LW: tl.constexpr, FAST: tl.constexpr, RPL: tl.constexpr):
    """The rule's last draw, restricted to z >= tau with key NMAX, by a loop over the row (-1: nothing kept)."""
    kf = proposal_key_tl(key, tl.full([], NMAX, tl.int32))
    n_seg = tl.cdiv(V, LANES * LW)
    best = tl.full([], MIN_PACKED_C, tl.int64)
    for cs in range(0, n_seg * (LANES // RPL)):
        c = cs // (LANES // RPL)
        lane, pos, x = lane_block(logits_ptr, bitmask_ptr, row, c * (LANES * LW), V, mrow, bitmask_stride,
                                  HAS_MASK, False, LANES, LW, RPL, cs % (LANES // RPL), 1, FAST)
        z = x * inv_t
        best = tl.maximum(best, segment_pack(tl.where(z >= tau, z, float("-inf")), lane, pos, c * (LANES * LW),
                                             c, inv_t, False, kf, True, LANES, LW, FAST))
    return tl.where((best >> 32) > NEG_INF_KEY_C, _unpack(best), -1)


@triton.jit
def rest_of_rule(logits_ptr, row, V, inv_t, top_p, key, m, lim, bitmask_ptr, mrow, bitmask_stride,
                 HAS_MASK: tl.constexpr, NP: tl.constexpr, NMAX: tl.constexpr, LANES: tl.constexpr,
                 LW: tl.constexpr, BLOCK: tl.constexpr, FAST: tl.constexpr, RPL: tl.constexpr = 128):
    """The rule past the first NP proposals by loops over the row in this one program (every proposal so far
    missed the top-p set): proposals NP .. NMAX - 1 (`_more_proposals`), then the draw restricted to z >= tau with
    key NMAX, tau from the row-wide bisection. The finish without the pass's lane maxima (HOT_LANES off); with them
    it takes `_open_row_token` (the speculative bonus knows tau and takes the pass's last draw:
    kernels/speculative.py `_bonus_by_rejection`)."""
    tok = _more_proposals(logits_ptr, row, V, inv_t, key, m, lim, m, bitmask_ptr, mrow, bitmask_stride, HAS_MASK,
                          NP, NMAX, LANES, LW, BLOCK, FAST, False, RPL)
    if tok == -2:
        tau = _bisect_tau(logits_ptr, row, V, inv_t, V + 1, top_p, bitmask_ptr, mrow, bitmask_stride, HAS_MASK, BLOCK)
        tok = _kept_row_draw(logits_ptr, row, V, inv_t, tau, key, bitmask_ptr, mrow, bitmask_stride, HAS_MASK, NMAX,
                             LANES, LW, FAST, RPL)
    return tok


@triton.jit
def _open_row_token(logits_ptr, row, V, inv_t, top_p, key, m, s_row, zrow_ptr, toks_ptr, lane_ptr, n_lanes, list_ptr,
                    cand_ptr, scratch_ptr, bitmask_ptr, mrow, bitmask_stride, HAS_MASK: tl.constexpr, NA: tl.constexpr,
                    NP: tl.constexpr, NPQ: tl.constexpr, NMAX: tl.constexpr, LANES: tl.constexpr, LW: tl.constexpr,
                    BLOCK: tl.constexpr, FAST: tl.constexpr, RPL: tl.constexpr, NG: tl.constexpr, LC: tl.constexpr,
                    CMAX: tl.constexpr, KP: tl.constexpr, HB: tl.constexpr, SMALL: tl.constexpr):
    """The token of a row whose first NA proposals (those the mass-above pass tested) all missed the top-p set T,
    from the pass's lane maxima (lane_ptr, the row's n_lanes), in a bounded number of sweeps over a few lanes, not
    over the row. t_lo: the largest z of those proposals; the mass above it is >= p * s, so every token of T has
    z > t_lo and sits in a lane whose max does. (1) Those lanes listed (list_ptr); (2) their tokens > t_lo
    written compactly (cand_ptr, at most CMAX), and the mass above each of the pass's other proposals NA .. NP - 1
    summed over them (exact: every token above such a proposal is a candidate, or the proposal lies at or below
    t_lo and misses); the first of those inside T is the token. Rows missing them all (p 0.5: 0.4% of rows with
    NP = 8): proposals NP .. NMAX - 1 by loops over the row (`_more_proposals`; none when NP = NMAX), then the
    rule's last draw: (3) tau from the candidates (threshold._top_p_cut against p * s_row: a histogram narrowing,
    then all pairs; on a block of SMALL when they are at most that many, else of CMAX); (4) the lanes with max
    >= tau listed again and drawn by the sampling pass's rule (threshold._draw_lanes), LC lanes at a time. More
    than CMAX tokens above t_lo, or a bracket the exact sums refute: tau from the row-wide bisection (slow, rare),
    then the same draw."""
    jj = tl.arange(0, NPQ)
    zs = tl.load(zrow_ptr + 2 + jj, mask=jj < NP, other=float("-inf"))
    t_lo = tl.max(tl.where(jj < NA, zs, float("-inf")), 0)
    g = tl.arange(0, NG)
    # the other proposals' z in entries 0 .. NP - NA - 1 (+inf past them: nothing is above)
    ze = tl.load(zrow_ptr + 2 + NA + jj, mask=jj < NP - NA, other=float("inf"))
    above = tl.zeros([NPQ], tl.float64)
    ref = m * 1.4426950408889634
    n_tok = 0
    # the lanes whose max is above t_lo, their tokens gathered LC lanes at a time
    lm = tl.load(lane_ptr + row * n_lanes + g, mask=g < n_lanes, other=float("-inf"))
    sel = lm > t_lo
    n_c = tl.sum(sel.to(tl.int32), 0)
    tl.store(list_ptr + tl.cumsum(sel.to(tl.int32), 0) - 1, g, mask=sel)
    tl.debug_barrier()                                          # the lane list's stores before its loads
    k = tl.arange(0, LW)
    for c0 in range(0, n_c, LC):
        i = c0 + tl.arange(0, LC)
        ok = i < n_c
        gl = tl.load(list_ptr + i, mask=ok, other=0)
        t = ((gl // LANES) * (LANES * LW) + gl % LANES)[:, None] + k[None, :] * LANES
        z = _kept_column(logits_ptr, row, t, ok[:, None], V, inv_t, t_lo, bitmask_ptr, mrow, bitmask_stride, HAS_MASK)
        z = tl.where(z > t_lo, z, float("-inf"))
        if NP > NA:
            above += _above_sums(z, _weights(z, ref), ze, jj, NP - NA, NPQ)
        is_c = (z > float("-inf")).to(tl.int32)
        per_lane = tl.sum(is_c, 1)
        at = n_tok + (tl.cumsum(per_lane, 0) - per_lane)[:, None] + tl.cumsum(is_c, 1) - 1
        tl.store(cand_ptr + at, z, mask=(is_c != 0) & (at < CMAX))
        n_tok += tl.sum(per_lane, 0)
    lim = top_p.to(tl.float64) * s_row
    tok = tl.full([], -2, tl.int64)
    if NP > NA:
        te = tl.load(toks_ptr + NA + jj, mask=jj < NP - NA, other=-1)
        for j in tl.static_range(NP - NA):
            zj = tl.sum(tl.where(jj == j, ze, 0.0), 0)
            hit = (zj > t_lo) & (tl.sum(tl.where(jj == j, above, 0.0), 0) < lim)
            tok = tl.where((tok == -2) & hit, tl.sum(tl.where(jj == j, te, 0), 0), tok)
    if tok == -2:
        tok = _more_proposals(logits_ptr, row, V, inv_t, key, m, lim, m, bitmask_ptr, mrow, bitmask_stride,
                              HAS_MASK, NP, NMAX, LANES, LW, BLOCK, FAST, False, RPL)
    if tok == -2:
        tl.debug_barrier()                                      # the candidates' stores before their loads
        tau = t_lo
        ok_cut = n_tok < 0
        small = n_tok < 0
        if SMALL > 0:       # few candidates (p 0.5 on flat rows: a few hundred): a block of SMALL, not CMAX
            small = n_tok <= SMALL
            if small:
                tau, ok_cut = _top_p_cut(cand_ptr, n_tok, m, tl.zeros([], tl.float64), 0.0, top_p, scratch_ptr,
                                         SMALL, KP, 32, HB, SMALL >= 1024, s_row)
        if (small == 0) & (n_tok <= CMAX):
            tau, ok_cut = _top_p_cut(cand_ptr, n_tok, m, tl.zeros([], tl.float64), 0.0, top_p, scratch_ptr, CMAX,
                                     KP, 32, HB, CMAX >= 1024, s_row)
        if not ok_cut:
            tau = _bisect_tau(logits_ptr, row, V, inv_t, V + 1, top_p, bitmask_ptr, mrow, bitmask_stride, HAS_MASK,
                              BLOCK)
        kept = lm >= tau
        n_k = tl.sum(kept.to(tl.int32), 0)
        tl.debug_barrier()                                      # every load of the first list before the second
        tl.store(list_ptr + tl.cumsum(kept.to(tl.int32), 0) - 1, g, mask=kept)
        tl.debug_barrier()
        kf = proposal_key_tl(key, tl.full([], NMAX, tl.int32))
        best = tl.full([], MIN_PACKED_C, tl.int64)
        for c0 in range(0, n_k, LC):
            i = c0 + tl.arange(0, LC)
            ok = i < n_k
            gl = tl.load(list_ptr + i, mask=ok, other=0)
            lml = tl.load(lane_ptr + row * n_lanes + gl, mask=ok, other=float("-inf"))
            b, _, _ = _draw_lanes(logits_ptr, row, gl, ok, lml, V, inv_t, tau, kf, bitmask_ptr, mrow, bitmask_stride,
                                  HAS_MASK, LANES, LW, FAST)
            best = tl.maximum(best, b)
        tok = tl.where((best >> 32) > NEG_INF_KEY_C, _unpack(best), -1)
    return tok


@triton.jit
def _row_token(logits_ptr, tok_ptr, dec_ptr, zrow_ptr, pmax_ptr, pmass_ptr, part_ptr, row, inv_t_ptr, top_p_ptr,
               keys_ptr, bitmask_ptr, mask_rows_ptr, bitmask_stride, V, n_prog, n_seg, lane_ptr, n_lanes, list_ptr,
               cand_ptr, HAS_MASK: tl.constexpr, NP: tl.constexpr, NPP: tl.constexpr,
               NPQ: tl.constexpr, NSP: tl.constexpr, NMAX: tl.constexpr, LANES: tl.constexpr, LW: tl.constexpr,
               BLOCK: tl.constexpr, FAST: tl.constexpr, RPL: tl.constexpr, HOT: tl.constexpr, NG: tl.constexpr,
               LC: tl.constexpr, CMAX: tl.constexpr, KP: tl.constexpr, HB: tl.constexpr, SMALL: tl.constexpr,
               NA: tl.constexpr):
    """A row's token: `_tokens_kernel`'s decision where it made one; a top-p-alone row it left open takes its first
    proposal j < NA whose mass above is < p * s (s: the pass's program masses, rescaled to the row max and summed
    in fp64; the masses above: sums of `_above_kernel`'s fp64 parts), else the rest of the rule: with the pass's
    lane maxima (HOT) `_open_row_token` (proposals NA .. NP - 1 on the candidates above the best missed one, then
    loops for NP .. NMAX - 1, then the draw restricted to the top-p set), without them `rest_of_rule` (loops over
    the row from proposal NA, the row-wide bisection). Proposals' tokens from `_tokens_kernel`, their z from zrow.
    -1: nothing allowed."""
    tok = tl.load(dec_ptr + row)
    if tok == -2:
        m, s_row = _row_mass(pmax_ptr, pmass_ptr, row, n_prog, NPP)
        tok = tl.full([], -1, tl.int64)
        if m > float("-inf"):
            c = tl.arange(0, NSP)
            base = part_ptr + (row * n_seg + c) * NA
            top_p = tl.load(top_p_ptr + row)
            lim = top_p.to(tl.float64) * s_row
            tok = tl.full([], -2, tl.int64)
            jj = tl.arange(0, NPQ)
            toks = tl.load(tok_ptr + row * NPQ + jj, mask=jj < NA, other=-1)
            for j in tl.static_range(NA):
                above = tl.sum(tl.load(base + j, mask=c < n_seg, other=0.0), 0)
                t = tl.sum(tl.where(jj == j, toks, 0), 0)
                tok = tl.where((tok == -2) & (above < lim), t, tok)
            if tok == -2:
                mrow = -1
                if HAS_MASK:
                    mrow = tl.load(mask_rows_ptr + row)
                inv_t = tl.load(inv_t_ptr + row)
                key = tl.load(keys_ptr + row).to(tl.uint32)
                if HOT:
                    tok = _open_row_token(logits_ptr, row, V, inv_t, top_p, key, m, s_row, zrow_ptr + row * (NPQ + 2),
                                          tok_ptr + row * NPQ, lane_ptr, n_lanes, list_ptr + row * n_lanes,
                                          cand_ptr + row * (CMAX + KP), cand_ptr + row * (CMAX + KP) + CMAX,
                                          bitmask_ptr, mrow, bitmask_stride, HAS_MASK, NA, NP, NPQ, NMAX, LANES, LW,
                                          BLOCK, FAST, RPL, NG, LC, CMAX, KP, HB, SMALL)
                else:
                    tok = rest_of_rule(logits_ptr, row, V, inv_t, top_p, key, m, lim, bitmask_ptr, mrow,
                                       bitmask_stride, HAS_MASK, NA, NMAX, LANES, LW, BLOCK, FAST, RPL)
    return tok


@triton.jit
def _reject_finish_kernel(logits_ptr, tok_ptr, dec_ptr, zrow_ptr, pmax_ptr, pmass_ptr, part_ptr, out_ptr, inv_t_ptr,
                          top_p_ptr, keys_ptr, bitmask_ptr, mask_rows_ptr, bitmask_stride, V, n_prog, n_seg, lane_ptr,
                          n_lanes, list_ptr, cand_ptr, HAS_MASK: tl.constexpr, NP: tl.constexpr,
                          NPP: tl.constexpr, NPQ: tl.constexpr, NSP: tl.constexpr, NMAX: tl.constexpr,
                          LANES: tl.constexpr, LW: tl.constexpr, BLOCK: tl.constexpr, FAST: tl.constexpr,
                          HOT: tl.constexpr = False, NG: tl.constexpr = 16, LC: tl.constexpr = 16,
                          CMAX: tl.constexpr = 16, KP: tl.constexpr = 16, HB: tl.constexpr = 16,
                          SMALL: tl.constexpr = 0, NA: tl.constexpr = 4, PDL: tl.constexpr = False):
    """Program (row): the row's token (`_row_token`)."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    tl.store(out_ptr + row, _row_token(logits_ptr, tok_ptr, dec_ptr, zrow_ptr, pmax_ptr, pmass_ptr, part_ptr, row,
                                       inv_t_ptr, top_p_ptr, keys_ptr, bitmask_ptr, mask_rows_ptr, bitmask_stride, V,
                                       n_prog, n_seg, lane_ptr, n_lanes, list_ptr, cand_ptr, HAS_MASK,
                                       NP, NPP, NPQ, NSP, NMAX, LANES, LW, BLOCK, FAST, min(LANES, 128), HOT, NG, LC,
                                       CMAX, KP, HB, SMALL, NA))


def finish_options(rows: int, np_: int, device) -> dict:
    """The finish's launch options: FINISH_WAVE for more rows than SMs when the pass drew PROPOSALS, else
    FINISH_WARPS warps (one program an SM)."""
    if np_ == PROPOSALS and not one_wave(rows, device):
        return FINISH_WAVE
    return dict(num_warps=FINISH_WARPS)


def reject_finish(logits, params, bitmask, mrows, packed, pmax, pmass, lane_max, drawn, seg: int, lanes: int,
                  np_: int, interpreting: bool, tau=None) -> torch.Tensor:
    """The tokens [R] int64 after a sampling pass with np_ proposals per program that stored lanes (DEFER; packed
    [R, n_prog, np_], pmax and pmass [R, n_prog], lane_max [R, lanes of the row] or None without HOT_LANES): the
    proposals' tokens per row, the mass-above pass over the top-p-alone rows, then the per-row finish. drawn: the
    top-k merge's tokens (-2: none) or None. tau: the rows' tau [R] when the pass cut at it (None: no row
    filtered)."""
    R, V = logits.shape
    n_prog = packed.shape[1]
    n_seg = triton.cdiv(V, seg)
    dev = logits.device
    na = min(np_, ABOVE_NP)                 # the proposals the mass-above pass tests (the finish tests the rest)
    part = torch.empty((R, n_seg, na), dtype=torch.float64, device=dev)
    npq = triton.next_power_of_2(np_ + 1)
    toks = torch.empty((R, npq), dtype=torch.int64, device=dev)
    dec = torch.empty((R,), dtype=torch.int64, device=dev)
    has_mask = bitmask is not None
    bm = bitmask if has_mask else logits
    mr = mrows if has_mask else packed
    stride = bitmask.stride(0) if has_mask else 0
    warps = max(1, min(ABOVE_WARPS, lanes // 32))
    npp = max(16, triton.next_power_of_2(n_prog))
    out = empty((R,), torch.int64, dev)
    if STAGES < 1:
        return out
    flags = dict(HAS_MASK=has_mask, NP=np_, NPQ=npq, LANES=lanes, LW=seg // lanes, FAST=not interpreting)
    zrow = torch.empty((R, npq + 2), dtype=torch.float32, device=dev)
    _tokens_kernel[(R,)](packed, toks, dec, zrow, pmax, logits, params.inv_temperature, params.greedy, params.top_k,
                         params.top_p, params.keys, tau if tau is not None else pmax, bm, mr, stride, V, n_prog, drawn,
                         DONE=drawn is not None, HAS_TAU=tau is not None, NPP=npp, NA=na, num_warps=1, **flags,
                         **pdl_kw())
    hot = lane_max is not None
    n_l = lane_max.shape[1] if hot else 1
    hotcap = min(HOTCAP, lanes)
    hot_buf = torch.empty((R, n_seg, hotcap) if hot else (1,), dtype=torch.int32, device=dev)
    _above_kernel[(R, n_seg)](logits, zrow, pmax, part, params.inv_temperature, bm, mr, stride, V, n_prog, n_seg,
                              lane_max if hot else pmax, n_l if hot else 0, hot_buf,
                              VEC=max(1, lanes // (32 * warps)), HOT=hot, HOTCAP=hotcap, PER=n_prog // n_seg,
                              NAQ=triton.next_power_of_2(na + 1), num_warps=warps, **dict(flags, NP=na), **pdl_kw())
    if STAGES < 2:
        return out
    cmax = min(OPEN_CMAX, max(16, triton.next_power_of_2(V)))
    ng = max(16, triton.next_power_of_2(n_l))
    # the open rows' work space (`_open_row_token`): a lane list; the candidates above t_lo, then KP floats of
    # all-pairs scratch
    lane_list = torch.empty((R, n_l) if hot else (1,), dtype=torch.int32, device=dev)
    cand = torch.empty((R, cmax + threshold.KP) if hot else (1,), dtype=torch.float32, device=dev)
    _reject_finish_kernel[(R,)](logits, toks, dec, zrow, pmax, pmass, part, out, params.inv_temperature, params.top_p,
                                params.keys, bm, mr, stride, V, n_prog, n_seg, lane_max if hot else pmax, n_l,
                                lane_list, cand,
                                NPP=npp, NSP=max(16, triton.next_power_of_2(n_seg)), NMAX=NMAX,
                                BLOCK=min(1024, triton.next_power_of_2(V)), HOT=hot, NG=ng, LC=min(OPEN_LC, ng),
                                CMAX=cmax, KP=threshold.KP, HB=threshold.HB_CUT, SMALL=min(OPEN_SMALL, cmax // 2),
                                NA=na, **finish_options(R, np_, dev), **flags, **pdl_kw())
    return out
