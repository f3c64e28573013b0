"""Device token automata for the engine's constraints, built in the background (SpecConfig(draft_masks="automaton")).

Grammar-aware drafting can take its masks from a token-level DFA held on the GPU (token_automaton.py: one mask
row per state, one host sync per draft block) instead of asking the CPU matchers once per draft position. The
engine builds one automaton per distinct regular constraint (a `Regex`, or a `JsonSchema` that outlines-core can
turn into a regular expression), after the constraint compiled:

    outlines-core Index of the regex  ->  token_automaton.from_index (device tables, bounded in bytes)
                                      ->  refine_masks against the compiled constraint's own matcher

Building costs 0.1-60 s (outlines-core's index, ~1 ms per state for the refinement), so it runs on one worker
thread (the index in a child process bounded in time and memory) and requests draft with CPU masks until it is
ready; one automaton serves every request of that constraint (an extraction run: thousands of requests, one
build). Anything that cannot be built (not regular,
a `Triggered` spec, tables over `AutomatonLimits.max_bytes`, an index over its time or memory bound, a regex
outlines-core rejects) is remembered as None, with the reason in `AutomatonBuilder.failures`.

Lossless regardless of how the automaton's language relates to the verifier's: drafts are still checked against
the request's matcher and cut at the first violation (mechanism 3), and a request whose committed output leaves
the automaton's language (DEAD state) stops using it.
"""
from __future__ import annotations

import pickle
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

DEFAULT_MAX_BYTES = 256 << 20        # device tables per automaton (masks are states x vocab/8 bytes)
DEFAULT_TIMEOUT_S = 60.0             # wall time for outlines-core's index (the child process is killed after)
DEFAULT_MEMORY_BYTES = 8 << 30       # address space of that child process

# outlines-core's index build is neither interruptible nor bounded in memory (a regex's DFA can explode), so it
# runs in a separate bare Python process (no torch: starts in ~0.1 s) under a timeout and an address-space limit,
# and sends back only tables that fit the byte bound.
_CHILD = r"""
import pickle, resource, sys
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
regex, eos, table, per_state, per_edge, max_bytes = pickle.load(sys.stdin.buffer)
try:
    from outlines_core import Index, Vocabulary
    index = Index(regex, Vocabulary(eos, table))
    trans = index.get_transitions()
    states = len(set(trans) | set(index.get_final_states()) | {index.get_initial_state()})
    edges = sum(len(v) for v in trans.values())
    need = per_state * (states + 1) + per_edge * edges
    if need > max_bytes:
        out = ("too_large", f"token automaton needs {need / 2**20:.1f} MiB ({states} states, {edges} transitions), "
                            f"over the bound of {max_bytes / 2**20:.1f} MiB")
    else:
        out = ("ok", (trans, index.get_initial_state(), sorted(index.get_final_states())))
except MemoryError:
    out = ("error", f"outlines-core index: over the {limit >> 20} MiB memory bound")
except Exception as exc:
    out = ("error", f"outlines-core index: {type(exc).__name__}: {exc}")
pickle.dump(out, sys.stdout.buffer, protocol=pickle.HIGHEST_PROTOCOL)
"""


@dataclass
class AutomatonLimits:
    max_bytes: int = DEFAULT_MAX_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S
    memory_bytes: int = DEFAULT_MEMORY_BYTES


def automaton_key(spec) -> Optional[tuple]:
    """The constraint identity an automaton is shared by (the compiler's own cache key), or None for specs that
    are never regular here (grammars, triggered free text)."""
    from deepinfer_sg.grammars import JsonSchema, Regex
    if not isinstance(spec, (Regex, JsonSchema)):
        return None
    layout = spec.layout_key() if hasattr(spec, "layout_key") else ""
    return (type(spec).__name__, spec.cache_key(), layout)


def index_transitions(regex: str, vocab, limits: AutomatonLimits):
    """outlines-core's token transitions of `regex` over `vocab` (grammars TokenizerVocab), built in a bounded
    child process: (transitions, initial, finals), or (None, reason) when it failed or would not fit."""
    from deepinfer_sg.grammars.backend_outlines import vocabulary_table
    from .token_automaton import table_byte_costs
    eos, table = vocabulary_table(vocab)
    per_state, per_edge = table_byte_costs(vocab.vocab_size)
    payload = pickle.dumps((regex, eos, table, per_state, per_edge, limits.max_bytes))
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD, str(limits.memory_bytes)], input=payload,
                              capture_output=True, timeout=limits.timeout_s)
    except subprocess.TimeoutExpired:
        return None, f"outlines-core index: over the {limits.timeout_s:.0f} s time bound"
    if done.returncode != 0 or not done.stdout:
        if b"memory allocation" in done.stderr:          # Rust aborts when the address-space limit bites
            return None, f"outlines-core index: over the {limits.memory_bytes >> 20} MiB memory bound"
        return None, f"outlines-core index: child exited with {done.returncode}: {done.stderr[-300:]!r}"
    status, result = pickle.loads(done.stdout)
    return (result, None) if status == "ok" else (None, result)


def build_automaton(spec, compiled, compiler, device, limits: Optional[AutomatonLimits] = None):
    """The refined device automaton of `spec` and None, or None and the reason it cannot be built (not an
    error: drafting falls back to CPU masks)."""
    from deepinfer_sg.grammars import ConstraintError
    from deepinfer_sg.grammars.backend_outlines import regex_for
    from .token_automaton import AutomatonTooLarge, from_transitions, refine_masks
    limits = limits or AutomatonLimits()
    try:
        regex = regex_for(spec)
    except ConstraintError as exc:
        return None, str(exc)
    found, why = index_transitions(regex, compiler.vocab, limits)
    if found is None:
        return None, why
    trans, initial, finals = found
    try:
        automaton = from_transitions(trans, initial, finals, compiler.vocab_size, list(compiler.vocab.eos_token_ids),
                                     limits.max_bytes)
    except AutomatonTooLarge as exc:
        return None, str(exc)
    refine_masks(automaton, trans, initial, compiled.matcher)
    return automaton.to(device), None


class AutomatonBuilder:
    """One background build per constraint key; `get` never blocks."""

    def __init__(self, compiler, device, limits: Optional[AutomatonLimits] = None):
        self.compiler, self.device, self.limits = compiler, device, limits or AutomatonLimits()
        self.failures: dict[tuple, str] = {}          # key -> why no automaton (for stats and logs)
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
                self._futures[key] = self._pool.submit(self._build, key, spec, compiled)
        return key

    def _build(self, key, spec, compiled):
        automaton, why = build_automaton(spec, compiled, self.compiler, self.device, self.limits)
        if automaton is None:
            self.failures[key] = why
        return automaton

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
