"""The search's rule for batched serving (a mixin of Search, beside FarRules).

``serve_batch`` does what mlx_lm/server.py does for a request that joins a
batch (``ResponseGenerator._generate``): the session's next request (its
tokens and a new chunk, split in typed segments as ``_tokenize`` splits a
chat) fetched from persist's prompt cache, inserted into a real
``BatchGenerator`` with that cache and the rest of its prompt beside one or
two other requests (some with caches of their own, arriving a few steps
apart), run until it finishes; every cache the server hands the prompt cache
(a segment's end, the finished request) inserted as it does.  The session
then continues from the finished request's cache, its chunks recording the
calls that built it: each segment in ``prefill_step_size`` pieces, the last
prompt token alone, then each generated token.  On CPU a batch row is bit for
bit a batch of one fed those calls (KVCache, ArraysCache, CacheList), so the
oracle is the session's own.

Two cases differ.  mlx-lm's server batches only models whose every cache
class can ``merge`` (``ModelProvider.is_batchable``: not ChunkedKVCache, so not
llama4) and never with kv_bits (``_is_batchable``): there the rule does not
run.  A ring (RotatingKVCache) that wrapped comes out of
``BatchRotatingKVCache.extract`` in temporal order (``_idx`` at its end) where
a batch of one keeps it rotated: the same keys and the same logits, but not
the same state, so such a request is checked against the extracted cache
itself (what persist serves must equal what mlx-lm computed), in a namespace
of its own so the session's lookups never meet it.
"""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

from persist.serve.tenants import Scoped
from tests.helpers import assert_same_state
from tests.search.far_rules import MODEL_KEY
from tests.search.oracle import feed, same_continuation, state_of

APART = Scoped(MODEL_KEY, "wrapped-rings")  # requests checked against their own cache
TYPES = ("system", "user", "assistant")  # the segment types mlx-lm's _tokenize gives
ROOM = 160 - 30  # the session stays under the search's 160 tokens (machine.MAX_TOKENS)
OTHER_FIRST = 250  # other requests start at ids the session never has first: no shared prefix


def batchable(model: Any) -> bool:
    """mlx-lm's server batches a model whose every cache class can merge."""
    return all(hasattr(c, "merge") for c in make_prompt_cache(model))


def ring_size(cache: list[Any]) -> int | None:
    """The smallest window of the cache's rings, or None without rings."""
    sizes = [c.max_size for c in cache if isinstance(c, RotatingKVCache)]
    return min(sizes) if sizes else None


def segments_of(chunk: list[int], cuts: tuple[int, int]) -> tuple[list[list[int]], list[str]]:
    """The chunk split as mlx-lm's server splits a chat prompt (system, user,
    assistant tail), empty parts dropped."""
    a, b = sorted(min(c, len(chunk)) for c in cuts)
    parts = [(chunk[:a], TYPES[0]), (chunk[a:b], TYPES[1]), (chunk[b:], TYPES[2])]
    kept = [(p, t) for p, t in parts if p]
    return [p for p, _ in kept], [t for _, t in kept]


def calls_of(segments: list[list[int]], step: int, generated: list[int]) -> list[list[int]]:
    """The calls a batch row's cache was fed: mlx-lm's insert_segments splits the
    last prompt token off, each segment goes in ``step`` pieces, the last token
    alone, then each generated token."""
    segs = [list(s) for s in segments]
    if len(segs[-1]) != 1:
        segs.append(segs[-1][-1:])
        segs[-2] = segs[-2][:-1]
    calls = [s[i : i + step] for s in segs[:-1] for i in range(0, len(s), step)]
    return [*calls, segs[-1], *([t] for t in generated)]


class BatchRules:
    """The batched-serving rule.  Mixed into Search (model, session, prompt cache)."""

    serving = False  # the batch and draft serving rules run (the families' test)

    @precondition(
        lambda self: (
            self.serving
            and self.quant is None  # mlx-lm's server never batches with kv_bits
            and self.cache_class is None  # nor a cache list mlx-lm's server never makes
            and batchable(self.model)
            and len(self.tokens) < ROOM
        )
    )
    @rule(
        n=st.integers(1, 24),
        cuts=st.tuples(st.integers(0, 24), st.integers(0, 24)),
        step=st.sampled_from([2, 3, 5, 8, 16, 512]),
        generate=st.integers(1, 4),
        others=st.lists(
            st.tuples(st.integers(1, 30), st.integers(0, 20), st.integers(1, 4)),
            min_size=1,
            max_size=2,
        ),
        delay=st.integers(0, 2),
    )
    def serve_batch(
        self,
        n: int,
        cuts: tuple[int, int],
        step: int,
        generate: int,
        others: list[tuple[int, int, int]],
        delay: int,
    ) -> None:
        """The session's next request served in a batch beside ``others`` (prompt
        length, cached length, max tokens), ``delay`` batch steps after them."""
        self.serve_insert()  # the previous turn's cache, inserted as the server does
        pc = self._prompt_cache()
        chunk = [self.rng.randrange(self.vocab) for _ in range(n)]
        prompt = [*self.tokens, *chunk]
        cache, rest = pc.fetch_nearest_cache(MODEL_KEY, prompt)
        k = len(prompt) - len(rest)
        if cache is None or k < len(self.tokens):  # a shorter hit: checked, not batched
            if cache is not None:
                self.continued(cache, k, rest[:2])
            return
        assert rest == chunk, (k, len(self.tokens))
        size = ring_size(self.cache)
        wraps = size is not None and len(prompt) + generate > size
        segments, types = segments_of(chunk, cuts)
        gen = BatchGenerator(self.model, prefill_step_size=step)
        self._insert_others(gen, others)
        for _ in range(delay):
            self._serve_step(gen, {}, APART if wraps else MODEL_KEY)
        (uid,) = gen.insert_segments(
            [segments], [generate], caches=[cache], all_tokens=[list(self.tokens)]
        )
        key = APART if wraps else MODEL_KEY
        done = None
        while done is None:
            done = self._serve_step(gen, {uid: types[::-1]}, key).get(uid)
        gen.close()
        cache, tokens = done
        generated = tokens[len(prompt) :]
        if wraps:
            self._check_apart(cache, tokens)
        else:
            self.cache = cache
            for c in calls_of(segments, step, generated):
                self._fed(c)
            self._check_served(len(self.tokens))
        self.tally.batches += 1

    def _insert_others(self, gen: BatchGenerator, others: list[tuple[int, int, int]]) -> None:
        """Other requests: random prompts of their own (one past the session's ids
        first, so no lookup of the session's ever shares them), some with caches."""
        for length, cached, max_tokens in others:
            head = [OTHER_FIRST + self.rng.randrange(3)]
            prompt = head + [self.rng.randrange(self.vocab) for _ in range(length + cached)]
            cache = feed(self.model, [prompt[: cached + 1]]) if cached else None
            at = prompt[: cached + 1] if cached else []
            gen.insert_segments(
                [[prompt[len(at) :]]], [max_tokens], caches=[cache], all_tokens=[at]
            )

    def _serve_step(
        self, gen: BatchGenerator, types: dict[int, list[str]], key: Any
    ) -> dict[int, tuple[list[Any], list[int]]]:
        """One step of the server's batch loop: the caches at segments' ends and of
        finished requests inserted into persist's prompt cache (under ``key`` for
        the session's request); the finished ones, by uid."""
        pc = self._prompt_cache()
        prompts, generations = gen.next()
        ends = [
            r.uid for r in prompts if r.end_of_segment and not r.end_of_prompt and types.get(r.uid)
        ]
        for uid, (cache, tokens) in gen.extract_cache(ends).items():
            pc.insert_cache(key, tokens[:], cache, cache_type=types[uid].pop())
            self._served_at(key, len(tokens))
        finished = {}
        for r in generations:
            if r.finish_reason is None:
                continue
            if r.uid in types:
                finished[r.uid] = (copy.deepcopy(r.prompt_cache), list(r.all_tokens))
            pc.insert_cache(key if r.uid in types else MODEL_KEY, r.all_tokens[:], r.prompt_cache)
            if r.uid in types:
                self._served_at(key, len(r.all_tokens))
        return finished

    def _served_at(self, key: Any, n: int) -> None:
        """The session's tokens up to ``n`` are in the prompt cache (and, written
        behind, the store); rings apart are not the session's."""
        if key == MODEL_KEY:
            self.served_lengths.append(n)
            self.saved.append(n)

    def _check_served(self, n: int) -> None:
        """The next turn (the session and one token more) is served the session's
        cache: the same as a fresh prefill fed its calls."""
        pc = self._prompt_cache()
        prompt = [*self.tokens[:n], 3, 5]
        cache, rest = pc.fetch_nearest_cache(MODEL_KEY, prompt)
        assert cache is not None
        k = len(prompt) - len(rest)
        assert k <= n, (k, n)
        self.continued(cache, k, rest[:2])
        self.tally.served += 1

    def _check_apart(self, want: list[Any], tokens: list[int]) -> None:
        """A wrapped ring's request: persist serves (from memory, then from the store)
        exactly the cache mlx-lm extracted for its tokens."""
        pc = self._prompt_cache()
        prompt = [*tokens, 3, 5]
        got, rest = pc.fetch_nearest_cache(APART, prompt)
        assert got is not None and len(prompt) - len(rest) == len(tokens)
        self._same(got, want, rest)
        pc.flush()
        hit = self.pc_store.lookup(prompt, identity=self.identity, namespace=APART.namespace)
        if hit is not None:  # the store keeps what its codecs can serve
            assert hit.tokens == tokens, (len(hit.tokens), len(tokens))
            self._same(hit.cache, want, rest)

    def _same(self, got: list[Any], want: list[Any], nxt: list[int]) -> None:
        mine = copy.deepcopy(want)
        assert_same_state(state_of(got), state_of(mine))
        same_continuation(self.model, got, mine, nxt[:2])
