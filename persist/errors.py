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
    "SessionDeletedError",
    "StoreFullError",
    "HostCacheFullError",
    "InvalidNameError",
    "InvalidTokensError",
    "IdentityUnavailableError",
    "AlreadyExistsError",
    "UnsupportedCacheError",
    "UnsupportedFormatError",
    "InvalidArgumentError",
    "InvalidMetadataError",
    "InvalidStateError",
    "BlockSizeMismatchError",
    "StoreBusyError",
    "SaveLostError",
    "UnsafeStoreError",
    "UnauthenticatedFileError",
    "ReadOnlyStoreError",
    "SessionConflictError",
    "SessionUnreachableError",
    "SessionUnreadableError",
    "StorageError",
    "StoreNotFoundError",
    "ModelNotFoundError",
    "AccessDeniedError",
]


class PersistError(Exception):
    """Root of every error persist raises on purpose."""


class UnknownKindError(PersistError, ValueError):
    """A cache class or a stored kind string that this process has no codec for."""

    def __init__(self, kind: str, detail: str = "") -> None:
        self.kind = kind
        msg = f"unknown cache kind {kind!r}"
        super().__init__(f"{msg}: {detail}" if detail else msg)


class UnsupportedVersionError(PersistError, ValueError):
    """A record, file or store index written by a newer persist than this one.

    ``what`` names the versioned thing: a cache kind, ``persist-file`` or
    ``store-index``.  Not an unknown kind: upgrading persist fixes it.
    """

    def __init__(self, what: str, version: int, known: int) -> None:
        self.what = what
        self.kind = what  # the name round 1 gave it
        self.version = version
        self.known = known
        super().__init__(
            f"{what!r} was written by version {version}, this persist reads up to "
            f"{known}; upgrade persist to read it"
        )


class UnsupportedFormatError(PersistError, ValueError):
    """A valid file of another format (an mlx-lm prompt cache) where a persist file was
    expected, or a format name persist does not write; the message names what to run."""


class UnsupportedCacheError(PersistError, TypeError):
    """A cache persist cannot store: not a cache list, or an array dtype the format lacks."""


class InvalidArgumentError(PersistError, ValueError):
    """A parameter persist cannot use (out of range, contradictory, empty)."""


class InvalidMetadataError(PersistError, TypeError):
    """An argument of a type persist cannot use: metadata that is not a map of
    strings to strings (or larger than the format allows), a cache
    configuration that is not a non-negative int."""


class InvalidStateError(PersistError, RuntimeError):
    """An operation out of order: a closed Store, a speculative round not armed."""


class SessionConflictError(PersistError, RuntimeError):
    """A save of a session that changed since the version the caller read (``if_version``)."""

    def __init__(self, session: str, namespace: str, expected: int, found: int) -> None:
        self.session, self.namespace = session, namespace
        self.expected, self.found = expected, found
        was = f"version {expected}" if expected else "no session"
        now = f"version {found}" if found else "no session"
        super().__init__(
            f"session {session!r} in namespace {namespace!r} changed while it was in use "
            f"(expected {was}, found {now}); nothing was saved"
        )


class BlockSizeMismatchError(PersistError, ValueError):
    """A shared tier whose namespace is cut in blocks of another size than this store's:
    their prefix lookups would never find each other's snapshots, so it is refused."""

    def __init__(self, tier: int, store: int, detail: str) -> None:
        self.tier, self.store = tier, store
        super().__init__(detail)


class StoreBusyError(PersistError, RuntimeError):
    """Concurrent writers kept replacing what this operation needed, or held the
    store's index locked past the wait; retrying may succeed."""


class SaveLostError(PersistError, RuntimeError):
    """A save whose in-flight files or registration were removed before it committed
    (a ``persist check --fix`` that could not see its lease); nothing was saved."""

    def __init__(self, why: str) -> None:
        super().__init__(
            f"the save was not committed: {why} while it ran (a check or repair from "
            "another machine or an older persist?); nothing was saved, save again"
        )


class UnsafeStoreError(PersistError, PermissionError):
    """A store folder or index another user owns or can write: refused, as ssh
    refuses such a ~/.ssh (they could plant sessions), with the command that fixes it."""

    def __init__(self, path: object, why: str, fix: str) -> None:
        self.path = path
        super().__init__(f"refusing the store: {path} {why}; {fix}")

    def __str__(self) -> str:
        return str(self.args[0])


class ReadOnlyStoreError(PersistError, PermissionError):
    """A write to a store opened read-only (a read-only mount, files without write access)."""

    def __init__(self, root: object, detail: str = "") -> None:
        self.root = root
        super().__init__(
            f"the store at {root} is read-only: "
            + (
                detail
                or "ls, show, inspect, export and restore work; saving, deleting "
                "and repairs need write access"
            )
        )

    def __str__(self) -> str:
        return str(self.args[0])


class AccessDeniedError(PersistError, PermissionError):
    """A request to ``persist serve`` without a valid API key (or tenant header) where
    one is required: answered 401 (``serve.tenants``)."""


class StorageError(PersistError, OSError):
    """The system refused a file operation (permissions, a missing folder, I/O)."""

    def __init__(self, what: str, error: OSError) -> None:
        where = f" {error.filename}" if getattr(error, "filename", None) else ""
        super().__init__(error.errno, f"{what}: {error.strerror or error}{where}")
        self.error = error

    def __str__(self) -> str:
        return str(self.args[1])


class IdentityMismatchError(PersistError, ValueError):
    """A session saved under one model identity restored under another."""

    def __init__(self, what: str, fields: Sequence[str], saved: str = "", given: str = "") -> None:
        self.fields = list(fields)
        self.saved, self.given = saved, given
        models = f" ({saved}; this is {given})" if saved and given else ""
        super().__init__(
            f"{what} was saved for another model{models}: fields that differ: "
            + ", ".join(self.fields)
        )


class CorruptBlobError(PersistError, ValueError):
    """Stored bytes that fail validation or their checksum; never half-loaded."""

    def __init__(self, where: str, detail: str) -> None:
        self.where = where
        self.detail = detail
        super().__init__(f"{where}: {detail}")


class UnauthenticatedFileError(PersistError, PermissionError):
    """A persist file imported under the operator key (``PERSIST_TIER_KEY``) without
    that key's valid tag: changed after its export, exported without the key or under
    another one (``engine.file_tags``).  Nothing is stored."""

    def __init__(self, where: str, detail: str) -> None:
        self.where = where
        super().__init__(f"refusing {where}: {detail}")

    def __str__(self) -> str:
        return str(self.args[0])


class NotResumableError(PersistError, ValueError):
    """A cache that cannot be saved or resumed in its current state."""


class SessionNotFoundError(PersistError, KeyError):
    """No session of that name in that namespace."""

    def __init__(self, session: str, namespace: str, hint: str = "") -> None:
        self.session = session
        self.namespace = namespace
        why = f" ({hint})" if hint else ""
        super().__init__(f"no session {session!r} in namespace {namespace!r}{why}")

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


class SessionDeletedError(SessionNotFoundError):
    """No session of that name here, and a fleet delete's tombstone under it on a tier
    (``tiers``): deleted already.  ``persist rm --fleet`` says so and exits 0, so a
    re-run after a partial failure is idempotent (attack 38d, finding F)."""

    def __init__(self, session: str, namespace: str, tiers: list[str]) -> None:
        self.session, self.namespace, self.tiers = session, namespace, tiers
        KeyError.__init__(
            self,
            f"session {session!r} in namespace {namespace!r} was already deleted on the "
            f"fleet (a tombstone on the {' and '.join(tiers)} tier)",
        )


class InvalidNameError(PersistError, ValueError):
    """A session or namespace name that cannot be a key (empty, huge, NUL)."""


class InvalidTokensError(PersistError, ValueError):
    """Token ids that are not integers in [0, 2**32)."""


class IdentityUnavailableError(PersistError, ValueError):
    """A model whose configuration cannot be found, so no identity can vouch for its caches."""


class AlreadyExistsError(PersistError, FileExistsError):
    """A file or session that a command would replace without being told to (``--force``)."""


class ExportTargetError(PersistError, ValueError):
    """A path an export will not write: inside the store's folder (its index, its blobs),
    or something there that is not a regular file (a FIFO, a device, a folder, a
    socket, a symbolic link).  --force replaces a regular file only."""

    def __init__(self, path: object, why: str) -> None:
        self.path = path
        super().__init__(f"{path}: {why}; export writes a regular file, nothing was written")


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


class HostCacheFullError(PersistError, MemoryError):
    """The host tier's pages cannot hold an entry now: its budget is taken, or the
    system refused more page-locked memory (the tier evicts and asks again)."""


class StoreNotFoundError(PersistError, FileNotFoundError):
    """A command that only reads or tidies a store was pointed at a folder with none."""

    def __init__(self, root: object) -> None:
        self.root = root
        super().__init__(f"no store at {root} (persist generate, prime and import create one)")

    def __str__(self) -> str:  # OSError formats a one-argument message as is; keep it so
        return str(self.args[0])


class ModelNotFoundError(PersistError, FileNotFoundError):
    """A ``--model`` that is neither a model folder nor a Hugging Face repo persist can get."""

    def __str__(self) -> str:
        return str(self.args[0])


class SessionUnreachableError(PersistError, ConnectionError):
    """A named session this store does not hold, while a tier that may hold it could not
    be asked: continuing it would fork the fleet's history."""

    def __init__(self, session: str, namespace: str, tiers: list[str]) -> None:
        self.session, self.namespace, self.tiers = session, namespace, tiers
        super().__init__(
            f"session {session!r} is not in this store, and the {' and '.join(tiers)} "
            "that may hold it could not be asked; try again when it answers, or pass --new "
            "to start a new conversation (kept beside the fleet's, never over it)"
        )


class SessionUnreadableError(SessionUnreachableError):
    """A named session this store does not hold, while a tier names it but its values
    there cannot be read: another operator key (or none) tagged them, or the tier
    dropped part of them (a Redis LRU eviction, an expired record).  Continuing it
    would fork the fleet's history, as with a tier that cannot be asked."""

    def __init__(self, session: str, namespace: str, reasons: list[str]) -> None:
        self.session, self.namespace, self.tiers = session, namespace, reasons
        ConnectionError.__init__(
            self,
            f"session {session!r} is on the fleet, but this machine cannot read it: "
            f"{'; '.join(reasons)}; continuing it would fork the fleet's history: fix "
            "that (a key: the fleet's in $PERSIST_TIER_KEY or --tier-key-file), or pass "
            "--new to start a new conversation under the name on purpose",
        )
