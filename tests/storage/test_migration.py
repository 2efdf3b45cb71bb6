"""A store written by schema version 1 (round 1) opens, migrates and serves.

tests/golden/store_v1 was written by round 1's code: sessions s300 (tokens
0..299) and s20 (0..19, which got the id of a deleted session: v1 reused ids).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from mlx_lm.models import cache as mc

import persist
from persist.storage.schema import SCHEMA_VERSION
from tests.golden.cases import IDENTITY, kvs
from tests.helpers import ROOT, raw

GOLDEN = ROOT / "tests" / "golden" / "store_v1"


def test_v1_store_migrates_in_place(tmp_path: Path) -> None:
    root = tmp_path / "store"
    shutil.copytree(GOLDEN, root)
    with persist.Store(root) as s:
        version = s.index.db.execute("SELECT value FROM meta WHERE key = 'schema_version'")
        assert version.fetchone()[0] == str(SCHEMA_VERSION) == "8"
        assert s.check() == []
        got = s.restore("s300", identity=IDENTITY)
        want = kvs(100, 300)
        assert raw(got.cache[0].keys[..., :300, :]) == raw(want[0])
        # the backfilled lookup keys give token-exact hits inside the first block
        prompt = list(range(40)) + [999, 1000]
        hit = s.lookup(prompt, identity=IDENTITY)
        assert hit is not None and hit.entry.session == "s300" and len(hit.tokens) == 40
        assert raw(hit.cache[0].keys[..., :40, :]) == raw(want[0][..., :40, :])
        # ids are never reused from now on, not even the ones v1 gave out
        c = mc.KVCache()
        c.update_and_fetch(*kvs(7, 30))
        s.delete("s20")
        info = s.save([c], list(range(500, 530)), identity=IDENTITY, session="new")
        assert info.id == 3
        s.delete("new")
        c2 = mc.KVCache()
        c2.update_and_fetch(*kvs(8, 30))
        assert s.save([c2], list(range(600, 630)), identity=IDENTITY, session="n2").id == 4
        assert s.check() == []
