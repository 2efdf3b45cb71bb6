"""A save, as five steps in order, each one function:

1. ``validated``: everything that can be refused without reading the cache's
   bytes (a read-only store, names, an unverified mark carried over, the
   layer count, the fleet's agreement on the namespace);
2. ``captured``: every layer encoded into records and host bytes
   (``codecs.snapshot.capture``), then held against the identity's cache
   configuration (quantization, windows) before anything is written;
3. and 4. ``saving.write_and_commit``: blocks and tail written, then one
   index transaction commits the row (and evicts down to the budgets);
5. ``published``: the disk reserve kept, each tier pushed, the host tier
   given a copy.

``Store.save`` and ``Store.checkpoint`` run ``save``; ``check --fix`` re-saves a
cut session through ``captured`` and ``write_and_commit`` (``engine.salvage``).
Nothing here calls back up into the Store: it passes what the steps need.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..errors import NotResumableError, ReadOnlyStoreError
from ..format.tokens import check_tokens
from ..identity import ModelIdentity
from ..records import Progress
from ..storage import full
from ..storage.rows import check_name, listed_info
from ..storage.types import EntryInfo
from .layer_checks import check_layers, check_quantized, check_windows
from .saving import Target, write_and_commit
from .tiers.fleet_sync import push_everywhere
from .unverified import inherit_mark

if TYPE_CHECKING:
    from ..codecs.snapshot import Snapshot
    from ..storage.index import SnapshotRow

__all__ = ["save", "validated", "captured", "published"]


def save(
    store: Any, cache: Sequence[Any] | Snapshot, tokens: Sequence[int], target: Target,
    progress: Progress | None = None,
) -> EntryInfo:  # fmt: skip
    """The five steps for ``store`` (a Store: its index, blobs, tiers, host tier)."""
    target = validated(cache, target, read_only=store.read_only, root=store.root)
    for tier in store.tiers:  # the fleet's secret adopted; planted by the push, if
        tier.agree(store.index, target.namespace)  # not refused (attack 38b, finding 5)
    snap = captured(cache, tokens, target.identity)
    row = write_and_commit(
        store.index, store.blobs, snap, target,
        block_tokens=store.block_tokens, budgets=store.budgets, progress=progress,
        keep_unpushed=store.keeps_unpushed(),  # a session's only copy until a tier holds it
    )  # fmt: skip
    return published(store, cache, row, target)


def validated(
    cache: Sequence[Any] | Snapshot, target: Target, *, read_only: bool, root: Any
) -> Target:
    """``target`` as the save will commit it, or a typed refusal; reads no bytes."""
    if read_only:
        raise ReadOnlyStoreError(root)
    check_name(target.namespace, "namespace")
    target = inherit_mark(cache, target)  # a continuation of unverified tokens
    for name in (target.name, target.owner):
        if name is not None:
            check_name(name, "session")
    check_layers(cache, target.identity)
    return target


def captured(
    cache: Sequence[Any] | Snapshot, tokens: Sequence[int], identity: ModelIdentity
) -> Snapshot:
    """The cache's records and host bytes, checked against ``identity``."""
    from ..codecs.snapshot import Snapshot, capture

    snap = cache if isinstance(cache, Snapshot) else capture(cache, tokens)
    if isinstance(cache, Snapshot) and snap.tokens != check_tokens(tokens):
        raise NotResumableError("a captured snapshot is saved with the tokens it was captured with")
    check_quantized(snap.records, identity)  # before anything is written
    check_windows(snap.records, identity)
    return snap


def published(
    store: Any, cache: Sequence[Any] | Snapshot, row: SnapshotRow, target: Target
) -> EntryInfo:
    """After the commit: the reserve, the tiers, the host tier's copy."""
    full.ensure_reserve(store.root)  # before the disk fills: what rm and gc delete with
    push_everywhere(store.tiers, store.index, store.blobs, row.namespace, row.id)
    info = listed_info(row)
    if store.host is not None:
        from .host.store_hooks import keep_saved, owner

        who = owner(target.namespace, target.identity, store.strict_backend)
        keep_saved(store.host, cache, row, info=info, who=who, index=store.index)
    return info
