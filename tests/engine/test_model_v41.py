"""V4.1 switches of the network (spec: shared/docs/v41-flash-architecture.md).

* With every V4.1 switch at its V4 value, a V4.1-layout config gives transformers' V4 logits.
* Chunked prefill + decode == the full path on the spec's tiny V4.1 config (engram, C2/C1, sharing, candidates).
* Sharing + candidate blocks: each layer's attention output equals a direct per-layer recomputation written here
  from the spec (§2.3-§2.5), which rebuilds every layer's compressed KV, index keys, candidate blocks and top-k
  from its own source layers' inputs.
* Rollback after a rejected speculation == never having decoded the rejected tokens.
"""
import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from model_oracle import hf_tiny, load_ours, tiny_v41  # noqa: E402

from deepinfer_sg.engine.config import ConfigError, ModelConfig  # noqa: E402
from deepinfer_sg.engine.model import Model, StepChunk  # noqa: E402


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _random_model(d: dict, seed=0) -> Model:
    torch.manual_seed(seed)
    m = Model(ModelConfig.from_dict(d)).eval()
    with torch.no_grad():   # make the zero/one-initialized tensors matter
        for name, p in m.named_parameters():
            if name.endswith(("attn_sink", "_base", "gate.bias")):
                p.normal_(0, 0.5)
            elif name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(("q_weight", "k_weight")):
                p.normal_(1.0, 0.3)
            elif p.dim() == 2 and not name.endswith("_fn"):
                p.normal_(0, 1.0 / math.sqrt(p.shape[1]))
    return m


def test_v41_layout_with_v4_switches_equals_transformers(tmp_path):
    hf, folder = hf_tiny(tmp_path, seed=4)
    v4 = json.loads((folder / "config.json").read_text())
    comp = v4["compress_rates"]
    ratios = [0 if t == "sliding_attention" else comp[t] for t in v4["layer_types"]]
    csa = [i for i, t in enumerate(v4["layer_types"]) if t == "compressed_sparse_attention"]
    y = v4["rope_parameters"]["compress"]
    keep = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "q_lora_rank",
            "o_lora_rank", "o_groups", "swiglu_limit", "rms_norm_eps", "max_position_embeddings", "rope_theta",
            "compress_rope_theta", "sliding_window", "index_n_heads", "index_head_dim", "index_topk",
            "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size",
            "routed_scaling_factor", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "mlp_layer_types"]
    text = {k: v4[k] for k in keep}
    text.update(qk_rope_head_dim=v4["qk_rope_head_dim"], compress_ratios=ratios,
                rope_scaling={"type": "yarn", "factor": y["factor"], "beta_fast": y["beta_fast"],
                              "beta_slow": y["beta_slow"],
                              "original_max_position_embeddings": y["original_max_position_embeddings"]},
                kv_source_layer_ids=[i for i, r in enumerate(ratios) if r], index_source_layer_ids=csa,
                index_k_source_layer_ids=csa,
                # the V4.1 switches at their V4 values
                hc_shifted=False, use_qnorm=True, compressor_style="v4")
    (folder / "config.json").write_text(json.dumps({"model_type": "deepseek_v41", "text_config": text}))
    ours = load_ours(folder)
    assert ours.config.variant == "v41"
    ids = torch.randint(0, text["vocab_size"], (1, 37), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits
    assert _rel(ours.forward_logits(ids), ref) < 1e-4


@pytest.mark.parametrize("eps", [1e-6, 1e-20])
def test_v41_chunked_prefill_and_decode_equal_full(eps):
    m = _random_model(tiny_v41(rms_norm_eps=eps))
    assert m.layers[0].attn_norm.eps == eps and m.config.hc_shifted and not m.config.q_norm
    S = 53
    ids = torch.randint(0, 512, (2, S), generator=torch.Generator().manual_seed(1))
    full = m.forward_logits(ids)
    a, b = m.new_cache(), m.new_cache()
    out = m.forward_step([StepChunk(a, ids[0, :23], 23), StepChunk(b, ids[1, :17], 17)])
    got_a, got_b = [out.logits[:23]], [out.logits[23:]]
    assert out.draft_features.shape == (40, 2 * 64)
    out = m.forward_step([StepChunk(a, ids[0, 23:40], 17), StepChunk(b, ids[1, 17:40], 23)])
    got_a.append(out.logits[:17]); got_b.append(out.logits[17:])
    for p in range(40, S):
        out = m.forward_step([StepChunk(a, ids[0, p:p + 1], 1), StepChunk(b, ids[1, p:p + 1], 1)])
        got_a.append(out.logits[:1]); got_b.append(out.logits[1:])
    assert _rel(torch.cat(got_a), full[0]) < 1e-5
    assert _rel(torch.cat(got_b), full[1]) < 1e-5


def test_v41_rollback_after_speculation_equals_clean_decode():
    m = _random_model(tiny_v41(), seed=3)
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(4))
    spec, clean = m.new_cache(), m.new_cache()
    m.forward_step([StepChunk(spec, ids[:31], 1)])
    m.forward_step([StepChunk(clean, ids[:31], 1)])
    # verify rows [g, d1, d2, d3, d4]: d1 accepted, d2.. rejected (3 tokens rolled back)
    draft = torch.cat([ids[31:33], (ids[33:36] + 7) % 512])
    m.forward_step([StepChunk(spec, draft, 5)])
    spec.rollback(3)
    m.forward_step([StepChunk(clean, ids[31:33], 1)])
    assert spec.length == clean.length == 33
    for p in range(33, 40):
        x = m.forward_step([StepChunk(spec, ids[p:p + 1], 1)]).logits
        y = m.forward_step([StepChunk(clean, ids[p:p + 1], 1)]).logits
        assert _rel(x, y) < 1e-5


def test_v41_topology_errors():
    with pytest.raises(ConfigError, match="kv source"):
        ModelConfig.from_dict(tiny_v41(kv_source_layer_ids=[3, 4]))
    with pytest.raises(ConfigError, match="ratio"):
        ModelConfig.from_dict(tiny_v41(kv_source_layer_ids=[2, 5]))
    with pytest.raises(ConfigError, match="candidate_source_layer_id"):
        ModelConfig.from_dict(tiny_v41(candidate_source_layer_id=3))
    with pytest.raises(ConfigError, match="index-K source"):
        ModelConfig.from_dict(tiny_v41(kv_source_layer_ids=[2, 3, 4], index_source_layer_ids=[2, 3, 4],
                                       index_k_source_layer_ids=[2, 4]))
    with pytest.raises(ConfigError, match="compress_ratios"):
        ModelConfig.from_dict(tiny_v41(compress_ratios=[0, 0, 2]))
    with pytest.raises(ConfigError, match="dspark_target_attn_input"):
        ModelConfig.from_dict(tiny_v41(dspark_target_attn_input=False))
    with pytest.raises(ConfigError, match="unknown"):
        ModelConfig.from_dict(tiny_v41(hc_shifted_typo=True))


# ----------------------------------------------------------------------------------------------------------
# Direct per-layer recomputation from the spec
# ----------------------------------------------------------------------------------------------------------

def _rms(x, w, eps):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 if w is None else w.double())


def _freqs(c: ModelConfig, compressed: bool):
    R = c.rope_dim
    base = c.compress_rope_theta if compressed else c.rope_theta
    f = [base ** (-2 * i / R) for i in range(R // 2)]
    if compressed and c.yarn is not None:   # spec §2.3 YaRN
        y = c.yarn
        low = max(math.floor(R * math.log(y.original_max_position_embeddings / (y.beta_fast * 2 * math.pi))
                             / (2 * math.log(base))), 0)
        high = min(math.ceil(R * math.log(y.original_max_position_embeddings / (y.beta_slow * 2 * math.pi))
                             / (2 * math.log(base))), R - 1)
        if low == high:
            high += 0.001
        ramp = [min(max((i - low) / (high - low), 0), 1) for i in range(R // 2)]
        f = [fi / y.factor * r + fi * (1 - r) for fi, r in zip(f, ramp)]
    return torch.tensor(f, dtype=torch.float64)


def _rope(x, pos, freqs, sign=1.0):
    """Rotate the last 2*len(freqs) dims of x [..., D] (interleaved pairs) by sign * pos * freqs."""
    R = 2 * len(freqs)
    head, tail = x[..., :-R], x[..., -R:]
    z = torch.view_as_complex(tail.double().reshape(*tail.shape[:-1], R // 2, 2).contiguous())
    ang = sign * float(pos) * freqs
    z = z * torch.polar(torch.ones_like(ang), ang)
    return torch.cat([head.double(), torch.view_as_real(z).reshape(tail.shape)], dim=-1)


def _capture(m: Model, ids: torch.Tensor):
    """Attention inputs (after attn_norm) and attention outputs of every layer, from one full forward."""
    xs, ys, hooks = {}, {}, []
    for i, blk in enumerate(m.layers):
        hooks.append(blk.attn_norm.register_forward_hook(lambda mod, a, out, i=i: xs.__setitem__(i, out)))
        hooks.append(blk.attn.wo_b.register_forward_hook(lambda mod, a, out, i=i: ys.__setitem__(i, out)))
    m.forward_logits(ids[None])
    for h in hooks:
        h.remove()
    return xs, ys


def _reference_attention(m: Model, xs: dict, layer: int) -> torch.Tensor:
    """One layer's attention output for every position, recomputed from the spec with the config's maps."""
    c = m.config
    sd = {k: v.double() for k, v in m.state_dict().items() if v.is_floating_point()}
    eps, W, R, D, nh = c.rms_norm_eps, c.sliding_window, c.rope_dim, c.head_dim, c.num_heads
    ratio = c.compress_ratios[layer]
    T = xs[layer].shape[0]

    def src(ids):   # nearest source at or before `layer` (spec §1.3 shared topology)
        return max(s for s in ids if s <= layer)

    def P(n, name):
        return sd[f"layers.{n}.attn.{name}"]

    x = xs[layer].double()
    fr = _freqs(c, ratio > 0)
    qr = _rms(x @ P(layer, "wq_a.weight").T, P(layer, "q_norm.weight"), eps)
    q = (qr @ P(layer, "wq_b.weight").T).view(T, nh, D)
    kv = _rms(x @ P(layer, "wkv.weight").T, P(layer, "kv_norm.weight"), eps)
    q = torch.stack([_rope(q[t], t, fr) for t in range(T)])
    kv = torch.stack([_rope(kv[t], t, fr) for t in range(T)])
    selected = [[] for _ in range(T)]
    entries = None
    if ratio > 0:
        kvs = src(c.kv_source_layer_ids)
        xk = xs[kvs].double()
        cc = xk @ P(kvs, "compressor.wkv.weight").T
        G = T // ratio
        if ratio == 2:
            s = xk @ P(kvs, "compressor.wgate.weight").T
            pooled = torch.stack([(F.softmax(s[2 * g:2 * g + 2], dim=0) * cc[2 * g:2 * g + 2]).sum(0)
                                  for g in range(G)])
        else:
            pooled = cc[:G]
        u = _rms(pooled, P(kvs, "compressor.norm.weight"), eps)
        entries = torch.stack([_rope(u[g], g * ratio, fr) for g in range(G)])
        # index source (same ratio), its index-K source, candidate blocks
        isrc = src([s for s in c.index_source_layer_ids if c.compress_ratios[s] == ratio])
        ksrc = max(s for s in (c.index_k_source_layer_ids or c.kv_source_layer_ids) if s <= isrc)
        ik = _rms(u @ P(ksrc, "indexer.wk.weight").T, P(ksrc, "indexer.k_norm.weight"), eps)
        ik = torch.stack([_rope(ik[g], g * ratio, fr) for g in range(G)])

        def scores_of(n):
            xn = xs[n].double()
            qn = _rms(xn @ P(n, "wq_a.weight").T, P(n, "q_norm.weight"), eps)
            iq = (qn @ P(n, "indexer.wq_b.weight").T).view(T, c.index_n_heads, c.index_head_dim)
            w = xn @ P(n, "indexer.weights_proj.weight").T
            out = []
            for t in range(T):
                iqt = _rope(iq[t], t, fr)
                dots = F.relu(iqt @ ik.T) * c.index_head_dim ** -0.5          # [Hi, G]
                out.append((w[t, :, None] * c.index_n_heads ** -0.5 * dots).sum(0))
            return out

        cand = None
        cs = c.candidate_source_layer_id
        if cs is not None and isrc > cs and c.compress_ratios[cs] == ratio:
            cand = []
            for t, sc in enumerate(scores_of(cs)):
                nvis = (t + 1) // ratio
                bs = c.candidate_block_size
                blocks = [(float("inf") if b == (nvis - 1) // bs else max(sc[g].item() for g in range(b * bs, min(nvis, (b + 1) * bs))), b)
                          for b in range((nvis + bs - 1) // bs)]
                keep = sorted(blocks, key=lambda v: (-v[0], v[1]))[:c.candidate_topk_blocks]
                cand.append({g for _, b in keep for g in range(b * bs, min(nvis, (b + 1) * bs))})
        for t, sc in enumerate(scores_of(isrc)):
            nvis = (t + 1) // ratio
            allowed = [g for g in range(nvis) if cand is None or g in cand[t]]
            best = sorted(allowed, key=lambda g: (-sc[g].item(), g))[:c.index_topk]
            selected[t] = best
    sink = sd[f"layers.{layer}.attn.attn_sink"]
    outs = []
    for t in range(T):
        keys = [kv[j] for j in range(max(0, t - W + 1), t + 1)] + [entries[g] for g in selected[t]]
        K = torch.stack(keys)
        logits = q[t] @ K.T * D ** -0.5                                    # [nh, S]
        full = torch.cat([logits, sink[:, None]], dim=1)
        p = torch.softmax(full, dim=1)[:, :-1]
        o = p @ K                                                          # [nh, D]
        outs.append(_rope(o, t, fr, sign=-1.0))
    o = torch.stack(outs)                                                  # [T, nh, D]
    Gs = c.o_groups
    wa = P(layer, "wo_a.weight").view(Gs, c.o_lora_rank, -1)
    u = torch.einsum("tgi,goi->tgo", o.reshape(T, Gs, -1), wa).reshape(T, -1)
    return u @ P(layer, "wo_b.weight").T


@pytest.mark.parametrize("overrides", [
    {},                                                                    # spec tiny config: candidates bite
    {"index_source_layer_ids": [2, 4], "candidate_source_layer_id": None, "index_topk": 3},   # plain sharing
    {"kv_source_layer_ids": [2, 4], "index_source_layer_ids": [2, 3, 4, 6],
     "index_k_source_layer_ids": [2, 4], "candidate_topk_blocks": 3},
])
def test_sharing_and_candidate_blocks_match_direct_recomputation(overrides):
    d = tiny_v41(engram_layer_ids=[], num_nextn_predict_layers=0, dspark_target_layer_ids=[],
                 compress_ratios=[0, 0, 2, 2, 1, 1, 1], **overrides)  # a None override removes the key
    m = _random_model(d, seed=5)
    T = 61    # C1: 61 entries > 8 candidate blocks x 2 > top-k; C2: 30 entries > top-k
    ids = torch.randint(0, 512, (T,), generator=torch.Generator().manual_seed(6))
    xs, ys = _capture(m, ids)
    for layer in range(m.config.num_layers):
        ref = _reference_attention(m, xs, layer)
        assert _rel(ys[layer].double(), ref) < 1e-5, f"layer {layer}"


def test_quantization_simulation_switch():
    m = _random_model(tiny_v41(), seed=8)
    ids = torch.randint(0, 512, (1, 45), generator=torch.Generator().manual_seed(9))
    plain = m.forward_logits(ids)
    m.quant_sim = True
    full = m.forward_logits(ids)
    assert not torch.allclose(full, plain)          # the switch changes the math
    cache = m.new_cache()
    rows = [m.forward_step([StepChunk(cache, ids[0, :29], 29)]).logits]
    rows += [m.forward_step([StepChunk(cache, ids[0, p:p + 1], 1)]).logits for p in range(29, 45)]
    assert _rel(torch.cat(rows), full[0]) < 1e-5    # stored and fresh keys see the same quantized values
    # what the caches hold lies on the spec's grids (§5.4): re-quantizing changes nothing
    from deepinfer_sg.engine.quant import qdq_fp4_e4m3, qdq_fp4_ue8m0, qdq_fp8_ue8m0
    lc2, lc4 = cache.layers[2], cache.layers[4]
    assert torch.equal(qdq_fp8_ue8m0(lc2.win, 32).to(lc2.win.dtype), lc2.win)
    assert torch.equal(qdq_fp4_e4m3(lc4.comp.entries, 16).to(torch.float32), lc4.comp.entries)
    assert torch.equal(qdq_fp4_ue8m0(lc4.ikeys, 32).to(torch.float32), lc4.ikeys)
    assert not torch.equal(qdq_fp4_e4m3(lc2.win, 16).to(torch.float32), lc2.win)   # (the check can fail)
    # activations entering FP8-weight linears are on the FP8 grid
    seen = []
    h = m.layers[3].attn.wq_a.register_forward_pre_hook(lambda mod, a: seen.append(a[0]))
    h2 = m.layers[3].ffn.shared_experts.w2.register_forward_pre_hook(lambda mod, a: seen.append(a[0]))
    m.forward_logits(ids[:, :9])
    h.remove(); h2.remove()
    assert len(seen) == 2 and all(torch.equal(qdq_fp8_ue8m0(x, 32).to(x.dtype), x) for x in seen)
    m.quant_sim = False
    assert torch.equal(m.forward_logits(ids), plain)


def _run(m, ids, plan, logit_rows, decode):
    cache, out = m.new_cache(), []
    p = 0
    for n in plan:
        o = m.forward_step([StepChunk(cache, ids[p:p + n], min(logit_rows, n))])
        out.append(o.logits); p += n
    for t in range(decode):
        out.append(m.forward_step([StepChunk(cache, ids[p:p + 1], 1)]).logits); p += 1
    return out


def test_yoco_mask_equals_compact_on_kept_rows():
    m = _random_model(tiny_v41(), seed=12)
    assert m.config.n_prefill_layer == 4
    keep = m.config.sliding_window + m.max_rollback          # 24, the smallest allowed
    ids = torch.randint(0, 512, (70,), generator=torch.Generator().manual_seed(13))
    with pytest.raises(ValueError, match="keep"):
        m.set_yoco("mask", keep - 1)
    results = {}
    for mode in ("off", "mask", "compact"):
        m.set_yoco(mode, keep)
        results[mode] = {"one": _run(m, ids, [60], keep, 6), "chunked": _run(m, ids, [23, 37], keep, 6)}
    m.set_yoco("off")
    for how in ("one", "chunked"):
        mask, compact, off = (torch.cat(results[k][how]) for k in ("mask", "compact", "off"))
        assert _rel(compact, mask) < 1e-5, how
        # the first kept rows lose their window in the decoder layers: truncation changes them vs `off`
        assert _rel(results["mask"][how][-7][:1], results["off"][how][-7][:1]) > 1e-3
    with pytest.raises(ValueError, match="logit_rows"):
        m.set_yoco("compact", keep)
        m.forward_step([StepChunk(m.new_cache(), ids[:40], keep + 1)])


def test_real_v41_flash_layer_roles_match_spec_table():
    # spec §1.2 values of the real V4.1-Flash text_config; expected roles from the table in spec §1.4
    d = tiny_v41(num_hidden_layers=40, num_nextn_predict_layers=3,
                 compress_ratios=[0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
                 kv_source_layer_ids=[2, 8, 14, 20], index_source_layer_ids=[2, 8, 14, 20, 24, 28, 32, 36],
                 candidate_source_layer_id=20, candidate_topk_blocks=2048, candidate_block_size=8,
                 engram_layer_ids=[1, 14], dspark_target_layer_ids=[37, 38, 39], rms_norm_eps=1e-20)
    c = ModelConfig.from_dict(d)
    assert c.n_prefill_layer == 20 and c.rms_norm_eps == 1e-20
    roles = {i: (s.ratio, s.kv_source, s.index_source, s.index_k_source, s.candidate_source, s.rope)
             for i, s in enumerate(c.layers)}
    assert roles[0] == roles[1] == (0, None, None, None, None, "main")
    for i in range(2, 20):
        src = 2 + 6 * ((i - 2) // 6)
        assert roles[i] == (2, src, src, src, None, "compress"), i
    assert roles[20] == (1, 20, 20, 20, None, "compress")
    for i in range(21, 24):
        assert roles[i] == (1, 20, 20, 20, None, "compress"), i
    for i in range(24, 40):
        src = 24 + 4 * ((i - 24) // 4)
        assert roles[i] == (1, 20, src, 20, 20 if i == src else None, "compress"), i
