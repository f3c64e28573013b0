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
hardware log2 for the per-lane noise and ln S_g (~1e-5 absolute), so a token can differ from the twin's only on
near-ties (~1e-5 of rows).
RNG quality argument: u_g and G_g are counter-based (kernels/rng.py; key from seed, position and stream FRESH,
ids 2**30 + g and 2**30 + 2**29 + g, apart from any token id), so a draw is a pure function of (seed, position,
q) whatever the batch. Each is the top 23 bits of lowbias32 (a bijective 32-bit mixer with near-ideal avalanche)
of (key XOR id * golden ratio), the key itself five rounds of it over (seed, position, stream): draws of one row
are distinct ids under one key, those of other rows or positions distinct keys; 2 draws per 16 tokens (~16k per
row) is far below anything such a mixer's statistics show; the tests check the law end to end (binomial bounds
and chi-square against softmax computed in float64).
Cost: per token a load, a max, an FMA + exp2 (ex2.approx.ftz: one instruction) and an add (~10 instructions
with the per-lane hash and logs amortised over 16 tokens, ~3 more for the in-lane pick: add, compare, count),
and per program ONE block reduction (the packed best lane: score and token id). Before (session 2) the pick took
~14 instructions per token; the per-token Gumbel noise before that (a hash and two logs per token, ~41
instructions) made the pass arithmetic-bound.
Greedy rows (T <= 0): per lane the first maximum, then the highest score / lowest id across lanes.
The Triton path is one program per (row, PL lanes of a segment) with its [PL, 16] block in registers (a thread
holds lanes side by side: 16-byte loads at 4; more lanes than that in sub-blocks, one after the other; `pass_shape`),
each writing one packed int64 (ordered score bits, then the complement of the token id, so an integer max picks the
highest score and then the lowest id), and `_finish_kernel` takes each row's max: two launches. Masked rows load
each bitmask word once per thread and k for the lanes a thread holds side by side (`threshold._load_words`), not
once per token.
Top-p alone (sampled rows, top-k off, p < 1) is drawn by rejection (kernels/rejection.py, P_REJECT): the first
of up to NMAX proposals from the unrestricted softmax (proposal 0: the plain draw above) inside the top-p set,
else the draw restricted to it on an independent key. Same law q, other tokens for a seed than the tau-first rule
(sessions <= 6); the speculative bonus follows the same rule. On a GPU no tau is computed for those rows: the pass
computes rejection.PROPOSALS draws per program (MORE_PROPOSALS when the host knows such a row has p < P_MORE:
`host_flags`), a mass-above pass and a finish decide.
Rows with top-k first get their exact tau from kernels/threshold.py: rows with top_k <= 64 by the lane path (one
read pass storing every lane's max, then a per-row merge that gathers the few lanes that can hold top-k tokens
and also DRAWS the row's token with this rule on them: such rows skip the pass, and when the host knows every
row is one (sample_from_logits does) the pass and the finish do not run: two launches in all); other filtered
rows by the histogram path (histogram pass, selection, candidate compaction, tau). Those kernels run only when
some row may filter, and the lane path only when some row takes it: decided on the host when top_k/top_p come
from the host (sample_from_logits does this: `host_flags`), otherwise assumed.
MASK_FIRST (masked rows, one lane per thread): the mask words load first and only allowed tokens' logits are
read, so a grammar mask that bans whole ranges skips their bytes. Deleted after session 7's R3 (B=64, us): an
"adaptive" mask mode (each program picking dense or mask-first from its block's words) ran 17.1 against 14.5 on
random masks and 13.6 against 14.5 on grammar-like 2% masks (where MASK_FIRST itself ran 11.4); a one-launch
pass (an atomic max per row, the row's last program writing the token) ran 13.2 against 11.7 for two launches.
Measured on an H200: see benchmarks/kernels_sampling.py (its docstring holds the latest table).
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import rejection, rng, threshold
from .backend import INTERPRETING, check, empty, pdl_kw, pdl_trigger, pdl_wait, use_triton
from .rejection import is_p_alone, p_alone_rows, proposal_keys, store_proposals
from .threshold import lane_block, needs_histogram_path, needs_lane_path, segment_keys, thresholds_and_paths

NEG_INF = float("-inf")


@dataclass
class RowParams:
    """Per-row sampling parameters as device tensors (built by `row_params`)."""
    inv_temperature: torch.Tensor   # float32 [R]; 1/T, or 1.0 for greedy rows
    greedy: torch.Tensor            # bool [R] (kernels also take integers: nonzero = greedy)
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
    """tau [R]: the smallest kept z under top-k/top-p (-inf for rows without filters, greedy rows, empty rows).
    Cost: a sort per row and float64 cumulative masses."""
    R, V = z.shape
    filt = (((params.top_k > 0) & (params.top_k < V)) | (params.top_p < 1)) & ~params.greedy
    tau = torch.full((R,), NEG_INF, device=z.device)
    if not bool(filt.any()):
        return tau
    zs, _ = z.sort(1, descending=True)
    # masses in float64: the definition's margins on flat rows (a boundary token holds ~1e-5 of the mass) lie
    # within fp32 rounding of a 129k-term cumulative sum, so an fp32 twin is no oracle there
    z64 = zs.double()
    m = z64[:, :1].clamp_min(-3e38)
    ps = torch.exp(z64 - m)
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
    lanes = min(lanes, seg)
    z = kept_z_torch(logits, params, bitmask, mask_rows)
    drawn = pick_lane(*lane_scores_torch(z, params.keys, seg, lanes))
    best, tok = z.max(1)                                     # greedy rows: the first allowed maximum
    greedy = torch.where(best > NEG_INF, tok, torch.full_like(tok, -1))
    if P_REJECT:
        alone = p_alone_rows(params, logits.shape[1])
        if bool(alone.any()):
            idx = alone.nonzero()[:, 0]
            zs = masked_z_torch(logits[idx], params.inv_temperature[idx], bitmask,
                                None if bitmask is None else default_mask_rows(mask_rows, len(alone), z.device)[idx])
            sub = RowParams(params.inv_temperature[idx], params.greedy[idx], params.top_k[idx], params.top_p[idx],
                            params.keys[idx])
            drawn[idx] = rejection_draw_torch(zs, sub, seg, lanes)
    return torch.where(params.greedy, greedy, drawn)


def rejection_draw_torch(z, params: RowParams, seg: int = SEG, lanes: int = LANES) -> torch.Tensor:
    """kernels/rejection.py's rule for top-p-alone rows of z (masked, scaled): the first of the proposals 0 ..
    NMAX - 1 (lane draws from the unrestricted softmax) inside the top-p set {z >= tau}, else the draw restricted
    to it with key NMAX; -1 where nothing is allowed."""
    tau = thresholds_torch(z, params)
    tok = torch.full((z.shape[0],), -2, dtype=torch.int64, device=z.device)
    for j in range(rejection.NMAX):
        t, inside = _proposal_torch(z, params, tau, j, seg, lanes)
        tok = torch.where((tok == -2) & inside, t, tok)
        if not bool((tok == -2).any()):
            return tok
    kept = z.masked_fill(z < tau[:, None], NEG_INF)
    last = pick_lane(*lane_scores_torch(kept, proposal_keys(params.keys, rejection.NMAX), seg, lanes))
    return torch.where(tok == -2, last, tok)


def _proposal_torch(z, params: RowParams, tau, j: int, seg: int, lanes: int):
    """(token, inside the top-p set {z >= tau}) of proposal j of every row."""
    t = pick_lane(*lane_scores_torch(z, proposal_keys(params.keys, j), seg, lanes))
    return t, (t >= 0) & (z.gather(1, t.clamp_min(0)[:, None])[:, 0] >= tau)


def open_rows_torch(z, params: RowParams, seg: int = SEG, lanes: int = LANES, n: int | None = None) -> torch.Tensor:
    """bool [R]: rows of z (masked, scaled; top-p alone) whose first n proposals (default NMAX: then the rule's
    last draw decides them) all miss the top-p set (tests and benchmarks: which rows took which branch)."""
    tau = thresholds_torch(z, params)
    miss = torch.ones(z.shape[0], dtype=torch.bool, device=z.device)
    for j in range(n or rejection.NMAX):
        miss &= ~_proposal_torch(z, params, tau, j, seg, lanes)[1]
    return miss


# ---------------------------------------------------------------------------------------------- Triton pieces
@triton.jit
def segment_block(logits_ptr, tau_ptr, bitmask_ptr, row, seg, inv_t, mrow, bitmask_stride, V, HAS_MASK: tl.constexpr,
                  HAS_TAU: tl.constexpr, FULL: tl.constexpr, LANES: tl.constexpr, LW: tl.constexpr,
                  PL: tl.constexpr, sub, VEC: tl.constexpr, FAST: tl.constexpr, MASK_FIRST: tl.constexpr = False):
    """Lanes sub * PL .. sub * PL + PL - 1 of segment `seg` of a row as a [PL, LW] block of kept values
    (threshold.lane_block): raw logits x, -inf where banned or padding; with HAS_TAU z = x / T, -inf below the
    row's tau (raw logits order like z: 1/T > 0). Returns (start, lane, pos, x): lane, pos from the segment's
    start."""
    start = seg * (LANES * LW)
    lane, pos, x = lane_block(logits_ptr, bitmask_ptr, row, start, V, mrow, bitmask_stride, HAS_MASK, FULL, LANES, LW,
                              PL, sub, VEC, FAST, MASK_FIRST)
    if HAS_TAU:
        x = x * inv_t
        x = tl.where(x >= tl.load(tau_ptr + row), x, float("-inf"))
    return start, lane, pos, x


@triton.jit
def _segment_body(logits_ptr, packed_ptr, tau_ptr, row, prog, n_prog, inv_t, greedy, key, bitmask_ptr, mrow,
                  bitmask_stride, V, HAS_MASK: tl.constexpr, HAS_TAU: tl.constexpr, FULL: tl.constexpr,
                  LANES: tl.constexpr, LW: tl.constexpr, PL: tl.constexpr, VEC: tl.constexpr, FAST: tl.constexpr,
                  MASK_FIRST: tl.constexpr, NP: tl.constexpr, REJECT: tl.constexpr, pmax_ptr, pmass_ptr, lane_ptr,
                  n_lanes, alone, HOT: tl.constexpr, NPR: tl.constexpr, SUBS: tl.constexpr):
    seg = prog // (LANES // PL)
    # SUBS sub-blocks of PL // SUBS lanes one after the other (a thread's lanes PL // SUBS apart): each lane's key
    # in-thread, one block reduction for all (REJECT: SUBS is 1). Measured and deleted (R3): the greedy branch
    # taken once outside the sub-blocks (so no branch between them): the logits loads then waited for the greedy
    # flag's load (numbers beside PASS_SHAPE)
    sub = prog % (LANES // PL) * SUBS
    start, lane, pos, x = segment_block(logits_ptr, tau_ptr, bitmask_ptr, row, seg, inv_t, mrow, bitmask_stride, V,
                                       HAS_MASK, HAS_TAU, FULL, LANES, LW, PL // SUBS, sub, VEC, FAST, MASK_FIRST)
    if not REJECT:
        keys = segment_keys(x, lane, pos, start, seg, inv_t, greedy, key, HAS_TAU, LANES, LW, FAST)
        for h in tl.static_range(1, SUBS):
            start, lane, pos, x = segment_block(logits_ptr, tau_ptr, bitmask_ptr, row, seg, inv_t, mrow,
                                               bitmask_stride, V, HAS_MASK, HAS_TAU, FULL, LANES, LW, PL // SUBS,
                                               sub + h, VEC, FAST, MASK_FIRST)
            keys = tl.maximum(keys, segment_keys(x, lane, pos, start, seg, inv_t, greedy, key, HAS_TAU, LANES, LW,
                                                 FAST))
        tl.store(packed_ptr + row * n_prog + prog, tl.max(keys, 0))
    else:
        # top-p-alone rows by rejection (kernels/rejection.py): NP proposals, and the program's max z for the row max
        o = row * n_prog + prog
        store_proposals(x, lane, pos, start, seg, inv_t, greedy, key, packed_ptr + o * NP, HAS_TAU, LANES, LW, FAST,
                        NP, True, pmass_ptr + o, lane_ptr + row * n_lanes, alone, HOT, NPR)
        xmax = tl.max(tl.max(x, 1), 0)
        if not HAS_TAU:
            xmax = xmax * inv_t
        tl.store(pmax_ptr + o, xmax)


@triton.jit
def _segment_kernel(logits_ptr, packed_ptr, inv_t_ptr, greedy_ptr, tau_ptr, keys_ptr,
                    bitmask_ptr, mask_rows_ptr, bitmask_stride, V, n_prog, HAS_MASK: tl.constexpr,
                    HAS_TAU: tl.constexpr, LANES: tl.constexpr, LW: tl.constexpr, PL: tl.constexpr,
                    VEC: tl.constexpr, FAST: tl.constexpr, done_ptr=None, DONE: tl.constexpr = False,
                    MASK_FIRST: tl.constexpr = False, NP: tl.constexpr = 1, REJECT: tl.constexpr = False,
                    pmax_ptr=None, pmass_ptr=None, lane_ptr=None, n_lanes=0,
                    top_k_ptr=None, top_p_ptr=None, HOT: tl.constexpr = False, NPR: tl.constexpr = 1,
                    PDL: tl.constexpr = False, SUBS: tl.constexpr = 1):
    """Program (row, part): PL lanes of one segment (LANES // PL parts per segment), [PL / SUBS, LW] in registers at
    a time, SUBS sub-blocks one after the other (lane l: tokens start + k * LANES + l, held by one thread). Every lane computes in-thread its max, weights, running
    sum and inverse-CDF candidate, then its score M_g + ln S_g + G_g (greedy rows: max z and its first id); one
    block reduction packs the part's best lane.
    DONE: rows whose done entry is not -2 are drawn by the finish (from the top-k merge's kept set): their
    programs return at once. MASK_FIRST: masked rows read only their allowed tokens' logits (threshold.lane_block).
    PDL: lets the finish (or the rejection chain) launch early; when launched early itself (pdl_kw), it waits
    first (everything it reads may come from the kernel before it).
    """
    pdl_trigger(PDL)
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    prog = tl.program_id(1)
    if DONE:
        drawn = tl.load(done_ptr + row)
        if drawn != -2:
            return
    inv_t = tl.load(inv_t_ptr + row)
    greedy = tl.load(greedy_ptr + row) != 0
    key = tl.load(keys_ptr + row).to(tl.uint32)
    mrow = -1
    if HAS_MASK:
        mrow = tl.load(mask_rows_ptr + row)
    alone = False
    if HOT:
        alone = is_p_alone(row, V, greedy_ptr, top_k_ptr, top_p_ptr)
    if (prog // (LANES // PL) + 1) * (LANES * LW) <= V:
        _segment_body(logits_ptr, packed_ptr, tau_ptr, row, prog, n_prog, inv_t, greedy, key, bitmask_ptr, mrow,
                      bitmask_stride, V, HAS_MASK, HAS_TAU, True, LANES, LW, PL, VEC, FAST, MASK_FIRST, NP, REJECT,
                      pmax_ptr, pmass_ptr, lane_ptr, n_lanes, alone, HOT, NPR, SUBS)
    else:
        _segment_body(logits_ptr, packed_ptr, tau_ptr, row, prog, n_prog, inv_t, greedy, key, bitmask_ptr, mrow,
                      bitmask_stride, V, HAS_MASK, HAS_TAU, False, LANES, LW, PL, VEC, FAST, MASK_FIRST, NP,
                      REJECT, pmax_ptr, pmass_ptr, lane_ptr, n_lanes, alone, HOT, NPR, SUBS)


@triton.jit
def _packed_token(packed_ptr, row, n_chunks, NEG_INF_KEY, BLOCK: tl.constexpr):
    """A row's token from its chunks' packed winners: the max, unpacked (-1 if the best score is -inf)."""
    c = tl.arange(0, BLOCK)
    best = tl.max(tl.load(packed_ptr + row * n_chunks + c, mask=c < n_chunks, other=-9223372036854775807), 0)
    return tl.where((best >> 32) > NEG_INF_KEY, 4294967295 - (best & 4294967295), -1)


@triton.jit
def _finish_kernel(packed_ptr, out_ptr, n_chunks, NEG_INF_KEY, BLOCK: tl.constexpr, done_ptr=None,
                   DONE: tl.constexpr = False, PDL: tl.constexpr = False):
    """Per row: max over the chunk winners, then unpack to a token id (-1 if the best score is -inf). DONE: rows
    whose token the top-k merge drew already (done != -2) keep it (the pass skipped them)."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    drawn = -2
    if DONE:
        drawn = tl.load(done_ptr + row)
    if drawn != -2:
        tl.store(out_ptr + row, drawn.to(tl.int64))
    else:
        tl.store(out_ptr + row, _packed_token(packed_ptr, row, n_chunks, NEG_INF_KEY, BLOCK))


NEG_INF_KEY = threshold.NEG_INF_KEY
_WORKSPACES = {}


def one_launch_workspace(rows: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(words int64, counts int32) of at least `rows` entries for a one-launch finish (kernels/speculative.py's
    residual pass), kept per device and left clean by every launch (words at the lowest value, counts 0), so no
    call pays a reset launch. One stream at a time: two launches running concurrently on other streams would
    share it."""
    key = str(device)
    ws = _WORKSPACES.get(key)
    if ws is None or ws[0].numel() < rows:
        n = max(rows, 256)
        ws = (torch.full((n,), -9223372036854775807, dtype=torch.int64, device=device),
              torch.zeros(n, dtype=torch.int32, device=device))
        _WORKSPACES[key] = ws
    return ws


def finish_packed(packed: torch.Tensor, drawn: torch.Tensor | None = None) -> torch.Tensor:
    """[R, n_chunks] packed chunk winners -> int64 [R] token ids (one small kernel); drawn: int64 [R] tokens drawn
    already by the top-k merge (-2: none), which win."""
    R, n = packed.shape
    out = empty((R,), torch.int64, packed.device)
    if R:
        _finish_kernel[(R,)](packed, out, n, NEG_INF_KEY, BLOCK=max(16, triton.next_power_of_2(n)), done_ptr=drawn,
                             DONE=drawn is not None, num_warps=1, **pdl_kw())
    return out


def may_filter(params: RowParams, V: int) -> bool:
    """Could any row use top-k/top-p? Answered on the host when the parameters live there (then rows without
    filters skip the threshold kernel entirely); parameters already on a GPU are assumed to (no sync)."""
    if params.top_k.is_cuda:
        return True
    return bool((((params.top_k > 0) & (params.top_k < V)) | (params.top_p < 1)).any())


# Program shape of the sampling pass: (lanes per program, warps) -> lanes per thread = lanes / (32 * warps).
# Measured on an H200 (2026-11-30, B=64 / 256, us; round 1 of session 5, mask words loaded by the layout-proof
# asm): T=1 256x2 12.2 / 35.1, 256x8 11.3 / 36.7, 128x1 12.1 / 35.2, 128x4 12.0 / 35.8; greedy 256x2 11.5 / 34.2,
# 128x4 11.6 / 34.5; masked rows gain from more, smaller programs (256x2 16.2 / 50.1, 256x8 15.4 / 45.2,
# 128x1 16.6 / 47.6, 128x4 14.6 / 43.3). So: unmasked 256x8 below 128 rows, 256x2 from there; masked 128x4.
# Variants removed after session 3 (same draws, never faster): a persistent pass prefetching its next item
# (P=1..4 programs per SM: 21.8 / 14.0 / 13.8 / 12.5 us at B=64), one launch with a per-row completion counter
# (13.3 us), the in-lane pick moved to the finish for the winning lane (12.5 / 35.5 us).
# Session 6 (B=64; R1 and R2, each beside the compiled tests: +-1 us run to run): T=1 128x2 10.9 / 11.8 / 11.1
# against 256x8 11.1 / 12.0 / 12.0 (also 256x4 11.4, 64x2 11.2); masked (random 50% masks) 64x2 14.4 / 14.3 /
# 14.3 against 128x4 14.5 / 14.6 / 14.6 (256x4 15.3, 128x2 20.8, 64x1 15.3). MASK_FIRST on those masks 15.0 / 16.1
# against 14.5 / 14.6, on grammar-like masks (2% allowed, runs of 512 tokens) 11.4 / 11.9 against 14.5 / 13.5:
# off by default (the benchmark's masks are the random ones); a caller that knows its masks are sparse can ask.
# Session 13, T=0.7 + mask at B=64 (56% of copy bandwidth in session 12's R1, 61-62% in this session's R2 beside the
# compiled tests): the masked pass's full-segment code issues ~23 SASS instructions per token against ~17 unmasked
# at the same shape (a 4-byte word load, its -1 default, the bit test and the select per token; the logits loads
# 4-byte at one lane per thread), and its programs read their mask row before any load of their block (a second
# dependent round trip). Measured and deleted (R2, twice each, us, HEAD in the same run): each program loading its
# own row's mask words beside its logits and reading mask_rows after them (reloading when it names another row):
# B=64 13.1 / 13.2 against 13.1 / 13.2, the engine's form (every 4th row unmasked, -1) 12.3 / 12.2 against 12.6 /
# 12.6, B=256 40.2 / 41.9 against 42.0 / 42.2 and 41.7 / 41.8 against 41.6 / 40.8: the round trip is hidden.
# Session 16: a program's lanes may exceed its threads x lanes side by side (a third shape entry): it takes them
# in sub-blocks (`_segment_body`), each lane's key kept in-thread, one block reduction for all, so a program's
# fixed work (row parameters, addresses, the reduction, the store) is shared by more tokens. SASS (sm_90, the
# masked full-segment sampled path, per token): 64x2 25.2 (HEAD), 256x2 in four sub-blocks 15.5; with the words
# loaded unpredicated and ln S_g by the hardware log2 (threshold.py) 64x2 23.1. R2 (H200, HEAD in the same run,
# three alternating passes, us; every token equal to the twin's): T=0.7 + random 50% masks B=64: HEAD 64x2
# 13.39 / 14.55 / 14.42, 64x2 13.44 / 14.69 / 14.78, 128x2x1 13.80 / 13.82 / 13.90, 256x2x1 14.00 / 13.97 /
# 13.93, 256x1x1 14.98 / 14.95 / 14.90, 256x4x1 13.88 / 13.86 / 13.78 (the first pass's HEAD and 64x2 ran in
# a faster state of the card; the later passes agree); B=256: HEAD 128x4 41.12 / 41.08 / 41.07, 128x4 40.68 /
# 40.61 / 40.48, 256x4x1 39.22 / 39.24 / 39.05, 256x2x1 38.66 / 38.75 / 38.63; the engine's form (every 4th row
# unmasked) B=64 HEAD 13.12 / 13.10 / 13.10, 256x2x1 12.68 / 12.71 / 12.70; T=1 B=64 HEAD 128x2 11.14 / 11.06 /
# 11.17, 128x2 11.08 / 11.00 / 11.06, 256x2x2 11.08 / 11.15 / 11.17, 256x1x2 11.57 / 11.64 / 11.61; B=256 HEAD
# 256x2 34.48 / 34.42 / 34.48, 256x2 34.29 / 34.24 / 34.11, 256x2x2 33.98 / 34.06 / 33.78. Fewer instructions
# a token bought less than their count: the pass is not issue-bound. Masked rows take 256x2x1 at every batch (the
# one shape measured on all three masked cases). Deleted after R3 (compiled tests beside it, HEAD in the same run):
# the greedy branch outside the sub-blocks (its loads behind the greedy flag's), T=0.7 + mask B=64 256x2x1 14.14 /
# 14.14 / 14.18, 256x4x1 14.16 / 14.23 / 14.74 against HEAD 13.56 / 14.73 / 14.58; B=256 256x2x1 40.35 / 39.66 /
# 39.67, 256x4x1 42.22 / 42.21 / 42.09 against 40.27 / 40.48 / 41.20; engine form B=64 256x4x1 13.23 / 13.29 /
# 13.25 against 12.84 / 12.86 / 12.90; T=1 B=64 128x2 10.98 / 10.93 / 10.93 against 10.70 / 10.66 / 10.63.
PASS_SHAPE = (256, 2, 2)        # unmasked rows from 128 rows (below: SMALL_SHAPE)
SMALL_SHAPE = (128, 2)
MASKED_SHAPE = (256, 2, 1)      # masked rows from 128 rows (below: MASKED_SMALL_SHAPE)
MASKED_SMALL_SHAPE = (256, 2, 1)
# the rejection pass (top-p-alone rows' proposals, kernels/rejection.py) keeps one sub-block a program and session
# 15's shapes: masked below 128 rows / from 128, unmasked below / from
REJECT_SHAPES = ((64, 2), (128, 4), (128, 2), (256, 2))
MASK_FIRST = False              # masked rows: mask words first, then only allowed tokens' logits (one lane/thread)
P_REJECT = True                 # top-p-alone rows by rejection (kernels/rejection.py); False: tau first (session 6)
SPEC_SHAPE = (256, 2)           # the speculative statistics / residual passes: 50.5 us vs 55.1 at 256x8 (R1)


def pass_shape(lanes: int, shape=None, masked: bool = False, rows: int = 0,
               reject: bool = False) -> tuple[int, int, int]:
    """(lanes per program, warps, lanes per thread side by side) for a rule with `lanes` lanes per segment: `shape`
    ((lanes per program, warps) or (lanes per program, warps, lanes per thread side by side)), else the measured
    defaults above (below 128 rows SMALL_SHAPE / MASKED_SMALL_SHAPE, from there PASS_SHAPE / MASKED_SHAPE; reject:
    REJECT_SHAPES). A program holding more lanes than its threads x lanes side by side takes them in sub-blocks
    (`sub_blocks`)."""
    small = rows < 128
    defaults = REJECT_SHAPES if reject else (MASKED_SMALL_SHAPE, MASKED_SHAPE, SMALL_SHAPE, PASS_SHAPE)
    pl, warps, *side = shape or defaults[(0 if small else 1) if masked else (2 if small else 3)]
    pl = min(pl, lanes)
    warps = max(1, min(warps, pl // 32))
    return pl, warps, max(1, min(side[0], pl // (32 * warps)) if side else pl // (32 * warps))


def sub_blocks(pl: int, warps: int, vec: int) -> int:
    """Sub-blocks of a pass program (`pass_shape`'s triple): its lanes over its threads x lanes side by side."""
    return max(1, pl // (32 * warps * vec))


def sample_triton(logits, params: RowParams, bitmask=None, mask_rows=None, seg: int = SEG, lanes: int = LANES,
                  filters: bool | None = None, histogram: bool | None = None, draw: bool = True, shape=None,
                  lane_only: bool = False, lane_rows: bool | None = None, mask_first: bool | None = None,
                  reject: bool | None = None, proposals: int | None = None):
    """Two launches (+ the threshold launches when rows may filter: kernels/threshold.py): the pass, one program
    per (row, PL lanes of a segment), then a per-row finish. seg, lanes: segment size and lanes per segment
    (powers of two, lanes a multiple of 32 when a bitmask is given; other values than SEG, LANES draw other tokens
    than the default rule: for benchmarks and tests on small vocabularies). shape: (lanes per program, warps[,
    lanes side by side]), default `pass_shape`'s; a thread holds that many lanes at a time (16-byte loads at 4) and
    works through lanes / (32 * warps * side by side) sub-blocks of them (`sub_blocks`).
    draw (default): the top-k merge draws its rows' tokens (threshold.lane_path: the same rule on the lanes that
    hold kept tokens) and the pass skips them; lane_only (the host knows every row is a sampled row with
    0 < top_k <= threshold.KMAX, as sample_from_logits does): the pass and the finish do not run at all (two
    launches in all, one read of the logits); lane_rows=False (the host knows no row takes the lane path:
    threshold.needs_lane_path): the lane path's launches are skipped. mask_first: MASK_FIRST for this call.
    reject (default: P_REJECT) draws top-p-alone rows by rejection (kernels/rejection.py: the pass computes
    `proposals` draws per program, default rejection.PROPOSALS, then a mass-above pass and a per-row finish); the host
    passes False when it knows no row is top-p alone (the pass then draws once, and the plain finish runs); those
    rows then never take the threshold path, so `filters` / `histogram` / `lane_rows` are about the other rows.
    Session 4's candidate path (per-unit candidates above a bound found by 8 bisection steps on the lane maxima,
    a merge for tau, then this pass drawing) measured 51.3 / 131.5 us for top-k50 p0.9 at B=64 / 256 against
    this lane path's 38.3 / 92.4 (H200, 2026-11-30) and was deleted."""
    lanes = min(lanes, seg)
    if bitmask is not None:
        check(lanes % 32 == 0, f"a masked sampling pass needs lanes % 32 == 0, got lanes={lanes}")
    R, V = logits.shape
    if R == 0:
        return empty((0,), torch.int64, logits.device)
    has_mask = bitmask is not None
    mrows = default_mask_rows(mask_rows, R, logits.device) if has_mask else None
    rejecting = P_REJECT and reject is not False
    np_ = (proposals or rejection.PROPOSALS) if rejecting else 1
    has_tau = (may_filter(params, V) if filters is None else filters)
    # top-p-alone rows are drawn by rejection: the threshold path sees them as unfiltered (tau = -inf); the view
    # costs ~10 small torch launches on device parameters (~15 us in R2), so only when the threshold path runs
    thr = threshold_view(params, V) if rejecting and has_tau else params
    drawn = None
    if has_tau and draw:
        tau, _, drawn = thresholds_and_paths(logits, thr, bitmask, mrows, histogram=histogram, draw=(seg, lanes),
                                             lane_rows=lane_rows)
        if lane_only:
            return drawn
    elif has_tau:
        tau = thresholds_and_paths(logits, thr, bitmask, mrows, histogram=histogram, lane_rows=lane_rows)[0]
    else:
        tau = logits
    pl, warps, vec = pass_shape(lanes, shape, has_mask, R, rejecting)
    subs = 1 if rejecting else sub_blocks(pl, warps, vec)
    if rejecting:                       # the proposals' pass takes one sub-block a program (a shape given with more)
        pl = min(pl, 32 * warps * vec)
    n_prog = triton.cdiv(V, seg) * (lanes // pl)
    packed = empty((R, n_prog, np_), torch.int64, logits.device)
    pmax = torch.empty((R, n_prog), dtype=torch.float32, device=logits.device) if rejecting else None
    pmass = torch.empty_like(pmax) if rejecting else None
    n_l = triton.cdiv(V, seg) * lanes
    lane_max = torch.empty((R, n_l), dtype=torch.float32, device=logits.device) if rejecting and \
        rejection.HOT_LANES else None
    # the pass is PDL-launched itself (threshold.py's PDL comment has the numbers), in front of the rejection chain
    # too since session 13 (R2, top-p alone, B=64 flat / peaked, twice each: 26.4 / 26.4 and 19.6 / 19.6 us against
    # 26.6 / 26.5 and 20.1 / 20.1 with a plain launch; B=256 80.6-80.7 / 54.7 against 80.8 / 54.9-55.0)
    _segment_kernel[(R, n_prog)](
        logits, packed, params.inv_temperature, params.greedy, tau, params.keys,
        bitmask if has_mask else logits, mrows if has_mask else packed, bitmask.stride(0) if has_mask else 0,
        V, n_prog, HAS_MASK=has_mask, HAS_TAU=has_tau, LANES=lanes, LW=seg // lanes, PL=pl, VEC=vec,
        FAST=not INTERPRETING, done_ptr=drawn, DONE=drawn is not None,
        MASK_FIRST=has_mask and vec == 1 and bool(MASK_FIRST if mask_first is None else mask_first), NP=np_,
        REJECT=rejecting, pmax_ptr=pmax, pmass_ptr=pmass,
        lane_ptr=lane_max if lane_max is not None else pmax, n_lanes=n_l,
        top_k_ptr=params.top_k, top_p_ptr=params.top_p, HOT=lane_max is not None, NPR=triton.next_power_of_2(np_),
        SUBS=subs, num_warps=warps, **pdl_kw())
    if rejecting:
        return rejection.reject_finish(logits, params, bitmask, mrows, packed, pmax, pmass, lane_max, drawn, seg,
                                       lanes, np_, INTERPRETING, tau if has_tau else None)
    return finish_packed(packed.view(R, n_prog), drawn)


def threshold_view(params: RowParams, V: int, alone: torch.Tensor | None = None) -> RowParams:
    """params with top-p switched off on top-p-alone rows (drawn by rejection, kernels/rejection.py, not by tau;
    alone: their p_alone_rows when the caller has it): what the threshold path and the host's filter checks see.
    Torch ops on the params' device."""
    alone = p_alone_rows(params, V) if alone is None else alone
    top_p_thr = torch.where(alone, torch.ones_like(params.top_p), params.top_p)
    return RowParams(params.inv_temperature, params.greedy, params.top_k, top_p_thr, params.keys)


def host_flags(host: RowParams, V: int) -> dict:
    """What the host knows from its copy of the parameters, as sample_triton's keywords: whether any row filters
    by tau (top-p-alone rows do not: they are drawn by rejection), needs the histogram path, takes the lane path,
    whether every row does (lane_only), whether any row is top-p alone (reject), and how many proposals the pass
    computes for those (rejection.MORE_PROPOSALS when one has p < rejection.P_MORE: four proposals all miss often
    there, and the finish tests the others on a few candidates instead of loops over the row)."""
    alone = p_alone_rows(host, V)
    thr = threshold_view(host, V, alone) if P_REJECT else host
    return dict(filters=may_filter(thr, V), histogram=needs_histogram_path(thr, V), lane_only=lane_rows_only(host, V),
                lane_rows=needs_lane_path(thr, V), reject=P_REJECT and bool(alone.any()),
                proposals=proposal_count(host, V, alone))


def proposal_count(host: RowParams, V: int, alone: torch.Tensor | None = None) -> int:
    """Proposals a pass draws for top-p-alone rows (host params; alone: their p_alone_rows when the caller has
    it): rejection.MORE_PROPOSALS when one has p < rejection.P_MORE, else rejection.PROPOSALS (the speculative
    step's statistics pass follows it too)."""
    alone = p_alone_rows(host, V) if alone is None else alone
    more = bool((alone & (host.top_p < rejection.P_MORE)).any())
    return rejection.MORE_PROPOSALS if more else rejection.PROPOSALS


def lane_rows_only(params: RowParams, V: int, kmax: int = threshold.KMAX) -> bool:
    """Is every row a sampled row with 0 < top_k <= kmax (the top-k merge then draws every token)? Host params."""
    k = params.top_k
    return bool(((k > 0) & (k <= kmax) & (k < V) & ~params.greedy.bool()).all())


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
        # (the kernels read an unmasked row's words from row 0 and set them all: threshold._dense_block)
        check(bitmask.shape[0] >= 1 or logits.shape[0] == 0,
              "bitmask must have at least one row (pass None for no mask)")
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
    top-p-alone rows add a pass over the lanes above their proposals (kernels/rejection.py), rows with top-k <= 64
    a lane-maxima pass and a per-row merge instead of the pass, larger top-k a histogram path
    (kernels/threshold.py).
    """
    check_logits_and_mask(logits, bitmask, mask_rows)
    R, V = logits.shape
    flags = {}
    params = None
    on_gpu = [isinstance(x, torch.Tensor) and x.is_cuda for x in (temperature, top_k, top_p, seed, position)]
    if not any(on_gpu[:3]):
        # the filter check runs on the host-side values, before they move to the GPU (no sync)
        host = row_params(R, "cpu", temperature, top_k, top_p, seed if not on_gpu[3] else 0,
                          position if not on_gpu[4] else 0)
        flags = host_flags(host, V)
        if logits.is_cuda and not any(on_gpu):
            params = to_device(host, logits.device)         # two copies, no kernel launches
    if params is None:
        params = row_params(R, logits.device, temperature, top_k, top_p, seed, position)
    if use_triton(logits):
        return sample_triton(logits, params, bitmask, mask_rows, **flags)
    return sample_torch(logits, params, bitmask, mask_rows)


def to_device(params: RowParams, device) -> RowParams:
    """Host-built RowParams on `device` in two copies (one int64 [3, R], one fp32 [2, R]) instead of one copy per
    field plus the elementwise kernels row_params runs on the device; greedy arrives as int64 (kernels test it
    against 0)."""
    ints = torch.stack([params.greedy.to(torch.int64), params.top_k, params.keys]).to(device, non_blocking=True)
    floats = torch.stack([params.inv_temperature, params.top_p]).to(device, non_blocking=True)
    return RowParams(floats[0], ints[0], ints[1], floats[1], ints[2])
