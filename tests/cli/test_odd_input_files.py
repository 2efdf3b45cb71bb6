"""Attack 38d, finding G: ``persist import /proc/self/mem`` exited 3 with an OSError
traceback (the open succeeds, the read fails with EIO); a folder was click's usage
error (exit 2).  Every file a command reads because the user named it (import,
inspect, verify) is a typed error of one line and exit 1 when it cannot be read:
a file the system refuses mid-read, a FIFO with no writer (never a wait), a
folder, a device, a missing file, a file that vanishes while it is read.  And
``persist export`` to a name whose temporary file name would be too long exited 3.
Real ``persist`` processes; the vanishing file through the library."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import persist
from tests.golden.cases import IDENTITY, kv_cache
from tests.helpers import persist_cli, pythonpath

READERS = ["import", "inspect", "verify"]


def odd(tmp: Path, kind: str) -> str:
    """A path of ``kind`` that no reader can take."""
    if kind == "proc-mem":
        if not Path("/proc/self/mem").exists():
            pytest.skip("no /proc/self/mem here")
        return "/proc/self/mem"  # a regular file by stat; every read is EIO
    if kind == "fifo":
        os.mkfifo(tmp / "fifo")  # nobody writes: a plain open waits forever
        return str(tmp / "fifo")
    if kind == "folder":
        (tmp / "folder.persist").mkdir()
        return str(tmp / "folder.persist")
    if kind == "device":
        return "/dev/zero"
    return str(tmp / "missing.persist")


def run(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``persist ARGS``, ended after a minute: a wait on a FIFO is the failure here."""
    env = {**os.environ, "PERSIST_HOME": str(tmp / "home"), "PYTHONPATH": pythonpath()}
    try:
        return subprocess.run(
            [sys.executable, "-m", "persist", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"persist {' '.join(args)} waited on its input")


@pytest.mark.parametrize("kind", ["proc-mem", "fifo", "folder", "device", "missing"])
@pytest.mark.parametrize("command", READERS)
def test_a_file_that_cannot_be_read_is_one_typed_line(
    tmp_path: Path, command: str, kind: str
) -> None:
    path = odd(tmp_path, kind)
    extra = ("--store", str(tmp_path / "s")) if command == "import" else ()
    out = run(tmp_path, command, path, *extra)
    assert out.returncode == 1, (out.returncode, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("persist: error: "), out.stderr
    assert path in lines[0] and "Traceback" not in out.stderr
    as_json = run(tmp_path, command, path, *extra, "--json")
    got = json.loads(as_json.stdout)
    assert as_json.returncode == 1
    assert issubclass(getattr(persist, got["type"]), persist.PersistError)
    if command == "import":
        assert not (tmp_path / "s").exists()  # refused before a store is made


def saved_file(tmp: Path) -> Path:
    file = tmp / "chat.persist"
    persist.save_file(file, [kv_cache(16, 1)], list(range(16)), identity=IDENTITY)
    return file


@pytest.mark.parametrize("where", ["header", "tensors"])
def test_a_file_that_vanishes_while_it_is_read_is_typed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """The file goes (a network mount drops it, a cleaner removes it) between the checks
    and the reads: what the system says then is StorageError, never a bare OSError."""
    from persist.engine import files

    file = saved_file(tmp_path)

    def failing(*_: Any, **__: Any) -> Any:
        file.unlink(missing_ok=True)
        raise OSError(5, "Input/output error")  # what a read of a dropped file says

    monkeypatch.setattr(files, "read_header" if where == "header" else "read_piece", failing)
    with pytest.raises(persist.StorageError, match=r"cannot read .*Input/output error"):
        persist.load_file(file)
    with persist.Store(tmp_path / "s") as s, pytest.raises(persist.StorageError):
        s.import_file(saved_file(tmp_path), session="chat")


def test_export_to_a_long_file_name_writes_it(tmp_path: Path) -> None:
    """The temporary file beside the target has a longer name: at 250 bytes it was
    ENAMETOOLONG and exit 3.  A name the system takes is exported; one it does not is
    one typed line."""
    with persist.Store(tmp_path / "s") as s:
        s.save([kv_cache(16, 1)], list(range(16)), identity=IDENTITY, session="chat")
    at = ("--store", str(tmp_path / "s"))
    target = tmp_path / ("x" * 250)
    persist_cli(tmp_path, "export", "chat", str(target), *at)
    assert persist.load_file(target).tokens == list(range(16))
    longer = str(tmp_path / ("y" * 300))  # past what the system takes for a name
    too_long = persist_cli(tmp_path, "export", "chat", longer, *at, check=False)
    assert too_long.returncode == 1 and "Traceback" not in too_long.stderr, too_long.stderr
    assert len(too_long.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("kind", ["no-config", "no-weights", "fifo"])
def test_a_model_folder_mlx_lm_cannot_read_is_one_typed_line(tmp_path: Path, kind: str) -> None:
    """``--model`` names a folder whose files mlx-lm opens with plain ``open``: a FIFO
    there waited forever, a missing file was a FileNotFoundError traceback (exit 3)."""
    folder = tmp_path / "model"
    folder.mkdir()
    if kind == "fifo":
        os.mkfifo(folder / "config.json")  # the first file mlx-lm opens
    elif kind == "no-weights":
        (folder / "config.json").write_text("{}")
    out = run(tmp_path, "generate", "--model", str(folder), "--session", "a", "--prompt", "x")
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and str(folder) in out.stderr
    assert ("safetensors" if kind == "no-weights" else "config.json") in out.stderr


def test_make_model_where_the_system_refuses_is_typed(tmp_path: Path) -> None:
    out = run(tmp_path, "make-model", str(tmp_path / ("m" * 300)))
    assert out.returncode == 1 and "cannot write a model" in out.stderr, out.stderr
