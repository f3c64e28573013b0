"""Random checkpoints in DeepSeek's format, and the small configs tests and benchmarks use.

- `tiny_v41_config(**overrides)`: the spec's §6.1 tiny V4.1 config (HF `config.json` dict, `text_config` layout).
- `tiny_v4_config(**overrides)`: a tiny transformers `deepseek_v4` config dict (every layer type, hash MoE).
- `midsize_v41_config(**overrides)`: the spec's §6.2 H200 benchmark config (~12.6 B parameters).
- `write_checkpoint(config, path, seed=0, quantize=None|"fp8")`: a random checkpoint folder (config.json +
  safetensors, sharded with an index when larger than `max_shard_bytes`).

The tensor inventory is the model's own (`Model(config).state_dict()` built on the meta device: names,
shapes), plus the Engram tables, which are not parameters. Stored dtypes follow the real checkpoint (spec
§5.2): hc_* / attn_sink / gate biases / ape in F32, everything else BF16; with `quantize="fp8"` the dense
projections are FP8 E4M3 + 32x32 UE8M0 `.scale`, routed experts FP4 (packed int8) + 1x32 UE8M0 `.scale`,
Engram tables FP8 + per-32 scales (with `quantize=None` the tables are BF16).

Random values are scaled so a tiny model behaves like a trained one in shape: projections N(0, 1/fan_in)
(activations stay O(1) through RMSNorm'd layers), residual-writing projections smaller, norms near 1,
near-identity hyper-connection mixes, moderate sinks and routing biases, logits with a spread of a few
units (peaked but not degenerate next-token distributions).
"""
from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from .quant import quantize_fp4_blocks, quantize_fp8_blocks

# ----------------------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------------------

_QUANTIZATION_CONFIG = {"quant_method": "fp8", "expert_dtype": "fp4", "activation_scheme": "dynamic",
                        "weight_block_size": [32, 32], "scale_fmt": "ue8m0"}

_TINY_V41_TEXT = {
    "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 7,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "qk_rope_head_dim": 16,
    "q_lora_rank": 32, "o_lora_rank": 32, "o_groups": 2,
    "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
    "swiglu_limit": 10.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "max_position_embeddings": 512, "rope_theta": 10000, "compress_rope_theta": 160000,
    "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 32,
                     "beta_fast": 32, "beta_slow": 1},
    "sliding_window": 8,
    "compress_ratios": [0, 0, 2, 2, 1, 1, 1, 0, 0],
    "kv_source_layer_ids": [2, 4], "index_source_layer_ids": [2, 4, 5],
    "index_n_heads": 2, "index_head_dim": 32, "index_topk": 6,
    "candidate_source_layer_id": 4, "candidate_topk_blocks": 8, "candidate_block_size": 2,
    "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "engram_layer_ids": [1], "engram_max_ngram_size": 3, "engram_vocab_size": 97,
    "engram_n_heads": 2, "engram_head_dim": 32, "engram_pad_token_id": 2,
    "engram_compressed_vocab_size": 0,
    "num_nextn_predict_layers": 2, "dspark_block_size": 3, "dspark_noise_token_id": 511,
    "dspark_target_layer_ids": [5, 6], "dspark_markov_rank": 16,
    "dspark_n_routed_experts": 4, "dspark_num_experts_per_tok": 2,
}


def _v41_config(text: dict, overrides: dict) -> dict:
    cfg = {
        "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "dtype": "bfloat16",
        "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
        "quantization_config": dict(_QUANTIZATION_CONFIG),
        "text_config": copy.deepcopy(text),
    }
    for k, v in overrides.items():  # top-level keys stay top-level, everything else is a text_config key
        if k in cfg and k != "text_config":
            cfg[k] = v
        elif v is None:
            cfg["text_config"].pop(k, None)
        else:
            cfg["text_config"][k] = v
    return cfg


def tiny_v41_config(**overrides) -> dict:
    """Spec §6.1 tiny V4.1 config as a `config.json` dict; overrides set `text_config` keys (None removes one)."""
    return _v41_config(_TINY_V41_TEXT, overrides)


def midsize_v41_config(**overrides) -> dict:
    """Spec §6.2 mid-size V4.1 config (~12.6 B params, ~25 GB bf16): real per-head geometry, fewer layers and
    experts, smaller Engram tables; the real tokenizer's vocabulary with Engram token compression on."""
    text = dict(_TINY_V41_TEXT)
    text.update({
        "vocab_size": 129280, "hidden_size": 2048, "num_hidden_layers": 20,
        "num_attention_heads": 32, "head_dim": 512, "qk_rope_head_dim": 64,
        "q_lora_rank": 768, "o_lora_rank": 512, "o_groups": 4,
        "sliding_window": 128, "rms_norm_eps": 1e-20, "max_position_embeddings": 1048576,
        "rope_theta": 10000, "compress_rope_theta": 160000,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        "compress_ratios": [0, 0] + [2] * 8 + [1] * 10 + [0, 0, 0],
        "kv_source_layer_ids": [2, 6, 10], "index_source_layer_ids": [2, 6, 10, 12, 14, 16, 18],
        "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512,
        "candidate_source_layer_id": 10, "candidate_topk_blocks": 256, "candidate_block_size": 8,
        "n_routed_experts": 64, "num_experts_per_tok": 6, "n_shared_experts": 1, "moe_intermediate_size": 1024,
        "routed_scaling_factor": 1.5,
        "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
        "engram_layer_ids": [1, 6], "engram_max_ngram_size": 4, "engram_n_heads": 8, "engram_head_dim": 256,
        "engram_vocab_size": 200000, "engram_pad_token_id": 2, "engram_compressed_vocab_size": 99092,
        "num_nextn_predict_layers": 3, "dspark_target_layer_ids": [17, 18, 19], "dspark_block_size": 5,
        "dspark_markov_rank": 256, "dspark_n_routed_experts": 32, "dspark_num_experts_per_tok": 3,
        "dspark_noise_token_id": 128799,
    })
    return _v41_config(text, overrides)


def tiny_v4_config(**overrides) -> dict:
    """A tiny transformers `deepseek_v4` config dict: sliding, CSA (ratio 4, indexer) and HCA (ratio 8) layers,
    a hash-routed MoE layer then regular MoE, YaRN on the compressed layers, hc_mult 2 (override to 4)."""
    cfg = {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "vocab_size": 256, "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "partial_rotary_factor": 0.25,
        "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 32,
        "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "routed_scaling_factor": 1.5,
        "scoring_func": "sqrtsoftplus", "norm_topk_prob": True, "swiglu_limit": 10.0,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "max_position_embeddings": 4096, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                            "beta_fast": 32, "beta_slow": 1},
        "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                        "compressed_sparse_attention"],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
        "hc_mult": 2, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "sliding_window": 8,
        # 8 index heads: with few heads ReLU often zeroes every head's score, and top-k among exact ties is
        # unspecified (transformers and we may pick different entries)
        "index_n_heads": 8, "index_head_dim": 32, "index_topk": 4,
        "num_nextn_predict_layers": 0, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
    }
    cfg.update(copy.deepcopy(overrides))
    return cfg


# ----------------------------------------------------------------------------------------------------------
# Tensor inventory and storage formats
# ----------------------------------------------------------------------------------------------------------

# Stored as F32 in DeepSeek's checkpoints (spec §5.2); the loader keeps whatever dtype the model chose.
_F32 = re.compile(r"(hc_(attn|ffn|head)_(fn|base|scale)|attn_sink|gate\.bias(_vl)?|\.ape)$")
# Dense projections stored FP8 E4M3 with 32x32 UE8M0 block scales in the real checkpoint.
_FP8 = re.compile(r"(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|ffn\.shared_experts\.w[123]"
                  r"|engram\.wkv|main_proj)\.weight$")
# Routed experts: FP4 E2M1 (two per int8, low nibble first) with 1x32 UE8M0 scales.
_FP4 = re.compile(r"ffn\.experts\.\d+\.w[123]\.weight$")
# Projections whose output is added to the residual streams: smaller, so depth does not blow activations up.
_RESIDUAL_OUT = re.compile(r"(attn\.wo_b|ffn\.experts\.\d+\.w2|ffn\.shared_experts\.w2)\.weight$")


def model_inventory(config) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype) of `Model(config).state_dict()`, built on the meta device (no memory)."""
    from . import engram as engram_mod
    from .model import Model

    mc = _model_config(config)
    saved = engram_mod.MAX_RANDOM_TABLE_ELEMENTS
    engram_mod.MAX_RANDOM_TABLE_ELEMENTS = 0  # no random in-memory Engram tables on the meta device
    try:
        model = Model(mc, device="meta")
    finally:
        engram_mod.MAX_RANDOM_TABLE_ELEMENTS = saved
    return {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}


def engram_tables(config) -> dict[int, tuple[int, int]]:
    """Engram layer id -> (rows, head_dim) of its table (rows = sum of the layer's hash primes)."""
    from .engram import EngramSpec, engram_table_rows

    mc = _model_config(config)
    if not mc.engram_layer_ids:
        return {}
    spec = EngramSpec.from_config(_text_config(config))
    return {i: (engram_table_rows(spec, i), spec.head_dim) for i in mc.engram_layer_ids}


def _model_config(config):
    from .config import ModelConfig
    return ModelConfig.from_dict(config) if isinstance(config, dict) else config


def _text_config(config: dict) -> dict:
    if not isinstance(config, dict):
        raise TypeError("write_checkpoint needs the config.json dict (e.g. tiny_v41_config()), not a ModelConfig")
    return config.get("text_config", config)


# ----------------------------------------------------------------------------------------------------------
# Random values
# ----------------------------------------------------------------------------------------------------------

def _init_value(name: str, shape: tuple[int, ...], dtype: torch.dtype, cfg: dict, g: torch.Generator) -> torch.Tensor:
    """A sensible random value for one tensor, by its DeepSeek name (fp32, or integer for index tables)."""
    def randn(*s, std=1.0):
        return torch.randn(*s, generator=g) * std

    if name.endswith("tid2eid"):  # hash routing: each token -> K distinct experts
        n_exp = int(cfg["n_routed_experts"])
        rows = [torch.randperm(n_exp, generator=g)[: shape[1]] for _ in range(shape[0])]
        return torch.stack(rows).to(dtype)
    if not dtype.is_floating_point:
        return torch.zeros(shape, dtype=dtype)
    m = re.search(r"hc_(attn|ffn|head)_(fn|base|scale)$", name)
    if m:
        part = m.group(2)
        if part == "fn":      # z = (r . fn) / rms(r): unit-variance mixing logits
            return randn(*shape, std=shape[1] ** -0.5)
        if part == "scale":
            return 0.5 + 0.5 * torch.rand(*shape, generator=g)
        # base: [pre(M), post(M), comb(M*M)] -> pre/post near sigmoid(0), comb favours keeping each stream
        n = shape[0]
        base = randn(n, std=0.3)
        M = int(round((-2 + math.sqrt(4 + 4 * n)) / 2)) if not name.endswith("hc_head_base") else n
        if not name.endswith("hc_head_base") and M * (M + 2) == n:
            base[2 * M:] += 2.0 * torch.eye(M).reshape(-1)
        return base
    if name.endswith("attn_sink"):
        return randn(*shape, std=0.5)
    if name.endswith(("gate.bias", "gate.bias_vl")):
        return randn(*shape, std=0.1)
    if name.endswith(".ape"):
        return randn(*shape, std=0.3)
    if name.endswith(("q_weight", "k_weight")) or name.endswith("norm.weight") or len(shape) == 1:
        return 1.0 + randn(*shape, std=0.1)
    if name == "embed.weight" or name.endswith("markov_head.embed.weight"):
        return randn(*shape)
    if name == "head.weight":  # logits spread ~2.5: peaked, non-degenerate next-token distributions
        return randn(*shape, std=2.5 * shape[1] ** -0.5)
    fan_in = shape[-1]
    std = fan_in ** -0.5
    if _RESIDUAL_OUT.search(name):
        std /= math.sqrt(2 * max(1, int(cfg.get("num_hidden_layers", 1))))
    if name.endswith("markov_head.head.weight"):
        std *= 0.5
    return randn(*shape, std=std)


def _stored(name: str, value: torch.Tensor, quantize: str | None) -> dict[str, torch.Tensor]:
    """One model tensor -> the checkpoint tensors that store it (weight [+ scale])."""
    if not value.dtype.is_floating_point:
        return {name: value}
    if _F32.search(name):
        return {name: value.float()}
    if quantize == "fp8" and value.ndim == 2:
        if _FP4.search(name) and value.shape[1] % 32 == 0:
            q, s = quantize_fp4_blocks(value)
            return {name: q, name[: -len("weight")] + "scale": s}
        if _FP8.search(name):
            q, s = quantize_fp8_blocks(value)
            return {name: q, name[: -len("weight")] + "scale": s}
    return {name: value.to(torch.bfloat16)}


def _engram_table(rows: int, width: int, quantize: str | None, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    from .engram import quantize_rows_fp8

    chunks_w, chunks_s = [], []
    for start in range(0, rows, 1 << 16):  # chunked: no fp32 copy of a whole big table
        vals = torch.randn(min(1 << 16, rows - start), width, generator=g)
        if quantize == "fp8":
            w, s = quantize_rows_fp8(vals)
            chunks_w.append(w)
            chunks_s.append(s.view(torch.float8_e8m0fnu))
        else:
            chunks_w.append(vals.to(torch.bfloat16))
    if quantize == "fp8":
        return torch.cat(chunks_w), torch.cat(chunks_s)
    return (torch.cat(chunks_w),)


# ----------------------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------------------

class _ShardWriter:
    """Accumulates tensors and writes a shard whenever `max_bytes` would be exceeded (bounded memory)."""

    def __init__(self, folder: Path, max_bytes: int):
        self.folder, self.max_bytes = folder, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.total = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        if self.pending and self.pending_bytes + n > self.max_bytes:
            self.flush()
        self.pending[name] = t.contiguous()
        self.pending_bytes += n
        self.total += n

    def flush(self) -> None:
        if not self.pending:
            return
        save_file(self.pending, str(self.folder / f"shard-{len(self.shards):05d}.tmp"), metadata={"format": "pt"})
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> list[Path]:
        self.flush()
        n = len(self.shards)
        if n == 1:
            (self.folder / "shard-00000.tmp").rename(self.folder / "model.safetensors")
            return [self.folder / "model.safetensors"]
        weight_map, files = {}, []
        for i, names in enumerate(self.shards):
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.folder / f"shard-{i:05d}.tmp").rename(self.folder / fname)
            weight_map.update({k: fname for k in names})
            files.append(self.folder / fname)
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        return files


def write_checkpoint(config: dict, path: str | Path, seed: int = 0, quantize: str | None = None,
                     max_shard_bytes: int = 2 << 30, prefix: str = "") -> Path:
    """Write a random checkpoint of `config` (a config.json dict) into folder `path`; returns the folder.

    quantize: None (BF16/F32 tensors) or "fp8" (the real checkpoint's formats: FP8 dense projections, FP4
    routed experts, FP8 Engram tables, each with UE8M0 scales). Shards at `max_shard_bytes` (index file when
    more than one). `prefix="model."` writes names with the optional prefix. Deterministic in `seed`:
    the same seed gives the same underlying values whatever `quantize` is (quantized = rounded twin).
    Cost: generates tensors one at a time; memory ~ one shard."""
    if quantize not in (None, "fp8"):
        raise ValueError(f"quantize must be None or 'fp8', got {quantize!r}")
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = copy.deepcopy(config)
    text = _text_config(cfg)
    if quantize is None:
        cfg.pop("quantization_config", None)
    elif "quantization_config" not in cfg:
        cfg["quantization_config"] = dict(_QUANTIZATION_CONFIG)
    inventory = model_inventory(config)
    if _model_config(config).variant == "v41":
        # the real V4.1 checkpoint also carries the image-routing bias next to every routing bias; text-only
        # models skip it on load, and writing it keeps that path exercised
        for name in list(inventory):
            if name.endswith("ffn.gate.bias") and name + "_vl" not in inventory:
                inventory[name + "_vl"] = inventory[name]
    tables = engram_tables(config)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))

    writer = _ShardWriter(folder, max_shard_bytes)
    for i, name in enumerate(sorted(inventory)):
        shape, dtype = inventory[name]
        # one generator per tensor: values do not depend on which other tensors exist or on `quantize`
        g = torch.Generator().manual_seed(seed * 1_000_003 + _stable_hash(name))
        value = _init_value(name, shape, dtype, text, g)
        for k, v in _stored(name, value, quantize).items():
            writer.add(prefix + k, v)
    for layer, (rows, width) in sorted(tables.items()):
        g = torch.Generator().manual_seed(seed * 1_000_003 + _stable_hash(f"engram{layer}"))
        base = f"{prefix}layers.{layer}.engram.embed."
        parts = _engram_table(rows, width, quantize, g)
        writer.add(base + "weight", parts[0])
        if len(parts) > 1:
            writer.add(base + "scale", parts[1])
    writer.finish()
    return folder


def _stable_hash(s: str) -> int:
    h = 0
    for ch in s.encode():
        h = (h * 131 + ch) % 1_000_000_007
    return h
