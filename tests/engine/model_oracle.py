"""Shared helpers for tests/engine: the tiny V4.1 config of the spec (v41-flash-architecture.md §6.1), and the
transformers oracle: a random DeepseekV4ForCausalLM -> save_pretrained -> our Model by DeepSeek tensor names.

The rename table is written here from transformers' conversion mapping, independently of engine/loader.py:
transformers' `save_pretrained` already writes DeepSeek names for most tensors; these are the exceptions."""
import torch
from safetensors.torch import load_file

from deepinfer_sg.engine.config import ModelConfig
from deepinfer_sg.engine.model import Model
from deepinfer_sg.engine.testing import tiny_v41_config as tiny_v41_config_dict



def tiny_v41(**text_overrides) -> dict:
    return tiny_v41_config_dict(**text_overrides)





# ---------------------------------------------------------------------------------------------------------
# transformers oracle (V4)
# ---------------------------------------------------------------------------------------------------------

_EXCEPTIONS = {  # name transformers writes -> DeepSeek's name
    "embed_tokens.weight": "embed.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}


def deepseek_name(name: str) -> str:
    if name.startswith("model."):
        name = name[len("model."):]
    name = _EXCEPTIONS.get(name, name)
    # transformers' reverse renaming turns the window KV norm into `attn.norm` (its `.norm.` -> `.kv_norm.` rule)
    return name.replace(".attn.norm.", ".attn.kv_norm.")


def hf_tiny(tmp_path, seed=0, **overrides):
    """Build + save a random transformers V4 model; returns (hf_model, folder)."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    kw = dict(vocab_size=97, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
              head_dim=32, q_lora_rank=16, n_routed_experts=4, num_experts_per_tok=2, sliding_window=8,
              o_groups=2, o_lora_rank=8, index_n_heads=8, index_head_dim=16, index_topk=3, hc_mult=2,
              partial_rotary_factor=0.25, max_position_embeddings=4096,
              rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                               "beta_fast": 32, "beta_slow": 1},
              layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                           "compressed_sparse_attention"],
              compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
              mlp_layer_types=["hash_moe", "moe", "moe", "moe"])
    kw.update(overrides)
    torch.manual_seed(seed)
    cfg = DeepseekV4Config(**kw)
    hf = DeepseekV4ForCausalLM(cfg).eval()
    with torch.no_grad():   # transformers zero-inits these; random values exercise them
        for name, p in hf.named_parameters():
            if name.endswith(("sinks", "position_bias", "e_score_correction_bias", ".base", "hc_base")):
                p.normal_(0, 0.5)
            if name.endswith(("norm.weight",)):
                p.uniform_(0.5, 1.5)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
            if name.endswith("tid2eid"):
                g = torch.Generator().manual_seed(seed + 1)
                b.copy_(torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:cfg.num_experts_per_tok]
                                     for _ in range(cfg.vocab_size)]))
    folder = tmp_path / "hf"
    hf.save_pretrained(folder)
    return hf, folder


def load_ours(folder, dtype=torch.float32) -> Model:
    config = ModelConfig.from_json(folder / "config.json")
    model = Model(config, dtype=dtype)
    sd = {deepseek_name(k): v for k, v in load_file(str(folder / "model.safetensors")).items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    model.set_dtype(dtype)
    return model.eval()
