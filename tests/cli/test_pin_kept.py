"""A named session's pin and retention hints belong to the session: its next turn keeps
them (attack 38f, F2: a save wrote its own pin flag, off for ``generate``, so a pinned
session was unpinned by its next turn and ``gc`` then evicted it, on a store without
tiers the only copy).  Only ``persist unpin`` (or a save that says ``pin=False``) drops
a pin.  Real ``persist`` processes for the user's path, the library for the rest."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import persist
from persist.apps import generate as gen_mod
from tests.golden.cases import IDENTITY, kv_cache
from tests.helpers import persist_cli


def lost_a_race(monkeypatch: pytest.MonkeyPatch, store: persist.Store, ident: Any) -> None:
    """Every turn from here on loses a race: another writer saves the session after it
    was read (as tests/cli/test_fork_names.py's)."""
    real = gen_mod.resume_text

    def racing(*a: Any, **k: Any) -> Any:
        got = real(*a, **k)
        other = store.restore(a[1], identity=ident)
        store.save(other.cache, other.tokens, identity=ident, session=a[1])
        return got

    monkeypatch.setattr(gen_mod, "resume_text", racing)


def _hints(store: persist.Store, name: str) -> tuple[float, int] | None:
    from persist.storage import writes

    with store.index.read() as db:
        return writes.session_hints(db, "default", name)


def test_a_pinned_sessions_next_turn_stays_pinned_and_gc_keeps_it(
    tiny: Any, tmp_path: Path
) -> None:
    _, _, folder = tiny("llama")
    at = ("--store", str(tmp_path / "s"))

    def turn(name: str, prompt: str) -> None:
        persist_cli(
            tmp_path, "generate", "--model", str(folder), "-m", "4", "--session", name,
            "--prompt", prompt, *at,
        )  # fmt: skip

    turn("s", "alpha one")
    persist_cli(tmp_path, "pin", "s", *at)
    turn("s", "beta")
    assert json.loads(persist_cli(tmp_path, "show", "s", *at, "--json").stdout)["pinned"]
    turn("other", "something else entirely here")
    persist_cli(tmp_path, "gc", "--max-bytes", "6K", *at, check=False)
    shown = persist_cli(tmp_path, "show", "s", *at, "--json", check=False)
    assert shown.returncode == 0, shown.stderr  # pinned: never evicted
    persist_cli(tmp_path, "unpin", "s", *at)  # the way to drop a pin
    turn("s", "gamma")
    assert not json.loads(persist_cli(tmp_path, "show", "s", *at, "--json").stdout)["pinned"]


def test_the_library_keeps_pin_and_hints_unless_a_save_sets_them(tmp_path: Path) -> None:
    toks = list(range(40))
    with persist.Store(tmp_path / "s") as s:
        s.save([kv_cache(32)], toks[:32], identity=IDENTITY, session="a", pin=True, priority=7)
        s.checkpoint([kv_cache(34)], toks[:34], identity=IDENTITY, session="a")
        checkpoints = [e for e in s.entries() if e.role == "checkpoint"]
        assert checkpoints and all(e.pinned for e in checkpoints)  # a pinned session's
        s.save([kv_cache(36)], toks[:36], identity=IDENTITY, session="a")
        assert s.entry("a").pinned and _hints(s, "a") == (0.0, 7)
        s.save([kv_cache(38)], toks[:38], identity=IDENTITY, session="a", ttl=60.0)
        assert s.entry("a").pinned and _hints(s, "a") == (60.0, 0)  # the save's own
        s.save([kv_cache(40)], toks, identity=IDENTITY, session="a", pin=False)
        assert not s.entry("a").pinned  # said so explicitly
        s.save([kv_cache(32)], toks[:32], identity=IDENTITY, session="b")
        assert not s.entry("b").pinned and _hints(s, "b") is None


def test_a_turn_kept_beside_as_a_fork_keeps_the_sessions_pin(
    tiny: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    with persist.Store(tmp_path / "s") as store:
        gen_mod.generate(model, tok, ident, store, session="s", prompt="hi", max_tokens=2)
        store.pin("s")
        store.retain("s", priority=5)
        lost_a_race(monkeypatch, store, ident)
        r = gen_mod.generate(model, tok, ident, store, session="s", prompt="on", max_tokens=2)
        assert r.session == "s~2"
        assert store.entry("s").pinned and store.entry("s~2").pinned
        assert _hints(store, "s") == _hints(store, "s~2") == (0.0, 5)
