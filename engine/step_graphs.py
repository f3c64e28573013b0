"""CUDA graphs for the segments of the batched decode / verify step (engine/batched.py).

Why: a fast decode step of the mid-size model launches thousands of small kernels (projections, norms, RoPE, mHC
mixes, MoE, attention), each costing the host a few microseconds of Python and launch work, so the step was bound
by the host, not by the GPU. A graph replays a whole segment with one launch.

What is captured: everything between two eager cache updates (`batched.span`: the rest of one layer (its index
selection and attention), every layer in between whole, and the next layer's projections; the first segment
starts at the embedding, the last ends with the head). The caches sit at fixed addresses (engine/arena.py). V4.1
has no eager updates (engine/compress_step.py), so its step is one graph; V4's overlapping compressors stay
outside.

Contract:
  * graphs are keyed by the step's token count T (no padding: a padded T would change GEMM shapes and so the
    round-off, and replays must equal eager bit for bit), then by the segment's key (which includes the shapes of
    its index inputs: a key this size never saw is captured when it first comes, also in a replay step);
  * the first `warm` steps with a new T run eager (the first compiles / autotunes the kernels; waiting for a
    second keeps one-off sizes, common with speculative verify rows, from paying a capture), the next captures
    every segment (capture, then replay to compute), later ones replay; at most `max_sizes` token counts are kept
    (least recently used dropped, and counted as new again);
  * inputs: a tensor that is an output of an earlier graph of the same T, a buffer from `stage()` / `upload()` or
    a tensor marked `fixed()` (the caches' slab and arenas, written in place by the graphs; views of an upload) is
    read in place; any other input is copied into the graph's own input buffer before each replay (one copy
    launch);
  * outputs are the graph's own buffers, overwritten by the next replay of that segment: callers must copy what
    they keep beyond the step;
  * weights and fixed tensors must not move after capture: `reset()` drops every graph (the model calls it from
    `set_dtype`, the slab and arenas when they grow).
Cost: capture ~ one eager step plus a device sync per segment, once per T (measured by benchmarks/model_forward.py:
its warm-up steps); replay: one graph launch per segment plus one copy per non-chained input.

`emulate=True` (tests, any device): a "graph" is the function itself re-run on the captured input buffers, its
results copied into the captured output buffers, so the same buffer discipline (inputs copied in, outputs
overwritten by every replay) can be checked on the CPU.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .transfer import to_device


@dataclass
class _Segment:
    graph: "torch.cuda.CUDAGraph"
    inputs: list            # the captured input tensors (None where the input was None)
    outputs: tuple


@dataclass
class _Size:
    """Everything captured for one token count."""
    pool: object
    segments: dict = field(default_factory=dict)    # key -> _Segment
    static: dict = field(default_factory=dict)      # data_ptr -> (shape, stride) of in-place-readable tensors
    staged: dict = field(default_factory=dict)      # name -> persistent input buffer
    pinned: dict = field(default_factory=dict)      # name -> (its pinned host buffer, event of the last copy)
    complete: bool = False


def _signature(t: torch.Tensor):
    return (tuple(t.shape), t.stride(), t.dtype)


class _EmulatedGraph:
    """Stands in for torch.cuda.CUDAGraph on any device: replay = re-run, results copied into the outputs."""

    def __init__(self, fn, inputs, outputs):
        self.fn, self.inputs, self.outputs = fn, inputs, outputs

    def replay(self) -> None:
        for have, new in zip(self.outputs, self.fn(*self.inputs)):
            if have is not None:
                have.copy_(new)


class SegmentGraphs:
    def __init__(self, max_sizes: int = 8, warm: int = 2, emulate: bool = False):
        self.emulate = emulate
        self.max_sizes = max_sizes
        self.warm = warm                 # eager steps at a new T before it is captured
        self._sizes: dict[int, _Size] = {}
        self._seen: dict[int, int] = {}
        self.mode = "eager"              # this step: "eager" | "capture" | "replay"
        self._cur: _Size | None = None
        self.captures = 0                # segments captured so far (for benchmarks / tests)

    def reset(self) -> None:
        """Drop every graph (weights moved, dtype changed, ...)."""
        self._sizes.clear()
        self._seen.clear()
        self.mode, self._cur = "eager", None

    # ------------------------------------------------------------------------------------------ per step
    def begin_step(self, T: int, device: torch.device) -> str:
        """Pick this step's mode for T tokens (module docstring) and return it."""
        self.mode, self._cur = "eager", None
        if device.type != "cuda" and not self.emulate:
            return self.mode
        size = self._sizes.get(T)
        if size is not None and size.complete:
            self._sizes[T] = self._sizes.pop(T)          # most recently used last
            self.mode, self._cur = "replay", size
            return self.mode
        seen = self._seen.get(T, 0)
        if seen < self.warm:
            self._seen[T] = seen + 1
            return self.mode
        while len(self._sizes) >= self.max_sizes:
            old = next(iter(self._sizes))
            del self._sizes[old]
            self._seen[old] = 0          # an evicted size must be warm again before it is recaptured (no thrash)
        self._sizes[T] = self._cur = _Size(pool=None if self.emulate else torch.cuda.graph_pool_handle())
        self.mode = "capture"
        return self.mode

    def end_step(self) -> None:
        if self.mode == "capture" and self._cur is not None:
            self._cur.complete = True
        self.mode, self._cur = "eager", None

    def abort_step(self) -> None:
        """The step failed midway: a half-captured size is dropped (its graphs may be missing segments)."""
        if self.mode == "capture":
            self._sizes = {t: s for t, s in self._sizes.items() if s is not self._cur}
        self.mode, self._cur = "eager", None

    def stage(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """A per-step input (positions' cos/sin, token ids) copied into a persistent buffer that every graph of
        this T reads in place (one copy per step instead of one per graph). Eager steps: `t` itself."""
        size = self._cur
        if size is None:
            return t
        buf = size.staged.get(name)
        if buf is None:
            with torch.inference_mode(False):   # a normal tensor: copied into by later steps in either mode
                buf = size.staged[name] = t.clone()
            size.static[buf.data_ptr()] = _signature(buf)
        else:
            buf.copy_(t)
        return buf

    def upload(self, name: str, host: torch.Tensor, device) -> torch.Tensor:
        """A host tensor on the device in one copy: eager steps through pinned memory (transfer.to_device); graph
        steps into a persistent buffer of this T named `name` (copied asynchronously from pinned memory, so its
        address holds from replay to replay and the graphs read it, or views of it marked `fixed`, in place)."""
        size = self._cur
        device = torch.device(device)
        if size is None or device.type != "cuda":
            t = to_device(host, device)
            if size is None:
                return t
            buf = size.staged.get(name)
            if buf is None:
                with torch.inference_mode(False):
                    buf = size.staged[name] = t.clone()
            else:
                buf.copy_(t)
            return buf
        buf = size.staged.get(name)
        if buf is None:
            with torch.inference_mode(False):
                buf = size.staged[name] = torch.empty(host.shape, dtype=host.dtype, device=device)
                # its own pinned host buffer too (a fresh pinned block per step costs the host more than the
                # copy), reused once the event says the previous copy from it is done (a step ends long after)
                size.pinned[name] = (torch.empty(host.shape, dtype=host.dtype, pin_memory=True), torch.cuda.Event())
        pinned, done = size.pinned[name]
        done.synchronize()
        pinned.copy_(host)
        buf.copy_(pinned, non_blocking=True)
        done.record()
        return buf

    def fixed(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor that keeps its address across steps (the window slab, the entries arenas: engine/arena.py)
        read and written in place by the graphs of this T; its owner calls `reset()` when the address changes."""
        if self._cur is not None:
            self._cur.static[t.data_ptr()] = _signature(t)
        return t

    # ------------------------------------------------------------------------------------------ segments
    def run(self, key, fn: Callable[..., tuple], *inputs) -> tuple:
        """fn(*inputs) -> tuple of tensors (or None), eagerly, by capture + replay, or by replay (this step's
        mode). Same values in every mode."""
        size = self._cur
        if size is None:
            return fn(*inputs)
        seg = size.segments.get(key)
        if seg is None:      # (also in a replay step: a segment key this size never saw, e.g. a new index bucket)
            seg = size.segments[key] = self._capture(size, fn, inputs)
            self.captures += 1
        else:   # (a step passes ~500 inputs, most read in place: this loop is on every step's host path)
            for have, given in zip(seg.inputs, inputs):
                if have is given:
                    continue
                if have is None or given is None:
                    raise RuntimeError(f"graph segment {key}: an input became {'None' if given is None else 'set'}")
                if given.data_ptr() == have.data_ptr() and given.dtype == have.dtype and given.shape == have.shape:
                    continue         # read in place (the same memory as captured)
                if given.shape != have.shape:
                    raise RuntimeError(f"graph segment {key}: input shape {tuple(given.shape)} != captured "
                                       f"{tuple(have.shape)}")
                have.copy_(given)
        seg.graph.replay()
        return seg.outputs

    def _capture(self, size: _Size, fn, inputs) -> _Segment:
        static_in = []
        for t in inputs:
            if t is None or size.static.get(t.data_ptr()) == _signature(t):
                static_in.append(t)
            else:
                with torch.inference_mode(False):   # (copied into by later replays, in either mode)
                    static_in.append(t.clone())
        if self.emulate:
            out = tuple(fn(*static_in))
            for t in out:
                if t is not None:
                    size.static[t.data_ptr()] = _signature(t)
            return _Segment(_EmulatedGraph(fn, static_in, out), static_in, out)
        # warm up on a side stream first (the PyTorch recipe: lazy handles / workspaces are made outside capture)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(*static_in)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=size.pool):
            out = fn(*static_in)
        for t in out:
            if t is not None:
                size.static[t.data_ptr()] = _signature(t)
        return _Segment(graph, static_in, tuple(out))
