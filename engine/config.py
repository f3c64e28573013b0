"""ModelConfig: one normalized description of a DeepSeek-V4 / V4.1 network, parsed from an HF `config.json`.

Two input layouts are accepted:
  * transformers' `deepseek_v4` config (layer_types + compress_rates, mlp_layer_types with hash MoE, nested
    rope_parameters) and DeepSeek's own V4 layout (compress_ratios 0/4/128, num_hash_layers, rope_scaling);
  * DeepSeek's V4.1 layout (`model_type: deepseek_v41`, everything under `text_config`; compress_ratios 0/1/2,
    kv/index/index-K source-layer maps, candidate blocks, engram, DSpark).

Both become the same dataclass. What differs between V4 and V4.1 is expressed as switches (`hc_shifted`, `q_norm`,
`compressor_style`, the sharing maps, candidate blocks), so the network code has one path with branches, not forks.
Every unknown key or inconsistent value raises `ConfigError` naming the key.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, asdict
from pathlib import Path


class ConfigError(ValueError):
    """A config.json field is unknown, missing or inconsistent; the message names the field."""


@dataclass(frozen=True)
class Yarn:
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class LayerSpec:
    """Role of one backbone layer, derived once from the config.

    ratio: compression ratio of the layer's compressed KV (0 = sliding window only).
    kv_source: layer whose compressor owns the compressed entries this layer attends (None if ratio 0).
    index_source: layer whose top-k selection this layer uses (None: attend every visible compressed entry).
    index_k_source: layer owning the index keys used by this layer's index source (None without indexer).
    candidate_source: layer whose candidate blocks restrict this layer's indexer (only for index sources).
    """
    ratio: int
    kv_source: int | None
    index_source: int | None
    index_k_source: int | None
    candidate_source: int | None
    rope: str  # "main" (rope_theta, no yarn) or "compress" (compress_rope_theta, yarn if configured)

    @property
    def has_compressed(self) -> bool:
        return self.ratio > 0


@dataclass
class ModelConfig:
    variant: str                      # "v4" or "v41"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_dim: int                     # rotary dims = the LAST rope_dim of every head / KV vector
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    sliding_window: int
    rms_norm_eps: float
    rope_theta: float
    compress_rope_theta: float
    yarn: Yarn | None                 # applied only to layers with compressed KV
    compress_ratios: list[int]        # per backbone layer
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    swiglu_limit: float
    mlp_layer_types: list[str]        # "moe" or "hash_moe" per layer
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    # ---- switches: V4 value / V4.1 value ----
    hc_shifted: bool                  # False (own pre-mix per sub-layer + hc_head) / True (previous sub-layer's)
    q_norm: bool                      # True (per-head unweighted RMSNorm on q) / False
    compressor_style: str             # "v4" (ratio-4 overlap + indexer's own compressor + ape) / "v41"
    kv_source_layer_ids: list[int] = field(default_factory=list)
    index_source_layer_ids: list[int] = field(default_factory=list)
    index_k_source_layer_ids: list[int] = field(default_factory=list)
    candidate_source_layer_id: int | None = None
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0
    # ---- V4.1 extras, consumed by engram.py / dspark.py ----
    engram_layer_ids: list[int] = field(default_factory=list)
    engram: dict = field(default_factory=dict)        # the engram_* keys, names without the prefix
    num_nextn_predict_layers: int = 0
    dspark: dict = field(default_factory=dict)        # the dspark_* keys, names without the prefix
    # ---- misc ----
    max_position_embeddings: int = 1 << 20
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    pad_token_id: int | None = None
    quantization_config: dict | None = None
    hc_post_mult: float = 2.0
    fp4_sparse_kv: bool = True        # runtime compressed-KV format when simulated: FP4 (True) or MXFP8

    # ------------------------------------------------------------------ derived
    def __post_init__(self):
        self.validate()
        self.layers: list[LayerSpec] = _derive_layers(self)

    @property
    def n_prefill_layer(self) -> int | None:
        """First YOCO decoder layer (V4.1: the first ratio-1 layer); None when there is none."""
        if self.compressor_style != "v41":
            return None
        return next((i for i, r in enumerate(self.compress_ratios) if r == 1), None)

    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.rope_dim

    @property
    def dspark_target_layer_ids(self) -> list[int]:
        return list(self.dspark.get("target_layer_ids", []))

    def validate(self) -> None:
        def need(cond: bool, msg: str):
            if not cond:
                raise ConfigError(msg)
        n = self.num_layers
        need(self.variant in ("v4", "v41"), f"variant must be 'v4' or 'v41', got {self.variant!r}")
        need(len(self.compress_ratios) == n,
             f"compress_ratios has {len(self.compress_ratios)} backbone entries, num_hidden_layers is {n}")
        need(len(self.mlp_layer_types) == n,
             f"mlp_layer_types has {len(self.mlp_layer_types)} entries, num_hidden_layers is {n}")
        for t in self.mlp_layer_types:
            need(t in ("moe", "hash_moe"), f"mlp_layer_types entry {t!r} is not 'moe' or 'hash_moe'")
        need(0 < self.rope_dim <= self.head_dim and self.rope_dim % 2 == 0,
             f"qk_rope_head_dim {self.rope_dim} must be even and within head_dim {self.head_dim}")
        need(self.index_head_dim >= self.rope_dim or not any(self.compress_ratios),
             f"index_head_dim {self.index_head_dim} must be >= qk_rope_head_dim {self.rope_dim}")
        need(self.num_heads % self.o_groups == 0,
             f"num_attention_heads {self.num_heads} is not divisible by o_groups {self.o_groups}")
        need(self.num_experts_per_tok <= self.n_routed_experts,
             f"num_experts_per_tok {self.num_experts_per_tok} > n_routed_experts {self.n_routed_experts}")
        need(self.n_shared_experts in (0, 1), f"n_shared_experts must be 0 or 1, got {self.n_shared_experts}")
        need(self.compressor_style in ("v4", "v41"), f"compressor_style {self.compressor_style!r} unknown")
        need(self.hc_mult >= 1 and self.hc_sinkhorn_iters >= 1, "hc_mult and hc_sinkhorn_iters must be >= 1")
        need(self.sliding_window >= 1, f"sliding_window must be >= 1, got {self.sliding_window}")
        for r in self.compress_ratios:
            need(r >= 0, f"compress_ratios entry {r} must be >= 0")
            need(not (self.compressor_style == "v4" and r == 1), "compress ratio 1 needs compressor_style 'v41'")
        for name in ("kv_source_layer_ids", "index_source_layer_ids", "index_k_source_layer_ids",
                     "engram_layer_ids"):
            ids = getattr(self, name)
            need(ids == sorted(set(ids)), f"{name} must be strictly increasing, got {ids}")
            need(all(0 <= i < n for i in ids), f"{name} {ids} has ids outside 0..{n - 1}")
        for i in self.dspark_target_layer_ids:
            need(0 <= i < n, f"dspark_target_layer_ids entry {i} outside 0..{n - 1}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("layers", None)
        return d

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        try:
            d = json.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {p}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p} is not valid JSON: {e}") from None
        return cls.from_dict(d)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        if not isinstance(d, dict):
            raise ConfigError("config must be a JSON object")
        mt = d.get("model_type")
        if mt == "deepseek_v41" or "text_config" in d:
            return _parse_v41(d)
        if mt in ("deepseek_v4", None):
            return _parse_v4(d)
        raise ConfigError(f"model_type {mt!r} is not 'deepseek_v4' or 'deepseek_v41'")


# ---------------------------------------------------------------------- helpers

# keys that are accepted and ignored (training-only, HF bookkeeping, or vision)
_IGNORED = {
    "architectures", "transformers_version", "dtype", "torch_dtype", "initializer_range", "use_cache",
    "output_router_logits", "router_aux_loss_coef", "router_jitter_noise", "attention_dropout", "mlp_bias",
    "attention_bias", "hidden_act", "model_type", "num_key_value_heads", "tie_word_embeddings", "norm_topk_prob",
    "scoring_func", "topk_method", "rope_interleave", "image_token_id", "vision_config", "text_config",
    "intermediate_size", "num_local_experts", "hc_post_mult_value", "attn_implementation", "_name_or_path",
    "n_group", "topk_group", "first_k_dense_replace",
    "id2label", "label2id", "return_dict", "output_hidden_states", "output_attentions", "is_encoder_decoder",
    "chunk_size_feed_forward", "problem_type", "tokenizer_class", "expert_dtype", "kv_lora_rank",
    "qk_nope_head_dim", "v_head_dim", "engram_num_embeddings", "index_weights_scale",
}


def _check_common(d: dict, where: str) -> None:
    def bad(key, val, want):
        raise ConfigError(f"{where}{key} = {val!r} is not supported (expected {want})")
    if d.get("num_key_value_heads", 1) != 1:
        bad("num_key_value_heads", d["num_key_value_heads"], "1: a single shared KV vector")
    if d.get("hidden_act", "silu") != "silu":
        bad("hidden_act", d["hidden_act"], "'silu'")
    if d.get("attention_bias", False):
        bad("attention_bias", d["attention_bias"], "false")
    if d.get("mlp_bias", False):
        bad("mlp_bias", d["mlp_bias"], "false")
    if d.get("tie_word_embeddings", False):
        bad("tie_word_embeddings", d["tie_word_embeddings"], "false: embed and head are separate tensors")
    if d.get("scoring_func", "sqrtsoftplus") != "sqrtsoftplus":
        bad("scoring_func", d["scoring_func"], "'sqrtsoftplus'")
    if d.get("topk_method", "noaux_tc") != "noaux_tc":
        bad("topk_method", d["topk_method"], "'noaux_tc'")
    if not d.get("norm_topk_prob", True):
        bad("norm_topk_prob", d["norm_topk_prob"], "true")
    if d.get("hc_post_mult_value", 2.0) != 2.0:
        bad("hc_post_mult_value", d["hc_post_mult_value"], "2.0")


def _unknown(d: dict, known: set, where: str) -> None:
    extra = sorted(k for k in d if k not in known and k not in _IGNORED)
    if extra:
        raise ConfigError(f"{where}unknown config keys {extra}")


def _req(d: dict, key: str, where: str):
    if key not in d:
        raise ConfigError(f"{where}missing required key {key!r}")
    return d[key]


def _yarn_from(rp: dict | None, where: str) -> Yarn | None:
    if not rp:
        return None
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind == "default":
        return None
    if kind != "yarn":
        raise ConfigError(f"{where}rope type {kind!r} is not supported (only 'yarn' or default)")
    for k in ("mscale", "mscale_all_dim"):
        if rp.get(k) not in (None, 0, 1, 1.0):
            raise ConfigError(f"{where}rope_scaling.{k} = {rp[k]} is not supported (V4 disables mscale)")
    if rp.get("attention_factor", 1.0) != 1.0:
        raise ConfigError(f"{where}rope attention_factor {rp['attention_factor']} != 1.0 is not supported")
    if "factor" not in rp or "original_max_position_embeddings" not in rp:
        raise ConfigError(f"{where}yarn rope needs 'factor' and 'original_max_position_embeddings'")
    return Yarn(float(rp["factor"]), int(rp["original_max_position_embeddings"]),
                float(rp.get("beta_fast") or 32), float(rp.get("beta_slow") or 1))


_V4_TYPE_TO_KEY = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}

_V4_KNOWN = {
    "vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads", "head_dim",
    "q_lora_rank", "num_experts_per_tok", "n_routed_experts", "n_shared_experts", "routed_scaling_factor",
    "max_position_embeddings", "rope_theta", "layer_types", "compress_rates", "compress_rope_theta", "hc_mult",
    "hc_sinkhorn_iters", "hc_eps", "mlp_layer_types", "swiglu_limit", "sliding_window", "o_groups", "o_lora_rank",
    "index_n_heads", "index_head_dim", "index_topk", "num_nextn_predict_layers", "rms_norm_eps", "pad_token_id",
    "bos_token_id", "eos_token_id", "rope_parameters", "partial_rotary_factor", "qk_rope_head_dim",
    "compress_ratios", "compress_rate_csa", "compress_rate_hca", "num_hash_layers", "rope_scaling",
    "quantization_config",
}


def _parse_v4(d: dict) -> ModelConfig:
    where = "deepseek_v4 config: "
    _unknown(d, _V4_KNOWN, where)
    _check_common(d, where)
    n = int(_req(d, "num_hidden_layers", where))
    head_dim = int(_req(d, "head_dim", where))
    # ratios: transformers' layer_types + compress_rates, or DeepSeek's compress_ratios list
    rates = dict(d.get("compress_rates") or {})
    if "compress_rate_csa" in d:
        rates["compressed_sparse_attention"] = d["compress_rate_csa"]
    if "compress_rate_hca" in d:
        rates["heavily_compressed_attention"] = d["compress_rate_hca"]
    for k, v in _V4_TYPE_TO_KEY.items():
        rates.setdefault(k, v)
    rates["sliding_attention"] = 0
    if d.get("layer_types") is not None:
        for t in d["layer_types"]:
            if t not in rates:
                raise ConfigError(f"{where}layer_types entry {t!r} unknown")
        ratios = [int(rates[t]) for t in d["layer_types"]]
        csa_rate = int(rates["compressed_sparse_attention"])
    elif d.get("compress_ratios") is not None:
        ratios = [int(r) for r in d["compress_ratios"]][:n]   # DeepSeek lists the MTP layers after the backbone
        csa_rate = int(rates["compressed_sparse_attention"])   # 4 unless compress_rate_csa says otherwise
    else:
        raise ConfigError(f"{where}needs 'layer_types' or 'compress_ratios'")
    if len(ratios) < n:
        raise ConfigError(f"{where}layer_types/compress_ratios has {len(ratios)} entries < num_hidden_layers {n}")
    ratios = ratios[:n]
    # in V4 only the CSA rate has an indexer (and overlapping windows); every other rate is HCA-like
    if d.get("mlp_layer_types") is not None:
        mlp = list(d["mlp_layer_types"])[:n]
    else:
        nh = int(d.get("num_hash_layers", 3))
        mlp = ["hash_moe"] * min(n, nh) + ["moe"] * max(0, n - nh)
    if d.get("qk_rope_head_dim") is not None:
        rope_dim = int(d["qk_rope_head_dim"])
    elif d.get("partial_rotary_factor") is not None:
        rope_dim = int(head_dim * float(d["partial_rotary_factor"]))
    else:
        rope_dim = 64
    rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
    rope_theta = float(d.get("rope_theta", 10000.0))
    compress_theta = float(d.get("compress_rope_theta", 160000.0))
    if isinstance(rp.get("compress"), dict):
        main = rp.get("main") or {}
        rope_theta = float(main.get("rope_theta", rope_theta))
        if main.get("rope_type", "default") != "default":
            raise ConfigError(f"{where}rope_parameters.main must be the default rope")
        comp = rp["compress"]
        compress_theta = float(comp.get("rope_theta", compress_theta))
        yarn = _yarn_from(comp, where + "rope_parameters.compress: ")
    else:
        yarn = _yarn_from(rp, where + "rope_parameters: ")
    comp_layers = [i for i, r in enumerate(ratios) if r > 0]
    csa_layers = [i for i, r in enumerate(ratios) if r == csa_rate]
    return ModelConfig(
        variant="v4",
        vocab_size=int(_req(d, "vocab_size", where)), hidden_size=int(_req(d, "hidden_size", where)),
        num_layers=n, num_heads=int(_req(d, "num_attention_heads", where)), head_dim=head_dim,
        rope_dim=rope_dim, q_lora_rank=int(_req(d, "q_lora_rank", where)),
        o_lora_rank=int(_req(d, "o_lora_rank", where)), o_groups=int(_req(d, "o_groups", where)),
        sliding_window=int(_req(d, "sliding_window", where)), rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta, compress_rope_theta=compress_theta, yarn=yarn, compress_ratios=ratios,
        index_n_heads=int(d.get("index_n_heads", 64)), index_head_dim=int(d.get("index_head_dim", 128)),
        index_topk=int(d.get("index_topk", 512)),
        n_routed_experts=int(_req(d, "n_routed_experts", where)), n_shared_experts=int(d.get("n_shared_experts", 1)),
        num_experts_per_tok=int(_req(d, "num_experts_per_tok", where)),
        moe_intermediate_size=int(_req(d, "moe_intermediate_size", where)),
        routed_scaling_factor=float(d.get("routed_scaling_factor", 1.5)),
        swiglu_limit=float(d.get("swiglu_limit", 10.0)), mlp_layer_types=mlp,
        hc_mult=int(d.get("hc_mult", 4)), hc_sinkhorn_iters=int(d.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(d.get("hc_eps", 1e-6)),
        hc_shifted=False, q_norm=True, compressor_style="v4",
        kv_source_layer_ids=comp_layers, index_source_layer_ids=csa_layers, index_k_source_layer_ids=csa_layers,
        num_nextn_predict_layers=0,  # V4's MTP layers are not instantiated (transformers ignores them too)
        max_position_embeddings=int(d.get("max_position_embeddings", 1 << 20)),
        bos_token_id=d.get("bos_token_id", 0), eos_token_id=d.get("eos_token_id", 1),
        pad_token_id=d.get("pad_token_id"), quantization_config=d.get("quantization_config"),
    )


_V41_TEXT_KNOWN = {
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "qk_rope_head_dim",
    "q_lora_rank", "o_lora_rank", "o_groups", "swiglu_limit", "rms_norm_eps", "max_position_embeddings",
    "rope_theta", "rope_scaling", "compress_rope_theta", "sliding_window", "compress_ratios",
    "kv_source_layer_ids", "index_source_layer_ids", "index_k_source_layer_ids", "index_n_heads",
    "index_head_dim", "index_topk", "candidate_source_layer_id", "candidate_topk_blocks", "candidate_block_size",
    "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size",
    "routed_scaling_factor", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "hc_shifted", "num_nextn_predict_layers",
    "bos_token_id", "eos_token_id", "pad_token_id",
    # switches that default to the V4.1 value (set them to reproduce V4 behaviour)
    "use_qnorm", "compressor_style", "num_hash_layers", "mlp_layer_types", "use_fp4_sparse_kv",
}

_V41_TOP_KNOWN = {"architectures", "model_type", "dtype", "torch_dtype", "bos_token_id", "eos_token_id",
                  "pad_token_id", "image_token_id", "quantization_config", "vision_config", "text_config",
                  "transformers_version", "tie_word_embeddings"}


def _source_map(layer: int, sources: list[int]) -> int | None:
    """Nearest source at or before `layer` (DeepInfer's `max(s in sources, s <= layer)`)."""
    best = None
    for s in sources:
        if s <= layer:
            best = s
    return best


def _parse_v41(d: dict) -> ModelConfig:
    extra = sorted(k for k in d if k not in _V41_TOP_KNOWN)
    if extra:
        raise ConfigError(f"deepseek_v41 config: unknown top-level keys {extra}")
    t = d.get("text_config")
    if not isinstance(t, dict):
        raise ConfigError("deepseek_v41 config: missing 'text_config' object")
    where = "deepseek_v41 text_config: "
    known = set(_V41_TEXT_KNOWN)
    known |= {k for k in t if k.startswith("engram_") or k.startswith("dspark_")}
    _unknown(t, known, where)
    _check_common(t, where)
    if d.get("tie_word_embeddings", False):
        raise ConfigError("deepseek_v41 config: tie_word_embeddings must be false")
    n = int(_req(t, "num_hidden_layers", where))
    nextn = int(t.get("num_nextn_predict_layers", 0))
    ratios_all = [int(r) for r in _req(t, "compress_ratios", where)]
    if len(ratios_all) not in (n, n + nextn):
        raise ConfigError(f"{where}compress_ratios has {len(ratios_all)} entries; expected num_hidden_layers "
                          f"({n}) or num_hidden_layers + num_nextn_predict_layers ({n + nextn})")
    ratios = ratios_all[:n]
    style = t.get("compressor_style", "v41")
    comp_layers = [i for i, r in enumerate(ratios) if r > 0]
    kv_src = list(t.get("kv_source_layer_ids", comp_layers))
    idx_src = list(t.get("index_source_layer_ids", kv_src))
    idxk_src = list(t.get("index_k_source_layer_ids", kv_src))
    nh = int(t.get("num_hash_layers", 0))
    mlp = list(t.get("mlp_layer_types") or (["hash_moe"] * min(n, nh) + ["moe"] * max(0, n - nh)))
    if not t.get("dspark_target_attn_input", True):
        raise ConfigError(f"{where}dspark_target_attn_input = false is not supported (features are captured at "
                          f"the target layers' attention input)")
    engram = {k[len("engram_"):]: v for k, v in t.items() if k.startswith("engram_")}
    engram_ids = list(engram.pop("layer_ids", []))
    dspark = {k[len("dspark_"):]: v for k, v in t.items() if k.startswith("dspark_")}
    return ModelConfig(
        variant="v41",
        vocab_size=int(_req(t, "vocab_size", where)), hidden_size=int(_req(t, "hidden_size", where)),
        num_layers=n, num_heads=int(_req(t, "num_attention_heads", where)), head_dim=int(_req(t, "head_dim", where)),
        rope_dim=int(_req(t, "qk_rope_head_dim", where)), q_lora_rank=int(_req(t, "q_lora_rank", where)),
        o_lora_rank=int(_req(t, "o_lora_rank", where)), o_groups=int(_req(t, "o_groups", where)),
        sliding_window=int(_req(t, "sliding_window", where)), rms_norm_eps=float(t.get("rms_norm_eps", 1e-20)),
        rope_theta=float(t.get("rope_theta", 10000.0)), compress_rope_theta=float(t.get("compress_rope_theta", 160000.0)),
        yarn=_yarn_from(t.get("rope_scaling"), where + "rope_scaling: "), compress_ratios=ratios,
        index_n_heads=int(t.get("index_n_heads", 0)), index_head_dim=int(t.get("index_head_dim", 0)),
        index_topk=int(t.get("index_topk", 0)),
        n_routed_experts=int(_req(t, "n_routed_experts", where)), n_shared_experts=int(t.get("n_shared_experts", 1)),
        num_experts_per_tok=int(_req(t, "num_experts_per_tok", where)),
        moe_intermediate_size=int(_req(t, "moe_intermediate_size", where)),
        routed_scaling_factor=float(t.get("routed_scaling_factor", 1.5)),
        swiglu_limit=float(t.get("swiglu_limit", 10.0)), mlp_layer_types=mlp,
        hc_mult=int(t.get("hc_mult", 4)), hc_sinkhorn_iters=int(t.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(t.get("hc_eps", 1e-6)),
        hc_shifted=bool(t.get("hc_shifted", True)), q_norm=bool(t.get("use_qnorm", False)), compressor_style=style,
        kv_source_layer_ids=kv_src, index_source_layer_ids=idx_src, index_k_source_layer_ids=idxk_src,
        candidate_source_layer_id=t.get("candidate_source_layer_id"),
        candidate_topk_blocks=int(t.get("candidate_topk_blocks", 0)),
        candidate_block_size=int(t.get("candidate_block_size", 0)),
        engram_layer_ids=engram_ids, engram=engram, num_nextn_predict_layers=nextn, dspark=dspark,
        max_position_embeddings=int(t.get("max_position_embeddings", 1 << 20)),
        bos_token_id=t.get("bos_token_id", d.get("bos_token_id", 0)),
        eos_token_id=t.get("eos_token_id", d.get("eos_token_id", 1)),
        pad_token_id=t.get("pad_token_id", d.get("pad_token_id")),
        quantization_config=d.get("quantization_config"), fp4_sparse_kv=bool(t.get("use_fp4_sparse_kv", True)),
    )


def _derive_layers(c: ModelConfig) -> list[LayerSpec]:
    """Per-layer roles from the ratios and the source maps; raises ConfigError on an inconsistent topology."""
    out = []
    cand = c.candidate_source_layer_id
    if cand is not None:
        if cand not in c.index_source_layer_ids:
            raise ConfigError(f"candidate_source_layer_id {cand} is not in index_source_layer_ids")
        if c.candidate_topk_blocks <= 0 or c.candidate_block_size <= 0:
            raise ConfigError("candidate_topk_blocks and candidate_block_size must be > 0 with a candidate source")
    for s in c.kv_source_layer_ids + c.index_source_layer_ids + c.index_k_source_layer_ids:
        if c.compress_ratios[s] == 0:
            raise ConfigError(f"source layer {s} has compress ratio 0 (no compressed KV)")
    for i, r in enumerate(c.compress_ratios):
        if r == 0:
            out.append(LayerSpec(0, None, None, None, None, "main"))
            continue
        kv = _source_map(i, c.kv_source_layer_ids)
        if kv is None:
            raise ConfigError(f"layer {i} (compress ratio {r}) has no kv source at or before it "
                              f"in kv_source_layer_ids {c.kv_source_layer_ids}")
        if c.compress_ratios[kv] != r:
            raise ConfigError(f"layer {i} (ratio {r}) would share compressed KV of layer {kv} (ratio "
                              f"{c.compress_ratios[kv]})")
        idx = _source_map(i, c.index_source_layer_ids)
        if idx is not None and c.compress_ratios[idx] != r:
            idx = None  # the nearest index source belongs to another ratio segment
        if c.compressor_style == "v4" and idx is not None and idx != i:
            raise ConfigError(f"layer {i}: index sharing needs compressor_style 'v41'")
        if c.variant == "v41" and c.compressor_style == "v41" and idx is None:
            raise ConfigError(f"layer {i} (ratio {r}) has no index source of the same ratio at or before it")
        idxk = None
        if idx is not None:
            idxk = _source_map(idx, c.index_k_source_layer_ids) if c.compressor_style == "v41" else idx
            if idxk is None or c.compress_ratios[idxk] != r:
                raise ConfigError(f"index source {idx} has no index-K source of ratio {r} at or before it")
            if _source_map(idxk, c.kv_source_layer_ids) != kv and c.compressor_style == "v41":
                raise ConfigError(f"layer {i}: index-K source {idxk} reads another compressed KV than kv source {kv}")
        cs = None
        if cand is not None and idx == i and i > cand and c.compress_ratios[cand] == r:
            cs = cand
        out.append(LayerSpec(r, kv, idx, idxk, cs, "compress"))
    if c.index_source_layer_ids and any(c.compress_ratios) and (c.index_n_heads <= 0 or c.index_head_dim <= 0):
        raise ConfigError("index_n_heads and index_head_dim must be > 0 when index sources exist")
    if c.compressor_style == "v4":
        for i, r in enumerate(c.compress_ratios):
            if r > 0 and c.kv_source_layer_ids and _source_map(i, c.kv_source_layer_ids) != i:
                raise ConfigError(f"layer {i}: compressed-KV sharing needs compressor_style 'v41'")
    return out


def yarn_low_high(rope_dim: int, base: float, y: Yarn) -> tuple[float, float]:
    """YaRN correction range (transformers / DeepSeek formula, truncated to integers)."""
    def dim_for(rot):
        return rope_dim * math.log(y.original_max_position_embeddings / (rot * 2 * math.pi)) / (2 * math.log(base))
    low = max(math.floor(dim_for(y.beta_fast)), 0)
    high = min(math.ceil(dim_for(y.beta_slow)), rope_dim - 1)
    return low, high
