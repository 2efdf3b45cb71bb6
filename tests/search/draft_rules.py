"""The search's rule for draft-model serving (a mixin of Search, beside FarRules).

With ``--draft-model`` mlx_lm.server answers one request at a time
(``_serve_single``): its cache list is the model's layers then the draft's,
speculative decoding runs on it, and it is inserted under the prompt and
every generated token, while the model's layers (and the draft's) often hold
one position less: speculative decoding yields the verified token before it
feeds it.  ``serve_draft`` runs such a request from the session's state (the
draft's layers carried along in a history of their own), inserts it as the
server does under the server's key for that draft, fetches the next turn and
checks both parts with the oracle: the model's layers against a fresh prefill
fed the session's calls, the draft's against one fed the draft's calls.  The
calls are recorded as mlx-lm made them (a proxy around each model): a call's
positions that a later trim removed are its rejected drafts.

Drafts: the model itself (every draft accepted, the last one never fed to the
draft) or another tiny model that disagrees.  Not with kv_bits (mlx-lm
quantizes at the drafts' peak: docs/FORMAT.md's known limit, see
``speculative_round``), nor where the model's cache cannot be trimmed (mlx-lm
refuses speculative decoding) or a ring would wrap within the request.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule
from mlx_lm.generate import speculative_generate_step
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

from tests.search.batch_rules import ring_size
from tests.search.oracle import chunks_upto, feed, same_continuation

DRAFT_KEYS = {"self": ("m", None, "self"), "other": ("m", None, "other")}  # model, adapter, draft
ROOM = 160 - 40  # the session stays under the search's 160 tokens (machine.MAX_TOKENS)


class Recorder:
    """A model as speculative decoding calls it, keeping each call's tokens and
    where in the cache it started."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.layers = model.layers
        self.calls: list[tuple[int, list[int]]] = []

    def __call__(self, inputs: mx.array, cache: list[Any]) -> mx.array:
        self.calls.append((cache[0].offset, inputs[0].tolist()))
        return self.model(inputs, cache=cache)

    def kept(self, end: int) -> list[tuple[list[int], list[int]]]:
        """Each call as (what the cache holds of it, what later trims removed): a
        position stays when no later call starts at or before it and it is below
        ``end``, the cache's final length."""
        out = []
        for i, (at, toks) in enumerate(self.calls):
            limit = min([end, *(a for a, _ in self.calls[i + 1 :])])
            n = max(0, min(len(toks), limit - at))
            out.append((toks[:n], toks[n:]))
        return out


@dataclass
class DraftHistory:
    """The draft's layers as the session's turns left them: its cache and the
    calls (pieces it holds) that built it."""

    cache: list[Any]
    chunks: list[list[int]] = field(default_factory=list)

    @property
    def length(self) -> int:
        return sum(len(c) for c in self.chunks)


class DraftRules:
    """The draft-serving rule.  Mixed into Search (model, session, prompt cache)."""

    draft_model: Any = None  # a tiny model with the same vocabulary that disagrees
    draft_identity: Any = None  # its ModelIdentity

    def draft_identity_of(self, key: Any) -> Any:
        """The identity of a cache list under a draft's key (persist serve's
        model_identity: the model's, naming the draft), None for a key not known."""
        if key == DRAFT_KEYS["self"]:
            return self.identity.with_draft(self.identity)
        if key == DRAFT_KEYS["other"] and self.draft_identity is not None:
            return self.identity.with_draft(self.draft_identity)
        return None

    def drafts_for(self, which: str) -> Any:
        return self.model if which == "self" else self.draft_model

    def _draft_history(self, which: str) -> DraftHistory:
        """The draft's layers brought up to the session: fed the session's calls
        past what they hold, cut where it holds them."""
        if which not in self.draft_histories:
            self.draft_histories[which] = DraftHistory(make_prompt_cache(self.drafts_for(which)))
        h = self.draft_histories[which]
        n = h.length
        for c in chunks_upto(self.chunks, len(self.tokens)):
            if n < len(c):
                piece = c[n:] if n else c
                feed(self.drafts_for(which), [piece], h.cache)
                h.chunks.append(list(piece))
            n = max(0, n - len(c))
        return h

    @precondition(
        lambda self: (
            self.serving
            and self.draft_model is not None
            and self.quant is None
            and self.cache_class is None
            and len(self.tokens) < ROOM
            and can_trim_prompt_cache(self.cache)
        )
    )
    @rule(
        which=st.sampled_from(["self", "other"]),
        n=st.integers(1, 16),
        step=st.sampled_from([2, 3, 5, 512]),
        generate=st.integers(1, 8),
        num_draft=st.integers(1, 4),
    )
    def serve_draft(self, which: str, n: int, step: int, generate: int, num_draft: int) -> None:
        """The session's next request served with speculative decoding, inserted
        under the prompt and every generated token; the next turn's hit is checked."""
        size = ring_size(self.cache)
        if size is not None and len(self.tokens) + n + generate + num_draft >= size:
            return  # a ring that fills cannot be rolled back: mlx-lm keeps the drafts
        draft = self._draft_history(which)
        layers = len(self.model.layers)
        cache = [*copy.deepcopy(self.cache), *copy.deepcopy(draft.cache)]
        chunk = [self.rng.randrange(self.vocab) for _ in range(n)]
        key = [*self.tokens, *chunk]
        model, drafter = Recorder(self.model), Recorder(self.drafts_for(which))
        steps = speculative_generate_step(
            mx.array(chunk), model, drafter, num_draft_tokens=num_draft,
            max_tokens=generate, prompt_cache=cache, prefill_step_size=step,
        )  # fmt: skip
        key += [int(t) for t, _, _ in steps]  # the server's key: every token it generated
        mine, theirs = cache[:layers], cache[layers:]
        self.cache = copy.deepcopy(mine)  # the session goes on from the model's layers
        for held, rejected in model.kept(mine[0].offset):
            if held:
                self._fed(held, rejected)
        draft.cache = copy.deepcopy(theirs)
        draft.chunks += [held for held, _ in drafter.kept(theirs[0].offset) if held]
        pc = self._prompt_cache()
        pc.insert_cache(DRAFT_KEYS[which], key, cache)
        self._check_draft(which, key)
        self.tally.drafted += 1

    def _check_draft(self, which: str, key: list[int]) -> None:
        """The next turn's hit (the key and more): its model layers continue like a
        fresh prefill fed the session's calls, its draft layers like one fed the
        draft's."""
        prompt = [*key, 3, 5]
        got, rest = self._prompt_cache().fetch_nearest_cache(DRAFT_KEYS[which], prompt)
        assert got is not None, "the request's own cache was not served"
        k = len(prompt) - len(rest)
        draft = self.draft_histories[which]
        assert k <= min(len(self.tokens), draft.length), (k, len(self.tokens), draft.length)
        layers = len(self.model.layers)
        self.continued(got[:layers], k, rest[:2])
        want = feed(self.drafts_for(which), chunks_upto(draft.chunks, k))
        same_continuation(self.drafts_for(which), got[layers:], want, rest[:2])
        self.tally.served += 1
