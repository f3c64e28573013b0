"""Lightning-indexer scores and top-k selection of compressed entries (architecture doc section 2.5).

For query row n (one decode/verify token) and each visible compressed entry g of its sequence:
  I[n, g] = sum_h w[n, h] * relu(iq[n, h] . ik[g])
then the k highest-scoring entries (fewer if fewer are visible; the rest -1). Ties: unspecified (as in the doc).

Shapes: iq [N, Hi, Di], w [N, Hi] (fp32), index_keys [P, Di] (a pool; row n's entries are
index_keys[key_start[n] + g] for g < key_len[n]), k int. Returns (idx int64 [N, k] entry numbers g, -1 padded;
scores fp32 [N, k], -inf padded), best first.
Triton: the score kernel (grid rows x entry blocks; per program one [Hi, Di] x [Di, BLOCK_G] product, relu and the
head-weighted sum in registers) writes scores [N, max_len]; torch.topk selects. The candidate-block restriction of
layers 24/28/... is expressed by the caller through key_start/key_len of a gathered pool.
Cost: N * max_len * Di * bytes(keys) (+ scores written and read once by topk).
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
    """Top-k of [N, L] scores (-inf = not visible) -> (idx padded with -1, scores padded with -inf)."""
    N, L = scores.shape
    kk = min(k, L)
    val, idx = scores.topk(kk, dim=1) if kk > 0 else (scores[:, :0], scores[:, :0].long())
    idx = torch.where(val > float("-inf"), idx, torch.full_like(idx, -1))
    if kk < k:
        val = torch.cat([val, val.new_full((N, k - kk), float("-inf"))], 1)
        idx = torch.cat([idx, idx.new_full((N, k - kk), -1)], 1)
    return idx, val


def select_two_stage(scores, k, chunk: int = 2048):
    """Same contract as `_select`, in two torch.topk calls: the top-k of each `chunk`-wide slice, then the top-k
    of those candidates (exact: each of the row's k best is among its slice's k best). A candidate for long rows
    (L = 16384, k = 512) where one wide topk measured 77 us on an H200; benchmarks/kernels.py times both."""
    N, L = scores.shape
    if L <= chunk or k >= chunk:
        return _select(scores, k)
    pad = (-L) % chunk
    padded = torch.nn.functional.pad(scores, (0, pad), value=float("-inf"))
    val, idx = padded.view(N, -1, chunk).topk(k, dim=2)                  # [N, slices, k]
    idx = idx + (torch.arange(idx.shape[1], device=scores.device) * chunk)[None, :, None]
    v2, i2 = val.reshape(N, -1).topk(k, dim=1)
    out = idx.reshape(N, -1).gather(1, i2)
    return torch.where(v2 > float("-inf"), out, torch.full_like(out, -1)), v2


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


def indexer_scores_triton(iq, w, keys, key_start, key_len, max_len, block_g: int = 128, num_warps: int = 4):
    """The score kernel alone: fp32 [N, max_len], -inf where not visible."""
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


def indexer_topk_triton(iq, w, keys, key_start, key_len, k, max_len=None, block_g: int = 128,
                        two_stage: bool = False):
    """two_stage: select with `select_two_stage` (off until the H200 table shows it faster)."""
    _check(iq, w, keys, key_start, key_len, k)
    N, Hi, Di = iq.shape
    check(Di >= 16 and Di & (Di - 1) == 0, f"index head dim must be a power of two >= 16, got {Di}")
    max_len = int(key_len.max()) if max_len is None else max_len
    scores = indexer_scores_triton(iq, w, keys, key_start, key_len, max_len, block_g)
    return select_two_stage(scores, k) if two_stage else _select(scores, k)


def indexer_topk(iq: torch.Tensor, w: torch.Tensor, index_keys: torch.Tensor, key_start: torch.Tensor,
                 key_len: torch.Tensor, k: int, max_len: int | None = None):
    """Scores and top-k entries per query row (module docstring). max_len: the largest key_len (pass it from the
    host to avoid a device sync)."""
    if use_triton(iq):
        return indexer_topk_triton(iq, w, index_keys, key_start, key_len, k, max_len)
    return indexer_topk_torch(iq, w, index_keys, key_start, key_len, k, max_len)
