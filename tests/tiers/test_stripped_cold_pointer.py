"""A tag stripped off the cold tier's session pointer does not stop the keyed fleet's pushes.

Found from outside (finding D, outside attack 38d): someone who can write the bucket
strips the tag off the cold tier's ``chat`` pointer (``<record key>.<tag>`` becomes
``<record key>``).  The cold tier is the only one that vouches for this machine's key
(``fleet_plan``), and it is the one planted: every later push of ``chat`` by every
keyed machine was refused, for good.  Now a pointer whose record opens and
authenticates under this machine's key as ``chat``'s is judged by that record's
lineage: a snapshot that continues it replaces the pointer (counted
``cold_foreign_replaced``).  A keyless fleet's pointer (its record carries no tag)
and another key's stay refused; an older record pointed back to rolls nothing back:
the very record is never re-tagged, a copy the fleet moved past stays unpushed, and
the turn that continues the newer history keeps the name or goes beside.
Real redis-server, moto's S3 server, real stores.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import pytest

import persist
from tests.golden.cases import IDENTITY, kv_cache
from tests.tiers.two_tiers import KEY, restored

K2 = bytes(range(1, 33))
V1, V2, V3, V4 = (list(range(100, n)) for n in (148, 160, 172, 184))
MINE = [*V1, 7, 8, 9, 10]  # a turn on the older copy: another history than V2
TIERS = pytest.mark.parametrize("redis", [True, False], ids=["redis+s3", "s3-only"])


def _tiers(redis_server: Any, s3_server: Any, redis: bool) -> dict[str, Any]:
    return {"cold": s3_server.url, **({"shared": redis_server.url} if redis else {})}


def _cold_key(s3: Any) -> str:
    c = s3.client()
    got = [o["Key"] for o in c.list_objects_v2(Bucket="persist-test").get("Contents", [])]
    [key] = [k for k in got if k.endswith("/sess/chat")]
    return key


def cold_pointer(s3: Any) -> bytes:
    return bytes(s3.client().get_object(Bucket="persist-test", Key=_cold_key(s3))["Body"].read())


def set_cold_pointer(s3: Any, value: bytes) -> None:
    """The attacker: one PUT, no key needed."""
    s3.client().put_object(Bucket="persist-test", Key=_cold_key(s3), Body=value)


def bare(pointer: bytes) -> bytes:
    """``<record key>.<tag>`` without its tag."""
    return pointer.partition(b".")[0]


def save(store: persist.Store, tokens: list[int], name: str = "chat") -> None:
    store.save([kv_cache(len(tokens), 1)], tokens, identity=IDENTITY, session=name)


@TIERS
def test_a_stripped_cold_pointer_does_not_stop_the_next_turn(
    redis_server: Any, s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, redis: bool
) -> None:
    monkeypatch.delenv("PERSIST_TIER_KEY", raising=False)
    tiers = _tiers(redis_server, s3_server, redis)
    with persist.Store(tmp_path / "a", tier_key=KEY, **tiers) as a:
        save(a, V1)
    set_cold_pointer(s3_server, bare(cold_pointer(s3_server)))
    with persist.Store(tmp_path / "a", tier_key=KEY, **tiers) as a:
        save(a, V2)
        counters = a.stats().counters
        assert not counters.get("cold_conflicts") and not counters.get("shared_conflicts"), counters
        assert counters.get("cold_foreign_replaced") == 1, counters
        assert a.sync()["conflicts"] == []
    assert b"." in cold_pointer(s3_server)  # tagged again, by the push that moved it on
    with persist.Store(tmp_path / "fresh", tier_key=KEY, cold=s3_server.url) as f:
        assert restored(f) == V2
    with persist.Store(tmp_path / "other", tier_key=KEY, **tiers) as o:
        save(o, V3)  # another keyed machine goes on from there
        assert not o.stats().counters.get("cold_conflicts")
    with persist.Store(tmp_path / "fresh2", tier_key=KEY, **tiers) as f:
        assert restored(f) == V3


@TIERS
def test_a_sync_of_the_very_record_does_not_retag_the_pointer(
    redis_server: Any, s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, redis: bool
) -> None:
    """The holder of the record the stripped pointer names cannot tell the fleet's latest
    from an older record pointed back to: alone, it writes nothing over it and refuses
    nothing.  Where Redis's pointer names that very record tagged, the cold tier's takes
    those same bytes (a writer who had them could have put them there itself)."""
    monkeypatch.delenv("PERSIST_TIER_KEY", raising=False)
    tiers = _tiers(redis_server, s3_server, redis)
    with persist.Store(tmp_path / "a", tier_key=KEY, **tiers) as a:
        save(a, V1)
    stripped = bare(cold_pointer(s3_server))
    set_cold_pointer(s3_server, stripped)
    with persist.Store(tmp_path / "a", tier_key=KEY, **tiers) as a:
        done = a.sync()
        assert done["conflicts"] == [] and done["failed"] == 0, done
        assert a.stats().counters.get("cold_foreign_replaced", 0) == (1 if redis else 0)
    if redis:
        [key] = list(redis_server.client().scan_iter("*sess:chat"))
        assert cold_pointer(s3_server) == redis_server.client().get(key)
    else:
        assert cold_pointer(s3_server) == stripped
    with persist.Store(tmp_path / "a", tier_key=KEY, **tiers) as a:
        save(a, V2)  # the next turn moves the name on, on every tier
        assert not a.stats().counters.get("cold_conflicts")
    with persist.Store(tmp_path / "fresh", tier_key=KEY, cold=s3_server.url) as f:
        assert restored(f) == V2


KEYLESS_OR_OTHER = pytest.mark.parametrize("fleet", [None, K2], ids=["keyless-fleet", "other-key"])


@KEYLESS_OR_OTHER
@TIERS
def test_a_pointer_whose_record_does_not_authenticate_is_still_refused(
    redis_server: Any, s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    redis: bool, fleet: bytes | None,
) -> None:  # fmt: skip
    """A keyless fleet's untagged pointer names an untagged record, another key's
    stripped pointer a record tagged under that key: neither is this key's history.
    A misconfigured keyed machine holding the fleet's copy, its turn extending it,
    is refused as before and writes nothing."""
    monkeypatch.delenv("PERSIST_TIER_KEY", raising=False)
    tiers = _tiers(redis_server, s3_server, redis)
    with persist.Store(tmp_path / "a", tier_key=fleet, **tiers) as a:
        save(a, V1)
    if fleet is not None:
        set_cold_pointer(s3_server, bare(cold_pointer(s3_server)))
    before = cold_pointer(s3_server)
    assert b"." not in before
    with persist.Store(tmp_path / "a", tier_key=KEY, **tiers) as b:  # the wrong key file
        save(b, V2)
        counters = b.stats().counters
        assert counters.get("cold_conflicts") == 1, counters
        assert not counters.get("cold_foreign_replaced"), counters
        assert {c["tier"] for c in b.sync()["conflicts"]} == set(tiers)
    assert cold_pointer(s3_server) == before
    if fleet is None:
        with persist.Store(tmp_path / "fresh", **tiers) as f:
            assert restored(f) == V1  # the keyless fleet's, untouched


def _three_turns(tmp: Path, tiers: dict[str, Any], s3: Any, b_holds: int) -> list[bytes]:
    """``a`` saves V1, V2, V3; ``b`` pulled turn ``b_holds`` (1 or 2) on the way and
    kept it.  The cold tier's pointer after each turn, untagged."""
    olds = []
    for n, toks in enumerate((V1, V2, V3), 1):
        with persist.Store(tmp / "a", tier_key=KEY, **tiers) as a:
            save(a, toks)
        olds.append(bare(cold_pointer(s3)))
        if n == b_holds:
            with persist.Store(tmp / "b", tier_key=KEY, **tiers) as b:
                assert restored(b) == toks
    return olds


POINTED = pytest.mark.parametrize("pointed", [2, 1], ids=["its-copy", "older-than-its-copy"])


@POINTED
@TIERS
def test_an_older_record_pointed_back_to_rolls_nothing_back(
    redis_server: Any, s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    redis: bool, pointed: int,
) -> None:  # fmt: skip
    """The attacker points the cold pointer, untagged, at an OLDER record of the name (the
    cold tier keeps every record): the very one machine ``b`` holds a copy of (turn 2),
    or one older still.  ``b`` pushes nothing over the fleet: its copy neither re-tags
    the pointer nor moves it on to turn 2 (the fleet is at turn 3), and with Redis
    holding turn 3 its copy is "behind".  The machine that holds turn 3 moves the
    name on over the planted pointer with its next turn."""
    monkeypatch.delenv("PERSIST_TIER_KEY", raising=False)
    tiers = _tiers(redis_server, s3_server, redis)
    olds = _three_turns(tmp_path, tiers, s3_server, 2)
    set_cold_pointer(s3_server, olds[pointed - 1])
    with persist.Store(tmp_path / "b", tier_key=KEY, **tiers) as b:
        done = b.sync()
        assert done["conflicts"] == [] and done["deleted_on_fleet"] == [], done
        assert not b.stats().counters.get("cold_foreign_replaced"), done
    assert cold_pointer(s3_server) == olds[pointed - 1]  # no rollback made authentic
    with persist.Store(tmp_path / "a", tier_key=KEY, **tiers) as a:
        save(a, V4)  # continues turn 3: takes the name over the planted pointer
        counters = a.stats().counters
        assert not counters.get("cold_conflicts") and not counters.get("shared_conflicts"), counters
        assert counters.get("cold_foreign_replaced") == 1, counters
    with persist.Store(tmp_path / "fresh", tier_key=KEY, **tiers) as f:
        assert restored(f) == V4
    with persist.Store(tmp_path / "b", tier_key=KEY, **tiers) as b:
        done = b.sync()  # b's turn-2 copy is the fleet's past now
        assert done["conflicts"] == [] and done["pushed"] == 0, done
    with persist.Store(tmp_path / "fresh2", tier_key=KEY, **tiers) as f:
        assert restored(f) == V4


def test_a_copy_does_not_replace_a_plant_on_redis_under_a_stripped_cold_pointer(
    redis_server: Any, s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both tiers planted: the cold pointer untagged at turn 1, Redis's a forged
    tombstone.  A stripped cold pointer vouches for a turn saved here, never for a copy:
    ``b``'s turn-2 copy is refused (written over neither), the holder of turn 3 moves
    the name on on both tiers with its next turn."""
    monkeypatch.delenv("PERSIST_TIER_KEY", raising=False)
    tiers = _tiers(redis_server, s3_server, True)
    olds = _three_turns(tmp_path, tiers, s3_server, 2)
    set_cold_pointer(s3_server, olds[0])
    r = redis_server.client()
    [key] = list(r.scan_iter("*sess:chat"))
    r.set(key, b"~" + struct.pack(">d", 4e9).hex().encode())
    with persist.Store(tmp_path / "b", tier_key=KEY, **tiers) as b:
        done = b.sync()
        assert [c["tier"] for c in done["conflicts"]] == ["shared"], done
    assert r.get(key).startswith(b"~") and cold_pointer(s3_server) == olds[0]
    with persist.Store(tmp_path / "a", tier_key=KEY, **tiers) as a:
        save(a, V4)
        counters = a.stats().counters
        assert not counters.get("cold_conflicts") and not counters.get("shared_conflicts"), counters
        assert counters.get("shared_foreign_replaced") == counters.get("cold_foreign_replaced") == 1
    with persist.Store(tmp_path / "fresh", tier_key=KEY, shared=redis_server.url) as f:
        assert restored(f) == V4


@TIERS
def test_a_turn_on_the_older_copy_loses_no_newer_turn(
    redis_server: Any, s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, redis: bool
) -> None:
    """The older record's holder saves a turn of its own on it while the cold pointer
    names that record untagged.  With Redis holding the fleet's newer turn, that turn is
    another history beside it (``chat~2``); on the cold tier alone nothing shows the
    newer turn, so the new one takes the name and the newer turn's next push goes
    beside it.  Either way both histories stay on the fleet, a conflict reported."""
    monkeypatch.delenv("PERSIST_TIER_KEY", raising=False)
    tiers = _tiers(redis_server, s3_server, redis)
    with persist.Store(tmp_path / "a", tier_key=KEY, **tiers) as a:
        save(a, V1)
    old = bare(cold_pointer(s3_server))
    with persist.Store(tmp_path / "b", tier_key=KEY, **tiers) as b:
        assert restored(b) == V1
    with persist.Store(tmp_path / "a", tier_key=KEY, **tiers) as a:
        save(a, V2)
    set_cold_pointer(s3_server, old)
    with persist.Store(tmp_path / "b", tier_key=KEY, **tiers) as b:
        save(b, MINE)
        assert b.stats().counters.get("cold_conflicts", 0) == (1 if redis else 0)
    with persist.Store(tmp_path / "a", tier_key=KEY, **tiers) as a:
        save(a, V3)
        assert a.stats().counters.get("cold_conflicts", 0) == (0 if redis else 1)
    with persist.Store(tmp_path / "fresh", tier_key=KEY, **tiers) as f:
        got = {tuple(restored(f, n) or ()) for n in ("chat", "chat~2")}
        assert got == {tuple(V3), tuple(MINE)}
        assert restored(f, "chat") == (V3 if redis else MINE)


def test_a_reader_does_not_repair_a_stripped_newer_cold_pointer_back(
    redis_server: Any, s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis names the older turn (a failover to a replica that missed the last write),
    the cold tier the newer one with its tag stripped.  A fresh reader used to take the
    stripped pointer for "nothing as new" and repair the cold tier back to Redis's older
    turn: the fleet rolled back, the rollback now authentic.  The repair never goes over
    a newer version its record authenticates here."""
    monkeypatch.delenv("PERSIST_TIER_KEY", raising=False)
    tiers = _tiers(redis_server, s3_server, True)
    r = redis_server.client()
    with persist.Store(tmp_path / "a", tier_key=KEY, **tiers) as a:
        save(a, V1)
    [key] = list(r.scan_iter("*sess:chat"))
    older = r.get(key)
    with persist.Store(tmp_path / "a", tier_key=KEY, **tiers) as a:
        save(a, V2)
    r.set(key, older)  # Redis lost the last write
    newer = bare(cold_pointer(s3_server))
    set_cold_pointer(s3_server, newer)
    with persist.Store(tmp_path / "f", tier_key=KEY, **tiers) as f:
        restored(f)
        counters = f.stats().counters
        assert not counters.get("cold_repaired") and counters.get("cold_repair_declined") == 1
    assert cold_pointer(s3_server) == newer  # not written back to the older turn
    with persist.Store(tmp_path / "a", tier_key=KEY, **tiers) as a:
        save(a, V3)
        assert not a.stats().counters.get("cold_conflicts")
    with persist.Store(tmp_path / "g", tier_key=KEY, cold=s3_server.url) as g:
        assert restored(g) == V3


@TIERS
def test_readers_of_a_stripped_cold_pointer(
    redis_server: Any, s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, redis: bool
) -> None:
    """A pull reads nothing through a pointer without a valid tag: alone, the cold tier's
    is unreadable (never "no session"); with Redis naming the same record tagged, the
    pull reads Redis's and repairs the cold pointer to those bytes."""
    monkeypatch.delenv("PERSIST_TIER_KEY", raising=False)
    tiers = _tiers(redis_server, s3_server, redis)
    with persist.Store(tmp_path / "a", tier_key=KEY, **tiers) as a:
        save(a, V1)
    tagged = cold_pointer(s3_server)
    set_cold_pointer(s3_server, bare(tagged))
    with persist.Store(tmp_path / "f", tier_key=KEY, **tiers) as f:
        if not redis:
            with pytest.raises(persist.SessionUnreadableError):
                f.restore("chat", identity=IDENTITY)
            return
        assert restored(f) == V1
        assert f.stats().counters.get("cold_repaired") == 1
    assert cold_pointer(s3_server) == tagged
