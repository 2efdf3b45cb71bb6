"""An unverified session (issue 23.3) reaches other machines through the shared tier
and still serves no lookup there: only its name restores it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import persist
from tests.helpers import assert_same_state, live_state, prefill, tokens_for


def test_an_unverified_session_serves_no_lookup_on_another_machine(
    tiny: Any, redis_server: Any, tmp_path: Path
) -> None:
    model, tok, _ = tiny("mamba2")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(300, seed=9)  # a full block: a candidate of the shared lookups
    cache, _ = prefill(model, toks)
    with persist.Store(tmp_path / "a", shared=redis_server.url) as a:
        a.save(cache, toks, identity=ident, session="m", unverified_tokens=True)
    with persist.Store(tmp_path / "b", shared=redis_server.url) as b:
        for prompt in ([*toks, 1], toks):  # through the shared tier's lookups
            assert b.lookup(prompt, identity=ident) is None
        got = b.restore("m", identity=ident)  # pulled by its name
        assert_same_state(live_state(got.cache), live_state(cache))
        assert b.entry("m").metadata["persist.unverified_tokens"] == "true"
        row = b.index.by_name("default", "m")
        assert row is not None and row.min_resume == len(toks) + 1  # the floor travelled
        assert b.lookup([*toks, 1], identity=ident) is None  # held locally now: still none
        b.save(cache, toks, identity=ident, session="checked")  # the same state, checked
        assert b.lookup([*toks, 1], identity=ident) is not None  # so the test can fail
