"""Mixture of experts: sqrtsoftplus router (bias for selection only, or a frozen token->expert hash table),
clamped-SwiGLU routed experts and one shared expert. Parameter names follow DeepSeek's checkpoint
(`ffn.gate.weight`, `ffn.gate.bias` | `ffn.gate.tid2eid`, `ffn.experts.{e}.w1/w2/w3.weight`,
`ffn.shared_experts.w1/w2/w3.weight`). Cost per token: K+1 expert SwiGLUs plus an E x H router matvec."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def swiglu_clamped(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, L)) * clamp(up, -L, L): the gate is clamped above only, up on both sides."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class Expert(nn.Module):
    def __init__(self, hidden: int, inter: int, limit: float):
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=False)   # gate
        self.w3 = nn.Linear(hidden, inter, bias=False)   # up
        self.w2 = nn.Linear(inter, hidden, bias=False)   # down
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu_clamped(self.w1(x), self.w3(x), self.limit))


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

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None):
        """-> (weights [T, K] fp32 incl. routed_scaling_factor, expert ids [T, K])."""
        scores = F.softplus(F.linear(x, self.weight).float()).sqrt()
        if self.hashed:
            if token_ids is None:
                raise ValueError("hash-routed MoE layer needs the token ids")
            idx = self.tid2eid[token_ids.reshape(-1)].long()
        else:
            idx = torch.topk(scores + self.bias.float(), self.top_k, dim=-1, sorted=False).indices
        w = scores.gather(1, idx)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * self.scaling, idx


class MoE(nn.Module):
    def __init__(self, hidden: int, inter: int, n_experts: int, top_k: int, n_shared: int, limit: float,
                 vocab_size: int, hashed: bool, scaling: float):
        super().__init__()
        self.gate = Gate(hidden, n_experts, top_k, vocab_size, hashed, scaling)
        self.experts = nn.ModuleList(Expert(hidden, inter, limit) for _ in range(n_experts))
        self.shared_experts = Expert(hidden, inter, limit) if n_shared else None

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

    def forward_grouped(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Same as forward, with the routed experts in one grouped kernel call (no per-expert Python loop, no
        host sync on CUDA): deepinfer_sg.kernels.moe_experts (Triton on CUDA, its torch twin on CPU)."""
        from deepinfer_sg.kernels import moe_experts
        weights, idx = self.gate(x, token_ids)
        w1, w3, w2 = self.stacked_weights()
        out = moe_experts(x, idx, weights, w1, w3, w2, swiglu_limit=self.experts[0].limit)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
