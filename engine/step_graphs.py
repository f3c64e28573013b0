"""CUDA graphs for the segments of the batched decode / verify step (engine/batched.py).

Why: a fast decode step of the mid-size model launches thousands of small kernels (projections, norms, RoPE, mHC
mixes, MoE, attention), each costing the host a few microseconds of Python and launch work, so the step was bound
by the host, not by the GPU. A graph replays a whole segment with one launch.

What is captured: everything between two eager cache updates (`batched.span`: the rest of one layer (its index
selection and attention), every layer in between whole, and the next layer's projections; the first segment
starts at the embedding, the last ends with the head). The caches sit at fixed addresses (engine/arena.py). V4.1
has no eager updates (engine/compress_step.py); its Engram rows are gathered inside the graph from in-memory
tables pinned on the host (batched.engram_on_device), so with those its step is one graph. Tables the device cannot
read (memory-mapped ones: every loaded checkpoint's, engine/loader.py) cut it between layers before their Engram
layer (batched.engram_splits: the host reads a segment's table rows while the device runs the segments before
it); V4's overlapping compressors stay outside.

Contract:
  * graphs are keyed by the step's token count T (no padding: a padded T would change GEMM shapes and so the
    round-off, and replays must equal eager bit for bit), then by the segment's key (which includes the shapes of
    its index inputs: a key this size never saw is captured when it first comes, also in a replay step);
  * the first `warm` steps with a new T run eager (the first compiles / autotunes the kernels; waiting for a
    second keeps one-off sizes, common with speculative verify rows, from paying a capture), the next captures
    every segment (capture, then replay to compute), later ones replay; at most `max_sizes` token counts are kept
    (least recently used dropped, and counted as new again);
  * inputs: a tensor that is an output of an earlier graph of the same T, a buffer from `stage()` / `upload()` /
    `ids_buffers()` or a tensor marked `fixed()` (the caches' slab and arenas, written in place by the graphs;
    views of an upload) is read in place; any other input is copied into the graph's own input buffer before each
    replay (one copy launch); `run(..., pre=(dst, src))` copies src into dst inside the segment's graph, at its
    start (the token ids from their pinned host buffer: a copy node, no host->device call at launch);
  * outputs are the graph's own buffers, overwritten by the next replay of that segment: callers must copy what
    they keep beyond the step;
  * weights and fixed tensors must not move after capture: `reset()` drops every graph (the model calls it from
    `set_dtype`, the slab and arenas when they grow).
Cost: capture ~ one eager step plus a device sync per segment, once per T (measured by benchmarks/model_forward.py:
its warm-up steps); replay: one graph launch per segment plus one copy per non-chained input. The launch of the
mid-size step's one graph holds the host 38-72 us (session 16 R1, H200, batch 64), and the step's graphs as run
take 0.11 ms longer than replayed back to back. Measured and deleted (R1, same process, batch 64): the step cut
before its first Engram layer, so that the device starts on a one-layer graph while the host launches the rest:
the graphs as run 3.82 ms against 3.82-3.84 uncut, the step 4.30 against 4.25-4.45 (a slow phase of the host).

`emulate=True` (tests, any device): a "graph" is the function itself re-run on the captured input buffers, its
results copied into the captured output buffers, so the same buffer discipline (inputs copied in, outputs
overwritten by every replay) can be checked on the CPU.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Callable

import torch



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
    pinned: dict = field(default_factory=dict)      # name -> _Pinned: its two pinned host buffers
    views: dict = field(default_factory=dict)       # upload name -> (its buffer, the views `upload_parts` made)
    fixed_now: dict = field(default_factory=dict)   # id -> tensor `fixed()` this step (folded into static at capture)
    ids: tuple | None = None                        # (host, device, event) buffers of the token ids (`ids_buffers`)
    complete: bool = False


@dataclass
class Ready:
    """A captured segment whose replay a step prepared (SegmentGraphs.prepare): its key (run_key's), segment, and the
    graphs' generation then (a reset() since retires the segment: replay_ready refuses it)."""
    key: tuple
    seg: _Segment
    generation: int


class _Pinned:
    """The two pinned host buffers of an upload, used in turn: the host writes one (a step's plan, laid out while the
    device may still run the step before, whose copy read the other) while the last copy from the other may still
    be queued. Each has the event of its last copy."""

    def __init__(self, shape, dtype):
        self.bufs = [torch.empty(shape, dtype=dtype, pin_memory=True) for _ in range(2)]
        self.done = [copy_event() for _ in range(2)]
        self.next = 0

    def _turn(self) -> int:
        """The index of the buffer to write now (its last copy done)."""
        k, self.next = self.next, 1 - self.next
        wait_done(self.done[k])
        return k

    def take(self) -> torch.Tensor:
        """The buffer to write now (its last copy done)."""
        return self.bufs[self._turn()]

    def copy(self, host: torch.Tensor, buf: torch.Tensor) -> None:
        """buf <- host asynchronously: from `host` itself when it is one of the two (written in place), else
        through the next one. (Buffers are told apart by address: `list.index` would compare tensors by value.)"""
        k = next((k for k, b in enumerate(self.bufs) if b.data_ptr() == host.data_ptr()), None)
        if k is None:
            k = self._turn()
            self.bufs[k].copy_(host)
        buf.copy_(self.bufs[k], non_blocking=True)
        self.done[k].record()


def _staging(size: "_Size", name: str, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The persistent device buffer of the upload `name` at this T (and on CUDA its pair of pinned host buffers)."""
    with torch.inference_mode(False):
        buf = size.staged[name] = torch.empty(shape, dtype=dtype, device=device)
        if device.type == "cuda":
            size.pinned[name] = _Pinned(shape, dtype)
    return buf


def _signature(t: torch.Tensor):
    return (tuple(t.shape), t.stride(), t.dtype)


def run_key(key: tuple, pre) -> tuple:
    """The key `SegmentGraphs.run` keeps a segment under: a segment with a `pre` copy is another graph."""
    return key if pre is None else key + ("pre",)


def copy_event() -> torch.Event:
    """An event that marks when a copy out of a pinned buffer has run, recorded on the current stream after the copy.
    A torch.Event: its record() finds the current stream in C++, where torch.cuda.Event.record() first asks
    Python's torch.cuda.current_stream() (8.3 us on the H200's host, session 15 R2). The plan's one record took 43 us
    there (R2), 4.1-6.0 as a torch.Event (R3); its copy 39-54 us, where a copy right after took 12-14: the first
    driver calls after the plan's ~3 ms of Python pay for cold host caches (with this event the next call paid it)."""
    return torch.Event(device="cuda")


def wait_done(done: "torch.Event | None") -> None:
    """Wait until the last copy out of a pinned buffer has run (before the host writes it again; None: nothing to
    wait for, a CPU buffer). By the time a
    step reuses its buffer the copy finished long ago, so a query (no synchronisation) answers; synchronising
    every time made these the 5 of the 7 sync calls per decode step that the profiler counted (session 6)."""
    if done is not None and not done.query():
        done.synchronize()


def _views(buf: torch.Tensor, shapes: list) -> list[torch.Tensor]:
    """Consecutive views of a flat buffer in the given shapes."""
    views, at = [], 0
    for shp in shapes:
        n = 1
        for d in shp:
            n *= d
        views.append(buf[at:at + n].view(shp))
        at += n
    return views


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
        self.keep_graph = False          # keep each graph's cudaGraph_t (raw_cuda_graph(): probes count its nodes)
        self._retired: list = []         # (event, sizes) dropped by reset(), freed once the event passed
        self.generation = 0              # reset() calls so far (weights may have moved since a check made before)

    def reset(self) -> None:
        """Drop every graph (weights moved, dtype changed, ...). A replay may still be running (a step planned
        ahead grows an arena while the device runs the previous step): the dropped graphs and their memory are
        kept until an event recorded now has passed (checked at the next steps)."""
        self.generation += 1
        if self._sizes and not self.emulate:
            done = torch.cuda.Event()
            done.record()
            self._retired.append((done, list(self._sizes.values())))
        self._sizes.clear()
        self._seen.clear()
        self.mode, self._cur = "eager", None

    # ------------------------------------------------------------------------------------------ per step
    def begin_step(self, T: int, device: torch.device) -> str:
        """Pick this step's mode for T tokens (module docstring) and return it."""
        self.mode, self._cur = "eager", None
        if self._retired:
            self._retired = [(done, sizes) for done, sizes in self._retired if not done.query()]
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
        if self._cur is not None:
            self._cur.fixed_now.clear()
            if self.mode == "capture":
                self._cur.complete = True
        self.mode, self._cur = "eager", None

    def abort_step(self) -> None:
        """The step failed midway: a half-captured size is dropped (its graphs may be missing segments)."""
        if self.mode == "capture":
            self._sizes = {t: s for t, s in self._sizes.items() if s is not self._cur}
        elif self._cur is not None:
            self._cur.fixed_now.clear()
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
        """A host tensor on the device in one copy (`prepare_upload` + its send, at once)."""
        (buf,), send = self.prepare_upload(name, host, device, [tuple(host.shape)])
        send()
        return buf

    def upload_parts(self, name: str, host: torch.Tensor, device, shapes: list) -> list[torch.Tensor]:
        """`upload` of a flat host tensor, returned as views of the given shapes (in order)."""
        views, send = self.prepare_upload(name, host, device, shapes)
        send()
        return views

    def prepare_upload(self, name: str, host: torch.Tensor, device, shapes: list) -> tuple[list, Callable]:
        """The device side of an upload of the flat host tensor `host`, without copying yet: (views of the device
        buffer in the given shapes, each `fixed`; send() which copies `host` as it is when called). Eager steps: a
        fresh buffer, copied through pinned memory (`pin_memory`, which keeps a tensor already pinned; on the CPU
        the host tensor itself); graph steps: a persistent buffer of this T named `name` with its own two pinned
        host buffers (a fresh pinned block per step costs the host more than the copy), each reused once the event
        says the previous copy from it is done (_Pinned), so the address holds from replay to replay and the graphs
        read it in place. Under graphs the views are made once per name and buffer and then returned as the same
        objects, so a replay's input check finds them by identity (~500 inputs per step: a data_ptr / shape
        comparison each cost the host ~0.5 ms per step). Why split: the plan of a step lays its upload out
        before the token ids are known (Model.plan_step), the send comes at launch."""
        size = self._cur
        device = torch.device(device)
        if size is None:
            if device.type == "cuda":
                with torch.inference_mode(False):
                    buf = torch.empty(host.shape, dtype=host.dtype, device=device)

                def send():    # (pinned, then an asynchronous copy: a pageable source would wait for the device)
                    buf.copy_(host.pin_memory(), non_blocking=True)
            else:
                buf, send = host, (lambda: None)
            return _views(buf, shapes), send
        buf = size.staged.get(name)
        if buf is None:
            buf = _staging(size, name, host.shape, host.dtype, device)
        if device.type == "cuda":
            pinned = size.pinned[name]

            def send():     # (no host copy when `host` is one of its pinned buffers: host_buffer)
                pinned.copy(host, buf)
        else:
            def send():
                buf.copy_(host)
        got = size.views.get(name)
        if got is not None and got[0] is buf:
            views = got[1]
        else:
            views = _views(buf, shapes)
            size.views[name] = (buf, views)
        for v in views:
            if v.numel():
                self.fixed(v)
        return views, send

    def ids_buffers(self, T: int, device) -> tuple | None:
        """(host, device, event) buffers of a graph step's T token ids: the launch writes the ids into `host`
        (pinned on CUDA; after the event of the last replay that read it) and the step's first graph copies them
        into `device` itself (`run`'s `pre`: a copy node of the graph, no host->device call at launch). None in
        eager steps."""
        size = self._cur
        if size is None:
            return None
        if size.ids is None:
            device = torch.device(device)
            cuda = device.type == "cuda"
            with torch.inference_mode(False):
                dev = torch.empty(T, dtype=torch.int64, device=device)
            size.static[dev.data_ptr()] = _signature(dev)      # (read in place by the graphs)
            size.ids = (torch.empty(T, dtype=torch.int64, pin_memory=cuda), dev, copy_event() if cuda else None)
        return size.ids

    def host_buffer(self, name: str, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor | None:
        """Where to write the host side of the upload `name` so that its send copies nothing on the host: under
        graphs on CUDA one of the upload's two pinned buffers (in turn, once its last copy is done: _Pinned), eagerly
        on CUDA a fresh pinned tensor; None elsewhere (any host tensor will do)."""
        if torch.device(device).type != "cuda":
            return None
        size = self._cur
        if size is None:
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        if name not in size.pinned:
            _staging(size, name, shape, dtype, torch.device(device))
        pinned = size.pinned[name]
        if tuple(pinned.bufs[0].shape) != tuple(shape) or pinned.bufs[0].dtype != dtype:
            return None
        return pinned.take()

    def fixed(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor that keeps its address across steps (the window slab, the entries arenas: engine/arena.py)
        read and written in place by the graphs of this T; its owner calls `reset()` when the address changes.
        Noted for this step only (cheap: every step names its fixed tensors again); a capture reads the notes."""
        if self._cur is not None:
            self._cur.fixed_now[id(t)] = t
        return t

    # ------------------------------------------------------------------------------------------ segments
    def prepare(self, key, inputs: list, pre: tuple | None = None) -> "Ready | None":
        """In a replay step, the captured segment that `run(key, fn, *inputs, pre=pre)` would replay when every input
        is the object it captured (nothing to copy in: the steady decode step), for `replay_ready` to launch with no
        other host work; else None (then `run` it). Model.plan_step prepares the step's first graph so, and its
        launch replays it as soon as the token ids are in their host buffer."""
        size = self._cur
        if size is None or self.mode != "replay":
            return None
        key = run_key(key, pre)
        seg = size.segments.get(key)
        if seg is None or len(seg.inputs) != len(inputs) or not all(map(operator.is_, seg.inputs, inputs)):
            return None
        return Ready(key, seg, self.generation)

    def replay_ready(self, ready: "Ready") -> tuple | None:
        """Replay a segment `prepare` found (in the same step) -> its outputs (`run`'s); None, replaying nothing, when
        the graphs were reset since (weights moved, a switch changed the kernels: the caller `run`s it instead)."""
        if ready.generation != self.generation:
            return None
        ready.seg.graph.replay()
        return ready.seg.outputs

    def run(self, key, fn: Callable[..., tuple], *inputs, pre: tuple | None = None) -> tuple:
        """fn(*inputs) -> tuple of tensors (or None), eagerly, by capture + replay, or by replay (this step's
        mode). Same values in every mode. pre: (dst, src) copied at the segment's start, inside its graph (the
        token ids from their host buffer: `ids_buffers`)."""
        if pre is not None:
            body, (dst, src), key = fn, pre, run_key(key, pre)

            def fn(*a):
                dst.copy_(src, non_blocking=True)
                return body(*a)
        size = self._cur
        if size is None:
            return fn(*inputs)
        seg = size.segments.get(key)
        if seg is None:      # (also in a replay step: a segment key this size never saw, e.g. a new index bucket)
            seg = size.segments[key] = self._capture(size, fn, inputs)
            self.captures += 1
        elif not all(map(operator.is_, seg.inputs, inputs)):
            # (a step passes ~500 inputs, under graphs all of them the captured objects as a rule: checked at C level
            # above; this loop is for the others)
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
        for t in size.fixed_now.values():
            size.static[t.data_ptr()] = _signature(t)
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
        graph = torch.cuda.CUDAGraph(keep_graph=True) if self.keep_graph else torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=size.pool):
            out = fn(*static_in)
        for t in out:
            if t is not None:
                size.static[t.data_ptr()] = _signature(t)
        return _Segment(graph, static_in, tuple(out))
