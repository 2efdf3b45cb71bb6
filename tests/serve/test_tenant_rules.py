"""The pure rules of persist serve's tenants: key files, namespaces, public prefixes, labels."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

import persist
from persist.errors import InvalidArgumentError, PersistError
from persist.serve.tenant_metrics import TenantCounts, tenancy_line, tenant_of
from persist.serve.tenants import AccessDeniedError, Tenants, load_keys, load_public, tenants_from
from persist.storage.rows import MAX_NAME
from tests.helpers import persist_cli

KEY = "k" * 16
OTHER_KEY = "j" * 20


def rules(tmp_path: Path, text: str) -> Tenants:
    p = tmp_path / "keys"
    p.write_text(text)
    return tenants_from("ns", api_keys=p)


def test_key_file_lines_and_json(tmp_path: Path) -> None:
    t = rules(tmp_path, f"# comment\n\n{KEY} acme\n{'j' * 20} globex\n")
    assert t.tenant({"Authorization": f"Bearer {KEY}"}) == "acme"
    assert t.tenant({"Authorization": f"bearer  {'j' * 20} "}) == "globex"
    t = rules(tmp_path, json.dumps({KEY: "acme"}))
    assert t.tenant({"Authorization": f"Bearer {KEY}"}) == "acme"
    assert KEY.encode() not in b"".join(t.keys)  # only digests are kept


@pytest.mark.parametrize(
    "text",
    [f"{KEY}\n", f"{KEY} a b\n", "short acme\n", f"{KEY} acme\n{KEY} other\n", "",
     f"{KEY} bad/tenant\n", "{not json", json.dumps({KEY: 5}), "\n# only comments\n"],
)  # fmt: skip
def test_bad_key_files_are_refused_without_the_key(tmp_path: Path, text: str) -> None:
    with pytest.raises(InvalidArgumentError) as e:
        rules(tmp_path, text)
    assert KEY not in str(e.value)


def test_a_json_key_file_with_a_key_twice_is_refused_by_position(tmp_path: Path) -> None:
    """Round 5 attack: JSON's last duplicate won silently (another tenant's key, or a
    key handed to two tenants, went unnoticed)."""
    text = f'{{"{KEY}": "acme", "{OTHER_KEY}": "globex", "{KEY}": "initech"}}'
    with pytest.raises(InvalidArgumentError, match="entry 3: repeats the key of entry 1") as e:
        rules(tmp_path, text)
    assert KEY not in str(e.value)


def test_a_key_line_twice_is_refused_by_line(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="line 4: repeats the key of line 2") as e:
        rules(tmp_path, f"# keys\n{KEY} acme\n{OTHER_KEY} globex\n{KEY} initech\n")
    assert KEY not in str(e.value)


def test_a_key_line_beginning_with_a_hash_is_refused_not_skipped(tmp_path: Path) -> None:
    """Round 5 attack: '#KEY TENANT' was read as a comment, so that tenant's key was
    silently missing; a comment of any other shape is still a comment."""
    hashed = "#" + KEY
    with pytest.raises(InvalidArgumentError, match="line 3") as e:
        rules(tmp_path, f"# KEY TENANT\n{KEY} acme\n{hashed} globex\n#----- acme\n")
    assert hashed not in str(e.value)


def test_comments_of_other_shapes_are_still_skipped(tmp_path: Path) -> None:
    t = rules(tmp_path, f"# KEY TENANT\n#note\n#-- acme\n  # {KEY}\n{KEY} acme\n")
    assert t.tenant({"Authorization": f"Bearer {KEY}"}) == "acme" and len(t.keys) == 1


@pytest.mark.parametrize(
    "auth", [None, "", "Bearer", "Bearer ", "Basic " + KEY, "Bearer nope", "Bearer \xff\x00",
             "Bearer " + "k" * 100_000],
)  # fmt: skip
def test_no_valid_key_is_access_denied(tmp_path: Path, auth: str | None) -> None:
    t = rules(tmp_path, f"{KEY} acme\n")
    headers = {} if auth is None else {"Authorization": auth}
    with pytest.raises(AccessDeniedError) as e:
        t.tenant(headers)
    assert isinstance(e.value, PersistError) and isinstance(e.value, PermissionError)


def test_access_denied_is_in_the_one_error_tree() -> None:
    """Round 5 attack: AccessDeniedError lived in serve/tenants.py, outside persist.errors."""
    import persist.errors

    assert "AccessDeniedError" in persist.errors.__all__
    assert persist.errors.AccessDeniedError is AccessDeniedError  # old imports still work
    assert issubclass(AccessDeniedError, PersistError)
    assert issubclass(AccessDeniedError, PermissionError)


def test_header_tenants() -> None:
    t = tenants_from("ns", header="X-Tenant")
    assert t.multi and t.tenant({"X-Tenant": "acme.eu-1"}) == "acme.eu-1"
    with pytest.raises(AccessDeniedError):
        t.tenant({})
    for bad in ("", "a b", "x" * 129, "é", "a/b", "\x00"):
        with pytest.raises(InvalidArgumentError):
            t.tenant({"X-Tenant": bad})
    for name in ("Authorization", "bad header", ""):
        with pytest.raises(InvalidArgumentError):
            tenants_from("ns", header=name)
    with pytest.raises(InvalidArgumentError):
        tenants_from("ns", api_keys="x", header="X-Tenant")


def test_a_base_namespace_holding_the_partition_mark_is_refused() -> None:
    """``--namespace 'x/salt:y'`` would make every tenant's namespace a partition of
    ``x``: all tenants would share one budget."""
    with pytest.raises(InvalidArgumentError, match="/salt:"):
        tenants_from("x/salt:y")


@pytest.mark.parametrize(
    "namespace", ["default/tenant:alice", "x/tenant:", "default/public", "a/b/public"]
)
def test_a_base_namespace_that_is_a_tenants_or_the_public_one_is_refused(namespace: str) -> None:
    """Found from outside: a single-tenant server on ``--namespace default/tenant:alice``
    served alice's caches to every client of it, and one on ``default/public`` wrote
    every client's prompts into the namespace all tenants read."""
    for options in ({}, {"header": "X-Tenant"}):
        with pytest.raises(InvalidArgumentError, match="--namespace"):
            tenants_from(namespace, **options)


@pytest.mark.parametrize("multi", [False, True])
def test_a_base_namespace_too_long_for_its_partitions_is_refused(multi: bool) -> None:
    """Found from outside: an 900-character ``--namespace`` started, and every tenant
    whose salted namespace passed the store's 1,024 characters was never saved."""
    options = {"header": "X-Tenant"} if multi else {}
    longest = MAX_NAME - len("/tenant:") - 128 - len("/salt:") - 32 if multi else MAX_NAME - 38
    fits = tenants_from("n" * longest, **options)
    assert len(fits.namespace_for("t" * 128 if multi else None, "salt")) == MAX_NAME
    with pytest.raises(InvalidArgumentError, match="at most"):
        tenants_from("n" * (longest + 1), **options)


def test_namespaces_never_collide() -> None:
    t = Tenants("ns")
    assert not t.multi and t.tenant({"Authorization": "whatever"}) is None
    names = {
        t.namespace_for(None),
        t.namespace_for("a"),
        t.namespace_for("b"),
        t.namespace_for("a", "s"),
        t.namespace_for("a", "t"),
        t.namespace_for(None, "s"),
        t.public_namespace,
    }
    assert len(names) == 7 and t.namespace_for(None) == "ns"
    assert "secret-salt" not in t.namespace_for("a", "secret-salt")
    for bad in ("", "x" * 257, 5, True, ["x"], {"a": 1}, "\ud800"):
        with pytest.raises(InvalidArgumentError):
            t.namespace_for("a", bad)


def test_public_prefixes(tmp_path: Path) -> None:
    system = {"role": "system", "content": "You are the shop's agent."}
    tools = [{"type": "function", "function": {"name": "f"}}]
    p = tmp_path / "public.json"
    p.write_text(json.dumps([{"messages": [system], "tools": tools}]))
    t = Tenants("ns", public=load_public(p))
    user = {"role": "user", "content": "hi"}
    assert t.is_public([system, user], tools)
    assert not t.is_public([system, user], None)  # other tools: another rendering
    assert not t.is_public([{**system, "content": "other"}, user], tools)
    assert not t.is_public([user], tools) and not t.is_public("x", None)
    text = tmp_path / "system.txt"
    text.write_text("You are the shop's agent.")
    assert Tenants("ns", public=load_public(text)).is_public([system, user], None)
    bad_files = [[{"messages": [user]}], [{"messages": []}], [5]]
    bad_files.append([{"messages": [system], "tools": 1}])
    for bad in bad_files:
        p.write_text(json.dumps(bad))
        with pytest.raises(InvalidArgumentError):
            load_public(p)


def test_metrics_labels_are_bounded(tmp_path: Path) -> None:
    import persist

    t = Tenants("ns", header="X-Tenant")
    assert tenant_of(t.namespace_for("acme", "s"), t) == "acme"
    assert tenant_of(t.public_namespace, t) == "(public)" and tenant_of("ns", t) == "(none)"
    with persist.Store(tmp_path / "s") as store:
        counts = TenantCounts(t, store, top=3)
        for i in range(50):
            counts.count(t.namespace_for(f"t{i}"), {"misses": i, "memory_hits": 1})
        ranked = counts.ranked()
        assert [label for label, _ in ranked] == ["t49", "t48", "t47", "(other)"]
        assert ranked[-1][1]["misses"] == sum(range(47))
        families = {f.name: f for f in counts.collect()}
    samples = families["persist_tenant_lookups"].samples
    assert len(samples) == 8  # 4 labels x (hit, miss)
    assert [s.value for s in families["persist_tenant_store_bytes"].samples] == [0] * 3


def test_tenants_named_like_the_reserved_labels_keep_labels_of_their_own() -> None:
    """Round 5 attack: a tenant named ``other`` or ``public`` (a key file's, or a
    gateway's header) was summed into the label of everyone else or of the public
    prefixes.  Reserved labels take a form no tenant name can (parentheses)."""
    t = Tenants("ns", header="X-Tenant")
    counts = TenantCounts(t, None, top=4)  # labels only: no store read
    for i, name in enumerate(("public", "none", "other")):
        counts.count(t.namespace_for(name), {"misses": 10 + i})
    counts.count(t.public_namespace, {"memory_hits": 5})
    counts.count(t.namespace_for(None), {"misses": 4})
    counts.count(t.namespace_for("small"), {"misses": 1})
    ranked = dict(counts.ranked())
    assert set(ranked) == {"public", "none", "other", "(public)", "(other)"}
    assert [ranked[n]["misses"] for n in ("public", "none", "other")] == [10, 11, 12]
    assert ranked["(public)"]["memory_hits"] == 5
    assert ranked["(other)"]["misses"] == 5  # the single-tenant namespace and "small"


SYSTEM_FIRST = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]


@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/chat/completions", {"messages": SYSTEM_FIRST, "persist": True}),
     ("/v1/chat/completions", {"messages": SYSTEM_FIRST, "persist": {"public_system": 1}}),
     ("/v1/chat/completions", {"messages": SYSTEM_FIRST, "persist": {"public": True}}),
     ("/v1/completions", {"prompt": "p", "persist": {"public_system": True}}),
     ("/v1/chat/completions", {"messages": SYSTEM_FIRST[1:], "persist": {"public_system": True}}),
     ("/v1/chat/completions", {"messages": SYSTEM_FIRST, "persist": {"public_system": True},
                               "chat_template_kwargs": {"date_string": "x"}}),
     # attack r15, F4: mlx-lm splits no system segment off these; the mark was ignored
     ("/v1/chat/completions", {"messages": [*SYSTEM_FIRST, {"role": "assistant", "content": "a"}],
                               "persist": {"public_system": True}}),
     ("/v1/chat/completions", {"messages": SYSTEM_FIRST[:1], "persist": {"public_system": True}}),
     ("/v1/chat/completions", {"messages": [SYSTEM_FIRST[0], {"role": "user", "content": ""}],
                               "persist": {"public_system": True}}),
     ("/v1/chat/completions", {"messages": [SYSTEM_FIRST[0], {"role": "user", "content": []}],
                               "persist": {"public_system": True}})],
)  # fmt: skip
def test_a_public_mark_that_cannot_be_honoured_is_a_bad_request(
    path: str, body: dict[str, Any]
) -> None:
    from persist.serve.request_checks import BadRequest, check_request

    with pytest.raises(BadRequest) as e:
        check_request(path, body, marks=True)
    assert e.value.param == "persist"


def test_a_tenants_store_bytes_are_what_its_budget_counts(tmp_path: Path) -> None:
    """persist_tenant_store_bytes summed at most 64 of a tenant's namespaces: a tenant
    with more salts showed less than its budget holds.  It is the budget's own sum."""
    import persist
    from tests.golden.cases import IDENTITY, kv_cache

    t = Tenants("ns", header="X-Tenant")
    with persist.Store(tmp_path / "s") as store:
        counts = TenantCounts(t, store)
        for i in range(70):
            ns = t.namespace_for("acme", f"salt-{i}")
            store.save([kv_cache(8, i)], list(range(i, i + 8)), identity=IDENTITY, namespace=ns)
            counts.count(ns, {"misses": 1})
        families = {f.name: f for f in counts.collect()}
        (sample,) = families["persist_tenant_store_bytes"].samples
        assert sample.labels["tenant"] == "acme"
        assert sample.value == store.index.unique_bytes() > 0


def test_start_line(tmp_path: Path) -> None:
    level, line = tenancy_line(Tenants("ns"), None)
    assert level == logging.WARNING and "single-tenant" in line and "FLEET" not in line
    level, line = tenancy_line(Tenants("ns"), "redis://x")
    assert "ANY CLIENT OF THE FLEET" in line
    keys: Any = load_keys_file(tmp_path)
    level, line = tenancy_line(Tenants("ns", keys=keys), "redis://x")
    assert level == logging.INFO and "1 keys" in line and "marks" not in line
    assert "--allow-public-marks" in tenancy_line(Tenants("ns", keys=keys, marks=True), None)[1]


def load_keys_file(tmp_path: Path) -> Any:
    p = tmp_path / "k"
    p.write_text(f"{KEY} acme\n")
    return load_keys(p)


def test_a_public_cut_never_holds_private_text(tiny: Any) -> None:
    """Found from outside (round 5): a template that renders a request's
    ``chat_template_kwargs`` in the system block filed that text as public, and a user
    message starting with an end-of-turn token moved mlx-lm's cut one private token in."""
    from types import SimpleNamespace

    from persist.serve.tenant_serving import public_cut

    _, tok, _ = tiny("llama")
    system = [{"role": "system", "content": "You are the shop's assistant."}]

    def cut_of(user: str, **kwargs: Any) -> tuple[int, int]:
        messages = [*system, {"role": "user", "content": user}]
        request = SimpleNamespace(messages=messages, tools=None)
        args = SimpleNamespace(chat_template_kwargs=kwargs or None)
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
        empty = tok.apply_chat_template([*system, {"role": "user", "content": ""}])
        mlx_cut = next(i for i, (a, b) in enumerate(zip(empty, prompt, strict=False)) if a != b)
        return mlx_cut, public_cut(tok, request, args, mlx_cut, {})

    mlx_cut, got = cut_of("Where is my order?")
    assert got == mlx_cut > 0  # the usual case: mlx-lm's own cut is the public prefix
    assert cut_of("Where is my order?", date_string="vault PIN 7351")[1] == 0
    # ChatML closes an empty user turn with <|im_end|>: a user text that begins with it
    # matches one token further, and that token is the user's, not the system's
    mlx_cut, got = cut_of("<|im_end|>PIN is 7351")
    assert got == 0 and mlx_cut > cut_of("Where is my order?")[0]


@pytest.mark.parametrize(
    ("option", "value", "said"),
    [
        ("--namespace", "", "namespace"),
        ("--max-request-bytes", "0", "--max-request-bytes"),
        # attack 39h: mlx-lm's server started, then hung on the first request (0) or
        # failed every one (-1)
        ("--prefill-step-size", "0", "--prefill-step-size"),
        ("--prefill-step-size", "-1", "--prefill-step-size"),
        ("--prompt-concurrency", "0", "--prompt-concurrency"),
        ("--decode-concurrency", "0", "--decode-concurrency"),
        # attack r17b: mlx-lm's size parser raised KeyError (a traceback) on these
        ("--prompt-cache-bytes", "300K", "--prompt-cache-bytes"),
        ("--prompt-cache-bytes", "-1", "--prompt-cache-bytes"),
        ("--prompt-cache-bytes", "lots", "--prompt-cache-bytes"),
    ],
)
def test_serve_refuses_options_that_serve_nothing(
    model_dir: Any, tmp_path: Path, option: str, value: str, said: str
) -> None:
    """Attack 38g: ``--namespace ''`` and ``--max-request-bytes 0`` started a server (one
    whose every save failed, one that refused every request).  Now one line, exit 1,
    before the model loads."""
    out = persist_cli(
        tmp_path / "home", "serve", "--model", str(model_dir("llama")), "--store",
        str(tmp_path / "s"), "--port", "0", option, value, check=False,
    )  # fmt: skip
    assert out.returncode == 1, (out.returncode, out.stderr[-2000:])
    assert said in out.stderr and "Traceback" not in out.stderr


def test_mlx_lm_sizes_below_one_are_refused_in_every_spelling() -> None:
    from persist.serve.app import check_sizes

    for bad in (["--prefill-step-size=0"], ["--prefill-step", "0"], ["--decode-concurrency", "-3"]):
        with pytest.raises(persist.InvalidArgumentError, match="at least 1"):
            check_sizes(bad)
    check_sizes(["--prefill-step-size", "1", "--prompt-concurrency", "2", "--kv-bits", "4"])
    check_sizes(["--prefill-step-size", "many"])  # mlx-lm's own argparse refuses it
    check_sizes(["--prompt-cache-bytes", "300M", "--prompt-cache-bytes=2GB"])
    for size in ("300K", "1.5T", "", "-2", "1e9", "x"):
        with pytest.raises(persist.InvalidArgumentError, match="--prompt-cache-bytes"):
            check_sizes([f"--prompt-cache-bytes={size}"])
    with pytest.raises(persist.InvalidArgumentError, match="300K"):  # the first of two too
        check_sizes(["--prompt-cache-bytes", "300K", "--prompt-cache-bytes", "1G"])


def test_a_tenant_header_or_key_given_twice_is_refused(tmp_path: Path) -> None:
    """Outside attack r15, F3: a request with ``X-Tenant: alice`` and then ``X-Tenant:
    mallory`` was served as alice (the first won): behind a gateway that appends its
    value instead of replacing the client's, a client picks its tenant."""
    from email.message import Message

    def headers(name: str, *values: str) -> Message:
        m = Message()
        for v in values:
            m[name] = v
        return m

    t = tenants_from("ns", header="X-Tenant")
    assert t.tenant(headers("X-Tenant", "alice")) == "alice"
    for twice in (("alice", "mallory"), ("alice", "alice")):
        with pytest.raises(InvalidArgumentError, match="more than once"):
            t.tenant(headers("X-Tenant", *twice))
    k = rules(tmp_path, f"{KEY} acme\n{OTHER_KEY} globex\n")
    with pytest.raises(InvalidArgumentError, match="more than once"):
        k.tenant(headers("Authorization", f"Bearer {OTHER_KEY}", f"Bearer {KEY}"))


def test_tenant_budgets_past_the_stores_are_warned_of(tmp_path: Path) -> None:
    """Outside attack r15, F2: with 3 keys, --tenant-max-bytes 300K and --max-bytes 300K,
    one tenant filled the store inside its own budget and every other tenant's save was
    refused for good.  The rule stands (the store's budget is a disk's); the start line
    says when the tenants' budgets add up past it."""
    from persist.serve.tenant_metrics import budget_line

    keys = rules(tmp_path, f"{KEY} acme\n{OTHER_KEY} globex\n{'i' * 16} initech\n")
    line = budget_line(keys, 300_000, 300_000)
    assert line is not None and "3 tenants" in line and "900000" in line, line
    assert budget_line(keys, 100_000, 300_000) is None  # they fit
    assert budget_line(keys, 100_000, None) is None  # no store budget
    assert budget_line(keys, None, 300_000) is None  # no tenant budgets
    header = tenants_from("ns", header="X-Tenant")
    line = budget_line(header, 100_000, 300_000)
    assert line is not None and "3 tenants" in line, line  # how many fit: tenants unknown
    assert budget_line(Tenants("ns"), 100_000, 300_000) is None  # single-tenant
