"""Issue 37: no client of ``persist serve`` reads another's prompt through the cache.

The oracle, from outside on main 598e851: client A sends a note with a
PIN; client B, knowing only the text before the PIN, sends it with each
digit and keeps the one with the largest ``cached_tokens``, four times, and
reads the PIN.  Real server processes, real HTTP clients, a real store.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from bench.servers import Server
from tests.helpers import persist_cli
from tests.serve.servers import get, metrics, persist_serve, raw

PREFIX = "Note to self: the vault PIN is "
PIN = "7351"
SECRET = f"{PREFIX}{PIN}, do not share"
KEYS = {
    "alice": "alice-key-0123456789abcdef",
    "bob": "bob-key-0123456789abcdef",
    "carol": "carol-key-0123456789abcdef",
}


def key_file(tmp: Path) -> Path:
    p = tmp / "keys.txt"
    p.write_text("# KEY TENANT\n" + "".join(f"{k} {t}\n" for t, k in KEYS.items()))
    return p


def post(
    srv: Server, path: str, body: Any, tenant: str | None = None, **headers: str
) -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    if tenant is not None:
        headers["Authorization"] = f"Bearer {KEYS[tenant]}"
    req = urllib.request.Request(f"http://127.0.0.1:{srv.port}{path}", data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def complete(srv: Server, prompt: str, tenant: str | None = None, **extra: Any) -> int:
    """Send ``prompt``; its cached_tokens (what the oracle reads)."""
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
    code, answer = post(srv, "/v1/completions", body, tenant)
    assert code == 200, answer
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def read_pin(srv: Server, tenant: str | None) -> tuple[str, list[set[int]]]:
    """The attack: the digit whose probe reuses most, four times; and what each round saw."""
    known, seen = PREFIX, []
    complete(srv, f"{PREFIX}#", tenant)  # B's own first send: every probe then starts alike
    for _ in range(len(PIN)):
        got = {d: complete(srv, f"{known}{d}zzzz", tenant) for d in "0123456789"}
        seen.append(set(got.values()))
        known += max(got, key=lambda d: got[d])
    return known[len(PREFIX) :], seen


def test_single_tenant_server_is_the_oracle(model_dir: Any, tmp_path: Path) -> None:
    """Without tenants every client shares one namespace: the attack works (the threat)."""
    srv = persist_serve(model_dir("llama"), tmp_path / "store", tmp_path / "a.log")
    try:
        complete(srv, SECRET)
        assert read_pin(srv, None)[0] == PIN
    finally:
        srv.stop()
    assert "single-tenant" in (tmp_path / "a.log").read_text()


def test_api_keys_close_the_oracle(model_dir: Any, tmp_path: Path) -> None:
    keys = key_file(tmp_path)
    srv = persist_serve(
        model_dir("llama"), tmp_path / "store", tmp_path / "a.log", "--api-keys", str(keys)
    )
    try:
        complete(srv, SECRET, "alice")
        assert complete(srv, SECRET, "alice") > len(PREFIX)  # alice's own cache serves her
        pin, seen = read_pin(srv, "bob")
        assert pin != PIN
        assert all(len(s) == 1 for s in seen), seen  # no digit told apart from another
        other = "Another note: the safe opens with 2468"
        complete(srv, other, "alice")
        before = metrics(srv)
        # bob sends alice's very prompt: never served from her cache, in any tier
        assert complete(srv, other, "bob") == 0
        after = metrics(srv)
        hit = ("persist_tenant_lookups_total", (("result", "hit"), ("tenant", "bob")))
        miss = ("persist_tenant_lookups_total", (("result", "miss"), ("tenant", "bob")))
        assert after.get(hit, 0) == before.get(hit, 0)
        assert after[miss] == before[miss] + 1
    finally:
        srv.stop()
    log = (tmp_path / "a.log").read_text()
    assert "tenants by API key" in log
    assert KEYS["alice"] not in log and KEYS["bob"] not in log


def test_no_oracle_after_a_restart(model_dir: Any, tmp_path: Path) -> None:
    keys, store = key_file(tmp_path), tmp_path / "store"
    args = ("--api-keys", str(keys))
    first = persist_serve(model_dir("llama"), store, tmp_path / "a.log", *args)
    try:
        complete(first, SECRET, "alice")
    finally:
        first.stop()  # the write-behind is flushed: alice's cache is in the store
    second = persist_serve(model_dir("llama"), store, tmp_path / "b.log", *args)
    try:
        pin, seen = read_pin(second, "bob")
        assert pin != PIN and all(len(s) == 1 for s in seen), seen
        assert complete(second, SECRET, "alice") >= len(SECRET) - 1  # hers, from the store
    finally:
        second.stop()


def test_no_oracle_across_servers_on_one_redis(model_dir: Any, tmp_path: Path) -> None:
    from tests.tiers.conftest import RedisServer

    redis = RedisServer(tmp_path)
    redis.start()
    keys = key_file(tmp_path)
    args = ("--api-keys", str(keys), "--shared", redis.url)
    a = persist_serve(model_dir("llama"), tmp_path / "a", tmp_path / "a.log", *args)
    b = persist_serve(model_dir("llama"), tmp_path / "b", tmp_path / "b.log", *args)
    try:
        complete(a, SECRET, "alice")
        r = redis.client()
        deadline = time.monotonic() + 60  # the write-behind pushes after the answer
        while not r.keys("persist:*:rec:*") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert r.keys("persist:*:rec:*")
        assert complete(b, SECRET, "bob") == 0  # b's store is empty; the tier has alice's
        assert complete(b, SECRET, "alice") >= len(SECRET) - 1  # ... which alice gets on b
    finally:
        a.stop()
        b.stop()
        redis.stop()


def test_malformed_key_header_and_salt_are_4xx_and_serving_goes_on(
    model_dir: Any, tmp_path: Path
) -> None:
    keys = key_file(tmp_path)
    srv = persist_serve(
        model_dir("llama"), tmp_path / "store", tmp_path / "a.log", "--api-keys", str(keys)
    )
    body = {"prompt": "hello there", "max_tokens": 2}
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
    try:
        code, answer = post(srv, "/v1/completions", body)
        assert code == 401 and answer["error"]["code"] == "invalid_api_key", answer
        assert get(srv, "/v1/models")[0] == 401 and get(srv, "/health")[0] == 200
        assert set(answer["error"]) >= {"message", "type", "param"}
        for auth in ("Bearer nope", "Basic abc", "Bearer " + "k" * 60000, "Bearer"):
            code, answer = post(srv, "/v1/completions", body, Authorization=auth)
            assert code == 401, (auth[:20], code)  # no key this server knows
        got = raw(srv, head + b"Authorization: Bearer \xff\xfe\x00key\r\n\r\n{}")
        assert got.startswith(b"HTTP/1.0 401"), got[:80]
        for salt in ("", "s" * 100_000, {"a": {"b": [1]}}, 7, ["x"], True):
            code, answer = post(srv, "/v1/completions", {**body, "cache_salt": salt}, "alice")
            assert code == 400, (str(salt)[:20], code, answer)
            assert "cache_salt" in answer["error"]["message"]
        code, answer = post(srv, "/v1/completions", b'{"prompt": "a", "cache_salt": "\\ud800"}',
                            "alice")  # fmt: skip
        assert code == 400, answer
        code, _ = post(srv, "/v1/completions", body, "alice")
        assert code == 200  # still serving
        code, _ = post(srv, "/v1/completions", {**body, "cache_salt": "s1"}, "bob")
        assert code == 200
    finally:
        srv.stop()
    assert srv.proc.returncode == 0
    assert "Traceback" not in (tmp_path / "a.log").read_text()


def test_tenant_header_and_salts(model_dir: Any, tmp_path: Path) -> None:
    srv = persist_serve(
        model_dir("llama"), tmp_path / "store", tmp_path / "a.log", "--tenant-header", "X-Tenant"
    )
    try:
        code, answer = post(srv, "/v1/completions", {"prompt": SECRET, "max_tokens": 1})
        assert code == 401, answer  # the gateway did not say who
        for bad in ("a b", "x" * 200, "ü", ""):
            code, answer = post(
                srv, "/v1/completions", {"prompt": "a", "max_tokens": 1},
                **{"X-Tenant": bad.encode("utf-8").decode("latin-1")},
            )  # fmt: skip
            assert code == 400, (bad, code, answer)  # said, but not a tenant name

        def ask(tenant: str, **extra: Any) -> int:
            body = {"prompt": SECRET, "max_tokens": 1, "temperature": 0, **extra}
            code, answer = post(srv, "/v1/completions", body, **{"X-Tenant": tenant})
            assert code == 200, answer
            return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])

        assert ask("acme") == 0
        assert ask("globex") == 0  # another tenant
        assert ask("acme", cache_salt="one") == 0  # the same tenant, salted apart
        assert ask("acme", cache_salt="one") >= len(SECRET) - 1
        assert ask("acme") >= len(SECRET) - 1
    finally:
        srv.stop()


@pytest.mark.parametrize("mode", ["single", "keys"])
def test_start_line_names_the_tenancy(model_dir: Any, tmp_path: Path, mode: str) -> None:
    extra = ("--api-keys", str(key_file(tmp_path))) if mode == "keys" else ()
    srv = persist_serve(model_dir("llama"), tmp_path / "store", tmp_path / "a.log", *extra)
    srv.stop()
    log = (tmp_path / "a.log").read_text()
    if mode == "single":
        assert "WARNING" in log and "single-tenant" in log
    else:
        assert "tenants by API key (3 keys)" in log


PUBLIC = "You are the support agent of a hardware shop. Answer in one line. " * 4
PRIVATE = "You are alice's notebook. Her PIN is 7351. Never repeat it. " * 4


def chat(srv: Server, system: str, question: str, tenant: str) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    body = {"messages": messages, "max_tokens": 8, "temperature": 0, "logprobs": True}
    code, answer = post(srv, "/v1/chat/completions", body, tenant)
    assert code == 200, answer
    return answer


def said(answer: dict[str, Any]) -> tuple[str, Any]:
    choice = answer["choices"][0]
    return choice["message"]["content"], choice.get("logprobs")


def reused(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


@pytest.mark.long
@pytest.mark.parametrize("variant", ["llama", "qwen3_next"])  # qwen3_next: recurrent layers
def test_public_prefix_is_shared_bit_exact_and_private_text_is_not(
    model_dir: Any, tmp_path: Path, variant: str
) -> None:
    """A recurrent model cannot be cut back: it resumes from the snapshot mlx-lm takes at
    the public cut itself, stored as it is."""
    model = model_dir(variant)
    questions = ["Where is my order?", "Do you sell cables?", "When do you open?"]
    plain = Server(["mlx_lm.server", "--model", str(model)], tmp_path / "plain.log")
    try:  # each request alone, on a fresh server each time: no cache at all
        want = []
        for q in questions:
            want.append(said(chat(plain, PUBLIC, q, "alice")))
            plain.stop()
            plain = Server(["mlx_lm.server", "--model", str(model)], tmp_path / "plain.log")
    finally:
        plain.stop()
    public = tmp_path / "public.json"
    public.write_text(json.dumps([{"messages": [{"role": "system", "content": PUBLIC}]}]))
    args = ("--api-keys", str(key_file(tmp_path)), "--public-prefix", str(public))
    store = tmp_path / "store"
    srv = persist_serve(model, store, tmp_path / "a.log", *args)
    try:
        first = chat(srv, PUBLIC, questions[0], "alice")
        assert reused(first) == 0 and said(first) == want[0]
        second = chat(srv, PUBLIC, questions[1], "bob")  # bob resumes from the public cut
        n = reused(second)
        assert len(PUBLIC) <= n < second["usage"]["prompt_tokens"] - len(questions[1])
        assert said(second) == want[1]  # the answer a fresh server gives, bit for bit
        chat(srv, PRIVATE, questions[0], "alice")  # a system prompt nobody made public
        assert reused(chat(srv, PRIVATE, questions[0], "carol")) == 0  # carol: no history
    finally:
        srv.stop()
    again = persist_serve(model, store, tmp_path / "b.log", *args)
    try:  # after a restart the public cut comes from the store
        third = chat(again, PUBLIC, questions[2], "carol")
        assert reused(third) == n and said(third) == want[2]
    finally:
        again.stop()


def test_one_tenant_cannot_evict_another(model_dir: Any, tmp_path: Path) -> None:
    import persist

    store, budget = tmp_path / "store", 200_000
    srv = persist_serve(
        model_dir("llama"), store, tmp_path / "a.log",
        "--api-keys", str(key_file(tmp_path)), "--tenant-max-bytes", str(budget),
    )  # fmt: skip
    try:
        complete(srv, SECRET, "bob")
        for i in range(8):  # alice writes far more than her budget
            complete(srv, f"{i} alice's long document: " + "lorem ipsum dolor " * 8, "alice")
    finally:
        srv.stop()
    with persist.Store(store) as s:
        alice = s.stats("default/tenant:alice")
        bob = s.stats("default/tenant:bob")
        assert alice.counters["serve_persisted"] >= 8  # each saved, in her namespace
        assert 0 < alice.entries < 8 and alice.unique_bytes <= budget  # hers evicted hers
        assert bob.entries >= 1 and bob.counters["serve_persisted"] >= 1  # bob's kept
    out = persist_cli(
        tmp_path, "stats", "--store", str(store), "--namespace", "default/tenant:bob", "--json"
    )
    assert json.loads(out.stdout)["counters"]["serve_persisted"] == bob.counters["serve_persisted"]


def test_salts_share_their_tenants_budget(model_dir: Any, tmp_path: Path) -> None:
    """Round 5 attack: each cache_salt was a namespace with a budget of its own, so a
    tenant sending a new salt with every request held that many budgets."""
    import persist

    store, budget = tmp_path / "store", 200_000
    srv = persist_serve(
        model_dir("llama"), store, tmp_path / "a.log",
        "--api-keys", str(key_file(tmp_path)), "--tenant-max-bytes", str(budget),
    )  # fmt: skip
    try:
        complete(srv, SECRET, "bob")
        for i in range(8):  # a new salt each time: each alone is well under the budget
            doc = f"{i} alice's long document: " + "lorem ipsum dolor " * 8
            complete(srv, doc, "alice", cache_salt=f"salt-{i}")
    finally:
        srv.stop()
    with persist.Store(store) as s, s.index.read() as db:
        held = dict(db.execute("SELECT namespace, bytes FROM usage WHERE bytes > 0").fetchall())
        assert s.stats("default/tenant:alice").entries == 0  # she never sent a salt-less one
    alice = {ns: n for ns, n in held.items() if ns.startswith("default/tenant:alice/salt:")}
    assert len(alice) >= 1 and sum(alice.values()) <= budget  # all her salts, one budget
    assert held["default/tenant:bob"] > 0  # bob's kept


def test_a_request_from_the_public_prefix_counts_its_prompt_once(
    model_dir: Any, tmp_path: Path
) -> None:
    """Round 5 attack: a request with a public segment was looked up twice (its tenant's
    namespace, then the public one) and both lookups counted its prompt tokens."""
    public = tmp_path / "public.json"
    public.write_text(json.dumps([{"messages": [{"role": "system", "content": PUBLIC}]}]))
    args = ("--api-keys", str(key_file(tmp_path)), "--public-prefix", str(public))
    srv = persist_serve(model_dir("llama"), tmp_path / "store", tmp_path / "a.log", *args)
    names = ("persist_prompt_tokens_total", "persist_cached_prompt_tokens_total")
    lookups = ("persist_cache_lookups_total", (("result", "hit"), ("source", "memory")))
    misses = ("persist_cache_lookups_total", (("result", "miss"), ("source", "memory")))
    try:
        for tenant in ("alice", "bob", "bob"):  # cold; from the public cut; from bob's own
            before = metrics(srv)
            answer = chat(srv, PUBLIC, "Where is my order?", tenant)
            after = metrics(srv)
            usage = answer["usage"]
            want = (usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"])
            got = tuple(after[(n, ())] - before.get((n, ()), 0) for n in names)
            assert got == want, (tenant, got, want)
            asked = sum(after.get(k, 0) - before.get(k, 0) for k in (lookups, misses))
            assert asked == 1, tenant  # one lookup of the memory tier per request
        assert reused(answer) > 0
    finally:
        srv.stop()


def test_a_request_from_the_public_prefix_is_one_lookup_of_its_tenant(
    model_dir: Any, tmp_path: Path
) -> None:
    """Each request is one lookup in the per-tenant counters, filed under the tenant
    that sent it with the result its cache came from: a request resuming from the
    public prefix was two (a miss of its own namespace, a hit of ``(public)``)."""
    public = tmp_path / "public.json"
    public.write_text(json.dumps([{"messages": [{"role": "system", "content": PUBLIC}]}]))
    args = ("--api-keys", str(key_file(tmp_path)), "--public-prefix", str(public))
    srv = persist_serve(model_dir("llama"), tmp_path / "store", tmp_path / "a.log", *args)
    name = "persist_tenant_lookups_total"
    # tenant -> (result, served from the public prefix) of each request
    sent = [("alice", "miss", 0), ("bob", "hit", 1), ("bob", "hit", 0)]
    try:
        for tenant, result, from_public in sent:
            before = metrics(srv)
            chat(srv, PUBLIC, "Where is my order?", tenant)
            after = metrics(srv)
            moved = {
                k: after[k] - before.get(k, 0)
                for k in after
                if k[0] == name and after[k] != before.get(k, 0)
            }
            assert moved == {(name, (("result", result), ("tenant", tenant))): 1}, tenant
            pub = ("persist_tenant_public_hits_total", (("tenant", tenant),))
            assert after.get(pub, 0) - before.get(pub, 0) == from_public, tenant
    finally:
        srv.stop()


MARK = {"persist": {"public_system": True}}  # what extra_body= sends with an OpenAI client
NOTE = "My PIN is 7351. Where is my order?"


def marked_chat(srv: Server, user: str, tenant: str, **extra: Any) -> tuple[int, dict[str, Any]]:
    messages = [{"role": "system", "content": PUBLIC}, {"role": "user", "content": user}]
    body = {"messages": messages, "max_tokens": 2, "temperature": 0, **MARK, **extra}
    return post(srv, "/v1/chat/completions", body, tenant)


def test_a_marked_system_prompt_is_shared_up_to_its_cut_and_no_further(
    model_dir: Any, tiny: Any, tmp_path: Path
) -> None:
    """Issue 37 leftover: a request may mark its system prompt public (when the operator
    allows marks).  Bob's user text begins with all of alice's: he gets exactly the
    system block's cut, none of her text."""
    _, tok, _ = tiny("llama")
    system = [{"role": "system", "content": PUBLIC}]
    later = f"{NOTE} And when is my refund due?"
    prompt = tok.apply_chat_template([*system, {"role": "user", "content": later}],
                                     add_generation_prompt=True)  # fmt: skip
    empty = tok.apply_chat_template([*system, {"role": "user", "content": ""}])
    cut = next(i for i, (a, b) in enumerate(zip(empty, prompt, strict=False)) if a != b)
    args = ("--api-keys", str(key_file(tmp_path)), "--allow-public-marks")
    srv = persist_serve(model_dir("llama"), tmp_path / "store", tmp_path / "a.log", *args)
    try:
        code, first = marked_chat(srv, NOTE, "alice")
        assert code == 200 and reused(first) == 0, first
        code, second = marked_chat(srv, later, "bob")
        assert code == 200, second
        assert reused(second) == cut > 0
    finally:
        srv.stop()


def test_a_public_mark_without_the_operators_leave_is_refused(
    model_dir: Any, tmp_path: Path
) -> None:
    """Without --allow-public-marks a tenant could not write into what every tenant
    reads: the mark is a 400 naming the option, and nothing is served or stored."""
    args = ("--api-keys", str(key_file(tmp_path)))
    srv = persist_serve(model_dir("llama"), tmp_path / "store", tmp_path / "a.log", *args)
    try:
        code, answer = marked_chat(srv, NOTE, "alice")
        assert code == 400, answer
        assert answer["error"]["param"] == "persist"
        assert "--allow-public-marks" in answer["error"]["message"]
        code, _ = marked_chat(srv, NOTE, "alice", persist={"public_system": False})
        assert code == 200  # an explicit false asks for nothing
    finally:
        srv.stop()


def test_a_public_mark_and_retention_hints_in_one_persist_field_are_both_honoured(
    model_dir: Any, tiny: Any, tmp_path: Path
) -> None:
    """The persist field carries the public mark and retention hints together: neither
    refuses the other's keys, and the mark is read before the hints are stripped from
    what mlx-lm sees (the two were built apart and, merged, lost the mark)."""
    _, tok, _ = tiny("llama")
    system = [{"role": "system", "content": PUBLIC}]
    later = f"{NOTE} And when is my refund due?"
    prompt = tok.apply_chat_template([*system, {"role": "user", "content": later}],
                                     add_generation_prompt=True)  # fmt: skip
    empty = tok.apply_chat_template([*system, {"role": "user", "content": ""}])
    cut = next(i for i, (a, b) in enumerate(zip(empty, prompt, strict=False)) if a != b)
    args = ("--api-keys", str(key_file(tmp_path)), "--allow-public-marks",
            "--tenant-max-bytes", "64M")  # fmt: skip
    srv = persist_serve(model_dir("llama"), tmp_path / "store", tmp_path / "a.log", *args)
    both = {"persist": {"public_system": True, "priority": 3, "ttl": "1h"}}
    try:
        code, first = marked_chat(srv, NOTE, "alice", **both)
        assert code == 200 and reused(first) == 0, first
        code, second = marked_chat(srv, later, "bob", **both)
        assert code == 200, second
        assert reused(second) == cut > 0
    finally:
        srv.stop()
