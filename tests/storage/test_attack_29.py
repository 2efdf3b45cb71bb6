"""Attack 29 on the store's listing commands: each test failed before its fix."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner
from mlx_lm.models import cache as mc

import persist
from persist.cli import cli
from tests.golden.cases import IDENTITY, kvs


def test_a_huge_limit_lists_everything_not_a_traceback(tmp_path: Path) -> None:
    with persist.Store(tmp_path) as s:
        c = mc.KVCache()
        c.update_and_fetch(*kvs(10, 20))
        s.save([c], [1] * 20, identity=IDENTITY, session="w")
    r = CliRunner().invoke(cli, ["ls", "--limit", str(2**63), "--store", str(tmp_path)])
    assert r.exit_code in (0, 2), r.output
