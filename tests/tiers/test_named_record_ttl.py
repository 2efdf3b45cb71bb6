"""A named session's record on Redis is durable only once its pointer names it.

A push writes the record, then swaps the ``sess:`` pointer.  The record used to be
written without a TTL: a pusher that died (or lost Redis) between the two left a
record nothing names that Redis kept for good.  Now it is written with the tier's
TTL and made durable (PERSIST) in the swap's own transaction.  Real redis-server
(and a real 3-node Redis Cluster); the pusher cut off between the two writes is
a server that refuses the swap.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import persist
from persist.remote.redis_tier import RedisTier
from tests.golden.cases import IDENTITY, kv_cache

TOKENS = list(range(100, 148))


def records(client: Any) -> list[bytes]:
    return [k for k in client.scan_iter(f"{RedisTier.prefix('default')}rec:*")]


def test_a_push_cut_off_before_its_pointer_leaves_no_record_without_a_ttl(
    redis_server: Any, tmp_path: Path
) -> None:
    """The server refuses the pointer's compare-and-set (an ACL without WATCH), as a
    pusher that dies or loses Redis between the record and the pointer."""
    r = redis_server.client()
    r.execute_command("ACL", "SETUSER", "bob", "on", ">pw", "~*", "+@all", "-watch")
    bob = redis_server.url.replace("redis://", "redis://bob:pw@")
    with persist.Store(tmp_path / "a", shared=bob) as a:
        a.save([kv_cache(48, 1)], TOKENS, identity=IDENTITY, session="chat")
    assert [r.ttl(k) > 0 for k in records(r)] == [True], [r.ttl(k) for k in records(r)]


@pytest.mark.parametrize("server", ["redis_server", "redis_cluster"])
def test_a_named_record_its_pointer_names_has_no_ttl(
    server: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    tier = request.getfixturevalue(server)
    with persist.Store(tmp_path / "a", shared=tier.url) as a:
        a.save([kv_cache(48, 1)], TOKENS, identity=IDENTITY, session="chat")
        a.sync()  # the same record pushed again: it stays durable
    clients = [tier.client()] if server == "redis_server" else [n.client() for n in tier.nodes]
    named = [c.ttl(k) for c in clients for k in records(c)]
    assert named == [-1], named
