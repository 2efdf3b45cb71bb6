"""A tier's URL as messages show it: without its credentials
(``redis://user:PASSWORD@host`` -> ``redis://***@host``), so no log line, error or
report of persist's carries a password.  No mlx."""

from __future__ import annotations

import re

__all__ = ["shown_url", "scrubbed"]


def shown_url(url: str) -> str:
    """A tier's URL without its credentials, for messages: everything between the
    scheme and the last ``@`` goes (a password may hold ``/``, ``,`` or ``@``; a
    cluster URL has them before its first host only)."""
    scheme, sep, rest = url.partition("://")
    _, at, hosts = rest.rpartition("@")
    for mark in "?#":  # a query or fragment may carry a password (?password=...)
        if mark in hosts:
            hosts = hosts.partition(mark)[0] + mark + "***"
    return f"{scheme}{sep}{'***@' if at else ''}{hosts}"


def scrubbed(text: str, url: str) -> str:
    """``text`` (a parser's message about ``url``) with every piece of the URL's
    credentials and query in it replaced by ``***``: urlparse splits a password
    holding ``/``, ``?``, ``#`` or ``,`` into host, path or query, and a message
    quotes those."""
    rest = url.partition("://")[2]
    creds, _, hosts = rest.rpartition("@")
    secret = creds + "".join(hosts.partition(m)[2] for m in "?#")
    pieces = sorted({p for p in re.split(r"[:/?#@,=&]", secret) if len(p) >= 3}, key=len)
    for piece in reversed(pieces):  # the longest first
        text = text.replace(piece, "***")
    return text
