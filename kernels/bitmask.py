"""Token bitmask application: set logits of disallowed tokens to -inf, in place.

Bitmask layout (shared with deepinfer_sg.grammars): int32 [N, W], W = ceil(V / 32); bit b of word w is token
32*w + b; a set bit means allowed. Columns at or beyond min(logits width, 32*W) are never touched, so a vocab
that is not a multiple of 32 and a logits tensor padded wider than the tokenizer both work.

Three entry points, one kernel:
- apply_token_bitmask_inplace(logits, bitmask, indices=None, mask_rows=None): logits row indices[k] takes mask row
  mask_rows[k] (default indices[k], which is xgrammar's convention); indices None = every row r takes mask row r.
- apply_token_bitmask_by_step_inplace(logits, bitmask, logits_cu_rows, mask_cu_rows): speculative verify rows,
  packed per request: request i owns logits rows [logits_cu_rows[i], logits_cu_rows[i+1]) and mask rows
  [mask_cu_rows[i], mask_cu_rows[i+1]); its s-th logits row takes its s-th mask row; logits rows beyond the
  request's mask rows are left alone (the scheduler verifies fewer rows than the grammar walk produced masks for,
  or the walk stopped at an ungrammatical draft: such rows are rejected before they are used).
- mask_rows entries of -1 skip that logits row.

Cost: reads the bitmask rows used (4 bytes per 32 tokens); per block of 1024 tokens: nothing when all are allowed,
a write of -inf when all are banned, a read + write of the block when mixed (cheaper than the memory system's
read-for-ownership of partially written sectors). The Triton grid is (rows, vocab blocks); each program expands
BLOCK/32 words into BLOCK predicates.
"""
import torch
import triton
import triton.language as tl

from .backend import check, use_triton


def _check_inputs(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    check(logits.dim() == 2, f"logits must be [rows, vocab], got shape {tuple(logits.shape)}")
    check(logits.dtype in (torch.float32, torch.float16, torch.bfloat16),
          f"logits must be a float tensor, got {logits.dtype}")
    check(bitmask.dim() == 2 and bitmask.dtype == torch.int32,
          f"bitmask must be int32 [rows, ceil(vocab/32)], got {bitmask.dtype} {tuple(bitmask.shape)}")
    check(logits.stride(1) == 1 and bitmask.stride(1) == 1, "logits and bitmask rows must be contiguous")
    check(logits.device == bitmask.device, f"logits on {logits.device} but bitmask on {bitmask.device}")


def _row_maps(logits, bitmask, indices, mask_rows):
    """(logits rows, mask rows) as int64 tensors on the logits' device, after validating them."""
    dev = logits.device
    if indices is None:
        check(mask_rows is None, "mask_rows needs indices (the logits rows it applies to)")
        n = logits.shape[0]
        check(bitmask.shape[0] >= n, f"bitmask has {bitmask.shape[0]} rows, logits {n}: need one mask per row")
        rows = torch.arange(n, device=dev)
        return rows, rows
    rows = torch.as_tensor(indices, device=dev).to(torch.int64).reshape(-1)
    masks = rows if mask_rows is None else torch.as_tensor(mask_rows, device=dev).to(torch.int64).reshape(-1)
    check(masks.numel() == rows.numel(), f"indices has {rows.numel()} entries but mask_rows {masks.numel()}")
    return rows, masks


def by_step_mask_rows(logits_cu_rows: torch.Tensor, mask_cu_rows: torch.Tensor, total_rows: int) -> torch.Tensor:
    """Mask row for every packed logits row (-1 = none), computed on the device with no host sync."""
    lc = logits_cu_rows.to(torch.int64)
    mc = mask_cu_rows.to(torch.int64).to(lc.device)
    r = torch.arange(total_rows, device=lc.device)
    req = torch.searchsorted(lc[1:].contiguous(), r, right=True).clamp_max(lc.numel() - 2)
    step = r - lc[req]
    n_masks = mc[req + 1] - mc[req]
    return torch.where(step < n_masks, mc[req] + step, torch.full_like(step, -1))


# ---------------------------------------------------------------------------------------------- torch twin
def apply_token_bitmask_torch(logits, bitmask, indices=None, mask_rows=None) -> None:
    """Plain-torch twin (CPU path and oracle): unpack the needed mask rows to booleans, then masked_fill_."""
    _check_inputs(logits, bitmask)
    rows, masks = _row_maps(logits, bitmask, indices, mask_rows)
    keep = masks >= 0
    rows, masks = rows[keep], masks[keep]
    if rows.numel() == 0:
        return
    n_cols = min(logits.shape[1], 32 * bitmask.shape[1])
    words = bitmask[masks]                                           # [n, W]
    bits = (words.unsqueeze(-1) >> torch.arange(32, device=words.device, dtype=torch.int32)) & 1
    allowed = bits.reshape(words.shape[0], -1)[:, :n_cols].bool()
    sub = logits[rows, :n_cols]
    logits[rows, :n_cols] = sub.masked_fill(~allowed, float("-inf"))


# ---------------------------------------------------------------------------------------------- Triton
@triton.jit
def _bitmask_kernel(logits_ptr, bitmask_ptr, rows_ptr, masks_ptr, n_cols, logits_stride, bitmask_stride,
                    BLOCK: tl.constexpr, ADAPTIVE: tl.constexpr):
    # n_cols <= 32 * words, so guarding words by ceil(n_cols / 32) never reads past a mask row.
    r = tl.program_id(0)
    blk = tl.program_id(1)
    row = tl.load(rows_ptr + r)
    mrow = tl.load(masks_ptr + r)
    if mrow >= 0:
        word_ids = blk * (BLOCK // 32) + tl.arange(0, BLOCK // 32)
        words = tl.load(bitmask_ptr + mrow * bitmask_stride + word_ids, mask=word_ids < (n_cols + 31) // 32,
                        other=-1)
        banned = ((words[:, None] >> tl.arange(0, 32)[None, :]) & 1) == 0
        banned = tl.reshape(banned, (BLOCK,))
        cols = blk * BLOCK + tl.arange(0, BLOCK)
        valid = cols < n_cols
        ptrs = logits_ptr + row.to(tl.int64) * logits_stride + cols
        if ADAPTIVE:
            # Partially written 32-byte sectors make the memory system read them first (one dependent round
            # trip per store); an explicit coalesced load is cheaper. So: a block with nothing banned is left
            # alone, a block with everything banned is written without reading, a mixed block is read and
            # written whole.
            n_banned = tl.sum((banned & valid).to(tl.int32), axis=0)
            n_valid = tl.minimum(n_cols - blk * BLOCK, BLOCK)
            if n_banned == n_valid:
                tl.store(ptrs, float("-inf"), mask=valid)
            elif n_banned > 0:
                x = tl.load(ptrs, mask=valid).to(tl.float32)       # exact round trip for fp16 / bf16
                tl.store(ptrs, tl.where(banned, float("-inf"), x), mask=valid)
        else:
            tl.store(ptrs, float("-inf"), mask=banned & valid)


def apply_token_bitmask_triton(logits, bitmask, indices=None, mask_rows=None, block: int = 1024,
                               num_warps: int = 4, adaptive: bool = True) -> None:
    # block 1024 / 4 warps, adaptive: the fastest variant timed on an H200 at B=64 and B=512 with random masks
    # (benchmarks/kernels.py --sweep: 78% / 90% of copy bandwidth vs 67% / 74% for masked stores only).
    """Triton path (also runs on CPU tensors under TRITON_INTERPRET=1). adaptive=False: masked stores of the
    banned tokens only (the previous kernel, kept for the benchmark's comparison)."""
    _check_inputs(logits, bitmask)
    rows, masks = _row_maps(logits, bitmask, indices, mask_rows)
    n_cols = min(logits.shape[1], 32 * bitmask.shape[1])
    if rows.numel() == 0 or n_cols == 0:
        return
    block = min(block, max(32, triton.next_power_of_2(n_cols)))
    grid = (rows.numel(), triton.cdiv(n_cols, block))
    _bitmask_kernel[grid](logits, bitmask, rows, masks, n_cols, logits.stride(0), bitmask.stride(0),
                          BLOCK=block, ADAPTIVE=adaptive, num_warps=num_warps)


# ---------------------------------------------------------------------------------------------- dispatch
def apply_token_bitmask_inplace(logits: torch.Tensor, bitmask: torch.Tensor, indices=None, mask_rows=None) -> None:
    """Set logits[indices[k], v] = -inf where bit v of bitmask[mask_rows[k]] is 0 (see module docstring)."""
    if use_triton(logits):
        apply_token_bitmask_triton(logits, bitmask, indices, mask_rows)
    else:
        apply_token_bitmask_torch(logits, bitmask, indices, mask_rows)


def apply_token_bitmask_by_step_inplace(logits: torch.Tensor, bitmask: torch.Tensor,
                                        logits_cu_rows: torch.Tensor, mask_cu_rows: torch.Tensor) -> None:
    """Mask packed speculative rows: the s-th row of request i takes mask row mask_cu_rows[i] + s, if it exists."""
    check(logits_cu_rows.numel() == mask_cu_rows.numel() and logits_cu_rows.numel() >= 1,
          f"logits_cu_rows ({logits_cu_rows.numel()}) and mask_cu_rows ({mask_cu_rows.numel()}) must both be [B+1]")
    masks = by_step_mask_rows(logits_cu_rows.to(logits.device), mask_cu_rows, logits.shape[0])
    rows = torch.arange(logits.shape[0], device=logits.device)
    apply_token_bitmask_inplace(logits, bitmask, rows, masks)
