"""Small things users hit: --force, gc's dry-run sizes, pin/unpin, short reprs."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner
from mlx_lm.models import cache as mc

import persist
from persist.cli import cli
from tests.golden.cases import IDENTITY, kvs


def store_with(root: Path, *names: str, n: int = 300) -> None:
    with persist.Store(root) as s:
        for i, name in enumerate(names):
            c = mc.KVCache()
            c.update_and_fetch(*kvs(10 + i, n))
            s.save([c], [i + 1] * n, identity=IDENTITY, session=name)


def run(*args: str) -> tuple[int, str]:
    r = CliRunner().invoke(cli, list(args))
    return r.exit_code, r.output


def test_export_and_import_refuse_to_overwrite_without_force(tmp_path: Path) -> None:
    root, f = tmp_path / "s", tmp_path / "w.safetensors"
    store_with(root, "w")
    assert run("export", "w", str(f), "--store", str(root))[0] == 0
    code, out = run("export", "w", str(f), "--store", str(root))
    assert code == 1 and "--force" in out
    assert run("export", "w", str(f), "--force", "--store", str(root))[0] == 0
    code, out = run("import", str(f), "--store", str(root))  # session "w" exists
    assert code == 1 and "--force" in out
    assert run("import", str(f), "--force", "--store", str(root))[0] == 0


def test_gc_dry_run_says_now_and_after(tmp_path: Path) -> None:
    root = tmp_path / "s"
    store_with(root, "a", "b")
    with persist.Store(root) as s:
        now = s.stats().unique_bytes
    code, out = run("gc", "--max-bytes", str(now - 1), "--dry-run", "--store", str(root))
    assert code == 0 and "now " in out and "after " in out


def test_pin_and_unpin(tmp_path: Path) -> None:
    root = tmp_path / "s"
    store_with(root, "keep", "other")
    assert run("pin", "keep", "--store", str(root))[0] == 0
    with persist.Store(root) as s:
        assert s.entry("keep").pinned
        report = s.gc(0)
        assert [e.session for e in report.evicted] == ["other"]
        assert [e.session for e in s.sessions()] == ["keep"]
    assert run("unpin", "keep", "--store", str(root))[0] == 0
    code, out = run("pin", "nope", "--store", str(root), "--json")
    assert code == 1 and "no session 'nope'" in out
    with persist.Store(root) as s:
        assert not s.entry("keep").pinned


def test_reprs_are_short(tmp_path: Path) -> None:
    root = tmp_path / "s"
    store_with(root, "long", n=3000)
    with persist.Store(root) as s:
        r = s.restore("long", identity=IDENTITY)
        text = repr(r)
        assert len(text) < 400 and "3000 tokens" in text and "..." in text
        assert len(repr(r.entry)) < 300
        assert json.dumps(r.entry.to_dict())
