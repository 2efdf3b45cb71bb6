"""Every byte of a file is written before its last fsync, and the rename comes after it.

Traced with strace on a real save (store blobs, ``save_file``, ``export``).
Round 1 fsynced a file, then rewrote its header with the real checksums:
durable through a process crash, lost on a power cut.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT
from tests.tools import need

CHILD = """
import sys
from pathlib import Path
from mlx_lm.models import cache as mc
import persist
from tests.golden.cases import IDENTITY, kvs
out = Path(sys.argv[1])
c = mc.KVCache()
c.update_and_fetch(*kvs(1, 700))
with persist.Store(out / "store") as s:
    s.save([c], list(range(700)), identity=IDENTITY, session="a")
    s.export("a", out / "a.safetensors")
persist.save_file(out / "b.safetensors", [c], list(range(700)))
"""

CALL = re.compile(r"^(?:(\d+) +)?(\w+)\((.*)")
RESUMED = re.compile(r"^(?:(\d+) +)?<\.\.\. (\w+) resumed>")
FD = re.compile(r"^(-?\d+)<([^>]*)>")
WRITES = {"write", "pwrite64", "writev", "pwritev", "pwritev2", "ftruncate"}


def events(log: str) -> list[tuple[str, str]]:
    """(call, path) in the order the kernel finished them; renames give their source path.

    With several threads (a save writes blobs on two) strace splits a call that
    another thread interrupts into "<unfinished ...>" and "<... resumed>": the
    call counts where it finished.
    """
    out: list[tuple[str, str]] = []
    pending: dict[str | None, tuple[str, str] | None] = {}
    for line in log.splitlines():
        r = RESUMED.match(line)
        if r:
            done = pending.pop(r.group(1), None)
            if done is not None:
                out.append(done)
            continue
        m = CALL.match(line)
        if not m:
            continue
        pid, call, rest = m.groups()
        event = _event(call, rest)
        if "<unfinished" in line:
            pending[pid] = event
        elif event is not None:
            out.append(event)
    return out


def _event(call: str, rest: str) -> tuple[str, str] | None:
    if call in WRITES | {"fsync", "fdatasync"}:
        fd = FD.match(rest)
        return (call, fd.group(2)) if fd else None
    if call in ("rename", "renameat", "renameat2"):
        src = re.findall(r'"([^"]*)"', rest)
        return ("rename", src[0]) if src else None
    return None


@pytest.mark.needs("strace")
def test_no_file_is_written_after_its_last_fsync(tmp_path: Path) -> None:
    strace = need("strace")
    log = tmp_path / "trace"
    subprocess.run(
        [
            strace, "-f", "-qq", "-y", "-o", str(log),
            "-e", "trace=write,pwrite64,writev,pwritev,pwritev2,ftruncate,fsync,fdatasync,"
            "rename,renameat,renameat2",
            sys.executable, "-c", CHILD, str(tmp_path),
        ],
        check=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    seen = events(log.read_text())
    renamed = [(i, p) for i, (c, p) in enumerate(seen) if c == "rename" and p.endswith(".tmp")]
    assert len(renamed) >= 3, seen[-20:]  # blobs, the export, save_file
    for at, path in renamed:
        before = [(c, i) for i, (c, p) in enumerate(seen[:at]) if p.endswith(path.lstrip("."))]
        last_sync = max((i for c, i in before if c in ("fsync", "fdatasync")), default=-1)
        last_write = max((i for c, i in before if c in WRITES), default=-1)
        assert last_sync > last_write >= 0, f"{path}: written after its last fsync"


def test_a_call_another_thread_interrupts_counts_where_it_finished() -> None:
    log = "\n".join(
        [
            '12 write(5</s/tmp/a.tmp>, "xx", 2) = 2',
            "12 fsync(5</s/tmp/a.tmp> <unfinished ...>",
            '13 write(6</s/tmp/b.tmp>, "yy", 2) = 2',
            "12 <... fsync resumed>) = 0",
            '12 rename("/s/tmp/a.tmp", "/s/blobs/ab/a") = 0',
        ]
    )
    assert events(log) == [
        ("write", "/s/tmp/a.tmp"),
        ("write", "/s/tmp/b.tmp"),
        ("fsync", "/s/tmp/a.tmp"),
        ("rename", "/s/tmp/a.tmp"),
    ]
