"""Bitmask application: Triton kernel (interpreter on CPU) vs torch twin vs hand decoding vs xgrammar."""
import pytest
import torch

from deepinfer_sg.kernels import apply_token_bitmask_inplace, apply_token_bitmask_by_step_inplace
from deepinfer_sg.kernels.bitmask import apply_token_bitmask_torch, apply_token_bitmask_triton, by_step_mask_rows
from helpers import bit_allowed, on_dev, random_bitmask


def _logits(rows, width, gen, dtype=torch.float32):
    return (torch.randn(rows, width, generator=gen) * 3 + 0.5).to(dtype)


def _expected(logits, bitmask, pairs):
    """Hand computation: for each (logits row, mask row) pair, ban every covered token whose bit is 0."""
    out = logits.clone()
    n_cols = min(logits.shape[1], 32 * bitmask.shape[1])
    for row, mrow in pairs:
        for v in range(n_cols):
            if not bit_allowed(bitmask, mrow, v):
                out[row, v] = float("-inf")
    return out


@pytest.mark.parametrize("rows,vocab,width", [(1, 1, 1), (3, 31, 31), (5, 33, 40), (4, 100, 100), (2, 257, 257)])
def test_twin_matches_hand_decoding(rows, vocab, width):
    gen = torch.Generator().manual_seed(rows * 1000 + vocab)
    bm = random_bitmask(rows, vocab, gen)
    logits = _logits(rows, width, gen)
    ref = _expected(logits, bm, [(r, r) for r in range(rows)])
    apply_token_bitmask_torch(logits, bm)
    assert torch.equal(logits, ref)


@pytest.mark.parametrize("rows,vocab,width,dtype", [
    (7, 1000, 1000, torch.float32), (3, 4097, 4100, torch.float32), (5, 129, 129, torch.bfloat16),
    (2, 8200, 8200, torch.float16)])
@pytest.mark.parametrize("adaptive", [False, True])
def test_triton_matches_twin_all_rows(rows, vocab, width, dtype, adaptive):
    gen = torch.Generator().manual_seed(vocab)
    bm = random_bitmask(rows, vocab, gen, density=0.3)
    logits = _logits(rows, width, gen, dtype)       # random values: an unwritten element keeps them and shows
    a, b = logits.clone(), logits.clone()
    apply_token_bitmask_torch(a, bm)
    b = on_dev(b)
    apply_token_bitmask_triton(b, on_dev(bm), block=1024, adaptive=adaptive)
    b = b.cpu()
    assert torch.equal(a, b)
    banned = torch.isinf(a[:, : min(width, 32 * bm.shape[1])]).float().mean()
    assert 0.5 < banned < 0.9                      # the mask did something, and not everything


def test_triton_matches_twin_indices_and_mask_rows():
    gen = torch.Generator().manual_seed(1)
    vocab = 300
    bm = random_bitmask(9, vocab, gen)
    logits = _logits(6, vocab + 5, gen)             # 5 padding columns beyond the mask: never touched
    idx = torch.tensor([4, 0, 5])
    mrows = torch.tensor([8, -1, 2])                # -1: leave row 0 alone
    a, b = logits.clone(), logits.clone()
    apply_token_bitmask_torch(a, bm, idx, mrows)
    b = on_dev(b)
    apply_token_bitmask_triton(b, on_dev(bm), on_dev(idx), on_dev(mrows), block=128)
    b = b.cpu()
    assert torch.equal(a, b)
    assert torch.equal(a, _expected(logits, bm, [(4, 8), (5, 2)]))


def test_matches_xgrammar_kernel():
    xgr = pytest.importorskip("xgrammar")
    gen = torch.Generator().manual_seed(2)
    vocab = 1000
    bm = random_bitmask(8, vocab, gen)
    logits = _logits(8, vocab, gen)
    for indices in (None, [1, 6, 3]):
        ref = logits.clone()
        xgr.apply_token_bitmask_inplace(ref, bm, indices=indices)
        ours = on_dev(logits.clone())
        apply_token_bitmask_triton(ours, on_dev(bm), indices, block=256)
        ours = ours.cpu()
        assert torch.equal(ours, ref)


def test_by_step_packed_layout():
    gen = torch.Generator().manual_seed(3)
    vocab = 77
    logits_cu = torch.tensor([0, 3, 4, 8, 10])     # request rows: 3, 1, 4, 2
    mask_cu = torch.tensor([0, 2, 3, 8, 8])        # mask rows:    2, 1, 5, 0 (last request unconstrained)
    bm = random_bitmask(8, vocab, gen)
    logits = _logits(10, vocab, gen)
    pairs = [(0, 0), (1, 1), (3, 2), (4, 3), (5, 4), (6, 5), (7, 6)]   # row 2 and rows 8-9 get no mask
    assert by_step_mask_rows(logits_cu, mask_cu, 10).tolist() == [0, 1, -1, 2, 3, 4, 5, 6, -1, -1]
    ref = _expected(logits, bm, pairs)
    a = logits.clone()
    apply_token_bitmask_by_step_inplace(a, bm, logits_cu, mask_cu)       # CPU: the twin
    b = on_dev(logits.clone())
    apply_token_bitmask_triton(b, on_dev(bm), on_dev(torch.arange(10)),
                               on_dev(by_step_mask_rows(logits_cu, mask_cu, 10)), block=64)
    b = b.cpu()
    assert torch.equal(a, ref) and torch.equal(b, ref)


def test_dispatch_uses_twin_on_cpu_and_validates():
    gen = torch.Generator().manual_seed(4)
    bm = random_bitmask(2, 64, gen)
    logits = _logits(2, 64, gen)
    ref = _expected(logits, bm, [(0, 0), (1, 1)])
    apply_token_bitmask_inplace(logits, bm)
    assert torch.equal(logits, ref)
    with pytest.raises(ValueError, match="bitmask must be int32"):
        apply_token_bitmask_inplace(logits, bm.to(torch.int64))
    with pytest.raises(ValueError, match="bitmask has 1 rows"):
        apply_token_bitmask_inplace(logits, bm[:1])


@pytest.mark.parametrize("block", [64, 1024])
def test_adaptive_blocks_all_banned_all_allowed_and_mixed(block):
    """The adaptive kernel's three block cases (nothing banned: untouched; all banned: written blind; mixed: read
    and written whole), including a partial last block and logits wider than the mask (never touched)."""
    gen = torch.Generator().manual_seed(block)
    vocab, width = 3000, 3010
    allowed = torch.rand(5, vocab, generator=gen) < 0.5
    allowed[0] = False                                # every block banned
    allowed[1] = True                                 # nothing banned
    allowed[2, :1024] = False                         # a banned block, a mixed one, an allowed tail
    allowed[2, 2048:] = True
    allowed[3, :2048] = True                          # only the partial last block banned
    allowed[3, 2048:] = False
    bits = torch.nn.functional.pad(allowed, (0, (-vocab) % 32)).view(5, -1, 32).to(torch.int64)
    packed = (bits << torch.arange(32)).sum(-1)
    bm = ((packed + 2**31) % 2**32 - 2**31).to(torch.int32)
    logits = _logits(5, width, gen, torch.float32)
    a, b = logits.clone(), on_dev(logits.clone())
    apply_token_bitmask_torch(a, bm)
    apply_token_bitmask_triton(b, on_dev(bm), block=block, adaptive=True)
    assert torch.equal(a, b.cpu())
    # (columns vocab..32*W-1 follow the mask's zero pad bits; columns past 32*W are never touched)
    assert torch.isinf(a[0, :vocab]).all() and not torch.isinf(a[1, :vocab]).any()
    assert not torch.isinf(a[:, 32 * bm.shape[1]:]).any()
