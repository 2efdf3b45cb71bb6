"""Store commands a user tidies with: no store made by a typo, a budget by default and
remembered per store, every file counted, rm of many, gc that says what pins keep."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from mlx_lm.models import cache as mc

import persist
from persist.cli import cli
from persist.cli.app import open_store
from tests.golden.cases import IDENTITY, kvs


def store_with(root: Path, *names: str, n: int = 300) -> None:
    with persist.Store(root) as s:
        for i, name in enumerate(names):
            c = mc.KVCache()
            c.update_and_fetch(*kvs(10 + i, n))
            s.save([c], [i + 1] * n, identity=IDENTITY, session=name)


def run(*args: str, code: int = 0) -> str:
    r = CliRunner().invoke(cli, list(args))
    assert r.exit_code == code, r.output
    return r.output


READ_ONLY = [
    ["ls"], ["show", "w"], ["rm", "w"], ["gc"], ["stats"], ["check"], ["pin", "w"],
    ["unpin", "w"], ["export", "w", "/tmp/never-written.safetensors"],
    ["config", "get", "max-bytes"], ["config", "set", "max-bytes", "5G"],
]  # fmt: skip


@pytest.mark.parametrize("args", READ_ONLY, ids=lambda a: " ".join(a[:2]))
def test_a_mistyped_store_is_an_error_not_a_new_store(tmp_path: Path, args: list[str]) -> None:
    """`persist ls --store /tmp/does-not-exist` printed "no sessions" and made the folder."""
    typo = tmp_path / "does-not-exist"
    out = run(*args, "--store", str(typo), code=1)
    assert f"no store at {typo}" in out
    assert not typo.exists()


def test_the_budget_is_stated_and_remembered(tmp_path: Path) -> None:
    root = tmp_path / "s"
    store_with(root, "a")
    stats = json.loads(run("stats", "--store", str(root), "--json"))
    disk = shutil.disk_usage(tmp_path).total
    assert stats["budget"] == min(disk // 10, 20 << 30) and stats["budget_source"] == "default"
    assert "(the default: a tenth of the disk, at most 20 GiB)" in run(
        "stats", "--store", str(root)
    )
    run("config", "set", "max-bytes", "5G", "--store", str(root))
    assert "budget 5.0 GiB (persist config set max-bytes)" in run("stats", "--store", str(root))
    with open_store(root, create=True) as s:  # what generate, prime and import open
        assert s.budgets.max_bytes == 5 << 30
    run("config", "set", "max-bytes", "none", "--store", str(root))
    with open_store(root, create=True) as s:
        assert s.budgets.max_bytes is None
    run("config", "unset", "max-bytes", "--store", str(root))
    assert json.loads(run("stats", "--store", str(root), "--json"))["budget_source"] == "default"


def test_stats_counts_every_file_and_gc_compacts_the_index(tmp_path: Path) -> None:
    """stats said 6.0 MiB beside a 12 MB index.sqlite; after gc --max-bytes 0, '0 B on disk'."""
    root = tmp_path / "s"
    store_with(root, *(f"s{i:03d}" for i in range(150)), n=40)
    before = json.loads(run("stats", "--store", str(root), "--json"))["files"]
    index = (root / "index.sqlite").stat().st_size  # with -wal and -shm while open
    assert before["index"] >= index and before["total"] >= index + before["blobs"]
    report = json.loads(run("gc", "--max-bytes", "0", "--store", str(root), "--json"))
    assert report["compacted"] and report["unique_bytes"] == 0
    after = json.loads(run("stats", "--store", str(root), "--json"))["files"]
    assert after["index"] < before["index"] / 2, (before, after)  # VACUUM gave pages back
    assert run("stats", "--store", str(root)).startswith("0 entries (0 sessions)")


def test_rm_takes_names_patterns_and_all(tmp_path: Path) -> None:
    root = tmp_path / "s"
    store_with(root, "draft-1", "draft-2", "keep", "other", "x")
    out = run("rm", "--glob", "draft-*", "x", "--store", str(root))
    assert out.strip().splitlines() == [
        "--glob 'draft-*' matched: draft-1, draft-2",
        "deleted 3 sessions: x, draft-1, draft-2",
    ]
    out = run("rm", "keep", "--glob", "nothing-*", "--store", str(root), code=1)  # all or nothing
    assert "no session 'nothing-*'" in out
    with persist.Store(root) as s:
        assert sorted(e.session for e in s.sessions()) == ["keep", "other"]
    assert run("rm", "keep", "--store", str(root)).strip() == "deleted session 'keep'"
    assert "deleted 1 session" not in run("rm", "--all", "--store", str(root))
    assert run("ls", "--store", str(root)).strip() == "no sessions"
    assert "give session names" in run("rm", "--store", str(root), code=2)


def test_gc_says_when_pins_keep_it_over_budget(tmp_path: Path) -> None:
    root = tmp_path / "s"
    store_with(root, "pinned", "loose")
    run("pin", "pinned", "--store", str(root))
    out = run("gc", "--max-bytes", "1K", "--store", str(root))
    assert out.startswith("evicted 1 entry, freeing")
    assert "over the budget of 1.0 KiB: 1 pinned session holds" in out
    assert "persist unpin NAME" in out


def test_persist_home_holds_the_demo_model_and_the_identity_memo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from persist import weights_memo
    from persist.apps import demo

    monkeypatch.delenv("PERSIST_IDENTITY_CACHE", raising=False)
    monkeypatch.setenv("PERSIST_HOME", str(tmp_path / "home"))
    assert demo.cache_home() == tmp_path / "home"
    assert weights_memo.memo_dir() == tmp_path / "home" / "identity"
    made = demo.demo_model_dir()
    assert made.parent == tmp_path / "home" and (made / "config.json").exists()


def test_a_library_store_keeps_the_remembered_budget(tmp_path: Path) -> None:
    """`persist config set max-bytes` is the store's: a server opening it with
    persist.Store(root) (no max_bytes) is held to it too; an explicit max_bytes wins,
    and a store with nothing remembered has no budget in the library, as documented."""
    root = tmp_path / "s"
    store_with(root, "a")
    with persist.Store(root) as s:
        assert s.budgets.max_bytes is None  # nothing remembered: the library's default
        one = s.stats().unique_bytes
    run("config", "set", "max-bytes", str(one + one // 2), "--store", str(root))
    store_with(root, "b", "c")  # a library store: each save evicts down to the budget
    with persist.Store(root) as s:
        assert s.budgets.max_bytes == one + one // 2
        assert len(s.sessions()) == 1
    with persist.Store(root, max_bytes=1 << 40) as s:
        assert s.budgets.max_bytes == 1 << 40
    run("config", "set", "max-bytes", "none", "--store", str(root))
    with persist.Store(root) as s:
        assert s.budgets.max_bytes is None
