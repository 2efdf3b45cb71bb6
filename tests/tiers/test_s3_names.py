"""Every valid session name reaches S3 and comes back; a key the object store refuses
is that key's failure, never an outage for the whole store (moto's server)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

import persist
from persist.remote.s3_tier import S3Tier, object_name
from tests.helpers import assert_same_state, live_state, prefill, tokens_for

NAMES = ["a//b", "../x", "a/b/", "x/../y", "./z", "..", ".", "%2F", "ü/ß 1", "n" * 1000, "q"]


def test_every_valid_session_name_round_trips_through_s3(
    tiny: Any, s3_server: Any, tmp_path: Path
) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(300, seed=12)
    cache, _ = prefill(model, toks)
    with persist.Store(tmp_path / "a", cold=s3_server.url) as a:
        for name in NAMES:  # a plain `q` last: nothing before it may hold it back
            a.save(cache, toks, identity=ident, session=name)
        assert a.cold is not None
        assert a.cold.tier.counters.get("errors", 0) == 0
        assert a.cold.tier.counters.get("refused", 0) == 0
    with persist.Store(tmp_path / "b", cold=s3_server.url) as b:
        for name in NAMES:
            got = b.restore(name, identity=ident)
            assert got.tokens == toks and got.entry.session == name
        assert_same_state(live_state(got.cache), live_state(cache))
    assert len({object_name(n) for n in NAMES}) == len(NAMES)  # no two names share a key


def test_one_refused_key_never_opens_the_breaker(
    tiny: Any,
    s3_server: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An object store that refuses one path (before the name encoding, obstore's
    parser refused `../x`) fails that push only; the next save still reaches S3."""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(300, seed=13)
    cache, _ = prefill(model, toks)
    real = S3Tier._path

    def refusing(self: S3Tier, namespace: str, *parts: str) -> str:
        path = real(self, namespace, *parts)
        return path + "//" if parts[-1] == object_name("bad") else path  # unparseable

    monkeypatch.setattr(S3Tier, "_path", refusing)
    caplog.set_level(logging.WARNING, logger="persist")
    with persist.Store(tmp_path / "a", cold=s3_server.url) as a:
        a.save(cache, toks, identity=ident, session="bad")  # the local save stands
        a.save(cache, toks, identity=ident, session="q")
        assert a.cold is not None and a.cold.tier.counters.get("refused", 0) >= 1
        assert a.cold.tier.counters.get("errors", 0) == 0
        told = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert len(told) == 1 and told[0].startswith(f"persist: cold tier {s3_server.url}")
        assert a.cold.tier.refusals.total == a.cold.tier.counters["refused"]
        assert a.sync(namespace="default")["failed"] == 1  # `bad` only, and said so
    with persist.Store(tmp_path / "b", cold=s3_server.url) as b:
        assert b.restore("q", identity=ident).tokens == toks


def test_hostile_cold_values_are_misses(tiny: Any, s3_server: Any, tmp_path: Path) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(300, seed=14)
    with persist.Store(tmp_path / "a", cold=s3_server.url) as a:
        for name in ("x", "y"):
            a.save(prefill(model, toks)[0], toks, identity=ident, session=name)
    s3 = s3_server.client()
    objects = [o["Key"] for o in s3.list_objects_v2(Bucket="persist-test")["Contents"]]
    (sess_x,) = [k for k in objects if k.endswith("/sess/x")]
    s3.put_object(Bucket="persist-test", Key=sess_x, Body=b"\xff" * 200)  # not a pointer
    with persist.Store(tmp_path / "b", cold=s3_server.url) as b:
        with pytest.raises(persist.SessionNotFoundError):
            b.restore("x", identity=ident)
        assert b.restore("y", identity=ident).tokens == toks
        assert b.cold is not None and b.cold.tier.counters.get("errors", 0) == 0


def test_a_name_with_a_lone_surrogate_is_refused_before_any_tier(
    tiny: Any, s3_server: Any, tmp_path: Path
) -> None:
    """check_name takes any text without NUL that UTF-8 can hold: a lone surrogate (no
    S3 key can hold it) is InvalidNameError at the save, never a UnicodeError from the
    cold tier's push, and nothing reaches S3."""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    t = tokens_for(260, seed=1)
    with persist.Store(tmp_path / "a", cold=s3_server.url) as a:
        with pytest.raises(persist.errors.InvalidNameError, match="lone surrogate"):
            a.save(prefill(model, t)[0], t, identity=ident, session="a\udcffb")
        assert a.sessions() == []
    assert "Contents" not in s3_server.client().list_objects_v2(Bucket="persist-test")
