"""Who is asking ``persist serve``, and which namespace that request's caches live in.

A prompt cache answers ``cached_tokens`` with how much of a prompt some
earlier request sent: shared between clients, it is an oracle of their
prompts (issue 37).  So every request is put in a namespace of its own
tenant, in every tier (memory, host, store, shared, cold), from, in order
of trust:

- an API key (``--api-keys FILE``: ``Authorization: Bearer KEY``, compared
  in constant time; none or an unknown one is 401);
- a header a trusted gateway sets (``--tenant-header NAME``), only when no
  keys are configured;
- the request's ``cache_salt`` (vLLM's field), which partitions further.

Without keys or a header the server is single-tenant: every request is in
the server's ``--namespace`` (as before), a salted one in its own.  Tenant
names and salts never reach a log; salts are hashed into the namespace.
Public prefixes (``--public-prefix``) live in one more namespace every
tenant reads.  Pure: no mlx, no HTTP.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import AccessDeniedError, InvalidArgumentError
from ..storage.retention import PARTITION
from ..storage.rows import MAX_NAME
from .option_files import read_option_file

__all__ = [
    "AccessDeniedError",  # defined in persist.errors; imported from here before round 5
    "Tenants",
    "Scoped",
    "load_keys",
    "load_public",
    "PublicPrefix",
    "tenants_from",
]

MAX_TENANT = 128
TENANT = re.compile(r"[A-Za-z0-9._@:+=-]{1,128}")  # a tenant name: a plain key, any tier
TENANT_MARK, PUBLIC = "/tenant:", "/public"  # NS/tenant:T is T's namespace, NS/public all's
SALT_HEX = 32  # hex digits of a salt's hash in its partition's name (NS/salt:HEX)
MIN_KEY, MAX_KEY = 16, 512  # an API key's characters
MAX_SALT = 256  # cache_salt characters (vLLM takes any string; a bound keeps bodies sane)
MAX_KEYS = 100_000
KEY_FILE_BYTES = MAX_KEYS * 1024  # 1 KiB a line: a key, a tenant, room for comments
PUBLIC_FILE_BYTES = 16 << 20  # 16 MiB: the text of a context of millions of tokens
HEADER = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]{1,64}")  # an HTTP header name (RFC 9110 token)


@dataclass(frozen=True)
class Scoped:
    """A prompt-cache key of mlx-lm's (its model key) within one namespace: mlx-lm's
    trie is keyed by it, so entries of two namespaces never meet in memory."""

    model: Any
    namespace: str


@dataclass(frozen=True)
class PublicPrefix:
    """Leading system messages (and tools) an operator made public: the system segment
    of a request that starts with exactly these is shared by every tenant."""

    messages: tuple[str, ...]  # each message as canonical JSON
    tools: str  # canonical JSON of the tools (null when none)

    @classmethod
    def of(cls, messages: Iterable[Any], tools: Any) -> PublicPrefix:
        return cls(tuple(_canonical(m) for m in messages), _canonical(tools or None))


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


@dataclass
class Tenants:
    """One server's rules: ``keys`` (sha256 of each key -> tenant), ``header`` (a trusted
    gateway's header name), ``public`` (public prefixes), ``marks`` (requests may mark
    their system prompt public), over the base ``namespace``."""

    namespace: str = "default"
    keys: dict[bytes, str] = field(default_factory=dict)
    header: str | None = None
    public: frozenset[PublicPrefix] = frozenset()
    marks: bool = False  # a request may mark its system prompt public (--allow-public-marks)

    @property
    def multi(self) -> bool:
        """Whether requests are told apart by who sends them (keys or a header)."""
        return bool(self.keys) or self.header is not None

    @property
    def public_namespace(self) -> str:
        return f"{self.namespace}{PUBLIC}"

    def tenant(self, headers: Mapping[str, str] | Any) -> str | None:
        """The tenant of a request with these headers (None: single-tenant).
        AccessDeniedError (401) without a valid key or the header; InvalidArgumentError
        (400) for a header value that is no tenant name."""
        if self.keys:
            return self._by_key(_once(headers, "Authorization"))
        if self.header is None:
            return None
        value = _once(headers, self.header)
        if value is None:
            raise AccessDeniedError(f"the {self.header} header is required")
        if not TENANT.fullmatch(value):
            raise InvalidArgumentError(
                f"the {self.header} header must be 1 to 128 letters, digits or ._@:+=-"
            )
        return str(value)

    def _by_key(self, authorization: str | None) -> str:
        scheme, _, key = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise AccessDeniedError("an API key is required (Authorization: Bearer KEY)")
        # http.server decodes headers as latin-1: these are the bytes the client sent
        given = _digest(key.strip().encode("latin-1", "replace"))
        found = None
        for digest, tenant in self.keys.items():  # every key compared: no early exit
            if hmac.compare_digest(digest, given):
                found = tenant
        if found is None:
            raise AccessDeniedError("the API key is not valid")
        return found

    def namespace_for(self, tenant: str | None, salt: Any = None) -> str:
        """The namespace of a tenant's caches, partitioned by ``salt`` (a request's
        ``cache_salt``; InvalidArgumentError when it is no string of 1..256 characters)."""
        ns = self.namespace if tenant is None else f"{self.namespace}{TENANT_MARK}{tenant}"
        if salt is None:
            return ns
        if not isinstance(salt, str) or not 0 < len(salt) <= MAX_SALT:
            raise InvalidArgumentError(
                f"cache_salt must be a string of 1 to {MAX_SALT} characters or null"
            )
        try:
            raw = salt.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidArgumentError("cache_salt must be valid text") from None
        # a partition of the tenant's namespace: within its budget in every tier
        return f"{ns}{PARTITION}{hashlib.sha256(raw).hexdigest()[:SALT_HEX]}"

    def is_public(self, messages: Any, tools: Any) -> bool:
        """Whether a chat request's leading system messages (with its tools) are a
        public prefix the operator named."""
        if not self.public or not isinstance(messages, list):
            return False
        system = []
        for m in messages:
            if not (isinstance(m, dict) and m.get("role") == "system"):
                break
            system.append(m)
        return bool(system) and PublicPrefix.of(system, tools) in self.public


def tenants_from(
    namespace: str,
    api_keys: str | Path | None = None,
    header: str | None = None,
    public_prefix: str | Path | None = None,
    public_marks: bool = False,
) -> Tenants:
    """The rules ``persist serve``'s options give (InvalidArgumentError for bad ones)."""
    if PARTITION in namespace:  # every tenant's namespace would be a partition of one
        raise InvalidArgumentError(
            f"--namespace {namespace!r} may not hold {PARTITION!r}: it marks a cache_salt's "
            "partition, and every tenant would share one budget"
        )
    _check_base(namespace, multi=api_keys is not None or header is not None)
    if api_keys is not None and header is not None:
        raise InvalidArgumentError(
            "give --api-keys or --tenant-header, not both: the key names the tenant"
        )
    if header is not None and (not HEADER.fullmatch(header) or header.lower() == "authorization"):
        raise InvalidArgumentError(f"--tenant-header {header!r} is not a header name to trust")
    return Tenants(
        namespace,
        load_keys(api_keys) if api_keys is not None else {},
        header,
        load_public(public_prefix) if public_prefix is not None else frozenset(),
        public_marks,
    )


def _check_base(namespace: str, multi: bool) -> None:
    """InvalidArgumentError for a ``--namespace`` that is a tenant's or the public one
    (its clients would share that tenant's caches, or write into what every tenant
    reads), or too long for the namespaces made from it (``namespace_for``)."""
    if TENANT_MARK in namespace or namespace.endswith(PUBLIC):
        raise InvalidArgumentError(
            f"--namespace {namespace[:80]!r} may not hold {TENANT_MARK!r} nor end in {PUBLIC!r}: "
            "those are a tenant's namespaces and the public one"
        )
    longest = len(TENANT_MARK) + MAX_TENANT if multi else 0
    most = MAX_NAME - longest - len(PARTITION) - SALT_HEX
    if len(namespace) > most:
        raise InvalidArgumentError(
            f"--namespace is {len(namespace)} characters; at most {most} here, so that every "
            f"tenant's and salt's namespace fits in {MAX_NAME}"
        )


def load_keys(path: str | Path) -> dict[bytes, str]:
    """An API key file: ``KEY TENANT`` a line (blank lines and ``#`` comments skipped),
    or JSON ``{"KEY": "TENANT", ...}``.  Keys are kept as their sha256 only.  A key
    listed twice, or one beginning with ``#``, is an error naming its line or entry
    (never the key): either would leave a tenant's key silently not what was meant."""
    text = _read(path, "API key", KEY_FILE_BYTES)
    pairs = _json_pairs(text, path) if text.lstrip().startswith("{") else _line_pairs(text, path)
    keys: dict[bytes, str] = {}
    first: dict[bytes, str] = {}  # digest -> where it was listed first
    for where, key, tenant in pairs:
        _check_pair(key, tenant, path, where)
        digest = _digest(key.encode())
        if digest in first:
            raise InvalidArgumentError(
                f"{path} {where}: repeats the key of {first[digest]}; each key names one tenant"
            )
        first[digest] = where
        keys[digest] = tenant
    if not keys or len(keys) > MAX_KEYS:
        raise InvalidArgumentError(f"{path}: want 1 to {MAX_KEYS} keys")
    return keys


def _json_pairs(text: str, path: str | Path) -> list[tuple[str, Any, Any]]:
    """(where, key, tenant) of a JSON key file, every pair kept (json.loads keeps the
    last of a repeated key)."""
    try:
        loaded = json.loads(text, object_pairs_hook=lambda pairs: pairs)
    except ValueError as e:
        raise InvalidArgumentError(f"the API key file {path} is not JSON: {e}") from None
    return [(f"entry {i}", k, v) for i, (k, v) in enumerate(loaded, 1)]


def _line_pairs(text: str, path: str | Path) -> list[tuple[str, Any, Any]]:
    """(where, key, tenant) of a ``KEY TENANT`` file.  A line whose first word begins
    with ``#`` is a comment, unless it reads as a key and a tenant: a key beginning
    with ``#`` (or a line commented out without a space) is refused, not skipped."""
    out: list[tuple[str, Any, Any]] = []
    for n, line in enumerate(text.splitlines(), 1):
        parts = line.split()
        if parts and parts[0].startswith("#"):
            if len(parts) == 2 and _key_shaped(parts[0]) and TENANT.fullmatch(parts[1]):
                raise InvalidArgumentError(
                    f"{path} line {n}: reads as a key beginning with '#', which no key may; "
                    "to comment a line out, begin it with '# ' (a hash and a space)"
                )
            continue
        if not parts:
            continue
        if len(parts) != 2:
            raise InvalidArgumentError(f"{path} line {n}: want 'KEY TENANT'")
        out.append((f"line {n}", parts[0], parts[1]))
    return out


def _key_shaped(key: Any) -> bool:
    return (isinstance(key, str) and MIN_KEY <= len(key) <= MAX_KEY and key.isprintable()
            and key.isascii() and " " not in key)  # fmt: skip


def _check_pair(key: Any, tenant: Any, path: str | Path, where: str) -> None:
    if not _key_shaped(key):  # the key itself is never put in a message
        raise InvalidArgumentError(
            f"{path} {where}: every key must be {MIN_KEY} to {MAX_KEY} printable ASCII characters"
        )
    if key.startswith("#"):
        raise InvalidArgumentError(f"{path} {where}: a key may not begin with '#'")
    if not (isinstance(tenant, str) and TENANT.fullmatch(tenant)):
        raise InvalidArgumentError(
            f"{path} {where}: tenant {tenant!r} must be 1 to 128 letters, digits or ._@:+=-"
        )


def load_public(path: str | Path) -> frozenset[PublicPrefix]:
    """Public prefixes: a JSON list of ``{"messages": [system messages], "tools": [...]}``
    (one object is a list of one), or any other file: one system prompt, its whole text."""
    text = _read(path, "public prefix", PUBLIC_FILE_BYTES)
    if not text.lstrip().startswith(("[", "{")):
        return frozenset({PublicPrefix.of([{"role": "system", "content": text}], None)})
    try:
        loaded = json.loads(text)
    except ValueError as e:
        raise InvalidArgumentError(f"the public prefix file {path} is not JSON: {e}") from None
    entries = loaded if isinstance(loaded, list) else [loaded]
    out = set()
    for i, entry in enumerate(entries):
        messages = entry.get("messages") if isinstance(entry, dict) else None
        if not (
            isinstance(messages, list)
            and messages
            and all(isinstance(m, dict) and m.get("role") == "system" for m in messages)
        ):
            raise InvalidArgumentError(
                f"{path}: entry {i} must be an object whose messages are system messages"
            )
        tools = entry.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise InvalidArgumentError(f"{path}: entry {i}'s tools must be a list")
        out.add(PublicPrefix.of(messages, tools))
    return frozenset(out)


def _read(path: str | Path, what: str, limit: int) -> str:
    data = read_option_file(path, limit, what)  # a regular file, bounded: never /dev/zero
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidArgumentError(f"the {what} file {path} is not UTF-8 text: {e}") from None


def _once(headers: Mapping[str, str] | Any, name: str) -> str | None:
    """A header that says who sends the request, given at most once: InvalidArgumentError
    (400) for two (attack r15: the first won, and behind a gateway that appends its
    value instead of replacing the client's, the client chose its tenant)."""
    values = headers.get_all(name) if hasattr(headers, "get_all") else None
    if values is not None and len(values) > 1:
        raise InvalidArgumentError(f"the {name} header was given more than once")
    return headers.get(name)
