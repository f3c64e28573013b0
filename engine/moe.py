"""Mixture of experts: sqrtsoftplus router (bias for selection only, or a frozen token->expert hash table),
clamped-SwiGLU routed experts and one shared expert. Parameter names follow DeepSeek's checkpoint
(`ffn.gate.weight`, `ffn.gate.bias` | `ffn.gate.tid2eid`, `ffn.experts.{e}.w1/w2/w3.weight`,
`ffn.shared_experts.w1/w2/w3.weight`). Cost per token: K+1 expert SwiGLUs plus an E x H router matvec.

The decode step's form (`MoE.forward_grouped`, CUDA): the gate is one kernels.router launch (GEMM + scores + top-k +
weights), the routed experts one grouped kernels.moe call, and the shared expert runs beside both on a second
stream (engine/streams.py), two kernels.skinny launches for few rows (`Expert.forward_fast`). On the
CPU the same calls run the torch twins, which are these modules' formulas: the same results bit for bit.

Routed experts kept quantized (`MoE.keep_quantized`, done by the loader for FP8/FP4 checkpoints on CUDA): the
experts' weights live in one `KeptExperts` per layer, float8_e4m3fn stacks [E, out, in] with fp32 row scales and
uint8 block-scale shifts (the layout of kernels.moe's fp8 path: 1 byte per weight + 1 per 32 weights, against 2
for bf16); the experts' nn.Linear weights become shape-only `meta` tensors (their names stay in state_dict). The
grouped kernel reads the stacks directly; the reference path (and the CPU twin) dequantizes each used expert on
the fly, exactly (every value is an e4m3 number times a power of two). The stacks are plain attributes, not
buffers: they stay on the device the loader put them on (Module.to() does not move them).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer_sg.kernels import router
from deepinfer_sg.kernels.skinny import skinny_linear, swiglu_clamped

from . import streams

_META_EXPERTS = False    # set by routed_experts_on_meta(): MoE builds its routed experts' weights on `meta`


@contextlib.contextmanager
def routed_experts_on_meta(on: bool = True):
    """Build every MoE's routed-expert Linear weights on the `meta` device (shapes only, no memory) inside the
    block: the loader then keeps them quantized (or materializes them) layer by layer."""
    global _META_EXPERTS
    old, _META_EXPERTS = _META_EXPERTS, on
    try:
        yield
    finally:
        _META_EXPERTS = old


@dataclass
class KeptExperts:
    """One layer's routed experts in kernels.moe's fp8 layout. `rows`: rows per block-scale shift (1: FP4
    experts' 1x32 groups, 32: FP8 experts' 32x32 blocks). The fp8 kernel widens the weights to fp16 (exact for e4m3
    and e2m1 values) and applies the shifts to fp32 partial products, so no shift calls for bf16 widening; the
    packed FP4 kernel folds each group's shift into the weights as it decodes them to bf16 (exact up to shift 126)
    and multiplies them with the activations in bf16 (kernels/moe.py w4_tiles)."""
    w1: torch.Tensor    # float8_e4m3fn [E, F, H] (packed FP4: uint8 [E, F, H/2], two E2M1 codes a byte)
    w3: torch.Tensor    # float8_e4m3fn [E, F, H]
    w2: torch.Tensor    # float8_e4m3fn [E, H, F] (packed: uint8 [E, H, F/2])
    s1: torch.Tensor    # fp32 [E, F]: row scale = the row's largest block scale
    s3: torch.Tensor
    s2: torch.Tensor    # fp32 [E, H]
    g1: torch.Tensor | None  # uint8 [E, ceil(H / 32), ceil(F / rows)]: block scale = row scale * 2**-shift
    g3: torch.Tensor | None  # (None once finalize() found every shift folded into the e4m3 values)
    g2: torch.Tensor | None  # uint8 [E, ceil(F / 32), ceil(H / rows)]
    rows: int

    @classmethod
    def empty(cls, n_experts: int, hidden: int, inter: int, rows: int, device, packed: bool = False
              ) -> "KeptExperts":
        """Uninitialised stacks; packed: FP4 bytes (half a byte per weight) instead of e4m3."""
        E, H, Fi = n_experts, hidden, inter
        cd = lambda a, b: -(-a // b)                                                   # noqa: E731
        c = 2 if packed else 1
        f8 = torch.uint8 if packed else torch.float8_e4m3fn
        u8 = dict(dtype=torch.uint8, device=device)
        return cls(torch.empty(E, Fi, H // c, dtype=f8, device=device),
                   torch.empty(E, Fi, H // c, dtype=f8, device=device), torch.empty(E, H, Fi // c, dtype=f8, device=device),
                   torch.empty(E, Fi, device=device), torch.empty(E, Fi, device=device), torch.empty(E, H, device=device),
                   torch.empty(E, cd(H, 32), cd(Fi, rows), **u8), torch.empty(E, cd(H, 32), cd(Fi, rows), **u8),
                   torch.empty(E, cd(Fi, 32), cd(H, rows), **u8), rows)

    def parts(self, which: str):
        """(weights, row scales, shifts) of "w1" | "w3" | "w2"."""
        i = which[1]
        return getattr(self, "w" + i), getattr(self, "s" + i), getattr(self, "g" + i)

    def store(self, which: str, e: int, w8: torch.Tensor, row_scale: torch.Tensor, shift: torch.Tensor) -> None:
        """Expert e's weight (e4m3 [out, in], or packed FP4 bytes [out, in/2]) with its row scales [out] and
        shifts [in/32, out/rows]. e4m3 weights whose shifts fold into the values exactly (quant.fold_shifts)
        are stored folded with zero shifts."""
        w, s, g = self.parts(which)
        if w.dtype == torch.float8_e4m3fn:
            from .quant import fold_shifts
            folded = fold_shifts(w8, shift, self.rows)
            if folded is not None:
                w8, shift = folded, torch.zeros_like(shift)
        w[e].copy_(w8)
        s[e].copy_(row_scale)
        g[e].copy_(shift)

    def finalize(self) -> None:
        """Drop the shifts when every one is zero (the row scales then say it all: the kernel's per-row path,
        measured 1.5x faster than the block-scaled one at the V4.1 shape). Packed FP4 always keeps them."""
        top = max(int(g.max()) for g in (self.g1, self.g3, self.g2))
        if top == 0 and self.w1.dtype == torch.float8_e4m3fn:
            self.g1 = self.g3 = self.g2 = None

    def shifts(self):
        """(g1, g3, g2) for kernels.moe, or None when the shifts were folded away."""
        return None if self.g1 is None else (self.g1, self.g3, self.g2)

    def dequantized(self, which: str, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert e's weight [out, in] in `dtype` (exact for bf16 / fp32)."""
        from deepinfer_sg.kernels.moe import dequantize_expert
        w, s, g = self.parts(which)
        return dequantize_expert(w[e], s[e], None if g is None else g[e], self.rows).to(dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w1, self.w3, self.w2, self.s1, self.s3, self.s2,
                                                          self.g1, self.g3, self.g2) if t is not None)


class ExpertLinear(nn.Linear):
    """nn.Linear whose weight may be kept quantized in its layer's KeptExperts (`kept` = (stacks, "w1", e)):
    then `weight` is a meta placeholder and forward dequantizes the slice on the fly. Calling the module (not
    reading `weight`) keeps forward hooks, e.g. the model's activation-quantization simulation, working."""
    kept = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kept is None:
            return super().forward(x)
        q, which, e = self.kept
        return F.linear(x, q.dequantized(which, e, x.dtype))


class Expert(nn.Module):
    def __init__(self, hidden: int, inter: int, limit: float, device=None):
        super().__init__()
        self.w1 = ExpertLinear(hidden, inter, bias=False, device=device)   # gate
        self.w3 = ExpertLinear(hidden, inter, bias=False, device=device)   # up
        self.w2 = ExpertLinear(inter, hidden, bias=False, device=device)   # down
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu_clamped(self.w1(x), self.w3(x), self.limit))

    def forward_fast(self, x: torch.Tensor) -> torch.Tensor:
        """Same as forward (bit for bit on the CPU, where kernels.skinny runs its twin: these formulas); on CUDA,
        up to kernels.skinny.MAX_ROWS rows, the front half (w1, w3, two clamps, silu, product: 6 launches) is one
        kernels.skinny launch (H200, session 8 R2, mid-size V4.1: 7.4 / 7.5 / 7.9 / 8.5 us at 8 / 16 / 32 / 64 rows
        against 18.1 - 18.4 us for the 6 launches), and so is the down product w2 (session 12 R3, PDL on, 64 rows:
        4.42 us against the library's 4.92; 31.3 against 32.4 us for the layer's gate + shared expert + write-back).
        Not for weights kept quantized."""
        if self.w1.kept is not None:
            return self(x)
        # (its own split-K tickets: it may run beside other kernels.skinny launches, on the side stream; its two
        # launches run in turn, so they may share them)
        h = skinny_linear(x, self.w1.weight, glu=(self.w3.weight, self.limit), site="shared expert")
        return skinny_linear(h, self.w2.weight, site="shared expert")


class Gate(nn.Module):
    def __init__(self, hidden: int, n_experts: int, top_k: int, vocab_size: int, hashed: bool,
                 scaling: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, hidden))
        self.hashed = hashed
        self.top_k = top_k
        self.scaling = scaling
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(vocab_size, top_k, dtype=torch.long))
        else:
            self.bias = nn.Parameter(torch.zeros(n_experts, dtype=torch.float32))

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 [T, n_experts]: sqrt(softplus(x W^T)), the affinities both the choice and the weights use."""
        return router.scores_torch(F.linear(x, self.weight))

    def weights_at(self, scores: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """fp32 [T, K]: the chosen experts' scores normalised to sum 1, times routed_scaling_factor."""
        return router.weights_at(scores, idx, self.scaling)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None):
        """-> (weights [T, K] fp32 incl. routed_scaling_factor, expert ids [T, K]). Score routing is
        kernels.router.gate_route: on CUDA the GEMM and the ~9 torch ops after it in one launch for few rows (the
        same formulas; the GEMM, then the twin, on the CPU)."""
        if not self.hashed:
            return router.gate_route(x, self.weight, self.bias.float(), self.top_k, self.scaling)
        if token_ids is None:
            raise ValueError("hash-routed MoE layer needs the token ids")
        idx = self.tid2eid[token_ids.reshape(-1)].long()
        return self.weights_at(self.scores(x), idx), idx


class MoE(nn.Module):
    def __init__(self, hidden: int, inter: int, n_experts: int, top_k: int, n_shared: int, limit: float,
                 vocab_size: int, hashed: bool, scaling: float):
        super().__init__()
        self.gate = Gate(hidden, n_experts, top_k, vocab_size, hashed, scaling)
        dev = "meta" if _META_EXPERTS else None
        self.experts = nn.ModuleList(Expert(hidden, inter, limit, device=dev) for _ in range(n_experts))
        self.shared_experts = Expert(hidden, inter, limit) if n_shared else None
        self.kept: KeptExperts | None = None     # routed experts kept quantized (keep_quantized)

    def keep_quantized(self, rows: int, device, packed: bool = False) -> KeptExperts:
        """Hold the routed experts in fp8 (packed: FP4) stacks on `device` (filled by the caller with
        KeptExperts.store, then finalize()); the experts' Linear weights become meta placeholders."""
        first = self.experts[0].w1
        self.kept = KeptExperts.empty(len(self.experts), first.in_features, first.out_features, rows, device, packed)
        for e, ex in enumerate(self.experts):
            for n in ("w1", "w3", "w2"):
                lin = getattr(ex, n)
                lin.weight = nn.Parameter(torch.empty_like(lin.weight, device="meta"), requires_grad=False)
                lin.kept = (self.kept, n, e)
        self._stacks = None
        return self.kept

    def materialize_experts(self, device) -> None:
        """Give meta-built routed experts real (uninitialised) weights on `device` in their dtype: for layers
        whose checkpoint experts are not kept quantized."""
        for ex in self.experts:
            for n in ("w1", "w3", "w2"):
                lin = getattr(ex, n)
                if lin.weight.is_meta:
                    lin.weight = nn.Parameter(torch.empty(lin.weight.shape, dtype=lin.weight.dtype, device=device),
                                              requires_grad=False)
                    lin.kept = None

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]. Loops over the experts that received tokens (a grouped GEMM is a kernel's job)."""
        weights, idx = self.gate(x, token_ids)
        out = torch.zeros_like(x)
        hit = torch.unique(idx)
        for e in hit.tolist():
            tok, slot = torch.where(idx == e)
            y = self.experts[e](x[tok]) * weights[tok, slot, None].to(x.dtype)
            out.index_add_(0, tok, y)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1 [E, F, H], w3 [E, F, H], w2 [E, H, F]) for the grouped kernel.

        Built once: the experts' own parameters are then re-pointed to views of the stacks, so no memory is
        duplicated and in-place weight updates (load_state_dict copies) stay visible. Rebuilt when a parameter
        was replaced (set_dtype, assign-loading): checked by storage pointers, O(1) per call."""
        first, last = self.experts[0], self.experts[-1]
        st = getattr(self, "_stacks", None)
        if st is not None:
            w1, w3, w2 = st
            if (first.w1.weight.data_ptr() == w1.data_ptr() and last.w1.weight.data_ptr() == w1[-1].data_ptr()
                    and first.w3.weight.data_ptr() == w3.data_ptr() and last.w2.weight.data_ptr() == w2[-1].data_ptr()
                    and first.w1.weight.dtype == w1.dtype):
                return st
        stacks = []
        for n in ("w1", "w3", "w2"):
            w = torch.stack([getattr(e, n).weight.data for e in self.experts])
            for k, e in enumerate(self.experts):
                getattr(e, n).weight.data = w[k]
            stacks.append(w)
        self._stacks = tuple(stacks)
        return self._stacks

    def forward_grouped(self, x: torch.Tensor, token_ids: torch.Tensor | None = None, parts: bool = False):
        """Same as forward, with the routed experts in one grouped kernel call (no per-expert Python loop, no
        host sync on CUDA): deepinfer_sg.kernels.moe_experts (Triton on CUDA, its torch twin on CPU). On CUDA the
        shared expert runs on a second stream beside the gate and the routed experts (engine/streams.py: the
        same kernels on the same inputs, so the same bits). parts: return (routed, shared or None) instead of
        their sum, for a consumer that adds them itself (mhc.hc_post's y2: no add launch, one rounding)."""
        from deepinfer_sg.kernels import moe_experts
        shared = self.shared_experts
        side = streams.fork(x) if shared is not None else None
        y_shared = None
        if side is not None:
            with streams.on(side):
                y_shared = shared.forward_fast(x)
        weights, idx = self.gate(x, token_ids)
        q = self.kept
        if q is not None:
            out = moe_experts(x, idx, weights, q.w1, q.w3, q.w2, swiglu_limit=self.experts[0].limit,
                              scales=(q.s1, q.s3, q.s2), shifts=q.shifts(), shift_rows=q.rows)
        else:
            w1, w3, w2 = self.stacked_weights()
            out = moe_experts(x, idx, weights, w1, w3, w2, swiglu_limit=self.experts[0].limit)
        if shared is None:
            return (out, None) if parts else out
        if y_shared is None:
            y_shared = shared.forward_fast(x)
        streams.join(side)
        return (out, y_shared) if parts else out + y_shared


@torch.no_grad()
def quantize_routed_experts(model: nn.Module, expert_dtype: str = "fp8") -> int:
    """Quantize every MoE layer's (dense) routed experts the way the real checkpoint stores them (FP4, 1x32 UE8M0
    groups, quant.quantize_fp4_blocks) and keep them as the loader would: "fp8" (e4m3 stacks) or "fp4" (packed).
    For benchmarks and tests on randomly initialised models (a real checkpoint goes through the loader).
    The experts' values change (FP4 rounding). Returns the number of layers converted."""
    from .quant import expert_fp4_packed, expert_to_fp8, quantize_fp4_blocks
    if expert_dtype not in ("fp8", "fp4"):
        raise ValueError(f"expert_dtype must be 'fp8' or 'fp4', got {expert_dtype!r}")
    n = 0
    for moe in [m for m in model.modules() if isinstance(m, MoE) and m.kept is None]:
        ws = [[getattr(ex, w).weight.detach() for w in ("w1", "w3", "w2")] for ex in moe.experts]
        q = moe.keep_quantized(1, moe.gate.weight.device, packed=expert_dtype == "fp4")
        for e, per in enumerate(ws):
            for which, w in zip(("w1", "w3", "w2"), per):
                packed, scale = quantize_fp4_blocks(w)
                parts = expert_fp4_packed(packed, scale) if expert_dtype == "fp4" else \
                    expert_to_fp8(packed, scale, "fp4", 1)
                q.store(which, e, *parts)
        q.finalize()
        n += 1
    return n
