"""Random damage to blobs and to the SQLite index: refused, reported, repaired.

Restore gives CorruptBlobError, never a wrong cache; lookup skips damaged
snapshots and still returns only correct caches; check() lists every
damaged blob; check(fix=True) quarantines without touching healthy sessions.
Index columns of the wrong SQLite type are damage each command reports with its
own exit status, never a traceback; ``show`` and ``ls`` mark a row that fails
its checksum.
"""

from __future__ import annotations

import json
import random
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.models import cache as mc

import persist
from tests.golden.cases import IDENTITY, kvs
from tests.helpers import assert_same_state, live_state, persist_cli, prefill, tokens_for
from tests.reliability.conftest import scale

TRIALS = scale(12, 150)


@pytest.fixture(scope="module")
def pristine(tiny: Any, tmp_path_factory: Any) -> tuple[Path, dict[str, list[int]]]:
    model, tok, _ = tiny("llama")
    identity = persist.ModelIdentity.of(model, tok)
    root = tmp_path_factory.mktemp("pristine") / "store"
    shared = tokens_for(300, seed=77)
    sessions = {}
    with persist.Store(root) as store:
        for i in range(6):
            toks = (shared if i % 2 else []) + tokens_for(100 + 60 * i, seed=i)
            store.save(prefill(model, toks)[0], toks, identity=identity, session=f"s{i}")
            sessions[f"s{i}"] = toks
    return root, sessions


def correct(model: Any, cache: list[Any], tokens: list[int]) -> None:
    fresh, _ = prefill(model, tokens)
    assert_same_state(live_state(fresh), live_state(cache))


def damage(root: Path, rng: random.Random) -> tuple[str, str | None]:
    blobs = sorted((root / "blobs").rglob("*.safetensors"))
    kind = rng.choice(["flip", "truncate", "delete", "flip", "sqlite"])
    if kind == "sqlite":
        db = root / "index.sqlite"
        data = bytearray(db.read_bytes())
        for _ in range(rng.randrange(1, 8)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        db.write_bytes(bytes(data))
        return kind, None
    victim = rng.choice(blobs)
    data = victim.read_bytes()
    if kind == "flip":
        b = bytearray(data)
        b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        victim.write_bytes(bytes(b))
    elif kind == "truncate":
        victim.write_bytes(data[: rng.randrange(len(data))])
    else:
        victim.unlink()
    return kind, victim.name.removesuffix(".safetensors")


# long: 25 s; tests/reliability/test_fault_sweep.py damages every file in every way in the quick run
@pytest.mark.long
def test_random_damage(pristine: Any, tiny: Any, tmp_path: Path, tally: Any) -> None:
    src, sessions = pristine
    model, tok, _ = tiny("llama")
    identity = persist.ModelIdentity.of(model, tok)
    rng = random.Random(1)
    for trial in range(TRIALS):
        root = tmp_path / f"t{trial}"
        shutil.copytree(src, root)
        kind, blob = damage(root, rng)
        tally.add("corruption", trials=1, **{f"fault:{kind}": 1})
        try:
            store = persist.Store(root)
        except persist.PersistError as e:  # a damaged index may refuse to open: typed
            tally.error("corruption", e)
            continue
        with store:
            healthy = set()
            for name, toks in sessions.items():
                try:
                    r = store.restore(name, identity=identity)
                except persist.PersistError as e:
                    tally.error("corruption", e)
                    continue
                assert r.tokens == toks, "a damaged store returned other tokens"
                correct(model, r.cache, r.tokens)
                healthy.add(name)
            for toks in sessions.values():
                try:
                    hit = store.lookup(toks + [1, 2], identity=identity)
                except persist.PersistError as e:
                    tally.error("corruption", e)
                    continue
                if hit is not None:
                    assert hit.tokens == toks[: len(hit.tokens)]
                    correct(model, hit.cache, hit.tokens)
            if blob is None:
                continue  # index damage: typed errors or correct answers were the promise
            problems = store.check()
            assert any(p.target == blob for p in problems), (blob, problems)
            fixed = store.check(fix=True)
            assert all(p.fixed for p in fixed)
            assert store.check() == []
            for name in healthy:  # sessions that did not use the blob survive the repair
                r = store.restore(name, identity=identity)
                correct(model, r.cache, r.tokens)
            tally.add("corruption", detected=1, data_lost=0)


def saved(root: Path, names: tuple[str, ...] = ("keep", "other"), n: int = 300) -> None:
    for seed, name in enumerate(names, 1):
        c = mc.KVCache()
        c.update_and_fetch(*kvs(seed, n))
        with persist.Store(root) as s:
            s.save([c], list(range(n)), identity=IDENTITY, session=name)


def edit(root: Path, sql: str) -> None:
    db = sqlite3.connect(root / "index.sqlite")
    with db:
        db.execute(sql)
    db.close()


def exits(root: Path, *commands: list[str]) -> list[int]:
    """Each command's exit status, in order; none may print a traceback."""
    codes = []
    for args in commands:
        out = persist_cli(root, *args, check=False)
        assert "Traceback" not in out.stdout + out.stderr, out.stdout + out.stderr
        codes.append(out.returncode)
    return codes


# SQLite does not enforce column types: what a damaged or hand-edited index holds.  A
# column the row checksum covers is damage (check exits 1, --fix repairs); the mutable
# ones (size, times) read as a default.  These made ls/stats/show/check exit 3 with a
# TypeError (an attack on fault handling).
@pytest.mark.parametrize(
    ("change", "check_code"),
    [
        ("manifest = 'hello'", 1),
        ("tokens = 'abc'", 1),
        ("identity_map = 'x'", 1),
        ("metadata = 7", 1),
        ("n_tokens = 'abc'", 1),
        ("bytes = 'x'", 0),
        ("created = 'zz'", 0),
        ("used = x'00'", 0),
    ],
)
def test_a_row_with_a_wrongly_typed_column_is_damage_not_a_crash(
    tmp_path: Path, change: str, check_code: int
) -> None:
    root = tmp_path / "store"
    saved(root)
    edit(root, f"UPDATE snapshots SET {change} WHERE name = 'keep'")
    listing = (["ls"], ["ls", "--json"], ["stats"], ["show", "keep"])
    assert exits(root, *listing, ["check"]) == [0, 0, 0, 0, check_code]
    assert exits(root, ["check", "--fix"], ["check"], ["ls"]) == [0, 0, 0]
    with persist.Store(root) as s:  # the undamaged session is untouched
        assert s.restore("other", identity=IDENTITY).tokens == list(range(300))


@pytest.mark.parametrize(
    ("change", "codes", "other"),
    [
        # a blob's head checksum of another type: that blob is damage
        ("UPDATE blobs SET head_xxh3 = 'x' WHERE rowid = 1", [0, 0, 0, 1, 0, 0], None),
        # every session's chains: both sessions are damage, --fix takes both
        (
            "UPDATE snapshot_blocks SET chain = 'x'",
            [0, 0, 0, 1, 0, 0],
            persist.SessionNotFoundError,
        ),
        # the block size every command needs: a typed refusal of the store, every time
        (
            "UPDATE meta SET value = 'abc' WHERE key = 'block_tokens'",
            [1, 1, 1, 1, 1, 1],
            persist.CorruptBlobError,
        ),
        # a namespace secret of another type: every command goes on
        ("UPDATE namespaces SET secret = 'x'", [0, 0, 0, 0, 0, 0], None),
    ],
)
def test_other_tables_with_a_wrongly_typed_column_are_typed_damage(
    tmp_path: Path, change: str, codes: list[int], other: type[Exception] | None
) -> None:
    root = tmp_path / "store"
    saved(root)
    edit(root, change)
    commands = (["ls"], ["stats"], ["show", "keep"], ["check"], ["check", "--fix"], ["ls"])
    assert exits(root, *commands) == codes
    if other is None:
        with persist.Store(root) as s:
            assert s.restore("other", identity=IDENTITY).tokens == list(range(300))
        return
    with pytest.raises(other), persist.Store(root) as s:
        s.restore("other", identity=IDENTITY)


def test_show_marks_a_row_that_fails_its_checksum(tmp_path: Path) -> None:
    root = tmp_path / "store"
    saved(root)
    edit(root, "UPDATE snapshots SET n_tokens = 200 WHERE name = 'keep'")
    out = persist_cli(root, "show", "keep")
    assert "DAMAGED" in out.stdout and "checksum" in out.stdout, out.stdout
    data = json.loads(persist_cli(root, "show", "keep", "--json").stdout)
    assert data["damaged"], data
    assert "DAMAGED" not in persist_cli(root, "show", "other").stdout


def test_ls_marks_a_row_that_fails_its_checksum(tmp_path: Path) -> None:
    root = tmp_path / "store"
    saved(root)
    edit(root, "UPDATE snapshots SET n_tokens = 200 WHERE name = 'keep'")
    lines = persist_cli(root, "ls").stdout.splitlines()
    assert [ln for ln in lines if "DAMAGED" in ln and " keep " in ln], lines
    assert not [ln for ln in lines if "DAMAGED" in ln and " other " in ln], lines
    data = json.loads(persist_cli(root, "ls", "--json").stdout)
    assert [e["session"] for e in data if e["damaged"]] == ["keep"], data
