"""``persist serve --warm N``: each model the server loads (the default one before the
server listens, any other when a request swaps to it) gets its N most valuable
store entries read into the host tier, so a returning conversation after a
restart is answered from RAM instead of a disk read (``engine.warm``)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..engine.host.tier import HostTier
from ..engine.store import Store
from ..engine.warm import warm
from ..identity import ModelIdentity

__all__ = ["warmer"]

log = logging.getLogger("persist")


def warmer(store: Store, host: HostTier | None, n: int) -> Callable[[ModelIdentity], None] | None:
    """What to run when a model is loaded (None: nothing to warm).  A failure is
    logged, never raised: a cold start still serves."""
    if n <= 0:
        return None
    if host is None:
        log.warning("persist: --warm needs the host tier (--host-cache): nothing warmed")
        return None

    def run(identity: ModelIdentity) -> None:
        try:
            r = warm(store.index, store.blobs, host, identity, n, None, store.strict_backend)
        except Exception as e:
            log.warning("persist: warm start failed: %s", e)
            return
        log.info(
            "persist: warm start: %d entries (%d tokens, %d bytes) of %s read into RAM "
            "in %.2f s%s",
            r.entries, r.tokens, r.bytes, identity.display(), r.seconds,
            f"; {r.skipped} skipped" if r.skipped else "",
        )  # fmt: skip

    return run
