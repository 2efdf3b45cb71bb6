"""The SQLite index: schema, migrations, connection settings.  No mlx here.

Schema version 7.  Each migration is a list of statements applied in one
transaction, then its Python step if it has one (a backfill);
``meta.schema_version`` records where a store is.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import CorruptBlobError, InvalidArgumentError, UnsupportedVersionError
from ..format.opening import file_kind
from .full import disk_full_error, full_disk
from .index import corruption_is_typed, end_transaction
from .lost import damaged_index, lost_index

if TYPE_CHECKING:
    import sqlite_utils
    from sqlite_utils import Database as _DatabaseBase
else:
    _DatabaseBase = object

__all__ = ["SCHEMA_VERSION", "connect", "Database"]

SCHEMA_VERSION = 8
JOURNAL_LIMIT = 4 << 20  # bytes of write-ahead log kept once it is reset

MIGRATIONS: dict[int, list[str]] = {
    1: [
        """CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)""",
        """CREATE TABLE namespaces (
            name TEXT PRIMARY KEY,
            secret BLOB NOT NULL
        )""",
        # A blob file: a token block or a snapshot tail.  'key' is its content
        # key (namespace-salted); 'file' the file name, unique per writer.
        """CREATE TABLE blobs (
            file TEXT PRIMARY KEY,
            key TEXT NOT NULL,
            namespace TEXT NOT NULL,
            size INTEGER NOT NULL,
            head_xxh3 BLOB NOT NULL,
            refs INTEGER NOT NULL DEFAULT 0,
            dead INTEGER NOT NULL DEFAULT 0,
            created REAL NOT NULL
        )""",
        """CREATE INDEX blobs_key ON blobs(key) WHERE dead = 0""",
        """CREATE INDEX blobs_dead ON blobs(dead, refs)""",
        """CREATE TABLE snapshots (
            id INTEGER PRIMARY KEY,
            namespace TEXT NOT NULL,
            name TEXT,
            owner TEXT,
            role TEXT NOT NULL,
            identity TEXT NOT NULL,
            identity_map BLOB NOT NULL,
            root BLOB NOT NULL,
            last_chain BLOB NOT NULL,
            n_blocks INTEGER NOT NULL,
            n_tokens INTEGER NOT NULL,
            tokens BLOB NOT NULL,
            trimmable INTEGER NOT NULL,
            min_resume INTEGER NOT NULL,
            manifest BLOB NOT NULL,
            tail TEXT NOT NULL REFERENCES blobs(file),
            bytes INTEGER NOT NULL,
            pinned INTEGER NOT NULL DEFAULT 0,
            created REAL NOT NULL,
            used REAL NOT NULL,
            metadata BLOB NOT NULL,
            row_xxh3 BLOB NOT NULL
        )""",
        """CREATE UNIQUE INDEX snapshots_name ON snapshots(namespace, name)
           WHERE name IS NOT NULL""",
        """CREATE INDEX snapshots_last_chain ON snapshots(last_chain)""",
        """CREATE INDEX snapshots_owner ON snapshots(namespace, owner)""",
        """CREATE INDEX snapshots_used ON snapshots(used)""",
        """CREATE TABLE snapshot_blocks (
            snapshot INTEGER NOT NULL REFERENCES snapshots(id) ON DELETE CASCADE,
            idx INTEGER NOT NULL,
            chain BLOB NOT NULL,
            blob TEXT REFERENCES blobs(file),
            PRIMARY KEY (snapshot, idx)
        )""",
        """CREATE INDEX snapshot_blocks_chain ON snapshot_blocks(chain, idx)""",
        # Saves in flight: their blob files carry this salt until the commit.
        """CREATE TABLE pending (
            salt TEXT PRIMARY KEY,
            pid INTEGER NOT NULL,
            created REAL NOT NULL
        )""",
        """CREATE TABLE counters (
            namespace TEXT NOT NULL,
            name TEXT NOT NULL,
            value INTEGER NOT NULL,
            PRIMARY KEY (namespace, name)
        )""",
    ],
    2: [
        # Head keys: for each block boundary b of a snapshot that at least
        # HEAD_TOKENS tokens follow, the key of those tokens under chain b.
        # They find prefixes that end inside a block (token-exact hits).
        """CREATE TABLE heads (
            snapshot INTEGER NOT NULL REFERENCES snapshots(id) ON DELETE CASCADE,
            pos INTEGER NOT NULL,
            key BLOB NOT NULL,
            PRIMARY KEY (snapshot, pos)
        )""",
        """CREATE INDEX heads_key ON heads(key)""",
        # Live bytes per namespace, kept by triggers on every change of a blob's
        # liveness: budgets are checked without scanning blobs or blocks.
        """CREATE TABLE usage (namespace TEXT PRIMARY KEY, bytes INTEGER NOT NULL)""",
        """INSERT INTO usage(namespace, bytes)
           SELECT namespace, SUM(size) FROM blobs WHERE dead = 0 GROUP BY namespace""",
        """CREATE TRIGGER usage_insert AFTER INSERT ON blobs WHEN NEW.dead = 0 BEGIN
             INSERT INTO usage(namespace, bytes) VALUES (NEW.namespace, NEW.size)
             ON CONFLICT(namespace) DO UPDATE SET bytes = bytes + NEW.size;
           END""",
        """CREATE TRIGGER usage_update AFTER UPDATE OF dead ON blobs
           WHEN OLD.dead != NEW.dead BEGIN
             INSERT INTO usage(namespace, bytes)
             VALUES (NEW.namespace, CASE WHEN NEW.dead = 0 THEN NEW.size ELSE -NEW.size END)
             ON CONFLICT(namespace) DO UPDATE SET bytes = bytes + excluded.bytes;
           END""",
        """CREATE TRIGGER usage_delete AFTER DELETE ON blobs WHEN OLD.dead = 0 BEGIN
             UPDATE usage SET bytes = bytes - OLD.size WHERE namespace = OLD.namespace;
           END""",
        """CREATE INDEX snapshots_ns_used ON snapshots(namespace, used)""",
        # Covering indexes: lookups rank candidates without reading their rows
        # (a token list is overflow pages, and the columns after it need them).
        # (last_chain, namespace, identity) then the ranking order: one chain's
        # candidates come out longest first and the walk stops at the limit.
        """CREATE INDEX snapshots_ends ON snapshots(
            last_chain, namespace, identity, n_tokens, used, trimmable, min_resume)""",
        """CREATE INDEX snapshots_facts ON snapshots(
            id, namespace, identity, trimmable, n_tokens, n_blocks, min_resume, used)""",
        # more = 1: the snapshot has blocks past this one.  Lookups find the
        # snapshots that go on past a prompt's matched blocks from this index alone.
        """ALTER TABLE snapshot_blocks ADD COLUMN more INTEGER NOT NULL DEFAULT 0""",
        """UPDATE snapshot_blocks SET more = 1 WHERE idx + 1 <
           (SELECT n_blocks FROM snapshots WHERE id = snapshot_blocks.snapshot)""",
        """CREATE INDEX snapshot_blocks_more ON snapshot_blocks(chain, idx, more)""",
        # Snapshot ids are never reused (a stale check must not hit a new row).
        """INSERT OR IGNORE INTO meta(key, value)
           SELECT 'last_snapshot_id', CAST(COALESCE(MAX(id), 0) AS TEXT) FROM snapshots""",
    ],
    3: [
        # Measured speeds for the restore-or-recompute decision (persist.storage.rates):
        # per machine, what ("restore" per tier, "prefill" per model), power-of-two bucket.
        """CREATE TABLE rates (
            machine TEXT NOT NULL,
            what TEXT NOT NULL,
            key TEXT NOT NULL,
            bucket INTEGER NOT NULL,
            rate REAL NOT NULL,
            samples INTEGER NOT NULL,
            updated REAL NOT NULL,
            PRIMARY KEY (machine, what, key, bucket)
        )""",
        # The latest decisions, for persist stats (a bounded ring per namespace).
        """CREATE TABLE decisions (
            id INTEGER PRIMARY KEY,
            namespace TEXT NOT NULL,
            at REAL NOT NULL,
            body BLOB NOT NULL
        )""",
        """CREATE INDEX decisions_ns ON decisions(namespace, id)""",
    ],
    4: [
        # Lookup keys (persist.storage.keys), big-endian tokens so that they sort as
        # token lists: a snapshot's tokens after its last block boundary under the
        # chain before them, and each full block some trimmable snapshot holds.
        """CREATE TABLE tails (
            anchor BLOB NOT NULL,
            trimmable INTEGER NOT NULL,
            rest BLOB NOT NULL,
            snapshot INTEGER NOT NULL,
            min_resume INTEGER NOT NULL,
            PRIMARY KEY (anchor, trimmable, rest, snapshot)
        ) WITHOUT ROWID""",
        """CREATE TABLE block_keys (
            anchor BLOB NOT NULL,
            rest BLOB NOT NULL,
            users INTEGER NOT NULL,
            PRIMARY KEY (anchor, rest)
        ) WITHOUT ROWID""",
        # What the keys replace: 16-token head keys, and the candidate rankings
        # that had to bound how many snapshots sharing one compete.
        """DROP TABLE heads""",
        """DROP INDEX snapshots_ends""",
        """DROP INDEX snapshots_facts""",
        """DROP INDEX snapshots_last_chain""",
        """DROP INDEX snapshot_blocks_more""",
        """DROP INDEX snapshots_ns_used""",
        # The oldest unpinned entry in one seek, however many are pinned (eviction).
        """CREATE INDEX snapshots_lru ON snapshots(pinned, used)""",
        """CREATE INDEX snapshots_ns_lru ON snapshots(namespace, pinned, used)""",
        # persist ls --sort size streams; its line about hidden entries counts an index.
        """CREATE INDEX snapshots_bytes ON snapshots(bytes)""",
        """CREATE INDEX snapshots_unnamed ON snapshots(namespace, role) WHERE name IS NULL""",
    ],
    5: [
        # Statistics and name prefixes from an index alone (a row is overflow pages:
        # reading 100,000 of them took persist stats 4.4 s): entries, sessions and bytes
        # are counted over it, and ls --prefix --sort used|size orders a name (or, for
        # checkpoints, owner) range by it, reading only the rows it lists.
        """CREATE INDEX snapshots_tally ON snapshots(namespace, name, owner, used, bytes)""",
        # The latest version (save time) of each named session this store saw on a
        # tier or wrote there: an older record of it is a replay, refused.
        """CREATE TABLE tier_seen (
            namespace TEXT NOT NULL,
            name TEXT NOT NULL,
            created REAL NOT NULL,
            PRIMARY KEY (namespace, name)
        ) WITHOUT ROWID""",
    ],
    6: [
        # The latest samples of each rate (msgpack list of per-second figures): an
        # estimate is their median, never one run (persist.storage.rates).
        """ALTER TABLE rates ADD COLUMN recent BLOB""",
    ],
    7: [
        # Retention hints (policy.eviction_key): a ttl protects an entry for that long
        # after its last use, a priority orders it.  Few rows: eviction reads them all,
        # and the unhinted rest through snapshots_lru as before.
        """CREATE TABLE retention_hints (
            snapshot INTEGER PRIMARY KEY,
            ttl REAL NOT NULL,
            priority INTEGER NOT NULL
        )""",
    ],
    8: [
        # The latest version of each name this store's own history of it continues
        # (pushed under the name or pulled): a push may replace up to it.  A local delete
        # clears it and keeps `created` (the replay floor): the next history under the
        # name is a new one, kept beside the fleet's, and older versions stay refused.
        """ALTER TABLE tier_seen ADD COLUMN base REAL""",
        """UPDATE tier_seen SET base = created""",
    ],
}


def _backfill_keys(db: sqlite_utils.Database) -> None:
    """The lookup keys of every snapshot a version 3 (or older) store holds."""
    from ..format.tokens import unpack_tokens
    from . import keys

    store_block = int(db.execute("SELECT value FROM meta WHERE key = 'block_tokens'").fetchone()[0])
    rows = db.execute("SELECT id, root, tokens, trimmable, min_resume, manifest FROM snapshots")
    for sid, root, raw, trimmable, floor, manifest in rows.fetchall():
        block = keys.block_of(bytes(manifest), store_block)
        chs = [bytes(root)] + [
            bytes(r[0])
            for r in db.execute(
                "SELECT chain FROM snapshot_blocks WHERE snapshot = ? ORDER BY idx", [sid]
            )
        ]
        toks = unpack_tokens(bytes(raw))
        if len(chs) == len(toks) // block + 1:  # else damaged: check reports the row
            keys.add(
                db,
                sid,
                chains=chs,
                tokens=toks,
                block=block,
                trimmable=bool(trimmable),
                min_resume=int(floor),
            )


BACKFILLS = {4: _backfill_keys}


class Database(_DatabaseBase):
    """The part of ``sqlite_utils.Database`` the store uses (``conn``, ``execute``,
    ``table_names``) over a plain connection.

    Importing sqlite_utils costs about 0.25 s (it pulls in numpy), more than
    the rest of ``persist ls``: a store whose schema is current is opened with
    this instead, and sqlite_utils is imported only for schema work
    (creating, migrating).  To the type checker it is a ``sqlite_utils.Database``,
    so the store's functions take either."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def execute(self, sql: str, parameters: Any = None) -> sqlite3.Cursor:
        if parameters is None:
            return self.conn.execute(sql)
        return self.conn.execute(sql, parameters)

    def table_names(self, fts4: bool = False, fts5: bool = False) -> list[str]:
        rows = self.conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        return [r[0] for r in rows]


def connect(path: Path, block_tokens: int, *, adopt: bool = False) -> sqlite_utils.Database:
    """Open (creating and migrating) the index at ``path``.

    A new store records ``block_tokens``; an existing one keeps its own, and
    asking for another is an error unless ``adopt`` (the caller did not ask).
    """
    for p in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        try:
            mode = p.lstat().st_mode
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(mode):  # a dangling one would make SQLite create its target
            raise CorruptBlobError(str(p), "is a symbolic link; persist never follows links")
        if not stat.S_ISREG(mode):  # SQLite would wait forever reading a FIFO
            raise CorruptBlobError(str(p), f"is {file_kind(mode)}, not the store's index file")
    if not path.exists():  # created private; SQLite gives -wal/-shm the same mode
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        with contextlib.suppress(FileExistsError):
            os.close(os.open(path, flags, 0o600))
    try:
        conn = sqlite3.connect(str(path), timeout=60, isolation_level=None, check_same_thread=False)
        # A flipped byte in a text column reads as U+FFFD instead of failing the whole
        # query: listings show the row (check's row checksum finds the damage).
        conn.text_factory = lambda b: b.decode("utf-8", "replace")
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("PRAGMA foreign_keys=ON")
        conn.execute("PRAGMA busy_timeout=60000")
        # a log that grew (a long reader held it) is cut back to this when next reset
        conn.execute(f"PRAGMA journal_size_limit={JOURNAL_LIMIT}")
    except sqlite3.DatabaseError as e:
        if full_disk(e, path.parent):
            raise disk_full_error(path.parent, e) from None
        raise damaged_index(path, f"the index is not a usable SQLite file: {e}") from None

    light = Database(conn)
    try:
        with corruption_is_typed():
            if _ready(light, block_tokens, adopt):  # no schema work: no lock, no sqlite_utils
                return light
            import sqlite_utils  # imported here: it pulls in click, which `import persist` must not

            db = sqlite_utils.Database(conn)
            lost = lost_index(path) if _version(db) == 0 else None
            if lost is None:
                _migrate(db, path)
                _check_block_tokens(db, block_tokens, path, adopt)
    except CorruptBlobError as e:
        conn.close()
        raise damaged_index(path, e.detail) from None
    except BaseException:
        conn.close()
        raise
    if lost is not None:
        conn.close()
        raise lost
    return db


def _ready(db: Database, block_tokens: int, adopt: bool) -> bool:
    """The schema is current and the block size recorded and accepted (read, not locked)."""
    if "meta" not in db.table_names():
        return False
    rows = dict(
        db.execute(
            "SELECT key, value FROM meta WHERE key IN ('schema_version', 'block_tokens')"
        ).fetchall()
    )
    if rows.get("schema_version") != str(SCHEMA_VERSION) or "block_tokens" not in rows:
        return False  # the locked path migrates, or raises UnsupportedVersionError
    size = str(rows["block_tokens"])
    if not size.isdigit() or int(size) <= 0:
        return False  # damaged: the locked path says so (_check_block_tokens)
    return adopt or int(size) == block_tokens


def _version(db: sqlite_utils.Database) -> int:
    if "meta" not in db.table_names():
        return 0
    row = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    return int(row[0]) if row else 0


def _migrate(db: sqlite_utils.Database, path: Path) -> None:
    try:
        db.execute("BEGIN IMMEDIATE")
        version = _version(db)
        if version > SCHEMA_VERSION:
            raise UnsupportedVersionError("store-index", version, SCHEMA_VERSION)
        for v in range(version + 1, SCHEMA_VERSION + 1):
            for stmt in MIGRATIONS[v]:
                db.execute(stmt)
            if v in BACKFILLS and version > 0:  # a new store has nothing to fill
                BACKFILLS[v](db)
            db.execute(
                "INSERT OR REPLACE INTO meta(key, value) VALUES ('schema_version', ?)", [str(v)]
            )
        db.execute("COMMIT")
    except BaseException:
        end_transaction(db, "ROLLBACK")
        raise


def _check_block_tokens(
    db: sqlite_utils.Database, block_tokens: int, path: Path, adopt: bool
) -> None:
    try:
        db.execute("BEGIN IMMEDIATE")
        row = db.execute("SELECT value FROM meta WHERE key = 'block_tokens'").fetchone()
        if row is None:
            db.execute(
                "INSERT INTO meta(key, value) VALUES ('block_tokens', ?)", [str(block_tokens)]
            )
        elif not str(row[0]).isdigit() or int(row[0]) <= 0:  # isdigit: ASCII digits only
            raise CorruptBlobError(
                str(path), f"its block size {str(row[0])[:40]!r} is not a positive number"
            )
        elif int(row[0]) != block_tokens and not adopt:
            raise InvalidArgumentError(
                f"store {path.parent} uses blocks of {row[0]} tokens, not {block_tokens}"
            )
        db.execute("COMMIT")
    except BaseException:
        end_transaction(db, "ROLLBACK")
        raise
