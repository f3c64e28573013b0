"""DSpark draft layers `mtp.{i}` (v41-flash-architecture.md §4, dspark-and-constraints.md §1-§2).

A draft round for one sequence whose cache holds positions 0..p and whose next ("golden") token g was just
sampled by the target (g sits at p+1, not yet processed):

1. backbone (heavy, once): the block [g, NOISE x (n-1)] at positions p+1..p+n goes through the draft layers
   (shifted mHC blocks, sliding-window attention, MoE). Every draft query attends the same key set: the W
   "main keys" of positions p-W+1..p (made from the target's features, see below) plus all n draft keys
   (non-causal inside the block) plus the sink. Collapse with the last pre-mix gives h_pre [n, H];
   base_logits = head(mtp.{last}.norm(h_pre)) with the target's own head.
2. Markov loop (light, sequential): prev_0 = g; for i in 0..n-1
       e_i      = markov_head.embed[prev_i]                      # [r]
       logits_i = base_logits_i + e_i @ markov_head.head^T      # first-order correction
       conf_i   = sigmoid(clamp([h_pre_i ; e_i] . w / T_i, -60, 60))
       d_i, p_i = sample(logits_i, i)                           # the caller's sampler (temperature, top-k/p,
       prev_{i+1} = d_i                                         #   grammar mask of the state after d_<i, ...)
   so step i's distribution depends only on g and d_<i; the backbone never sees sampled drafts.

Main keys: after every target forward, the features the target captured for the processed tokens (mean of the
residual streams at the input of each `dspark_target_layer_ids` layer, concatenated) become
`main_hidden = main_norm(main_proj(features))` and, per draft layer i, `mk_i = rope(kv_norm_i(wkv_i(main_hidden)))`
at the tokens' positions (FP8 QDQ when the model simulates runtime quantization). They live in
`SequenceCache.drafter` (a `DrafterState`, W + max_rollback rows per draft layer; `cache.rollback(n)` rolls it
back too). Call `update_draft_keys(model, chunks, out.draft_features)` after each `model.forward_step`.

API (model = engine.model.Model with `mtp` built by `build_mtp`):
    update_draft_keys(model, chunks, draft_features)            # after forward_step, same chunks
    result = draft(model, caches, golden [B], sample, n=None)   # -> DraftResult(tokens [B, n], probs [B, n, V],
                                                                #    confidences [B, n], backbone)
    backbone = draft_backbone(model, caches, golden, n)         # just stage 1 (h_pre, base_logits)
    result = markov_draft(model, backbone, golden, sample)      # just stage 2 (re-run after substituting tokens)
`sample(logits_i [B, V] fp32, step_i) -> (tokens [B] long, probs [B, V] or None)`: probs is the processed
distribution the token was drawn from; it is stored as the proposal p for verification, so return exactly that
(a one-hot row for a forced/greedy token; None if the caller keeps the proposals itself, e.g.
grammar_drafting.MaskedDraftSampler). A token of -1 (the request's block ended) is returned as is and fed to
the next step as id 0; those later outputs are meaningless and the caller ignores them. Cost of a round: one n-token pass through the draft layers per sequence plus
n steps of [B, r] x [r, V] for the Markov head.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from .config import LayerSpec, ModelConfig
from .mhc import hc_post, hc_pre
from .model import Block, first_stream
from .norm import RMSNorm
from .rope import rope_cos_sin

# sliding-window-only role of every draft layer (ratio 0, no compressed KV, base RoPE)
DRAFT_LAYER_SPEC = LayerSpec(ratio=0, kv_source=None, index_source=None, index_k_source=None,
                             candidate_source=None, rope="main")
# confidences are logits clamped to this range before the sigmoid (DeepInfer's kernel)
CONF_LOGIT_CLAMP = 60.0

Sampler = Callable[[torch.Tensor, int], "tuple[torch.Tensor, torch.Tensor]"]


# ----------------------------------------------------------------------------------------------
# Parameters
# ----------------------------------------------------------------------------------------------


class MarkovHead(nn.Module):
    """Rank-r first-order transition bias: bias(prev, .) = head.weight @ embed.weight[prev]."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, rank)          # markov_head.embed.weight [V, r]
        self.head = nn.Linear(rank, vocab_size, bias=False)  # markov_head.head.weight  [V, r]


class ConfidenceHead(nn.Module):
    def __init__(self, in_features: int):
        super().__init__()
        self.proj = nn.Linear(in_features, 1, bias=False)    # confidence_head.proj.weight [1, H + r]


class DraftLayer(Block):
    """One `mtp.{i}` block: a sliding-window-only decoder block (B1's `Block`) plus the extras of the first
    layer (`main_proj`, `main_norm`) and the last (`norm`, `markov_head`, `confidence_head`)."""

    def __init__(self, config: ModelConfig, index: int, count: int):
        d = config.dspark
        super().__init__(config, None, spec=DRAFT_LAYER_SPEC, n_experts=d.get("n_routed_experts"),
                         top_k=d.get("num_experts_per_tok"))
        self.index, self.is_first, self.is_last = index, index == 0, index == count - 1
        H, eps = config.hidden_size, config.rms_norm_eps
        if self.is_first:
            n_targets = len(config.dspark_target_layer_ids)
            self.main_proj = nn.Linear(n_targets * H, H, bias=False)
            self.main_norm = RMSNorm(H, eps)
        if self.is_last:
            rank = int(d.get("markov_rank", 0) or 0)
            self.norm = RMSNorm(H, eps)
            if rank:
                self.markov_head = MarkovHead(config.vocab_size, rank)
            self.confidence_head = ConfidenceHead(H + rank)


def build_mtp(config: ModelConfig, model: nn.Module | None = None) -> nn.ModuleList:
    """The `num_nextn_predict_layers` draft layers, to be stored as `model.mtp` (names `mtp.{i}.*`).

    The embedding and LM head are the backbone's (`embed.weight`, `head.weight`), so none are created here."""
    count = config.num_nextn_predict_layers
    if count <= 0:
        raise ValueError("build_mtp: the config has num_nextn_predict_layers = 0")
    if not config.hc_shifted:
        raise ValueError("DSpark draft layers need the shifted mHC schedule (hc_shifted, V4.1)")
    if not config.dspark_target_layer_ids:
        raise ValueError("DSpark draft layers need dspark_target_layer_ids in the config")
    if "noise_token_id" not in config.dspark:
        raise ValueError("DSpark draft layers need dspark_noise_token_id in the config")
    return nn.ModuleList(DraftLayer(config, i, count) for i in range(count))


# ----------------------------------------------------------------------------------------------
# Per-sequence state: the main keys
# ----------------------------------------------------------------------------------------------


@dataclass
class DrafterState:
    """Main keys of the last positions of one sequence, per draft layer: keys[i][k] is position start + k."""

    keys: list[torch.Tensor]
    start: int
    capacity: int  # rows kept: sliding_window + max_rollback (a rollback must still leave W keys)

    @property
    def end(self) -> int:
        return self.start + (self.keys[0].shape[0] if self.keys else 0)

    def write(self, new_keys: list[torch.Tensor], start: int) -> None:
        """Store keys for positions start..; later rows are overwritten, a gap restarts the ring."""
        if start < self.start or start > self.end:
            self.keys, self.start = [k[:0] for k in new_keys], start
        cut = start - self.start
        self.keys = [torch.cat([old[:cut], new]) for old, new in zip(self.keys, new_keys)]
        drop = max(0, self.keys[0].shape[0] - self.capacity)
        if drop:
            self.keys = [k[drop:] for k in self.keys]
            self.start += drop

    def rollback(self, n: int) -> None:
        """Forget the last n positions (called by SequenceCache.rollback)."""
        keep = max(0, self.end - n - self.start)
        self.keys = [k[:keep] for k in self.keys]

    def window(self, layer: int, end: int, width: int) -> torch.Tensor:
        """Keys of positions max(0, end - width) .. end - 1 for draft layer `layer`."""
        if end > self.end:
            raise RuntimeError(f"DSpark drafter has main keys up to position {self.end - 1} but the cache is at "
                               f"length {end}: call dspark.update_draft_keys after every forward_step")
        lo = max(self.start, end - width)
        return self.keys[layer][lo - self.start: end - self.start]

    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() for k in self.keys)


def _mtp(model) -> nn.ModuleList:
    mtp = getattr(model, "mtp", None)
    if mtp is None:
        raise ValueError("this model has no DSpark draft layers (num_nextn_predict_layers = 0 or not a V4.1 config)")
    return mtp


def _qdq_window(model, x: torch.Tensor) -> torch.Tensor:
    """FP8 per-32 QDQ of window keys when the model simulates runtime quantization (as the target's SWA KV)."""
    if not getattr(model, "quant_sim", False):
        return x
    from .quant import qdq_fp8_ue8m0

    return qdq_fp8_ue8m0(x, 32).to(x.dtype)


def _rope(model, positions: torch.Tensor):
    return rope_cos_sin(model.inv_freq_main, positions)


def main_keys(model, features: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
    """features [T, n_targets*H] at positions [T] -> per draft layer the main keys [T, D]."""
    mtp = _mtp(model)
    first = mtp[0]
    x = features.to(first.main_proj.weight.dtype)
    main_hidden = first.main_norm(first.main_proj(x))
    cos, sin = _rope(model, positions)
    return [_qdq_window(model, layer.attn.project_kv(main_hidden, cos, sin)) for layer in mtp]


@torch.no_grad()
def update_draft_keys(model, chunks: Sequence, draft_features: torch.Tensor | None) -> None:
    """Turn a forward_step's `draft_features` into main keys in each chunk's cache (`cache.drafter`).

    chunks: the StepChunks just run (their caches have advanced); draft_features [sum(n), n_targets*H] in
    chunk order. Cost: one main_proj GEMM plus one kv projection per draft layer, per token."""
    if draft_features is None:
        raise ValueError("update_draft_keys: the forward step returned no draft features (no DSpark target layers)")
    total = sum(int(ch.token_ids.numel()) for ch in chunks)
    if draft_features.shape[0] != total:
        raise ValueError(f"update_draft_keys: {draft_features.shape[0]} feature rows for {total} chunk tokens")
    c = model.config
    capacity = c.sliding_window + model.max_rollback
    dev = draft_features.device
    positions, off = [], 0
    for ch in chunks:
        n = int(ch.token_ids.numel())
        positions.append(torch.arange(ch.cache.length - n, ch.cache.length, device=dev))
    keys = main_keys(model, draft_features, torch.cat(positions))
    for ch, pos in zip(chunks, positions):
        n = pos.numel()
        new = [k[off: off + n] for k in keys]
        off += n
        state = ch.cache.drafter
        if not isinstance(state, DrafterState):
            state = DrafterState([k[:0] for k in new], int(pos[0]), capacity)
            ch.cache.drafter = state
        state.write(new, int(pos[0]))


# ----------------------------------------------------------------------------------------------
# Drafting
# ----------------------------------------------------------------------------------------------


@dataclass
class DraftBackbone:
    """Stage-1 output for B sequences: hidden before the final norm and the head's logits per draft slot."""

    h_pre: torch.Tensor        # [B, n, H]
    base_logits: torch.Tensor  # fp32 [B, n, V]


@dataclass
class DraftResult:
    tokens: torch.Tensor       # long [B, n]: d_1..d_n for positions p+2..p+n+1
    probs: torch.Tensor        # [B, n, V]: the distributions the tokens were sampled from (proposal p)
    confidences: torch.Tensor  # fp32 [B, n]: predicted acceptance probability of each draft given the previous
    backbone: DraftBackbone


def _draft_attention(model, layer: DraftLayer, li: int, x: torch.Tensor, states: list[DrafterState],
                     ends: list[int], n: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B*n, H] (attn-norm output of the draft slots) -> [B*n, H]. Per sequence: queries = its n slots, keys =
    its W main keys (positions <= p) + its n draft keys, all visible (non-causal block), plus the sink."""
    attn = layer.attn
    q, _ = attn.project_q(x, cos, sin)
    kv = _qdq_window(model, attn.project_kv(x, cos, sin))
    W = model.config.sliding_window
    outs = []
    for b, (state, end) in enumerate(zip(states, ends)):
        keys = torch.cat([state.window(li, end, W).to(kv.dtype), kv[b * n:(b + 1) * n]])
        bias = torch.zeros(n, keys.shape[0], device=kv.device)
        outs.append(attn.attend(q[b * n:(b + 1) * n], keys, bias))
    return attn.output(torch.cat(outs), cos, sin)


@torch.no_grad()
def draft_backbone(model, caches: Sequence, golden: torch.Tensor, n: int | None = None) -> DraftBackbone:
    """Stage 1 for B sequences: the block [golden, NOISE x (n-1)] at positions cache.length.. through the draft
    layers; n defaults to the config's dspark_block_size."""
    mtp = _mtp(model)
    c = model.config
    n = int(n or c.dspark.get("block_size", 1))
    golden = golden.reshape(-1).long().to(model.device)
    B = golden.shape[0]
    if B != len(caches):
        raise ValueError(f"draft: {B} golden tokens for {len(caches)} caches")
    if n < 1:
        raise ValueError(f"draft: block size must be >= 1, got {n}")
    states = []
    for i, cache in enumerate(caches):
        if not isinstance(cache.drafter, DrafterState) or cache.length == 0:
            raise RuntimeError(f"draft: sequence {i} has no DSpark main keys (run a forward step and "
                               "update_draft_keys first)")
        states.append(cache.drafter)
    ends = [cache.length for cache in caches]
    noise = int(c.dspark["noise_token_id"])
    tokens = torch.full((B, n), noise, dtype=torch.long, device=golden.device)
    tokens[:, 0] = golden
    tokens = tokens.reshape(-1)
    positions = torch.cat([torch.arange(e, e + n, device=golden.device) for e in ends])
    cos, sin = _rope(model, positions)

    h = model.embed(tokens)
    R = h.unsqueeze(1).expand(-1, c.hc_mult, -1).contiguous()   # [B*n, M, H]
    a = first_stream(h.shape[0], c.hc_mult, h.device)           # the first sub-layer reads stream 0
    for li, layer in enumerate(mtp):
        pre, post, comb = layer.mixes(R, "attn")
        x = hc_pre(R, a)
        y = _draft_attention(model, layer, li, layer.attn_norm(x), states, ends, n, cos, sin)
        R = hc_post(R, y, post, comb)
        R, a = layer.ffn_sublayer(R, pre, tokens)
    h_pre = hc_pre(R, a)                                        # collapse with the last pre-mix
    last = mtp[-1]
    base = model.head(last.norm(h_pre)).float()
    return DraftBackbone(h_pre=h_pre.view(B, n, -1), base_logits=base.view(B, n, -1))


def _conf_temperatures(t, n: int) -> list[float]:
    if isinstance(t, (int, float)):
        return [max(float(t), 1e-5)] * n
    t = [float(v) for v in t]
    if len(t) != n:
        raise ValueError(f"confidence temperatures: need 1 or {n} values (one per draft position), got {len(t)}")
    return [max(v, 1e-5) for v in t]


@torch.no_grad()
def markov_draft(model, backbone: DraftBackbone, golden: torch.Tensor, sample: Sampler,
                 conf_temperature: float | Sequence[float] = 1.0, steps: int | None = None) -> DraftResult:
    """Stage 2: the sequential Markov loop over the backbone's slots (see the module docstring).

    steps: how many slots to sample (default all n). Each step's logits depend only on the golden token and
    the tokens `sample` returned for earlier steps."""
    last = _mtp(model)[-1]
    B, n, V = backbone.base_logits.shape
    steps = n if steps is None else int(steps)
    if not 0 <= steps <= n:
        raise ValueError(f"markov_draft: steps {steps} not in 0..{n}")
    temps = _conf_temperatures(conf_temperature, n)
    markov = getattr(last, "markov_head", None)
    w_conf = last.confidence_head.proj.weight.float().reshape(-1)          # [H + r]
    H = backbone.h_pre.shape[-1]
    prev = golden.reshape(-1).long().to(backbone.base_logits.device)
    tokens, probs, confs = [], [], []
    for i in range(steps):
        logits = backbone.base_logits[:, i]
        h_i = backbone.h_pre[:, i].float()
        z = h_i @ w_conf[:H]
        if markov is not None:
            e = markov.embed(prev)                                          # [B, r]
            # in the weight dtype: no fp32 copy of the [V, r] head per step
            logits = logits + torch.nn.functional.linear(e, markov.head.weight).float()
            z = z + e.float() @ w_conf[H:]
        confs.append(torch.sigmoid((z / temps[i]).clamp(-CONF_LOGIT_CLAMP, CONF_LOGIT_CLAMP)))
        tok, p = sample(logits, i)
        tok = torch.as_tensor(tok).reshape(-1).long().to(prev.device)
        if p is None:  # the caller keeps the proposals itself
            p = logits.new_zeros(B, V)
        if tok.shape[0] != B or tuple(p.shape) != (B, V):
            raise ValueError(f"sampler returned tokens {tuple(tok.shape)} / probs {tuple(p.shape)}; expected [{B}] / [{B}, {V}]")
        tokens.append(tok)
        probs.append(p)
        # a request whose block has ended may return -1: any id works as its (ignored) next previous token
        prev = tok.clamp_min(0)
    empty = backbone.base_logits.new_zeros(B, 0)
    return DraftResult(
        tokens=torch.stack(tokens, 1) if tokens else empty.long(),
        probs=torch.stack(probs, 1) if probs else backbone.base_logits.new_zeros(B, 0, V),
        confidences=torch.stack(confs, 1) if confs else empty,
        backbone=backbone,
    )


def draft(model, caches: Sequence, golden: torch.Tensor, sample: Sampler, n: int | None = None,
          conf_temperature: float | Sequence[float] = 1.0) -> DraftResult:
    """n draft tokens after each sequence's golden token: backbone once, then the sequential Markov loop."""
    backbone = draft_backbone(model, caches, golden, n)
    return markov_draft(model, backbone, golden, sample, conf_temperature)


# ----------------------------------------------------------------------------------------------
# Simple samplers (tests, greedy engines); the engine passes its own for temperature/top-k/top-p/masks
# ----------------------------------------------------------------------------------------------


def greedy_sampler(logits: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """argmax with a one-hot proposal distribution."""
    tok = logits.argmax(-1)
    return tok, torch.nn.functional.one_hot(tok, logits.shape[-1]).to(logits.dtype)


def temperature_sampler(temperature: float, generator: torch.Generator | None = None) -> Sampler:
    """softmax(logits / T) sampling; returns the softmax it sampled from."""
    def sample(logits: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        p = torch.softmax(logits.float() / temperature, dim=-1)
        return torch.multinomial(p, 1, generator=generator).squeeze(-1), p
    return sample
