"""Plain rows of the index and the checksum that guards them.  No mlx."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import xxhash

from ..errors import InvalidNameError
from .types import EntryInfo

__all__ = [
    "check_namespace",
    "SNAPSHOT_COLS",
    "SnapshotRow",
    "NewBlob",
    "BlockRef",
    "row_digest",
    "row_of",
    "cols",
    "entry_info",
    "listed_info",
    "check_name",
    "fork_name",
    "MAX_NAME",
    "MAX_FORKS",
    "store_root",
]

MAX_NAME = 1024
MAX_FORKS = 1000  # NAME~2 .. NAME~1000: the histories persist keeps beside a session
_FORK = re.compile(r"~([1-9][0-9]{0,3})\Z")  # a fork suffix: ~N, no leading zero
MAX_COMPONENT = 255  # bytes in one folder name (NAME_MAX on Linux and macOS)


@dataclass(frozen=True)
class SnapshotRow:
    id: int
    namespace: str
    name: str | None
    owner: str | None
    role: str
    identity: str
    identity_map: bytes
    root: bytes
    last_chain: bytes
    n_blocks: int
    n_tokens: int
    tokens: bytes
    trimmable: bool
    min_resume: int
    manifest: bytes
    tail: str
    nbytes: int
    pinned: bool
    created: float
    used: float
    metadata: bytes
    row_xxh3: bytes


@dataclass(frozen=True)
class NewBlob:
    file: str
    key: str
    size: int
    head_xxh3: bytes


@dataclass(frozen=True)
class BlockRef:
    idx: int
    chain: bytes
    blob: str | None


SNAPSHOT_COLS = (
    "id, namespace, name, owner, role, identity, identity_map, root, last_chain, n_blocks, "
    "n_tokens, tokens, trimmable, min_resume, manifest, tail, bytes, pinned, created, used, "
    "metadata, row_xxh3"
)

IMMUTABLE = (
    "namespace",
    "identity",
    "root",
    "last_chain",
    "n_blocks",
    "n_tokens",
    "tokens",
    "trimmable",
    "min_resume",
    "manifest",
    "tail",
)


def row_digest(row: Any, blocks: Sequence[BlockRef]) -> bytes:
    """Checksum of what a snapshot row must never change (tokens, layout, blobs).

    The index is data like any other: a flipped bit in a row's tokens would
    otherwise restore a cache for tokens it does not cover.
    """
    get = row.get if isinstance(row, dict) else lambda k: getattr(row, k)
    fields: list[Any] = [get(k) for k in IMMUTABLE]
    fields[7] = int(bool(fields[7]))
    fields.append([[b.idx, b.chain, b.blob] for b in blocks])
    return xxhash.xxh3_128_digest(msgpack.packb(fields, use_bin_type=True))


def cols(alias: str) -> str:
    return ", ".join(f"{alias}.{c.strip()}" for c in SNAPSHOT_COLS.split(","))


def blob_value(v: Any) -> bytes:
    """A BLOB column's value; any other type (SQLite does not enforce column types:
    a damaged or hand-edited index) reads as empty, which fails the row's checksum
    and every decode, so the row is damage, never a crash."""
    return bytes(v) if isinstance(v, (bytes, bytearray, memoryview)) else b""


def _int(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else -1


def _real(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


def row_of(r: Sequence[Any]) -> SnapshotRow:
    return SnapshotRow(
        id=r[0],
        namespace=r[1],
        name=r[2],
        owner=r[3],
        role=r[4],
        identity=r[5],
        identity_map=blob_value(r[6]),
        root=blob_value(r[7]),
        last_chain=blob_value(r[8]),
        n_blocks=_int(r[9]),
        n_tokens=_int(r[10]),
        tokens=blob_value(r[11]),
        trimmable=bool(r[12]),
        min_resume=_int(r[13]),
        manifest=blob_value(r[14]),
        tail=r[15],
        nbytes=max(_int(r[16]), 0),
        pinned=bool(r[17]),
        created=_real(r[18]),
        used=_real(r[19]),
        metadata=blob_value(r[20]),
        row_xxh3=blob_value(r[21]),
    )


def _row_fields(r: SnapshotRow) -> dict[str, Any]:
    """The fields of an entry that are plain columns (no decoding needed)."""
    return dict(
        id=r.id,
        namespace=r.namespace,
        session=r.name,
        role=r.role,
        owner=r.owner,
        tokens=r.n_tokens,
        bytes=r.nbytes,
        trimmable=r.trimmable,
        min_resume_offset=r.min_resume,
        identity=r.identity,
        created=r.created,
        used=r.used,
        pinned=r.pinned,
    )


def entry_info(r: SnapshotRow) -> EntryInfo:
    """What a caller sees of a snapshot row."""
    body = msgpack.unpackb(r.manifest, raw=False)
    ident = msgpack.unpackb(r.identity_map, raw=False)
    return EntryInfo(
        **_row_fields(r),
        kinds=[layer["kind"] for layer in body["layers"]],
        model=str(ident.get("name", "")),
        metadata=msgpack.unpackb(r.metadata, raw=False),
    )


def listed_info(r: SnapshotRow) -> EntryInfo:
    """``entry_info``, or for a row whose fields do not decode (bit rot in the index) an
    entry marked damaged: listing commands show it and go on (``check --fix`` repairs)."""
    try:
        return entry_info(r)
    except Exception as e:  # msgpack raises many kinds on garbage: all mean damage here
        return EntryInfo(
            **_row_fields(r),
            kinds=[],
            model="",
            damaged=f"the index row does not decode ({type(e).__name__})",
        )


def check_name(value: Any, what: str) -> str:
    """Session and namespace names are plain keys: any text of 1..1024 characters, no NUL,
    encodable as UTF-8 (a lone surrogate is no text SQLite or a tier key can hold).  A
    session name may go past the limit by a fork suffix ``~N`` (``fork_name``): the
    limit is the base name's, so every name persist keeps a history under is a name
    every command takes (attack 38d, finding E)."""
    if not isinstance(value, str) or "\x00" in value or not _fits(value, what == "session"):
        raise InvalidNameError(
            f"{what} must be 1 to {MAX_NAME} characters of text without NUL"
            + (f" (then only a fork suffix, ~2 to ~{MAX_FORKS})" if what == "session" else "")
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidNameError(f"{what} must be valid text (it holds a lone surrogate)") from None
    return value


def check_namespace(value: str | None) -> str | None:
    """``check_name`` of a namespace argument where None means every namespace."""
    return None if value is None else check_name(value, "namespace")


def _fits(name: str, forks: bool) -> bool:
    if 0 < len(name) <= MAX_NAME:
        return True
    base = _fork_base(name) if forks else None
    return base is not None and 0 < len(base) <= MAX_NAME


def _fork_base(name: str) -> str | None:
    """``name`` without its fork suffix ``~N`` (2 <= N <= MAX_FORKS); None without one."""
    m = _FORK.search(name)
    return name[: m.start()] if m and 2 <= int(m.group(1)) <= MAX_FORKS else None


def fork_name(name: str, n: int) -> str:
    """The name of the ``n``-th history of session ``name`` (2 <= n <= MAX_FORKS), kept
    beside it when a save or push does not continue it: ``name~n``.  A name already
    past MAX_NAME (a fork of a name of MAX_NAME characters) has its forks beside it,
    ``base~n`` (``name`` itself for one n: callers pass over it), since a suffix on a
    suffix would take it past every limit."""
    if len(name) > MAX_NAME:
        base = _fork_base(name)
        if base is not None:
            return f"{base}~{n}"
    return f"{name}~{n}"


def store_root(root: str | os.PathLike[str]) -> Path:
    """A store root as the user meant it: ``~`` and ``$VARS`` expanded.

    Round 1 took ``"~/.cache/persist"`` literally and made a folder named
    ``~`` in the working directory (one ``rm -rf ~`` away from losing a home).
    A root that still has a component named ``~`` after expansion is refused.
    """
    path = Path(os.path.expandvars(os.path.expanduser(os.fspath(root))))
    long = [p for p in path.parts if len(os.fsencode(p)) > MAX_COMPONENT]
    if long:  # the system's ENAMETOOLONG, said before anything is made
        raise InvalidNameError(
            f"store root {os.fspath(root)!r} has a folder name of {len(os.fsencode(long[0]))} "
            f"bytes; a name on disk has at most {MAX_COMPONENT}"
        )
    if "~" in path.parts:
        raise InvalidNameError(
            f"store root {os.fspath(root)!r} has a folder named '~' (not expanded): "
            "give a path without it"
        )
    return path
