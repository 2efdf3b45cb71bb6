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
from tests.engine.test_host_store import ident
from tests.helpers import NEXT, prefill, tokens_for

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
