"""Odd files where the store keeps blobs and folders: refused, typed, reported, repaired.

Round 3 found a FIFO in place of a blob hanging ``check``, ``check --fix``,
``export``, ``Store.restore`` and ``persist inspect FIFO`` forever (a plain
open waits for a writer), and ``blobs/`` or ``tmp/`` replaced by a regular
file making ``check`` exit 3 and ``restore`` raise a raw NotADirectoryError.
A later attack found such a file named "not a regular file", and a FIFO or folder
in place of the ``reserve`` file passing ``check`` (leaving the full-disk path,
which frees only a regular reserve, nothing to free).
"""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from mlx_lm.models import cache as mc

import persist
from tests.golden.cases import IDENTITY, kvs
from tests.helpers import persist_cli

HANG = 60  # seconds before a hang guard fires: far above any honest run


@contextmanager
def no_hang() -> Iterator[None]:
    """Turn a wait that never ends into a test failure (not a timing verdict)."""

    def boom(*_: object) -> None:
        raise AssertionError("hung")

    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(HANG)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def saved(root: Path, n: int = 300, name: str = "keep", seed: int = 1) -> None:
    c = mc.KVCache()
    c.update_and_fetch(*kvs(seed, n))
    with persist.Store(root) as s:
        s.save([c], list(range(n)), identity=IDENTITY, session=name)


def blob_files(root: Path) -> list[Path]:
    return sorted((root / "blobs").rglob("*.safetensors"))


def fifo_for_a_blob(root: Path) -> Path:
    victim = blob_files(root)[0]
    victim.unlink()
    os.mkfifo(victim)
    return victim


def test_a_fifo_in_place_of_a_blob_is_refused_by_restore(tmp_path: Path) -> None:
    root = tmp_path / "store"
    saved(root)
    fifo_for_a_blob(root)
    with persist.Store(root) as s, no_hang():
        with pytest.raises(persist.CorruptBlobError, match="FIFO"):
            s.restore("keep", identity=IDENTITY)
        assert s.lookup(list(range(301)), identity=IDENTITY) is None  # skipped, not hung


def test_a_fifo_in_place_of_a_blob_is_reported_and_quarantined(tmp_path: Path) -> None:
    root = tmp_path / "store"
    saved(root)
    fifo = fifo_for_a_blob(root)
    with persist.Store(root) as s, no_hang():
        found = s.check()
        assert any(p.kind == "damaged-blob" and "FIFO" in p.detail for p in found), found
        fixed = s.check(fix=True)
        assert all(p.fixed for p in fixed), fixed
        assert not fifo.exists()
        assert s.check() == []
        assert any(p.kind == "session-cut" and "'keep'" in p.target for p in fixed), fixed


# long: 18 s of CLI processes; test_fault_sweep replaces blobs by FIFOs in the quick run
@pytest.mark.long
def test_cli_commands_refuse_a_fifo_instead_of_waiting(tmp_path: Path) -> None:
    home = tmp_path / "store"
    saved(home)
    fifo = fifo_for_a_blob(home)
    out = persist_cli(home, "check", check=False)
    assert out.returncode == 1 and "FIFO" in out.stdout, out
    out = persist_cli(home, "export", "keep", str(tmp_path / "x.persist"), check=False)
    assert out.returncode == 1 and "FIFO" in out.stderr, out
    for cmd in ("inspect", "verify", "import"):
        out = persist_cli(home, cmd, str(fifo), check=False)
        assert out.returncode == 1 and "FIFO" in out.stderr, (cmd, out)
    out = persist_cli(home, "check", "--fix", check=False)
    assert out.returncode == 0, out


def test_inspect_refuses_a_device(tmp_path: Path) -> None:
    out = persist_cli(tmp_path / "store", "inspect", "/dev/zero", check=False)
    assert out.returncode == 1 and "character device, not a regular file" in out.stderr, out


@pytest.mark.parametrize("folder", ["blobs", "tmp"])
def test_a_folder_replaced_by_a_file_is_typed_reported_and_repaired(
    tmp_path: Path, folder: str
) -> None:
    root = tmp_path / "store"
    saved(root)
    moved = tmp_path / "moved"
    os.replace(root / folder, moved)
    (root / folder).write_bytes(b"not a folder")
    with persist.Store(root) as s:
        if folder == "blobs":
            with pytest.raises(persist.CorruptBlobError, match="not a directory"):
                s.restore("keep", identity=IDENTITY)
        found = s.check()
        assert any(p.kind == "not-a-folder" and p.target.endswith(folder) for p in found), found
        fixed = s.check(fix=True)
        assert all(p.fixed for p in fixed), fixed
        assert (root / folder).is_dir()
        assert s.check() == []
        saved(root, 50, "after", seed=5)  # writes work again
        assert s.restore("after", identity=IDENTITY).tokens == list(range(50))
        if folder == "tmp":  # nothing of blobs/ was touched: the session is whole
            assert s.restore("keep", identity=IDENTITY).tokens == list(range(300))
    # the file that stood in for the folder is kept, in quarantine, not deleted
    assert [p.read_bytes() for p in (root / "quarantine").iterdir()] == [b"not a folder"]


def test_cli_check_reports_a_folder_replaced_by_a_file(tmp_path: Path) -> None:
    home = tmp_path / "store"
    saved(home)
    os.replace(home / "blobs", tmp_path / "moved")
    (home / "blobs").write_bytes(b"x")
    out = persist_cli(home, "check", check=False)
    assert out.returncode == 1 and "not-a-folder" in out.stdout, out


@pytest.mark.parametrize("folder", ["tmp", "blobs"])
def test_a_folder_replaced_by_a_file_is_named_a_regular_file(tmp_path: Path, folder: str) -> None:
    root = tmp_path / "store"
    saved(root)
    target = root / folder
    if folder == "tmp":
        target.rmdir()
    else:
        shutil.rmtree(target)
    target.write_text("x")
    out = persist_cli(root, "check", check=False)
    assert out.returncode == 1, out.stderr
    assert f"{folder}: is a regular file, not a folder" in out.stdout, out.stdout


@pytest.mark.parametrize("kind", ["fifo", "dir"])
def test_an_odd_file_in_place_of_the_reserve_is_reported_and_replaced(
    tmp_path: Path, kind: str
) -> None:
    root = tmp_path / "store"
    saved(root)
    reserve = root / "reserve"
    reserve.unlink()
    os.mkfifo(reserve) if kind == "fifo" else reserve.mkdir()
    out = persist_cli(root, "check", check=False)
    assert out.returncode == 1 and "reserve" in out.stdout, out.stdout
    fixed = persist_cli(root, "check", "--fix", check=False)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr  # replaced: the store is whole
    assert reserve.is_file() and not reserve.is_symlink() and reserve.stat().st_size > 0
    assert persist_cli(root, "check").returncode == 0
