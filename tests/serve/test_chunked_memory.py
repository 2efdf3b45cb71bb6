"""Issue 36 repro 1 in persist serve's memory tier: mlx-lm's prompt cache cuts a
longer cached prompt with ``trim_prompt_cache``, which for a chunked-attention
cache whose front was dropped keeps a state no fresh prefill gives.  persist's
memory tier refuses such a cut (persist.servable) and asks its other tiers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import persist
from persist.serve.server import PersistentPromptCache
from tests.engine.chunked_session import check_hit, prompt_sharing, session


class Hit:
    def __init__(self, cache: Any, tokens: list[int]) -> None:
        self.cache, self.tokens = cache, tokens


def test_the_memory_tier_never_hands_out_a_cut_into_a_dropped_chunk(
    tiny: Any, tmp_path: Path
) -> None:
    model, _, ident, toks, cache = session(tiny)
    with persist.Store(tmp_path / "s") as store:
        pc = PersistentPromptCache(4, store=store, identity=ident)
        try:
            pc.insert_cache("m", toks, cache)
            pc.flush()
            for h in (48, 56, 63, 79):
                prompt = prompt_sharing(toks, h)
                got, rest = pc.fetch_nearest_cache("m", prompt)
                if got is not None:
                    check_hit(model, Hit(got, prompt[: len(prompt) - len(rest)]), toks, h)
            got, rest = pc.fetch_nearest_cache("m", [*toks, 1, 2])  # the whole: itself
            assert got is not None and rest == [1, 2]
            check_hit(model, Hit(got, toks), toks, len(toks))
        finally:
            pc.close()
