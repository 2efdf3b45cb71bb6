"""The index's transactions: SQLite errors as typed ones, and a transaction
ended (COMMIT or ROLLBACK) even through Ctrl-Cs.  No mlx.

``Index.read``/``write`` and the schema's migrations run every statement
inside these; nothing else talks to SQLite's error classes.
"""

from __future__ import annotations

import contextlib
import errno
import sqlite3
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ..errors import CorruptBlobError, StorageError, StoreBusyError, StoreFullError
from .full import file_size_limit

if TYPE_CHECKING:
    import sqlite_utils

__all__ = ["corruption_is_typed", "end_transaction"]


@contextlib.contextmanager
def corruption_is_typed() -> Iterator[None]:
    """A damaged index file surfaces as CorruptBlobError, not as a raw sqlite3 error."""
    try:
        yield
    except sqlite3.OperationalError as e:
        if "decode to UTF-8" in str(e):  # a flipped byte inside a text column
            raise CorruptBlobError("index.sqlite", f"the index is damaged: {e}") from None
        if "database or disk is full" in str(e):  # SQLite could not grow its log or file
            raise StoreFullError(0, 0, f"the disk holding the store is full ({e})") from None
        limit = file_size_limit()
        if "disk I/O error" in str(e) and limit is not None:  # EFBIG past ulimit -f
            raise StoreFullError(
                0,
                0,
                f"the store's index could not grow: this process may write files of "
                f"{limit} bytes at most (ulimit -f), taken as a full disk ({e})",
            ) from None
        if "disk I/O error" in str(e):
            raise StorageError("the store's index", OSError(errno.EIO, str(e))) from None
        if "attempt to write a readonly database" in str(e):  # in a read: a read-only view
            raise StoreBusyError(  # of a store a writer elsewhere changed (attack r13c)
                f"SQLite could not follow the store's write-ahead log from this read-only "
                f"view while a writer elsewhere changed it ({e}); retry"
            ) from None
        if "database is locked" in str(e):  # another process held it past the busy timeout
            raise StoreBusyError(
                f"the store's index stayed locked by another process ({e}); retry later"
            ) from None
        raise  # other operational errors are not damage
    except (sqlite3.IntegrityError, sqlite3.ProgrammingError):
        raise  # bugs are not damage
    except sqlite3.DatabaseError as e:
        raise CorruptBlobError("index.sqlite", f"the index is damaged: {e}") from None


def end_transaction(db: sqlite_utils.Database, verb: str) -> None:
    """COMMIT or ROLLBACK the connection's transaction, if it is in one, even through
    Ctrl-Cs: an interrupt raised as the statement was about to run is caught and the
    statement tried again, then raised once the transaction is over.  The
    connection is asked, not a flag: BEGIN itself may have failed (a locked
    database) or been interrupted as it returned."""
    interrupted: KeyboardInterrupt | None = None
    while True:
        try:
            if db.conn.in_transaction:
                db.execute(verb)
            break
        except KeyboardInterrupt as e:
            interrupted = e
    if interrupted is not None:
        raise interrupted
