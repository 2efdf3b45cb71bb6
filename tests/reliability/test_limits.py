"""Resource limits, names and tenants."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import persist
from persist.storage import lookup
from tests.helpers import ROOT, prefill, tokens_for
from tests.store_helpers import assert_private, clean

FULL_DISK = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
from mlx_lm import load
import persist
from tests.helpers import prefill, tokens_for
model, tok = load(sys.argv[1])
ident = persist.ModelIdentity.of(model, tok)
cache, _ = prefill(model, tokens_for(900, 5))
with persist.Store(sys.argv[2]) as store:
    resource.setrlimit(resource.RLIMIT_FSIZE, (30000, 30000))  # the disk is now full
    try:
        store.save(cache, tokens_for(900, 5), identity=ident, session="big")
    except persist.StoreFullError as e:
        print("refused:", e)
        raise SystemExit(3)
"""


def test_full_disk_during_save(tiny: Any, tmp_path: Path, tally: Any) -> None:
    model, tok, model_dir = tiny("llama")
    identity = persist.ModelIdentity.of(model, tok)
    root = tmp_path / "store"
    t = tokens_for(200, 1)
    with persist.Store(root) as store:
        store.save(prefill(model, t)[0], t, identity=identity, session="small")
        before = [e.to_dict() for e in store.entries()]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [sys.executable, "-c", FULL_DISK, str(model_dir), str(root)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 3, r.stderr
    assert "disk is full" in r.stdout
    with persist.Store(root) as store:
        assert [e.to_dict() for e in store.entries()] == before
        clean(store)
        assert store.restore("small", identity=identity).tokens == t
    tally.add("limits", trials=1, faults_injected=1, data_lost=0)


def test_store_at_budget_keeps_working(tiny: Any, tmp_path: Path, tally: Any) -> None:
    model, tok, _ = tiny("llama")
    identity = persist.ModelIdentity.of(model, tok)
    with persist.Store(tmp_path / "s", max_bytes=120_000) as store:
        for i in range(15):
            t = tokens_for(150 + 10 * i, 100 + i)
            store.save(prefill(model, t)[0], t, identity=identity, session=f"s{i}")
            assert store.stats().unique_bytes <= 120_000
            assert store.restore(f"s{i}", identity=identity).tokens == t
        assert "s14" in {s.session for s in store.sessions()}
        clean(store)
    tally.add("limits", trials=15)


@pytest.mark.parametrize(
    "name",
    [
        "../../../tmp/x",
        "/etc/passwd",
        "..",
        "a/b\\c",
        "\u202etxt.exe",
        "🙂" * 250,
        " ",
        "x" * 1024,
        "NUL?",
        "con",
        "a\r\nb",
    ],
)
def test_names_are_keys_never_paths(name: str, tiny: Any, tmp_path: Path, tally: Any) -> None:
    model, tok, _ = tiny("llama")
    identity = persist.ModelIdentity.of(model, tok)
    root = tmp_path / "inside" / "store"
    t = tokens_for(30, 3)
    with persist.Store(root) as store:
        store.save(prefill(model, t)[0], t, identity=identity, session=name, namespace=name)
        assert store.restore(name, identity=identity, namespace=name).tokens == t
        store.delete(name, namespace=name)
        clean(store)
    outside = {p for p in tmp_path.rglob("*") if not str(p).startswith(str(root))}
    assert outside == {tmp_path / "inside"}  # nothing written outside the store root
    assert_private(root)
    tally.add("names", trials=1)


@pytest.mark.parametrize("name", ["", "x" * 1025, "a\x00b"])
def test_bad_names_refused(name: str, tiny: Any, tmp_path: Path) -> None:
    model, tok, _ = tiny("llama")
    identity = persist.ModelIdentity.of(model, tok)
    with persist.Store(tmp_path / "s") as store:
        with pytest.raises(persist.InvalidNameError):
            store.restore(name, identity=identity)
        with pytest.raises(persist.InvalidNameError):
            store.lookup([1, 2, 3], identity=identity, namespace=name)


def test_tenants_never_touch_each_other(
    tiny: Any, tmp_path: Path, tally: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tok, _ = tiny("llama")
    identity = persist.ModelIdentity.of(model, tok)
    secret_prompt = tokens_for(600, 9)
    with persist.Store(tmp_path / "s") as store:
        store.save(
            prefill(model, secret_prompt)[0],
            secret_prompt,
            identity=identity,
            session="a-private",
            namespace="a",
        )
        own = tokens_for(300, 10)
        store.save(prefill(model, own)[0], own, identity=identity, session="b", namespace="b")
        a_blobs = {
            r[0] for r in store.index.db.execute("SELECT file FROM blobs WHERE namespace = 'a'")
        }
        opened: list[str] = []
        seen_rows: list[str] = []
        real_open = store.blobs.open

        def spy_open(file: str) -> Any:
            opened.append(file)
            return real_open(file)

        def spy(real: Any) -> Any:
            def candidates(*a: Any, **k: Any) -> Any:
                rows = real(*a, **k)
                seen_rows.extend(r.namespace for r in rows)
                return rows

            return candidates

        monkeypatch.setattr(store.blobs, "open", spy_open)
        monkeypatch.setattr(lookup, "candidate_rows", spy(lookup.candidate_rows))
        for n in (300, 450, 599):  # B probes A's prompt at several depths
            assert store.lookup(secret_prompt[:n] + [1], identity=identity, namespace="b") is None
        assert not opened and set(seen_rows) <= {"b"}
        hit = store.lookup(own + [1], identity=identity, namespace="b")
        assert hit is not None and not (set(opened) & a_blobs)
    assert (tmp_path / "s" / "index.sqlite").stat().st_mode & 0o077 == 0  # secrets are private
    tally.add("tenants", trials=4, data_lost=0)
