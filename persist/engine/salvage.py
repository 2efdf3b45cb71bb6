"""What ``check --fix`` keeps of a damaged trimmable session: its longest valid prefix.

The store layer (``persist.storage.check_damage``) finds the first damaged
block and asks for a cut; cutting rebuilds the cache from the valid blocks
(``loading.load_snapshot`` with ``keep``: only the blocks before the damage
and the tail's unsplit tensors are read, each verified) and saves it again
under the same name, which replaces the damaged row in one commit.  mlx is
imported only here, and only when a session is cut: ``check`` alone never
loads it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import msgpack

from ..errors import PersistError
from ..format.tokens import unpack_tokens

if TYPE_CHECKING:
    from ..storage import retention
    from ..storage.blobs import BlobStore
    from ..storage.index import Index, SnapshotRow

__all__ = ["cutter"]

log = logging.getLogger("persist")


def cutter(index: Index, blobs: BlobStore, block_tokens: int, budgets: retention.Budgets) -> Any:
    """A ``check_damage.Cutter`` that re-saves sessions into this index and these blobs."""

    def cut(row: SnapshotRow, keep: int) -> bool:
        from .loading import load_snapshot
        from .reading import saved_identity
        from .save_pipeline import captured
        from .saving import Target, write_and_commit

        try:
            cache = load_snapshot(index, blobs, row, keep=keep)
            meta = msgpack.unpackb(row.metadata, raw=False)
            assert row.name is not None
            target = Target(
                identity=saved_identity(row),
                namespace=row.namespace,
                name=row.name,
                role="session",
                pin=row.pinned,
                metadata=meta,
                if_version=row.id,  # a session saved again meanwhile is not cut back
            )
            snap = captured(cache, unpack_tokens(row.tokens)[:keep], target.identity)
            write_and_commit(index, blobs, snap, target, block_tokens=block_tokens, budgets=budgets)
        except PersistError as e:  # the valid part did not read back whole: no cut
            log.warning("persist: could not cut session %r to %d tokens: %s", row.name, keep, e)
            return False
        return True

    return cut
