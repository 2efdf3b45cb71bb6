"""A rotation (``sync(rekey=True)``, ``persist sync --rekey``) judges the old key's
values by lineage, as a push judges its own key's.

Found from outside (attack 38c, finding 1): the old key's values are tagged under the
old key, so the rotating machine cannot authenticate them, and the rekey treated them
as "nothing there": the first machine to rekey pushed whatever it held over the
fleet's newer turn, over a fleet delete (the deleted session came back), or over
another conversation under the name, with no conflict.  Their tokens, versions and
tombstone versions are readable all the same; they now decide, for a rekey, whether a
copy is the fleet's past (pushed to none) or a fork (``NAME~2``).
Real redis-server, moto's S3 server, real stores.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

import persist
from persist.engine.tiers.lineage import tombstone
from persist.engine.tiers.records import Keys
from persist.errors import PersistError
from tests.golden.cases import IDENTITY, kv_cache

K1, K2 = bytes(range(32)), bytes(range(1, 33))
V1, V2, OTHER = list(range(100, 148)), list(range(100, 160)), list(range(900, 920))


def _restored(tmp: Path, tiers: dict[str, str], name: str) -> Any:
    with persist.Store(tmp / f"fresh-{name}", tier_key=K2, **tiers) as f:
        try:
            return f.restore(name, identity=IDENTITY).tokens
        except PersistError as e:
            return type(e).__name__


@pytest.mark.parametrize("case", ["newer-turn", "tombstone", "other-conversation"])
def test_a_rekey_keeps_the_old_keys_newer_history(
    redis_server: Any, s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    monkeypatch.delenv("PERSIST_TIER_KEY", raising=False)
    tiers = {"shared": redis_server.url, "cold": s3_server.url}
    with persist.Store(tmp_path / "a", tier_key=K1, **tiers) as a:
        a.save([kv_cache(48, 1)], V1, identity=IDENTITY, session="chat")
    with persist.Store(tmp_path / "b", tier_key=K1, **tiers) as b:  # b pulls turn 1, keeps it
        assert b.restore("chat", identity=IDENTITY).tokens == V1
    with persist.Store(tmp_path / "a", tier_key=K1, **tiers) as a:
        if case == "newer-turn":
            a.save([kv_cache(60, 1)], V2, identity=IDENTITY, session="chat")
        elif case == "tombstone":
            assert a.delete("chat", fleet=True)
        else:  # the name now holds another conversation: after a fleet delete, as only
            assert a.delete("chat", fleet=True)  # then may one take it (attack 38d)
            a.save([kv_cache(20, 9)], OTHER, identity=IDENTITY, session="chat")
    shutil.rmtree(tmp_path / "a")  # the old key's writer is gone: only the tiers know
    with persist.Store(tmp_path / "b", tier_key=K2, **tiers) as b:  # rotated to K2
        done = b.sync(rekey=True)
    # the old key's newer turn, delete or conversation is not replaced (attack 38c); nor
    # taken as the fleet's word (attack 38f): K2 cannot tell it from a keyless plant, so
    # b's copy goes nowhere and each tier holding it reports a conflict (exit 1)
    assert done["pushed"] == 0 and not done["deleted_on_fleet"], done
    refused = {(c["tier"], c["session"], c["kept_as"]) for c in done["conflicts"]}
    assert refused == {("cold", "chat", None), ("shared", "chat", None)}, done
    assert _restored(tmp_path, tiers, "chat") != V1


def test_a_rekey_of_a_history_of_its_own_goes_beside_the_old_keys(
    redis_server: Any, s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """b's own turn that does not continue the old key's session: kept as chat~2."""
    monkeypatch.delenv("PERSIST_TIER_KEY", raising=False)
    tiers = {"shared": redis_server.url, "cold": s3_server.url}
    with persist.Store(tmp_path / "a", tier_key=K1, **tiers) as a:
        a.save([kv_cache(48, 1)], V1, identity=IDENTITY, session="chat")
    with persist.Store(tmp_path / "b", tier_key=K2) as b:  # saved away from the tiers
        b.save([kv_cache(20, 9)], OTHER, identity=IDENTITY, session="chat")
    with persist.Store(tmp_path / "b", tier_key=K2, **tiers) as b:
        done = b.sync(rekey=True)
    kept = {(c["tier"], c["session"], c["kept_as"]) for c in done["conflicts"]}
    assert kept == {("cold", "chat", "chat~2")}, done
    assert _restored(tmp_path, tiers, "chat~2") == OTHER


def test_a_rekey_that_continues_the_old_keys_session_takes_the_name(
    redis_server: Any, s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rotation still does its work: a later turn replaces the old key's pointer."""
    monkeypatch.delenv("PERSIST_TIER_KEY", raising=False)
    tiers = {"shared": redis_server.url, "cold": s3_server.url}
    with persist.Store(tmp_path / "a", tier_key=K1, **tiers) as a:
        a.save([kv_cache(48, 1)], V1, identity=IDENTITY, session="chat")
    with persist.Store(tmp_path / "a", tier_key=K2) as a:
        a.save([kv_cache(60, 1)], V2, identity=IDENTITY, session="chat")
    with persist.Store(tmp_path / "a", tier_key=K2, **tiers) as a:
        done = a.sync(rekey=True)
    assert not done["conflicts"] and done["pushed"] == 2, done
    assert _restored(tmp_path, tiers, "chat") == V2


@pytest.mark.parametrize("tier", ["redis_server", "s3_server"])
def test_a_rekey_racing_an_old_key_push_keeps_that_turn(
    tier: str, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In the rotation window a machine still on K1 pushes its turn between the rekeying
    machine's read of the name and its write: the rekey reads again and goes beside."""
    monkeypatch.delenv("PERSIST_TIER_KEY", raising=False)
    server = request.getfixturevalue(tier)
    where = {"shared" if tier == "redis_server" else "cold": server.url}
    mine, theirs = [*V1, *range(200, 210)], [*V1, *range(300, 310)]
    with persist.Store(tmp_path / "a", tier_key=K1, **where) as a:
        a.save([kv_cache(48, 1)], V1, identity=IDENTITY, session="chat")
    with persist.Store(tmp_path / "b", tier_key=K1, **where) as b:
        assert b.restore("chat", identity=IDENTITY).tokens == V1
    with persist.Store(tmp_path / "a", tier_key=K1) as a, persist.Store(tmp_path / "b") as b:
        a.save([kv_cache(58, 2)], mine, identity=IDENTITY, session="chat")
        b.save([kv_cache(58, 3)], theirs, identity=IDENTITY, session="chat")
    reports: dict[str, Any] = {}
    with (
        persist.Store(tmp_path / "a", tier_key=K1, **where) as a,
        persist.Store(tmp_path / "b", tier_key=K2, **where) as b,
    ):
        write = b.tiers[0].tier.put_record

        def between(*args: Any, **kwargs: Any) -> Any:
            if "a" not in reports:
                reports["a"] = a.sync()  # the old key's turn lands in the window
            return write(*args, **kwargs)

        monkeypatch.setattr(b.tiers[0].tier, "put_record", between)
        reports["b"] = b.sync(rekey=True)
    assert not reports["a"]["conflicts"], reports["a"]
    got = [(c["session"], c["kept_as"]) for c in reports["b"]["conflicts"]]
    assert got == [("chat", "chat~2")], reports["b"]
    with persist.Store(tmp_path / "k1", tier_key=K1, **where) as k:
        assert k.restore("chat", identity=IDENTITY).tokens == mine  # a's turn, kept
    assert _restored(tmp_path, where, "chat~2") == theirs


@pytest.mark.parametrize("planted_on", ["shared", "cold"])
@pytest.mark.parametrize("forged", ["tombstone", "stripped"])
def test_a_rekey_does_not_take_a_forged_value_for_the_fleets_word(
    redis_server: Any,
    s3_server: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    planted_on: str,
    forged: str,
) -> None:
    """Attack 38f, finding 1: mid-rotation, a writer without a key SETs an untagged
    tombstone under a live session's name on one tier.  Every
    ``sync --rekey`` said "deleted on the fleet, not pushed back (persist rm drops it)",
    exit 0, and the session never moved to the new key.  Now it is a conflict naming the
    tier, the copy is kept and pushed nowhere, and once the plant is gone the rotation
    moves the session."""
    monkeypatch.delenv("PERSIST_TIER_KEY", raising=False)
    tiers = {"shared": redis_server.url, "cold": s3_server.url}
    with persist.Store(tmp_path / "a", tier_key=K1, **tiers) as a:
        a.save([kv_cache(48, 1)], V1, identity=IDENTITY, session="chat")
        tier = next(t.tier for t in a.tiers if t.name == planted_on)
        held, token = tier.session_pointer("default", b"chat")
        if forged == "tombstone":
            plant = tombstone(Keys(None), "default", "chat", 4e9)  # no key: no tag
        else:  # the old pointer's tag stripped: its record's lineage still decides
            plant = held.partition(b".")[0]
        assert tier.swap_session("default", b"chat", plant, token)
    with persist.Store(tmp_path / "a", tier_key=K2) as a:  # a's copy, rotated to K2
        a.save([kv_cache(60, 1)], V2, identity=IDENTITY, session="chat")
    with persist.Store(tmp_path / "a", tier_key=K2, **tiers) as a:
        done = a.sync(rekey=True)
        assert not done["deleted_on_fleet"], done
        assert a.entry("chat").tokens == len(V2)  # kept here
        if forged == "tombstone":
            assert done["pushed"] == 0, done
            refused = [c for c in done["conflicts"] if c["kept_as"] is None]
            assert [(c["tier"], c["session"]) for c in refused] == [(planted_on, "chat")]
            assert "tombstone no key here authenticates" in refused[0]["why"]
            tier = next(t.tier for t in a.tiers if t.name == planted_on)
            now = tier.session_pointer("default", b"chat")[1]  # the operator puts back
            assert tier.swap_session("default", b"chat", held, now)  # what was there
            done = a.sync(rekey=True)
    assert not done["conflicts"] and not done["deleted_on_fleet"], done
    assert _restored(tmp_path, tiers, "chat") == V2  # the rotation moved the session
