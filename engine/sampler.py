"""One batched sampling step: grammar masks (filled by engine/mask_fill.py while the forward runs), then
temperature / top-k / top-p, with counter-based per-request randomness.

Every draw is inverse-CDF sampling with ONE uniform per row, U = counter_uniform(seed, position, case): a
pure function of (request seed, absolute position, case) from the engine's single counter generator
(SplitMix64, shared with the speculative verifier in engine/speculative.py, so a bonus token uses the very
uniform plain sampling uses at that position). So a seeded request gives the same output alone, in any
batch, in any order, and after preemption; a logit that moves by rounding when it is recomputed (other
batch shape, re-prefill) only changes a draw if U * total lands within that rounding of a CDF boundary.
- CUDA: `deepinfer_sg.kernels.sample_from_logits` (helper D), bitmask fused into the same pass; the
  speculative verifier's fused path (kernels.speculative_accept) uses the same noise streams.
- CPU: `sample_rows` here (mask applied first; no sort and no per-token noise: ~3 passes over the row).
Order: grammar bitmask (-inf where a bit is 0) -> temperature -> top-k -> top-p -> draw. Greedy
(temperature 0) is the argmax of the masked logits (ties -> lowest id).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from .speculative import counter_uniforms

if TYPE_CHECKING:
    from .mask_fill import MaskJob  # (engine/mask_fill.py fills the masks; it imports this module)

MASK64 = (1 << 64) - 1
SEED_MASK = (1 << 63) - 1   # torch generators and the kernels take non-negative int64 seeds
CASE_FRESH, CASE_RESIDUAL, CASE_VERIFY = 0, 1, 2   # the speculative verifier uses the other two cases


def splitmix64(x: int) -> int:
    """The SplitMix64 finaliser: a bijective 64-bit mix, good enough to turn counters into uniforms."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def counter_uniform(seed: int, position: int, case: int = CASE_FRESH) -> float:
    """U in [0, 1) from (seed, position, case) alone: 53 random bits of a doubly mixed counter."""
    x = splitmix64((splitmix64(seed & MASK64) + position * 3 + case) & MASK64)
    return (x >> 11) * (1.0 / (1 << 53))


@dataclass
class SamplingRow:
    """What the sampler needs to know about one logits row."""

    temperature: float
    top_k: int
    top_p: float
    seed: int
    position: int          # absolute position of the token this row samples (prompt + outputs so far)
    want_logprob: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


# ---------------------------------------------------------------- bitmasks

def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


_SHIFTS = {}


def _shifts(device) -> torch.Tensor:
    """uint8 [8] = 0..7 on `device` (cached)."""
    key = str(device)
    if key not in _SHIFTS:
        _SHIFTS[key] = torch.arange(8, dtype=torch.uint8, device=device)
    return _SHIFTS[key]


def apply_token_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, indices: Optional[torch.Tensor] = None) -> None:
    """Plain-torch version: logits[r, v] = -inf where bit v of bitmask[r] is 0 (r in indices, or all
    rows). Columns past the bitmask's coverage are untouched. Unpacks in uint8 (bit v of the little-endian
    int32 words = bit v%8 of byte v//8; one shift-and over R x V bytes, viewed as bool), and fills in place
    when the rows are all of `logits` in order (the engine's usual case), avoiding an indexed copy.
    Cost: ~3 byte/float passes over R x V (~2x faster than a lookup-table unpack)."""
    rows = torch.arange(bitmask.shape[0], device=logits.device) if indices is None else indices.to(logits.device)
    if rows.numel() == 0:
        return
    cover = min(logits.shape[1], bitmask.shape[1] * 32)
    words = bitmask.to(logits.device)[rows].contiguous()
    as_bytes = words.view(torch.uint8)                 # little-endian: byte k of word w = bits 8k..8k+7
    bits = (as_bytes.unsqueeze(-1) >> _shifts(logits.device)) & 1
    blocked = (bits ^ 1).view(torch.bool).reshape(rows.numel(), -1)[:, :cover]
    all_rows = rows.numel() == logits.shape[0] and bool((rows == torch.arange(rows.numel(), device=rows.device)).all())
    if all_rows:
        logits[:, :cover].masked_fill_(blocked, float("-inf"))
    else:
        logits[rows, :cover] = logits[rows, :cover].masked_fill(blocked, float("-inf"))


def _find_kernel():
    """Helper D's dispatching kernel (Triton on CUDA, torch twin on CPU) when it exists; else ours."""
    try:
        from deepinfer_sg.kernels import apply_token_bitmask_inplace  # type: ignore
        return apply_token_bitmask_inplace
    except Exception:  # kernels not built yet: the plain-torch reference is exact, only slower
        return apply_token_bitmask_torch


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor) -> None:
    """Hook: every unfused mask application of the engine goes through here (the kernels' Triton
    version on CUDA, the byte-table torch version above on CPU)."""
    global _KERNEL
    if not logits.is_cuda:
        apply_token_bitmask_torch(logits, bitmask, indices)
        return
    if _KERNEL is None:
        _KERNEL = _find_kernel()
    _KERNEL(logits, bitmask, indices)


_KERNEL = None


# ---------------------------------------------------------------- sampling

def row_uniforms(rows: Sequence[SamplingRow], device, case: int = CASE_FRESH) -> torch.Tensor:
    """float64 [len(rows)]: each row's U = counter_uniform(seed & SEED_MASK, position, case), computed by the
    engine's one counter generator (engine/speculative.py `counter_uniforms`, shared with the speculative
    verifier). Seeds are cut to 63 bits exactly as the fused kernel and the speculative decoder cut them, so a
    request draws the same uniforms on every path."""
    seeds = torch.tensor([r.seed & SEED_MASK for r in rows], dtype=torch.int64)
    pos = torch.tensor([r.position for r in rows], dtype=torch.int64)
    return counter_uniforms(seeds, pos, case).to(device)


INVERSE_CDF_BLOCK = 1024   # two-level search: block sums first, then a cumulative sum inside one block


def inverse_cdf_blocked(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token per row of non-negative weights w [n, V] with uniforms u [n] in [0, 1); rows with total 0 give -1.

    Inverse-CDF sampling in vocabulary order, two-level so that no cumulative sum (a sequential scan) runs
    over the whole vocabulary: the sums of 1024-token blocks (a vectorised reduction), a float64 cumulative
    sum over the ~127 block sums picks block b with probability S_b / sum(S), then u's position inside that
    block's mass, rescaled to the block's own float64 cumulative sum, picks the token. So token t of block b
    has probability (S_b / sum S) * (w_t / sum_{block b} w): the exact law up to the float rounding of the
    block sums (~1e-7 relative, the same order as the fp32 weights themselves). Row-local: a row's draw does
    not depend on the other rows. Cost per row: one reduction pass over V plus O(V / 1024 + 1024)."""
    n, V = w.shape
    if n == 0:
        return torch.zeros(0, dtype=torch.long, device=w.device)
    B = INVERSE_CDF_BLOCK
    full = V // B
    parts = [w[:, :full * B].reshape(n, full, B).sum(-1)] if full else []
    if V % B:
        parts.append(w[:, full * B:].sum(-1, keepdim=True))
    bsum = torch.cat(parts, -1).to(torch.float64)                     # [n, nb]
    bcdf = bsum.cumsum(-1)
    total = bcdf[:, -1]
    target = u.to(torch.float64) * total
    b = torch.searchsorted(bcdf, target.unsqueeze(-1), right=True).squeeze(-1)
    last_block = bsum.shape[1] - 1 - (bsum > 0).flip(-1).to(torch.int8).argmax(-1)
    b = torch.minimum(b, last_block)                                  # u * total rounded up to total
    before = torch.cat([torch.zeros_like(bcdf[:, :1]), bcdf], -1).gather(1, b.unsqueeze(-1)).squeeze(-1)
    frac = ((target - before) / bsum.gather(1, b.unsqueeze(-1)).squeeze(-1)).clamp(0.0, 1.0)
    cols = b.unsqueeze(-1) * B + torch.arange(B, device=w.device)     # [n, B] token ids of block b
    inner = w.gather(1, cols.clamp_max(V - 1)).to(torch.float64).masked_fill(cols >= V, 0.0)
    icdf = inner.cumsum(-1)
    j = torch.searchsorted(icdf, (frac * icdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    last_in = B - 1 - (inner > 0).flip(-1).to(torch.int8).argmax(-1)
    j = torch.minimum(j, last_in)                                     # frac == 1 after rounding
    return torch.where(total > 0, b * B + j, torch.full_like(b, -1))


TOPP_CANDIDATES = 1024   # top-p/top-k rows first look at this many best tokens; a full sort only if needed


def _filtered_probs(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, width: int):
    """Sorted (desc) candidate probabilities after top-k then top-p, and their token ids, looking at the
    best `width` tokens. Also returns which rows need more than `width` candidates (then: call again
    with the full width). x: temperature-scaled logits [n, V]."""
    V = x.shape[-1]
    vals, order = torch.topk(x, min(width, V), dim=-1, sorted=True) if width < V else \
        torch.sort(x, dim=-1, descending=True, stable=True)
    ranks = torch.arange(vals.shape[-1], device=x.device)
    has_k = top_k > 0
    k = torch.where(has_k, top_k, torch.full_like(top_k, V))
    in_k = ranks.unsqueeze(0) < k.unsqueeze(-1)
    # normaliser: over the k kept tokens when top-k is on, over the whole vocabulary otherwise
    log_z = torch.where(has_k, torch.logsumexp(vals.masked_fill(~in_k, float("-inf")), -1), torch.logsumexp(x, -1))
    probs = torch.exp(vals.double() - log_z.double().unsqueeze(-1)).masked_fill(~in_k, 0.0)
    cum = probs.cumsum(-1)
    keep = (cum - probs) < top_p.unsqueeze(-1)
    # the candidate window was too short if top-k reaches past it or its mass has not reached top_p yet
    short = (k > vals.shape[-1]) & (cum[:, -1] < top_p)
    return probs.masked_fill(~keep, 0.0), order, short


def sample_rows(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> tuple[list[int], list[Optional[float]]]:
    """Torch path: pick one token per row of already-masked `logits` [R, V]. Returns (token ids, a None per
    row kept for the verifier's interface); a row with no allowed token gives -1.

    Inverse-CDF sampling with ONE counter uniform per row, U = counter_uniform(seed, position, CASE_FRESH):
    exact sampling from the processed distribution, a pure function of (row logits, seed, position), so
    independent of the batch composition and order. Plain rows: weights exp(z - max z), z = logits / T.
    Top-k/top-p rows: a top-1024 selection (a full sort only when the kept set is larger) gives the kept
    probabilities. Both are searched in vocabulary order (`inverse_cdf_blocked`), as the speculative
    verifier searches its processed distribution, so a bonus token equals the plain draw. Greedy rows: argmax
    (lowest id on ties). Cost per sampled row: ~3 passes over V (scale, exp, block sums); no sort, no
    per-token random numbers."""
    R, V = logits.shape
    dev = logits.device
    tokens = torch.full((R,), -1, dtype=torch.long, device=dev)
    mx = logits.max(-1).values
    alive = ~(torch.isneginf(mx) | torch.isnan(mx))
    greedy = [i for i, r in enumerate(rows) if r.greedy]
    if greedy:
        g = torch.tensor(greedy, device=dev)
        tokens[g] = logits[g].argmax(-1)
    plain = [i for i, r in enumerate(rows) if not r.greedy and r.top_k <= 0 and r.top_p >= 1.0]
    filtered = [i for i, r in enumerate(rows) if not r.greedy and (r.top_k > 0 or r.top_p < 1.0)]
    if plain:
        idx = torch.tensor(plain, device=dev)
        temps = torch.tensor([rows[i].temperature for i in plain], device=dev, dtype=torch.float32)
        m = torch.where(alive[idx], mx[idx], torch.zeros_like(mx[idx])).float()
        w = logits[idx].float()            # a fresh copy (index_select): scaled in place, max weight 1
        w.sub_(m.unsqueeze(-1))
        if bool((temps != 1.0).any()):   # T = 1 (the common case) skips a pass
            w.div_(temps.unsqueeze(-1))
        w.exp_()
        tokens[idx] = inverse_cdf_blocked(w, row_uniforms([rows[i] for i in plain], dev))
    if filtered:
        idx = torch.tensor(filtered, device=dev)
        temps = torch.tensor([rows[i].temperature for i in filtered], device=dev, dtype=torch.float32)
        top_k = torch.tensor([rows[i].top_k for i in filtered], device=dev)
        top_p = torch.tensor([rows[i].top_p for i in filtered], device=dev, dtype=torch.float64)
        x = logits[idx].float() / temps.unsqueeze(-1)
        probs, order, short = _filtered_probs(x, top_k, top_p, TOPP_CANDIDATES)
        if bool(short.any()):   # rare: a flat distribution whose kept set is wider than the window
            probs, order, _ = _filtered_probs(x, top_k, top_p, V)
        # searched in vocabulary order, like plain rows and the speculative verifier's processed
        # distribution, so one (seed, position) maps to the same token on every path (up to rounding)
        kept = torch.zeros(len(filtered), V, dtype=probs.dtype, device=dev).scatter_(1, order, probs)
        tokens[idx] = inverse_cdf_blocked(kept, row_uniforms([rows[i] for i in filtered], dev))
    tokens[~alive] = -1
    return tokens.tolist(), [None] * R


def _find_fused_sampler():
    try:
        from deepinfer_sg.kernels import sample_from_logits  # type: ignore
        return sample_from_logits
    except Exception:
        return None


_FUSED = _find_fused_sampler()
# On CPU the kernels' torch twin hashes every (row, token) in int64 (~20x slower than the path here), so
# CPU runs use sample_rows; CUDA runs use the fused Triton kernel. Both are batch independent; their
# draws differ from each other (different noise streams), each reproducible for a fixed seed.
FUSED_ON_CPU = False


def sample_batch(logits: torch.Tensor, rows: Sequence[SamplingRow], masks: Optional["MaskJob"] = None,
                 fused: Optional[bool] = None) -> list[int]:
    """The engine's sampling entry point: apply the rows' grammar masks and draw one token per row
    (-1 for a row whose mask allows nothing). fused=None: the kernels' fused sampler on CUDA (or on CPU
    when FUSED_ON_CPU), the torch path otherwise; True/False force a path (True: same draws as
    kernels.sample_from_logits / speculative_accept on every device)."""
    use_fused = (logits.is_cuda or FUSED_ON_CPU) if fused is None else fused
    if _FUSED is not None and logits.shape[0] and use_fused:
        dev = logits.device
        temperature = torch.tensor([0.0 if r.greedy else r.temperature for r in rows], dtype=torch.float32)
        top_k = torch.tensor([max(0, r.top_k) for r in rows], dtype=torch.int64)
        top_p = torch.tensor([r.top_p for r in rows], dtype=torch.float32)
        seed = torch.tensor([r.seed & SEED_MASK for r in rows], dtype=torch.int64)
        pos = torch.tensor([r.position for r in rows], dtype=torch.int64)
        bitmask = mask_rows = None
        if masks is not None and masks.bitmask is not None:
            bitmask = masks.bitmask.to(dev, non_blocking=True)
            mr = torch.full((len(rows),), -1, dtype=torch.int64)
            mr[torch.tensor(masks.rows, dtype=torch.long)] = torch.tensor(masks.rows, dtype=torch.int64)
            mask_rows = mr.to(dev)
        # the parameters stay on the host: the kernel then knows there which rows filter (no threshold launches
        # when none does; the top-k lane path alone, which draws too, when every row is a small top-k) and moves
        # them in two packed copies (no per-field copies, no elementwise kernels on the device)
        out = _FUSED(logits.contiguous(), temperature, top_k, top_p, seed, pos, bitmask=bitmask,
                     mask_rows=mask_rows).tolist()
        dead = [i for i, t in enumerate(out) if t < 0]
        if dead:
            # -1 must mean "nothing allowed"; an early kernel version also returned it when its float32
            # uniform rounded to 1.0 (fixed since). Defensive: re-check such rows on the torch path.
            idx = torch.tensor(dead, device=dev)
            sub = logits[idx].float().clone()
            if bitmask is not None:
                keep = mask_rows[idx]
                have = (keep >= 0).nonzero().squeeze(-1)
                if have.numel():
                    apply_token_bitmask_torch(sub, bitmask[keep.clamp_min(0)], have)
            redo, _ = sample_rows(sub, [rows[i] for i in dead])
            for i, t in zip(dead, redo):
                out[i] = t
        return out
    if masks is not None:
        masks.apply(logits)
    return sample_rows(logits, rows)[0]


def raw_logprobs(logits: torch.Tensor, row_indices: list[int]) -> Optional[torch.Tensor]:
    """log_softmax of the unmasked logits for the rows that asked for logprobs (call before masking)."""
    if not row_indices:
        return None
    return torch.log_softmax(logits[torch.tensor(row_indices, device=logits.device)].float(), -1)
