"""The log lines of ``persist serve`` an operator reads: what it runs with, what it did.

``--log-format json`` writes one JSON object a line (time, level, logger,
message, and the traceback if any) for log shippers; the default is
mlx-lm's ``time - LEVEL - message``.  The start line names the store, its
budget, the tiers and that persistence is on; the stop line summarises the
run in words (``ServeMetrics.summary``).  Tier URLs are logged without
their passwords.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from ..engine.tiers.lineage import shown_url

__all__ = ["JsonFormatter", "use_log_format", "start_line", "stop_line", "redact"]


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ts (RFC 3339, UTC), level, logger, message[, exc]."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def use_log_format(fmt: str) -> None:
    """Put ``fmt`` ('text' or 'json') on the root logger's handlers (mlx-lm's basicConfig)."""
    if fmt != "json":
        return
    root = logging.getLogger()
    if not root.handlers:  # mlx-lm configures logging first; without it, a handler of our own
        root.addHandler(logging.StreamHandler())
    for h in root.handlers:
        h.setFormatter(JsonFormatter())


def redact(url: str | None) -> str:
    """A tier URL without its user and password (``remote/urls.shown_url``), or "off"."""
    return shown_url(url) if url else "off"


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def start_line(
    store: Any,
    namespace: str,
    *,
    shared: str | None,
    cold: str | None,
    queue: int,
    when_full: str,
    host: Any = None,
) -> str:
    """'persistence on: store /path (12 entries, 3.4 MiB of 20.0 GiB), namespace ..., ...,
    host cache 8.0 GiB in pinned host memory' (``host``: the HostTier, or None: off)."""
    st = store.stats()
    budget = store.budgets.max_bytes
    of = f" of {_size(budget)}" if budget is not None else ", no budget"
    ram = f"{_size(host.max_bytes)} in {host.where}" if host is not None else "off"
    return (
        f"persist serve: persistence on: store {store.root} ({st.entries} entries, "
        f"{_size(st.unique_bytes)}{of}), namespace {namespace!r}, "
        f"shared tier {redact(shared)}, cold tier {redact(cold)}, "
        f"write-behind queue {queue} ({when_full} when full), host cache {ram}"
    )


def stop_line(summary: str, store: Any) -> str:
    """'persist serve: stopped, up 2m13s, 48 requests; ...; store: 24 entries, 3.4 MiB'."""
    try:
        st = store.stats()
        budget = store.budgets.max_bytes
        of = f" of {_size(budget)}" if budget is not None else ""
        held = f"store: {st.entries} entries, {_size(st.unique_bytes)}{of}"
    except Exception as e:  # the summary never hides why the server stopped
        held = f"store: unreadable ({e})"
    return f"persist serve: stopped, {summary}; {held}"
