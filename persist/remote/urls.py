"""A tier's URL as messages show it: without its credentials
(``redis://user:PASSWORD@host`` -> ``redis://***@host``), so no log line, error or
report of persist's carries a password.  No mlx."""

from __future__ import annotations

__all__ = ["shown_url"]


def shown_url(url: str) -> str:
    """A tier's URL without its credentials, for messages: everything between the
    scheme and the last ``@`` goes (a password may hold ``/``, ``,`` or ``@``; a
    cluster URL has them before its first host only)."""
    scheme, sep, rest = url.partition("://")
    _, at, hosts = rest.rpartition("@")
    return f"{scheme}{sep}{'***@' if at else ''}{hosts}"
