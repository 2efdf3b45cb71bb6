"""Attacks on issue 24's fleet tiers, third round (blob repair, sync reports, pointers):
a writer without the operator key replaces values on the tier; the owner's ``sync`` must
repair them and say truthfully what it did."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import persist
from persist.remote.redis_tier import RedisTier
from tests.helpers import prefill, tokens_for

KEY = bytes(range(32))


def _keys(r: Any, p: str, kind: str) -> list[bytes]:
    return sorted(r.scan_iter(f"{p}{kind}:*"))


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
        ptrs = _keys(r, p, "blk") + _keys(r, p, "head")
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
    assert report["tiers"]["shared"] == {"pushed": 1, "present": 0, "failed": 0}
