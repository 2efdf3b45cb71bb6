"""A session deleted here and started again under its name is a new history: its push
keeps the fleet's session and goes beside it (``NAME~2``), reported as a conflict.

Found from outside (round 5's attack on the fleet): after ``persist rm chat`` the
store still remembered the fleet's version of ``chat`` as one it had seen, so a
new conversation under the name (``generate --new``) replaced the fleet's
pointer and every machine resumed it.  Real redis-server, real stores.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlx_lm.models import cache as mc

import persist
from tests.golden.cases import IDENTITY, kvs


def kv(n: int, seed: int) -> Any:
    c = mc.KVCache()
    c.update_and_fetch(*kvs(seed, n))
    return c


def test_a_session_deleted_and_begun_again_never_replaces_the_fleets(
    redis_server: Any, tmp_path: Path
) -> None:
    url = redis_server.url
    fleet = list(range(100, 148))
    with persist.Store(tmp_path / "a", shared=url) as a:
        a.save([kv(48, 1)], fleet, identity=IDENTITY, session="chat")
        a.delete("chat")  # here only: the fleet still holds it
        other = list(range(900, 940))
        a.save([kv(40, 2)], other, identity=IDENTITY, session="chat")
        report = a.sync()
    assert report["conflicts"], report
    with persist.Store(tmp_path / "c", shared=url) as c:
        assert c.restore("chat", identity=IDENTITY).tokens == fleet
        assert c.restore("chat~2", identity=IDENTITY).tokens == other
