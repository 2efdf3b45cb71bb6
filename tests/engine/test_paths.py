"""Store roots as users write them: ``~`` and environment variables expanded, never literal."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import persist
from tests.helpers import ROOT


def test_tilde_and_variables_expand(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("STORES", str(tmp_path / "stores"))
    monkeypatch.chdir(tmp_path)
    with persist.Store("~/.cache/persist/store") as s:
        assert s.root == tmp_path / "home" / ".cache" / "persist" / "store"
    with persist.Store("$STORES/a") as s:
        assert s.root == tmp_path / "stores" / "a"
    assert not (tmp_path / "~").exists() and not (tmp_path / "$STORES").exists()


def test_a_literal_tilde_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(persist.InvalidNameError, match="named '~'"):
        persist.Store(tmp_path / "~" / "store")
    assert not (tmp_path / "~").exists()


def test_cli_store_option_expands(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    persist.Store(tmp_path / "home" / "x").close()  # ls reads a store, never makes one
    for arg in (["--store", "~/x"], ["--store=~/x"]):
        r = subprocess.run(
            [sys.executable, "-m", "persist", "ls", *arg],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        assert (tmp_path / "home" / "x" / "index.sqlite").exists()
        assert not (tmp_path / "~").exists()
