"""Index glue kernels: twins vs the rule applied element by element in Python; Triton vs twin on awkward shapes
(G not a power of two, one row, strided scores / ids as the engine slices them, with and without candidates); the
select layer's chain of kernels launched back to back against the twins. Outputs start poisoned (conftest)."""
import pytest
import torch
import triton

from deepinfer_sg.kernels.decode_attention import sparse_attention_torch, sparse_attention_triton
from deepinfer_sg.kernels.index_rows import entry_rows_torch, visible_scores_torch, visible_scores_triton
from deepinfer_sg.kernels.indexer import _select, indexer_scores_torch, indexer_scores_triton, topk_select_triton
from deepinfer_sg.kernels.rope import apply_rope_torch
from helpers import on_dev, to_cpu


def _inputs(T, G, gen, ratio):
    scores = torch.randn(T, G + 3, generator=gen)[:, 1:G + 1]          # (a column slice: row stride G + 3)
    positions = torch.randint(0, 3 * G, (T,), generator=gen)
    count = torch.randint(0, G + 2, (T,), generator=gen)
    cand = torch.rand(T, G, generator=gen) < 0.6
    return scores, positions, count, cand


def test_visible_twin_is_the_rule():
    g = torch.Generator().manual_seed(0)
    scores, pos, count, cand = _inputs(5, 13, g, 2)
    vis, masked = visible_scores_torch(scores, pos, count, 2, cand)
    for t in range(5):
        for e in range(13):
            v = e < (int(pos[t]) + 1) // 2 and e < int(count[t])
            assert bool(vis[t, e]) == v
            assert float(masked[t, e]) == (float(scores[t, e]) if v and bool(cand[t, e]) else float("-inf"))


@pytest.mark.parametrize("T,G,ratio", [(1, 16, 1), (7, 37, 2), (12, 300, 4), (3, 2048, 1)])
@pytest.mark.parametrize("with_cand", [False, True])
def test_visible_triton_matches_twin(T, G, ratio, with_cand):
    g = torch.Generator().manual_seed(T * G + ratio)
    scores, pos, count, cand = _inputs(T, G, g, ratio)
    cand = cand if with_cand else None
    want = visible_scores_torch(scores, pos, count, ratio, cand)
    got = to_cpu(visible_scores_triton(on_dev(scores), on_dev(pos), on_dev(count), ratio, on_dev(cand)))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_entry_rows_twin_is_the_rule():
    ids = torch.tensor([[0, 3, -1], [5, 1, 2]])
    got = entry_rows_torch(ids, torch.tensor([100, 200]), torch.tensor([4, 3]), 4)
    assert got.tolist() == [[100, 103, -1, -1], [-1, 201, 202, -1]]


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="candidate mask"):
        visible_scores_triton(torch.zeros(2, 8), torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long),
                              1, torch.ones(2, 7, dtype=torch.bool))


def test_select_layer_chain_back_to_back():
    """The engine's select layer as one chain of launches with no host sync between them (on a GPU each is a
    programmatic dependent launch, so every read of the previous kernel's output must come after its wait):
    index scores (queries rotated, head weights scaled, the visible entries picked in the kernel) -> top-k select
    -> sparse attention over the selected entry ids (pool rows made in its gather), run twice, against the twins
    (visible entries and entry rows as this file's twins make them). Each output starts poisoned, so a read that
    overtakes its producer shows up."""
    g = torch.Generator().manual_seed(5)
    T, Hi, Di, G, k, H, D, W = 6, 4, 16, 45, 8, 4, 32, 12
    iq, w = torch.randn(T, Hi, Di, generator=g), torch.randn(T, Hi + 2, generator=g).to(torch.bfloat16)[:, 1:-1]
    ang = torch.rand(T, 4, generator=g) * 6.3
    turn = torch.stack([ang.cos(), ang.sin()], -1)
    keys = torch.randn(T * G, Di, generator=g)
    start, count = torch.arange(T) * G, torch.randint(0, G + 1, (T,), generator=g)
    pos = torch.randint(0, 2 * G, (T,), generator=g)
    q, win = torch.randn(T, H, D, generator=g), torch.randn(T * W, D, generator=g)
    win_idx = torch.arange(T * W, dtype=torch.int32).view(T, W)     # (int32 as the engine gives it: no cast launch)
    win_idx[:, :5] = -1
    kv, sink = torch.randn(T * G, D, generator=g), torch.randn(H, generator=g)
    scores = indexer_scores_torch(apply_rope_torch(iq, turn), w.float() * 0.5, keys, start, count, G)
    ids = _select(visible_scores_torch(scores, pos, count, 2)[1], k)[0]
    want = sparse_attention_torch(q, win, win_idx, sink, kv, entry_rows_torch(ids, start, count, 16))
    d = on_dev((iq, w, keys, start, count, turn, pos, q, win, win_idx, kv, sink))
    for _ in range(2):
        masked = indexer_scores_triton(*d[:5], G, w_scale=0.5, turn=d[5], positions=d[6], ratio=2)
        got_ids, _ = topk_select_triton(masked, k, sorted=False)
        out = sparse_attention_triton(d[7], d[8], d[9], d[11], d[10], got_ids, cmp_start=d[3], cmp_count=d[4]).cpu()
        assert torch.equal(got_ids.cpu().sort(1).values, ids.sort(1).values)
        assert torch.allclose(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("T,G,block,top,tiles", [(5, 200, 8, 6, None), (3, 77, 4, 3, None), (4, 300, 3, 9, None),
                                                 (2, 64, 8, 7, None), (9, 300, 8, 9, (64, 128)),
                                                 (9, 301, 3, 20, (32, 64))])
def test_candidate_blocks_match_chain(T, G, block, top, tiles, monkeypatch):
    """The three launches against engine/indexer.py's torch chain (the twin) on masked scores: ties between blocks
    (rounded scores), rows with nothing visible, a row whose visible prefix ends on a block's end, one seeing
    everything, rows with fewer visible blocks than `top`; G not a multiple of the block, a block not a power of
    two; tiles: (entries a block-score program reads, a mask program writes) made small, so that rows span several
    programs and visible prefixes end on a tile's end, one entry past it, inside, or in the last tile."""
    from deepinfer_sg.engine.indexer import candidate_block_mask
    from deepinfer_sg.kernels import index_rows
    if tiles:
        monkeypatch.setattr(index_rows, "TILE_SCORES", tiles[0])
        monkeypatch.setattr(index_rows, "TILE_MASK", tiles[1])
    gen = torch.Generator().manual_seed(T * G + block + top)
    s = torch.randn(T, G + 5, generator=gen)[:, 2:G + 2].round()                 # (a column slice)
    n_vis = torch.randint(0, G + 1, (T,), generator=gen)
    n_vis[0], n_vis[1] = 0, G
    n_vis[-1] = 2 * block if T > 2 else n_vis[-1]
    if tiles:     # prefixes ending on a score tile's end, one past it, one short of it, and on a mask tile's end
        edge = tiles[0] // triton.next_power_of_2(block) * block
        n_vis[2:6] = torch.tensor([edge, edge + 1, edge - 1, 2 * edge])
    visible = torch.arange(G)[None, :] < n_vis[:, None]
    masked = s.masked_fill(~visible, float("-inf"))
    want = candidate_block_mask(masked, visible, block, top, masked=True)
    got = index_rows.candidate_blocks_triton(on_dev(masked), block, top).cpu()
    assert got.dtype == torch.bool and torch.equal(got, want)
    # the engine's call (on a GPU it dispatches to the kernels, elsewhere to the chain)
    assert torch.equal(candidate_block_mask(on_dev(masked), None, block, top, masked=True).cpu(), want)
