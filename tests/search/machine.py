"""A Hypothesis state machine over one live session of a tiny model and one store.

It feeds random prefill chunks and single decode steps, saves (in this Store,
or in a new Store over the same folder), looks up random shared lengths of
what it saved, through the index or the host tier, and restores sessions by
name in a new Store.  The oracle for every hit and restore: a fresh cache fed
the hit's own tokens in the same chunks the session was fed (MLX on CPU is not
chunk-invariant), continued with the same tokens, gives the same logits and
holds the same state after every step, bit for bit.
"""

from __future__ import annotations

import random
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from mlx_lm.models.cache import (
    ChunkedKVCache,
    can_trim_prompt_cache,
    make_prompt_cache,
    trim_prompt_cache,
)

import persist
from persist.errors import SessionNotFoundError
from tests.helpers import assert_same_state, live_state, raw

GIB = 1 << 30
MAX_TOKENS = 160  # the session never grows past this: tiny models, quick steps
CONTINUE = 2  # tokens fed after a hit to compare (each a whole call)
BLOCK = 16  # small blocks: sessions of a few dozen tokens have several to damage
NAMES = ["a", "b", "c"]  # "c" only ever by import


@dataclass
class Tally:
    """What one family's search checked: sequences, states, hits, restores, misses."""

    sequences: int = 0
    states: int = 0
    hits: int = 0
    restores: int = 0
    misses: int = 0
    repairs: int = 0
    imports: int = 0
    by_length: dict[int, int] = field(default_factory=dict)


def feed(model: Any, chunks: Sequence[Sequence[int]], cache: list[Any] | None = None) -> list[Any]:
    """A cache fed ``chunks``, one call each (a fresh one unless ``cache`` is given)."""
    cache = make_prompt_cache(model) if cache is None else cache
    for c in chunks:
        model(mx.array([list(c)]), cache=cache)
        mx.eval([x.state for x in cache])
    return cache


def chunks_upto(chunks: Sequence[Sequence[int]], k: int) -> list[list[int]]:
    """The session's chunks cut at ``k`` tokens: a fresh prefill of the first ``k``."""
    out, n = [], 0
    for c in chunks:
        if n >= k:
            break
        out.append(list(c[: k - n]))
        n += len(out[-1])
    return out


def same_continuation(model: Any, got: list[Any], want: list[Any], nxt: Sequence[int]) -> None:
    # A chunked layer is compared from the next call on: a fresh prefill may still
    # hold one position before its last chunk that mlx-lm's next front drop removes
    # (and the saved state no longer has); docs/FORMAT.md "Servable prefixes".
    plain = [i for i, c in enumerate(want) if not isinstance(c, ChunkedKVCache)]
    assert_same_state(live_state([got[i] for i in plain]), live_state([want[i] for i in plain]))
    for i, t in enumerate(nxt):
        a = model(mx.array([[t]]), cache=got)[0, -1]
        b = model(mx.array([[t]]), cache=want)[0, -1]
        mx.eval(a, b)
        assert raw(a) == raw(b), f"logits differ {i + 1} steps after the hit"
        assert_same_state(live_state(got), live_state(want))


class Search(RuleBasedStateMachine):
    """Subclassed per family by ``machine_for`` (model, identity and tally bound)."""

    model: Any = None
    identity: Any = None
    tally: Tally = Tally()
    vocab = 250

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="persist-search-"))
        self.store = persist.Store(self.root / "s", block_tokens=BLOCK)
        self.cache = make_prompt_cache(self.model)
        self.chunks: list[list[int]] = []
        self.saved: list[int] = []  # lengths saved (every one a prefix of the session)
        self.named: dict[str, int] = {}
        self.repaired = False  # a repair may cut or remove any session sharing a blob
        self.rng = random.Random(0)
        self.tally.sequences += 1

    @property
    def tokens(self) -> list[int]:
        return [t for c in self.chunks for t in c]

    def _feed(self, toks: list[int]) -> None:
        feed(self.model, [toks], self.cache)
        self.chunks.append(toks)
        self.tally.states += 1

    @initialize(n=st.integers(1, 48), seed=st.integers(0, 2**16))
    def first_prefill(self, n: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self._feed([self.rng.randrange(self.vocab) for _ in range(n)])

    @precondition(lambda self: len(self.tokens) < MAX_TOKENS - 48)
    @rule(n=st.integers(2, 48))
    def prefill(self, n: int) -> None:
        self._feed([self.rng.randrange(self.vocab) for _ in range(n)])

    @precondition(lambda self: len(self.tokens) < MAX_TOKENS)
    @rule(steps=st.integers(1, 12))
    def decode(self, steps: int) -> None:
        for _ in range(steps):
            self._feed([self.rng.randrange(self.vocab)])

    @precondition(
        lambda self: len(self.tokens) < MAX_TOKENS - 8 and can_trim_prompt_cache(self.cache)
    )
    @rule(n=st.integers(2, 8), data=st.data())
    def speculative_round(self, n: int, data: st.DataObject) -> None:
        """Draft tokens fed in one call, the rejected ones trimmed (mlx-lm's
        speculative decoding): the cache holds the accepted ones as that call's chunk."""
        toks = [self.rng.randrange(self.vocab) for _ in range(n)]
        rejected = data.draw(st.integers(1, n - 1), label="rejected")
        feed(self.model, [toks], self.cache)
        if not can_trim_prompt_cache(self.cache):  # a ring the drafts filled: all kept
            rejected = 0
        assert trim_prompt_cache(self.cache, rejected) == rejected
        self.chunks.append(toks[: n - rejected])
        self.tally.states += 1

    @rule(session=st.sampled_from([None, "a", "b"]), host=st.booleans())
    def save(self, session: str | None, host: bool) -> None:
        """Save in a new Store over the same folder (host tier or not)."""
        self._reopen(host)
        self.store.save(self.cache, self.tokens, identity=self.identity, session=session)
        self.saved.append(len(self.tokens))
        if session is not None:
            self.named[session] = len(self.tokens)

    def _reopen(self, host: bool) -> None:
        self.store.close()
        self.store = persist.Store(
            self.root / "s", block_tokens=BLOCK, host_cache=GIB if host else None
        )

    @precondition(lambda self: bool(self.saved))
    @rule(
        pick=st.integers(0, 1 << 16),
        frac=st.one_of(st.just(1.0), st.floats(0, 1)),  # whole: recurrent state serves only it
        reopen=st.booleans(),
    )
    def lookup(self, pick: int, frac: float, reopen: bool) -> None:
        """A prompt sharing h tokens of a saved length, then a token it did not have."""
        if reopen:
            self._reopen(False)
        toks = self.tokens
        n = self.saved[pick % len(self.saved)]
        h = max(1, min(n, round(frac * n)))
        other = (toks[h] + 1) % self.vocab if h < len(toks) else 0
        hit = self.store.lookup([*toks[:h], other, 7], identity=self.identity)
        if hit is None:
            self.tally.misses += 1
            return
        k = len(hit.tokens)
        assert k <= h and hit.tokens == toks[:k]
        want = feed(self.model, chunks_upto(self.chunks, k))
        same_continuation(self.model, hit.cache, want, [other, 7][:CONTINUE])
        self.tally.hits += 1
        self.tally.by_length[k] = self.tally.by_length.get(k, 0) + 1

    @precondition(lambda self: bool(self.named))
    @rule(name=st.sampled_from(["a", "b"]))
    def export_import(self, name: str) -> None:
        """A session exported to a persist file and imported again as session "c"
        (then restored, looked up and repaired as any other)."""
        if name not in self.named:
            return
        path = self.root / f"{name}.persist"
        try:
            self.store.export(name, path)
        except SessionNotFoundError:  # removed by the repair of a session sharing its blobs
            assert self.repaired
            del self.named[name]
            return
        self.store.import_file(path, session="c")
        self.named["c"] = self.named[name]
        self.saved.append(self.named[name])
        self.tally.imports += 1

    @precondition(lambda self: bool(self.named))
    @rule(name=st.sampled_from(NAMES))
    def restore(self, name: str) -> None:
        """A named session restored in a new Store is exactly what was saved."""
        if name not in self.named:
            return
        self._reopen(False)
        self._check_restore(name)
        self.tally.restores += 1

    def _check_restore(self, name: str) -> None:
        """Restore ``name``: as saved, or (after a repair touched it) cut to a prefix
        or gone; either way exactly a fresh prefill of the tokens it claims."""
        try:
            r = self.store.restore(name, identity=self.identity)
        except SessionNotFoundError:
            assert self.repaired, f"session {name!r} vanished without a repair"
            del self.named[name]
            return
        k = len(r.tokens)
        assert k == self.named[name] or (self.repaired and k < self.named[name])
        self.named[name] = k
        assert r.tokens == self.tokens[:k]
        want = feed(self.model, chunks_upto(self.chunks, k))
        same_continuation(self.model, r.cache, want, [3, 5][:CONTINUE])

    @precondition(lambda self: bool(self.named))
    @rule(name=st.sampled_from(NAMES), pick=st.integers(0, 1 << 16), at=st.integers(0, 255))
    def repair(self, name: str, pick: int, at: int) -> None:
        """One byte of one of the session's blobs flipped, ``check --fix``: the session
        restores to exactly a fresh prefill of the tokens it claims, or is gone."""
        if name not in self.named:
            return
        self._reopen(False)
        row = self.store.index.by_name("default", name)
        if row is None:  # removed by the repair of another session sharing its blobs
            assert self.repaired
            del self.named[name]
            return
        files = [b.blob for b in self.store.index.blocks(row.id) if b.blob] + [row.tail]
        path = self.store.blobs.path(files[pick % len(files)])
        data = bytearray(path.read_bytes())
        data[-1 - at % min(len(data), 256)] ^= 0x40  # in the tensor bytes, not the header
        path.write_bytes(bytes(data))
        self.store.check(fix=True)
        assert self.store.check() == []
        self.repaired = True
        self._check_restore(name)
        self.tally.repairs += 1

    @invariant()
    def session_is_one_history(self) -> None:
        assert all(n <= len(self.tokens) for n in self.saved)

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.root, ignore_errors=True)


def machine_for(model: Any, identity: Any, tally: Tally) -> type[Search]:
    """The search bound to one family's model (a class: Hypothesis makes instances)."""
    return type("SearchOf", (Search,), {"model": model, "identity": identity, "tally": tally})
