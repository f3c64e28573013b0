"""The DeepSeek-V4 / V4.1 network: embeddings, mHC blocks (attention + MoE), final collapse, norm and head.

One code path serves both entry points:
  * `forward_step(chunks)`: each chunk = (SequenceCache, new token ids, how many logit rows to return). Dense parts
    (projections, MoE, mHC) run batched over all chunks' tokens. Caches advance in place. Two paths, same results
    to round-off:
      - reference (prefill, any chunk longer than batched.MAX_FAST_ROWS, YOCO compaction, `fast_decode=False`):
        attention, compressors and indexers per sequence with a dense mask, MoE as a loop over experts;
      - batched (decode / verify steps, engine/batched.py): attention of all rows in one
        `kernels.sparse_attention` call over gathered window + selected compressed keys, batched compressors
        and index scores, `kernels.hc_mixes` for the mHC mixes, `kernels.moe_experts` for the routed experts
        (Triton on CUDA, the torch twins on CPU); caches at fixed addresses (engine/arena.py); a V4.1 step is one
        CUDA graph per token count, its compressors' cache updates included (engine/compress_step.py) and its
        Engram rows hashed from the token windows and read from the pinned tables by the device
        (`engram_device_reads`); tables the device cannot read (memory-mapped) are looked up on the host, the graph
        cut before their layers so the lookups overlap the device (batched.engram_splits; V4's overlapping
        compressors update eagerly between segments); fed by one upload of the step's index lists, the Engram
        windows included
        (engine/step_graphs.py; `cuda_graphs`, on by default, bit-identical to eager).
  * `forward_logits(ids [B, S])`: fresh caches, one chunk per row (the full-sequence reference).

V4 vs V4.1 is decided by config switches (see config.py): `hc_shifted`, `q_norm`, `compressor_style`, the
kv/index/index-K source maps and candidate blocks. Engram (engine/engram.py) and the DSpark draft layers
(engine/dspark.py) plug in where the spec puts them. Runtime switches on the model: `quant_sim` (QDQ simulation
of DeepInfer's FP8/FP4 activations and caches, off by default) and `set_yoco(mode, keep)` (spec §3.3 prefill
truncation of the decoder layers: "off" (default), "mask", "compact").

Cost of a step: dense work O(T * active params); attention over <= W + index_topk keys per query (the reference
path builds a dense [n, window + entries] bias per sequence, queries in blocks of 256). Host syncs per step: none
when the token ids come from the host (their range check and the recent-token bookkeeping for Engram n-grams then
stay there); with device ids, the range check and the Engram windows' copy to the host, at the start of the step
(with host ids the fast path makes the windows after the first segment is launched).

state_dict keys are DeepSeek's tensor names without the `model.` prefix.
"""
from __future__ import annotations

import functools
import importlib
import itertools
import operator
import re
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from deepinfer_sg import kernels

from . import batched, compress_step, projections
from .arena import undo as undo_log
from .attention import Attention
from .cache import LayerCache, SequenceCache, set_each
from .config import LayerSpec, ModelConfig
from .indexer import candidate_block_mask, topk_mask
from .mhc import drop_mixes, hc_head_collapse, hc_mixes, hc_post, hc_pre
from .moe import MoE
from .norm import RMSNorm
from .rope import apply_rope, inv_freq, rope_cos_sin
from .step_graphs import SegmentGraphs, wait_done
from .token_ring import ring_for
from .transfer import made_once, ragged_arange, to_device, to_device_many

# parameters kept in fp32 whatever the model dtype (DeepSeek ships them in F32)
_FP32_SUFFIXES = ("hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale",
                  "hc_head_fn", "hc_head_base", "hc_head_scale", "attn_sink", "gate.bias", "ape")


def _quant():
    """B2's runtime-quantization simulation functions (imported lazily: only needed when the switch is on)."""
    return importlib.import_module("deepinfer_sg.engine.quant")


# compress_step inputs that are arenas (fixed addresses, written in place by the graph), not per-step indices
_FIXED_COMPRESS = ("ring_kv", "ring_g", "ent", "lat", "ik")
EMPTY_CHAIN = (None,) * 8      # the layer chain a step's first segment starts from (Model._layers_fast)

# linears whose weights are FP8 / FP4 in the real checkpoint: their inputs are quantized to FP8 per 32 at run time
_ACT_QUANT_LINEARS = re.compile(r"(attn\.(wq_a|wq_b|wkv|wo_b)|attn\.indexer\.wq_b|ffn\.shared_experts\.w[123]"
                                r"|ffn\.experts\.\d+\.w[123]|main_proj)$")


def _act_qdq(x: torch.Tensor) -> torch.Tensor:
    return _quant().qdq_fp8_ue8m0(x, 32).to(x.dtype)


@dataclass
class StepChunk:
    cache: SequenceCache
    token_ids: torch.Tensor          # LongTensor [n]
    logit_rows: int = 1              # return logits for the last `logit_rows` tokens of this chunk


@dataclass
class StepOutput:
    logits: torch.Tensor                          # fp32 [sum(logit_rows), V]
    draft_features: torch.Tensor | None = None    # [T, n_targets * H]: mean of streams at the target layers
    hidden: torch.Tensor | None = None            # [T, H] collapsed final hidden (before the final norm)


@dataclass
class StepRows:
    """One chunk of a step as `Model.plan_step` sees it: the cache, how many tokens the step runs for it, and how
    many logit rows (the last ones) it returns."""
    cache: SequenceCache
    n: int
    logit_rows: int = 1


@dataclass
class _Segment:
    """One graph segment of a batched step, prepared on the host (Model._segment)."""
    cores: list          # the layers whose attention core runs in it
    args: list           # its inputs after the token ids: positions, window slab, new window rows, then per layer
    late: list           # (index in args, layer) of the Engram rows the host looks up at launch (None until then)
    key: tuple           # its graph key; with its inputs' shapes unless `late` (then completed at launch)
    fn: object           # batched.span with the segment's layers
    shapes: list         # its inputs' shapes (those of `late`: None until launch)


@dataclass
class StepPlan:
    """A step planned by `Model.plan_step`, run by `Model.launch` (or dropped by `Model.cancel`), once."""
    rows: list                     # StepRows, in chunk order
    ctx: "StepContext"             # what the step knows (the batched path's BatchPlan in ctx.plan)
    total: int                     # tokens of the step
    fast: bool                     # the batched path (else the reference path, all of it at launch)
    saved: list | None = None      # the compressor states' undo log (arena.undo; cancel puts them back)
    segments: list = field(default_factory=list)   # graph segments prepared at plan time (V4: the first one)
    every_row: bool = False        # every chunk returns a logit row for each of its tokens (decode, verify)
    splits: list = field(default_factory=list)     # layers before which its graph is cut (batched.engram_splits at
    # plan time: a flip of model.engram_device_reads before the launch does not change this step's segments)
    state: str = "planned"         # planned | launched | cancelled


@dataclass
class _Seq:
    cache: SequenceCache
    start: int                  # position of the first row processed for this sequence
    n: int                      # rows processed
    off: int                    # offset of those rows in the flat token batch
    rect_lo: int | None = None  # YOCO: decoder-layer windows start no earlier than this position
    fresh_window: bool = False  # YOCO compact: older window keys are never visible, start the ring anew


@dataclass
class StepContext:
    """What one forward step knows: the chunks, flat positions/ids, per-layer top-k and candidate masks."""
    seqs: list[_Seq]
    positions: torch.Tensor | None             # [T] (fast path with host ids: set once uploaded, _layers_fast)
    token_ids: torch.Tensor | None             # [T] (likewise)
    rope: dict = field(default_factory=dict)   # kind -> (cos, sin) at `positions`
    topk: dict = field(default_factory=dict)   # index-source layer -> list of bool [n, G] per seq
    cand: dict = field(default_factory=dict)   # candidate-source layer -> list of bool [n, G] per seq
    captures: dict = field(default_factory=dict)  # layer -> [T, H] mean of streams (DSpark target features)
    windows: torch.Tensor | None = None        # engram token windows [T, N] (computed on first use)
    rows: torch.Tensor | None = None           # after YOCO compaction: kept rows' indices in the full batch
    plan: "batched.BatchPlan | None" = None    # set when the step takes the batched decode/verify path
    engram_rows: dict = field(default_factory=dict)   # fast path: engram layer -> looked-up rows [T, ...]
    graphs: SegmentGraphs | None = None        # fast path: runs the dense segments (eager / CUDA graphs)
    graph_ids: object = None                   # fast path: the token ids as the graph reads them (or a Deferred)
    compress: dict = field(default_factory=dict)   # fast path: layer -> compress_step inputs (updates in the graph)
    host_ids: torch.Tensor | None = None       # the token ids on the host, when they were given there
    window_prep: tuple | None = None           # fast path, Engram: `_windows_prep` made at plan time
    ids_host: tuple | None = None              # graph steps: SegmentGraphs.ids_buffers (the ids' own buffers)
    ids_copy: bool = False                     # the first segment still has to copy the ids in, or record their
                                               # buffer's event (launch sets it)
    engram_ids: dict = field(default_factory=dict)    # fast path: engram layer -> its row ids' upload slot, to fill
    ready: object = None                       # graph steps: the first graph's replay prepared by plan_step
    ready_out: tuple | None = None             # its outputs, once launch replayed it (until _run_segment took them)

    @functools.cached_property
    def caches(self) -> list:
        """The sequences' caches, in order (made once per step)."""
        return [s.cache for s in self.seqs]


# what plan_step reads of each StepRows and cache
_CACHE, _ROWS, _LOGIT_ROWS, _LENGTH = map(operator.attrgetter, ("cache", "n", "logit_rows", "length"))


def _counts(ctx: "StepContext") -> tuple:
    """The step's sequences' rows, offsets and start positions (batched.SeqArrays: the batched plan's `arrays` when
    there is one)."""
    if ctx.plan is not None:
        return ctx.plan.arrays
    seqs = ctx.seqs
    return batched.SeqArrays(*(np.fromiter([getattr(s, k) for s in seqs], np.int64, len(seqs))
                               for k in batched.SeqArrays._fields))


def _on_host(t: torch.Tensor) -> bool:
    """Whether t is in host memory (the step's token ids: then checked and copied without a sync; the Engram
    windows' tail: then it goes up with the step's upload)."""
    return t.device.type == "cpu"


def first_stream(T: int, M: int, device) -> torch.Tensor:
    """Read-out weights [T, M] fp32 that take stream 0."""
    a = torch.zeros(T, M, device=device)
    a[:, 0] = 1.0
    return a


class Block(nn.Module):
    """One layer: [engram] -> mHC(attention) -> mHC(MoE). Parameter names are DeepSeek's (`attn_norm.weight`,
    `hc_attn_fn`, `attn.*`, `ffn.*`, ...). `layer_id=None` builds a sliding-window-only block (DSpark drafter)."""

    def __init__(self, config: ModelConfig, layer_id: int | None, spec: LayerSpec | None = None,
                 n_experts: int | None = None, top_k: int | None = None, hashed: bool = False):
        super().__init__()
        c = config
        self.config, self.layer_id = c, layer_id
        self.spec = spec if spec is not None else c.layers[layer_id]
        M, H = c.hc_mult, c.hidden_size
        mix = (2 + M) * M
        for name in ("attn", "ffn"):
            self.register_parameter(f"hc_{name}_fn", nn.Parameter(torch.randn(mix, M * H) * 0.02))
            self.register_parameter(f"hc_{name}_base", nn.Parameter(torch.zeros(mix)))
            self.register_parameter(f"hc_{name}_scale", nn.Parameter(torch.ones(3)))
        self.attn_norm = RMSNorm(H, c.rms_norm_eps)
        self.ffn_norm = RMSNorm(H, c.rms_norm_eps)
        self.attn = Attention(c, self.spec, layer_id)
        self.ffn = MoE(H, c.moe_intermediate_size, n_experts or c.n_routed_experts, top_k or c.num_experts_per_tok,
                       c.n_shared_experts, c.swiglu_limit, c.vocab_size, hashed, c.routed_scaling_factor)
        if layer_id is not None and layer_id in c.engram_layer_ids:
            try:
                from .engram import Engram
            except ImportError as e:
                raise NotImplementedError(
                    f"layer {layer_id} has an Engram block but engine/engram.py is not available ({e})") from None
            self.engram = Engram(c, layer_id)

    def mixes(self, R: torch.Tensor, which: str, fast: bool = False):
        """(pre, post, comb) of sub-layer `which`; fast=True: the fused kernel (Triton on CUDA, twin on CPU)."""
        c = self.config
        if fast:
            m = kernels.hc_mixes(R, getattr(self, f"hc_{which}_fn"), getattr(self, f"hc_{which}_base"),
                                 getattr(self, f"hc_{which}_scale"), norm_eps=c.rms_norm_eps, hc_eps=c.hc_eps,
                                 iters=c.hc_sinkhorn_iters, post_mult=c.hc_post_mult)
            return m.pre, m.post, m.comb
        return hc_mixes(R, getattr(self, f"hc_{which}_fn"), getattr(self, f"hc_{which}_base"),
                        getattr(self, f"hc_{which}_scale"), eps=c.rms_norm_eps, hc_eps=c.hc_eps,
                        iters=c.hc_sinkhorn_iters, post_mult=c.hc_post_mult)

    def ffn_sublayer(self, R: torch.Tensor, a: torch.Tensor | None, token_ids: torch.Tensor | None,
                     fast: bool = False, fast_moe: bool = False):
        """mHC-wrapped MoE. a = previous sub-layer's pre-mix (shifted schedule) or None -> (R', this pre-mix).
        fast / fast_moe: the fused mix kernel / the grouped routed-expert kernel (same results to round-off)."""
        pre, post, comb = self.mixes(R, "ffn", fast)
        x = hc_pre(R, a if self.config.hc_shifted else pre)
        xn = self.ffn_norm(x)
        y = self.ffn.forward_grouped(xn, token_ids) if fast_moe else self.ffn(xn, token_ids)
        return hc_post(R, y, post, comb), pre


class Model(nn.Module):
    """DeepSeek-V4 / V4.1 causal LM. Build with the target dtype/device: `Model(config, dtype=torch.bfloat16)`
    keeps the F32 tensors of the checkpoint (mHC, sinks, routing bias, ape) in fp32. `device="meta"` builds
    shapes only (for loaders that fill `state_dict()` afterwards via `load_state_dict(..., assign=True)`)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 max_rollback: int = 16):
        super().__init__()
        self.config = config
        self.max_rollback = max_rollback
        self._quant_hooks: list = []
        self.yoco_mode = "off"   # prefill truncation of the decoder layers: "off" | "mask" | "compact" (set_yoco)
        self.yoco_keep = 0
        # decode / verify steps (every chunk <= batched.MAX_FAST_ROWS rows) take the batched path with the
        # kernels; False forces the per-sequence reference path everywhere (same results to round-off)
        self.fast_decode = True
        # on CUDA the fast path's dense segments run as CUDA graphs, one set per token count (step_graphs.py);
        # False: always eager (same results bit for bit)
        self.cuda_graphs = True
        # fused mHC read-out / write-back kernels on the fast path: on (R1 of session 5, mid-size V4.1, bf16, batch
        # 8: 11.01 ms per step vs 13.83 unfused; logits vs the reference path 2.0e-1 vs 2.1e-1 unfused: bf16 MoE
        # route flips either way)
        self._fused_mhc = True
        # fast path: Engram layers whose table can be read by the device (an in-memory FP8 table, pinned on CUDA)
        # get the token windows in the step's upload and hash them and read their rows inside the graph
        # (batched.engram_on_device), so the step is one graph with no host Engram work; False: the host hashes and
        # looks the rows up (the path for memory-mapped tables), the graph cut before each Engram layer. Session 10
        # R2 (mid-size V4.1, fp8 experts, H200, plan-ahead, median of 13 steps): 4.33 / 5.62 / 8.45 ms per step at
        # batch 8 / 64 / 256 against 4.36 / 5.94 / 9.89 off in the same run (the base code: 4.33-4.36 / 5.89-5.99 /
        # 10.65-13.43); the graphs alone 4.08 / 5.16 / 7.75 against 4.09 / 5.15 / 7.48 ms
        self.engram_device_reads = True
        self._stack_projections = True
        self._fused_rope = True
        self._stacked_at = -1       # SegmentGraphs.generation when projections.fuse last checked the weights
        self._graphs = SegmentGraphs()
        # graph steps send their upload at the end of plan_step (queued behind the step the device runs) and the
        # launch only writes the token ids into a host buffer that the first graph copies in itself (a copy node):
        # no host->device call between the ids and the graph launch. False: the one upload, ids in it, at launch.
        # Session 14 (mid-size V4.1, H200, one process a round): the launch until the graph runs 0.19 / 0.36 ms at
        # batch 64 / 256 against 0.22 / 0.45, step 4.30 / 6.58 against 4.34 / 6.64 (R2); 0.27 / 0.40 against 0.44 /
        # 0.48, step 4.08 / 6.50 against 4.31 / 6.55 (R3; benchmarks/model_forward.py)
        self.send_ahead = True
        self._open_plan = None      # a plan_step(undo=True) not yet launched or cancelled (one at a time)
        c = config
        with torch.device(device):
            self.embed = nn.Embedding(c.vocab_size, c.hidden_size)
            self.layers = nn.ModuleList(
                Block(c, i, hashed=c.mlp_layer_types[i] == "hash_moe") for i in range(c.num_layers))
            self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
            if not c.hc_shifted:
                M = c.hc_mult
                self.hc_head_fn = nn.Parameter(torch.randn(M, M * c.hidden_size) * 0.02)
                self.hc_head_base = nn.Parameter(torch.zeros(M))
                self.hc_head_scale = nn.Parameter(torch.ones(1))
            if c.num_nextn_predict_layers and c.variant == "v41":
                try:
                    from .dspark import build_mtp
                except ImportError:
                    build_mtp = None   # drafter not available yet: the backbone still works
                if build_mtp is not None:
                    self.mtp = build_mtp(c, self)
        # RoPE frequencies: plain attributes computed on the CPU (not buffers), so meta-device construction
        # followed by `to_empty()` cannot leave them uninitialized; copied per device on first use.
        self._inv_freq = {name: inv_freq(c, name) for name in ("main", "compress")}
        self._inv_freq_on: dict = {}
        self.set_dtype(dtype)

    # ------------------------------------------------------------------ runtime-quantization simulation
    @property
    def quant_sim(self) -> bool:
        """Simulate DeepInfer's runtime quantization (spec §2.9, §5.4): FP8 (UE8M0, per 32) window KV and
        activations entering every FP8/FP4-weight linear, FP4 (E4M3 scale, per 16) compressed KV, FP4 (UE8M0,
        per 32) index queries and keys. Off by default; the QDQ functions are B2's engine/quant.py."""
        return bool(self._quant_hooks)

    @quant_sim.setter
    def quant_sim(self, on: bool) -> None:
        self.reset_graphs()
        for h in self._quant_hooks:
            h.remove()
        self._quant_hooks = []
        for mod in self.modules():
            if isinstance(mod, Attention):
                mod.act_qdq = _act_qdq if on else None
        if not on:
            return
        for name, mod in self.named_modules():
            if isinstance(mod, nn.Linear) and _ACT_QUANT_LINEARS.search(name):
                self._quant_hooks.append(mod.register_forward_pre_hook(lambda m, args: (_act_qdq(args[0]),)))

    def set_yoco(self, mode: str, keep: int = 0) -> "Model":
        """YOCO prefill truncation (spec §3.3). In `mask` and `compact` mode the decoder layers (from the first
        ratio-1 layer on) see window keys no older than `L - keep`, L = sequence length after the chunk;
        `compact` also skips computing decoder rows older than that. keep >= sliding_window + max_rollback."""
        if mode not in ("off", "mask", "compact"):
            raise ValueError(f"YOCO mode {mode!r} is not 'off', 'mask' or 'compact'")
        if mode != "off":
            if self.config.n_prefill_layer is None:
                raise ValueError("YOCO truncation needs a config with ratio-1 (decoder) layers")
            if keep < self.config.sliding_window + self.max_rollback:
                raise ValueError(f"YOCO keep {keep} < sliding_window {self.config.sliding_window} + max_rollback "
                                 f"{self.max_rollback}")
        self.yoco_mode, self.yoco_keep = mode, keep
        return self

    @property
    def fused_mhc(self) -> bool:
        """Fast path: the fused mHC read-out / write-back kernels (kernels/hc_mix.py; same math up to fp32
        summation order, so not bit-equal to the unfused path, which `fused_mhc = False` selects). On by default:
        one launch instead of ~9 per write-back, 20% faster decode steps (R1, session 5)."""
        return self._fused_mhc

    @fused_mhc.setter
    def fused_mhc(self, on: bool) -> None:
        self._switch_fast_path("_fused_mhc", on)

    @property
    def stack_projections(self) -> bool:
        """Fast path: the projections of each layer's attention-norm output as one GEMM over their stacked weights
        (engine/projections.py: the parameters become row blocks of one tensor; same values up to GEMM summation
        order). False: one GEMM each. On by default."""
        return self._stack_projections

    @stack_projections.setter
    def stack_projections(self, on: bool) -> None:
        self._switch_fast_path("_stack_projections", on)

    @property
    def fused_rope(self) -> bool:
        """Fast path: RoPE inside its neighbours' launches: the window kv's norm + rotation + slab write as one
        kernels.rmsnorm launch (Attention.store_kv), the in-graph compressors' entry and index key norm + rotation
        + arena write as one kernels.rmsnorm launch each and their ring write + pooling as two kernels.ring_pool
        launches (compress_step.compress_rows). Same math; the
        products sum in another order than the GEMM library's (bf16 round-off). False: the separate launches. On by
        default."""
        return self._fused_rope

    @fused_rope.setter
    def fused_rope(self, on: bool) -> None:
        self._switch_fast_path("_fused_rope", on)

    def _switch_fast_path(self, attr: str, on: bool) -> None:
        """Set a fast-path switch; a change drops the captured graphs (their segments ran the other kernels)."""
        if bool(on) != getattr(self, attr):
            self.reset_graphs()
        setattr(self, attr, bool(on))

    def reset_graphs(self) -> None:
        """Forget the captured CUDA graphs (they read the weights where they were at capture time): needed after
        replacing parameters by other tensors or an Engram layer's table (graphs read its pinned rows by address);
        moving or casting the model (`to`, `set_dtype`) does it itself. Arena growth calls it too: the segments'
        remembered inputs (`_segment_keys`) go with the graphs, so the replaced buffers they hold are freed."""
        self.__dict__.pop("_segment_keys", None)
        if hasattr(self, "_graphs"):
            self._graphs.reset()

    def _apply(self, fn, *args, **kwargs):
        self.reset_graphs()
        return super()._apply(fn, *args, **kwargs)

    def set_dtype(self, dtype: torch.dtype) -> "Model":
        """Cast floating parameters to `dtype`, keeping the checkpoint's F32 tensors in fp32."""
        self.reset_graphs()
        for name, p in self.named_parameters():
            want = torch.float32 if name.endswith(_FP32_SUFFIXES) else dtype
            if p.dtype != want:
                p.data = p.data.to(want)
        self.dtype = dtype
        return self

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def _freqs(self, kind: str) -> torch.Tensor:
        dev = self.device
        key = (kind, dev)
        if key not in self._inv_freq_on:
            self._inv_freq_on[key] = self._inv_freq[kind].to(dev)
        return self._inv_freq_on[key]

    def _turn_kinds(self) -> tuple:
        """The rotations a batched step makes (rope.step_turns): ((rope kind, ratio) per row: ("main", 1),
        ("compress", 1), then each compressor's (kind, ratio) for its group starts), freqs [C, R/2] fp32, ratios
        [C, 1] int64 on the device), made once per device (plan_step: before any graph capture)."""
        dev = self.device
        key = ("turns", dev)
        if key not in self._inv_freq_on:
            kinds = [("main", 1), ("compress", 1)]
            for blk in self.layers:
                comp = getattr(blk.attn, "compressor", None)
                if comp is not None and (blk.attn.spec.rope, comp.ratio) not in kinds:
                    kinds.append((blk.attn.spec.rope, comp.ratio))
            self._inv_freq_on[key] = (kinds, torch.stack([self._freqs(k) for k, _ in kinds]),
                                      torch.tensor([[r] for _, r in kinds], dtype=torch.int64).to(dev))
        return self._inv_freq_on[key]

    @property
    def inv_freq_main(self) -> torch.Tensor:
        """fp32 [rope_dim/2] RoPE frequencies of sliding-window layers (and the DSpark drafter), on the device."""
        return self._freqs("main")

    @property
    def inv_freq_compress(self) -> torch.Tensor:
        """fp32 [rope_dim/2] RoPE frequencies (YaRN) of compressed layers, on the model's device."""
        return self._freqs("compress")

    # ------------------------------------------------------------------ caches
    def new_cache(self) -> SequenceCache:
        layers = []
        for i, spec in enumerate(self.config.layers):
            lc = LayerCache(ratio=spec.ratio)
            attn = self.layers[i].attn
            if hasattr(attn, "compressor"):
                lc.comp = attn.compressor.new_state()
            if hasattr(attn, "indexer") and hasattr(attn.indexer, "compressor"):
                lc.icomp = attn.indexer.compressor.new_state()
            layers.append(lc)
        return SequenceCache(layers=layers, max_rollback=self.max_rollback,
                             keep_tokens=self.max_rollback + 16)

    # ------------------------------------------------------------------ entry points
    @torch.no_grad()
    def forward_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, S] -> fp32 logits [B, S, V], every row its own sequence from position 0."""
        B, S = input_ids.shape
        out = self.forward_step([StepChunk(self.new_cache(), input_ids[b], S) for b in range(B)])
        return out.logits.view(B, S, -1)

    @torch.no_grad()
    def forward_step(self, chunks: list[StepChunk]) -> StepOutput:
        """Run each chunk's tokens right after its cache's current length; advance the caches.

        Returns fp32 logits for the last `logit_rows` rows of each chunk (in chunk order) and, when the config
        names DSpark target layers, their captured features for every processed token.
        Same as `launch(plan_step(rows), ids)` (the two halves callers can overlap with the device's work)."""
        rows, flat = self.step_ids(chunks)
        return self.launch(self.plan_step(rows, undo=False), flat)

    def step_ids(self, chunks: list[StepChunk]) -> tuple[list["StepRows"], torch.Tensor | None]:
        """The chunks as plan_step's StepRows, and their token ids as one flat int64 tensor (on the host when they
        all are, else on the model's device) for `launch`."""
        ids = []
        for ch in chunks:
            t = ch.token_ids
            ids.append(t.long().reshape(-1) if t.dtype != torch.long or t.dim() != 1 else t)
        rows = [StepRows(ch.cache, t.shape[0], ch.logit_rows) for ch, t in zip(chunks, ids)]
        on_host = all(t.device.type == "cpu" for t in ids)
        dev = self.device
        flat = (torch.cat(ids) if ids and (on_host or all(t.device == dev for t in ids))
                else torch.cat([t.to(dev) for t in ids]) if ids else None)
        return rows, flat

    @torch.no_grad()
    def plan_step(self, rows: list["StepRows"], undo: bool = True) -> "StepPlan":
        """The host half of a step that depends on counts, not on token values: for each StepRows(cache, n,
        logit_rows) the step will run n tokens right after the cache's length. On the batched path this places
        the windows (slab slots), plans the compressors' rows (arena room, destination rows, the states' counts
        after the step) and makes every index list of its graph segments (V4: of the first; host arrays for the
        step's one upload). Call it while the device still runs the previous step (after that step's `launch`
        returned); then `launch(plan, ids)` once the ids are known, or `cancel(plan)` (undo=True keeps what cancel
        restores). One plan at a time: planning again (forward_step included) cancels a plan still open. Cost: the
        host work of the step minus the Engram lookups and the launch itself; no device sync (device work it
        queues, rows moving into the slab / arenas, runs after the previous step), except a wait for a pinned upload
        buffer's copy of two steps before, which has long run (step_graphs._Pinned; a re-plan after a cancel waits
        for its own step's). Graph steps (model.send_ahead) send the step's upload here, queued behind the step the
        device runs (stream order keeps that step's reads of the same buffers first); their token ids go in at
        launch through a host buffer the first graph copies from itself (SegmentGraphs.ids_buffers; ids on the
        device by a device copy into that graph's buffer)."""
        c = self.config
        dev = self.device
        if self._open_plan is not None:
            # a plan made ahead and still open (another engine or caller sharing this model planned it) is
            # superseded: cancelling restores its caches, and its owner sees plan.state == "cancelled" and plans again
            self.cancel(self._open_plan)
        if not rows:
            raise ValueError("forward_step needs at least one StepChunk")
        B = len(rows)
        caches = list(map(_CACHE, rows))
        if len(set(map(id, caches))) != B:
            raise ValueError("the same SequenceCache appears in two chunks of one step")
        # (numpy over the rows' numbers: no Python per row but the _Seq each sequence gets)
        n, shown = (np.fromiter(map(get, rows), np.int64, B) for get in (_ROWS, _LOGIT_ROWS))
        compact = self.yoco_mode == "compact" and c.n_prefill_layer is not None
        for bad, msg in ((n <= 0, lambda k: f"StepChunk {k} with no tokens"),
                         ((shown < 0) | (shown > n), lambda k: f"logit_rows {shown[k]} not in 0..{n[k]}"),
                         (shown > self.yoco_keep if compact else None,
                          lambda k: f"logit_rows {shown[k]} > {self.yoco_keep} rows kept by YOCO compaction")):
            if bad is not None and bad.any():
                raise ValueError(msg(int(np.flatnonzero(bad)[0])))
        start = np.fromiter(map(_LENGTH, caches), np.int64, B)
        off = np.cumsum(n) - n
        rect = (start + n - self.yoco_keep).tolist() if self.yoco_mode != "off" else None
        seqs = list(map(_Seq, caches, start.tolist(), n.tolist(), off.tolist(), rect or itertools.repeat(None, B)))
        ctx = StepContext(seqs, None, None)
        ctx.caches = caches        # (its cached property, known here)
        plan = StepPlan(rows, ctx, int(n.sum()), batched.usable(self, n), every_row=bool((shown == n).all()))
        if not plan.fast:
            return plan
        self._open_plan = plan if undo else None
        try:
            ctx.plan = batched.make_plan(n, off, start, rect, dev)
            ctx.graphs = self._graphs
            if self.stack_projections and not self.quant_sim and self._stacked_at != self._graphs.generation:
                # (checked again only after reset_graphs: every weight move / cast / replacement calls it)
                if projections.fuse(self):
                    self.reset_graphs()      # (the graphs read the weights where they were)
                self._stacked_at = self._graphs.generation
            if self.cuda_graphs and not self.quant_sim:
                self._graphs.begin_step(plan.total, dev)
            # positions go up with the step's index lists (one upload: batched.BatchPlan.layout). Graph steps with
            # send_ahead send it at the end of this plan and the first graph copies the ids in itself at launch
            # (SegmentGraphs.ids_buffers); otherwise the ids' slot of that upload is filled at launch and the upload
            # sent then. (Measured and deleted, session 12 R2 on the H200, mid-size V4.1: the upload sent here,
            # behind the previous step on the stream, and the ids in an upload of their own at launch: that upload
            # alone cost the launch's host 0.05-0.13 ms, as much as the whole one, and the host time before the
            # graph run was 0.19 / 0.32 / 0.41 ms at batch 8 / 64 / 256 against 0.15 / 0.20 / 0.42; send_ahead
            # has no such upload: the ids' copy is a node of the first graph)
            ctx.plan.positions = ctx.plan.defer(ctx.plan.row_positions)
            ctx.ids_host = self._graphs.ids_buffers(plan.total, dev) if self.send_ahead else None
            ctx.graph_ids = (ctx.plan.defer(np.zeros(plan.total, dtype=np.int64)) if ctx.ids_host is None
                             else ctx.ids_host[1])
            self._turn_kinds()     # (the frequencies on the device before any graph capture)
            if undo:     # (compress_step.plan_layer logs the values it changes as it reads them)
                plan.saved = []
            self._plan_fast(ctx, plan)
            if ctx.ids_host is not None and not ctx.engram_ids:
                # (the upload now, behind the step the device runs: stream order keeps that step's reads of the
                # same buffer first; row ids hashed at launch, ctx.engram_ids, keep it for the launch)
                ctx.plan.send()
                ctx.ready = self._prepare_first(ctx, plan)
        except BaseException:
            if plan.saved:
                undo_log(plan.saved)
            self._open_plan = None
            self._graphs.abort_step()
            raise
        return plan

    def _prepare_first(self, ctx: StepContext, plan: "StepPlan"):
        """The step's first graph, its replay prepared now (SegmentGraphs.prepare: a replay step whose inputs are all
        the captured objects, the steady decode step), so that launch replays it right after writing the token ids
        into their host buffer, before the rest of its host work; None otherwise. Session 16 (mid-size V4.1, batch
        64, H200, a slow phase of the host; benchmarks/model_forward.py): the graph launched 405 us after launch's
        call, 155 of them after `_run_segment` was entered (R1: resolving and passing the ~450 inputs, the key, the
        inputs' identity check); prepared, launch until the graph run 0.28-0.29 ms against 0.39 and the step 4.34 /
        4.39 against 4.56 ms in the same process (R2); at batch 8 0.13 against 0.19 ms, step 3.22 / 3.24 against
        3.33 (R3)."""
        seg = plan.segments[0] if plan.segments else None
        if seg is None or seg.late:
            return None
        host, dev, _ = ctx.ids_host
        # (the inputs `_run_segment` passes: the first segment's empty layer chain, the ids, its args)
        return ctx.graphs.prepare(seg.key, [*EMPTY_CHAIN, ctx.graph_ids, *seg.args], pre=(dev, host))

    def cancel(self, plan: "StepPlan") -> None:
        """Forget a planned step that will not be launched: the caches are as before `plan_step` (the rows it moved
        into the slab / arenas stay there, which changes no value)."""
        if plan.state != "planned":
            raise RuntimeError(f"cancel: this plan was already {plan.state}")
        if plan.fast and plan.saved is None:
            raise RuntimeError("cancel: plan_step(undo=False) kept no state to restore")
        plan.state = "cancelled"
        if plan.fast:
            undo_log(plan.saved)
            self._graphs.abort_step()
        if self._open_plan is plan:
            self._open_plan = None

    @torch.no_grad()
    def launch(self, plan: "StepPlan", token_ids: torch.Tensor) -> StepOutput:
        """The token-dependent half of a step planned by `plan_step`: token_ids [T] (int64, the chunks' ids in
        order; on the host as the engine gives them: then no sync; on the device: one, their range check) -> the
        step's StepOutput (forward_step's contract). Enqueues the device work and returns without waiting for it."""
        c = self.config
        dev = self.device
        if plan.state != "planned":
            raise RuntimeError(f"launch: this plan was already {plan.state}")
        if self._open_plan is not None and self._open_plan is not plan:
            raise RuntimeError("launch: another step was planned after this one")
        plan.state = "launched"
        self._open_plan = None
        ctx = full_ctx = plan.ctx
        try:
            if token_ids is None or token_ids.dim() != 1 or token_ids.shape[0] != plan.total:
                raise ValueError(f"launch: token ids of shape {None if token_ids is None else tuple(token_ids.shape)}"
                                 f" for a step of {plan.total} tokens")
            all_ids = token_ids.long()
            on_host = _on_host(all_ids)
            # ids given on the host are checked there (no sync); device ids cost one sync
            if not on_host and all_ids.device != dev:
                all_ids = all_ids.to(dev)
            if (bool((all_ids.numpy().view(np.uint64) >= c.vocab_size).any()) if on_host     # (< 0 wraps around)
                    else bool((all_ids < 0).any() | (all_ids >= c.vocab_size).any())):
                bad = next(k for k, s in enumerate(ctx.seqs) if bool(
                    ((all_ids[s.off:s.off + s.n] < 0) | (all_ids[s.off:s.off + s.n] >= c.vocab_size)).any()))
                raise ValueError(f"token id outside 0..{c.vocab_size - 1} in chunk {bad}")
            ctx.host_ids = all_ids if on_host else None
            if plan.fast and ctx.ids_host is not None:
                if on_host:      # into their host buffer (the first graph copies them)
                    host, _, done = ctx.ids_host
                    wait_done(done)
                    host.numpy()[:] = all_ids.numpy()
                    ctx.host_ids, ctx.ids_copy = host, True
                else:            # into the graphs' ids buffer, in stream order (through the host would sync)
                    ctx.token_ids = ctx.ids_host[1].copy_(all_ids)
            elif plan.fast:
                if on_host:      # into the upload's ids slot
                    ctx.plan.fill(ctx.graph_ids, all_ids.numpy())
                else:
                    ctx.token_ids = all_ids
                    ctx.graph_ids = self._graphs.stage("ids", all_ids)
            else:
                pos = torch.from_numpy(ragged_arange([s.start for s in ctx.seqs], [s.n for s in ctx.seqs]))
                if on_host:
                    ctx.token_ids, ctx.positions = to_device_many([all_ids, pos], dev)
                else:
                    ctx.token_ids, ctx.positions = all_ids, to_device(pos, dev)
                for kind in ("main", "compress"):
                    ctx.rope[kind] = rope_cos_sin(self._freqs(kind), ctx.positions)
            if c.engram_layer_ids:
                if ctx.plan is None:
                    ctx.windows = self._token_windows(ctx)
                else:     # (on the host, for the layers whose rows the device does not hash itself (those already
                    # in ctx.engram_rows). From host ids: made when the first Engram rows are read, `_engram_rows`,
                    # after the first segment is launched when it has no Engram layer, so the device starts sooner;
                    # from device ids the copy syncs, so it is made here, before any segment is queued)
                    if ctx.host_ids is None and len(ctx.engram_rows) < len(batched.engram_layers(self)):
                        ctx.windows = self._token_windows(ctx).cpu()
        except BaseException:
            if plan.fast:
                if plan.saved is not None:
                    undo_log(plan.saved)
                self._graphs.abort_step()
            raise
        chunks = plan.rows
        every_row = plan.every_row
        logits = None
        try:
            if ctx.ready is not None and ctx.ids_copy:
                # (the first graph, prepared by plan_step: launched now that its ids are in their host buffer; the
                # host work before it ran at plan time, the rest of the launch's runs while the device computes)
                ctx.ready_out = self._graphs.replay_ready(ctx.ready)
                if ctx.ready_out is not None:
                    self._ids_copied(ctx)
            if ctx.plan is not None:
                hfin, logits = self._layers_fast(ctx, every_row, plan.segments, bool(plan.splits))
            else:
                R, a = self.embed_streams(ctx.token_ids)
                for i, block in enumerate(self.layers):
                    if self.yoco_mode == "compact" and i == c.n_prefill_layer:
                        R, a, ctx = self._compact_layer(block, R, a, ctx)
                    else:
                        R, a = self._layer(block, R, a, ctx)
                hfin = self.collapse_streams(R, a)
        except BaseException:
            self._graphs.abort_step()
            drop_mixes()       # (mixes a failed segment deferred: batched.span joins them only when it returns)
            raise
        self._graphs.end_step()
        if ctx.plan is not None:
            batched.commit_windows(self, ctx, ctx.plan)
        if logits is None and every_row:
            logits = self.head(self.norm(hfin)).float()
        elif logits is None:
            rows = to_device(torch.cat([torch.arange(s.off + s.n - ch.logit_rows, s.off + s.n)
                                        for s, ch in zip(ctx.seqs, chunks)]), dev)
            logits = self.head(self.norm(hfin[rows])).float()
        self._advance(full_ctx)
        feats = None
        if ctx.captures:   # (after compaction: kept rows only, spec §3.3)
            feats = torch.cat([ctx.captures[i] if ctx.rows is None or ctx.captures[i].shape[0] == ctx.rows.shape[0]
                               else ctx.captures[i][ctx.rows] for i in c.dspark_target_layer_ids], dim=-1)
        return StepOutput(logits=logits, draft_features=feats, hidden=hfin)

    def embed_streams(self, ids: torch.Tensor, reuse: bool = False):
        """Token ids [T] -> (R [T, M, H] every stream the embedding, a: the first sub-layer's read-out weights
        (shifted mHC: stream 0) or None). reuse: take `a` from a constant kept per token count (no launches; the
        fast path, whose token counts are few and small: prefill lengths would each keep one for good)."""
        c = self.config
        h = self.embed(ids)
        R = h.unsqueeze(1).expand(-1, c.hc_mult, -1).contiguous()         # [T, M, H]
        a = None
        if c.hc_shifted and reuse:   # the first sub-layer reads stream 0
            a = made_once(("stream 0", h.shape[0], c.hc_mult), h.device,
                          lambda: first_stream(h.shape[0], c.hc_mult, h.device))
        elif c.hc_shifted:
            a = first_stream(h.shape[0], c.hc_mult, h.device)
        return R, a

    def collapse_streams(self, R: torch.Tensor, a) -> torch.Tensor:
        """The streams after the last layer -> the final hidden [T, H] (before the final norm)."""
        c = self.config
        if c.hc_shifted:
            return hc_pre(R, a)
        return hc_head_collapse(R, self.hc_head_fn, self.hc_head_base, self.hc_head_scale,
                                eps=c.rms_norm_eps, hc_eps=c.hc_eps)

    # ------------------------------------------------------------------ one layer
    def _layer_input(self, block: Block, R: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Engram (before anything else in the layer), then the DSpark target-feature capture: the mean of the
        streams at the layer's attention input (spec §2.2, §4)."""
        if hasattr(block, "engram"):
            R = block.engram(R, ctx.windows)
        if block.layer_id in self.config.dspark_target_layer_ids:
            ctx.captures[block.layer_id] = R.float().mean(dim=1).to(R.dtype)
        return R

    def _layer(self, block: Block, R: torch.Tensor, a, ctx: StepContext):
        """One layer on the reference path."""
        c = self.config
        R = self._layer_input(block, R, ctx)
        pre, post, comb = block.mixes(R, "attn")
        x = hc_pre(R, a if c.hc_shifted else pre)
        y = self._attention(block.attn, block.attn_norm(x), ctx)
        R = hc_post(R, y, post, comb)
        R, a = block.ffn_sublayer(R, pre, ctx.token_ids)
        return R, a

    def _plan_fast(self, ctx: StepContext, plan: StepPlan) -> None:
        """plan_step's batched-path part (host; depends on counts only): the windows' slab slots, the compressors'
        rows inside the graph (compress_step.plan_layer: the states' counts after the step, the pools every later
        layer reads), then the graph segments whose inputs are known now (V4.1: all of them; V4: the first): their
        index inputs (batched.span_inputs) laid out in the step's one upload and resolved to their device views
        (`_segment`; the copy itself is sent at launch)."""
        bp = ctx.plan
        layers = self.layers
        # (checked here, before any state changes, not at launch: the launch's host work until the graph runs is
        # time the device waits)
        missing = [i for i in batched.engram_layers(self) if layers[i].engram.table is None]
        if missing:
            raise RuntimeError(f"engram layers {missing}: no table loaded (set `.table`, see EngramTable)")
        batched.prepare_windows(self, ctx, bp, self.embed.weight.new_empty((0, self.config.head_dim)))
        on_device = batched.engram_on_device(self) if self.config.engram_layer_ids else []
        if self.config.engram_layer_ids:     # (the Engram windows' index, from lengths: the launch only gathers)
            ctx.window_prep = idx, tail = self._windows_prep(ctx, plan.saved)
            src = None
            if on_device and _on_host(tail):     # [2, T, N]: an index into this step's ids, else (-1) the earlier token
                now = idx < idx.shape[0]
                early = np.where(now, -1, tail.numpy()[np.where(now, 0, idx - idx.shape[0])])
                if early.max() >= self.config.vocab_size:
                    # (the device hash reads the token -> class map at these ids unchecked; the step's own ids are
                    # checked at launch, the caches' recent ids here: they may have been set outside forward_step)
                    raise ValueError(f"a cache's recent token ids hold {int(early.max())}, outside 0.."
                                     f"{self.config.vocab_size - 1}")
                src = bp.defer(np.stack([np.where(now, idx, -1), early]))
            for i in on_device:
                eng = self.layers[i].engram
                if src is not None:      # the windows go up with the upload, the device hashes them (mix)
                    eng.hash_consts(bp.device)
                    ctx.engram_rows[i] = src
                else:     # (the caches' recent tokens on the device: row ids hashed on the host at launch, a sync)
                    ctx.engram_ids[i] = bp.defer(np.zeros((plan.total, eng.spec.rows_per_token), dtype=np.int64))
        ctx.compress = {i: compress_step.plan_layer(self, layers[i].attn, ctx, bp, plan.saved)
                        for i in compress_step.graph_layers(self)}
        every_row = plan.every_row
        splits = plan.splits = batched.engram_splits(self, on_device)
        if splits:
            cuts = list(zip([0] + splits, splits + [len(layers)]))
            # (every layer's inputs first, so that the first segment's layout puts them all in one upload)
            raws = [[batched.span_inputs(self, layers[j].attn, ctx, bp) for j in range(a, b)] for a, b in cuts]
            plan.segments = [self._segment(ctx, None if a == 0 else batched.BOUNDARY,
                                           None if b == len(layers) else batched.BOUNDARY, every_row, raw,
                                           full=list(range(a, b)))
                             for (a, b), raw in zip(cuts, raws)]
            return
        nxt = (batched.eager_layers(self) + [None])[0]
        plan.segments = [self._segment(ctx, None, nxt, every_row,
                                       [batched.span_inputs(self, layers[j].attn, ctx, bp)
                                        for j in range(len(layers) if nxt is None else nxt)])]

    def _layers_fast(self, ctx: StepContext, every_row: bool, ready: list, split: bool):
        """Every layer on the batched path -> (final hidden [T, H], fp32 logits [T, V] when `every_row`, else None).

        Only the cache updates whose sizes the host decides (compressors, index keys: batched.update_compressed on
        the layers batched.eager_layers names) run eagerly; everything between two of them is one segment
        (batched.span): the rest of the previous such layer (its index selection and attention), every layer in
        between whole, the projections of the next one. The caches sit at fixed addresses (engine/arena.py), and
        the index tensors a segment reads are made before it from host-side lengths (at plan time by `_plan_fast`:
        `ready`; `split`: the plan cut the step before Engram layers, every segment is in `ready`). Segments run
        through ctx.graphs: CUDA graphs on CUDA once the token count is warm, else eager.
        The first segment starts at the embedding, the last one ends with the head; outputs that outlive the step
        are copied out of the graph's buffers. Engram rows the device does not read itself (batched.engram_on_device)
        are read from the host tables right before their segment is launched, so with V4.1's cuts at those Engram
        layers (batched.engram_splits) the device runs the segments before while the host reads them."""
        g = ctx.graphs
        plan = ctx.plan
        layers = self.layers
        chain = list(EMPTY_CHAIN)   # R, pre, post, comb, q, kv, iq, w of the layer updated last (or a Handoff)
        if split:      # V4.1: every segment prepared, cut between layers
            for k, seg in enumerate(ready):
                head = self._run_and_record(ctx, seg, chain)
                if k + 1 < len(ready):     # (a batched.Handoff in the chain's first slots)
                    chain = [*batched.Handoff(*head)] + [None] * (8 - len(batched.Handoff._fields))
            hfin, logits = head
        else:
            prev = None
            for nxt in batched.eager_layers(self) + [None]:
                if prev is None and ready:
                    seg = ready[0]
                else:
                    cores = ([] if prev is None else [prev]) + list(
                        range(0 if prev is None else prev + 1, len(layers) if nxt is None else nxt))
                    seg = self._segment(ctx, prev, nxt, every_row,
                                        [batched.span_inputs(self, layers[j].attn, ctx, plan) for j in cores])
                head = self._run_and_record(ctx, seg, chain)
                if nxt is None:
                    hfin, logits = head
                    break
                R, pre, post, comb, xn, q, kv, iq, w, feat = head
                if feat is not None:
                    ctx.captures[nxt] = feat
                batched.update_compressed(self, layers[nxt].attn, xn, ctx, plan)
                chain = [R, pre, post, comb, q, kv, iq, w]
                prev = nxt
        if g.mode != "eager":    # graph buffers: the next replay overwrites them
            hfin = hfin.clone()
        if logits is not None:   # fp32 from the head's dtype, out of the graph's buffer: one pass over the logits
            logits = logits.to(torch.float32, copy=g.mode != "eager")
        return hfin, logits

    def _run_and_record(self, ctx: StepContext, seg: "_Segment", chain: list) -> tuple:
        """Read the segment's Engram rows, run it, record what its layers report (DSpark features, selections,
        candidate blocks) -> its head outputs."""
        if seg.late or ctx.engram_ids:     # (nothing to look up: V4.1's step with the device reading its rows)
            self._engram_rows(ctx, [j for _, j in seg.late])
        outs = self._run_segment(ctx, seg, chain)
        head, tail = outs[:len(outs) - 3 * len(seg.cores)], outs[len(outs) - 3 * len(seg.cores):]
        select = batched.select_layers(self)
        for j, (feat, ids, cand) in zip(seg.cores, zip(tail[0::3], tail[1::3], tail[2::3])):
            if feat is not None:
                ctx.captures[j] = feat
            if j in select:
                ctx.plan.topk[j] = ids
            if cand is not None:
                ctx.plan.cand[j] = cand
        return head

    def _engram_rows(self, ctx: StepContext, layer_ids: list) -> None:
        """The Engram table rows of these layers (those not read yet this step) for the fast path: hashed and read
        on the host (ctx.windows, there), written straight into a pinned buffer of their upload and sent. Layers
        whose rows the device reads (ctx.engram_ids, batched.engram_on_device) only get their row ids, hashed on
        the host into their slots of the step's upload (all of them at the first call, before it is sent)."""
        g, dev = ctx.graphs, self.device
        if ctx.engram_ids:    # (every layer read on the device at once: before the step's upload is first sent)
            if ctx.windows is None:
                ctx.windows = self._token_windows(ctx).cpu()
            for i, slot in ctx.engram_ids.items():
                eng = self.layers[i].engram
                rows = eng._rows_np(ctx.windows)
                eng.table._check_ids(rows.reshape(-1))
                ctx.plan.fill(slot, rows)
                ctx.engram_rows[i] = slot
            ctx.engram_ids = {}
        has = batched.engram_layers(self)
        for i in layer_ids:
            if i not in has or i in ctx.engram_rows:
                continue
            blk = self.layers[i]
            if ctx.windows is None:     # (the step's token windows, on the host: once, before the first lookup)
                ctx.windows = self._token_windows(ctx).cpu()
            shape = blk.engram.packed_shape(ctx.windows.shape[0])
            out = None if shape is None else g.host_buffer(f"engram{i}", shape, torch.uint8, dev)
            e = blk.engram.packed_values(ctx.windows, "cpu", out=out)
            ctx.engram_rows[i] = g.fixed(g.upload(f"engram{i}", e, dev))

    def _segment(self, ctx: StepContext, prev, nxt, every_row: bool, raw: list,
                 full: list | None = None) -> "_Segment":
        """A graph segment's inputs (host side; no device work): its layers' span_inputs `raw` resolved to views of
        the step's upload, laid out now (BatchPlan.layout) and sent by `_run_segment`, in the order `_run_segment`
        hands them to the graph (made here, at plan time, so that the launch only sends and runs: ~540 inputs at
        the mid-size model; with the upload laid out straight into its pinned buffer, BatchPlan.layout, session 11
        R4, mid-size V4.1 on the H200, the base run first in the same round: launch's host time before the graph
        run 0.37-0.38 -> 0.25-0.26 ms at batch 64 and the step 5.50-5.52 -> 5.37-5.40 ms (R1, base second:
        5.53-5.56 -> 5.31-5.36); at 256 and 8 within the runs' noise, 8.41-8.46 -> 8.39-8.52 and 4.31-4.37 ->
        4.22-4.33 ms); the Engram rows the host looks up at launch (batched.engram_splits) are left as slots
        that `_run_segment` fills. prev / nxt as batched.span's prev_e / next_e; full: its whole layers (default:
        those between prev and nxt)."""
        g, plan = ctx.graphs, ctx.plan
        if full is None:
            full = list(range(0 if prev is None else prev + 1, len(self.layers) if nxt is None else nxt))
        cores = ([] if prev is None or prev == batched.BOUNDARY else [prev]) + full
        plan.layout(g, plan.device)     # every index list of the segment: one host->device copy (at its send)
        staged = ctx.__dict__.setdefault("_staged", {})

        def stage(t):   # a view of the step's upload is read in place; another per-step tensor is staged once
            if t is None or isinstance(t, batched.Deferred):
                return plan.resolve(t)
            if id(t) not in staged:
                staged[id(t)] = g.stage(f"in{len(staged)}_{tuple(t.shape)}_{t.dtype}", t)
            return staged[id(t)]

        def fixed(t):
            return None if t is None else g.fixed(t)
        per, meta, engram = [], [], []
        for j, (got, m) in zip(cores, raw):
            _, win_rows, kv_pool, kv_start, kv_count, ids, keys, kstart, kcount, cand = got[:10]
            if j != prev:
                engram.append((len(per), j))
            per += [None, stage(win_rows), fixed(kv_pool), stage(kv_start),
                    stage(kv_count), ids, fixed(keys), stage(kstart), stage(kcount), cand]
            per += [fixed(t) if name in _FIXED_COMPRESS else stage(t)
                    for name, t in zip(compress_step.INPUTS, got[10:])]
            meta.append(m)
        if nxt is not None and nxt != batched.BOUNDARY:
            engram.append((len(per), nxt))
            per.append(None)
        args = [plan.resolve(plan.positions), g.fixed(plan.win_all), plan.resolve(plan.win_new_rows), *per]
        late, has = [], batched.engram_layers(self)
        for at, j in engram:
            # (row ids hashed on the host at launch go into their slot of this upload, ctx.engram_ids: known now)
            got = ctx.engram_rows.get(j, ctx.engram_ids.get(j))
            if j in has and got is None:     # (rows the host looks up at launch)
                late.append((at + 3, j))
            else:
                args[at + 3] = plan.resolve(got)
        head = ("span", prev, full[0] if full else None, nxt, every_row if nxt is None else None, tuple(meta))
        # (under graphs a steady step's inputs are the same objects as the last step's, the upload's views
        # included: their shapes and the key are then those of last time, no shape read per input)
        known = self.__dict__.setdefault("_segment_keys", {})
        last = known.get((head, bool(late)))
        if last is not None and len(last[0]) == len(args) and all(map(operator.is_, last[0], args)):
            shapes, key = last[1], last[2]
        else:
            shapes = [None if t is None else tuple(t.shape) for t in args]
            key = head + (() if late else (tuple(shapes),))
            known[(head, bool(late))] = (args, shapes, key)
        fn = functools.partial(batched.span, self, prev, full, nxt, every_row, tuple(meta))
        return _Segment(cores, args, late, key, fn, shapes)

    def _run_segment(self, ctx: StepContext, seg: "_Segment", chain: list) -> tuple:
        """Send the step's laid-out upload, fill the segment's Engram rows the host looked up, run it (ctx.graphs);
        the step's first segment, when launch already replayed it as prepared (ctx.ready_out): its outputs."""
        g, plan = ctx.graphs, ctx.plan
        plan.send()
        if isinstance(plan.positions, batched.Deferred):     # positions (and host ids) came with the upload
            plan.positions = ctx.positions = plan.resolve(plan.positions)
        if isinstance(ctx.graph_ids, batched.Deferred):
            ctx.graph_ids = ctx.token_ids = plan.resolve(ctx.graph_ids)
        args, key = seg.args, seg.key
        if seg.late:
            args, shapes = list(args), list(seg.shapes)
            for at, j in seg.late:
                e = args[at] = plan.resolve(ctx.engram_rows.get(j))
                shapes[at] = None if e is None else tuple(e.shape)
            key = key + (tuple(shapes),)
        if ctx.ready_out is not None:
            out, ctx.ready_out = ctx.ready_out, None
            return out
        if not ctx.ids_copy:
            return g.run(key, seg.fn, *chain, ctx.graph_ids, *args)
        host, dev, _ = ctx.ids_host
        out = g.run(key, seg.fn, *chain, ctx.graph_ids, *args, pre=(dev, host))
        self._ids_copied(ctx)
        return out

    @staticmethod
    def _ids_copied(ctx: StepContext) -> None:
        """The first graph (its copy of the ids from their host buffer) is queued: the ids live on the device from
        now, and the buffer's event is recorded right behind the copy (the next launch waits for it before writing
        the buffer again: long passed by then)."""
        _, dev, done = ctx.ids_host
        ctx.ids_copy, ctx.token_ids = False, dev
        if done is not None:
            done.record()

    def _compact_layer(self, block: Block, R: torch.Tensor, a, ctx: StepContext):
        """The first decoder layer in YOCO `compact` mode: its compressed KV and index keys are built from every
        row, then rows older than each sequence's `rect_lo` are dropped for the rest of the network."""
        c = self.config
        R = self._layer_input(block, R, ctx)
        pre, post, comb = block.mixes(R, "attn")
        xn = block.attn_norm(hc_pre(R, a if c.hc_shifted else pre))
        self._update_compressed(block.attn, xn, ctx)
        keep_rows, seqs, off = [], [], 0
        for s in ctx.seqs:
            first = max(s.start, s.rect_lo)
            n = s.start + s.n - first
            keep_rows.append(torch.arange(s.off + first - s.start, s.off + s.n, device=R.device))
            seqs.append(_Seq(s.cache, first, n, off, s.rect_lo, fresh_window=first > s.start))
            off += n
        rows = torch.cat(keep_rows)
        kept = StepContext(seqs, ctx.positions[rows], ctx.token_ids[rows],
                           rope={k: (cs[rows], sn[rows]) for k, (cs, sn) in ctx.rope.items()},
                           captures=dict(ctx.captures), rows=rows)
        if ctx.windows is not None:
            kept.windows = ctx.windows[rows.to(ctx.windows.device)]
        R, xn, pre, post, comb = R[rows], xn[rows], pre[rows], post[rows], comb[rows]
        a = a[rows] if a is not None else None
        y = self._attention(block.attn, xn, kept, compressed_done=True)
        R = hc_post(R, y, post, comb)
        R, a = block.ffn_sublayer(R, pre, kept.token_ids)
        return R, a, kept

    def _token_windows(self, ctx: StepContext) -> torch.Tensor:
        """[T, N] raw token ids at t, t-1, ..., t-N+1 (-1 before the sequence start), N = engram max n-gram.

        One gather for the whole step: source = [this step's ids, the token ring (every sequence's recent ids), -1],
        and the [T, N] index into it is built on the host from lengths (no per-sequence device ops): by plan_step
        (ctx.window_prep, `_windows_prep`), so that the launch only gathers."""
        idx, tail = ctx.window_prep if ctx.window_prep is not None else self._windows_prep(ctx)
        ids = self._token_source(ctx, _on_host(tail))
        src = torch.cat([ids, tail.to(ids.device)])
        return src[to_device(torch.from_numpy(idx), ids.device)]

    def _windows_prep(self, ctx: StepContext, log: list | None = None) -> tuple:
        """(index [T, N] int64 NumPy into [this step's ids, tail], tail = the token ring's storage (the caches' recent
        ids, engine/token_ring.py: placed there first when it does not hold them, `log` an undo log that gets that;
        then a -1, where ids before a sequence's start or beyond its kept ones point): the token-independent part of
        `_token_windows`. (The launch reads the ring as this plan left it: nothing writes it in between, its growth
        makes a new storage.)"""
        N = int(self.config.engram.get("max_ngram_size", 3))
        ns, off, starts = _counts(ctx)
        T = int(ns.sum())
        ring, slots = ring_for(self, ctx.caches, log=log)
        R, pad = ring.ring, T + ring.flat.shape[0] - 1
        # per row r of sequence q (j = r - off_q) and k steps back (position starts_q + j - k): a new token of this
        # step (j >= k), a held one (m_q + j >= k: in the ring at slot_q * R + position % R), or before the
        # sequence start / beyond the kept ids (pad); numpy over [T, N]
        off, base, m, start = (np.repeat(a, ns)[:, None] for a in (off, slots * R, ring.count[slots], starts))
        j = np.arange(T, dtype=np.int64)[:, None] - off
        k = np.arange(N, dtype=np.int64)[None, :]
        idx = np.where(j >= k, off + j - k, np.where(m + j >= k, T + base + (start + j - k) % R, pad))
        return idx, ring.flat

    @staticmethod
    def _token_source(ctx: StepContext, on_host: bool) -> torch.Tensor:
        """The step's ids where the caches' recent ids live (`on_host`: their token ring is on the host): on the host
        when the ids came from there and the ring is there (then the Engram windows and the token bookkeeping cost
        no device work and no sync: the Engram tables are read on the host anyway), else on the device."""
        if ctx.host_ids is not None and (ctx.token_ids is None or on_host):
            return ctx.host_ids       # (no device ids yet: a device ring's ids come to the host)
        return ctx.token_ids

    def _advance(self, ctx: StepContext) -> None:
        """Advance the step's sequences: cache.tokens += this step's ids (the last keep_tokens kept) in the token
        ring (engine/token_ring.py: a steady step writes the new ids in place and the ring's per-slot arrays; on the
        host when the ids are, `_token_source`), cache.length += its rows (set for all caches by a C-level map,
        cache.set_each; the rollback floor follows the length by itself, SequenceCache.rollback)."""
        caches = ctx.caches
        n, off, start = _counts(ctx)
        ring, slots = ring_for(self, caches)
        ids = self._token_source(ctx, ring.flat.device.type == "cpu")
        if ids.device != ring.flat.device:       # (device ids, the ring on the host: the ids move to the device)
            ring, slots = ring_for(self, caches, ids.device)
        ring.advance(slots, ids, n, off, start, host=ids is ctx.host_ids)
        set_each(caches, "length", (start + n).tolist())

    def _qdq(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        if not self.quant_sim:
            return x
        q = _quant()
        if kind == "window":
            return q.qdq_fp8_ue8m0(x, 32).to(x.dtype)
        if kind == "compressed":
            if not self.config.fp4_sparse_kv:
                return q.qdq_fp8_ue8m0(x, 32).to(x.dtype)
            return q.qdq_fp4_e4m3(x, 16).to(x.dtype)
        return q.qdq_fp4_ue8m0(x, 32).to(x.dtype)    # index q / k

    def _update_compressed(self, attn: Attention, x: torch.Tensor, ctx: StepContext) -> None:
        """Feed this step's rows to the layer's compressors (kv source, V4 indexer) and V4.1 index keys."""
        c = self.config
        i = attn.layer_id
        spec = attn.spec
        ccos_fn = self._rotator(spec.rope)
        R = self.max_rollback
        # 1. compressed KV (kv sources) and V4 indexer keys
        if hasattr(attn, "compressor"):
            v41 = c.compressor_style == "v41"
            for s in ctx.seqs:
                st = s.cache.layers[i].comp
                attn.compressor.step(st, x[s.off:s.off + s.n], s.start,
                                     lambda lat, p: self._qdq(ccos_fn(lat, p), "compressed"), v41, R)
        idx_mod = getattr(attn, "indexer", None)
        if idx_mod is not None and hasattr(idx_mod, "compressor"):
            for s in ctx.seqs:
                idx_mod.compressor.step(s.cache.layers[i].icomp, x[s.off:s.off + s.n], s.start,
                                        lambda lat, p: self._qdq(ccos_fn(lat, p), "index"), False, R)
        # 2. V4.1 index keys from the kv source's latents
        if idx_mod is not None and hasattr(idx_mod, "wk"):
            for s in ctx.seqs:
                lc = s.cache.layers[i]
                src = s.cache.layers[c.layers[i].kv_source].comp
                have = 0 if lc.ikeys is None else lc.ikeys.shape[0]
                if src.n_entries > have:
                    lat = src.latents[have:]
                    p = torch.arange(have, src.n_entries, device=lat.device) * spec.ratio
                    ik = self._qdq(ccos_fn(idx_mod.k_norm(idx_mod.wk(lat)), p), "index")
                    lc.ikeys = ik if lc.ikeys is None else torch.cat([lc.ikeys, ik])

    def _attention(self, attn: Attention, x: torch.Tensor, ctx: StepContext,
                   compressed_done: bool = False) -> torch.Tensor:
        c = self.config
        i = attn.layer_id
        spec = attn.spec
        cos, sin = ctx.rope[spec.rope]
        q, qr = attn.project_q(x, cos, sin)
        kv = self._qdq(attn.project_kv(x, cos, sin), "window")
        R = self.max_rollback
        if not compressed_done:
            self._update_compressed(attn, x, ctx)
        idx_mod = getattr(attn, "indexer", None)
        # 3. top-k selection (index sources), candidate blocks
        if spec.index_source == i:
            iq, w = idx_mod.queries(qr, x)
            iq = self._qdq(apply_rope(iq, cos, sin), "index")
            masks, cands = [], []
            for s in ctx.seqs:
                if c.compressor_style == "v4":
                    ik = s.cache.layers[i].icomp.entries
                else:
                    ik = s.cache.layers[spec.index_k_source].ikeys
                G = 0 if ik is None else ik.shape[0]
                qpos = ctx.positions[s.off:s.off + s.n]
                visible = torch.arange(G, device=qpos.device)[None, :] < ((qpos + 1) // spec.ratio)[:, None]
                if G == 0:
                    masks.append(visible)
                    cands.append(visible)
                    continue
                allowed = visible
                if spec.candidate_source is not None:
                    allowed = visible & ctx.cand[spec.candidate_source][len(masks)]
                sel, cand = [], []
                for b in range(0, s.n, 256):   # query blocks bound the [n, Hi, G] score tensor
                    rows = slice(s.off + b, s.off + min(b + 256, s.n))
                    scores = idx_mod.scores(iq[rows], w[rows], ik)
                    sel.append(topk_mask(scores, allowed[b:b + 256], c.index_topk))
                    if i == c.candidate_source_layer_id:
                        cand.append(candidate_block_mask(scores, visible[b:b + 256], c.candidate_block_size,
                                                         c.candidate_topk_blocks))
                masks.append(torch.cat(sel))
                if cand:
                    cands.append(torch.cat(cand))
            ctx.topk[i] = masks
            if i == c.candidate_source_layer_id:
                ctx.cand[i] = cands
        # 4. attention per sequence
        W = c.sliding_window
        keep = W - 1 + R
        decoder = self.yoco_mode != "off" and i >= c.n_prefill_layer
        outs = []
        for si, s in enumerate(ctx.seqs):
            lc = s.cache.layers[i]
            new_kv = kv[s.off:s.off + s.n]
            past = lc.win if lc.win is not None and not s.fresh_window else new_kv[:0]
            keys = torch.cat([past, new_kv])
            kpos = torch.arange(s.start - past.shape[0], s.start + s.n, device=kv.device)
            qpos = ctx.positions[s.off:s.off + s.n]
            d = qpos[:, None] - kpos[None, :]
            bias = torch.zeros(s.n, keys.shape[0], device=kv.device)
            bias.masked_fill_((d < 0) | (d >= W), float("-inf"))
            if decoder:   # YOCO: decoder windows never reach before rect_lo (a row before it sees no window)
                bias.masked_fill_((kpos < s.rect_lo)[None, :], float("-inf"))
            if spec.ratio > 0:
                entries = s.cache.layers[spec.kv_source].comp.entries
                if entries is not None and entries.shape[0] > 0:
                    G = entries.shape[0]
                    if spec.index_source is None:
                        sel = torch.arange(G, device=kv.device)[None, :] < ((qpos + 1) // spec.ratio)[:, None]
                    else:
                        sel = ctx.topk[spec.index_source][si]
                    cbias = torch.zeros(s.n, G, device=kv.device).masked_fill_(~sel, float("-inf"))
                    keys = torch.cat([keys, entries.to(keys.dtype)])
                    bias = torch.cat([bias, cbias], dim=1)
            outs.append(attn.attend(q[s.off:s.off + s.n], keys, bias))
            win = torch.cat([past, new_kv])
            # a copy when cut: a slice would keep the whole prefill's rows alive (and cache_pool counts rows)
            lc.win = win[-keep:].clone() if win.shape[0] > keep else win
        o = torch.cat(outs)
        return attn.output(o, cos, sin)

    def _rotator(self, kind: str):
        freqs = self._freqs(kind)

        def rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            cs, sn = rope_cos_sin(freqs, positions)
            return apply_rope(x, cs, sn)
        return rotate
