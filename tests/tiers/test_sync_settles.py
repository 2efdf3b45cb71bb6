"""``persist sync`` after a fork settles: the second sync pushes nothing and changes no
value on a tier.

Found from outside: store a saved ``chat`` (a 40-token prompt on the tiny model)
while the fleet held another history of it, so its push went beside the fleet's
as ``chat~2``; the two share their first 16 tokens, so one ``head`` pointer
serves both.  From then on every ``persist sync`` reported "pushed 1" and wrote
the shared tier again, forever: a pointer naming the other history's record (a
valid record that serves the same prefix) was taken as wrong and rewritten (two
histories in one store flipped it back and forth), and a push kept beside the
tier's session was counted as pushed even when the tier held all of it already.
Real redis-server and moto's S3 server, the tiny llama model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import persist
from tests.helpers import prefill, tokens_for

HEAD = tokens_for(16, seed=60)  # the 16 tokens both histories begin with
FLEETS = [*HEAD, *tokens_for(24, seed=61)]  # the fleet's chat, 40 tokens
MINE = [*HEAD, *tokens_for(24, seed=62)]  # a's, which does not continue it


def values(redis: Any, s3: Any | None) -> dict[Any, Any]:
    """Every key's value on Redis (and every object's ETag on S3): what a sync changed."""
    r = redis.client()
    got: dict[Any, Any] = {k: r.get(k) for k in r.scan_iter("persist:*")}
    if s3 is not None:
        listed = s3.client().list_objects_v2(Bucket="persist-test").get("Contents", [])
        got.update({o["Key"]: o["ETag"] for o in listed})
    return got


def synced_three_times(a: persist.Store, redis: Any, s3: Any | None) -> list[dict[str, Any]]:
    reports, before = [], None
    for i in range(3):
        reports.append(a.sync())
        now = values(redis, s3)
        if i:
            assert now == before, f"sync {i + 1} changed the tier"
        before = now
    for i, report in enumerate(reports[1:], 2):
        pushed = {t: n["pushed"] for t, n in report["tiers"].items()}
        assert set(pushed.values()) == {0}, f"sync {i}: {report}"
        assert report["failed"] == 0, report
    return reports


@pytest.mark.parametrize("cold", [False, True], ids=["redis", "redis+s3"])
def test_sync_after_a_fork_pushes_nothing_the_second_time(
    cold: bool, tiny: Any, redis_server: Any, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    s3 = request.getfixturevalue("s3_server") if cold else None
    where = {"shared": redis_server.url, **({"cold": s3.url} if s3 else {})}
    with persist.Store(tmp_path / "b", **where) as b:  # the fleet's history of chat
        b.save(prefill(model, FLEETS)[0], FLEETS, identity=ident, session="chat")
    with persist.Store(tmp_path / "a", **where) as a:
        a.save(prefill(model, MINE)[0], MINE, identity=ident, session="chat")  # -> chat~2
        reports = synced_three_times(a, redis_server, s3)
    forks = [(c["session"], c["kept_as"]) for c in reports[-1]["conflicts"]]
    assert forks and set(forks) == {("chat", "chat~2")}, reports[-1]  # still said
    with persist.Store(tmp_path / "c", **where) as c:  # both histories, whole
        assert c.restore("chat", identity=ident).tokens == FLEETS
        assert c.restore("chat~2", identity=ident).tokens == MINE


def test_two_histories_in_one_store_stop_taking_the_head_from_each_other(
    tiny: Any, redis_server: Any, tmp_path: Path
) -> None:
    """A store holding ``chat`` and its local fork ``chat~2`` (a turn that lost its local
    race), which share a 16-token head: each sync's push of one rewrote the head
    pointer the other had written, "pushed 2" forever."""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    with persist.Store(tmp_path / "a", shared=redis_server.url) as a:
        a.save(prefill(model, FLEETS)[0], FLEETS, identity=ident, session="chat")
        a.save(prefill(model, MINE)[0], MINE, identity=ident, session="chat~2")
        synced_three_times(a, redis_server, None)
    with persist.Store(tmp_path / "c", shared=redis_server.url) as c:
        assert c.restore("chat", identity=ident).tokens == FLEETS
        assert c.restore("chat~2", identity=ident).tokens == MINE
