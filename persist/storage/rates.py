"""Measured speeds and the latest restore-or-recompute decisions, in the index.  No mlx.

A rate is kept per machine (host name and MLX backend: a store on a shared
disk serves machines of different speeds), per what was measured ("restore"
keyed by tier, "prefill" keyed by model identity) and per power-of-two
bucket of the amount (``policy.rate_bucket``), as an exponential moving
average so that one noisy run moves it only part of the way.  Recording is
best effort: a read never fails because its statistics could not be written
(a full disk drops them, counted by ``full.dropped``).
"""

from __future__ import annotations

import platform
import time
from typing import Any

import msgpack

from .full import best_effort
from .index import Index

__all__ = [
    "machine_name",
    "record",
    "rates",
    "all_rates",
    "note_decision",
    "decisions",
    "note_path",
    "paths",
]

WEIGHT = 0.3  # of a new measurement in the moving average
KEEP_DECISIONS = 32  # per namespace, for persist stats


def machine_name(backend: str) -> str:
    """This machine as rates are keyed: ``host/backend`` ("gpu-7/cuda:NVIDIA H200")."""
    return f"{platform.node() or 'unknown'}/{backend or 'unknown'}"


def record(index: Index, machine: str, what: str, key: str, bucket: int, rate: float) -> None:
    """Fold one measured rate (per second) into the moving average of its bucket."""
    if not rate > 0 or rate == float("inf"):
        return
    best_effort(_record, index, machine, what, key, bucket, rate)


def _record(index: Index, machine: str, what: str, key: str, bucket: int, rate: float) -> None:
    with index.write() as db:
        db.execute(
            "INSERT INTO rates(machine, what, key, bucket, rate, samples, updated) "
            "VALUES (?, ?, ?, ?, ?, 1, ?) ON CONFLICT(machine, what, key, bucket) DO UPDATE "
            f"SET rate = rate * {1 - WEIGHT} + excluded.rate * {WEIGHT}, "
            "samples = samples + 1, updated = excluded.updated",
            [machine, what, key, bucket, rate, time.time()],
        )


def rates(index: Index, machine: str, what: str, key: str) -> dict[int, float]:
    """Bucket -> rate per second measured here for ``what``/``key``."""
    with index.read() as db:
        got = db.execute(
            "SELECT bucket, rate FROM rates WHERE machine = ? AND what = ? AND key = ?",
            [machine, what, key],
        ).fetchall()
    return {int(b): float(r) for b, r in got}


def all_rates(index: Index) -> list[dict[str, Any]]:
    with index.read() as db:
        got = db.execute(
            "SELECT machine, what, key, bucket, rate, samples FROM rates "
            "ORDER BY machine, what, key, bucket"
        ).fetchall()
    cols = ("machine", "what", "key", "bucket", "rate", "samples")
    return [dict(zip(cols, r, strict=True)) for r in got]


def note_decision(index: Index, namespace: str, body: dict[str, Any]) -> None:
    """Keep a decision (the latest KEEP_DECISIONS per namespace); dropped on a full disk."""
    best_effort(_note, index, namespace, body)


def _note(index: Index, namespace: str, body: dict[str, Any]) -> None:
    with index.write() as db:
        db.execute(
            "INSERT INTO decisions(namespace, at, body) VALUES (?, ?, ?)",
            [namespace, time.time(), msgpack.packb(body, use_bin_type=True)],
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
    best_effort(_note_path, index, machine, text)


def _note_path(index: Index, machine: str, text: str) -> None:
    with index.write() as db:
        db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", [_PATH + machine, text])


def paths(index: Index) -> dict[str, str]:
    """Machine -> the data path its latest process took, in words."""
    with index.read() as db:
        got = db.execute(
            "SELECT key, value FROM meta WHERE key LIKE ? ORDER BY key", [_PATH + "%"]
        ).fetchall()
    return {str(k)[len(_PATH) :]: str(v) for k, v in got}
