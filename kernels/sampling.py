"""Fused masked sampling: bitmask + temperature + top-k/top-p + seeded sampling.

The processed distribution q of a row (shared with kernels/speculative.py; the engine's contract):
- allowed tokens: bit set in the row's bitmask (if one is given) and logit > -inf;
- temperature T > 0: z = logit * (1/T) (the reciprocal is taken once, in fp32, on the torch side);
  T <= 0 means greedy: q is one-hot on the allowed argmax (lowest id on ties);
- top-k (k >= 1, 0 = off), then top-p (0 < p <= 1, 1 = off) on the renormalised top-k set (the engine's order,
  engine/sampler.py, and vLLM's): the top-k set K = {v : fewer than k allowed tokens have z > z_v} (all allowed
  tokens when top-k is off; ties with the k-th value stay in); keep v in K iff the softmax mass of the tokens with
  z > z_v is < p times the mass of K (every such token is in K). Ties with the last kept token stay in. The kept
  set is {z >= tau} for one threshold tau;
- q = softmax(z) restricted to the kept set. A row with no allowed token samples -1.

Sampling is Gumbel-max over lanes of 16 tokens, then inverse CDF inside the winning lane. The vocabulary is cut
in segments of SEG = 4096 ids, each seen as LANES = 256 lanes: lane g = c * LANES + l holds the ids
c*SEG + k*LANES + l (k = 0..15), so that on a GPU each thread owns whole lanes while the loads stay coalesced.
For each lane, over its kept tokens: M_g = max z, weights w_v = exp(z_v - M_g), mass S_g = sum w_v;
- inside lane g, a candidate t_g by inverse CDF with one uniform u_g: the first kept token (in k order) whose
  running sum exceeds u_g * S_g (the target is kept strictly below S_g, so t_g always has w > 0);
- across all lanes of the row, Gumbel-max on the log-masses: argmax_g M_g + ln S_g + G_g; the token is that t_g.
Exact: P(g) = e^M_g S_g / sum_g' e^M_g' S_g' (Gumbel-max) and P(v | g) = w_v / S_g (inverse CDF), so
P(v) = e^z_v / sum over kept = q_v, up to fp32 rounding of the running sums (~1e-7 of a lane's mass) and the
23-bit uniforms (a token with less than ~2**-23 of its lane's mass is drawn at a rate rounded to that grain;
plain per-token Gumbel-max with 23-bit uniforms has the same grain: its noise is capped at 16.6). The twins
compute the same function with the same formulas; the kernels round some sums in another order and use the
hardware log2 for the per-lane noise (~1e-5 absolute), so a token can differ from the twin's only on near-ties
(~1e-5 of rows).
RNG quality argument: u_g and G_g are counter-based (kernels/rng.py; key from seed, position and stream FRESH,
ids 2**30 + g and 2**30 + 2**29 + g, apart from any token id), so a draw is a pure function of (seed, position,
q) whatever the batch. Each is the top 23 bits of lowbias32 (a bijective 32-bit mixer with near-ideal avalanche)
of (key XOR id * golden ratio), the key itself five rounds of it over (seed, position, stream): draws of one row
are distinct ids under one key, those of other rows or positions distinct keys; 2 draws per 16 tokens (~16k per
row) is far below anything such a mixer's statistics show; the tests check the law end to end (binomial bounds
and chi-square against softmax computed in float64).
Cost: per token a load, a max, an FMA + exp2 (ex2.approx.ftz: one instruction) and an add (~10 instructions
with the per-lane hash and logs amortised over 16 tokens), and per (row, segment) program ONE block reduction
(the packed best lane: score and lane number). The inverse-CDF pick inside the lane runs only for the row's
winning lane, in the finish kernel (`_late_token`: the pass's operations on that lane's 16 tokens, in the same
order). Before (session 2) the pick ran in the pass for every lane (~14 instructions per token); the per-token
Gumbel noise before that (a hash and two logs per token, ~41 instructions) made the pass arithmetic-bound.
Greedy rows (T <= 0): per lane the first maximum, then the highest score / lowest id across lanes.
The Triton path is one program per (row, segment) with the whole segment in registers, each writing one packed
int64 (ordered score bits, then the complement of the lane number (greedy rows: of the token id), so an integer
max picks the highest score and then the lowest number), and `_finish_late_kernel` takes the row's max and picks
the token in the winning lane: two launches.
Rows with top-k/top-p first get their exact tau from kernels/threshold.py: rows with top_k <= 64 by a candidate
pass (one read: each segment keeps its tokens above a bound from its lane maxima) and a per-row merge; other
filtered rows by the histogram path (histogram pass, selection, candidate compaction, tau). Those kernels run
only when some row may filter: decided on the host when top_k/top_p come from the host (sample_from_logits does
this), otherwise assumed.
Persistent variant (`persistent=P`): P programs per SM loop over the (row, segment) items and issue the next
item's loads before computing the current one (`_segment_loop_kernel`; same draws).
Measured on an H200: see benchmarks/kernels_sampling.py (its docstring holds the latest table).
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import rng
from .backend import INTERPRETING, check, empty, use_triton
from .threshold import _below, _ordered, exp2_w, needs_histogram_path, thresholds_and_paths, thresholds_triton

NEG_INF = float("-inf")


@dataclass
class RowParams:
    """Per-row sampling parameters as device tensors (built by `row_params`)."""
    inv_temperature: torch.Tensor   # float32 [R]; 1/T, or 1.0 for greedy rows
    greedy: torch.Tensor            # bool [R]
    top_k: torch.Tensor             # int64 [R]; 0 = off
    top_p: torch.Tensor             # float32 [R]; 1.0 = off
    keys: torch.Tensor              # int64 [R]; rng row keys (32-bit values)


def _per_row(x, n, dtype, device, name):
    t = torch.as_tensor(x, dtype=dtype, device=device)
    if t.dim() == 0:
        t = t.expand(n)
    check(t.shape == (n,), f"{name} must be a scalar or have one entry per row ({n}), got shape {tuple(t.shape)}")
    return t.contiguous()


def row_params(n_rows, device, temperature, top_k, top_p, seed, position, stream=rng.FRESH) -> RowParams:
    """Validate and pack per-row parameters (scalars broadcast to every row)."""
    temp = _per_row(temperature, n_rows, torch.float32, device, "temperature")
    k = _per_row(top_k, n_rows, torch.int64, device, "top_k")
    p = _per_row(top_p, n_rows, torch.float32, device, "top_p")
    seed = _per_row(seed, n_rows, torch.int64, device, "seed")
    pos = _per_row(position, n_rows, torch.int64, device, "position")
    if n_rows and not temp.is_cuda:     # cheap on CPU; on CUDA these checks would force a host sync
        check(bool((k >= 0).all()), f"top_k must be >= 0 (0 = off), got {k.tolist()}")
        check(bool(((p > 0) & (p <= 1)).all()), f"top_p must be in (0, 1], got {p.tolist()}")
        check(bool(torch.isfinite(temp).all()), f"temperature must be finite, got {temp.tolist()}")
    greedy = temp <= 0
    safe_t = torch.where(greedy, torch.ones_like(temp), temp)
    inv_t = torch.where(greedy, torch.ones_like(temp), 1.0 / safe_t)
    return RowParams(inv_t.float(), greedy, k, p, rng.row_keys(seed, pos, stream))


def default_mask_rows(mask_rows, n_rows, device):
    if mask_rows is None:
        return torch.arange(n_rows, device=device)
    return torch.as_tensor(mask_rows, device=device).to(torch.int64).contiguous()


# ---------------------------------------------------------------------------------------------- torch twin
def masked_z_torch(logits, inv_temperature, bitmask=None, mask_rows=None):
    """z = logits * (1/T) with -inf at banned tokens (fp32 [R, V])."""
    z = logits.float() * inv_temperature[:, None]
    if bitmask is None:
        return z
    R, V = z.shape
    mrows = default_mask_rows(mask_rows, R, z.device)
    words = bitmask[mrows.clamp_min(0)]
    bits = (words.unsqueeze(-1) >> torch.arange(32, device=z.device, dtype=torch.int32)) & 1
    allowed = bits.reshape(R, -1)[:, :V].bool() | (mrows < 0)[:, None]
    return z.masked_fill(~allowed, NEG_INF)


def thresholds_torch(z, params: RowParams) -> torch.Tensor:
    """tau [R]: the smallest kept z under top-k/top-p (-inf for rows without filters, greedy rows, empty rows)."""
    R, V = z.shape
    filt = (((params.top_k > 0) & (params.top_k < V)) | (params.top_p < 1)) & ~params.greedy
    tau = torch.full((R,), NEG_INF, device=z.device)
    if not bool(filt.any()):
        return tau
    zs, _ = z.sort(1, descending=True)
    m = zs[:, :1].clamp_min(-3e38)
    ps = torch.exp(zs - m)
    mass_excl = torch.cumsum(ps, 1) - ps
    first = torch.searchsorted(-zs, -zs, side="left")       # first index of each tie group = count(z > z_v)
    mass_gt = torch.gather(mass_excl, 1, first)
    k = torch.where(params.top_k > 0, params.top_k, torch.full_like(params.top_k, V + 1))
    in_k = (first < k[:, None]) & (zs > NEG_INF)
    mass_k = torch.where(in_k, ps, torch.zeros_like(ps)).sum(1, keepdim=True)       # top-k renormalisation
    ok = in_k & ((mass_gt < params.top_p[:, None] * mass_k) | (params.top_p[:, None] >= 1))     # p = 1: off
    best = torch.where(ok, zs, torch.full_like(zs, float("inf"))).min(1).values
    return torch.where(filt & (best < float("inf")), best, tau)


def kept_z_torch(logits, params: RowParams, bitmask=None, mask_rows=None) -> torch.Tensor:
    """z with -inf outside the kept set; greedy rows keep only their first maximum."""
    z = masked_z_torch(logits, params.inv_temperature, bitmask, mask_rows)
    z = z.masked_fill(z < thresholds_torch(z, params)[:, None], NEG_INF)
    onehot = torch.zeros_like(z, dtype=torch.bool).scatter_(1, z.argmax(1, keepdim=True), True)
    return torch.where(params.greedy[:, None] & ~onehot, torch.full_like(z, NEG_INF), z)


def probs_torch(logits, params: RowParams, bitmask=None, mask_rows=None) -> torch.Tensor:
    """The processed distribution q [R, V] fp32 (all zeros for a row with no allowed token)."""
    z = kept_z_torch(logits, params, bitmask, mask_rows)
    q = torch.softmax(z, 1)
    return torch.nan_to_num(q, nan=0.0)


SEG = 4096                      # tokens per vocab segment (part of the sampling rule: see the module docstring)
U_ID = 1 << 30                  # rng ids of the per-lane uniforms u_g (token ids are < 2**30)
G_ID = (1 << 30) + (1 << 29)    # rng ids of the per-lane Gumbel noise G_g
LANES = 256                     # lanes per segment: lane l of segment c holds ids c*SEG + k*LANES + l
LOG2E = 1.4426950408889634


def _below_torch(target: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return torch.minimum(target.view(torch.int32), s.view(torch.int32) - 1).view(torch.float32)


def _first_above_torch(w: torch.Tensor, cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Index of the first entry (last dim) with w > 0 and running sum > target; the length if none."""
    hit = (w > 0) & (cdf > target[..., None])
    return torch.where(hit.any(-1), hit.to(torch.int8).argmax(-1), torch.full_like(target, w.shape[-1],
                                                                                     dtype=torch.int64))


def n_lanes(V: int, seg: int = SEG, lanes: int = LANES) -> int:
    """Lanes holding at least one token: a prefix of the lane numbers (the last segment may be partial)."""
    full, rest = divmod(V, seg)
    return full * lanes + min(lanes, rest)


def lane_ids_torch(n: int, seg: int, lanes: int, device) -> torch.Tensor:
    """int64 [n, seg // lanes]: the token id of each (lane, k) (ids past V are padding)."""
    g = torch.arange(n, device=device)
    k = torch.arange(seg // lanes, device=device)
    return (g // lanes * seg + g % lanes)[:, None] + k[None, :] * lanes


def lanes_view(x: torch.Tensor, fill: float, seg: int = SEG, lanes: int = LANES) -> torch.Tensor:
    """[R, V] -> [R, G, seg // lanes] (padded with `fill`): row r's lane g = c * lanes + l holds the ids
    c * seg + k * lanes + l, k = 0 .. seg // lanes - 1 (in that order); G = n_lanes(V)."""
    R, V = x.shape
    ids = lane_ids_torch(n_lanes(V, seg, lanes), seg, lanes, x.device)
    ext = torch.cat([x, torch.full((R, 1), fill, dtype=x.dtype, device=x.device)], 1)
    return ext[:, ids.clamp_max(V)]


def lane_draw_torch(w: torch.Tensor, keys: torch.Tensor):
    """Inverse-CDF draw inside every lane: w [R, G, LW] >= 0 -> (mass S [R, G], k [R, G]): the first k with
    w > 0 whose running sum exceeds u_g * S (target kept strictly below S; u_g = uniform(key, U_ID + g))."""
    cdf = torch.cumsum(w, -1)
    s = torch.where(w > 0, cdf, torch.zeros_like(cdf)).amax(-1)
    g = torch.arange(w.shape[1], device=w.device)
    target = _below_torch(rng.uniform(keys[:, None], g[None, :] + U_ID) * s, s)
    return s, _first_above_torch(w, cdf, target)


def lane_gumbel_torch(keys: torch.Tensor, n_lanes: int) -> torch.Tensor:
    """G_g [R, G]: each lane's Gumbel noise (id G_ID + g)."""
    return rng.gumbel(keys[:, None], torch.arange(n_lanes, device=keys.device)[None, :] + G_ID)


def pick_lane(score: torch.Tensor, k: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The drawn token of each row's best lane (the first on ties), -1 where every score is -inf."""
    best, g = score.max(1)
    tok = ids[g, k.gather(1, g[:, None])[:, 0].clamp_max(ids.shape[1] - 1)]
    return torch.where(best > NEG_INF, tok, torch.full_like(tok, -1))


def lane_scores_torch(z: torch.Tensor, keys: torch.Tensor, seg: int = SEG, lanes: int = LANES):
    """(score [R, G], k [R, G], ids [G, LW]): per lane M_g + ln S_g + G_g (-inf for a lane with nothing kept) and
    its inverse-CDF draw k (module docstring). Same function as the kernels up to the rounding of the sums."""
    zl = lanes_view(z, NEG_INF, seg, lanes)
    m = zl.amax(-1)
    ref = torch.where(m > NEG_INF, m, torch.zeros_like(m)) * LOG2E
    s, k = lane_draw_torch(torch.exp2(zl * LOG2E - ref[..., None]), keys)
    score = torch.where(s > 0, m + torch.log(s.clamp_min(1e-30)) + lane_gumbel_torch(keys, zl.shape[1]),
                        torch.full_like(m, NEG_INF))
    return score, k, lane_ids_torch(zl.shape[1], seg, lanes, z.device)


def sample_torch(logits, params: RowParams, bitmask=None, mask_rows=None, seg: int = SEG, lanes: int = LANES):
    z = kept_z_torch(logits, params, bitmask, mask_rows)
    drawn = pick_lane(*lane_scores_torch(z, params.keys, seg, min(lanes, seg)))
    best, tok = z.max(1)                                     # greedy rows: the first allowed maximum
    greedy = torch.where(best > NEG_INF, tok, torch.full_like(tok, -1))
    return torch.where(params.greedy, greedy, drawn)


# ---------------------------------------------------------------------------------------------- Triton pieces
@triton.jit
def pack_best(score, ids):
    """Per-lane best (score, id) -> one int64 per program: ordered score bits high, (2**32-1-id) low, so that an
    integer max picks the highest score and, among equal scores, the lowest id (the first maximum)."""
    bm = tl.max(score, 0)
    bid = tl.min(tl.where(score == bm, ids, 2147483647), 0)
    return pack_scalar(bm, bid)


@triton.jit
def pack_scalar(score, token):
    """One (score, id) pair -> the packed int64 of `pack_best`."""
    key = _ordered(score.to(tl.int32, bitcast=True)).to(tl.int64)
    return (key << 32) + (4294967295 - token.to(tl.int64))


@triton.jit
def _first_above(w, cdf, target, lane, NONE: tl.constexpr):
    """The first lane with w > 0 whose running sum exceeds target (NONE if there is none)."""
    return tl.min(tl.where((w > 0) & (cdf > target), lane, NONE), 0)


@triton.jit
def lane_pick(w, gid, key, LW: tl.constexpr):
    """Inverse-CDF draw inside every lane of a [LANES, LW] block of weights >= 0 (each lane held by one thread:
    no communication): (S [LANES], k [LANES]) = the lane mass and the first k whose running sum exceeds u * S
    (u = uniform(key, U_ID + gid), the target kept below S). Twin: lane_draw_torch.
    A lane's running sum is accumulated in-thread in k order, so it never decreases and it only grows at a w > 0:
    S is its last entry (= the largest running sum at a kept token, the twin's S), and the first entry above
    the target is the count of entries at or below it, a token with w > 0 (the target is > 0 when S > 0).
    ~3 instructions per token (add, compare, count)."""
    cdf = tl.cumsum(w, 1)
    k = tl.arange(0, LW)[None, :]
    s = tl.max(tl.where(k == LW - 1, cdf, float("-inf")), 1)              # the last entry: a register pick
    target = _below(rng.uniform_tl(key, gid + 1073741824) * s, s)            # U_ID + g
    return s, tl.sum((cdf <= target[:, None]).to(tl.int32), 1)


@triton.jit
def lane_score(m, s, key, gid, FAST: tl.constexpr):
    """M_g + ln S_g + G_g per lane (G_ID + g), -inf for an empty lane."""
    g = rng.gumbel_tl(key, gid + 1610612736, FAST)                          # G_ID + g
    return tl.where(s > 0, m + tl.log(tl.maximum(s, 1e-30)) + g, float("-inf"))


@triton.jit
def pack_lanes(score, token):
    """The packed best (score, lowest id on ties) of a block's lanes: one block reduction."""
    key = _ordered(score.to(tl.int32, bitcast=True)).to(tl.int64)
    return tl.max((key << 32) + (4294967295 - token.to(tl.int64)), 0)


@triton.jit
def _kept_x(logits_ptr, tau_ptr, row, start, offs, V, inv_t, words, bits, HAS_MASK: tl.constexpr,
            HAS_TAU: tl.constexpr, FULL: tl.constexpr):
    """Logits of tokens start + offs of a row as fp32, -inf where not kept (padding, banned, below tau). With
    HAS_TAU the values are z = x / T, else raw logits x (which order like z: 1/T > 0). FULL: no token is past V
    (no bounds checks). words/bits (broadcastable to offs): each token's bitmask word and its bit as a mask
    (1 << bit index: one AND per token)."""
    ptrs = logits_ptr + row * V + start + offs
    if FULL:
        x = tl.load(ptrs).to(tl.float32)
    else:
        x = tl.load(ptrs, mask=offs < V - start, other=float("-inf")).to(tl.float32)
    if HAS_MASK:
        x = tl.where((words & bits) != 0, x, float("-inf"))
    if HAS_TAU:
        x = x * inv_t
        x = tl.where(x >= tl.load(tau_ptr + row), x, float("-inf"))
    return x


@triton.jit
def segment_block(logits_ptr, tau_ptr, bitmask_ptr, row, seg, inv_t, mrow, bitmask_stride, V, HAS_MASK: tl.constexpr,
                  HAS_TAU: tl.constexpr, FULL: tl.constexpr, LANES: tl.constexpr, LW: tl.constexpr):
    """Segment `seg` of a row as a [LANES, LW] block of kept logits (`_kept_x`): token start + k * LANES + l, lanes
    along dim 0 (contiguous in memory, spread over threads), a lane's tokens along dim 1 (strided; held by one
    thread, so per-lane work needs no communication). Returns (start, lane, pos, x)."""
    start = seg * (LANES * LW)
    lane = tl.arange(0, LANES)
    k = tl.arange(0, LW)
    pos = lane[:, None] + k[None, :] * LANES
    words = 0
    if HAS_MASK:
        # token start + pos sits in word (start + pos) // 32 at bit pos % 32 (start, LANES multiples of 32); the
        # offsets keep dim 0 first in contiguity so that the words load takes the logits' layout
        wptr = bitmask_ptr + mrow * bitmask_stride + (start + k[None, :] * LANES) // 32 + lane[:, None] // 32
        if FULL:
            words = tl.load(wptr, mask=mrow >= 0, other=-1)
        else:
            words = tl.load(wptr, mask=(mrow >= 0) & (start + pos < V), other=-1)
    x = _kept_x(logits_ptr, tau_ptr, row, start, pos, V, inv_t, words, (1 << (lane % 32))[:, None], HAS_MASK,
                HAS_TAU, FULL)
    return start, lane, pos, x


@triton.jit
def _segment_body(logits_ptr, packed_ptr, tau_ptr, row, seg, inv_t, greedy, key, bitmask_ptr, mrow,
                  bitmask_stride, V, n_seg, HAS_MASK: tl.constexpr, HAS_TAU: tl.constexpr, FULL: tl.constexpr,
                  LANES: tl.constexpr, LW: tl.constexpr, FAST: tl.constexpr, LATE: tl.constexpr = False):
    start, lane, pos, x = segment_block(logits_ptr, tau_ptr, bitmask_ptr, row, seg, inv_t, mrow, bitmask_stride, V,
                                       HAS_MASK, HAS_TAU, FULL, LANES, LW)
    tl.store(packed_ptr + row * n_seg + seg, segment_pack(x, seg, inv_t, greedy, key, HAS_TAU, LANES, LW, FAST,
                                                          LATE))


@triton.jit
def segment_pack(x, seg, inv_t, greedy, key, HAS_TAU: tl.constexpr, LANES: tl.constexpr, LW: tl.constexpr,
                 FAST: tl.constexpr, LATE: tl.constexpr = False):
    """The packed best lane of a segment block x [LANES, LW] of kept logits (`segment_block`): greedy rows the
    first maximum, others the lane draw (module docstring). LATE: non-greedy rows pack (score, lane number) and
    leave the inverse-CDF pick inside the lane to the finish, which does it for the row's winning lane only
    (`_late_pick`): the pass then spends per token only a max, an FFMA, an exp2 and an add."""
    lane = tl.arange(0, LANES)
    start = seg * (LANES * LW)
    xm = tl.max(x, 1)                                       # per lane, in-thread
    if greedy:
        pos = lane[:, None] + tl.arange(0, LW)[None, :] * LANES
        first = tl.min(tl.where(x == xm[:, None], pos, LANES * LW), 1)
        packed = pack_lanes(xm, start + first)
    else:
        # weights exp(z - M_g) = 2^(x * c - M_g * log2 e), c = log2(e) / T (log2 e when x is z already)
        c = 1.4426950408889634
        m = xm
        if not HAS_TAU:
            c = inv_t * 1.4426950408889634
            m = xm * inv_t                                  # = the lane's max z exactly: rounding is monotone
        ref = tl.where(m > float("-inf"), m, 0.0) * 1.4426950408889634
        gid = seg * LANES + lane
        if LATE:
            cdf = tl.cumsum(exp2_w(x * c - ref[:, None], FAST), 1)             # in-thread, in k order
            s = tl.max(tl.where(tl.arange(0, LW)[None, :] == LW - 1, cdf, float("-inf")), 1)
            packed = pack_lanes(lane_score(m, s, key, gid, FAST), gid)
        else:
            s, kk = lane_pick(exp2_w(x * c - ref[:, None], FAST), gid, key, LW)
            packed = pack_lanes(lane_score(m, s, key, gid, FAST), start + tl.minimum(kk, LW - 1) * LANES + lane)
    return packed


@triton.jit
def _item_load(logits_ptr, inv_t_ptr, greedy_ptr, tau_ptr, keys_ptr, bitmask_ptr, mask_rows_ptr, bitmask_stride,
               item, n_items, V, n_seg, HAS_MASK: tl.constexpr, HAS_TAU: tl.constexpr, LANES: tl.constexpr,
               LW: tl.constexpr):
    """Issue the loads of work item `item` = row * n_seg + seg (nothing past n_items): the raw logits block, its
    mask words and the row's parameters. Nothing here waits for the data (the caller uses it one item later)."""
    live = item < n_items
    row = (item // n_seg).to(tl.int64)
    start = (item % n_seg) * (LANES * LW)
    lane = tl.arange(0, LANES)
    k = tl.arange(0, LW)
    pos = lane[:, None] + k[None, :] * LANES
    lim = tl.where(live, V - start, 0)
    x = tl.load(logits_ptr + row * V + start + pos, mask=pos < lim, other=float("-inf"))
    inv_t = tl.load(inv_t_ptr + row, mask=live, other=1.0)
    greedy = tl.load(greedy_ptr + row, mask=live, other=0)
    key = tl.load(keys_ptr + row, mask=live, other=0)
    tau = float("-inf")
    if HAS_TAU:
        tau = tl.load(tau_ptr + row, mask=live, other=float("-inf"))
    words = 0
    if HAS_MASK:
        mrow = tl.load(mask_rows_ptr + row, mask=live, other=-1)
        wptr = bitmask_ptr + mrow * bitmask_stride + (start + k[None, :] * LANES) // 32 + lane[:, None] // 32
        words = tl.load(wptr, mask=(mrow >= 0) & (pos < lim), other=-1)
    return x, words, inv_t, greedy, key, tau


@triton.jit
def _segment_loop_kernel(logits_ptr, packed_ptr, inv_t_ptr, greedy_ptr, tau_ptr, keys_ptr, bitmask_ptr,
                         mask_rows_ptr, bitmask_stride, V, n_seg, n_items, HAS_MASK: tl.constexpr,
                         HAS_TAU: tl.constexpr, LANES: tl.constexpr, LW: tl.constexpr, FAST: tl.constexpr):
    """Persistent variant of `_segment_kernel`: program p handles items p, p + P, p + 2P, ... (item = row * n_seg
    + seg) and issues the loads of its next item before computing the current one, so a program's arithmetic
    overlaps its own next read (with one program per item, every program's loads complete together at the end
    of the read and all the arithmetic follows it)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    x, words, inv_t, greedy, key, tau = _item_load(logits_ptr, inv_t_ptr, greedy_ptr, tau_ptr, keys_ptr, bitmask_ptr,
                                                   mask_rows_ptr, bitmask_stride, pid, n_items, V, n_seg, HAS_MASK,
                                                   HAS_TAU, LANES, LW)
    lane = tl.arange(0, LANES)
    for item in range(pid, n_items, nprog):
        xn, wn, inv_tn, greedyn, keyn, taun = _item_load(logits_ptr, inv_t_ptr, greedy_ptr, tau_ptr, keys_ptr,
                                                         bitmask_ptr, mask_rows_ptr, bitmask_stride, item + nprog,
                                                         n_items, V, n_seg, HAS_MASK, HAS_TAU, LANES, LW)
        z = x.to(tl.float32)
        if HAS_MASK:
            z = tl.where((words & (1 << (lane % 32))[:, None]) != 0, z, float("-inf"))
        if HAS_TAU:
            z = z * inv_t
            z = tl.where(z >= tau, z, float("-inf"))
        seg = item % n_seg
        packed = segment_pack(z, seg, inv_t, greedy != 0, key.to(tl.uint32), HAS_TAU, LANES, LW, FAST)
        tl.store(packed_ptr + item, packed)
        x, words, inv_t, greedy, key, tau = xn, wn, inv_tn, greedyn, keyn, taun


@triton.jit
def _segment_kernel(logits_ptr, packed_ptr, inv_t_ptr, greedy_ptr, tau_ptr, keys_ptr,
                    bitmask_ptr, mask_rows_ptr, bitmask_stride, V, n_seg, out_ptr, count_ptr, NEG_INF_KEY,
                    HAS_MASK: tl.constexpr, HAS_TAU: tl.constexpr, LANES: tl.constexpr, LW: tl.constexpr,
                    ONE_LAUNCH: tl.constexpr, NCP: tl.constexpr, FAST: tl.constexpr, done_ptr=None,
                    DONE: tl.constexpr = False, LATE: tl.constexpr = False):
    """Program (row, segment): the segment as [LANES, LW] in registers (lane l: tokens start + k * LANES + l,
    held by one thread). Every lane computes in-thread its max, weights, running sum and inverse-CDF candidate,
    then its score M_g + ln S_g + G_g (greedy rows: max z and its first id); one block reduction packs the
    segment's best lane.
    ONE_LAUNCH: the row's last program to finish (a per-row counter, acq_rel) also reduces the row's packs into
    out_ptr and resets the counter, saving `_finish_kernel`'s launch.
    DONE: rows whose done entry is not -2 were drawn already (the top-k merge): their programs return at once."""
    row = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    if DONE:
        if tl.load(done_ptr + row) != -2:
            return
    inv_t = tl.load(inv_t_ptr + row)
    greedy = tl.load(greedy_ptr + row) != 0
    key = tl.load(keys_ptr + row).to(tl.uint32)
    mrow = -1
    if HAS_MASK:
        mrow = tl.load(mask_rows_ptr + row)
    if (seg + 1) * (LANES * LW) <= V:
        _segment_body(logits_ptr, packed_ptr, tau_ptr, row, seg, inv_t, greedy, key, bitmask_ptr, mrow,
                      bitmask_stride, V, n_seg, HAS_MASK, HAS_TAU, True, LANES, LW, FAST, LATE)
    else:
        _segment_body(logits_ptr, packed_ptr, tau_ptr, row, seg, inv_t, greedy, key, bitmask_ptr, mrow,
                      bitmask_stride, V, n_seg, HAS_MASK, HAS_TAU, False, LANES, LW, FAST, LATE)
    if ONE_LAUNCH:
        # release: this program's pack is visible before its count; the last one acquires all of them
        if tl.atomic_add(count_ptr + row, 1, sem="acq_rel") == n_seg - 1:
            c = tl.arange(0, NCP)
            p = tl.load(packed_ptr + row * n_seg + c, mask=c < n_seg, other=-9223372036854775807, volatile=True)
            best = tl.max(p, 0)
            tl.store(out_ptr + row, tl.where((best >> 32) > NEG_INF_KEY, 4294967295 - (best & 4294967295), -1))
            tl.atomic_xchg(count_ptr + row, 0)                  # ready for the next launch


@triton.jit
def _finish_kernel(packed_ptr, out_ptr, n_chunks, NEG_INF_KEY, BLOCK: tl.constexpr, done_ptr=None,
                   DONE: tl.constexpr = False):
    """Per row: max over the chunk winners, then unpack to a token id (-1 if the best score is -inf); DONE: the
    rows drawn already keep their token."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    drawn = -2
    if DONE:
        drawn = tl.load(done_ptr + row)
    if drawn != -2:
        tl.store(out_ptr + row, drawn.to(tl.int64))
    else:
        p = tl.load(packed_ptr + row * n_chunks + c, mask=c < n_chunks, other=-9223372036854775807)
        best = tl.max(p, 0)
        tok = 4294967295 - (best & 4294967295)
        tl.store(out_ptr + row, tl.where((best >> 32) > NEG_INF_KEY, tok, -1))


@triton.jit
def _late_token(logits_ptr, row, g, inv_t, key, tau, bitmask_ptr, mrow, bitmask_stride, V,
                HAS_MASK: tl.constexpr, HAS_TAU: tl.constexpr, LANES: tl.constexpr, LW: tl.constexpr,
                FAST: tl.constexpr):
    """The inverse-CDF pick inside lane g of a row, with the very operations of the segment pass in the same order
    (scalars, k = 0 .. LW-1: the lane max, weights, running sum; `lane_pick`'s rule), so its lane mass is the one
    the pass scored. Three unrolled sweeps over the lane's LW logits (16 loads, from L2)."""
    start = (g // LANES) * (LANES * LW)
    l = g % LANES
    if not FAST:     # the interpreter: one vector (numpy's running sums are sequential too), much faster there
        k = tl.arange(0, LW)
        x = _lane_x(logits_ptr, row, start + k * LANES + l, inv_t, tau, bitmask_ptr, mrow, bitmask_stride, V,
                    HAS_MASK, HAS_TAU)
        s, kk = lane_pick(_lane_w(x[None, :], inv_t, HAS_TAU, FAST), g[None], key, LW)
        return start + tl.minimum(tl.sum(kk, 0), LW - 1) * LANES + l
    xm = float("-inf")
    for k in tl.static_range(LW):
        xm = tl.maximum(xm, _lane_x(logits_ptr, row, start + k * LANES + l, inv_t, tau, bitmask_ptr, mrow,
                                    bitmask_stride, V, HAS_MASK, HAS_TAU))
    c = 1.4426950408889634
    m = xm
    if not HAS_TAU:
        c = inv_t * 1.4426950408889634
        m = xm * inv_t
    ref = tl.where(m > float("-inf"), m, 0.0) * 1.4426950408889634
    s = 0.0
    for k in tl.static_range(LW):
        x = _lane_x(logits_ptr, row, start + k * LANES + l, inv_t, tau, bitmask_ptr, mrow, bitmask_stride, V,
                    HAS_MASK, HAS_TAU)
        s = s + exp2_w(x * c - ref, FAST)
    target = _below(rng.uniform_tl(key, g + 1073741824) * s, s)               # U_ID + g
    cdf = 0.0
    kk = 0
    for k in tl.static_range(LW):
        x = _lane_x(logits_ptr, row, start + k * LANES + l, inv_t, tau, bitmask_ptr, mrow, bitmask_stride, V,
                    HAS_MASK, HAS_TAU)
        cdf = cdf + exp2_w(x * c - ref, FAST)
        kk += (cdf <= target).to(tl.int32)
    return start + tl.minimum(kk, LW - 1) * LANES + l


@triton.jit
def _lane_w(x, inv_t, HAS_TAU: tl.constexpr, FAST: tl.constexpr):
    """Weights of a [1, LW] lane block as the segment pass computes them (`segment_pack`)."""
    xm = tl.max(x, 1)
    c = 1.4426950408889634
    m = xm
    if not HAS_TAU:
        c = inv_t * 1.4426950408889634
        m = xm * inv_t
    ref = tl.where(m > float("-inf"), m, 0.0) * 1.4426950408889634
    return exp2_w(x * c - ref[:, None], FAST)


@triton.jit
def _lane_x(logits_ptr, row, t, inv_t, tau, bitmask_ptr, mrow, bitmask_stride, V, HAS_MASK: tl.constexpr,
            HAS_TAU: tl.constexpr):
    """Token t's kept value as the segment pass sees it (`_kept_x`): raw logit, or z = x / T when tau applies."""
    x = tl.load(logits_ptr + row * V + t, mask=t < V, other=float("-inf")).to(tl.float32)
    if HAS_MASK:
        w = tl.load(bitmask_ptr + mrow * bitmask_stride + t // 32, mask=(mrow >= 0) & (t < V), other=-1)
        x = tl.where((w & (1 << (t % 32))) != 0, x, float("-inf"))
    if HAS_TAU:
        x = x * inv_t
        x = tl.where(x >= tau, x, float("-inf"))
    return x


@triton.jit
def _finish_late_kernel(packed_ptr, out_ptr, n_chunks, NEG_INF_KEY, logits_ptr, inv_t_ptr, greedy_ptr, tau_ptr,
                        keys_ptr, bitmask_ptr, mask_rows_ptr, bitmask_stride, V, BLOCK: tl.constexpr,
                        HAS_MASK: tl.constexpr, HAS_TAU: tl.constexpr, LANES: tl.constexpr, LW: tl.constexpr,
                        FAST: tl.constexpr, done_ptr=None, DONE: tl.constexpr = False):
    """Per row of a LATE pass: the best packed (score, lane) over the segments; greedy rows packed a token id,
    the others a lane whose token is picked here (`_late_token`); -1 if the best score is -inf. DONE: the rows
    drawn already keep their token."""
    row = tl.program_id(0).to(tl.int64)
    drawn = -2
    if DONE:
        drawn = tl.load(done_ptr + row)
    if drawn != -2:
        tl.store(out_ptr + row, drawn.to(tl.int64))
    else:
        c = tl.arange(0, BLOCK)
        p = tl.load(packed_ptr + row * n_chunks + c, mask=c < n_chunks, other=-9223372036854775807)
        best = tl.max(p, 0)
        tok = 4294967295 - (best & 4294967295)
        if (best >> 32) <= NEG_INF_KEY:
            tok = tok * 0 - 1
        elif tl.load(greedy_ptr + row) == 0:
            mrow = -1
            if HAS_MASK:
                mrow = tl.load(mask_rows_ptr + row)
            tau = float("-inf")
            if HAS_TAU:
                tau = tl.load(tau_ptr + row)
            tok = _late_token(logits_ptr, row, tok, tl.load(inv_t_ptr + row), tl.load(keys_ptr + row).to(tl.uint32),
                              tau, bitmask_ptr, mrow, bitmask_stride, V, HAS_MASK, HAS_TAU, LANES, LW, FAST)
        tl.store(out_ptr + row, tok)


# ordered key of float("-inf") (fp32 bits 0xFF800000, negative: flip the 31 low bits)
NEG_INF_KEY = (0xFF800000 - (1 << 32)) ^ 0x7FFFFFFF


def finish_packed(packed: torch.Tensor, drawn: torch.Tensor | None = None) -> torch.Tensor:
    """[R, n_chunks] packed chunk winners -> int64 [R] token ids (one small kernel); drawn: int32 [R] tokens
    drawn already (-2: none), which win."""
    R, n = packed.shape
    out = empty((R,), torch.int64, packed.device)
    if R:
        _finish_kernel[(R,)](packed, out, n, NEG_INF_KEY, BLOCK=max(16, triton.next_power_of_2(n)),
                             done_ptr=drawn, DONE=drawn is not None, num_warps=1)
    return out


def may_filter(params: RowParams, V: int) -> bool:
    """Could any row use top-k/top-p? Answered on the host when the parameters live there (then rows without
    filters skip the threshold kernel entirely); parameters already on a GPU are assumed to (no sync)."""
    if params.top_k.is_cuda:
        return True
    return bool((((params.top_k > 0) & (params.top_k < V)) | (params.top_p < 1)).any())


def sample_triton(logits, params: RowParams, bitmask=None, mask_rows=None, seg: int = SEG, lanes: int = LANES,
                  num_warps: int = 2, filters: bool | None = None, one_launch: bool = False,
                  persistent: int = 0, histogram: bool | None = None, draw: bool = False, late: bool = False):
    """Two launches (+ the threshold launches when rows may filter: kernels/threshold.py). num_warps=2: with
    16-byte loads a warp covers 128 lanes, so 2 warps hold all 256 lanes and a lane's 16 tokens stay in one thread
    (more warps split the lanes' tokens across warps: every per-lane sum then crosses warps; measured on an H200,
    B=64: 13.7 us at 2 warps, 21.3 at 4, 45.1 at 8). seg, lanes: segment size and lanes per segment (powers of
    two, lanes a multiple of 32 when a bitmask is given; other values than SEG, LANES draw other tokens than the
    default rule: for benchmarks and tests on small vocabularies).
    Variants with the same draws, off by default because an H200 showed no gain (2026-11-29, B=64 / 256):
    late=True (the in-lane pick in the finish, for the winning lane only: 12.5 / 35.5 us vs 12.2 / 35.1),
    draw=True (top-k rows drawn in the top-k merge: 49.0 / 138.6 vs 47.9 / 132.6), persistent=P (12.5 at P=4),
    one_launch=True (13.4)."""
    lanes = min(lanes, seg)
    if bitmask is not None:
        check(lanes % 32 == 0, f"a masked sampling pass needs lanes % 32 == 0, got lanes={lanes}")
    R, V = logits.shape
    if R == 0:
        return empty((0,), torch.int64, logits.device)
    has_mask = bitmask is not None
    mrows = default_mask_rows(mask_rows, R, logits.device) if has_mask else None
    has_tau = may_filter(params, V) if filters is None else filters
    drawn = None
    if has_tau and draw and not persistent and not one_launch:
        # candidate-path rows get their token from the top-k merge; the pass skips them
        tau, _, drawn = thresholds_and_paths(logits, params, bitmask, mrows, histogram=histogram, draw=(seg, lanes))
    elif has_tau:
        tau = thresholds_triton(logits, params, bitmask, mrows, histogram=histogram)
    else:
        tau = logits
    n_seg = triton.cdiv(V, seg)
    packed = empty((R, n_seg), torch.int64, logits.device)
    if persistent:
        n_items = R * n_seg
        grid = min(n_items, persistent * _sm_count(logits.device))
        _segment_loop_kernel[(grid,)](
            logits, packed, params.inv_temperature, params.greedy, tau, params.keys,
            bitmask if has_mask else logits, mrows if has_mask else packed, bitmask.stride(0) if has_mask else 0,
            V, n_seg, n_items, HAS_MASK=has_mask, HAS_TAU=has_tau, LANES=lanes, LW=seg // lanes,
            FAST=not INTERPRETING, num_warps=num_warps)
        return finish_packed(packed)
    out = empty((R,), torch.int64, logits.device) if one_launch else packed
    _segment_kernel[(R, n_seg)](
        logits, packed, params.inv_temperature, params.greedy, tau, params.keys,
        bitmask if has_mask else logits, mrows if has_mask else packed, bitmask.stride(0) if has_mask else 0,
        V, n_seg, out, _row_counters(R, logits.device) if one_launch else packed, NEG_INF_KEY, HAS_MASK=has_mask,
        HAS_TAU=has_tau, LANES=lanes, LW=seg // lanes, ONE_LAUNCH=one_launch,
        NCP=max(16, triton.next_power_of_2(n_seg)), FAST=not INTERPRETING, done_ptr=drawn, DONE=drawn is not None,
        LATE=late and not one_launch, num_warps=num_warps)
    if one_launch:
        return out
    if not late:
        return finish_packed(packed, drawn)
    final = empty((R,), torch.int64, logits.device)
    _finish_late_kernel[(R,)](packed, final, n_seg, NEG_INF_KEY, logits, params.inv_temperature, params.greedy, tau,
                              params.keys, bitmask if has_mask else logits, mrows if has_mask else packed,
                              bitmask.stride(0) if has_mask else 0, V, BLOCK=max(16, triton.next_power_of_2(n_seg)),
                              HAS_MASK=has_mask, HAS_TAU=has_tau, LANES=lanes, LW=seg // lanes,
                              FAST=not INTERPRETING, done_ptr=drawn, DONE=drawn is not None, num_warps=1)
    return final


_SMS: dict = {}


def _sm_count(device) -> int:
    """Multiprocessors of a CUDA device (cached); a nominal 4 elsewhere (the interpreter: tests)."""
    key = str(device)
    if key not in _SMS:
        _SMS[key] = torch.cuda.get_device_properties(device).multi_processor_count if torch.device(device).type == \
            "cuda" else 4
    return _SMS[key]


_COUNTERS: dict = {}


def _row_counters(R: int, device) -> torch.Tensor:
    """Per-row completion counters for the one-launch pass: zeros, kept zero by the kernel itself (the last
    program of a row resets it), allocated once per device and grown as needed. One one-launch pass at a time
    per device (two concurrent streams would share the counters)."""
    key = str(device)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < R:
        buf = torch.zeros(max(R, 1024), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


# ---------------------------------------------------------------------------------------------- dispatch
def check_logits_and_mask(logits, bitmask, mask_rows=None):
    check(logits.dim() == 2 and logits.is_contiguous(),
          f"logits must be a contiguous [rows, vocab] tensor, got shape {tuple(logits.shape)}")
    if bitmask is not None:
        check(bitmask.dtype == torch.int32 and bitmask.dim() == 2 and bitmask.stride(1) == 1,
              f"bitmask must be int32 [rows, words], got {bitmask.dtype} {tuple(bitmask.shape)}")
        check(32 * bitmask.shape[1] >= logits.shape[1],
              f"bitmask covers {32 * bitmask.shape[1]} tokens but logits have {logits.shape[1]} columns")
        check(bitmask.device == logits.device, f"bitmask on {bitmask.device}, logits on {logits.device}")
        if mask_rows is None:
            check(bitmask.shape[0] >= logits.shape[0],
                  f"bitmask has {bitmask.shape[0]} rows for {logits.shape[0]} logits rows and no mask_rows")


def processed_probs(logits: torch.Tensor, temperature, top_k, top_p, bitmask: torch.Tensor | None = None,
                    mask_rows=None) -> torch.Tensor:
    """The processed distribution q [R, V] fp32 that sample_from_logits samples and speculative_accept verifies
    against (module docstring; rows with nothing allowed are all zeros). Plain torch on any device (a sort per row
    when top-k/top-p is on): for drafters that must store the exact p their drafts were sampled from."""
    check_logits_and_mask(logits, bitmask, mask_rows)
    params = row_params(logits.shape[0], logits.device, temperature, top_k, top_p, 0, 0)
    return probs_torch(logits, params, bitmask, mask_rows)


def sample_from_logits(logits: torch.Tensor, temperature, top_k, top_p, seed, position,
                       bitmask: torch.Tensor | None = None, mask_rows=None) -> torch.Tensor:
    """Sample one token per row of `logits` [R, V] from the processed distribution q (module docstring).

    temperature, top_k, top_p, seed, position: scalars or [R] tensors (seed and position int64: a draw is a pure
    function of (seed, position, q), so batch composition never changes a sample). bitmask int32 [N, ceil(V/32)]
    with mask_rows [R] (row r uses mask row mask_rows[r]; -1 = unmasked; default r) fuses the grammar mask.
    Returns int64 [R] token ids (-1 where nothing is allowed). Cost: one pass over logits (+ mask bits) per row;
    rows with top-k/top-p add a histogram pass and a candidate pass (kernels/threshold.py).
    """
    check_logits_and_mask(logits, bitmask, mask_rows)
    # the filter check runs on the host-side values, before they move to the GPU (no sync)
    filters = histogram = None
    if not any(isinstance(x, torch.Tensor) and x.is_cuda for x in (temperature, top_k, top_p)):
        host = row_params(logits.shape[0], "cpu", temperature, top_k, top_p, 0, 0)
        filters, histogram = may_filter(host, logits.shape[1]), needs_histogram_path(host, logits.shape[1])
    params = row_params(logits.shape[0], logits.device, temperature, top_k, top_p, seed, position)
    if use_triton(logits):
        return sample_triton(logits, params, bitmask, mask_rows, filters=filters, histogram=histogram)
    return sample_torch(logits, params, bitmask, mask_rows)
