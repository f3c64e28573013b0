"""Shared pieces of the kernel benchmarks (benchmarks/kernels.py and its per-family modules): the ceilings,
timing, L2-defeating input rotation and the table row. `configure(dry)` must run before a family module is
imported: the family modules take DEV, DRY, V and W from here at import time."""
import importlib.util
import math
import os
import sys

if "--dry" in sys.argv:          # the interpreter must be chosen before any kernel is decorated
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402


def _import_kernels():
    """deepinfer_sg.kernels, or (on a machine where the package is not installed) the repository's kernels/
    folder loaded under that name: the kernels import nothing else of ours."""
    try:
        import deepinfer_sg.kernels                                          # noqa: F401
    except ImportError:
        import types
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        pkg = types.ModuleType("deepinfer_sg")
        pkg.__path__ = []
        sys.modules["deepinfer_sg"] = pkg
        spec = importlib.util.spec_from_file_location("deepinfer_sg.kernels", os.path.join(root, "kernels", "__init__.py"),
                                                      submodule_search_locations=[os.path.join(root, "kernels")])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["deepinfer_sg.kernels"] = mod
        spec.loader.exec_module(mod)


_import_kernels()

V = 129280
W = (V + 31) // 32
ROWS = []
LINES = []           # everything the table prints, written to $OUT/kernels.txt at the end when OUT is set
DEV = "cuda"
DRY = False          # --dry: run every benchmark body once on tiny shapes on the CPU (Triton interpreter), untimed


def configure(dry: bool):
    """Tiny CPU shapes under the Triton interpreter (--dry) or the real ones on CUDA."""
    global DEV, DRY, V, W
    if dry:
        os.environ["TRITON_INTERPRET"] = "1"
        DEV, DRY, V = "cpu", True, 1000
        W = (V + 31) // 32


def emit(line=""):
    LINES.append(line)
    print(line, flush=True)


def S(big, small):
    """The benchmark shape, or a tiny one for --dry."""
    return small if DRY else big


def time_ms(fn, graph=True):
    fn()
    if DRY:
        return 1.0
    torch.cuda.synchronize()
    if graph:
        try:
            return triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median")
        except Exception:                                    # noqa: BLE001 - the path syncs: time it plainly
            torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def rotating(make, set_bytes, l2_bytes):
    """Enough independent input sets that cycling through them exceeds 4x the L2; returns a `next()` getter."""
    n = max(1, min(16, math.ceil(4 * l2_bytes / max(set_bytes, 1))))
    sets = [make() for _ in range(n)]
    state = {"i": 0}

    def nxt():
        s = sets[state["i"] % n]
        state["i"] += 1
        return s
    return nxt


def row(kernel, shape, t_ms, twin_ms, nbytes, bw, note=""):
    gbs = nbytes / (t_ms * 1e-3) / 1e9
    r = dict(kernel=kernel, shape=shape, triton_us=t_ms * 1e3, twin_us=None if twin_ms is None else twin_ms * 1e3,
             bytes=nbytes, gbs=gbs, roofline=gbs / bw, note=note)
    ROWS.append(r)
    tw = "-" if twin_ms is None else f"{twin_ms * 1e3:9.1f}"
    sp = "-" if twin_ms is None else f"{twin_ms / t_ms:6.1f}x"
    emit(f"{kernel:22s} {shape:34s} {t_ms * 1e3:9.1f} {tw:>9s} {sp:>8s} {nbytes / 1e6:9.1f} {gbs:8.0f} "
        f"{gbs / bw:6.0%}  {note}")


def ceilings():
    n = 1 << 29                                             # 2 GiB of fp32: far beyond the L2
    x = torch.randn(n, device=DEV)
    y = torch.empty_like(x)
    t = triton.testing.do_bench(lambda: y.copy_(x), warmup=10, rep=100, return_mode="median")
    bw = 2 * x.numel() * 4 / (t * 1e-3) / 1e9
    x = y = None                                            # free the 4 GiB before the matmul
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    t = triton.testing.do_bench(lambda: a @ b, warmup=10, rep=100, return_mode="median")
    tflops = 2 * 8192 ** 3 / (t * 1e-3) / 1e12
    return bw, tflops


def rand_bitmask(rows, density=0.5, span=1):
    """Each token allowed with probability `density`; span > 1 decides runs of `span` tokens together (real
    grammar masks ban or allow whole ranges: most of the vocabulary in a structural JSON state)."""
    bits = torch.rand(rows, -(-W * 32 // span), device=DEV) < density
    bits = bits.repeat_interleave(span, dim=1)[:, :W * 32]
    packed = (bits.view(rows, W, 32).to(torch.int64) << torch.arange(32, device=DEV)).sum(-1)
    return ((packed + 2**31) % 2**32 - 2**31).to(torch.int32)


def bitmask_floor(mask: torch.Tensor) -> int:
    """Fewest bytes for masking fp32 logits in place: the mask, plus a write of every 32-byte sector (8 tokens) whose
    tokens are all banned, plus read + write of every sector holding banned and allowed tokens (a partial-sector
    write needs the sector's old bytes: the memory system fetches them first)."""
    R = mask.shape[0]
    bits = (mask.unsqueeze(-1) >> torch.arange(32, device=mask.device, dtype=torch.int32)) & 1
    banned = (bits.view(R, -1)[:, :V] == 0)
    pad = (-V) % 8
    per_sector = torch.nn.functional.pad(banned, (0, pad)).view(R, -1, 8)
    full, some = per_sector.all(-1), per_sector.any(-1)
    return mask.numel() * 4 + 32 * int(full.sum()) + 2 * 32 * int((some & ~full).sum())
