"""A lookup waits only for the evicted caches in flight that could serve it (issue
39): a miss no longer waits for the previous request's copy into the host tier,
and a prompt that one of them would serve still finds it kept.  A real host tier,
real mlx-lm caches; its keep held open by an event."""

from __future__ import annotations

import threading
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


def settled(keeper: EvictionKeeper, prompt: list[int], have: int) -> threading.Event:
    done = threading.Event()
    threading.Thread(target=lambda: (keeper.settle(prompt, have), done.set()), daemon=True).start()
    return done


def test_a_prompt_no_cache_in_flight_serves_does_not_wait(tiny: Any) -> None:
    model, _, _ = tiny("llama")
    kept = tokens_for(40, seed=1)
    tier = HeldTier()
    keeper = EvictionKeeper(tier)
    try:
        assert keeper.offer("o", kept, prefill(model, kept)[0])
        assert tier.started.wait(60)
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
