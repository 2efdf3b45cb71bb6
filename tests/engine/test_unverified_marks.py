"""A cache restored from an unverified session carries the mark into every later save
(``persist.marks``): under another name, as a checkpoint, captured, copied."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

import persist
from persist.codecs.snapshot import capture
from persist.engine.host.tier import HostTier
from persist.marks import carries_unverified, mark_unverified
from tests.engine.host_checks import ident
from tests.helpers import NEXT, assert_same_state, live_state, prefill, tokens_for

GIB = 1 << 30


def _restored(tiny: Any, store: persist.Store) -> tuple[Any, Any, list[int], list[Any]]:
    model, identity = ident(tiny, "mamba2")
    toks = tokens_for(40, seed=41)
    cache, _ = prefill(model, toks)
    store.save(cache, toks, identity=identity, session="u", unverified_tokens=True)
    got = store.restore("u", identity=identity)
    assert carries_unverified(got.cache) and not carries_unverified(cache)
    more, _ = prefill(model, NEXT, cache=got.cache)
    return model, identity, [*toks, *NEXT], more


def test_every_save_of_a_continuation_stays_unverified(tiny: Any, tmp_path: Path) -> None:
    with persist.Store(tmp_path / "s", host_cache=GIB) as store:
        _, identity, toks, more = _restored(tiny, store)
        store.checkpoint(more, toks, identity=identity, session="w")  # owned by another
        store.save(capture(more, toks), toks, identity=identity, session="x")
        store.save(copy.deepcopy(more), toks, identity=identity, session="y")
        saved = store.entries()
        assert len(saved) == 4  # u, w's checkpoint, x, y
        assert all(e.metadata.get("persist.unverified_tokens") == "true" for e in saved)
        assert store.lookup([*toks, 1], identity=identity) is None
        assert store.stats().host_cache["entries"] == 0  # type: ignore[index]
        with pytest.raises(persist.InvalidArgumentError, match="session name"):
            store.save(more, toks, identity=identity)  # a prefix: nothing would own it
        again = store.restore("y", identity=identity)  # by name, as any unverified one
        assert again.tokens == toks and carries_unverified(again.cache)


def test_a_verified_restore_is_not_marked(tiny: Any, tmp_path: Path) -> None:
    model, identity = ident(tiny, "mamba2")
    toks = tokens_for(40, seed=42)
    with persist.Store(tmp_path / "s") as store:
        store.save(prefill(model, toks)[0], toks, identity=identity, session="v")
        got = store.restore("v", identity=identity)
        assert not carries_unverified(got.cache)


def test_the_host_tier_never_keeps_a_marked_cache(tiny: Any) -> None:
    model, _ = ident(tiny, "llama")
    toks = tokens_for(40, seed=43)
    cache, _ = prefill(model, toks)
    host = HostTier(GIB)
    mark_unverified(cache)
    assert not host.keep("o", toks, cache, copy=True)
    assert not host.keep("o", toks, capture(cache, toks), copy=True)
    assert len(host) == 0


class _Slotted:
    __slots__ = ("__weakref__",)


def test_a_layer_without_attributes_is_marked_by_weak_reference() -> None:
    a, b = _Slotted(), _Slotted()
    mark_unverified([a])
    assert carries_unverified([a]) and not carries_unverified([b])


def test_an_unverified_session_continued_elsewhere_never_serves(tiny: Any, tmp_path: Path) -> None:
    model, identity = ident(tiny, "mamba2")
    toks = tokens_for(40, seed=40)
    cache, _ = prefill(model, toks)
    with persist.Store(tmp_path / "s", host_cache=GIB) as store:
        store.save(cache, toks, identity=identity, session="u", unverified_tokens=True)
        got = store.restore("u", identity=identity)
        more, _ = prefill(model, NEXT, cache=got.cache)
        store.save(more, [*toks, *NEXT], identity=identity, session="v")
        hit = store.lookup([*toks, *NEXT, 1], identity=identity)
        assert hit is None, hit.source


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
        # the restored cache carries the mark (persist.marks): a caller's own cache
        # of those tokens, saved elsewhere, is checked, so the test can fail
        b.save(prefill(model, toks)[0], toks, identity=ident, session="checked")
        assert b.lookup([*toks, 1], identity=ident) is not None


def test_a_checkpoint_of_an_unverified_session_serves_no_lookup(tiny: Any, tmp_path: Path) -> None:
    """A checkpoint owned by an unverified session, of its tokens continued, begins
    with what nothing checked: it must not serve another prompt either."""
    from tests.helpers import NEXT, continue_run

    model, tok, _ = tiny("mamba2")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(40, seed=4)
    cache, _ = prefill(model, toks)
    with persist.Store(tmp_path / "s") as store:
        store.save(cache, toks, identity=ident, session="m", unverified_tokens=True)
        got = store.restore("m", identity=ident)
        _, greedy = continue_run(model, got.cache, NEXT)
        more = [*toks, *NEXT, *greedy]
        store.checkpoint(got.cache, more, identity=ident, session="m")
        assert store.lookup([*more, 5], identity=ident) is None
        store.checkpoint(got.cache, more, identity=ident, session="other")  # still marked
        assert store.lookup([*more, 5], identity=ident) is None
        fresh, _ = prefill(model, more)  # the caller's own cache of them: checked
        store.checkpoint(fresh, more, identity=ident, session="other")
        assert store.lookup([*more, 5], identity=ident) is not None


def test_a_turn_of_an_unverified_session_kept_under_name_2_stays_unverified(
    tiny: Any, tmp_path: Path
) -> None:
    """persist generate --session on an unverified session whose session another
    writer saved meanwhile keeps the turn as NAME~2: that one continues the
    unverified tokens too, and must serve no lookup."""
    from persist.apps.resume import resume_text, save_turn
    from tests.helpers import NEXT, continue_run

    model, tok, _ = tiny("mamba2")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(40, seed=6)
    cache, _ = prefill(model, toks)
    with persist.Store(tmp_path / "s") as store:
        store.save(cache, toks, identity=ident, session="m", unverified_tokens=True)
        got = resume_text(store, "m", list(NEXT), identity=ident, namespace="default", bar=None)
        store.save(cache, toks, identity=ident, session="m")  # another writer's turn
        assert got.cache is not None
        _, greedy = continue_run(model, got.cache, got.tokens[got.covered :])
        more = [*got.tokens, *greedy]
        name = save_turn(
            store, got.cache, more, identity=ident, session="m", namespace="default",
            version=got.version, unverified=got.unverified,
        )  # fmt: skip
        assert name == "m~2"
        assert store.entry("m~2").metadata["persist.unverified_tokens"] == "true"
        assert store.lookup([*more, 5], identity=ident) is None
