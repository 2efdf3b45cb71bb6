"""The library's default path, timed in the same rounds as bench_throughput's rows.

A ``persist.Store(root)`` opened and closed for every save and restore, as the
README's library example does, under MLX's default CPU buffer cache (32 MiB:
every restore faults in fresh memory).  The parent process keeps freed buffers
as ``persist serve`` does, and that setting (and the memory allocator's state
it leaves behind: glibc keeps or returns freed chunks by their history) is
process-wide, so these operations run in a spawned child process that never
changes MLX's cache: the child builds the same cache from the same seeds and
answers one command at a time, so its operations interleave with the parent's.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
from pathlib import Path
from typing import Any

SAVE = "default path: save"
RESTORE = "default path: restore + step (cold)"
SESSION = "s"


class DefaultPath:
    """A child process serving ``prepare_*`` (untimed) and ``save``/``restore`` (timed
    by the caller around the round trip: a pipe's latency is well under a millisecond)."""

    def __init__(self, build: str, tokens: int, root: Path) -> None:
        ctx = mp.get_context("spawn")  # a fresh interpreter: no fork of the parent's MLX state
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, build, tokens, str(root)), daemon=True)
        self.proc.start()
        child.close()
        self._expect("ready")

    def ask(self, command: str) -> None:
        self.conn.send(command)
        self._expect("done")

    def _expect(self, what: str) -> None:
        reply = self.conn.recv()
        if reply != what:
            raise RuntimeError(f"default-path child: {reply}")

    def close(self) -> None:
        self.conn.send("quit")
        self.proc.join(timeout=60)
        self.conn.close()


def _serve(conn: Any, build: str, tokens: int, root_name: str) -> None:
    import persist
    from bench.common import evict
    from bench.shapes import IDENTITY, first_step, llama, qwen3_next

    root = Path(root_name)
    cache = {"llama3-8b": llama, "qwen3-next": qwen3_next}[build](tokens)
    toks = list(range(tokens))
    held: list[Any] = []

    def save() -> None:
        with persist.Store(root) as store:
            store.save(cache, toks, identity=IDENTITY, session=SESSION)

    def prepare_save() -> None:
        gc.collect()
        with persist.Store(root) as store:
            if store.has_session(SESSION):
                store.delete(SESSION)

    def prepare_restore() -> None:
        held.clear()  # the last restore's caches go back to the allocator, as a caller's would
        gc.collect()
        for p in (root / "blobs").rglob("*.safetensors"):
            evict(p)

    def restore() -> None:
        with persist.Store(root) as store:
            r = store.restore(SESSION, identity=IDENTITY)
        first_step(r.cache)
        held.append(r)

    commands = {
        "prepare_save": prepare_save,
        "save": save,
        "prepare_restore": prepare_restore,
        "restore": restore,
    }
    save()
    conn.send("ready")
    while (command := conn.recv()) != "quit":
        try:
            commands[command]()
            conn.send("done")
        except Exception as e:  # the parent raises it, named
            conn.send(f"{command} failed: {e!r}")
    conn.close()


def ops(child: DefaultPath) -> dict[str, tuple[Any, Any]]:
    """The two rows, as bench_throughput's (setup, timed op) pairs."""
    return {
        SAVE: (lambda: child.ask("prepare_save"), lambda: child.ask("save")),
        RESTORE: (lambda: child.ask("prepare_restore"), lambda: child.ask("restore")),
    }
