"""A shared tier's URL may carry a password (``redis://user:PASSWORD@host``): no
message, log line or error of persist's shows it (found in round 5: the breaker's
warning and every TierUnavailable named the URL as given)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

import persist
from persist.remote.redis_base import RedisConnection, TierUnavailable
from tests.helpers import prefill, tokens_for
from tests.tiers.conftest import free_port


def test_an_outage_never_shows_the_password(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="persist")
    tier = RedisConnection(f"redis://alice:sekr3t@127.0.0.1:{free_port()}/0")
    with pytest.raises(TierUnavailable) as got:
        tier._call("ping", lambda: tier._client.ping())
    assert "sekr3t" not in str(got.value) and "127.0.0.1" in str(got.value)
    assert caplog.records and not any("sekr3t" in r.getMessage() for r in caplog.records)


def test_a_refusal_never_shows_the_password(
    tiny: Any, redis_server: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    redis_server.client().execute_command(
        "ACL", "SETUSER", "alice", "on", ">sekr3t", "~nothing:*", "+@all", "-@admin"
    )
    caplog.set_level(logging.WARNING, logger="persist")
    model, tok, _ = tiny("llama")
    toks = tokens_for(200, seed=3)
    url = redis_server.url.replace("redis://", "redis://alice:sekr3t@")
    with persist.Store(tmp_path / "a", shared=url) as store:
        store.save(prefill(model, toks)[0], toks, identity=persist.ModelIdentity.of(model, tok))
        assert store.shared is not None and store.shared.tier.counters.get("denied")
    said = [r.getMessage() for r in caplog.records]
    assert said and not any("sekr3t" in m for m in said), said


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6399/0?password=SECRETpw",
        "redis://:SECRETpw/ab@127.0.0.1:6399/0",
        "redis://:SECRETpw#ab@127.0.0.1:6399/0",
        "redis://:ab?SECRETpw@127.0.0.1:6399/0",
        "redis://user/x:SECRETpw@127.0.0.1:6399/0",
        "redis+cluster://u:SECRETpw,x@127.0.0.1:7000,127.0.0.1:7001",
        "redis+cluster://u:SECRETpw@127.0.0.1:notaport",
    ],
)
def test_a_url_refused_never_shows_its_password(url: str) -> None:
    """Outside attack r17c: the refusal of a URL redis-py cannot read quoted what
    urlparse made of it, the password included."""
    with pytest.raises(persist.PersistError) as got:
        tier = RedisConnection(url)
        tier._call("ping", lambda: tier._client.ping())  # a cluster's client is made here
    assert "SECRETpw" not in str(got.value), str(got.value)
