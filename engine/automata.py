"""Device token automata for the engine's constraints, built in the background (SpecConfig(draft_masks="automaton")).

Grammar-aware drafting can take its masks from a token-level DFA held on the GPU (token_automaton.py: one mask
row per state, one host sync per draft block) instead of asking the CPU matchers once per draft position. The
engine builds one automaton per distinct regular constraint (a `Regex`, or a `JsonSchema` that outlines-core can
turn into a regular expression), after the constraint compiled:

    outlines-core Index of the regex  ->  token_automaton.from_index (device tables, bounded in bytes)
                                      ->  refine_masks against the compiled constraint's own matcher

Building costs 0.1-10 s (outlines-core's index, ~1 ms per state for the refinement), so it runs on one worker
thread and requests simply draft with CPU masks until it is ready; one automaton serves every request of that
constraint (an extraction run: thousands of requests, one build). Anything that cannot be built (not regular,
a `Triggered` spec, more than `max_bytes` of tables, a regex outlines-core rejects) is remembered as None.

Lossless regardless of how the automaton's language relates to the verifier's: drafts are still checked against
the request's matcher and cut at the first violation (mechanism 3), and a request whose committed output leaves
the automaton's language (DEAD state) stops using it.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

DEFAULT_MAX_BYTES = 256 << 20        # device tables per automaton (masks are states x vocab/8 bytes)


def automaton_key(spec) -> Optional[tuple]:
    """The constraint identity an automaton is shared by (the compiler's own cache key), or None for specs that
    are never regular here (grammars, triggered free text)."""
    from deepinfer_sg.grammars import JsonSchema, Regex
    if not isinstance(spec, (Regex, JsonSchema)):
        return None
    layout = spec.layout_key() if hasattr(spec, "layout_key") else ""
    return (type(spec).__name__, spec.cache_key(), layout)


def build_automaton(spec, compiled, compiler, device, max_bytes: int = DEFAULT_MAX_BYTES):
    """The refined device automaton of `spec`, or None when it cannot be built (the reason is not an error:
    drafting falls back to CPU masks)."""
    from outlines_core import Index
    from deepinfer_sg.grammars import ConstraintError
    from deepinfer_sg.grammars.backend_outlines import outlines_vocabulary, regex_for
    from .token_automaton import AutomatonTooLarge, from_index
    try:
        index = Index(regex_for(spec), outlines_vocabulary(compiler.vocab))
        automaton = from_index(index, compiler.vocab_size, list(compiler.vocab.eos_token_ids), max_bytes=max_bytes,
                               reference=compiled.matcher)
    except (ConstraintError, AutomatonTooLarge, ValueError, RuntimeError):
        return None
    return automaton.to(device)


class AutomatonBuilder:
    """One background build per constraint key; `get` never blocks."""

    def __init__(self, compiler, device, max_bytes: int = DEFAULT_MAX_BYTES):
        self.compiler, self.device, self.max_bytes = compiler, device, max_bytes
        self._futures: dict[tuple, Future] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="deepinfer-automaton")

    def request(self, spec, compiled) -> Optional[tuple]:
        """Start building the automaton of `spec` (once per key); returns the key, or None when none applies."""
        key = automaton_key(spec)
        if key is None:
            return None
        with self._lock:
            if key not in self._futures:
                self._futures[key] = self._pool.submit(build_automaton, spec, compiled, self.compiler, self.device,
                                                       self.max_bytes)
        return key

    def get(self, key: Optional[tuple]):
        """The automaton if it is built (None while building, or when it could not be built)."""
        fut = self._futures.get(key) if key is not None else None
        if fut is None or not fut.done():
            return None
        try:
            return fut.result()
        except Exception:       # a bug in a build must not stop decoding: CPU masks keep working
            return None

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until every started build has finished (tests and benchmarks that want it used at once)."""
        for fut in list(self._futures.values()):
            try:
                fut.result(timeout)
            except Exception:
                pass

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
