"""Random damage to blobs and to the SQLite index: refused, reported, repaired.

Restore gives CorruptBlobError, never a wrong cache; lookup skips damaged
snapshots and still returns only correct caches; check() lists every
damaged blob; check(fix=True) quarantines without touching healthy sessions.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import pytest

import persist
from tests.helpers import assert_same_state, live_state, prefill, tokens_for
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
