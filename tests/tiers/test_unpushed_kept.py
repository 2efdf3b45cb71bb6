"""Attack 38b, finding 14: during a cold-tier outage a named session's push is held back
(the session is committed here only), and budget eviction (``gc``, or the automatic one
of a save over ``max_bytes``) deleted it: the only copy, gone everywhere.  A named
session whose latest version no tier holds yet is kept from budget eviction while tiers
are configured: ``gc`` reports it (``unpushed_kept``), a save that finds no other room
is refused with StoreFullError naming it; once pushed, it is evicted as any other.
Real redis-server, moto's S3 server; the outage is S3 at a port nothing listens on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import persist
from tests.golden.cases import IDENTITY, kv_cache
from tests.helpers import persist_cli
from tests.tiers.conftest import s3_down

KEY = bytes(range(32))
V1, V2 = list(range(512)), list(range(600))


def both(tmp: Path, name: str, redis: Any, s3: Any, **kw: Any) -> persist.Store:
    return persist.Store(tmp / name, tier_key=KEY, shared=redis.url, cold=s3.url, **kw)


def test_gc_keeps_a_turn_saved_while_the_cold_tier_was_down(
    redis_server: Any, s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with both(tmp_path, "a", redis_server, s3_server) as a:
        a.save([kv_cache(512, 1)], V1, identity=IDENTITY, session="chat")
    with s3_down(monkeypatch), both(tmp_path, "a", redis_server, s3_server) as a:
        a.save([kv_cache(600, 1)], V2, identity=IDENTITY, session="chat")  # held back
        report = a.gc(max_bytes=1)
        assert (report.evicted, report.unpushed_kept) == ([], 1), report
        assert [e.session for e in a.sessions()] == ["chat"]
        # an operator's gc without the tier settings: a store that pushed keeps it too
        out = persist_cli(tmp_path, "gc", "--max-bytes", "1", "--store", str(tmp_path / "a"))
        assert "kept 1 named session not yet on a tier" in out.stdout, out.stdout
        assert [e.session for e in a.sessions()] == ["chat"]
    with both(tmp_path, "a", redis_server, s3_server) as a:
        assert a.sync()["pushed"] >= 1
        report = a.gc(max_bytes=1)  # on the tiers now: evicted as any other
        assert ([e.session for e in report.evicted], report.unpushed_kept) == (["chat"], 0)
    with both(tmp_path, "fresh", redis_server, s3_server) as f:
        assert f.restore("chat", identity=IDENTITY).tokens == V2


def test_a_save_over_the_budget_evicts_no_unpushed_session(
    redis_server: Any, s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    budget = {"max_bytes": 50_000}
    with s3_down(monkeypatch), both(tmp_path, "b", redis_server, s3_server, **budget) as b:
        b.save([kv_cache(600, 1)], V2, identity=IDENTITY, session="notes")
        with pytest.raises(persist.StoreFullError, match="not yet on a tier"):
            b.save([kv_cache(600, 3)], list(range(1000, 1600)), identity=IDENTITY, session="x")
        assert [e.session for e in b.sessions()] == ["notes"]
    with both(tmp_path, "b", redis_server, s3_server) as b:
        b.sync()
    with both(tmp_path, "g", redis_server, s3_server) as g:
        assert g.restore("notes", identity=IDENTITY).tokens == V2


def test_without_tiers_the_budget_evicts_as_before(tmp_path: Path) -> None:
    with persist.Store(tmp_path / "s") as s:
        s.save([kv_cache(600, 1)], V2, identity=IDENTITY, session="notes")
        report = s.gc(max_bytes=1)
        assert ([e.session for e in report.evicted], report.unpushed_kept) == (["notes"], 0)
