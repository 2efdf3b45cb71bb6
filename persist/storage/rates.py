"""Measured speeds and the latest restore-or-recompute decisions, in the index.  No mlx.

A rate is kept per machine (host name and MLX backend: a store on a shared
disk serves machines of different speeds), per what was measured ("restore"
keyed by tier, "prefill" keyed by model identity) and per power-of-two
bucket of the amount (``policy.recompute.rate_bucket``), as its latest
``policy.recompute.KEEP_SAMPLES`` samples: an estimate is read from several runs
(``policy.recompute.rate_of``), so one noisy run moves it only part of the way, and a
run measured again replaces the oldest.  Recording is
best effort: a read never fails because its statistics could not be written
(a full disk drops them, counted by ``full.dropped``).
"""

from __future__ import annotations

import functools
import platform
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import msgpack

from ..policy import recompute
from .full import best_effort
from .index import Index

__all__ = [
    "machine_name",
    "record",
    "rates",
    "samples",
    "samples_by_key",
    "Samples",
    "reset",
    "all_rates",
    "note_decision",
    "decisions",
    "note_path",
    "paths",
]

KEEP_DECISIONS = 32  # per namespace, for persist stats


def machine_name(backend: str) -> str:
    """This machine as rates are keyed: ``host/backend`` ("gpu-7/cuda:NVIDIA H200")."""
    return f"{platform.node() or 'unknown'}/{backend or 'unknown'}"


def record(
    index: Index,
    machine: str,
    what: str,
    *,
    key: str,
    bucket: int,
    rate: float,
    at: float | None = None,
) -> None:
    """Add one measured rate (per second) to its bucket's latest samples (``at``:
    when, in ``time.time`` seconds; now by default)."""
    if not rate > 0 or rate == float("inf"):
        return
    when = time.time() if at is None else at
    _write(index, functools.partial(
        _record, machine=machine, what=what, key=key, bucket=bucket, rate=rate, at=when
    ))  # fmt: skip


def _write(index: Index, write: Callable[[Any], None]) -> None:
    """A statistics row: held for the index's own writer where it holds statistics
    (``persist serve``: never a transaction on the request's thread), else written
    now, best effort."""
    held = index.held
    if held is not None and held.defer(write):
        return
    best_effort(_in_transaction, index, write)


def _in_transaction(index: Index, write: Callable[[Any], None]) -> None:
    with index.write() as db:
        write(db)


def _recent(raw: Any, rate: float, samples: int) -> list[float]:
    """A row's kept samples (a row older than schema 6 kept its average alone)."""
    if raw is not None:
        try:
            got = msgpack.unpackb(bytes(raw), raw=False)
            if isinstance(got, list):
                return [float(r) for r in got if isinstance(r, (int, float))]
        except Exception:  # a damaged list: start again from the row's average
            pass
    return [rate] if samples > 0 else []


def _record(
    db: Any, *, machine: str, what: str, key: str, bucket: int, rate: float, at: float
) -> None:
    where = [machine, what, key, bucket]
    row = db.execute(
        "SELECT rate, samples, recent FROM rates "
        "WHERE machine = ? AND what = ? AND key = ? AND bucket = ?",
        where,
    ).fetchone()
    kept = [] if row is None else _recent(row[2], float(row[0]), int(row[1]))
    kept = [*kept, rate][-recompute.KEEP_SAMPLES :]
    est = recompute.rate_of(kept)
    assert est is not None
    n = 1 if row is None else int(row[1]) + 1
    db.execute(
        "INSERT OR REPLACE INTO rates(machine, what, key, bucket, rate, samples, updated, "
        "recent) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        [*where, est.typical, n, at, msgpack.packb(kept)],
    )


class Samples(NamedTuple):
    """A bucket's latest samples (per second) and when the newest was taken."""

    values: list[float]
    updated: float


def samples(index: Index, machine: str, what: str, key: str) -> dict[int, Samples]:
    """Bucket -> its latest samples measured here for ``what``/``key``."""
    with index.read() as db:
        got = db.execute(
            "SELECT bucket, rate, samples, updated, recent FROM rates "
            "WHERE machine = ? AND what = ? AND key = ?",
            [machine, what, key],
        ).fetchall()
    return {int(b): Samples(_recent(raw, float(r), int(n)), float(u)) for b, r, n, u, raw in got}


def samples_by_key(index: Index, machine: str, what: str) -> dict[str, dict[int, Samples]]:
    """Key (a tier, for "restore") -> bucket -> its latest samples measured here."""
    with index.read() as db:
        got = db.execute(
            "SELECT key, bucket, rate, samples, updated, recent FROM rates "
            "WHERE machine = ? AND what = ?",
            [machine, what],
        ).fetchall()
    out: dict[str, dict[int, Samples]] = {}
    for k, b, r, n, u, raw in got:
        out.setdefault(str(k), {})[int(b)] = Samples(_recent(raw, float(r), int(n)), float(u))
    return out


def rates(index: Index, machine: str, what: str, key: str) -> dict[int, float]:
    """Bucket -> the median rate per second measured here for ``what``/``key``."""
    out = {}
    for b, s in samples(index, machine, what, key).items():
        est = recompute.rate_of(s.values)
        if est is not None:
            out[b] = est.typical
    return out


def reset(index: Index, machine: str | None = None) -> int:
    """Forget the measured rates (of ``machine`` only, if given); how many went."""
    sql, args = "DELETE FROM rates", []
    if machine is not None:
        sql, args = sql + " WHERE machine = ?", [machine]
    with index.write() as db:
        return int(db.execute(sql, args).rowcount)


def all_rates(index: Index) -> list[dict[str, Any]]:
    """Every rate kept: its median (``rate``), runs ever measured (``samples``) and
    the latest runs (``recent``) its estimate is read from."""
    with index.read() as db:
        got = db.execute(
            "SELECT machine, what, key, bucket, rate, samples, recent FROM rates "
            "ORDER BY machine, what, key, bucket"
        ).fetchall()
    cols = ("machine", "what", "key", "bucket", "rate", "samples")
    return [
        {**dict(zip(cols, r[:6], strict=True)), "recent": _recent(r[6], float(r[4]), int(r[5]))}
        for r in got
    ]


def note_decision(index: Index, namespace: str, body: dict[str, Any]) -> None:
    """Keep a decision (the latest KEEP_DECISIONS per namespace); dropped on a full disk."""
    packed = msgpack.packb(body, use_bin_type=True)
    _write(index, functools.partial(_note, namespace=namespace, at=time.time(), body=packed))


def _note(db: Any, *, namespace: str, at: float, body: bytes) -> None:
    db.execute(
        "INSERT INTO decisions(namespace, at, body) VALUES (?, ?, ?)",
        [namespace, at, body],
    )
    db.execute(
        "DELETE FROM decisions WHERE namespace = ? AND id NOT IN "
        "(SELECT id FROM decisions WHERE namespace = ? ORDER BY id DESC LIMIT ?)",
        [namespace, namespace, KEEP_DECISIONS],
    )


def decisions(index: Index, namespace: str | None = None, limit: int = 5) -> list[dict[str, Any]]:
    """The latest decisions, newest first."""
    sql, args = "SELECT namespace, at, body FROM decisions", []
    if namespace is not None:
        sql += " WHERE namespace = ?"
        args.append(namespace)
    with index.read() as db:
        got = db.execute(sql + " ORDER BY id DESC LIMIT ?", [*args, limit]).fetchall()
    out = []
    for ns, at, body in got:
        try:
            d = msgpack.unpackb(bytes(body), raw=False)
        except Exception:  # a damaged row is not worth an error in stats
            continue
        if isinstance(d, dict):
            out.append({"namespace": ns, "at": at, **d})
    return out


_PATH = "data_path:"  # meta key prefix: the data path a machine's processes chose


def note_path(index: Index, machine: str, text: str) -> None:
    """Keep the data path (``cuda/pinned.data_path``) a process on ``machine`` took;
    dropped on a full disk."""
    _write(index, functools.partial(_note_path, machine=machine, text=text))


def _note_path(db: Any, *, machine: str, text: str) -> None:
    db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", [_PATH + machine, text])


def paths(index: Index) -> dict[str, str]:
    """Machine -> the data path its latest process took, in words."""
    with index.read() as db:
        got = db.execute(
            "SELECT key, value FROM meta WHERE key LIKE ? ORDER BY key", [_PATH + "%"]
        ).fetchall()
    return {str(k)[len(_PATH) :]: str(v) for k, v in got}
