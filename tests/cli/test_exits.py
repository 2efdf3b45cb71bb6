"""Exit codes mean what they say: 1 persist refused, 3 a bug, 130 Ctrl-C, 0 on a closed pipe."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from mlx_lm.models import cache as mc

import persist
from persist.cli import cli
from tests.golden.cases import IDENTITY, kvs
from tests.helpers import ROOT


def made(tmp_path: Path) -> str:
    """An empty store: only commands that write sessions make one."""
    persist.Store(tmp_path / "s").close()
    return str(tmp_path / "s")


def test_a_bug_is_exit_3_with_a_traceback(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("an unexpected bug")

    from persist.storage import listing

    monkeypatch.setattr(listing, "stream", broken)
    res = CliRunner().invoke(cli, ["ls", "--all", "--store", made(tmp_path)])
    assert res.exit_code == 3
    assert "Traceback" in res.output and "please report it" in res.output


@pytest.mark.parametrize("error", [ValueError("a bad value inside"), OSError(5, "EIO inside")])
def test_builtin_errors_are_bugs_not_user_errors(
    error: Exception, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Only PersistError is exit 1: a ValueError or OSError escaping persist is a bug."""

    def broken(*_: Any, **__: Any) -> Any:
        raise error

    from persist.storage import listing

    monkeypatch.setattr(listing, "stream", broken)
    res = CliRunner().invoke(cli, ["ls", "--store", made(tmp_path)])
    assert res.exit_code == 3 and "please report it" in res.output


def test_what_the_system_refuses_is_exit_1(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("a file, not a folder")
    f = str(tmp_path / "f")  # import makes its store: here it cannot
    res = CliRunner().invoke(cli, ["import", f, "--store", str(tmp_path / "f" / "s")])
    assert res.exit_code == 1 and "cannot open the store" in res.output


def test_ctrl_c_is_exit_130(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def interrupted(*_: Any, **__: Any) -> Any:
        raise KeyboardInterrupt

    from persist.storage import listing

    monkeypatch.setattr(listing, "stream", interrupted)
    res = CliRunner().invoke(cli, ["ls", "--store", made(tmp_path)])
    assert res.exit_code == 130


def test_a_persist_error_is_exit_1(tmp_path: Path) -> None:
    res = CliRunner().invoke(cli, ["show", "nope", "--store", made(tmp_path)])
    assert res.exit_code == 1 and "no session 'nope'" in res.output


def test_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    root = tmp_path / "s"
    c = mc.KVCache()
    c.update_and_fetch(*kvs(1, 20))
    with persist.Store(root) as s:
        s.index.db.execute("PRAGMA synchronous=OFF")  # build speed only (3,000 commits)
        for i in range(3000):
            s.save([c], [i % 50] * 20, identity=IDENTITY, session=f"session-{i:05d}")
    p = subprocess.Popen(
        [sys.executable, "-m", "persist", "ls", "--store", str(root)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert p.stdout is not None and p.stderr is not None
    p.stdout.readline()
    p.stdout.close()  # like `| head -1`
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 0, err
    assert "Broken pipe" not in err and "Traceback" not in err, err
