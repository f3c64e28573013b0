"""ConstraintCompiler: specs -> compiled constraints, on worker threads, with a byte-bounded cache.

compile(spec) blocks up to `timeout_s` (default 10 s) and raises ConstraintError on any failure,
including a timeout; compile_async(spec) returns a Future. A compile that times out keeps running on its
worker thread (native code cannot be interrupted) but is bounded by llguidance's parser limits, and
identical specs share one in-flight compile, so a hostile schema costs one thread for a while and never
the process. The cache is keyed by (spec, its property order, tokenizer fingerprint, backend) and bounded
in bytes (LRU eviction), unlike xgrammar's default unbounded cache (CVE-2025-32381).
Cost of a cache miss beyond the backend's own compile: one scan of the schema (schema_support.scan_marks: value
checks, ~0.1 µs per keyword); only a schema with keywords to rewrite or refuse (1 in 3 MaskBench schemas)
also pays the exact rewrites (schema_support.prepare: only the subschemas scan marked, and those above them, are
copied and rewritten; the refusal walk and the draft 4-7 `$ref` walk skipped when scan saw nothing for them);
plus the worker-thread hand-off
(tens of µs) where one is used. JSON schemas reach llguidance as JSON text, which it parses ~3x faster than it
converts a dict: one encode per compile (the schema's, or its rewrite's), plus, with the cache on, the schema's own
text for the key when it is rewritten (cache_bytes=0 builds no key at all).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from . import backend_llguidance, schema_support
from .specs import ConstraintError, Grammar, JsonSchema, Regex, Triggered
from .trigger import TriggeredCompiled
from .vocab import TokenizerVocab

BACKENDS = ("auto", "llguidance", "xgrammar", "outlines")

# A blocking compile() of a small spec that llguidance alone compiles runs on the caller's thread: its work
# is bounded by LLParserLimits (grammar size, lexer fuel and states; tests/grammars/test_grammar_compiler.py
# feeds it hostile small schemas), so it cannot run away, and the hand-off to a worker thread (two thread
# wake-ups: 0.1-0.8 ms on an idle many-core host, as much as the compile itself) is saved. Only when the
# caller's timeout leaves room for that bound; larger specs, the xgrammar fallback and compile_async() always
# run on a worker, under the timeout.
INLINE_MAX_CHARS = 16_384
INLINE_MIN_TIMEOUT_S = 1.0


class _NeedsWorker(Exception):
    """An inline compile reached a step that must run on a worker (under the timeout): the xgrammar fallback."""


class ConstraintCompiler:
    """Compiles constraint specs for one tokenizer.

    tokenizer: a `tokenizers.Tokenizer` (or an HF fast tokenizer); vocab_size: the model's logit width
    (default: the tokenizer's; 129,280 for DeepSeek-V4); eos_token_ids: default the tokenizer's EOS.
    backend: "auto" (llguidance, or xgrammar when llguidance cannot and xgrammar is exact), or one
    backend by name. Building the compiler decodes the vocabulary once (~1 s for 129k tokens).
    """

    def __init__(self, tokenizer, vocab_size=None, eos_token_ids=None, backend="auto", timeout_s=10.0,
                 cache_bytes=512 << 20, max_workers=2):
        if backend not in BACKENDS:
            raise ConstraintError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.vocab = TokenizerVocab.from_tokenizer(tokenizer, vocab_size, eos_token_ids)
        self.vocab_size = self.vocab.vocab_size
        self.backend = backend
        self.timeout_s = timeout_s
        self.cache_bytes = int(cache_bytes)
        self._cache: OrderedDict = OrderedDict()
        self._cached_bytes = 0
        self._inflight: dict = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile")
        backend_llguidance.lltokenizer(self.vocab)  # build once, up front

    # -- public API -------------------------------------------------------------------------------
    def compile(self, spec):
        """Compiled constraint for `spec` (cached). Raises ConstraintError (invalid, unsupported, timeout).
        Small llguidance-only specs compile on the calling thread (see INLINE_MAX_CHARS)."""
        key, running = None, False
        if self.cache_bytes > 0:  # (cache off: no key to build and nothing to look up; an inline compile then shares
            # no in-flight compile of the same spec, whose result only the cache would have kept)
            key = self._key(spec)
            with self._lock:
                hit = self._cache.get(key)
                if hit is not None:
                    self._cache.move_to_end(key)
                    return hit
                running = key in self._inflight
        if not running and self._inline_ok(spec, key):
            try:
                compiled = self._build(spec, inline=True)
                return compiled if key is None else self._store(key, compiled)
            except _NeedsWorker:
                pass  # the rest runs on a worker, under the timeout
            except ConstraintError:
                raise
            except RecursionError:  # (the schema walks, with the cache off: no key was encoded to find it first)
                raise ConstraintError("JSON schema is nested too deeply (or contains itself)") from None
            except Exception as e:  # a backend bug fails this constraint only
                raise ConstraintError(f"internal error compiling {_describe(spec)}: {type(e).__name__}: {e}") from None
        future = self.compile_async(spec)
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise _timed_out(self.timeout_s, spec) from None

    def compile_async(self, spec) -> Future:
        """Future[compiled constraint]; the compile runs on a worker thread (GIL released in the backends)."""
        key = self._key(spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                done = Future()
                done.set_result(hit)
                return done
            running = self._inflight.get(key)
            if running is not None:
                return running
            future = self._pool.submit(self._compile_and_store, key, spec)
            self._inflight[key] = future
            return future

    @property
    def cached_bytes(self) -> int:
        return self._cached_bytes

    def close(self):
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- internals --------------------------------------------------------------------------------
    def _key(self, spec):
        compile_key = getattr(spec, "compile_key", None)
        if compile_key is not None:  # our specs: one string that determines the compile exactly
            return (compile_key(), "", self.vocab.fingerprint, self.backend)
        if not hasattr(spec, "cache_key"):
            raise ConstraintError(f"not a constraint spec: {type(spec).__name__} (use Regex, JsonSchema, Grammar, Triggered)")
        layout = spec.layout_key() if hasattr(spec, "layout_key") else ""
        return (spec.cache_key(), layout, self.vocab.fingerprint, self.backend)

    def _inline_ok(self, spec, key) -> bool:
        """Whether compile() may try `spec` on the caller's thread: an llguidance backend, a timeout that leaves
        room, and a spec of at most INLINE_MAX_CHARS: its cache key (larger ones then go to compile_async, where
        concurrent compiles of the same spec share one), or with the cache off (no key) a Regex / Grammar text
        (a JSON schema's grammar text is measured once made, in _llguidance: past it, only the backend compile
        moves to a worker)."""
        if self.backend not in ("auto", "llguidance") or self.timeout_s < INLINE_MIN_TIMEOUT_S:
            return False
        if key is not None:
            return len(key[0]) <= INLINE_MAX_CHARS
        inner = spec.inner if isinstance(spec, Triggered) else spec
        text = inner.pattern if isinstance(inner, Regex) else inner.text if isinstance(inner, Grammar) else ""
        return len(text) <= INLINE_MAX_CHARS

    def _compile_and_store(self, key, spec):
        try:
            compiled = self._compile_now(spec)
        except ConstraintError:
            raise
        except Exception as e:  # a backend bug must fail this constraint only, never the caller's thread
            raise ConstraintError(f"internal error compiling {_describe(spec)}: {type(e).__name__}: {e}") from None
        finally:
            with self._lock:
                self._inflight.pop(key, None)
        return self._store(key, compiled)

    def _store(self, key, compiled):
        """Cache `compiled` (LRU, bounded in bytes); the cached object if another thread stored one first."""
        if compiled.nbytes > self.cache_bytes:
            return compiled  # too large to cache (or the cache is off)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                return hit
            if compiled.nbytes <= self.cache_bytes:
                self._cache[key] = compiled
                self._cached_bytes += compiled.nbytes
                while self._cached_bytes > self.cache_bytes:
                    _, old = self._cache.popitem(last=False)
                    self._cached_bytes -= old.nbytes
        return compiled

    def _compile_now(self, spec):
        """The compile a worker runs (no inline shortcuts)."""
        return self._build(spec, inline=False)

    def _build(self, spec, inline: bool):
        if isinstance(spec, Triggered):
            for t in spec.trigger_token_ids + ((spec.bound_token_id,) if spec.bound_token_id is not None else ()):
                if not 0 <= t < self.vocab.n_tokens:
                    raise ConstraintError(f"trigger token id {t} is outside the tokenizer's {self.vocab.n_tokens} ids")
            return TriggeredCompiled(spec, self._build(spec.inner, inline), self.vocab)
        if isinstance(spec, JsonSchema):
            return self._compile_json(spec, inline)
        if isinstance(spec, (Regex, Grammar)):
            return self._compile_text(spec)
        raise ConstraintError(f"not a constraint spec: {type(spec).__name__}")

    def _compile_text(self, spec):
        if self.backend in ("auto", "llguidance"):
            return backend_llguidance.compile_spec(spec, self.vocab)
        return _backend_module(self.backend).compile_spec(spec, self.vocab)

    def _compile_json(self, spec: JsonSchema, inline: bool = False):
        # one cheap walk: value checks + is there anything to rewrite (+ which of the full path's walks can go)
        found, has_unsupported, ref_siblings, dirty = schema_support.scan_marks(spec.schema)
        if found == schema_support.SCAN_AS_IS and self.backend in ("auto", "llguidance"):
            # The common case: valid, nothing to rewrite or refuse, so llguidance gets the schema as given; the
            # full path below runs only if llguidance refuses it.
            try:
                return self._llguidance(spec, inline)
            except ConstraintError as llg_error:
                return self._json_fallback(self._prepare(spec, checked=True), llg_error, inline)
        prepared = self._prepare(spec, checked=found != schema_support.SCAN_INVALID, ref_siblings=ref_siblings,
                                 dirty=dirty)
        if self.backend in ("xgrammar", "outlines"):
            bad = schema_support.unsupported(prepared.schema, self.backend)
            if bad:
                raise schema_support.refuse(*bad[0], why=f"{self.backend} does not implement it exactly")
            return _backend_module(self.backend).compile_spec(prepared, self.vocab)
        try:
            # (prepare() never introduces a keyword llguidance lacks: with none in the input, nothing to look for)
            bad = schema_support.unsupported(prepared.schema, "llguidance") if has_unsupported else ()
            if bad:
                raise schema_support.refuse(*bad[0])
            return self._llguidance(prepared, inline)
        except ConstraintError as llg_error:
            return self._json_fallback(prepared, llg_error, inline)

    def _llguidance(self, spec: JsonSchema, inline: bool):
        """backend_llguidance.compile_spec(spec). An inline compile whose grammar text (made here once, kept by the
        spec: the text llguidance gets) is over INLINE_MAX_CHARS runs it on a worker, under the timeout; the scan
        and the rewrite, linear in the schema, stay on this thread (not redone there)."""
        if inline and len(spec.layout_key()) > INLINE_MAX_CHARS:
            future = self._pool.submit(backend_llguidance.compile_spec, spec, self.vocab)
            try:
                return future.result(timeout=self.timeout_s)
            except FutureTimeout:
                raise _timed_out(self.timeout_s, spec) from None
        return backend_llguidance.compile_spec(spec, self.vocab)

    @staticmethod
    def _prepare(spec: JsonSchema, checked: bool, ref_siblings: bool = True, dirty: set | None = None) -> JsonSchema:
        """The exact rewrites (schema_support.prepare); check_schema first (ConstraintError with the pointer)
        unless scan() already checked every value. With scan_marks' `dirty` set (and no draft 4-7 $ref siblings),
        only the marked subschemas are copied and rewritten."""
        if not checked:
            schema_support.check_schema(spec.schema)
        marked = checked and dirty is not None and not ref_siblings  # (prepare() copies only marked parts: no text)
        return spec.with_schema(schema_support.prepare(spec.schema, spec.approximations, ref_siblings,
                                                       None if marked else spec.layout_key(), dirty if checked else None))

    def _json_fallback(self, prepared: JsonSchema, llg_error: ConstraintError, inline: bool):
        """llguidance refused `prepared`: try xgrammar when backend="auto" and it is exact, else re-raise with a pointer."""
        if self.backend == "llguidance":
            raise _with_pointer(llg_error, prepared.schema) from None
        if not schema_support.unsupported(prepared.schema, "xgrammar"):
            if inline:
                raise _NeedsWorker  # xgrammar compiles take seconds: on a worker, under the timeout
            from . import backend_xgrammar

            try:
                return backend_xgrammar.compile_spec(prepared, self.vocab)
            except ConstraintError:
                pass  # report llguidance's error: it names the schema location
        raise _with_pointer(llg_error, prepared.schema) from None


def _backend_module(name):
    if name == "xgrammar":
        from . import backend_xgrammar

        return backend_xgrammar
    if name == "outlines":
        from . import backend_outlines

        return backend_outlines
    return backend_llguidance


def _with_pointer(error: ConstraintError, schema) -> ConstraintError:
    """Add the JSON pointer of the keyword llguidance names ("Unimplemented keys: [...]")."""
    msg = str(error)
    marker = "Unimplemented keys: ["
    if marker in msg:
        names = [n.strip().strip('"') for n in msg.split(marker, 1)[1].split("]", 1)[0].split(",")]
        for name in names:
            pointer = schema_support.find_keyword(schema, name)
            if pointer is not None:
                return schema_support.refuse(name, pointer)
    return error


def _timed_out(timeout_s: float, spec) -> ConstraintError:
    return ConstraintError(f"compiling the constraint took longer than {timeout_s} s; refused ({_describe(spec)})")


def _describe(spec) -> str:
    text = spec.cache_key()
    return text if len(text) < 120 else text[:117] + "..."
