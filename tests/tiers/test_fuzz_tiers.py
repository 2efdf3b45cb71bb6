"""A hostile tier: random mutations of every kind of key on a real Redis and a real S3
(moto), each followed by a restore and a lookup on a fresh machine.  Whatever the
tier holds, the answer is the right cache (bit for bit against a fresh prefill) or
a typed miss; never another session's state, never an untyped exception.

A few hundred cases in CI; ``PERSIST_LONG=1`` runs ten times as many."""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import persist
from persist.remote import redis_tier
from tests.helpers import live_state, prefill, tokens_for

LONG = os.environ.get("PERSIST_LONG") == "1"
KEY = bytes(range(100, 132))
# a block size mutated on the tier is another fleet's: refused (fleet_block), typed
TYPED = (
    persist.SessionNotFoundError,
    persist.SessionUnreadableError,  # named on the tier, a part of it gone or forged
    persist.CorruptBlobError,
    persist.BlockSizeMismatchError,
)


def mutate(rng: random.Random, value: bytes, others: list[bytes]) -> bytes:
    """One random damage of a value (or another key's value in its place)."""
    how = rng.randrange(9)
    if how == 0 and value:
        v = bytearray(value)
        v[rng.randrange(len(v))] ^= 1 << rng.randrange(8)
        return bytes(v)
    if how == 1:
        return value[: rng.randrange(len(value) + 1)]
    if how == 2:
        return value + rng.randbytes(rng.randrange(1, 64))
    if how == 3:
        return rng.randbytes(rng.randrange(0, 300))
    if how == 4:
        return rng.choice(others)
    if how == 5:
        return rng.choice([b"parts:3000000", b"parts:abc", b"parts:2:zz", b"parts:-1", b"\xff\xfe"])
    if how == 6 and len(value) > 8:
        at = rng.randrange(len(value) - 4)
        return value[:at] + rng.randbytes(4) + value[at + 4 :]
    if how == 7:
        return b""
    return value[::-1]


class Oracle:
    """What a fresh machine may answer: session x exactly, or the prompt's prefix exactly."""

    def __init__(self, model: Any, x: list[int], prompt: list[int]) -> None:
        self.model, self.x, self.prompt = model, x, prompt
        self.x_state = live_state(prefill(model, x)[0])
        self._prefix: dict[int, Any] = {}

    def prefix(self, k: int) -> Any:
        if k not in self._prefix:
            self._prefix[k] = live_state(prefill(self.model, self.prompt[:k])[0])
        return self._prefix[k]

    def check(self, open_store: Callable[[], persist.Store], ident: Any, case: str) -> None:
        with open_store() as b:
            try:
                got = b.restore("x", identity=ident)
                assert got.tokens == self.x, case
                assert live_state(got.cache) == self.x_state, case
            except TYPED:
                pass
            try:
                hit = b.lookup(self.prompt, identity=ident)
            except TYPED:
                hit = None
            if hit is not None:
                assert hit.tokens == self.prompt[: len(hit.tokens)], case
                assert live_state(hit.cache) == self.prefix(len(hit.tokens)), case


def fleet(model: Any, tok: Any, root: Path, **tiers: Any) -> tuple[Any, Oracle]:
    """Machine A's work: sessions x and y sharing a block, and an anonymous prefix."""
    ident = persist.ModelIdentity.of(model, tok)
    x = tokens_for(300, seed=90)
    y = [*x[:256], *tokens_for(60, seed=91)]
    doc = tokens_for(600, seed=92)
    with persist.Store(root, **tiers) as a:
        a.save(prefill(model, x)[0], x, identity=ident, session="x")
        a.save(prefill(model, y)[0], y, identity=ident, session="y")
        a.save(prefill(model, doc)[0], doc, identity=ident)
    return ident, Oracle(model, x, [*doc[:420], 7, 7])


# long: 15 + 10 s; the deterministic hostile-tier tests (test_trust, test_sync_repair) run quickly
@pytest.mark.long
@pytest.mark.parametrize("key", [None, KEY], ids=["no-key", "key"])
def test_random_redis_mutations_never_give_a_wrong_cache(
    key: bytes | None, tiny: Any, redis_server: Any, tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.setattr(redis_tier, "PART_BYTES", 2048)  # blobs in parts too
    model, tok, _ = tiny("llama")
    url = redis_server.url
    ident, oracle = fleet(model, tok, tmp_path / "a", shared=url, tier_key=key)
    r = redis_server.client()
    keys = sorted(r.keys("persist:*"))
    dumps = {k: r.dump(k) for k in keys}
    originals = {k: bytes(r.get(k)) for k in keys}
    values = list(originals.values())
    rng = random.Random(24 if key is None else 25)
    for n in range(1500 if LONG else 130):
        hit = rng.sample(keys, rng.choice([1, 1, 1, 2]))
        for k in hit:
            r.delete(k)
            if rng.random() < 0.1:
                r.rpush(k, b"not a string")
            elif rng.random() > 0.1:
                r.set(k, mutate(rng, originals[k], values))
        case = f"case {n}: {[k.decode(errors='replace') for k in hit]}"
        root = tmp_path / f"m{n}"
        oracle.check(lambda root=root: persist.Store(root, shared=url, tier_key=key), ident, case)
        for k in hit:  # the tier as A left it
            r.delete(k)
            r.restore(k, 0, dumps[k])


@pytest.mark.long  # 7 s; test_s3_names and test_s3_cold check hostile S3 values quickly
def test_random_s3_mutations_never_give_a_wrong_cache(
    tiny: Any, s3_server: Any, tmp_path: Path
) -> None:
    model, tok, _ = tiny("llama")
    url = s3_server.url
    ident, oracle = fleet(model, tok, tmp_path / "a", cold=url)
    s3, bucket = s3_server.client(), "persist-test"
    keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"])
    values = {k: s3.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys}
    rng = random.Random(26)
    for n in range(400 if LONG else 40):
        k = rng.choice(keys)
        if rng.random() < 0.15:
            s3.delete_object(Bucket=bucket, Key=k)
        else:
            s3.put_object(Bucket=bucket, Key=k, Body=mutate(rng, values[k], list(values.values())))
        root = tmp_path / f"m{n}"
        oracle.check(lambda root=root: persist.Store(root, cold=url), ident, f"case {n}: {k}")
        s3.put_object(Bucket=bucket, Key=k, Body=values[k])
