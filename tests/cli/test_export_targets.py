"""Attack 38b, finding 16: ``persist export NAME PATH --force`` replaced whatever was at
PATH by a rename: the store's own ``index.sqlite`` (every session lost), one of its
blobs, a FIFO, a device node (as root, ``/dev/null`` itself).  --force replaces a
regular file only; a path inside the store, or one that is not a regular file, is
``ExportTargetError`` and nothing is written.  FIFOs and device nodes are made in
tmp_path (never the machine's /dev); a device node needs root, else skipped.
Real stores, real ``persist`` processes."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

import persist
from tests.golden.cases import IDENTITY, kv_cache
from tests.helpers import persist_cli


def store_with_chat(root: Path) -> None:
    with persist.Store(root) as s:
        s.save([kv_cache(48, 1)], list(range(48)), identity=IDENTITY, session="chat")


def export(tmp: Path, root: Path, target: Path, *more: str) -> subprocess.CompletedProcess[str]:
    args = ["export", "chat", str(target), "--force", "--store", str(root), *more]
    return persist_cli(tmp, *args, check=False)


def refused(out: subprocess.CompletedProcess[str], why: str) -> None:
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert "ExportTargetError" in out.stdout and why in out.stdout, out.stdout


def restores(root: Path) -> int:
    with persist.Store(root) as s:
        return len(s.restore("chat", identity=IDENTITY).tokens)


def test_export_refuses_the_stores_own_files(tmp_path: Path) -> None:
    root = tmp_path / "s"
    store_with_chat(root)
    blob = next(p for p in (root / "blobs").rglob("*") if p.is_file())
    before = blob.read_bytes()
    for target in (root / "index.sqlite", blob, root / "new.persist"):
        refused(export(tmp_path, root, target, "--json"), "inside the store")
    assert blob.read_bytes() == before and not (root / "new.persist").exists()
    assert restores(root) == 48
    link = tmp_path / "link"  # a link is refused (this one leads into the store)
    link.symlink_to(root / "index.sqlite")
    refused(export(tmp_path, root, link, "--json"), "symbolic link")
    assert link.is_symlink() and restores(root) == 48


def test_export_force_replaces_a_regular_file_only(tmp_path: Path) -> None:
    root = tmp_path / "s"
    store_with_chat(root)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    refused(export(tmp_path, root, fifo, "--json"), "a FIFO")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    folder = tmp_path / "folder"
    folder.mkdir()
    out = export(tmp_path, root, folder, "--json")
    assert out.returncode in (1, 2) and folder.is_dir(), out  # click's own check, or ours
    old = tmp_path / "old.persist"
    old.write_bytes(b"an older export")
    assert export(tmp_path, root, old).returncode == 0
    with persist.Store(tmp_path / "t") as t:
        assert t.import_file(old, session="back").tokens == 48


def test_export_to_a_path_that_cannot_exist_is_typed(tmp_path: Path) -> None:
    """Attack 38c: under a regular file, through a loop of links, a name over 255
    bytes: exit 3 and a traceback, with or without --force."""
    root = tmp_path / "s"
    store_with_chat(root)
    (tmp_path / "file").write_text("x")
    (tmp_path / "loopA").symlink_to(tmp_path / "loopB")
    (tmp_path / "loopB").symlink_to(tmp_path / "loopA")
    for target in (tmp_path / "file" / "sub", tmp_path / "loopA" / "x", tmp_path / ("n" * 300)):
        for force in ((), ("--force",)):
            args = ["export", "chat", str(target), "--store", str(root), "--json", *force]
            out = persist_cli(tmp_path, *args, check=False)
            refused(out, "cannot be written there")
    assert restores(root) == 48


def test_export_refuses_a_device_node(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("making a device node (mknod) needs root")
    root = tmp_path / "s"
    store_with_chat(root)
    node = tmp_path / "fullnode"  # a copy of /dev/full's numbers, in the temp folder
    os.mknod(node, 0o600 | stat.S_IFCHR, os.makedev(1, 7))
    refused(export(tmp_path, root, node, "--json"), "a character device")
    assert stat.S_ISCHR(os.lstat(node).st_mode)


def test_the_library_refuses_too(tmp_path: Path) -> None:
    root = tmp_path / "s"
    store_with_chat(root)
    with persist.Store(root) as s, pytest.raises(persist.ExportTargetError, match="store"):
        s.export("chat", root / "index.sqlite")
    assert restores(root) == 48


def test_an_export_not_told_to_replace_never_replaces_a_file_made_meanwhile(
    tmp_path: Path,
) -> None:
    """Attack r13c, F2: without --force the target was checked at the start only; a
    file made there while the export ran was replaced (two concurrent exports to one
    path both succeeded).  The file is made at the export's first blob read."""
    root = tmp_path / "s"
    store_with_chat(root)
    target = tmp_path / "out.persist"
    with persist.Store(root) as s:
        real = s.index.blob_head

        def blob_head(name: str) -> object:
            if not target.exists():
                target.write_bytes(b"precious")  # another program's file, made meanwhile
            return real(name)

        s.index.blob_head = blob_head  # type: ignore[method-assign]
        with pytest.raises(persist.errors.AlreadyExistsError, match="out"):
            s.export("chat", target, replace=False)
    assert target.read_bytes() == b"precious"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []


def test_writers_not_told_to_replace_refuse_an_existing_file(tmp_path: Path) -> None:
    from persist.engine.mlx_lm_files import write_mlx_lm

    target = tmp_path / "there.safetensors"
    target.write_bytes(b"precious")
    cache = [kv_cache(8, 1)]
    with pytest.raises(persist.errors.AlreadyExistsError):
        persist.save_file(target, cache, list(range(8)), replace=False)
    with pytest.raises(persist.errors.AlreadyExistsError):
        write_mlx_lm(target, cache, {}, replace=False)
    assert target.read_bytes() == b"precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["there.safetensors"]


def test_export_refusals_are_typed_and_in_one_order(tmp_path: Path) -> None:
    """Attack r13c: a folder was click's usage error (exit 2); without --force an
    existing path was refused before the session or the target's kind was looked at;
    a folder that is not there was reported under the temporary file's name."""
    root = tmp_path / "s"
    store_with_chat(root)
    folder = tmp_path / "folder"
    folder.mkdir()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for force in ((), ("--force",)):
        base = ["--store", str(root), "--json", *force]
        refused(persist_cli(tmp_path, "export", "chat", str(folder), *base, check=False),
                "a folder")  # fmt: skip
        refused(persist_cli(tmp_path, "export", "chat", str(fifo), *base, check=False), "a FIFO")
        gone = persist_cli(tmp_path, "export", "nope", str(fifo), *base, check=False)
        assert gone.returncode == 1 and "SessionNotFoundError" in gone.stdout, gone.stdout
        missing = tmp_path / "no-such-folder" / "x.persist"
        out = persist_cli(tmp_path, "export", "chat", str(missing), *base, check=False)
        assert out.returncode == 1 and "StorageError" in out.stdout, out.stdout
        assert str(missing) in out.stdout and ".tmp" not in out.stdout, out.stdout
    old = tmp_path / "old.persist"
    old.write_bytes(b"an older export")
    out = persist_cli(tmp_path, "export", "chat", str(old), "--store", str(root), "--json",
                      check=False)  # fmt: skip
    assert out.returncode == 1 and "AlreadyExistsError" in out.stdout, out.stdout
    assert old.read_bytes() == b"an older export"
