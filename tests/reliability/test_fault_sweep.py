"""Every kind of damage to every file and folder of a store: typed, reported, nothing else lost.

For each target (each blob, each ``blobs/<ab>/`` folder, ``blobs/``, ``tmp/``,
``reserve``, ``index.sqlite``) and each damage that applies (flip a byte,
truncate, delete, replace by a directory / a FIFO / a symbolic link / a
sparse file of the same size; for the index also 0 bytes, half of it, a
flipped header, a damaged row), a copy of one store is damaged and every
command is run: open, ls, restore of every session, lookup, check, check
--fix, check again, restore again.  The promises: no hang, no untyped error,
every restore bit-exact, a repair that leaves nothing but the links persist
never touches, and no session losing more than the damage reached (a
session whose blobs were not hit keeps everything; a hit one keeps at least
its blocks before the damage).  ``PERSIST_LONG=1`` runs every pair and
writes the table to bench/results/faults.md; the short run takes a sample.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models import cache as mc

import persist
from tests.golden.cases import IDENTITY, kvs
from tests.reliability.conftest import LONG

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
SESSIONS = {"a": 600, "b": 300}  # tokens: a has 2 blocks and a tail, b 1 block and a tail
BLOCK = 256


@contextmanager
def no_hang(seconds: int = 60) -> Iterator[None]:
    def boom(*_: object) -> None:
        raise AssertionError("hung")

    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: Any) -> tuple[Path, dict[str, Any], dict[str, list[str]]]:
    root = tmp_path_factory.mktemp("sweep") / "store"
    arrays, owned = {}, {}
    with persist.Store(root, block_tokens=BLOCK) as s:
        for i, (name, n) in enumerate(SESSIONS.items()):
            c = mc.KVCache()
            k, v = kvs(10 + i, n)
            c.update_and_fetch(k, v)
            s.save([c], list(range(n)), identity=IDENTITY, session=name)
            arrays[name] = (k, v)
            row = s.index.by_name("default", name)
            assert row is not None
            owned[name] = [b.blob for b in s.index.blocks(row.id) if b.blob] + [row.tail]
    return root, arrays, owned


# -- damage -------------------------------------------------------------------


def _flip(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x10
    p.write_bytes(bytes(data))


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _remove(p: Path) -> None:
    shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


def _by_dir(p: Path) -> None:
    _remove(p)
    p.mkdir()


def _by_fifo(p: Path) -> None:
    _remove(p)
    os.mkfifo(p)


def _by_link(p: Path) -> None:
    away = Path(tempfile.mkdtemp(prefix="away-")) / p.name  # the same bytes, outside the store
    os.replace(p, away)
    p.symlink_to(away)


def _by_sparse(p: Path) -> None:
    size = p.stat().st_size
    _remove(p)
    with open(p, "wb") as f:
        f.truncate(size)  # the same size, no data: a hole


def _by_file(p: Path) -> None:
    _remove(p)
    p.write_bytes(b"a file where a folder was")


def _empty(p: Path) -> None:
    p.write_bytes(b"")


def _header_flip(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[3] ^= 0xFF
    p.write_bytes(bytes(data))


def _bad_row(p: Path) -> None:
    db = sqlite3.connect(p)
    with db:
        db.execute("UPDATE snapshots SET manifest = X'c1c1c1' WHERE name = 'a'")
    db.close()


FILE_DAMAGE: dict[str, Callable[[Path], None]] = {
    "flip": _flip,
    "truncate": _truncate,
    "delete": _remove,
    "directory": _by_dir,
    "FIFO": _by_fifo,
    "symlink": _by_link,
    "sparse": _by_sparse,
}
DIR_DAMAGE = {"delete": _remove, "file": _by_file, "FIFO": _by_fifo, "symlink": _by_link}
INDEX_DAMAGE = {
    **FILE_DAMAGE,
    "0 bytes": _empty,
    "header flip": _header_flip,
    "damaged row": _bad_row,
}


def targets(root: Path, owned: dict[str, list[str]]) -> list[tuple[str, str, set[str]]]:
    """(label, path relative to the store, sessions whose data it holds)."""
    out = [("index.sqlite", "index.sqlite", set(SESSIONS)), ("reserve", "reserve", set())]
    out += [("blobs/", "blobs", set(SESSIONS)), ("tmp/", "tmp", set())]
    for sub in sorted(p for p in (root / "blobs").iterdir() if p.is_dir()):
        users = {n for n, fs in owned.items() if any(f[:2] == sub.name for f in fs)}
        out.append((f"blobs/{sub.name}/", f"blobs/{sub.name}", users))
    for name, files in owned.items():
        for i, f in enumerate(files):
            what = "tail" if i == len(files) - 1 else f"block {i}"
            out.append((f"{what} of {name}", f"blobs/{f[:2]}/{f}.safetensors", {name}))
    return out


def damages(rel: str) -> dict[str, Callable[[Path], None]]:
    if rel == "index.sqlite":
        return INDEX_DAMAGE
    return DIR_DAMAGE if rel in ("blobs", "tmp") or rel.count("/") == 1 else FILE_DAMAGE


def pairs(root: Path, owned: dict[str, list[str]]) -> list[tuple[str, str, set[str], str]]:
    every = [(lab, rel, users, d) for lab, rel, users in targets(root, owned) for d in damages(rel)]
    if LONG:
        return every
    sample = {"flip", "FIFO", "0 bytes", "file", "damaged row"}
    return [p for p in every if p[3] in sample and "block 1" not in p[0]]


# -- commands -------------------------------------------------------------------


def outcome(fn: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "ok", fn()
    except persist.PersistError as e:
        return type(e).__name__, None


def exact(r: persist.Restored, arrays: Any) -> bool:
    k, v = arrays
    c, n = r.cache[0], len(r.tokens)
    return r.tokens == list(range(n)) and bool(
        mx.array_equal(c.keys[..., :n, :], k[..., :n, :])
        and mx.array_equal(c.values[..., :n, :], v[..., :n, :])
    )


def run_all(root: Path, arrays: dict[str, Any]) -> dict[str, Any]:
    rec: dict[str, Any] = {}
    state, store = outcome(lambda: persist.Store(root))
    rec["open"] = state
    if store is None:
        rec["blobs kept"] = sorted(p.name for p in root.rglob("*.safetensors"))
        return rec
    with store:
        rec["ls"] = outcome(lambda: len(store.entries()))[0]
        for name in SESSIONS:
            state, r = outcome(lambda name=name: store.restore(name, identity=IDENTITY))
            if r is not None:
                assert exact(r, arrays[name]), f"restore of {name} not bit-exact"
            rec[f"restore {name}"] = state
        prompt = list(range(SESSIONS["a"])) + [1]
        state, hit = outcome(lambda: store.lookup(prompt, identity=IDENTITY))
        if hit is not None:
            assert exact(hit, arrays[hit.entry.session]), "lookup not bit-exact"
        rec["lookup"] = state if hit is not None or state != "ok" else "miss"
        state, found = outcome(store.check)
        rec["check"] = state if found is None else f"{len(found)} problems"
        state, fixed = outcome(lambda: store.check(fix=True))
        rec["check --fix"] = state if fixed is None else f"{sum(p.fixed for p in fixed)} fixed"
        rec["cut"] = sorted(p.target for p in fixed or [] if p.kind == "session-cut")
        state, after = outcome(store.check)
        rec["left"] = sorted({p.kind for p in after}) if after is not None else [state]
        kept = {}
        for name in SESSIONS:
            state, r = outcome(lambda name=name: store.restore(name, identity=IDENTITY))
            if r is not None:
                assert exact(r, arrays[name]), f"repaired {name} not bit-exact"
            kept[name] = len(r.tokens) if r is not None else 0
        rec["kept"] = kept
    return rec


def test_every_damage_to_every_file_and_folder(pristine: Any, tmp_path: Path, tally: Any) -> None:
    src, arrays, owned = pristine
    table = []
    for k, (label, rel, users, dname) in enumerate(pairs(src, owned)):
        root = tmp_path / f"t{k}" / "store"
        shutil.copytree(src, root, symlinks=True)
        damages(rel)[dname](root / rel)
        with no_hang():
            try:
                rec = run_all(root, arrays)
            except AssertionError as e:
                raise AssertionError(f"{label}, {dname}: {e}") from None
        tally.add("fault-sweep", trials=1, **{f"open:{rec['open']}": 1})
        if rec["open"] != "ok":  # only the index may make a store refuse to open
            assert rel == "index.sqlite", (label, dname, rec)
            assert rec["blobs kept"]  # and then nothing of blobs/ was deleted
        else:
            # what a repair leaves: links (never touched); of a damaged index, only typed refusals
            may = {"symlink", "unvouched-blobs"}
            if rel == "index.sqlite" and dname != "damaged row":
                may |= {"index-corrupt", "CorruptBlobError"}
            assert set(rec["left"]) <= may, (label, dname, rec)
            for name, n in rec["kept"].items():
                if name not in users and dname != "damaged row":
                    assert n == SESSIONS[name], (label, dname, name, rec)  # untouched: whole
                least = _least_kept(label, name)
                assert n >= least, (label, dname, name, rec)
        table.append({"target": label, "damage": dname, **rec})
    if LONG:
        _write(table)


def _least_kept(label: str, name: str) -> int:
    """Tokens a session keeps at least when ``label`` is damaged: its blocks before it."""
    if label.startswith("block ") and label.endswith(f" of {name}"):
        return int(label.split()[1]) * BLOCK
    if label == f"tail of {name}":
        return (SESSIONS[name] // BLOCK) * BLOCK
    return 0


def _write(table: list[dict[str, Any]]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "faults.json").write_text(json.dumps(table, indent=2, default=str))
    cols = ["open", "ls", "restore a", "restore b", "lookup", "check", "check --fix", "left"]
    lines = [
        "# Fault sweep: every damage to every file and folder of a store",
        "",
        "Written by `PERSIST_LONG=1 pytest tests/reliability/test_fault_sweep.py`. "
        f"Store: sessions a ({SESSIONS['a']} tokens: blocks 0, 1 and a tail) and "
        f"b ({SESSIONS['b']} tokens: block 0 and a tail), {BLOCK}-token blocks. "
        "Each cell: what the command did (ok, a typed error's name, problems found or "
        "fixed); `left`: problems after the repair (links persist never touches); "
        "`kept`: tokens each session restores after the repair, bit-exact. "
        f"{len(table)} damages, no hang, no untyped error, no session lost more than the "
        "damage reached.",
        "",
        "| target | damage | " + " | ".join(cols) + " | kept a / b |",
        "|---" * (len(cols) + 3) + "|",
    ]
    for r in table:
        kept = r.get("kept")
        cells = [_cell(r.get(c, "-")) for c in cols]
        k = f"{kept['a']} / {kept['b']}" if kept else "refused to open, blobs kept"
        lines.append(f"| {r['target']} | {r['damage']} | " + " | ".join(cells) + f" | {k} |")
    (RESULTS / "faults.md").write_text("\n".join(lines) + "\n")


def _cell(v: Any) -> str:
    return (", ".join(v) or "none") if isinstance(v, list) else str(v)
