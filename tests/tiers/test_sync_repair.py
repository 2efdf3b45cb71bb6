"""``sync`` repairs what a writer without the operator key replaced or planted on a
tier (blobs, records, pointers), and says truthfully what it pushed.  Blobs are
written SET NX / If-None-Match, so a push that only asked whether a key exists left
such damage for good and reported the session present (found by attacks on the
fleet tiers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import persist
from persist.remote.redis_tier import RedisTier
from tests.helpers import prefill, tokens_for
from tests.tiers.tier_values import blob_keys, keys_of

KEY = bytes(range(32))


def test_sync_repairs_a_blob_a_hostile_writer_corrupted(
    tiny: Any, redis_server: Any, tmp_path: Path
) -> None:
    """A machine without the key overwrites a session's blobs on Redis (a keyed reader
    rightly calls them unauthenticated).  The owner runs ``persist sync``: it must push
    them again (or at least not report the session as present on the tier); today the
    push only asks EXISTS, the blob stays broken and no other machine can restore."""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    r, p = redis_server.client(), RedisTier.prefix("default")
    toks = tokens_for(300, seed=3)
    with persist.Store(tmp_path / "a", shared=redis_server.url, tier_key=KEY) as a:
        a.save(prefill(model, toks)[0], toks, identity=ident, session="s")
        for k in blob_keys(r, p):
            r.set(k, b"\0" * len(r.get(k) or b""))  # the hostile write
        report = a.sync()
        assert report["tiers"]["shared"] == {"pushed": 1, "present": 0, "failed": 0, "held": 0}
        assert a.sync()["tiers"]["shared"]["present"] == 1  # repaired: now it is there
    with persist.Store(tmp_path / "b", shared=redis_server.url, tier_key=KEY) as b:
        assert b.restore("s", identity=ident).tokens == toks


def test_a_blob_planted_ahead_of_the_save_never_blocks_the_cache(
    tiny: Any, redis_server: Any, tmp_path: Path
) -> None:
    """Blob names are content keys (plus the key's id, readable from any blob on the tier),
    so anyone who can run the same model on a known prompt (a shared system prompt)
    knows them before the honest save.  Garbage planted there without a TTL makes every
    honest push of that blob a no-op (SET NX): the cache is lost to the whole fleet for
    good, and sync cannot repair it."""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    r, p = redis_server.client(), RedisTier.prefix("default")
    toks = tokens_for(300, seed=4)
    cache = prefill(model, toks)[0]
    with persist.Store(tmp_path / "a", shared=redis_server.url, tier_key=KEY) as a:
        a.save(cache, toks, identity=ident, session="probe")  # the attacker's rehearsal
    names = blob_keys(r, p)
    r.flushall()  # the tier loses everything; the attacker then plants ahead of anyone
    for k in names:
        r.set(k, b"garbage")
    with persist.Store(tmp_path / "h", shared=redis_server.url, tier_key=KEY) as h:
        h.save(cache, toks, identity=ident, session="s")
        h.sync()
    with persist.Store(tmp_path / "b", shared=redis_server.url, tier_key=KEY) as b:
        assert b.restore("s", identity=ident).tokens == toks


def test_sync_repairs_a_corrupted_object_on_the_cold_tier(
    tiny: Any, s3_server: Any, tmp_path: Path
) -> None:
    """rec/ and blob/ objects are written with If-None-Match: once a hostile writer has
    replaced one with garbage, no push of the owner ever replaces it; ``sync`` counts the
    session as present and a machine with only the cold tier never gets it back."""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    s3 = s3_server.client()
    toks = tokens_for(300, seed=5)
    with persist.Store(tmp_path / "a", cold=s3_server.url, tier_key=KEY) as a:
        a.save(prefill(model, toks)[0], toks, identity=ident, session="s")
        objs = s3.list_objects_v2(Bucket="persist-test")["Contents"]
        for o in objs:
            if "/rec/" in o["Key"] or "/blob/" in o["Key"]:
                s3.put_object(Bucket="persist-test", Key=o["Key"], Body=b"\0" * o["Size"])
        assert a.sync()["tiers"]["cold"]["pushed"] == 1
    with persist.Store(tmp_path / "b", cold=s3_server.url, tier_key=KEY) as b:
        assert b.restore("s", identity=ident).tokens == toks


def test_blob_marks_forget_the_oldest_and_a_bad_mark_wins() -> None:
    """The set of blobs verified good is bounded (a long-lived server reads the oldest
    again), and a blob a restore found wrong is never taken as good until rewritten."""
    from persist.remote.blob_marks import BlobMarks

    m = BlobMarks(good=2, bad=2)
    for n in ("a", "b", "c"):
        m.good("ns", n)
    assert not m.is_good("ns", "a") and m.is_good("ns", "b") and m.is_good("ns", "c")
    m.bad("ns", "c")
    assert not m.is_good("ns", "c")
    m.good("ns", "c")  # rewritten (or read back right)
    assert m.is_good("ns", "c")


def test_sync_repairs_pointers_of_an_untrimmable_snapshot(
    tiny: Any, redis_server: Any, tmp_path: Path
) -> None:
    """A recurrent model's snapshot (untrimmable) is found by prompt through its blk/head
    pointers.  A machine without the key can read those keys (SCAN) and overwrite their
    values with junk, without a TTL.  The owner's sync must put them back; today the
    pointers are written SET NX, the junk stays for good and no other machine's
    lookup of that prompt ever hits the tier again."""
    model, tok, _ = tiny("mamba2")
    ident = persist.ModelIdentity.of(model, tok)
    r, p = redis_server.client(), RedisTier.prefix("default")
    toks = tokens_for(300, seed=7)
    with persist.Store(tmp_path / "a", shared=redis_server.url, tier_key=KEY) as a:
        a.save(prefill(model, toks)[0], toks, identity=ident, session="s")
        ptrs = keys_of(r, p, "blk") + keys_of(r, p, "head")
        assert ptrs
        for k in ptrs:
            r.set(k, b"junk")  # the hostile write, no TTL
        a.sync()
    held = [r.get(k) for k in ptrs]
    with persist.Store(tmp_path / "b", shared=redis_server.url, tier_key=KEY) as b:
        assert b.lookup([*toks, 1], identity=ident) is not None
    assert b"junk" not in held, "sync left planted pointers in place"


def test_sync_reports_a_repaired_session_pointer_as_pushed(
    tiny: Any, redis_server: Any, tmp_path: Path
) -> None:
    """A hostile writer replaces session s's pointer (``sess:s``) with junk: no machine
    can restore s from the tier.  The owner's sync writes it again (so s is restorable),
    but reports the snapshot as already there and right: ``present`` 1, ``pushed`` 0."""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    r, p = redis_server.client(), RedisTier.prefix("default")
    toks = tokens_for(300, seed=8)
    with persist.Store(tmp_path / "a", shared=redis_server.url, tier_key=KEY) as a:
        a.save(prefill(model, toks)[0], toks, identity=ident, session="s")
        r.set(f"{p}sess:s", b"junk")
        report = a.sync()
    with persist.Store(tmp_path / "b", shared=redis_server.url, tier_key=KEY) as b:
        assert b.restore("s", identity=ident).tokens == toks  # repaired
    assert report["tiers"]["shared"] == {"pushed": 1, "present": 0, "failed": 0, "held": 0}
