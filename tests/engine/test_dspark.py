"""DSpark draft layers (spec §4): parameter names, the drafter's key set, the sequential Markov loop and the
confidence head. Expected values are recomputed here from the spec (a direct implementation of §4 on the
model's parameters), or checked by perturbation (what a step may and may not depend on)."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from deepinfer_sg.engine import dspark
from deepinfer_sg.engine.config import ModelConfig
from deepinfer_sg.engine.mhc import hc_mixes
from deepinfer_sg.engine.model import Model, StepChunk
from deepinfer_sg.engine.testing import tiny_v41_config

TINY = tiny_v41_config()  # v41-flash-architecture.md §6.1
V, H, W, NOISE = 512, 64, 8, 511


def init_params(model: Model, seed: int) -> None:
    """Deterministic weights with healthy scales (norm weights near 1, matrices ~ 1/sqrt(fan_in))."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * r)
            elif name.endswith("_scale") or name.endswith("_base") or name.endswith("attn_sink"):
                p.copy_(0.5 * r)
            elif name.endswith("gate.bias"):
                p.copy_(0.1 * r)
            elif p.ndim == 2:
                p.copy_(r / math.sqrt(p.shape[1]))
            else:
                p.copy_(r)


@pytest.fixture(scope="module")
def model() -> Model:
    torch.manual_seed(0)
    m = Model(ModelConfig.from_dict(TINY)).eval()
    init_params(m, 1)
    return m


def prefill(model: Model, tokens: list[int], chunk_sizes=None):
    """Run the tokens through the target (in chunks), feeding the drafter after every step; return the cache
    and every step's draft features (for the reference computation)."""
    cache = model.new_cache()
    feats = []
    sizes = chunk_sizes or [len(tokens)]
    at = 0
    for n in sizes:
        chunks = [StepChunk(cache, torch.tensor(tokens[at:at + n]), 1)]
        out = model.forward_step(chunks)
        dspark.update_draft_keys(model, chunks, out.draft_features)
        feats.append(out.draft_features)
        at += n
    return cache, torch.cat(feats)


PROMPT = [(7 * i + 3) % 500 for i in range(20)]


@pytest.fixture(scope="module")
def base(model):
    """(cache, features) after PROMPT; tests only read it (drafting does not change the cache)."""
    return prefill(model, PROMPT)


# ------------------------------------------------------------------------------------------------
# Parameters
# ------------------------------------------------------------------------------------------------


def test_draft_parameters_follow_deepseek_names(model):
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items() if k.startswith("mtp.")}
    expected = {
        "mtp.0.main_proj.weight": (H, 2 * H), "mtp.0.main_norm.weight": (H,),
        "mtp.1.norm.weight": (H,), "mtp.1.markov_head.embed.weight": (V, 16),
        "mtp.1.markov_head.head.weight": (V, 16), "mtp.1.confidence_head.proj.weight": (1, H + 16),
    }
    for i in (0, 1):
        expected.update({
            f"mtp.{i}.hc_attn_fn": (24, 4 * H), f"mtp.{i}.hc_ffn_base": (24,), f"mtp.{i}.hc_attn_scale": (3,),
            f"mtp.{i}.attn_norm.weight": (H,), f"mtp.{i}.ffn_norm.weight": (H,),
            f"mtp.{i}.attn.wq_a.weight": (32, H), f"mtp.{i}.attn.wq_b.weight": (4 * 64, 32),
            f"mtp.{i}.attn.wkv.weight": (64, H), f"mtp.{i}.attn.kv_norm.weight": (64,),
            f"mtp.{i}.attn.wo_a.weight": (2 * 32, 2 * 64), f"mtp.{i}.attn.wo_b.weight": (H, 2 * 32),
            f"mtp.{i}.attn.attn_sink": (4,), f"mtp.{i}.ffn.gate.weight": (4, H), f"mtp.{i}.ffn.gate.bias": (4,),
            f"mtp.{i}.ffn.experts.3.w1.weight": (32, H), f"mtp.{i}.ffn.shared_experts.w2.weight": (H, 32),
        })
    for name, shape in expected.items():
        assert shapes.get(name) == shape, name
    # sliding-window only, 4 experts, extras only where the spec puts them, embed/head tied to the backbone
    forbidden = ("compressor", "indexer", "engram", "experts.4.", "mtp.1.main_proj", "mtp.0.norm.weight",
                 "mtp.0.markov_head", "mtp.0.confidence_head", "mtp.0.embed", "mtp.0.head", "mtp.1.head.weight")
    assert not [k for k in shapes if any(f in k for f in forbidden)]


def test_draft_parameters_stay_fp32_where_deepseek_ships_f32():
    m = Model(ModelConfig.from_dict(TINY), dtype=torch.bfloat16)
    sd = m.state_dict()
    assert sd["mtp.0.hc_attn_fn"].dtype == torch.float32 and sd["mtp.1.attn.attn_sink"].dtype == torch.float32
    assert sd["mtp.1.markov_head.embed.weight"].dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------------
# The backbone, against a direct implementation of spec §4
# ------------------------------------------------------------------------------------------------


def rms(x, w, eps=1e-6):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope(x, pos, rdim=16, base=10000.0, inverse=False):
    """Interleaved-pair rotation of the last rdim channels at integer positions."""
    freqs = base ** (-torch.arange(0, rdim, 2, dtype=torch.float64) / rdim)
    ang = pos.double()[:, None] * freqs * (-1 if inverse else 1)
    while ang.dim() < x.dim():
        ang = ang.unsqueeze(-2)
    out = x.clone()
    a, b = x[..., -rdim::2], x[..., -rdim + 1::2]
    out[..., -rdim::2] = a * ang.cos() - b * ang.sin()
    out[..., -rdim + 1::2] = a * ang.sin() + b * ang.cos()
    return out


def reference_backbone(model: Model, feats: torch.Tensor, golden: int, n: int):
    """Spec §4 for one sequence whose features cover positions 0..L-1, in float64."""
    sd = {k: v.double() for k, v in model.state_dict().items()}
    L = feats.shape[0]
    ctx_pos, pos = torch.arange(L), torch.arange(L, L + n)
    main_hidden = rms(feats.double() @ sd["mtp.0.main_proj.weight"].t(), sd["mtp.0.main_norm.weight"])
    tokens = torch.tensor([golden] + [NOISE] * (n - 1))
    R = sd["embed.weight"][tokens].unsqueeze(1).repeat(1, 4, 1)
    a = torch.zeros(n, 4, dtype=torch.float64)
    a[:, 0] = 1
    for i, layer in enumerate(model.mtp):
        p = f"mtp.{i}."
        main_keys = rope(rms(main_hidden @ sd[p + "attn.wkv.weight"].t(), sd[p + "attn.kv_norm.weight"]), ctx_pos)
        # attention sub-layer (shifted mHC: read with the previous pre-mix)
        pre_a, post_a, comb_a = (t.double() for t in hc_mixes(R, sd[p + "hc_attn_fn"], sd[p + "hc_attn_base"],
                                                                sd[p + "hc_attn_scale"], eps=1e-6, hc_eps=1e-6, iters=20))
        x = rms((a[..., None] * R).sum(1), sd[p + "attn_norm.weight"])
        q = rms(x @ sd[p + "attn.wq_a.weight"].t(), sd[p + "attn.q_norm.weight"]) @ sd[p + "attn.wq_b.weight"].t()
        q = rope(q.view(n, 4, 64), pos)
        own = rope(rms(x @ sd[p + "attn.wkv.weight"].t(), sd[p + "attn.kv_norm.weight"]), pos)
        keys = torch.cat([main_keys[max(0, L - W):], own])          # W main keys <= p, all n draft keys
        s = torch.einsum("nhd,kd->nhk", q, keys) / 8.0
        sink = sd[p + "attn.attn_sink"].view(1, 4, 1).expand(n, 4, 1)
        prob = torch.softmax(torch.cat([s, sink], -1), -1)[..., :-1]
        o = rope(torch.einsum("nhk,kd->nhd", prob, keys), pos, inverse=True)
        wo_a = sd[p + "attn.wo_a.weight"].view(2, 32, 128)
        y = torch.einsum("ngi,goi->ngo", o.reshape(n, 2, 128), wo_a).reshape(n, 64) @ sd[p + "attn.wo_b.weight"].t()
        R = post_a[..., None] * y[:, None] + torch.einsum("njk,njh->nkh", comb_a, R)
        a = pre_a
        # MoE sub-layer (the MoE itself is the backbone's module, checked by its own tests)
        pre_f, post_f, comb_f = (t.double() for t in hc_mixes(R, sd[p + "hc_ffn_fn"], sd[p + "hc_ffn_base"],
                                                                sd[p + "hc_ffn_scale"], eps=1e-6, hc_eps=1e-6, iters=20))
        x = rms((a[..., None] * R).sum(1), sd[p + "ffn_norm.weight"])
        ffn = copy.deepcopy(layer.ffn).double()
        y = ffn(x, tokens)
        R = post_f[..., None] * y[:, None] + torch.einsum("njk,njh->nkh", comb_f, R)
        a = pre_f
    h_pre = (a[..., None] * R).sum(1)
    base = rms(h_pre, sd["mtp.1.norm.weight"]) @ sd["head.weight"].t()
    return h_pre, base


@pytest.mark.parametrize("sizes", [None, [9, 8, 3]])
def test_backbone_matches_spec(model, base, sizes):
    cache, feats = prefill(model, PROMPT, sizes) if sizes else base
    bb = dspark.draft_backbone(model, [cache], torch.tensor([42]), 3)
    h_ref, base_ref = reference_backbone(model, feats, 42, 3)
    torch.testing.assert_close(bb.h_pre[0].double(), h_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(bb.base_logits[0].double(), base_ref, rtol=1e-4, atol=1e-4)


def test_only_the_last_window_of_main_keys_matters(model, base):
    cache, feats = base
    logits = dspark.draft_backbone(model, [cache], torch.tensor([42]), 3).base_logits

    def with_features(changed_rows):
        f = feats.clone()
        f[changed_rows] += 3.0
        c = model.new_cache()
        c.length = len(PROMPT)
        dspark.update_draft_keys(model, [StepChunk(c, torch.tensor(PROMPT), 1)], f)
        return dspark.draft_backbone(model, [c], torch.tensor([42]), 3).base_logits

    assert torch.equal(with_features(slice(0, len(PROMPT) - W)), logits)     # older than the window: no effect
    assert not torch.allclose(with_features(slice(len(PROMPT) - 1, None)), logits)  # the last main key: effect


def test_draft_slots_see_each_other_non_causally(model, base):
    cache, _ = base
    three = dspark.draft_backbone(model, [cache], torch.tensor([42]), 3).h_pre
    two = dspark.draft_backbone(model, [cache], torch.tensor([42]), 2).h_pre
    # slot 0 attends the later noise slots too, so the block length changes it
    assert not torch.allclose(three[0, 0], two[0, 0])


def test_batched_drafting_equals_one_sequence_at_a_time(model, base):
    c1, _ = base
    c2, _ = prefill(model, PROMPT[:11] + [9, 9, 9])
    both = dspark.draft_backbone(model, [c1, c2], torch.tensor([42, 7]), 3)
    one = dspark.draft_backbone(model, [c1], torch.tensor([42]), 3)
    two = dspark.draft_backbone(model, [c2], torch.tensor([7]), 3)
    torch.testing.assert_close(both.base_logits, torch.cat([one.base_logits, two.base_logits]), rtol=1e-5, atol=1e-5)


def test_rollback_forgets_main_keys_like_never_decoding(model):
    committed = PROMPT[:15]
    cache, _ = prefill(model, committed + [100, 101, 102, 103], [15, 4])   # 4 speculative rows
    cache.rollback(4)
    fresh, _ = prefill(model, committed)
    assert cache.drafter.end == fresh.drafter.end == 15
    a = dspark.draft_backbone(model, [cache], torch.tensor([42]), 3).base_logits
    b = dspark.draft_backbone(model, [fresh], torch.tensor([42]), 3).base_logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_drafting_without_main_keys_is_a_clear_error(model):
    with pytest.raises(RuntimeError, match="update_draft_keys"):
        dspark.draft(model, [model.new_cache()], torch.tensor([1]), dspark.greedy_sampler)
    cache, _ = prefill(model, PROMPT[:6])
    model.forward_step([StepChunk(cache, torch.tensor([5]), 1)])   # forgot to update the drafter
    with pytest.raises(RuntimeError, match="update_draft_keys"):
        dspark.draft(model, [cache], torch.tensor([1]), dspark.greedy_sampler)


# ------------------------------------------------------------------------------------------------
# The Markov loop and the confidence head
# ------------------------------------------------------------------------------------------------


class Recorder:
    """A sampler that records the logits it is shown; draws from softmax(logits / 0.8), or forces tokens."""

    def __init__(self, forced=None, seed=0):
        self.forced = forced or {}
        self.logits, self.returned = [], []
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, logits, step):
        self.logits.append(logits.clone())
        if step in self.forced:
            tok = torch.tensor(self.forced[step])
            p = torch.nn.functional.one_hot(tok, logits.shape[-1]).float()
        else:
            p = torch.softmax(logits / 0.8, -1)
            top = p.topk(50, dim=-1)   # a processed distribution (top-k), as an engine would store it
            p = torch.zeros_like(p).scatter_(-1, top.indices, top.values)
            p = p / p.sum(-1, keepdim=True)
            tok = torch.multinomial(p, 1, generator=self.gen).squeeze(-1)
        self.returned.append((tok, p))
        return tok, p


def test_step_i_depends_only_on_tokens_before_i(model, base):
    cache, _ = base
    golden = torch.tensor([42])
    bb = dspark.draft_backbone(model, [cache], golden, 4)
    markov = model.mtp[-1].markov_head
    base_run = Recorder(seed=1)
    r0 = dspark.markov_draft(model, bb, golden, base_run)
    for j in range(3):
        other = (int(r0.tokens[0, j]) + 17) % V
        forced = {i: [int(r0.tokens[0, i])] for i in range(j)}   # same history before j, a different token at j
        forced[j] = [other]
        pert = Recorder(forced=forced, seed=2)
        dspark.markov_draft(model, bb, golden, pert)
        for i in range(j + 1):   # steps up to j saw the same history
            assert torch.equal(pert.logits[i], base_run.logits[i])
        # step j+1 differs exactly by the Markov bias of the changed previous token
        e = markov.embed.weight.double()
        delta = (e[other] - e[int(r0.tokens[0, j])]) @ markov.head.weight.double().t()
        torch.testing.assert_close((pert.logits[j + 1] - base_run.logits[j + 1])[0].double(), delta, rtol=1e-4, atol=1e-4)


def test_first_step_uses_the_golden_token_as_previous(model, base):
    cache, _ = base
    bb = dspark.draft_backbone(model, [cache], torch.tensor([42]), 2)
    rec = Recorder()
    dspark.markov_draft(model, bb, torch.tensor([42]), rec)
    mk = model.mtp[-1].markov_head
    expected = bb.base_logits[0, 0].double() + mk.embed.weight[42].double() @ mk.head.weight.double().t()
    torch.testing.assert_close(rec.logits[0][0].double(), expected, rtol=1e-5, atol=1e-5)


def test_probs_are_exactly_the_distributions_sampled_from(model, base):
    c1, _ = base
    c2, _ = prefill(model, PROMPT[:12])
    rec = Recorder(forced={1: [3, 4]}, seed=5)
    r = dspark.draft(model, [c1, c2], torch.tensor([42, 43]), rec, n=3)
    assert r.tokens.shape == (2, 3) and r.probs.shape == (2, 3, V) and r.confidences.shape == (2, 3)
    for i, (tok, p) in enumerate(rec.returned):
        assert torch.equal(r.tokens[:, i], tok)
        assert torch.equal(r.probs[:, i], p)
    assert r.tokens[:, 1].tolist() == [3, 4]


def test_confidences_follow_the_head(model, base):
    cache, _ = base
    golden = torch.tensor([42])
    bb = dspark.draft_backbone(model, [cache], golden, 3)
    temps = [1.0, 0.5, 2.0]
    r = dspark.markov_draft(model, bb, golden, dspark.greedy_sampler, conf_temperature=temps)
    w = model.mtp[-1].confidence_head.proj.weight.detach().double()[0]
    emb = model.mtp[-1].markov_head.embed.weight.detach().double()
    prev = [42] + r.tokens[0, :2].tolist()
    for i in range(3):
        z = float(torch.cat([bb.h_pre[0, i].double(), emb[prev[i]]]) @ w.detach()) / temps[i]
        expected = 1 / (1 + math.exp(-max(-60.0, min(60.0, z))))
        assert abs(float(r.confidences[0, i]) - expected) < 1e-5


def test_greedy_drafts_are_argmax_of_the_markov_logits(model, base):
    cache, _ = base
    r = dspark.draft(model, [cache], torch.tensor([42]), dspark.greedy_sampler, n=3)
    mk = model.mtp[-1].markov_head
    prev = 42
    for i in range(3):
        logits = r.backbone.base_logits[0, i] + mk.embed.weight[prev] @ mk.head.weight.t()
        assert int(r.tokens[0, i]) == int(logits.argmax())
        prev = int(r.tokens[0, i])
    assert torch.equal(r.probs.sum(-1), torch.ones(1, 3))


def test_quantization_simulation_stores_fp8_main_keys(model):
    from deepinfer_sg.engine.quant import qdq_fp8_ue8m0

    model.quant_sim = True
    try:
        cache, _ = prefill(model, PROMPT[:10])
        r = dspark.draft(model, [cache], torch.tensor([42]), dspark.greedy_sampler, n=2)
    finally:
        model.quant_sim = False
    keys = cache.drafter.keys[0]
    assert torch.equal(qdq_fp8_ue8m0(keys, 32), keys)   # already on the FP8 grid
    assert r.tokens.shape == (1, 2)


def test_requests_whose_block_ended_may_return_minus_one(model, base):
    c1, _ = base
    c2, _ = prefill(model, PROMPT[:9])

    def sample(logits, step):   # request 1's block ends after its first draft
        tok = logits.argmax(-1)
        if step >= 1:
            tok[1] = -1
        return tok, None

    r = dspark.draft(model, [c1, c2], torch.tensor([42, 43]), sample, n=3)
    assert r.tokens[1, 1:].tolist() == [-1, -1] and r.tokens[0].min() >= 0
    greedy = dspark.draft(model, [c1], torch.tensor([42]), dspark.greedy_sampler, n=3)
    assert torch.equal(r.tokens[0], greedy.tokens[0])   # the other request is unaffected


def test_greedy_speculation_with_the_drafter_reproduces_greedy_decoding(model):
    """Draft -> verify [g, d_1..d_n] in one target step -> keep the agreeing prefix -> roll back the rest ->
    feed the drafter the verified rows. Under greedy decoding the output must equal plain greedy decoding,
    whatever the drafts were (this exercises the drafter's key ring across verification and rollback)."""
    steps = 14
    plain = model.new_cache()
    out = model.forward_step([StepChunk(plain, torch.tensor(PROMPT[:10]), 1)])
    expected = [int(out.logits[-1].argmax())]
    while len(expected) < steps + 3:
        out = model.forward_step([StepChunk(plain, torch.tensor(expected[-1:]), 1)])
        expected.append(int(out.logits[-1].argmax()))

    cache, _ = prefill(model, PROMPT[:10])
    out_tokens = [expected[0]]
    accepted = []
    rnd = 0
    while len(out_tokens) < steps:
        golden = out_tokens[-1]
        at = len(out_tokens)
        rnd += 1
        # round kinds: the drafter's own greedy drafts; oracle drafts (all accepted); oracle drafts with a wrong
        # third token (two accepted)
        oracle = expected[at:at + 3] + [0] * 3

        def sample(logits, step, kind=rnd % 3):
            if kind == 0:
                return dspark.greedy_sampler(logits, step)
            tok = oracle[step] if not (kind == 2 and step == 2) else (oracle[step] + 1) % V
            return torch.tensor([tok]), None

        drafts = dspark.draft(model, [cache], torch.tensor([golden]), sample, n=3).tokens[0].tolist()
        chunks = [StepChunk(cache, torch.tensor([golden] + drafts), 4)]
        out = model.forward_step(chunks)
        dspark.update_draft_keys(model, chunks, out.draft_features)
        target = out.logits.argmax(-1).tolist()          # the target's choice after g, d_1, d_2, d_3
        k = 0
        while k < 3 and drafts[k] == target[k]:
            k += 1
        accepted.append(k)
        out_tokens += drafts[:k] + [target[k]]
        cache.rollback(3 - k)                             # forget the rejected drafts' rows
        assert cache.drafter.end == cache.length
    assert out_tokens[:steps] == expected[:steps]
    assert 3 in accepted and 2 in accepted               # full and partial acceptance both happened


def test_bf16_model_drafts():
    m = Model(ModelConfig.from_dict(TINY), dtype=torch.bfloat16).eval()
    init_params(m, 2)
    m.set_dtype(torch.bfloat16)
    cache, _ = prefill(m, PROMPT[:9])
    r = dspark.draft(m, [cache], torch.tensor([42]), dspark.temperature_sampler(1.0, torch.Generator().manual_seed(0)))
    assert r.tokens.shape == (1, 3) and r.probs.dtype == torch.float32
    assert torch.isfinite(r.confidences).all() and torch.allclose(r.probs.sum(-1), torch.ones(1, 3))


def test_update_draft_keys_is_idempotent(model):
    cache = model.new_cache()
    chunks = [StepChunk(cache, torch.tensor(PROMPT[:12]), 1)]
    out = model.forward_step(chunks)
    dspark.update_draft_keys(model, chunks, out.draft_features)
    once = [k.clone() for k in cache.drafter.keys]
    dspark.update_draft_keys(model, chunks, out.draft_features)   # e.g. the model and the engine both call it
    assert all(torch.equal(a, b) for a, b in zip(once, cache.drafter.keys))
    assert cache.drafter.start == 0 and cache.drafter.end == 12
