"""A GPU-resident token automaton: a REGULAR constraint's token-level DFA stored as device tensors, so that a
masked drafter's sequential Markov loop can fetch each position's mask and advance the grammar state on the
device, with no host round trip per draft position (issue 7, "how masks reach the drafter", option b).

Source: an outlines-core `Index` (regex x vocabulary -> {state: {token: next state}}, EOS listed in final
states). For JSON Schema, outlines-core's `build_regex_from_schema` gives the regex; that only exists for
schemas without recursion, and its language is outlines-core's JSON (string escapes, number syntax,
whitespace), not necessarily the verifier's. Losslessness does not need the two to agree: the drafter
records the masked proposal it sampled from, and the verifier masks with the real matcher; a draft outside the
verifier's grammar is cut (mechanism 3). Agreement only decides acceptance.

Layout (S DFA states renumbered 0..S-1, state S = "terminated": EOS was accepted; V logit width;
W = ceil(V / 32)):
  masks       int32 [S + 1, W]  allowed tokens per state, the bitmask layout of grammars/kernels (bit set =
                                allowed); EOS in final states; the terminated state allows only EOS, like a
                                terminated matcher's fill_mask
  keys        int64 [E]         sorted state * V + token over every non-EOS transition
  next_state  int32 [E]         the transition's target
  final       bool  [S + 1]
Memory: 4 W (S + 1) + 12 E bytes (`nbytes`). Per draft position: one gather of B mask rows and one
searchsorted over E (about log2 E probes per request). Build: O(E) host work after the Index (measured in
benchmarks/mask_delivery.py: a few seconds for a 620-state extraction schema on the 129k DeepSeek vocabulary,
most of it outlines-core's Index), plus `refine_masks` (~1 ms per state) to narrow each row to the verifier's
mask. `walk` advances a committed state on host copies of the tables (the engine's commit path).

Limits (then the drafter keeps CPU matchers): recursion (nested JSON of unbounded depth, EBNF/Lark grammars),
trigger constraints and DSML tool calls (free text until markup, recursive JSON arguments), and DFAs past
`max_bytes` (bounded repetitions multiply states: maxLength on many string fields, wide numeric ranges).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

DEAD = -1        # a token the state does not allow (never produced by a masked drafter)


class AutomatonTooLarge(ValueError):
    """The DFA's device tables would exceed the memory bound given to `from_transitions`."""


@dataclass
class TokenAutomaton:
    masks: torch.Tensor          # int32 [S + 1, W]
    keys: torch.Tensor           # int64 [E], sorted
    next_state: torch.Tensor     # int32 [E]
    final: torch.Tensor          # bool [S + 1]
    initial: int
    vocab_size: int
    eos_token_ids: tuple
    _host: Optional["TokenAutomaton"] = field(default=None, repr=False, compare=False)   # CPU tables for walk()

    @property
    def num_states(self) -> int:
        """DFA states, not counting the terminated state."""
        return self.masks.shape[0] - 1

    @property
    def terminated(self) -> int:
        return self.masks.shape[0] - 1

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.masks, self.keys, self.next_state, self.final))

    def to(self, device) -> "TokenAutomaton":
        """A copy on `device`; it keeps a reference to the host tables for `walk`."""
        out = TokenAutomaton(self.masks.to(device), self.keys.to(device), self.next_state.to(device),
                             self.final.to(device), self.initial, self.vocab_size, self.eos_token_ids)
        out._host = self._host if self._host is not None else (self if self.masks.device.type == "cpu" else None)
        return out

    def walk(self, state: int, tokens) -> int:
        """The state after `tokens` from `state`, on the host tables (committed tokens are on the host already;
        no device work). DEAD once a token is not allowed."""
        host = self._host if self._host is not None else self
        if host.masks.device.type != "cpu":
            host = self._host = TokenAutomaton(self.masks.cpu(), self.keys.cpu(), self.next_state.cpu(),
                                               self.final.cpu(), self.initial, self.vocab_size, self.eos_token_ids)
        s = torch.tensor([int(state)])
        for t in tokens:
            s = host.advance(s, torch.tensor([int(t)]))
        return int(s)

    def initial_states(self, n: int, device=None) -> torch.Tensor:
        return torch.full((n,), self.initial, dtype=torch.long, device=device or self.masks.device)

    def mask_rows(self, states: torch.Tensor) -> torch.Tensor:
        """int32 [B, W] bitmask rows of `states` (long [B]; DEAD rows allow nothing). No host sync."""
        rows = self.masks[states.clamp_min(0)]
        return torch.where((states >= 0).unsqueeze(-1), rows, torch.zeros_like(rows))

    def advance(self, states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Next states (long [B]) after `tokens` (long [B]); a negative token (block ended) keeps the state;
        EOS in a final state goes to the terminated state; a disallowed token gives DEAD. No host sync."""
        V = self.vocab_size
        live = (states >= 0) & (tokens >= 0)
        s, t = states.clamp_min(0), tokens.clamp(0, V - 1)
        key = s * V + t
        if self.keys.numel():
            pos = torch.searchsorted(self.keys, key).clamp_max(self.keys.numel() - 1)
            hit = self.keys[pos] == key
            nxt = torch.where(hit, self.next_state[pos].to(torch.long), torch.full_like(key, DEAD))
        else:
            nxt = torch.full_like(key, DEAD)
        is_eos = torch.zeros_like(live)
        for e in self.eos_token_ids:
            is_eos |= tokens == e
        nxt = torch.where(is_eos, torch.where(self.final[s] & (s != self.terminated),
                                              torch.full_like(key, self.terminated), torch.full_like(key, DEAD)), nxt)
        return torch.where(live, nxt, states)


def table_byte_costs(vocab_size: int) -> tuple[int, int]:
    """Device bytes per state (its mask row + final flag) and per transition (int64 key + int32 next state)."""
    return 4 * ((vocab_size + 31) // 32) + 1, 12


def from_transitions(transitions: dict, initial: int, finals: Sequence[int], vocab_size: int,
                     eos_token_ids: Sequence[int], max_bytes: Optional[int] = None) -> TokenAutomaton:
    """Device-ready tables (on the CPU; `.to(device)` after) from {state: {token: next}} (outlines-core's
    `Index.get_transitions()`, any state ids). Raises AutomatonTooLarge past `max_bytes`."""
    eos = tuple(int(e) for e in eos_token_ids)
    ids = sorted(set(transitions) | set(int(f) for f in finals) | {int(initial)})
    S = len(ids)
    W = (vocab_size + 31) // 32
    E = sum(len(v) for v in transitions.values())
    per_state, per_edge = table_byte_costs(vocab_size)
    need = per_state * (S + 1) + per_edge * E
    if max_bytes is not None and need > max_bytes:
        raise AutomatonTooLarge(f"token automaton needs {need / 2**20:.1f} MiB ({S} states, {E} transitions), "
                                f"over the bound of {max_bytes / 2**20:.1f} MiB")
    dense = {s: i for i, s in enumerate(ids)}
    final = torch.zeros(S + 1, dtype=torch.bool)
    for f in finals:
        final[dense[int(f)]] = True
    final[S] = True
    src, tok, dst = [], [], []
    for s, row in transitions.items():
        ds = dense[s]
        for t, n in row.items():
            if t in eos:
                continue                         # EOS: handled by `final` (goes to the terminated state)
            src.append(ds)
            tok.append(t)
            dst.append(dense[n])
    src_t = torch.tensor(src, dtype=torch.long)
    tok_t = torch.tensor(tok, dtype=torch.long)
    keys = src_t * vocab_size + tok_t
    order = torch.argsort(keys)
    allowed = torch.zeros(S + 1, W * 32, dtype=torch.bool)
    allowed[src_t, tok_t] = True
    for e in eos:
        allowed[:, e] = final                    # EOS allowed where the language may end (and after it)
    return TokenAutomaton(pack_bits(allowed), keys[order], torch.tensor(dst, dtype=torch.int32)[order], final,
                          dense[int(initial)], vocab_size, eos)


def from_index(index, vocab_size: int, eos_token_ids: Sequence[int], max_bytes: Optional[int] = None,
               reference: Optional[Callable[[], object]] = None) -> TokenAutomaton:
    """From an outlines-core `Index` (host copy of its transition dict: O(E) Python work). reference: see
    `refine_masks` (the verifier's matcher factory)."""
    trans = index.get_transitions()
    a = from_transitions(trans, index.get_initial_state(), sorted(index.get_final_states()), vocab_size,
                         eos_token_ids, max_bytes)
    if reference is not None:
        refine_masks(a, trans, index.get_initial_state(), reference)
    return a


def refine_masks(a: TokenAutomaton, transitions: dict, initial: int, reference: Callable[[], object]) -> int:
    """Intersect each state's mask with the verifier's mask at that state, in place (CPU tables).

    reference() -> a fresh matcher of the verifier (grammars protocol: accept, fill_mask, is_terminated). For each
    DFA state, the matcher replays the shortest token path to it (breadth-first over the transitions) and its
    mask is ANDed into the state's row. Why: the verifier's mask can be narrower than the language's (llguidance
    drops non-canonical tokenizations of forced text, e.g. "{" where "{\"" is forced), and a draft it masks out
    is a certain rejection; with the same masks, single-token states (forced drafts) agree too. States whose path
    the verifier refuses keep the DFA's row (the cut handles their drafts). Exactly right only where the
    verifier's mask is a function of the DFA state (checked on random walks by the tests, not assumed).
    Cost: one replay + one fill per state (~1 ms each). Returns the number of states refined."""
    ids = sorted(set(transitions) | {int(initial)})
    dense = {s: i for i, s in enumerate(ids)}
    parent = {int(initial): None}
    order = [int(initial)]
    for s in order:                                   # breadth-first: shortest token paths
        for t, nxt in transitions.get(s, {}).items():
            if nxt not in parent and t not in a.eos_token_ids:
                parent[nxt] = (s, t)
                order.append(nxt)
    row = torch.zeros(1, a.masks.shape[1], dtype=torch.int32)
    refined = 0
    for s in order:
        path, x = [], s
        while parent[x] is not None:
            x, t = parent[x]
            path.append(t)
        m = reference()
        if not all(m.accept(int(t)) for t in reversed(path)) or m.is_terminated():
            continue
        m.fill_mask(row, 0)
        i = dense[s]
        a.masks[i] &= row[0]
        refined += 1
    return refined


def pack_bits(allowed: torch.Tensor) -> torch.Tensor:
    """bool [R, 32 W] -> int32 [R, W] (bit j of word w = column 32 w + j)."""
    R, C = allowed.shape
    out = torch.empty(R, C // 32, dtype=torch.int32)
    shifts = torch.arange(32, dtype=torch.int64)
    for r in range(0, R, 64):                                # row chunks: the int64 temporary stays ~66 MB
        words = (allowed[r:r + 64].view(-1, C // 32, 32).to(torch.int64) << shifts).sum(-1)
        out[r:r + 64] = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # wrap to int32
    return out
