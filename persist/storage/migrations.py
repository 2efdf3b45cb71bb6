"""The index's schema by version: each migration's statements and backfills.

Each migration is a list of statements applied in one transaction, then its
Python step if it has one (a backfill); ``meta.schema_version`` records where
a store is.  ``schema.connect`` applies them; this module only lists them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import sqlite_utils

__all__ = ["SCHEMA_VERSION", "MIGRATIONS", "BACKFILLS"]

SCHEMA_VERSION = 8

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
