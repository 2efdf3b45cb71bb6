"""A Hypothesis state machine over one live session of a tiny model and one store.

It feeds random prefill chunks and single decode steps (with kv_bits, converted
to quantized layers as mlx-lm does), saves (in this Store, or in a new Store
over the same folder), looks up random shared lengths of what it saved,
through the index or the host tier, and restores sessions by name in a new
Store; tests/search/far_rules.py adds restores in a fresh process, a shared
(Redis) tier and persist serve's memory tier, batch_rules.py and
draft_rules.py requests served in a batch and with a draft model.  The oracle for every hit and
restore (tests/search/oracle.py): a fresh cache fed the hit's own tokens in the
same chunks the session was fed (MLX on CPU is not chunk-invariant), continued
with the same tokens, gives the same logits and holds the same state after
every step, bit for bit.
"""

from __future__ import annotations

import random
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

import persist
from persist.errors import SessionNotFoundError
from tests.search.batch_rules import BatchRules
from tests.search.draft_rules import DraftHistory, DraftRules
from tests.search.far_rules import FarRules
from tests.search.oracle import (
    Quant,
    chunks_upto,
    feed,
    quantized,
    replay,
    same_continuation,
)

GIB = 1 << 30
MAX_TOKENS = 160  # the session never grows past this: tiny models, quick steps
CONTINUE = 2  # tokens fed after a hit to compare (each a whole call)
BLOCK = 16  # small blocks: sessions of a few dozen tokens have several to damage
NAMES = ["a", "b", "c"]  # "c" only ever by import


@dataclass
class Tally:
    """What one family's search checked: sequences, states, hits, restores, misses..."""

    sequences: int = 0
    states: int = 0
    hits: int = 0
    restores: int = 0
    misses: int = 0
    repairs: int = 0
    imports: int = 0
    processes: int = 0  # restores in a fresh process
    pulls: int = 0  # lookups and restores by a new machine from the shared tier
    served: int = 0  # persist serve memory-tier (prompt cache) hits
    batches: int = 0  # requests served in a batch (BatchGenerator) beside others
    drafted: int = 0  # requests served with a draft model (speculative decoding)
    conversions: int = 0  # sessions converted to quantized layers (kv_bits)
    by_length: dict[int, int] = field(default_factory=dict)


class Search(FarRules, BatchRules, DraftRules, RuleBasedStateMachine):
    """Subclassed per family by ``machine_for`` (model, identity, tally and the
    optional parts bound: kv_bits, a recipe for fresh processes, a shared tier)."""

    model: Any = None
    identity: Any = None
    tally: Tally = Tally()
    vocab = 250
    quant: Quant | None = None
    exact_calls = True  # oracle.calls_are_exact: else the reference replays the calls
    cache_class: Any = None  # one cache class for every layer (a user's choice), else the model's
    rollbacks = True  # False: the cache class's own trim is no rollback (ConcatenateKVCache)

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="persist-search-"))
        self.start_far()
        self.store = self._open(False)
        self.cache = self.new_cache()
        self.chunks: list[list[int]] = []
        self.drafts: list[list[int]] = []  # each chunk's rejected drafts (fed in its call)
        self.saved: list[int] = []  # lengths saved (every one a prefix of the session)
        self.named: dict[str, int] = {}  # the length each session was last saved at
        self.repaired = False  # a repair may cut or remove any session sharing a blob
        self.converted = False  # kv_bits quantized the session
        self.rng = random.Random(0)
        self.draft_histories: dict[str, DraftHistory] = {}  # by draft (serve_draft)
        self.tally.sequences += 1

    def new_cache(self) -> list[Any]:
        if self.cache_class is None:
            return make_prompt_cache(self.model)
        return [self.cache_class() for _ in self.model.layers]

    @property
    def tokens(self) -> list[int]:
        return [t for c in self.chunks for t in c]

    def _call(self, toks: list[int]) -> None:
        """One model call of the session, then mlx-lm's kv_bits conversion."""
        feed(self.model, [toks], self.cache, self.quant)

    def _fed(self, toks: list[int], drafts: list[int] | None = None) -> None:
        """``toks`` are the session's next chunk (what its cache now holds), fed in
        one call with ``drafts`` after them, which were rolled back."""
        self.chunks.append(toks)
        self.drafts.append(drafts or [])
        if not self.converted and quantized(self.cache):
            self.converted = True
            self.tally.conversions += 1
        self.tally.states += 1

    def fresh(self, k: int) -> list[Any]:
        """The oracle's cache: a fresh prefill of the session's first ``k`` tokens."""
        if not self.exact_calls:
            calls = list(zip(self.chunks, self.drafts, strict=True))
            return replay(self.model, calls, k, self.quant)
        return feed(self.model, chunks_upto(self.chunks, k), self.new_cache(), self.quant)

    def continued(self, got: list[Any], k: int, nxt: list[int]) -> None:
        """``got`` (holding the session's first ``k`` tokens) continues with ``nxt``
        exactly like a fresh prefill of those tokens."""
        after = self.quant.convert if self.quant is not None else None
        same_continuation(self.model, got, self.fresh(k), nxt, after)

    @initialize(n=st.integers(1, 48), seed=st.integers(0, 2**16))
    def first_prefill(self, n: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self._random_chunk(n)

    def _random_chunk(self, n: int) -> None:
        toks = [self.rng.randrange(self.vocab) for _ in range(n)]
        self._call(toks)
        self._fed(toks)

    @precondition(lambda self: len(self.tokens) < MAX_TOKENS - 48)
    @rule(n=st.integers(2, 48))
    def prefill(self, n: int) -> None:
        self._random_chunk(n)

    @precondition(lambda self: len(self.tokens) < MAX_TOKENS)
    @rule(steps=st.integers(1, 12))
    def decode(self, steps: int) -> None:
        for _ in range(steps):
            self._random_chunk(1)

    @precondition(
        lambda self: (
            self.rollbacks
            and len(self.tokens) < MAX_TOKENS - 8
            and can_trim_prompt_cache(self.cache)
        )
    )
    @rule(n=st.integers(2, 8), data=st.data())
    def speculative_round(self, n: int, data: st.DataObject) -> None:
        """Draft tokens fed in one call (kv_bits conversion after it, as mlx-lm's
        speculative decoding does), the rejected ones trimmed: the cache holds the
        accepted ones as that call's chunk."""
        toks = [self.rng.randrange(self.vocab) for _ in range(n)]
        rejected = data.draw(st.integers(1, n - 1), label="rejected")
        q = self.quant
        if q is not None and not quantized(self.cache) and len(self.tokens) + n >= q.start:
            # mlx-lm would quantize at the drafts' peak, before the rollback: a
            # state no fresh run holds, that persist cannot recognize once the
            # session grows past the start (docs/FORMAT.md: a known limit)
            return
        self._call(toks)
        if not can_trim_prompt_cache(self.cache):  # a ring the drafts filled: all kept
            rejected = 0
        assert trim_prompt_cache(self.cache, rejected) == rejected
        self._fed(toks[: n - rejected], toks[n - rejected :])

    @rule(session=st.sampled_from([None, "a", "b"]), host=st.booleans())
    def save(self, session: str | None, host: bool) -> None:
        """Save in a new Store over the same folder (host tier or not)."""
        self._reopen(host)
        self.store.save(self.cache, self.tokens, identity=self.identity, session=session)
        self.saved.append(len(self.tokens))
        if session is not None:
            self.named[session] = len(self.tokens)

    def _open(self, host: bool, root: Path | None = None) -> persist.Store:
        return persist.Store(
            root or self.root / "s",
            block_tokens=BLOCK,
            host_cache=GIB if host else None,
            shared=self.shared,
        )

    def _reopen(self, host: bool) -> None:
        self.store.close()
        self.store = self._open(host)

    def prompt(self, pick: int, frac: float, lengths: list[int]) -> tuple[list[int], int]:
        """A prompt sharing h tokens of one of ``lengths``, then a token the session
        did not have there; and h."""
        toks = self.tokens
        n = lengths[pick % len(lengths)]
        h = max(1, min(n, round(frac * n)))
        other = (toks[h] + 1) % self.vocab if h < len(toks) else 0
        return [*toks[:h], other, 7], h

    def check_lookup(self, store: persist.Store, pick: int, frac: float) -> None:
        """``store``'s hit for a prompt sharing a random part of a saved length is
        a fresh prefill of the tokens it claims (or a miss)."""
        prompt, h = self.prompt(pick, frac, self.saved)
        hit = store.lookup(prompt, identity=self.identity)
        if hit is None:
            self.tally.misses += 1
            return
        k = len(hit.tokens)
        assert k <= h and hit.tokens == self.tokens[:k]
        self.continued(hit.cache, k, prompt[h : h + CONTINUE])
        self.tally.hits += 1
        self.tally.by_length[k] = self.tally.by_length.get(k, 0) + 1

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
        self.check_lookup(self.store, pick, frac)

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
        # a repair cuts it; a shared tier may give back the fleet's whole copy
        assert k == self.named[name] or (self.repaired and k < self.named[name])
        assert r.tokens == self.tokens[:k]
        self.continued(r.cache, k, [3, 5][:CONTINUE])

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
        self.stop_far()
        self.store.close()
        shutil.rmtree(self.root, ignore_errors=True)


def machine_for(
    model: Any,
    identity: Any,
    tally: Tally,
    vocab: int = 250,
    **parts: Any,
) -> type[Search]:
    """The search bound to one family's model (a class: Hypothesis makes instances),
    feeding token ids below ``vocab``.  ``parts``: ``quant`` (kv_bits), ``recipe``
    and ``processes`` (restores in a fresh process), ``shared`` (a Redis URL)."""
    bound = {"model": model, "identity": identity, "tally": tally, "vocab": min(vocab, 250)}
    return type("SearchOf", (Search,), {**bound, **parts})
