"""Engram's device half in two launches: decode the table rows, and gate the projected value into the streams.

Contract (engine/engram.py `Engram.mix`, around its one GEMM):
    unpack_rows(packed [N, W + W/32] uint8, W, dtype) -> [N, W] dtype: FP8 E4M3 bytes times 2^(scale byte - 127)
        per 32 values (the table's stored bytes, exact in bf16 / fp32);
    gather_rows(ids [...] int64, weight [rows, W] uint8, scale [rows, W/32] uint8, dtype) -> [..., W] dtype: the same
        decode of table rows `ids`, read by the kernel itself (the table in pinned host memory: no host gather);
    hashed_rows(src, ids, consts, pad, weight, scale, dtype) -> [T, (N-1) H, W] dtype: the rows of each token's hashed
        N-gram window (engine/engram.py's hash), hashed, read and decoded in one launch;
    engram_gate(R [T, M, H], kv [T, (M+1) H], w [M, H] fp32, eps) -> R' [T, M, H] in R's dtype, with
        r = R (fp32), key_m = kv[:, m H:(m+1) H], value = kv[:, M H:] (as fp32),
        d_m = <r_m, w_m * key_m> * rsqrt(mean(r_m^2) + eps) * rsqrt(mean(key_m^2) + eps) / sqrt(H),
        gate_m = sigmoid(sign(d_m) sqrt(max(|d_m|, 1e-6))),   R'_m = r_m + gate_m * value.
Why: the torch form is ~40 launches per Engram layer (byte slicing, the scale exponents, products, norms, signs,
square roots, the sigmoid, the write-back), each a few microseconds at decode sizes: R1 of session 7, mid-size V4.1,
batch 8: 86 launches and 210 us for the two Engram layers, 65 us of it the GEMM.
Why the reads by id (gather_rows / hashed_rows): the host's hashing and table lookups of the step's Engram rows
cost 0.4 / 1.1 / 3.0 ms of host time per step at batch 8 / 64 / 256 (mid-size V4.1, two Engram layers, session 10
R2 on the H200) and cut the step's CUDA graph in three; read by the device from the pinned table, one graph runs
the step and the host only uploads the windows.
Cost: unpack N (W + W/32) bytes read, N W written; gate 2 T M H + T (M+1) H elements read, T M H written; one
program per table row / per (token, stream). hashed_rows: T (N-1) H rows of W + W/32 bytes read over PCIe (the
table in pinned host memory), one program per token and HASH_ROWS_HOST_BLOCK rows (HASH_ROWS_BLOCK from a table in
device memory). Session 10 R2 (8 rows a program): the mid-size step's graphs took 0.27 ms longer at batch 256 (7.75
against 7.48 ms for the same step with the rows uploaded by the host: ~3.2 MB at ~12 GB/s), no longer at batch 8 /
64 (4.08 / 5.16 against 4.09 / 5.15).
Where hashed_rows' time goes (session 16, K4 on the H200, .round scripts: the mid-size / V4.1 Engram geometry, N = 4,
8 heads, W = 256, so 24 rows of 264 B a token, from a table of 4.8M rows (1.27 GB, one mid-size layer's); 16 calls
in a CUDA graph, PDL on; us a call, rows cold: ids re-drawn before every replay). R1, 8 rows a program, T = 8 / 64 /
256: from pinned host memory 8.86-9.55 / 23.29-23.40 / 64.52-65.02 (warm, the same ids again: 6.88-7.20 /
14.97-15.09 / 64.57-64.83); the same kernel on a device-memory copy of the table 4.18 / 5.03 / 6.94. So the hash
costs a few us and the rest is the rows' trip over PCIe. The copy engine moves as many bytes, contiguous, from pinned
to device memory (R2, 16 copies in a graph) in 4.07 / 11.71 / 36.38 us (12.5 / 34.6 / 44.6 GB/s; 55.3 GB/s for
256 MB). R3: 2 rows a program (HASH_ROWS_HOST_BLOCK) 6.14 / 16.87 / 51.69 against 8.09-8.29 / 22.27-23.54 /
66.13-66.74 with 8, i.e. 69% / 70% of the copy engine's time for the bytes at T = 64 / 256 (why more, smaller
programs read faster over PCIe is not established); 1 row 6.27 / 17.84 / 52.58 (at 2 warps 6.10 / 16.81 / 51.43).
On a device table 1 row loses (3.39 / 5.87 / 16.87 against 4.30 / 4.61 / 6.58 with 8), so a device table keeps 8
(HASH_ROWS_BLOCK). Measured and deleted (R1, 8 rows a program, cold): each row's scale bytes loaded once a 32-value
group ([rows, groups, 32] tiles; each thread loads 16 scale bytes one by one now) 9.27 / 23.05 / 65.92; the table
interleaved [rows, W + G] (one read a row, but its 264-byte stride allows only byte loads) 8.01 / 21.94 / 70.52;
32 rows a program 7.94 / 22.28 / 84.14. A table that fits in device memory (the mid-size model's two, 2.5 GB) is
the cut: 4-7 us whatever T (not taken: EngramTable.device_arrays pins in-memory tables in host memory on CUDA, so
the engine runs HASH_ROWS_HOST_BLOCK; this kernel reads wherever its pointers point).
PDL (backend.pdl_kw: each kernel waits before its first read of the step's data and its first store; the hash's
primes / offsets, uploaded once, are read before the wait; the gate's weight after it, since engram.py makes that
product with a torch launch on first use and after a weight change): session 12 R2 (the gate then read its weight
before the wait) on the H200, a mid-size Engram layer, 16 calls in a CUDA graph (benchmarks/model_forward.py
--engram-kernels), PDL off -> on, T = 8 / 64 / 256:
hashed_rows 6.74 -> 6.42, 14.72 -> 14.50, 44.38 -> 44.61 us (bound by its reads over PCIe: neutral); engram_gate
2.28 -> 1.95, 2.76 -> 2.41, 4.74 -> 4.61 us. Kept for all three kernels (_rows_kernel, not timed, runs only where
the host looks the rows up or hashes their ids: memory-mapped tables, token ids on the device).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .backend import check, empty, pdl_kw, pdl_wait, use_triton

GROUP = 32      # values per UE8M0 scale byte
# table rows per program of the hashed read (a token's (N-1) x heads rows in a few programs). 32 (one program per
# token of the mid-size model) measured the same, session 10 R3: graphs back to back 7.81 / 5.12 ms at batch 256 / 64
# against 7.80-7.83 / 5.13-5.15 with 8. For a table in device memory.
HASH_ROWS_BLOCK = 8
# The same for a table in (pinned) host memory, its rows read over PCIe: 2 rows a program take 22-28% less time
# than 8 (module docstring, session 16 R3).
HASH_ROWS_HOST_BLOCK = 2


def unpack_rows_torch(packed: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """The twin (and the CPU path)."""
    w = packed[..., :width].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    s = torch.exp2(packed[..., width:].to(torch.float32) - 127.0).repeat_interleave(GROUP, dim=-1)[..., :width]
    return (w * s).to(dtype)


def engram_gate_torch(R: torch.Tensor, kv: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The twin (and the CPU path)."""
    t, m, h = R.shape
    kv = kv.float()
    key = kv[:, : m * h].view(t, m, h)
    value = kv[:, m * h:]
    r = R.float()
    dot = (r * w * key).sum(-1)
    dot = dot * torch.rsqrt(r.pow(2).mean(-1) + eps) * torch.rsqrt(key.pow(2).mean(-1) + eps) / math.sqrt(h)
    gate = torch.sigmoid(torch.sign(dot) * dot.abs().clamp_min(1e-6).sqrt())   # [T, M]
    return (r + gate[..., None] * value[:, None, :]).to(R.dtype)


@triton.jit
def _decode(b, s):
    """E4M3 bytes b times 2^(s - 127) for UE8M0 scale bytes s (both int32) -> float32."""
    e, m = (b >> 3) & 15, b & 7
    # E4M3 by its bits: normal (1 + m/8) 2^(e-7), subnormal m/8 2^-6, the one NaN code (e = 15, m = 7)
    normal = ((b >> 7) << 31 | (e + 120) << 23 | m << 20).to(tl.float32, bitcast=True)
    sub = tl.where((b >> 7) == 1, -1.0, 1.0) * m.to(tl.float32) * 0.001953125
    v = tl.where(e == 0, sub, tl.where((e == 15) & (m == 7), float("nan"), normal))
    return v * (s << 23).to(tl.float32, bitcast=True)                  # 2^(s - 127), exactly


@triton.jit
def _rows_kernel(ids_ptr, w_ptr, s_ptr, out_ptr, W, w_stride, s_stride, GATHER: tl.constexpr,
                 BLOCK_W: tl.constexpr, PDL: tl.constexpr = False):
    """Program n decodes row n of the packed rows (GATHER off: bytes and scale bytes of row n at w_ptr / s_ptr with
    the rows' stride), or table row ids[n] (GATHER on: w_ptr / s_ptr are the table's weight and scale arrays)."""
    n = tl.program_id(0).to(tl.int64)
    pdl_wait(PDL)     # (the ids, or the packed rows, are the step's: nothing to read before)
    row = tl.load(ids_ptr + n).to(tl.int64) if GATHER else n
    i = tl.arange(0, BLOCK_W)
    ok = i < W
    b = tl.load(w_ptr + row * w_stride + i, mask=ok, other=0).to(tl.int32)
    s = tl.load(s_ptr + row * s_stride + i // 32, mask=ok, other=127).to(tl.int32)
    tl.store(out_ptr + n * W + i, _decode(b, s).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _hash_kernel(src_ptr, ids_ptr, T, cls_ptr, mult_ptr, prime_ptr, off_ptr, pad, w_ptr, s_ptr, out_ptr, W, G, J,
                 N: tl.constexpr, H: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_W: tl.constexpr,
                 PDL: tl.constexpr = False):
    """Program (t, jb): token t's table rows jb * BLOCK_J.. (row j = n-gram size j // H + 2, head j % H), hashed from
    its window and read + decoded (the layout of `hashed_rows_torch`)."""
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    okj = j < J
    prime = tl.load(prime_ptr + j, mask=okj, other=1)      # (the hash's constants: read before the wait)
    offset = tl.load(off_ptr + j, mask=okj, other=0)
    pdl_wait(PDL)
    accj = tl.zeros((BLOCK_J,), dtype=tl.int64)
    for i in tl.static_range(N):
        k = tl.load(src_ptr + t * N + i)              # this step's id k, or (k < 0) the one given after the indices
        tok = tl.where(k >= 0, tl.load(ids_ptr + tl.maximum(k, 0)), tl.load(src_ptr + (T + t) * N + i))
        term = tl.load(cls_ptr + tl.where(tok < 0, pad, tok)) * tl.load(mult_ptr + i)
        if i == 0:
            acc = term
        else:
            acc = acc ^ term
            accj = tl.where(j // H == i - 1, acc, accj)
    # (acc >= 0: classes and multipliers are >= 0 and their products stay below 2^63, engram.multiplier_bound)
    row = accj % prime + offset
    i = tl.arange(0, BLOCK_W)
    ok = okj[:, None] & (i < W)[None, :]
    b = tl.load(w_ptr + row[:, None] * W + i[None, :], mask=ok, other=0).to(tl.int32)
    s = tl.load(s_ptr + row[:, None] * G + i[None, :] // 32, mask=ok, other=127).to(tl.int32)
    tl.store(out_ptr + (t * J + j)[:, None] * W + i[None, :], _decode(b, s).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _gate_kernel(r_ptr, kv_ptr, w_ptr, out_ptr, H, M, kv_stride, eps, BLOCK_H: tl.constexpr,
                 PDL: tl.constexpr = False):
    t = tl.program_id(0).to(tl.int64)
    m = tl.program_id(1)
    h = tl.arange(0, BLOCK_H)
    ok = h < H
    # (the weight too after the wait: the engine's gate weight is a product the kernel before may have just made)
    pdl_wait(PDL)
    w = tl.load(w_ptr + m * H + h, mask=ok, other=0.0)
    r = tl.load(r_ptr + (t * M + m) * H + h, mask=ok, other=0.0).to(tl.float32)
    key = tl.load(kv_ptr + t * kv_stride + m * H + h, mask=ok, other=0.0).to(tl.float32)
    value = tl.load(kv_ptr + t * kv_stride + M * H + h, mask=ok, other=0.0).to(tl.float32)
    dot = tl.sum(r * w * key, axis=0)
    dot = dot / tl.sqrt(tl.sum(r * r, axis=0) / H + eps) / tl.sqrt(tl.sum(key * key, axis=0) / H + eps) / tl.sqrt(
        H.to(tl.float32))
    sgn = tl.where(dot > 0, 1.0, tl.where(dot < 0, -1.0, 0.0))
    z = sgn * tl.sqrt(tl.maximum(tl.abs(dot), 1e-6))
    gate = 1.0 / (1.0 + tl.exp(-z))
    tl.store(out_ptr + (t * M + m) * H + h, (r + gate * value).to(out_ptr.dtype.element_ty), mask=ok)


def unpack_rows_triton(packed: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """The decode kernel: same contract as `unpack_rows_torch` (any leading shape)."""
    check(packed.dtype == torch.uint8 and packed.shape[-1] == width + -(-width // GROUP),
          f"unpack_rows: {packed.dtype} rows of {packed.shape[-1]} bytes for width {width} (want uint8, "
          f"{width} + {-(-width // GROUP)} scale bytes)")
    p = packed.contiguous()
    out = empty((*packed.shape[:-1], width), dtype, packed.device)
    n = p.numel() // max(p.shape[-1], 1)
    if n:
        _rows_kernel[(n,)](p, p, p[..., width:], out, width, p.shape[-1], p.shape[-1], GATHER=False,
                           BLOCK_W=triton.next_power_of_2(width), **pdl_kw())
    return out


def gather_rows_torch(ids: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The twin (and the CPU path) of `gather_rows_triton`: table rows ids [...] of weight [rows, W] (E4M3 bytes) /
    scale [rows, W/32] (UE8M0 bytes), decoded -> [..., W] dtype."""
    rows = ids.to(weight.device)
    return unpack_rows_torch(torch.cat([weight[rows], scale[rows]], dim=-1), weight.shape[1], dtype).to(ids.device)


def _check_table(weight: torch.Tensor, scale: torch.Tensor, who: str) -> None:
    """A table as the row kernels read it: contiguous uint8 weight [rows, W] and UE8M0 scale [rows, ceil(W/32)]."""
    W = weight.shape[1]
    check(weight.dtype == torch.uint8 and scale.dtype == torch.uint8
          and scale.shape == (weight.shape[0], -(-W // GROUP)) and weight.is_contiguous() and scale.is_contiguous(),
          f"{who}: weight {weight.dtype} {tuple(weight.shape)}, scale {scale.dtype} {tuple(scale.shape)} (want "
          f"contiguous uint8 [rows, W] and [rows, ceil(W / {GROUP})])")


def gather_rows_triton(ids: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                       dtype: torch.dtype) -> torch.Tensor:
    """Read table rows on the device and decode them in one launch: ids [...] int64 on the device (in range: the
    caller checks), weight [rows, W] / scale [rows, W/32] uint8 wherever the device can read them (device memory, or
    pinned / registered host memory through unified addressing: then each row crosses PCIe once, inside the launch
    that decodes it) -> [..., W] dtype on the ids' device."""
    W = weight.shape[1]
    check(ids.dtype == torch.int64, f"gather_rows: ids must be int64, got {ids.dtype}")
    _check_table(weight, scale, "gather_rows")
    idc = ids.contiguous()
    out = empty((*ids.shape, W), dtype, ids.device)
    if idc.numel():
        _rows_kernel[(idc.numel(),)](idc, weight, scale, out, W, W, scale.shape[1], GATHER=True,
                                     BLOCK_W=triton.next_power_of_2(W), **pdl_kw())
    return out


def hashed_rows_torch(src: torch.Tensor, ids: torch.Tensor, consts: tuple, pad: int, weight: torch.Tensor,
                      scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The twin (and the CPU path) of `hashed_rows_triton`: each token's N-gram window hashed to its table rows (as
    engine/engram.py's hash_rows), which are read and decoded (`gather_rows_torch`) -> [T, (N-1) H, W] dtype.
    src int64 [2, T, N]: token t's window (itself, then the N - 1 before it) as src[0, t] = indices into ids (this
    step's tokens [T]), where -1 means the token src[1, t] instead (an earlier one; negative: before the sequence
    start, hashed as `pad`); consts = (classes [V] (token -> class), mult [N], prime [(N-1) H], offset [(N-1) H]),
    int64 on ids' device. Fixed shapes for a token count T (a CUDA graph's inputs)."""
    classes, mult, prime, offset = consts
    T, N = ids.shape[0], mult.shape[0]
    w = torch.where(src[0] >= 0, ids[src[0].clamp(min=0)], src[1])
    c = classes[torch.where(w < 0, pad, w)] * mult
    acc, accs = c[:, 0], []
    for i in range(1, N):
        acc = acc ^ c[:, i]
        accs.append(acc)
    rows = torch.stack(accs, 1)[:, :, None] % prime.view(N - 1, -1) + offset.view(N - 1, -1)
    return gather_rows_torch(rows.reshape(T, -1), weight, scale, dtype)


def hashed_rows_triton(src: torch.Tensor, ids: torch.Tensor, consts: tuple, pad: int, weight: torch.Tensor,
                       scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Hash, read and decode in one launch: same contract as `hashed_rows_torch` (the table wherever the device can
    read it, as for `gather_rows_triton`)."""
    classes, mult, prime, offset = consts
    T, N, W = ids.shape[0], mult.shape[0], weight.shape[1]
    J = prime.shape[0]
    check(src.dtype == torch.int64 and ids.dtype == torch.int64 and tuple(src.shape) == (2, T, N)
          and J % max(N - 1, 1) == 0 and offset.shape == prime.shape
          and all(t.dtype == torch.int64 and t.is_contiguous() for t in consts),
          f"hashed_rows: src {src.dtype} {tuple(src.shape)}, ids {ids.dtype} {tuple(ids.shape)}, "
          f"mult {tuple(mult.shape)}, prime {tuple(prime.shape)}, offset {tuple(offset.shape)} (want int64 src "
          f"[2, T, N] and contiguous int64 constants)")
    _check_table(weight, scale, "hashed_rows")
    out = empty((T, J, W), dtype, ids.device)
    if T and J:
        BLOCK_J = min(HASH_ROWS_BLOCK if weight.is_cuda else HASH_ROWS_HOST_BLOCK, triton.next_power_of_2(J))
        _hash_kernel[(T, triton.cdiv(J, BLOCK_J))](src.contiguous(), ids.contiguous(), T, classes, mult, prime,
                                                  offset, int(pad), weight, scale, out, W, scale.shape[1], J, N=N,
                                                  H=J // (N - 1), BLOCK_J=BLOCK_J, BLOCK_W=triton.next_power_of_2(W),
                                                  **pdl_kw())
    return out


def engram_gate_triton(R: torch.Tensor, kv: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The gate kernel: same contract as `engram_gate_torch` (kv rows at any stride)."""
    T, M, H = R.shape
    check(kv.dim() == 2 and kv.shape == (T, (M + 1) * H) and w.shape == (M, H) and w.dtype == torch.float32,
          f"engram_gate: R {tuple(R.shape)}, kv {tuple(kv.shape)}, w {w.dtype} {tuple(w.shape)} (want kv "
          f"[{T}, {(M + 1) * H}], w fp32 [{M}, {H}])")
    Rc = R.contiguous()
    kvc = kv if kv.stride(1) == 1 else kv.contiguous()
    out = empty(R.shape, R.dtype, R.device)
    if T:
        BLOCK_H = triton.next_power_of_2(H)
        _gate_kernel[(T, M)](Rc, kvc, w.contiguous(), out, H, M, kvc.stride(0), float(eps), BLOCK_H=BLOCK_H,
                             num_warps=4 if BLOCK_H <= 1024 else 8, **pdl_kw())
    return out


def unpack_rows(packed: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Dispatch: the kernel on CUDA, the twin elsewhere."""
    if use_triton(packed):
        return unpack_rows_triton(packed, width, dtype)
    return unpack_rows_torch(packed, width, dtype)


def gather_rows(ids: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Dispatch on the ids' device: the kernel on CUDA, the twin elsewhere."""
    if use_triton(ids):
        return gather_rows_triton(ids, weight, scale, dtype)
    return gather_rows_torch(ids, weight, scale, dtype)


def hashed_rows(src: torch.Tensor, ids: torch.Tensor, consts: tuple, pad: int, weight: torch.Tensor,
                scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Dispatch on the ids' device: the kernel on CUDA, the twin elsewhere."""
    if use_triton(ids):
        return hashed_rows_triton(src, ids, consts, pad, weight, scale, dtype)
    return hashed_rows_torch(src, ids, consts, pad, weight, scale, dtype)


def engram_gate(R: torch.Tensor, kv: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Dispatch: the kernel on CUDA, the twin elsewhere."""
    if use_triton(R):
        return engram_gate_triton(R, kv, w, eps)
    return engram_gate_torch(R, kv, w, eps)
