"""A second CUDA stream for independent work inside the decode step (fork / join), so that small kernels of two
independent chains overlap instead of queueing one after the other: a few-row kernel fills a few SMs for a few
microseconds, and the step is hundreds of them (the mid-size V4.1 step at batch 8: ~900 kernels, ~5 ms).

    side = fork(x)            # None: run everything on the current stream (CPU, or switched off)
    with on(side):            # the side chain (a no-op context when side is None)
        y = work(x)
    ...                       # the main chain
    join(side)                # the current stream waits for the side chain before y is used

Same kernels on the same inputs either way, so the results are the same bits with or without the side stream.
Memory is safe without record_stream: `fork` makes the side stream wait for the current one and `join` the other
way round, so a tensor either stream frees is reused (by its stream's allocations) only after both chains are past
it. Inside a CUDA-graph capture the fork and join become graph edges (parallel branches of the graph), and the side
stream's allocations come from the capture's pool (PyTorch routes every stream in the same capture to it).

Used for the shared expert beside the gate and routed experts (engine/moe.py; session 8 R1, mid-size V4.1, H200:
5.15 / 4.58 / 7.93 ms per step with it against 5.57 / 4.68 / 8.46 ms without, bf16 experts at batch 8, fp8 at 8 / 64),
and on a lane of its own ("engram") for the Engram rows the device reads from the pinned tables over PCIe, queued
as the step's graph starts (batched._engram_ahead; `mark` / `wait`: each Engram layer waits only for its rows).
Measured and dropped: the window kv and index queries beside the q heads (pre_attention): within the noise
(+-0.1 ms) in the same runs.
"""
from __future__ import annotations

import contextlib

import torch

# the switch (benchmarks/model_forward.py's "serial-shared" path turns it off to measure what it gives)
ENABLED = True
_SIDE: dict = {}


def fork(x: torch.Tensor, lane: str = "side"):
    """The side stream `lane` of x's CUDA device (one stream per lane: work on two lanes never queues behind each
    other), made to wait for the current stream; None when x is not on CUDA or the switch is off. The stream is
    made on first use, outside any capture (a graph segment's first run is eager)."""
    if not (ENABLED and x.is_cuda):
        return None
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    s = _SIDE.get((dev, lane))
    if s is None:
        s = _SIDE[(dev, lane)] = torch.cuda.Stream(device=dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    return s


def on(side):
    """Context: make `side` the current stream (nothing when side is None)."""
    return torch.cuda.stream(side) if side is not None else contextlib.nullcontext()


def mark(side):
    """An event recorded on `side` now (what is queued there so far), for `wait`; None when side is None."""
    if side is None:
        return None
    ev = torch.cuda.Event()
    ev.record(side)
    return ev


def wait(ev) -> None:
    """The current stream waits for the event (`mark`) before what is queued next (nothing when ev is None)."""
    if ev is not None:
        torch.cuda.current_stream().wait_event(ev)


def join(side) -> None:
    """The current stream waits for everything queued on `side` so far (nothing when side is None)."""
    if side is not None:
        torch.cuda.current_stream(side.device).wait_stream(side)
