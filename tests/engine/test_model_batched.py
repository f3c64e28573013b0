"""The batched decode / verify path (engine/batched.py with the kernels' torch twins) against the reference path.

Oracle: `Model.forward_step` with `fast_decode = False`, the per-sequence dense-mask path (checked against
transformers in test_model_v4.py and against the full-sequence path in test_model_v41.py), run on deep copies of
the same caches. Scenarios: batches of sequences at different lengths (empty, shorter than the window, several
windows long, more compressed entries than index_topk), decode rows and multi-row verify chunks, subsets of the
sequences per step, rollbacks in between; V4 (CSA overlap + own indexer compressor, HCA, hash MoE) and V4.1
(shared sources, candidate blocks, engram, ratio 1 and 2); YOCO mask mode; quantization simulation; bf16.
"""
import copy
import math

import pytest
import torch

from deepinfer_sg.engine import batched, indexer, testing
from deepinfer_sg.engine.config import ModelConfig
from deepinfer_sg.engine.model import Model, StepChunk


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _random_model(d: dict, seed: int) -> Model:
    torch.manual_seed(seed)
    m = Model(ModelConfig.from_dict(d)).eval()
    with torch.no_grad():   # make the zero/one-initialized tensors matter
        for name, p in m.named_parameters():
            if name.endswith(("attn_sink", "_base", "gate.bias", "ape")):
                p.normal_(0, 0.5)
            elif name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif p.dim() == 2 and not name.endswith("_fn"):
                p.normal_(0, 1.0 / math.sqrt(p.shape[1]))
        for name, b in m.named_buffers():
            if name.endswith("tid2eid"):
                g = torch.Generator().manual_seed(seed)
                b.copy_(torch.stack([torch.randperm(m.config.n_routed_experts, generator=g)[:b.shape[1]]
                                     for _ in range(b.shape[0])]))
    return m


MODELS = {
    "v4": lambda: _random_model(testing.tiny_v4_config(hc_mult=4, index_n_heads=2), seed=1),
    "v41": lambda: _random_model(testing.tiny_v41_config(), seed=2),
}
PROMPTS = [0, 3, 9, 30, 45]   # empty / < window / several windows, > index_topk compressed entries
# per step: rows per sequence (0 = sequence not in this step); then rollbacks applied to both copies
SCHEDULE = [
    ([1, 1, 1, 1, 1], None),
    ([6, 1, 3, 0, 5], [4, 0, 2, 0, 3]),   # verify rows, then reject some drafts
    ([1, 2, 1, 6, 1], [0, 1, 0, 5, 0]),
    ([1, 0, 1, 1, 1], None),
    ([1, 1, 1, 1, 1], None),
]


def _spy(monkeypatch):
    calls = []
    real = batched.sparse_attention
    monkeypatch.setattr(batched, "sparse_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _run_both(m: Model, monkeypatch, vocab: int, seed: int = 0, tol: float = 1e-5):
    g = torch.Generator().manual_seed(seed)
    caches = [m.new_cache() for _ in PROMPTS]
    m.fast_decode = False
    first = [StepChunk(c, torch.randint(0, vocab, (n,), generator=g), 1) for c, n in zip(caches, PROMPTS) if n]
    m.forward_step(first)
    ref = copy.deepcopy(caches)
    calls = _spy(monkeypatch)
    for rows, back in SCHEDULE:
        chunks = [(i, torch.randint(0, vocab, (n,), generator=g)) for i, n in enumerate(rows) if n]
        outs = {}
        for fast, cs in ((True, caches), (False, ref)):
            m.fast_decode = fast
            before = len(calls)
            outs[fast] = m.forward_step([StepChunk(cs[i], t, t.shape[0]) for i, t in chunks])
            assert (len(calls) > before) == fast    # the fast step really ran the batched kernels, the other not
        assert outs[True].logits.shape == outs[False].logits.shape == (sum(rows), vocab)
        assert _rel(outs[True].logits, outs[False].logits) < tol
        if outs[False].draft_features is not None:
            assert _rel(outs[True].draft_features, outs[False].draft_features) < tol
        if back:
            for c, r, n in zip(caches, ref, back):
                c.rollback(n)
                r.rollback(n)
    m.fast_decode = True
    return caches, ref


def _close(a, b, what):
    if a is None or b is None:
        assert a is None and b is None, what
        return
    assert a.shape == b.shape, what
    if a.numel():
        assert (a.float() - b.float()).abs().max() <= 1e-5 * b.float().abs().max() + 1e-6, what


@pytest.mark.parametrize("fused", [False, True], ids=["mhc", "fused-mhc"])
@pytest.mark.parametrize("name", list(MODELS))
def test_fast_path_equals_reference_path(name, fused, monkeypatch):
    m = MODELS[name]()
    m.fused_mhc = fused   # the fused mHC read-out / write-back kernels (their torch twins here)
    caches, ref = _run_both(m, monkeypatch, m.config.vocab_size)
    for c, r in zip(caches, ref):   # the caches advanced identically (windows, compressed state, index keys)
        assert c.length == r.length and torch.equal(c.tokens, r.tokens)
        for k, (a, b) in enumerate(zip(c.layers, r.layers)):
            _close(a.win, b.win, f"layer {k} window")
            _close(a.ikeys, b.ikeys, f"layer {k} index keys")
            for sa, sb, what in ((a.comp, b.comp, "compressor"), (a.icomp, b.icomp, "index compressor")):
                if sa is None or sb is None:
                    assert sa is None and sb is None
                    continue
                assert sa.tok_start == sb.tok_start, f"layer {k} {what}"
                for f in ("entries", "latents", "tok_kv", "tok_gate"):
                    _close(getattr(sa, f), getattr(sb, f), f"layer {k} {what} {f}")


def test_fast_path_equals_reference_with_yoco_mask(monkeypatch):
    m = MODELS["v41"]()
    m.set_yoco("mask", m.config.sliding_window + m.max_rollback)
    _run_both(m, monkeypatch, m.config.vocab_size, seed=5)


def test_fast_path_equals_reference_with_quantization_simulation(monkeypatch):
    m = MODELS["v41"]()
    m.quant_sim = True
    _run_both(m, monkeypatch, m.config.vocab_size, seed=6)


def test_bf16_fast_path_runs_close_to_fp32_reference():
    # top-k wider than the entries: bf16 round-off then cannot flip entry selection (a flip of an MoE route still
    # can, and changes that row and its sequence's later rows: hence the median over rows)
    m32 = _random_model(testing.tiny_v41_config(index_topk=64, candidate_topk_blocks=64), seed=2)
    m16 = copy.deepcopy(m32).set_dtype(torch.bfloat16)
    assert m16.layers[2].attn.attn_sink.dtype == torch.float32 and m16.embed.weight.dtype == torch.bfloat16
    assert m16.layers[2].hc_attn_fn.dtype == torch.float32 and m16.layers[2].ffn.gate.bias.dtype == torch.float32
    ids = torch.randint(0, 512, (3, 40), generator=torch.Generator().manual_seed(7))
    a, b = [m16.new_cache() for _ in range(3)], [m32.new_cache() for _ in range(3)]
    m32.fast_decode = False
    m16.forward_step([StepChunk(c, ids[k, :30], 1) for k, c in enumerate(a)])
    m32.forward_step([StepChunk(c, ids[k, :30], 1) for k, c in enumerate(b)])
    errs = []
    for p in range(30, 40, 2):
        x = m16.forward_step([StepChunk(c, ids[k, p:p + 2], 2) for k, c in enumerate(a)]).logits
        y = m32.forward_step([StepChunk(c, ids[k, p:p + 2], 2) for k, c in enumerate(b)]).logits
        assert x.dtype == torch.float32 and torch.isfinite(x).all()
        errs += [((u - v).abs().max() / v.abs().max()).item() for u, v in zip(x, y)]
    assert torch.tensor(errs).median() < 0.05, errs
    assert a[0].layers[0].win.dtype == torch.bfloat16 and a[0].layers[2].comp.entries.dtype == torch.bfloat16


def test_grouped_moe_equals_expert_loop_and_follows_weight_updates():
    m = MODELS["v4"]()
    moe = m.layers[1].ffn
    x = torch.randn(7, m.config.hidden_size, generator=torch.Generator().manual_seed(8))
    ref = moe(x)
    assert _rel(moe.forward_grouped(x), ref) < 1e-5
    # the experts' parameters now view the stacks: an in-place load shows up in both paths
    sd = {k: v * 0.5 if ".experts.3." in k else v for k, v in moe.state_dict().items()}
    moe.load_state_dict(sd)
    ref2 = moe(x)
    assert _rel(moe.forward_grouped(x), ref2) < 1e-5
    # state_dict values stay per expert (not the stacks)
    assert moe.state_dict()["experts.3.w1.weight"].shape == moe.experts[3].w1.weight.shape
    m.set_dtype(torch.bfloat16)       # replaced parameters: the stacks are rebuilt in the new dtype
    assert moe.stacked_weights()[0].dtype == torch.bfloat16
    assert _rel(moe.forward_grouped(x.bfloat16()).float(), moe(x.bfloat16()).float()) < 2e-2


def test_triton_kernels_as_wired_give_the_reference_logits(monkeypatch):
    """The CUDA dispatch (Triton kernels), run by the interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET):
    the same shapes, dtypes and index layouts the H200 gets, against the reference path."""
    import deepinfer_sg.kernels.decode_attention as k_attn
    import deepinfer_sg.kernels.hc_mix as k_hc
    import deepinfer_sg.kernels.indexer as k_idx
    import deepinfer_sg.kernels.moe as k_moe
    ran = {}
    for mod, fn in ((k_attn, "sparse_attention_triton"), (k_hc, "hc_mixes_triton"), (k_moe, "moe_experts_triton"),
                    (k_idx, "indexer_scores_triton")):
        monkeypatch.setattr(mod, "use_triton", lambda t: True)
        real = getattr(mod, fn)
        monkeypatch.setattr(mod, fn, lambda *a, real=real, fn=fn, **k: ran.__setitem__(fn, 1) or real(*a, **k))
    m = MODELS["v41"]()
    g = torch.Generator().manual_seed(9)
    caches = [m.new_cache() for _ in range(3)]
    m.fast_decode = False
    m.forward_step([StepChunk(c, torch.randint(0, 512, (n,), generator=g), 1) for c, n in zip(caches, [20, 33, 5])])
    ref = copy.deepcopy(caches)
    for rows in ([1, 1, 1], [3, 1, 2]):
        ch = [torch.randint(0, 512, (n,), generator=g) for n in rows]
        m.fast_decode = True
        a = m.forward_step([StepChunk(c, x, len(x)) for c, x in zip(caches, ch)]).logits
        m.fast_decode = False
        b = m.forward_step([StepChunk(c, x, len(x)) for c, x in zip(ref, ch)]).logits
        assert _rel(a, b) < 1e-5
    assert len(ran) == 4, ran


@pytest.mark.parametrize("G,k", [(5, 8), (40, 8), (33, 16)])
def test_topk_ids_by_the_select_kernel_equal_the_reference_mask(G, k):
    """engine/indexer.py's topk_ids: the select kernel's winners (Triton, by the interpreter) sorted to ids, against the
    reference's `topk_mask` turned into ascending ids by hand; relu-like exact ties, rows with fewer allowed entries
    than k, rows with none."""
    from deepinfer_sg.engine.indexer import topk_mask
    g = torch.Generator().manual_seed(G * k)
    T = 6
    scores = torch.randint(0, 4, (T, G), generator=g).float()          # many exact ties
    allowed = torch.rand(T, G, generator=g) < 0.7
    allowed[1, 3:] = False                                             # fewer than k allowed
    allowed[2] = False                                                 # none
    want = torch.full((T, min(k, G)), -1, dtype=torch.long)
    for r, row in enumerate(topk_mask(scores, allowed, k)):
        ids = row.nonzero().flatten()
        want[r, :ids.numel()] = ids
    for triton in (False, True):
        assert torch.equal(indexer.topk_ids(scores, allowed, k, triton=triton), want), triton
