"""Few-row products (kernels/skinny.py): the twin vs the sum written out in float64 (plain and grouped) and vs the
clamped SwiGLU by hand; the Triton kernel vs the twin on awkward shapes (rows not a power of two and past one row
block, N and K not multiples of the blocks, strided rows, groups, fp32 and bf16). Outputs start poisoned
(conftest), so an unwritten element fails."""
import pytest
import torch

from deepinfer_sg.kernels.backend import INTERPRETING
from deepinfer_sg.kernels.skinny import skinny_linear_torch, skinny_linear_triton
from helpers import on_dev, to_cpu


def _by_hand(x, w, G):
    """out[t, g*N + n] = sum_k x[t, g*K + k] * w[g*N + n, k] in float64."""
    x = x.double()
    K, N = x.shape[1] // G, w.shape[0] // G
    out = torch.zeros(x.shape[0], G * N, dtype=torch.float64)
    for g in range(G):
        out[:, g * N:(g + 1) * N] = x[:, g * K:(g + 1) * K] @ w[g * N:(g + 1) * N].double().T
    return out


@pytest.mark.parametrize("G", [1, 3])
def test_twin_is_the_sum(G):
    g = torch.Generator().manual_seed(G)
    T, K, N = 4, 24, 5
    x, w = torch.randn(T, G * K, generator=g), torch.randn(G * N, K, generator=g)
    assert torch.allclose(skinny_linear_torch(x, w, G).double(), _by_hand(x, w, G), atol=1e-4)


# (rows, groups, N, K)
SHAPES = [(1, 1, 40, 96), (7, 1, 33, 70), (20, 1, 130, 300), (3, 4, 24, 64), (17, 2, 33, 96), (70, 1, 18, 40)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_twin(shape, dtype):
    T, G, N, K = shape
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(T, G * K, generator=g) + 0.1).to(dtype)
    w = (torch.randn(G * N, K, generator=g) * 0.5).to(dtype)
    want = skinny_linear_torch(x, w, G)
    got = to_cpu(skinny_linear_triton(on_dev(x), on_dev(w), G))
    assert got.dtype == dtype and got.shape == (T, G * N)
    scale = want.float().abs().max()
    if dtype == torch.float32:   # (a GPU's fp32 dot runs in tf32)
        assert torch.allclose(got, want, atol=1e-4 * scale if INTERPRETING else 3e-3 * scale)
    else:    # fp32 sums in another order, one bf16 rounding of the result (and of the rotated inputs)
        assert torch.allclose(got.float(), want.float(), atol=2e-2 * scale, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [5, 40])
def test_clamped_swiglu_of_gate_and_up(dtype, rows):
    """A shared expert's front half: silu(min(x w1, L)) * clamp(x w3, -L, L) with L small enough that both clamps
    bite; the twin vs float64 by hand, the kernel vs the twin."""
    g = torch.Generator().manual_seed(rows)
    K, N, L = 64, 48, 1.5
    x = torch.randn(rows, K, generator=g).to(dtype)
    w1, w3 = ((torch.randn(N, K, generator=g) * 0.4).to(dtype) for _ in range(2))
    want = skinny_linear_torch(x, w1, glu=(w3, L))
    if dtype == torch.float32:
        gate, up = x.double() @ w1.double().T, x.double() @ w3.double().T
        assert (gate > L).any() and (up.abs() > L).any()          # (both clamps bite)
        gate = gate.clamp(max=L)
        hand = gate / (1 + torch.exp(-gate)) * up.clamp(-L, L)
        assert torch.allclose(want.double(), hand, atol=1e-5)
    got = to_cpu(skinny_linear_triton(on_dev(x), on_dev(w1), glu=(on_dev(w3), L)))
    scale = want.float().abs().max()
    tol = (1e-4 if INTERPRETING else 3e-3) if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype and torch.allclose(got.float(), want.float(), atol=tol * scale, rtol=1e-2)


def test_triton_reads_strided_rows():
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(6, 200, generator=g)
    x = wide[:, 30:130]                       # a column block of a wider product: rows at stride 200
    w = torch.randn(45, 100, generator=g)
    got = to_cpu(skinny_linear_triton(on_dev(wide)[:, 30:130], on_dev(w)))
    assert torch.allclose(got, skinny_linear_torch(x, w), atol=1e-4 if INTERPRETING else 5e-2)


# (rows, groups, N, K, SPLIT asked; None: launch_config's choice), glu
SPLITS = [((3, 1, 40, 2048, None), False), ((5, 2, 24, 700, 3), False), ((9, 1, 33, 1100, 8), True),
          ((20, 1, 18, 520, 2), True)]


@pytest.mark.parametrize("case", SPLITS)
def test_split_k_matches_twin_and_leaves_the_tickets_zero(case):
    """K cut into slices (programs): partial sums in a workspace, the tile's last program adds them in slice order
    and applies the SwiGLU; the same result twice in a row (the tile counters reset themselves), equal to the
    unsplit launch up to fp32 summation order."""
    from deepinfer_sg.kernels.skinny import launch_config
    (T, G, N, K, split), glu = case
    if split is None:
        assert launch_config(T, N, K, G)["SPLIT"] > 1
    g = torch.Generator().manual_seed(T + K)
    x = (torch.randn(T, G * K, generator=g) * 0.2).to(torch.bfloat16)
    w = (torch.randn(G * N, K, generator=g) * 0.2).to(torch.bfloat16)
    up = (on_dev((torch.randn(N, K, generator=g) * 0.2).to(torch.bfloat16)), 1.0) if glu else None
    cfg = {} if split is None else {"SPLIT": split, "BK": 64}
    tickets = on_dev(torch.zeros(64, dtype=torch.int32))
    want = skinny_linear_torch(x, w, G, None if up is None else (to_cpu(up[0]), 1.0)).float()
    one = to_cpu(skinny_linear_triton(on_dev(x), on_dev(w), G, up, config=dict(cfg, SPLIT=1))).float()
    for _ in range(2):
        got = to_cpu(skinny_linear_triton(on_dev(x), on_dev(w), G, up, config=cfg, tickets=tickets)).float()
        assert torch.equal(to_cpu(tickets), torch.zeros(64, dtype=torch.int32))
        scale = want.abs().max()
        assert torch.allclose(got, want, atol=2e-2 * scale, rtol=1e-2)
        assert torch.allclose(got, one, atol=1e-2 * scale, rtol=1e-2)


def test_shared_tickets_are_left_zero_and_a_capture_without_them_runs_unsplit(monkeypatch):
    """Default tickets come from kernels.backend.tickets (per device and site) and are zero again after a split
    launch; when none can be had (a CUDA graph captured before a warm-up made them) the launch is the unsplit one,
    bit for bit."""
    from deepinfer_sg.kernels import backend, skinny
    g = torch.Generator().manual_seed(11)
    x = on_dev((torch.randn(3, 1024, generator=g) * 0.2).to(torch.bfloat16))
    w = on_dev((torch.randn(40, 1024, generator=g) * 0.2).to(torch.bfloat16))
    cfg = {"SPLIT": 4, "BK": 64}
    split = to_cpu(skinny_linear_triton(x, w, config=cfg, site="test-skinny"))
    assert not to_cpu(backend.tickets(x.device, 8, site="test-skinny")).any()
    unsplit = to_cpu(skinny_linear_triton(x, w, config=dict(cfg, SPLIT=1)))
    monkeypatch.setattr(skinny, "shared_tickets", lambda *a, **k: None)
    assert torch.equal(to_cpu(skinny_linear_triton(x, w, config=cfg, site="test-skinny")), unsplit)
    assert torch.allclose(split.float(), unsplit.float(), atol=2e-2 * unsplit.float().abs().max())


@pytest.mark.parametrize("pdl", [False, True])
def test_a_chain_of_launches_reads_each_output_after_it_is_written(monkeypatch, pdl):
    """The shared expert's two products and a third (split-K) one back to back, each reading the one before's
    output: launched with programmatic dependent launch on a Hopper GPU (kernels.backend.PDL; off elsewhere), a
    kernel reading its input before its wait would see the poisoned output. Compiled: the weight prefetch before
    the wait (PF) on and off give the same bits."""
    from deepinfer_sg.kernels import backend, skinny
    monkeypatch.setattr(backend, "PDL", pdl)
    g = torch.Generator().manual_seed(21)
    x = (torch.randn(7, 256, generator=g) * 0.3).to(torch.bfloat16)
    w1, w3 = ((torch.randn(96, 256, generator=g) * 0.2).to(torch.bfloat16) for _ in range(2))
    w2 = (torch.randn(256, 96, generator=g) * 0.2).to(torch.bfloat16)
    w4 = (torch.randn(40, 256, generator=g) * 0.2).to(torch.bfloat16)
    h = skinny_linear_torch(x, w1, glu=(w3, 1.0))
    want = skinny_linear_torch(skinny_linear_torch(h, w2), w4).float()

    def chain():
        h = skinny_linear_triton(on_dev(x), on_dev(w1), glu=(on_dev(w3), 1.0))
        return to_cpu(skinny_linear_triton(skinny_linear_triton(h, on_dev(w2)), on_dev(w4), config={"SPLIT": 2,
                                                                                                     "BK": 64}))
    got = chain().float()
    assert torch.allclose(got, want, atol=3e-2 * want.abs().max(), rtol=2e-2)
    if not INTERPRETING:
        monkeypatch.setattr(skinny, "PREFETCH", not skinny.PREFETCH)
        assert torch.equal(chain().float(), got)


def test_bad_shapes_are_refused_with_the_shapes():
    with pytest.raises(ValueError, match="in 2 groups"):
        skinny_linear_triton(torch.randn(3, 10), torch.randn(4, 4), groups=2)
    with pytest.raises(ValueError, match="glu up weight"):
        skinny_linear_triton(torch.randn(3, 16), torch.randn(4, 16), glu=(torch.randn(5, 16), 1.0))



def test_twin_glu_then_down_is_the_engines_shared_expert():
    """engine/moe.py's Expert = the glu product, then w2 (the kernel can replace a shared expert's 7 launches)."""
    from deepinfer_sg.engine.moe import Expert
    torch.manual_seed(4)
    ex = Expert(hidden=32, inter=24, limit=0.8)
    x = torch.randn(5, 32) * 3
    want = ex(x)
    got = skinny_linear_torch(skinny_linear_torch(x, ex.w1.weight, glu=(ex.w3.weight, ex.limit)), ex.w2.weight)
    assert torch.equal(got, want)


def test_split_k_keeps_one_wave_at_the_shared_experts_shapes():
    """launch_config splits K only while the grid stays within one wave of an H200's 132 SMs (the shared expert
    runs beside the routed experts: more programs cost those more than they save), and not at 64 rows (partial
    sums of more than 1/8 of the weight's bytes)."""
    from deepinfer_sg.kernels.skinny import launch_config
    for N, K in ((1024, 2048), (2048, 1024)):           # the mid-size shared expert's front half and w2
        for T in (1, 8, 16, 32, 64):
            c = launch_config(T, N, K, 1)
            programs = -(-N // c["BN"]) * -(-T // c["BM"]) * c["SPLIT"]
            assert programs <= 132 or c["SPLIT"] == 1, (T, N, K, c)
    assert [launch_config(T, 1024, 2048, 1)["SPLIT"] for T in (8, 64)] == [2, 1]
    assert [launch_config(T, 2048, 1024, 1)["SPLIT"] for T in (8, 64)] == [1, 1]
