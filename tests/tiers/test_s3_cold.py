"""The durable cold tier on a real S3-compatible server (moto's server mode): a machine
with only the cold tier restores any named session bit for bit; damaged objects are
never used; a server that is down never fails local work."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import persist
from persist.remote.redis_tier import RedisTier
from tests.helpers import check_against_child, persist_cli, prefill, run_child, tokens_for
from tests.tiers.tier_values import blob_keys

KEY = bytes(range(32))


@pytest.mark.long
@pytest.mark.parametrize("variant", ["llama", "qwen3_next"])
def test_a_machine_with_only_the_cold_tier_restores_a_session(
    variant: str, tiny: Any, s3_server: Any, tmp_path: Path
) -> None:
    model, tok, model_dir = tiny(variant)
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(300, seed=40)
    cache, _ = prefill(model, toks)
    with persist.Store(tmp_path / "a", cold=s3_server.url) as a:
        a.save(cache, toks, identity=ident, session="work")
        a.save(cache, toks, identity=ident)  # an anonymous prefix: not the cold tier's job
    out = tmp_path / "out.safetensors"
    job = {"store": str(tmp_path / "b"), "cold": s3_server.url, "session": "work"}
    run_child(model_dir, [{**job, "next": [2, 5], "out": str(out)}], tmp_path)
    check_against_child(model, cache, out, toks, next_tokens=[2, 5])
    keys = [o["Key"] for o in s3_server.client().list_objects_v2(Bucket="persist-test")["Contents"]]
    assert all(k.startswith("fleet/persist/") for k in keys)
    assert sum("/sess/" in k for k in keys) == 1 and sum("/rec/" in k for k in keys) == 1


def test_a_damaged_object_is_never_used(tiny: Any, s3_server: Any, tmp_path: Path) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(300, seed=41)
    with persist.Store(tmp_path / "a", cold=s3_server.url) as a:
        a.save(prefill(model, toks)[0], toks, identity=ident, session="s")
    s3 = s3_server.client()
    key = next(
        o["Key"]
        for o in s3.list_objects_v2(Bucket="persist-test")["Contents"]
        if "/blob/" in o["Key"] and o["Size"] > 1000
    )
    data = bytearray(s3.get_object(Bucket="persist-test", Key=key)["Body"].read())
    data[-3] ^= 0x55
    s3.put_object(Bucket="persist-test", Key=key, Body=bytes(data))
    with persist.Store(tmp_path / "b", cold=s3_server.url) as b:
        with pytest.raises(persist.CorruptBlobError):
            b.restore("s", identity=ident)
        assert b.entries() == []


def test_a_cold_tier_that_is_down_never_fails_local_work(
    tiny: Any, s3_server: Any, tmp_path: Path
) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(300, seed=42)
    cache, _ = prefill(model, toks)
    s3_server.stop()
    with persist.Store(tmp_path / "a", cold=s3_server.url) as a:
        a.save(cache, toks, identity=ident, session="s")
        a.save(cache, toks, identity=ident, session="t")
        assert a.restore("s", identity=ident).tokens == toks
        assert a.cold is not None and a.cold.tier.counters.get("errors", 0) == 1


@pytest.mark.long
def test_the_cli_takes_a_session_to_a_new_machine_through_s3(
    model_dir: Any, s3_server: Any, tmp_path: Path
) -> None:
    import json

    m = str(model_dir("llama"))

    def generate(home: str, prompt: str, **env: str) -> dict[str, Any]:
        args = ["generate", "--model", m, "--session", "w", "--prompt", prompt, "--json"]
        out = persist_cli(tmp_path / home, *args, "--max-tokens", "3", env=env)
        return dict(json.loads(out.stdout))

    first = generate("a", "a session kept in the durable tier", PERSIST_COLD=s3_server.url)
    second = generate("b", " and resumed on a new machine", PERSIST_COLD=s3_server.url)
    assert second["source"] == "session" and second["reused_tokens"] == first["session_tokens"]


def test_a_junk_blob_without_the_tag_is_a_miss_and_the_cold_tier_serves(
    tiny: Any, redis_server: Any, s3_server: Any, tmp_path: Path
) -> None:
    """With a key, a value without the key's tag is a miss (README threat model) and the
    next tier is asked.  A blob replaced by a few bytes (shorter than its size, so no tag
    fits) is instead CorruptBlobError from the restore: a machine without the key
    stops a session that S3 still holds intact."""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    r, p = redis_server.client(), RedisTier.prefix("default")
    toks = tokens_for(300, seed=6)
    tiers = {"shared": redis_server.url, "cold": s3_server.url, "tier_key": KEY}
    with persist.Store(tmp_path / "a", **tiers) as a:
        a.save(prefill(model, toks)[0], toks, identity=ident, session="s")
    for k in blob_keys(r, p):
        r.set(k, b"garbage")
    with persist.Store(tmp_path / "b", **tiers) as b:
        assert b.restore("s", identity=ident).tokens == toks
        assert b.stats().counters["shared_unauthenticated"] >= 1
