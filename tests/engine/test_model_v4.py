"""Our V4 network against transformers' DeepseekV4ForCausalLM (random tiny models, fp32, CPU).

Oracle: transformers' implementation, saved with `save_pretrained` and loaded into our Model by DeepSeek tensor
names (renames in conftest.py). Configs cover every layer type (sliding / CSA ratio 4 with overlap and indexer /
HCA), hc_mult 2 and 4, windows shorter than the sequence, more compressed entries than index_topk, hash and
regular MoE layers, YaRN and plain rope on the compressed layers.
"""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from model_oracle import hf_tiny, load_ours  # noqa: E402

from deepinfer_sg.engine.config import ConfigError, ModelConfig  # noqa: E402
from deepinfer_sg.engine.model import StepChunk  # noqa: E402

CONFIGS = {
    # 4 layers, hc 2: sliding, CSA(4), HCA(8), CSA(4); first layer hash-routed; yarn on compressed layers
    "hc2": dict(),
    # 5 layers, hc 4: HCA(6) first, CSA(3); two hash layers; plain rope; window 5; 16 routed experts top-3
    "hc4": dict(num_hidden_layers=5, hc_mult=4, sliding_window=5, n_routed_experts=16, num_experts_per_tok=3,
                layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention",
                             "heavily_compressed_attention", "compressed_sparse_attention"],
                compress_rates={"compressed_sparse_attention": 3, "heavily_compressed_attention": 6},
                mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe"], rope_parameters=None,
                index_topk=4, swiglu_limit=0.5),
}
SEQ = 41   # several windows long; CSA has 10-13 entries > index_topk


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    hf, folder = hf_tiny(tmp_path_factory.mktemp(request.param), seed=len(request.param),
                         **CONFIGS[request.param])
    return hf, load_ours(folder), folder


def _ids(vocab, b, s, seed=3):
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


def test_state_dict_names_are_deepseek_names(pair):
    _, ours, _ = pair
    keys = set(ours.state_dict())
    assert {"embed.weight", "head.weight", "norm.weight", "hc_head_fn", "layers.0.attn.wq_a.weight",
            "layers.0.ffn.experts.1.w3.weight", "layers.0.ffn.shared_experts.w2.weight"} <= keys
    assert any(k.endswith("attn.indexer.compressor.ape") for k in keys)


def test_full_logits_match_transformers(pair):
    hf, ours, _ = pair
    ids = _ids(hf.config.vocab_size, 2, SEQ)
    with torch.no_grad():
        ref = hf(ids).logits
    out = ours.forward_logits(ids)
    assert out.shape == ref.shape
    assert _rel(out, ref) < 1e-4


def test_incremental_equals_full(pair):
    _, ours, _ = pair
    V = ours.config.vocab_size
    ids = _ids(V, 2, SEQ, seed=5)
    full = ours.forward_logits(ids)
    c0, c1 = ours.new_cache(), ours.new_cache()
    rows0, rows1 = [], []
    # two sequences in the same steps, different odd chunkings, then decode both together
    plan0, plan1 = [7, 13, 5], [3, 11, 9]
    p0 = p1 = 0
    for n0, n1 in zip(plan0, plan1):
        out = ours.forward_step([StepChunk(c0, ids[0, p0:p0 + n0], n0), StepChunk(c1, ids[1, p1:p1 + n1], n1)])
        rows0.append(out.logits[:n0]); rows1.append(out.logits[n0:])
        p0 += n0; p1 += n1
    while p0 < SEQ or p1 < SEQ:
        chunks, which = [], []
        if p0 < SEQ:
            chunks.append(StepChunk(c0, ids[0, p0:p0 + 1], 1)); which.append(0); p0 += 1
        if p1 < SEQ:
            chunks.append(StepChunk(c1, ids[1, p1:p1 + 1], 1)); which.append(1); p1 += 1
        out = ours.forward_step(chunks)
        for r, w in enumerate(which):
            (rows0 if w == 0 else rows1).append(out.logits[r:r + 1])
    assert c0.length == SEQ and c1.length == SEQ
    assert _rel(torch.cat(rows0), full[0]) < 1e-5
    assert _rel(torch.cat(rows1), full[1]) < 1e-5


def test_greedy_generation_matches_transformers(pair):
    hf, ours, _ = pair
    prompt = _ids(hf.config.vocab_size, 1, 19, seed=9)
    hf.generation_config.eos_token_id = None     # never stop early: compare 32 tokens
    ref = hf.generate(prompt, max_new_tokens=32, do_sample=False)[0, 19:].tolist()
    assert len(ref) == 32
    cache = ours.new_cache()
    out = ours.forward_step([StepChunk(cache, prompt[0], 1)])
    toks = []
    for _ in range(32):
        t = int(out.logits[-1].argmax())
        toks.append(t)
        out = ours.forward_step([StepChunk(cache, torch.tensor([t]), 1)])
    assert toks == ref


def test_rollback_then_redecode_is_identical(pair):
    _, ours, _ = pair
    ids = _ids(ours.config.vocab_size, 1, SEQ, seed=7)[0]
    cache = ours.new_cache()
    ours.forward_step([StepChunk(cache, ids[:25], 1)])
    ref = ours.forward_step([StepChunk(cache, ids[25:33], 8)]).logits
    # speculate garbage, roll it back, then decode the real tokens one by one
    junk = (ids[33:41] + 1) % ours.config.vocab_size
    ours.forward_step([StepChunk(cache, junk, 1)])
    cache.rollback(8)
    assert cache.length == 33
    cache.rollback(8)     # 16 tokens behind the last step: the most a cache supports
    with pytest.raises(ValueError):
        cache.rollback(1)
    rows = [ours.forward_step([StepChunk(cache, ids[p:p + 1], 1)]).logits for p in range(25, 33)]
    assert _rel(torch.cat(rows), ref) < 1e-6
    with pytest.raises(ValueError):
        cache.rollback(ours.max_rollback + 1)


def test_bf16_runs_close_to_fp32(pair):
    _, _, folder = pair
    ours16 = load_ours(folder, dtype=torch.bfloat16)
    ours32 = load_ours(folder)
    ids = _ids(ours32.config.vocab_size, 1, 24)
    a, b = ours16.forward_logits(ids), ours32.forward_logits(ids)
    assert a.dtype == torch.float32 and ours16.layers[0].attn.wq_a.weight.dtype == torch.bfloat16
    assert ours16.layers[0].hc_attn_fn.dtype == torch.float32
    assert _rel(a, b) < 0.1


def test_config_errors_name_the_field(tmp_path):
    _, folder = hf_tiny(tmp_path)
    import json
    d = json.loads((folder / "config.json").read_text())
    ModelConfig.from_dict(d)
    for key, val, word in [("bogus_key", 1, "bogus_key"), ("num_key_value_heads", 2, "num_key_value_heads"),
                           ("layer_types", ["sliding_attention"] * 2, "layer_types"),
                           ("scoring_func", "softmax", "scoring_func"), ("model_type", "llama", "model_type")]:
        bad = dict(d, **{key: val})
        with pytest.raises(ConfigError, match=word):
            ModelConfig.from_dict(bad)


def test_loader_reads_transformers_checkpoint(pair):
    # B2's loader (engine/loader.py) on the same save_pretrained folder gives the same network
    from deepinfer_sg.engine.loader import load_model
    hf, _, folder = pair
    ours = load_model(folder)
    ids = _ids(hf.config.vocab_size, 1, 30, seed=8)
    with torch.no_grad():
        ref = hf(ids).logits
    assert _rel(ours.forward_logits(ids), ref) < 1e-4


def test_bad_chunks_are_rejected_before_any_cache_changes(pair):
    _, ours, _ = pair
    cache = ours.new_cache()
    with pytest.raises(ValueError, match="token id"):
        ours.forward_step([StepChunk(cache, torch.tensor([1, ours.config.vocab_size]), 1)])
    with pytest.raises(ValueError, match="same SequenceCache"):
        ours.forward_step([StepChunk(cache, torch.tensor([1]), 1), StepChunk(cache, torch.tensor([2]), 1)])
    assert cache.length == 0 and all(lc.win is None for lc in cache.layers)


def test_deepseek_native_v4_layout_parses_like_transformers_layout(pair):
    _, ours, folder = pair
    import json
    d = json.loads((folder / "config.json").read_text())
    rates = d["compress_rates"]
    native = {k: v for k, v in d.items() if k not in ("layer_types", "compress_rates", "mlp_layer_types",
                                                      "rope_parameters", "partial_rotary_factor")}
    native["compress_ratios"] = [0 if t == "sliding_attention" else rates[t] for t in d["layer_types"]] + [0]
    native["num_hash_layers"] = d["mlp_layer_types"].count("hash_moe")
    native["compress_rate_csa"] = rates["compressed_sparse_attention"]
    comp = d["rope_parameters"]["compress"]
    if comp["rope_type"] == "yarn":
        native["rope_scaling"] = {"type": "yarn", **{k: comp[k] for k in (
            "factor", "original_max_position_embeddings", "beta_fast", "beta_slow")}}
    a, b = ModelConfig.from_dict(native), ours.config
    assert a.layers == b.layers and a.yarn == b.yarn and a.mlp_layer_types == b.mlp_layer_types
    assert a.rope_dim == b.rope_dim
