"""Which implementation runs: the Triton kernel on CUDA tensors, the plain-torch twin elsewhere.

Tests call the `*_triton` functions directly on CPU tensors with TRITON_INTERPRET=1 (set by tests/conftest.py),
so the same kernels CI checks are the ones the H200 runs.
"""
import contextlib
import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


def use_triton(t: torch.Tensor) -> bool:
    """True when `t` lives on a CUDA device (and DEEPINFER_SG_KERNELS is not "torch").

    DEEPINFER_SG_KERNELS=torch forces the twins everywhere (to bisect a suspected kernel bug in the engine).
    """
    return t.is_cuda and os.environ.get("DEEPINFER_SG_KERNELS", "triton") != "torch"


def check(cond: bool, message: str) -> None:
    """Raise ValueError(message) unless cond: kernels name the tensor and the shape that is wrong."""
    if not cond:
        raise ValueError(message)


# Triton 3.6's interpreter computes tl.dot on bf16/fp16 operands wrongly (seen here: garbage of order 1e10), so
# kernels upcast dot operands to fp32 when interpreting; on a GPU the native low-precision dot runs.
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _fix_interpreter_range() -> None:
    """Triton 3.6's interpreter turns a run-time scalar into a Python int with int(ndarray of shape (1,)), which
    NumPy >= 2.3 refuses, so `for i in range(0, n, BLOCK)` over a kernel argument fails in CI. Give its tensors
    an __index__ that takes the single element. Only the interpreter is touched; compiled kernels are not."""
    import triton.runtime.interpreter as interpreter
    original = interpreter._patch_lang_tensor
    if getattr(original, "_deepinfer_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
    patched._deepinfer_fixed = True
    interpreter._patch_lang_tensor = patched


if INTERPRETING:
    _fix_interpreter_range()


def empty(shape, dtype, device) -> torch.Tensor:
    """torch.empty for kernel outputs; with DEEPINFER_SG_POISON=1 (the kernel tests set it) filled with NaN or a
    large negative sentinel, so an element a kernel forgets to write shows up in the comparison."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if os.environ.get("DEEPINFER_SG_POISON") == "1":
        t.fill_(float("nan") if t.is_floating_point() else -123456789)
    return t


_TICKETS: dict = {}     # (device, site) -> int32 zeros, shared by the split launches of one site


def tickets(device, n: int, site: str = "main") -> torch.Tensor | None:
    """n zeroed int32 ticket counters for a split launch: the programs of one output tile take a ticket each, and
    the last to arrive merges the partials and puts its counter back to 0, so every launch leaves them zero.

    Kept per device and site, grown when a launch needs more. Launches that run in turn (one stream) may share a
    site's counters; launches that may overlap (two streams, e.g. the shared expert beside the routed experts) must
    name different sites. While a CUDA graph is being captured the counters cannot be made or grown (an allocation
    made during capture belongs to the graph's private pool), so then the answer is None and the caller takes its
    unsplit path; the warm-up step before a capture makes them."""
    key = (_indexed(device), site)
    t = _TICKETS.get(key)
    if t is None or t.numel() < n:
        if key[0].type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        if t is not None:     # (kept alive: a CUDA graph captured earlier may hold its address)
            _RETIRED.append(t)
        t = _TICKETS[key] = torch.zeros(max(n, 4096), dtype=torch.int32, device=key[0])
    return t[:n]


_RETIRED: list = []     # ticket buffers that a bigger one replaced


def _indexed(device) -> torch.device:
    """The device with its index ("cuda" -> "cuda:<current>"), so that one device is one key."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


@functools.cache
def _properties(index: int):
    """A CUDA device's properties, asked once (launch-time rules read them on every launch)."""
    return torch.cuda.get_device_properties(index)


def one_wave(programs: int, device) -> bool:
    """Whether a grid of `programs` programs starts in one wave (at most one an SM): then its programs may let the
    next kernel launch at once (`pdl_trigger` first: the next kernel's waiting programs cannot hold back ours, all
    already started); kernels/hc_mix.py sizes its write-back tiles by it."""
    return programs <= sm_count(device)


def sm_count(device) -> int:
    """Multiprocessors of a CUDA device (132 on an H200; 132 for the interpreter and the CPU, so that launch shapes
    under test are the H200's)."""
    device = _indexed(device)
    if device.type != "cuda":
        return 132
    return _properties(device.index).multi_processor_count


# Programmatic dependent launch (Hopper): a kernel launched with `pdl_kw()` may be scheduled before the kernel
# launched before it on the stream has finished, and must call `pdl_wait` before it writes anything, or reads
# anything an earlier kernel writes (weights it may read before). DEEPINFER_SG_PDL=0 turns it off everywhere (to
# bisect a suspected ordering bug); benchmarks flip `PDL` to time both.
PDL = os.environ.get("DEEPINFER_SG_PDL", "1") != "0"


def pdl_kw() -> dict:
    """Launch keywords of a kernel that calls `pdl_wait` before it touches memory an earlier kernel writes: only its
    launch and scheduling (and reads of constant inputs) overlap the previous kernel's tail. Off in the
    interpreter (no griddepcontrol there) and before Hopper (griddepcontrol needs sm_90)."""
    on = PDL and not INTERPRETING and _has_griddepcontrol()
    return dict(PDL=on, launch_pdl=True) if on else dict(PDL=False)


@contextlib.contextmanager
def pdl_as(on: bool):
    """PDL on / off for the launches inside the block, then as it was (benchmarks time both ways in one process)."""
    global PDL
    was, PDL = PDL, on
    try:
        yield
    finally:
        PDL = was


def _has_griddepcontrol() -> bool:
    """Whether the current CUDA device can run programmatic dependent launch (sm_90+)."""
    return torch.cuda.is_available() and _properties(torch.cuda.current_device()).major >= 9


@triton.jit
def pdl_trigger(PDL: tl.constexpr):
    """(a kernel followed by a PDL launch) let the next kernel's programs be scheduled once every program of this
    one has started (or finished); call it only where the next kernel's waiting programs cannot hold back this
    one's later programs (one wave, or near the end)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """(a PDL-launched kernel) wait until the previous kernel has finished and its writes are visible."""
    if PDL:
        gdc_wait()
