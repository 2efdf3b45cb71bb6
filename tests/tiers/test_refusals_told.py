"""A shared tier that answers "no" (out of memory under Redis's default policy,
noeviction; an ACL) fails each push it refuses: the operator is told, in the log
(the first refusal at once, then one line a minute with the count) and on
/metrics, not only in ``persist stats`` (found from outside: a full Redis left
the fleet without a line anywhere)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

import persist
from tests.helpers import prefill, tokens_for
from tests.tiers.conftest import Clock


def _full(redis_server: Any) -> None:
    r = redis_server.client()
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", str(int(r.info("memory")["used_memory"]) + 4096))


def test_refusals_are_logged_once_a_minute_with_their_count(
    tiny: Any, redis_server: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    _full(redis_server)
    caplog.set_level(logging.WARNING, logger="persist")
    with persist.Store(tmp_path / "a", shared=redis_server.url) as store:
        clock = Clock(store)
        for i in range(3):
            toks = tokens_for(300, seed=40 + i)
            store.save(prefill(model, toks)[0], toks, identity=ident, session=f"s{i}")
        said = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert len(said) == 1, said
        assert "shared tier" in said[0] and "maxmemory" in said[0]
        assert store.shared is not None
        refused = store.shared.tier.counters.get("errors", 0)
        assert refused > 1
        clock.advance(61)
        toks = tokens_for(300, seed=49)
        store.save(prefill(model, toks)[0], toks, identity=ident, session="late")
        said = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert len(said) == 2, said
        assert f"({refused - 1} more since the last such line)" in said[1], said[1]
