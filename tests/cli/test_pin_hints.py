"""``persist pin --ttl/--priority``: retention hints from the command line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import persist
from persist.cli import cli
from persist.engine.lifecycle import parse_ttl
from persist.errors import InvalidArgumentError
from tests.golden.cases import IDENTITY, kv_cache


def stored(root: Path) -> None:
    with persist.Store(root) as s:
        s.save([kv_cache(32)], list(range(32)), identity=IDENTITY, session="agent")


def run(*args: str) -> Any:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def hints(root: Path) -> list[tuple[float, int]]:
    with persist.Store(root) as s:
        return list(s.index.db.execute("SELECT ttl, priority FROM retention_hints"))


def test_pin_with_a_ttl_sets_hints_not_a_pin(tmp_path: Path) -> None:
    root = tmp_path / "s"
    stored(root)
    out = run("pin", "agent", "--ttl", "1h", "--priority", "5", "--store", str(root), "--json")
    assert out.exit_code == 0 and json.loads(out.output)["ttl"] == 3600.0
    assert hints(root) == [(3600.0, 5)]
    with persist.Store(root) as s:
        assert not s.entry("agent").pinned
    assert run("pin", "agent", "--ttl", "0", "--store", str(root)).exit_code == 0
    assert hints(root) == []


def test_bad_ttls_exit_1_and_change_nothing(tmp_path: Path) -> None:
    root = tmp_path / "s"
    stored(root)
    for bad in ("1y", "-5m", "nan", "inf", "", "9" * 40):
        out = run("pin", "agent", "--ttl", bad, "--store", str(root))
        assert out.exit_code == 1 and "ttl" in out.output, bad
    assert run("pin", "agent", "--priority", "5000", "--store", str(root)).exit_code == 2
    assert hints(root) == []


@pytest.mark.parametrize(
    ("text", "seconds"), [("30s", 30.0), ("5m", 300.0), ("1h", 3600.0), ("2d", 172800.0),
                          ("90", 90.0), (" 1.5H ", 5400.0)],
)  # fmt: skip
def test_ttls_read_as_clients_write_them(text: str, seconds: float) -> None:
    assert parse_ttl(text) == seconds


def test_a_ttl_past_a_month_is_refused() -> None:
    with pytest.raises(InvalidArgumentError):
        parse_ttl("31d")
