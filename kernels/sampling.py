"""Fused masked sampling: bitmask + temperature + top-k/top-p + seeded sampling.

The processed distribution q of a row (shared with kernels/speculative.py; the engine's contract):
- allowed tokens: bit set in the row's bitmask (if one is given) and logit > -inf;
- temperature T > 0: z = logit * (1/T) (the reciprocal is taken once, in fp32, on the torch side);
  T <= 0 means greedy: q is one-hot on the allowed argmax (lowest id on ties);
- top-k (k >= 1, 0 = off) and top-p (0 < p <= 1, 1 = off): keep v iff fewer than k allowed tokens have z > z_v and
  the softmax mass of tokens with z > z_v is < p (mass over all allowed tokens; this equals applying top-p then
  top-k, and keeps every token tied with the last kept one). The kept set is {z >= tau} for one threshold tau;
- q = softmax(z) restricted to the kept set. A row with no allowed token samples -1.

Sampling is Gumbel-max with the counter-based noise of kernels/rng.py (key from seed, position, stream FRESH):
argmax over kept v of z_v + Gumbel(key, v) is an exact sample of q and needs no normalisation, so a row without
top-k/top-p costs ONE pass over its logits (+ 1 bit of mask per token). The Triton path splits each row into
chunks (grid rows x chunks, enough programs to fill the GPU at decode batch sizes); each lane keeps a running best,
each program writes one packed int64 (ordered score bits, then the complement of the id, so an integer max picks
the highest score and then the lowest id) and `_finish_kernel` reduces the chunks of a row: two launches.
Rows with top-k/top-p first get their exact tau from kernels/threshold.py: a histogram pass over (row, chunk)
programs, a small selection, a compaction of the few candidate tokens and a sort of them (four launches; a row
with more than CMAX candidates falls back to a bisection). Those kernels run only when some row may filter:
decided on the host when top_k/top_p come from the host (sample_from_logits does this), otherwise assumed.
On a GPU the noise uses the hardware log2 approximation (rng.gumbel_tl, FAST): ~1e-5 absolute noise difference
from the twin, so a token differs from the twin's only on near-ties (0 of 1,280 rows in the H200 benchmark).
Measured on an H200 (benchmarks/kernels.py): B=64 19 us, B=256 59 us (41% / 53% of copy bandwidth; the noise
arithmetic, ~46 instructions per token, is the limit), 80-100x the twin.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import rng
from .backend import INTERPRETING, check, empty, use_triton
from .threshold import _ordered, load_z, thresholds_triton  # noqa: F401 - re-exported

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
    ps = ps / ps.sum(1, keepdim=True)
    mass_excl = torch.cumsum(ps, 1) - ps
    first = torch.searchsorted(-zs, -zs, side="left")       # first index of each tie group = count(z > z_v)
    mass_gt = torch.gather(mass_excl, 1, first)
    k = torch.where(params.top_k > 0, params.top_k, torch.full_like(params.top_k, V + 1))
    ok = (first < k[:, None]) & (mass_gt < params.top_p[:, None]) & (zs > NEG_INF)
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


def sample_torch(logits, params: RowParams, bitmask=None, mask_rows=None) -> torch.Tensor:
    z = kept_z_torch(logits, params, bitmask, mask_rows)
    ids = torch.arange(z.shape[1], device=z.device)
    score = torch.where(params.greedy[:, None], z, z + rng.gumbel(params.keys[:, None], ids[None, :]))
    best, tok = score.max(1)
    return torch.where(best > NEG_INF, tok, torch.full_like(tok, -1))


# ---------------------------------------------------------------------------------------------- Triton pieces
@triton.jit
def pack_best(score, ids):
    """Per-lane best (score, id) -> one int64 per program: ordered score bits high, (2**32-1-id) low, so that an
    integer max picks the highest score and, among equal scores, the lowest id (the first maximum)."""
    bm = tl.max(score, 0)
    bid = tl.min(tl.where(score == bm, ids, 2147483647), 0)
    key = _ordered(bm.to(tl.int32, bitcast=True)).to(tl.int64)
    return (key << 32) + (4294967295 - bid.to(tl.int64))


@triton.jit
def _gumbel_split_kernel(logits_ptr, packed_ptr, inv_t_ptr, greedy_ptr, tau_ptr, keys_ptr,
                         bitmask_ptr, mask_rows_ptr, bitmask_stride, V, n_chunks,
                         HAS_MASK: tl.constexpr, HAS_TAU: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                         FAST_LOG: tl.constexpr):
    """Program (row, chunk): best z + Gumbel over the chunk's kept tokens (greedy rows: best z), packed.
    Each lane keeps its own running best across the chunk; one block reduction at the end."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    inv_t = tl.load(inv_t_ptr + row)
    greedy = tl.load(greedy_ptr + row) != 0
    tau = float("-inf")
    if HAS_TAU:
        tau = tl.load(tau_ptr + row)
    key = tl.load(keys_ptr + row).to(tl.uint32)
    mrow = -1
    if HAS_MASK:
        mrow = tl.load(mask_rows_ptr + row)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_id = tl.zeros([BLOCK], tl.int32)
    for i in tl.static_range(CHUNK // BLOCK):
        cols = chunk * CHUNK + i * BLOCK + tl.arange(0, BLOCK)
        z = load_z(logits_ptr, row, cols, V, inv_t, bitmask_ptr, mrow, bitmask_stride, HAS_MASK)
        noise = tl.where(greedy, 0.0, rng.gumbel_tl(key, cols, FAST_LOG))
        score = tl.where((z >= tau) & (z > float("-inf")), z + noise, float("-inf"))
        better = score > best                       # strict: a lane's earlier (lower) id wins ties
        best = tl.where(better, score, best)
        best_id = tl.where(better, cols, best_id)
    tl.store(packed_ptr + row * n_chunks + chunk, pack_best(best, best_id))


@triton.jit
def _finish_kernel(packed_ptr, out_ptr, n_chunks, NEG_INF_KEY, BLOCK: tl.constexpr):
    """Per row: max over the chunk winners, then unpack to a token id (-1 if the best score is -inf)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    p = tl.load(packed_ptr + row * n_chunks + c, mask=c < n_chunks, other=-9223372036854775807)
    best = tl.max(p, 0)
    tok = 4294967295 - (best & 4294967295)
    tl.store(out_ptr + row, tl.where((best >> 32) > NEG_INF_KEY, tok, -1))


# ordered key of float("-inf") (fp32 bits 0xFF800000, negative: flip the 31 low bits)
NEG_INF_KEY = (0xFF800000 - (1 << 32)) ^ 0x7FFFFFFF


def chunking(V: int, block: int = 1024, chunk: int = 4096):
    """(BLOCK, CHUNK, n_chunks) for a vocab of V: CHUNK tokens per program, BLOCK per inner step."""
    block = min(block, triton.next_power_of_2(V))
    chunk = max(block, min(chunk, triton.next_power_of_2(V)))
    return block, chunk, triton.cdiv(V, chunk)


def finish_packed(packed: torch.Tensor) -> torch.Tensor:
    """[R, n_chunks] packed chunk winners -> int64 [R] token ids (one small kernel)."""
    R, n = packed.shape
    out = empty((R,), torch.int64, packed.device)
    if R:
        _finish_kernel[(R,)](packed, out, n, NEG_INF_KEY, BLOCK=max(16, triton.next_power_of_2(n)), num_warps=1)
    return out


def finish_argmax(best: torch.Tensor, best_id: torch.Tensor) -> torch.Tensor:
    """Reduce per-chunk winners [R, n_chunks] to token ids (-1 where every chunk is empty)."""
    val, c = best.max(1)
    tok = best_id.gather(1, c[:, None])[:, 0]
    return torch.where(val > NEG_INF, tok, torch.full_like(tok, -1))


def may_filter(params: RowParams, V: int) -> bool:
    """Could any row use top-k/top-p? Answered on the host when the parameters live there (then rows without
    filters skip the threshold kernel entirely); parameters already on a GPU are assumed to (no sync)."""
    if params.top_k.is_cuda:
        return True
    return bool((((params.top_k > 0) & (params.top_k < V)) | (params.top_p < 1)).any())


def sample_triton(logits, params: RowParams, bitmask=None, mask_rows=None, block=1024, chunk=4096,
                  num_warps=4, filters: bool | None = None):
    R, V = logits.shape
    if R == 0:
        return empty((0,), torch.int64, logits.device)
    has_mask = bitmask is not None
    mrows = default_mask_rows(mask_rows, R, logits.device) if has_mask else None
    has_tau = may_filter(params, V) if filters is None else filters
    tau = thresholds_triton(logits, params, bitmask, mrows) if has_tau else logits
    block, chunk, n_chunks = chunking(V, block, chunk)
    packed = empty((R, n_chunks), torch.int64, logits.device)
    _gumbel_split_kernel[(R, n_chunks)](
        logits, packed, params.inv_temperature, params.greedy.to(torch.int8), tau, params.keys,
        bitmask if has_mask else logits, mrows if has_mask else packed, bitmask.stride(0) if has_mask else 0,
        V, n_chunks, HAS_MASK=has_mask, HAS_TAU=has_tau, BLOCK=block, CHUNK=chunk, FAST_LOG=not INTERPRETING,
        num_warps=num_warps)
    return finish_packed(packed)


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
    filters = may_filter(row_params(logits.shape[0], "cpu", 1.0, top_k, top_p, 0, 0), logits.shape[1]) \
        if not (isinstance(top_k, torch.Tensor) and top_k.is_cuda) else None
    params = row_params(logits.shape[0], logits.device, temperature, top_k, top_p, seed, position)
    if use_triton(logits):
        return sample_triton(logits, params, bitmask, mask_rows, filters=filters)
    return sample_torch(logits, params, bitmask, mask_rows)
