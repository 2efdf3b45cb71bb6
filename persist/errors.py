"""The error tree: one root, and each error also the builtin it resembles.

Callers catch ``PersistError`` for anything persist refuses; code that only
knows builtins still gets a ``ValueError``/``KeyError``/``OSError``.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "PersistError",
    "UnknownKindError",
    "UnsupportedVersionError",
    "IdentityMismatchError",
    "CorruptBlobError",
    "NotResumableError",
    "SessionNotFoundError",
    "StoreFullError",
    "InvalidNameError",
    "InvalidTokensError",
    "IdentityUnavailableError",
    "AlreadyExistsError",
]


class PersistError(Exception):
    """Root of every error persist raises on purpose."""


class UnknownKindError(PersistError, ValueError):
    """A cache class or a stored kind string that this process has no codec for."""

    def __init__(self, kind: str, detail: str = "") -> None:
        self.kind = kind
        msg = f"unknown cache kind {kind!r}"
        super().__init__(f"{msg}: {detail}" if detail else msg)


class UnsupportedVersionError(UnknownKindError):
    """A record written by a newer codec (or file format) than this code knows."""

    def __init__(self, kind: str, version: int, known: int) -> None:
        self.version = version
        self.known = known
        super().__init__(
            kind,
            f"written by codec version {version}, this persist reads up to "
            f"{known}; upgrade persist to read it",
        )


class IdentityMismatchError(PersistError, ValueError):
    """A session saved under one model identity restored under another."""

    def __init__(self, what: str, fields: Sequence[str]) -> None:
        self.fields = list(fields)
        super().__init__(
            f"{what} was saved for another model: fields that differ: " + ", ".join(self.fields)
        )


class CorruptBlobError(PersistError, ValueError):
    """Stored bytes that fail validation or their checksum; never half-loaded."""

    def __init__(self, where: str, detail: str) -> None:
        self.where = where
        self.detail = detail
        super().__init__(f"{where}: {detail}")


class NotResumableError(PersistError, ValueError):
    """A cache that cannot be saved or resumed in its current state."""


class SessionNotFoundError(PersistError, KeyError):
    """No session of that name in that namespace."""

    def __init__(self, session: str, namespace: str) -> None:
        self.session = session
        self.namespace = namespace
        super().__init__(f"no session {session!r} in namespace {namespace!r}")

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


class InvalidNameError(PersistError, ValueError):
    """A session or namespace name that cannot be a key (empty, huge, NUL)."""


class InvalidTokensError(PersistError, ValueError):
    """Token ids that are not integers in [0, 2**32)."""


class IdentityUnavailableError(PersistError, ValueError):
    """A model whose configuration cannot be found, so no identity can vouch for its caches."""


class AlreadyExistsError(PersistError, FileExistsError):
    """A file or session that a command would replace without being told to (``--force``)."""


class StoreFullError(PersistError, OSError):
    """A snapshot that cannot fit in the store's byte budget."""

    def __init__(self, needed: int, budget: int, detail: str = "") -> None:
        self.needed = needed
        self.budget = budget
        super().__init__(
            detail or f"snapshot needs {needed} bytes but the store budget is {budget} bytes"
        )

    def __str__(self) -> str:  # OSError formats multi-arg messages oddly
        return str(self.args[0])
