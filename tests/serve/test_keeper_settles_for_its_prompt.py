"""A lookup waits only for the evicted caches in flight that could serve it (issue
39): a miss no longer waits for the previous request's copy into the host tier,
and a prompt that one of them would serve still finds it kept.  A real host tier,
real mlx-lm caches; its keep held open by an event."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from persist.engine.host.tier import HostTier
from persist.serve.keeper import EvictionKeeper
from tests.helpers import prefill, tokens_for


class HeldTier(HostTier):
    """A host tier whose keeps wait until ``go`` is set."""

    def __init__(self) -> None:
        super().__init__(1 << 30)
        self.go, self.started = threading.Event(), threading.Event()

    def keep(self, *args: Any, **kw: Any) -> Any:
        self.started.set()
        assert self.go.wait(60)
        return super().keep(*args, **kw)


def settled(
    keeper: EvictionKeeper, prompt: list[int], have: int, owner: str = "o"
) -> threading.Event:
    done = threading.Event()
    threading.Thread(
        target=lambda: (keeper.settle(prompt, have, owner), done.set()), daemon=True
    ).start()
    return done


def gated(tiny: Any) -> tuple[Any, HostTier, EvictionKeeper, Callable[[], None]]:
    """A tiny model, a host tier and a keeper behind a request gate that a request
    has entered (its prompt phase lasts until the returned ``leave``)."""
    from persist.serve.quiet import RequestGate

    model, _, _ = tiny("llama")
    gate = RequestGate(hold=600)
    tier = HostTier(1 << 30)
    return model, tier, EvictionKeeper(tier, gate=gate), gate.enter()


def held(keeper: EvictionKeeper) -> None:
    """Wait (bounded: 60 s) until the keeper took a copy and holds it."""
    pause = threading.Event()
    for _ in range(600):
        if keeper.holding:
            return
        pause.wait(0.1)


def copying(tiny: Any, owner: str) -> tuple[list[int], HeldTier, EvictionKeeper]:
    """40 tokens' cache of ``owner`` handed to a keeper whose copy has started and is
    held (``tier.go`` lets it finish)."""
    model, _, _ = tiny("llama")
    kept = tokens_for(40, seed=1)
    tier = HeldTier()
    keeper = EvictionKeeper(tier)
    assert keeper.offer(owner, kept, prefill(model, kept)[0])
    assert tier.started.wait(60)
    return kept, tier, keeper


def test_a_prompt_no_cache_in_flight_serves_does_not_wait(tiny: Any) -> None:
    kept, tier, keeper = copying(tiny, "o")
    try:
        other = tokens_for(40, seed=2)  # shares nothing with the kept tokens
        assert settled(keeper, other, 0).wait(30)
        # memory already gives 20 of the kept tokens' prefix, and the prompt goes
        # another way at 20: the kept cache serves it no further
        fork = kept[:20] + [(kept[20] + 1) % 256] + kept[21:]
        assert settled(keeper, fork, 20).wait(30)
        longer = settled(keeper, kept[:30] + [7, 8], 10)  # the kept cache serves 30
        assert not longer.wait(0.5)  # it waits for the copy ...
        tier.go.set()
        assert longer.wait(60)  # ... and finds it kept
        assert tier.peek("o", kept[:30] + [7, 8])[0] >= 30
    finally:
        tier.go.set()
        keeper.close()


def test_a_copy_that_would_add_few_tokens_is_not_waited_for(tiny: Any) -> None:
    # issue 39 on an H100: a miss that shares a chat template's tokens with a cache in
    # flight waited for its whole copy to gain a token or two of prefill
    model, _, _ = tiny("llama")
    kept = tokens_for(40, seed=3)
    tier = HeldTier()
    keeper = EvictionKeeper(tier, gain=16)
    try:
        assert keeper.offer("o", kept, prefill(model, kept)[0])
        assert tier.started.wait(60)
        tail = tokens_for(40, seed=6)  # a prompt that goes on past what is shared
        assert settled(keeper, kept[:25] + tail, 10).wait(30)  # 15 more: not worth it
        longer = settled(keeper, kept[:26] + tail, 10)  # 16 more: waited for
        assert not longer.wait(0.5)
        # a short prompt: half of what memory leaves (20 of 40) is worth its copy
        short = settled(keeper, kept[:20] + [7] * 20, 0)
        assert not short.wait(0.5)
        tier.go.set()
        assert longer.wait(60) and short.wait(60)
    finally:
        tier.go.set()
        keeper.close()


def test_a_copy_waits_for_a_prompt_phase_unless_a_lookup_needs_it(tiny: Any) -> None:
    # the keeper's copy ran beside the next request's prefill on the GPU (issue 39);
    # held while a request prompts, it starts at once for a lookup that waits for it
    model, tier, keeper, leave = gated(tiny)
    first, second = tokens_for(40, seed=4), tokens_for(40, seed=5)
    try:
        assert keeper.offer("o", first, prefill(model, first)[0])
        held(keeper)
        assert keeper.holding == 1 and tier.peek("o", first + [1])[0] == 0
        assert settled(keeper, first + [1], 0).wait(60)  # needed: copied at once
        assert tier.peek("o", first + [1])[0] == 40
        assert keeper.offer("o", second, prefill(model, second)[0])
        held(keeper)
        assert keeper.holding == 1
        leave()  # the prompt phase is over: the held copy goes on
        keeper.settle()
        assert tier.peek("o", second + [1])[0] == 40
    finally:
        leave()
        keeper.close()


def test_a_held_copy_goes_on_when_another_eviction_waits(tiny: Any) -> None:
    # attack r14b: under steady load some request is always prompting, each copy was
    # held its full time and the evictions behind it were dropped ("two are in
    # flight"): a returning conversation lost its prefix.  A copy holds only while
    # nothing waits behind it.
    model, tier, keeper, leave = gated(tiny)
    a, b = tokens_for(40, seed=7), tokens_for(40, seed=8)
    try:
        assert keeper.offer("o", a, prefill(model, a)[0])
        held(keeper)
        wait = threading.Event()
        assert keeper.holding == 1
        assert keeper.offer("o", b, prefill(model, b)[0])  # another waits behind it
        for _ in range(600):  # the first goes on while the request still prompts
            if tier.peek("o", a + [1])[0] == 40:
                break
            wait.wait(0.1)
        assert tier.peek("o", a + [1])[0] == 40
        leave()  # the last one, nothing behind it, waited for the prompt phase
        keeper.settle()
        assert tier.peek("o", b + [1])[0] == 40 and keeper.dropped == 0
    finally:
        leave()
        keeper.close()


def test_a_lookup_never_waits_for_another_tenants_copy(tiny: Any) -> None:
    """Outside attack r15, F1: a lookup waited for any copy in flight that shared its
    prompt's first tokens, whoever's it was: the wait (0.4 s a 1 GiB copy) told a
    tenant, digit by digit, whether another tenant's evicted prompt began as it
    guessed.  Only copies of the lookup's own owner (namespace and model) count."""
    kept, tier, keeper = copying(tiny, "alice")
    try:
        probe = kept[:30] + [7, 8]  # the copy would serve 30 of its tokens
        assert settled(keeper, probe, 10, owner="bob").wait(30)  # not alice's: no wait
        theirs = settled(keeper, probe, 10, owner="alice")
        assert not theirs.wait(0.5)  # alice's own lookup waits for her copy
        tier.go.set()
        assert theirs.wait(60)
    finally:
        tier.go.set()
        keeper.close()
