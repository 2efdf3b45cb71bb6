"""Attacks on issue 23's fixes (never a wrong cache): each test failed before its fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import persist
from tests.helpers import assert_same_state, live_state, prefill, tokens_for


def test_an_unverified_session_exported_and_imported_elsewhere_stays_unverified(
    tiny: Any, tmp_path: Path
) -> None:
    """A persist-format export of an unverified session carries its tokens as if
    checked: imported into another store it must still serve no lookup."""
    model, tok, _ = tiny("mamba2")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(40, seed=3)
    cache, _ = prefill(model, toks)
    out = tmp_path / "m.cache"
    with persist.Store(tmp_path / "a") as a:
        a.save(cache, toks, identity=ident, session="m", unverified_tokens=True)
        a.export("m", out)
    with persist.Store(tmp_path / "b") as b:
        b.import_file(out, identity=ident)
        assert b.entry("m").metadata["persist.unverified_tokens"] == "true"
        for prompt in ([*toks, 1], toks):
            assert b.lookup(prompt, identity=ident) is None
        got = b.restore("m", identity=ident)  # its own name still restores it
        assert_same_state(live_state(got.cache), live_state(cache))
        b.save(got.cache, toks, identity=ident, session="checked")  # the test can fail
        assert b.lookup([*toks, 1], identity=ident) is not None
