"""``persist.Store``: named sessions and cross-session prefix reuse.

The engine's one public object.  Its methods are thin: they check names and
identities, then call ``save_pipeline.save`` / ``loading.load_snapshot``
(which take the index and the blob tier, never the Store) or the storage
layer (``persist.storage``: SQL and files, no mlx).  Here: opening, saving,
explaining, listing, files; restores and lookups are ``StoreReads``'
(engine/store_reads.py), closing and upkeep ``StoreUpkeep``'s (engine/lifecycle.py).
Listing and maintenance never import mlx: ``persist ls`` starts in a blink.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import (
    InvalidArgumentError,
    SessionNotFoundError,
)
from ..format.manifest import check_metadata
from ..format.tokens import check_tokens
from ..identity import ModelIdentity
from ..records import Progress
from ..storage import retention
from ..storage.housekeeping import remembered_budget
from ..storage.index import BlockRef, Index, SnapshotRow
from ..storage.rows import check_name, check_namespace, store_root
from ..storage.store_folder import open_folder
from ..storage.types import EntryInfo
from .costs import CostModel
from .file_tags import file_key
from .lifecycle import check_hints
from .store_reads import StoreReads

if TYPE_CHECKING:  # the save path imports mlx: loaded by the first save, not by ``ls``
    from ..codecs.snapshot import Snapshot
    from .explain import Explanation
    from .saving import Target
    from .tiers.exchange import Shared

__all__ = ["Store", "check_name"]


class Store(StoreReads):
    """A directory of cached states: ``Store(root, max_bytes=None, block_tokens=256)``.

    ``namespace_max_bytes`` (bytes for every namespace, or a map of namespace to
    bytes) gives tenants budgets of their own: a save evicts only in its own
    namespace, and one that cannot fit there is StoreFullError; a namespace's
    partitions (``NS/salt:X``: ``storage.retention.budget_owner``) share its
    budget.  ``tier_key``: tiers.py.
    ``host_cache`` (bytes; None or 0: none) keeps a copy of every save in RAM that
    lookups ask first (``engine.host.store_hooks``).  ``cached_writes``: large blobs
    are written through the page cache instead of O_DIRECT, so a restore soon after
    (``persist serve``'s, after a restart too) reads them from memory."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        max_bytes: int | None = None,
        block_tokens: int | None = None,
        namespace_max_bytes: int | Mapping[str, int] | None = None,
        shared: str | None = None,
        cold: str | None = None,
        tier_key: bytes | None = None,
        strict_backend: bool = False,
        host_cache: int | None = None,
        cached_writes: bool = False,
    ) -> None:
        self.root = store_root(root)
        self.host = None  # saves kept in RAM (engine.host_store)
        if host_cache is not None and host_cache != 0:  # mlx loads only when asked for
            from .host.tier import HostTier

            self.host = HostTier(host_cache)  # checks the size
        if block_tokens is not None and not 1 <= block_tokens <= 1 << 20:
            raise InvalidArgumentError("block_tokens must be between 1 and 1048576")
        self.budgets = retention.Budgets(max_bytes, namespace_max_bytes)
        self.strict_backend = strict_backend  # refuse caches another MLX backend computed
        opened = open_folder(self.root, block_tokens)  # storage.store_folder
        self.read_only, self.blobs, db = opened.read_only, opened.blobs, opened.db
        # large blobs through the page cache, not O_DIRECT: for a caller that restores
        # what it saved soon (persist serve, after a restart too)
        opened.blobs.cached_writes = cached_writes
        self._index: Index | None = Index(db, self.root if self.read_only else None)
        if max_bytes is None:  # a budget remembered for this store binds every opener
            self.budgets = retention.Budgets(remembered_budget(self._index), namespace_max_bytes)
        self.costs = CostModel(self._index)  # restore or recompute, from measured rates
        self.shared: Shared | None = None  # a Redis-protocol server every machine shares
        self.cold: Shared | None = None  # S3, for named sessions
        if shared or cold:  # the tier code and clients load only when asked for
            from .tiers.exchange import open_tiers

            self.shared, self.cold = open_tiers(shared, cold, tier_key)
        self.tiers = [t for t in (self.shared, self.cold) if t is not None]
        self.tier_key = tier_key  # also tags exports and checks imports (file_tags)
        self.block_tokens = int(
            db.execute("SELECT value FROM meta WHERE key = 'block_tokens'").fetchone()[0]
        )

    # -- saving -----------------------------------------------------------

    def save(
        self,
        cache: Sequence[Any] | Snapshot,
        tokens: Sequence[int],
        *,
        identity: ModelIdentity,
        session: str | None = None,
        namespace: str = "default",
        pin: bool | None = None,
        metadata: Mapping[str, str] | None = None,
        progress: Progress | None = None,
        if_version: int | None = None,
        unverified_tokens: bool = False,
        ttl: float | None = None,
        priority: int | None = None,
    ) -> EntryInfo:
        """Save ``cache`` (covering exactly ``tokens``); named if ``session`` is given.

        ``ttl`` (seconds) and ``priority`` are retention hints: within the budget,
        an entry is evicted after every entry whose hints have lapsed, for ``ttl``
        seconds after its last use, and higher priorities after lower ones
        (``policy.eviction_key``).  A session keeps its hints from save to save;
        without any, eviction is least recently used first.  ``pin``: True pins the
        session (``pin``), False unpins it; None (the default) keeps the session's
        own pin, as a new turn keeps its hints: a pinned session stays pinned.

        ``unverified_tokens``: nothing vouches that ``tokens`` are what the cache
        covers (an imported purely recurrent cache records no offset): the
        session is then restored by its name only and never serves a lookup,
        nor does any later save of it (docs/FORMAT.md).

        ``cache`` may also be a ``persist.codecs.snapshot.capture(cache, tokens)``
        taken earlier, in another thread (a server captures on its generation thread).
        ``if_version`` is the session's version as the caller read it
        (``Restored.entry.id``; 0 for a session that must not exist yet): if the
        session changed meanwhile the save is refused (``SessionConflictError``)
        and nothing is written, instead of one writer's turn silently replacing
        another's.
        """
        from .saving import Target

        role = "prefix" if session is None else "session"
        meta = check_metadata(metadata)
        if unverified_tokens and session is None:
            raise InvalidArgumentError("unverified tokens are kept only under a session name")
        target = Target(
            identity=identity,
            namespace=namespace,
            name=session,
            role=role,
            pin=pin,
            metadata=meta,
            if_version=if_version,
            unverified=unverified_tokens,
            hints=check_hints(ttl, priority),
        )
        return self._save(cache, tokens, target, progress)

    def checkpoint(
        self,
        cache: Sequence[Any] | Snapshot,
        tokens: Sequence[int],
        *,
        identity: ModelIdentity,
        session: str | None = None,
        namespace: str = "default",
    ) -> EntryInfo:
        """Save a checkpoint: an anonymous snapshot owned by ``session`` (deleted with it)
        that serves prefix lookups, kept even when it is a prefix of a longer snapshot."""
        from .saving import Target

        target = Target(identity=identity, namespace=namespace, owner=session, role="checkpoint")
        return self._save(cache, tokens, target)

    def _save(
        self,
        cache: Sequence[Any] | Snapshot,
        tokens: Sequence[int],
        target: Target,
        progress: Progress | None = None,
    ) -> EntryInfo:
        from .save_pipeline import save

        return save(self, cache, tokens, target, progress)

    def preload(self) -> None:
        """Import now the modules a first restore, lookup or save imports on first use
        (``ls`` never needs them): ``persist serve`` calls this before it answers, so its
        first request pays for no imports (issue 39: a first restore's extra time)."""
        from . import explain, lookup_order, reading, save_pipeline, saving, warm  # noqa: F401

    def count(self, namespace: str = "default", **counters: int) -> None:
        """Add to ``namespace``'s counters (``persist stats`` shows them)."""
        self.index.count(check_name(namespace, "namespace"), **counters)

    # -- explaining ---------------------------------------------------------

    def explain(
        self,
        tokens: Sequence[int],
        *,
        identity: ModelIdentity,
        namespace: str = "default",
        tokenizer: Any = None,
        limit: int = 5,
        other_namespaces: bool = False,
        bounded: bool = False,
    ) -> Explanation:
        """Why ``lookup`` of ``tokens`` would miss or hit short, from the index alone.

        The nearest snapshots by shared prefix (this identity and any other),
        where the prompt diverges from each (decoded with ``tokenizer``), and
        the reason the best usable hit is shorter than the longest shared
        prefix (``persist.engine.explain.REASONS``).  Reads no blob, counts
        nothing.  ``other_namespaces`` adds a count (never content) of longer
        shared prefixes elsewhere: for an operator, never for a tenant.
        ``bounded`` reads only the rows the lookup keys lead to (a few index seeks,
        a few dozen rows: ``persist.storage.nearest``), as ``persist serve`` does.
        """
        from .explain import explain

        toks = check_tokens(tokens)
        check_name(namespace, "namespace")
        return explain(
            self.index,
            self.blobs,
            self.costs,
            toks,
            identity=identity,
            namespace=namespace,
            limit=limit,
            tokenizer=tokenizer,
            other_namespaces=other_namespaces,
            strict_backend=self.strict_backend,
            block=self.block_tokens,
            bounded=bounded,
        )

    # -- listing and maintenance --------------------------------------------

    def sessions(self, namespace: str | None = None) -> list[EntryInfo]:
        ns = check_namespace(namespace)
        return [self._info(r) for r in self.index.snapshots(ns, named_only=True)]

    def entries(self, namespace: str | None = None) -> list[EntryInfo]:
        """Every snapshot: sessions, checkpoints and anonymous prefixes."""
        ns = check_namespace(namespace)
        return [self._info(r) for r in self.index.snapshots(ns, named_only=False)]

    def entry(self, session: str, *, namespace: str = "default") -> EntryInfo:
        row = self.index.by_name(namespace, session)  # names checked there
        if row is None:
            raise SessionNotFoundError(session, namespace)
        return self.index.checked_info(row)  # show: a row failing its checksum is marked

    def export(
        self,
        session: str,
        path: str | os.PathLike[str],
        *,
        namespace: str = "default",
        format: str = "persist",
        model: str | None = None,
        model_dir: str | os.PathLike[str] | None = None,
        replace: bool = True,
    ) -> EntryInfo:
        """Write a session to one file: a persist file (``load_file`` reads it, with
        tokens and identity) or, with ``format="mlx-lm"``, one mlx-lm's
        ``load_prompt_cache`` and ``mlx_lm generate --prompt-cache-file`` read
        (caches and metadata: ``model``, the path or repo id as mlx-lm will be
        given it, default the identity's name, and ``tokenizer_config``).  The
        file claims ``model``, so its files must hold the session's model:
        ``model`` itself when it is a folder, else ``model_dir`` (the folder a
        repo id resolves to); neither is ModelNotFoundError, nothing written.  A
        session only the fleet holds is pulled first, as ``restore`` pulls it (a
        read-only store with tiers: ReadOnlyStoreError).  ``path`` inside the store, or one holding
        anything but a regular file (a FIFO, a device, a folder, a link), is
        ExportTargetError: nothing written.  ``replace`` False (``persist export``
        without --force): a file at ``path`` is AlreadyExistsError, even one made
        while the export ran (the file is linked into place, never renamed over)."""
        from .files import check_export_target
        from .reading import read_named
        from .transfer import export_row

        check_name(namespace, "namespace")
        check_name(session, "session")
        key = file_key(self.tier_key)  # the operator key tags the file (file_tags)

        def write(row: SnapshotRow, refs: list[BlockRef]) -> None:
            # a regular file outside the store only, checked before any blob is read
            check_export_target(self.root, path, replace)
            export_row(
                self.index, self.blobs, row, refs=refs, path=path, format=format,
                model=model, model_dir=model_dir, key=key, replace=replace,
            )  # fmt: skip

        # as restore: a session only the fleet holds is pulled (a read-only store says
        # so, ReadOnlyStoreError, never "no session": attack r13c), and one saved again
        # or removed meanwhile is the new version or not found, never a false report of
        # damage (read_named; attack r13b)
        _, row = self._pulled(
            session, namespace, lambda: read_named(self.index, namespace, session, write)
        )
        return self._info(row)

    def import_file(
        self,
        path: str | os.PathLike[str],
        *,
        session: str | None = None,
        namespace: str = "default",
        identity: ModelIdentity | None = None,
        tokens: Sequence[int] | None = None,
        model: Any = None,
        unverified_tokens: bool = False,
        chat_tokens: Sequence[int] | None = None,
        trust_model: bool = False,
    ) -> EntryInfo:
        """Store a file as a session (named after the file unless ``session``).

        A persist file carries its tokens and identity (``identity``, if given,
        must be of the same model; the cache settings are the file's).  Under the
        operator key (``tier_key``, else ``$PERSIST_TIER_KEY``) it must carry the
        key's tag (``file_tags``); without a key it is trusted as written.
        An mlx-lm prompt cache carries neither: pass the
        ``identity`` of the model that computed it and the ``tokens`` it covers
        (checked against every layer's offset), and the ``model`` itself so
        the file's layers are checked against the model's own caches (count,
        kinds, heads, head dims, dtypes: ``cache_fit.check_fits``).  A cache
        with no offset (purely recurrent) cannot vouch for any token list: it
        is refused unless ``unverified_tokens`` (``Store.save``).
        ``chat_tokens`` (the text's tokens with the chat template) only let the
        error say when those are the ones that fit.  The model an mlx-lm file names
        (``mlx_lm.cache_prompt`` and ``export`` write it) must be ``identity``'s, and
        on this machine to be compared, unless ``trust_model``.
        """
        from .transfer import read_importable

        got = read_importable(
            path,
            identity=identity,
            tokens=tokens,
            model=model,
            unverified_tokens=unverified_tokens,
            chat_tokens=chat_tokens,
            key=file_key(self.tier_key),
            trust_model=trust_model,
        )
        name = session if session is not None else Path(path).name.split(".")[0]
        return self.save(
            got.cache,
            got.tokens,
            identity=got.identity,
            session=name,
            namespace=namespace,
            metadata=got.metadata,
            unverified_tokens=got.unverified,
        )
