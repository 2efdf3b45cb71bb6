"""Reader processes for a staged restore: file bytes read and hashed beside the GIL.

On an H200 a staged restore's reader threads spent twice the time of the same
reads and hashes alone (bench/results/cuda-restore-r4.md): every preadv and
xxhash call hands the GIL back and forth among eight threads.  Here each lane
has a process (``reader_worker.py``: stdlib and xxhash, no MLX) that reads
and hashes into the lane's slots, which live in one shared memory file
(``memfd``) that the parent maps, and on CUDA page-locks, too.  The parent's
reader thread sends a request per slot (the blob's descriptor attached, so a
worker never opens a path) and queues the slot's copy once the reply says
every checksum held.

A worker that dies (killed, out of memory) fails its restore with
``ReaderLost``, which the restore answers by reading on the host path; the
next restore starts a new worker.
"""

from __future__ import annotations

import mmap
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..errors import CorruptBlobError

__all__ = ["Readers", "ReaderLost", "Piece", "Sent"]

WORKER = Path(__file__).with_name("reader_worker.py")
MAX_MESSAGE = 1 << 16  # as reader_worker.MAX_MESSAGE
START_SECONDS = 30.0  # a worker's start: an interpreter, xxhash, the mapping
REPLY_SECONDS = 60.0  # one request (a slot's read and hash: milliseconds) from a slow disk
REPLY_RATE = 1 << 20  # and a second more per MiB asked for, for a slower one still


class ReaderLost(OSError):
    """A reader process is gone: this restore takes the host path instead."""


class Piece(NamedTuple):
    """Slot bytes [a, b) of one tensor: ``first``/``last`` when they start/end it;
    ``digest`` its checksum, ``where`` names it in errors."""

    a: int
    b: int
    ident: int
    first: bool
    last: bool
    digest: bytes
    where: str


class Sent(NamedTuple):
    """Requests sent to lane ``lane``'s worker: (sequence number, bytes, pieces) each."""

    lane: int
    asked: list[tuple[int, int, list[Piece]]]


class Readers:
    """``n`` reader processes over one shared mapping of ``2 n`` slots of ``size`` bytes
    (lane ``i`` owns slots ``2 i`` and ``2 i + 1``)."""

    def __init__(self, n: int, size: int) -> None:
        self.n, self.size = n, size
        self.nbytes = 2 * n * size
        self.fd = os.memfd_create("persist-slots")
        try:
            os.ftruncate(self.fd, self.nbytes)
            self.map = mmap.mmap(self.fd, self.nbytes)
        except BaseException:
            os.close(self.fd)
            raise
        whole = np.frombuffer(self.map, dtype=np.uint8)
        self.base = int(whole.ctypes.data)
        self.slots = [
            [whole[(2 * i + j) * size : (2 * i + j + 1) * size] for j in (0, 1)] for i in range(n)
        ]
        self._procs: list[subprocess.Popen[bytes] | None] = [None] * n
        self._socks: list[socket.socket | None] = [None] * n
        self._seq = [0] * n  # each worker's last request: its reply must name it
        self._lock = threading.Lock()
        try:
            for i in range(n):
                self._start(i)
            for i in range(n):
                self._await(i)
        except BaseException:
            self.close()
            raise

    def _start(self, i: int) -> None:
        if self.fd < 0:
            raise ReaderLost("the reader processes were closed")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-s",
                    "-S",
                    str(WORKER),
                    str(theirs.fileno()),
                    str(self.fd),
                    str(self.nbytes),
                ],
                pass_fds=(theirs.fileno(), self.fd),
                stdin=subprocess.DEVNULL,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._procs[i], self._socks[i] = proc, ours

    def _await(self, i: int) -> None:
        """Worker ``i`` said it is ready (its imports worked), within START_SECONDS."""
        sock = self._socks[i]
        assert sock is not None
        sock.settimeout(START_SECONDS)
        try:
            said = sock.recv(16)
        except OSError as e:
            raise ReaderLost(f"reader process {i} did not start: {e}") from None
        if said != b"ready":
            raise ReaderLost(f"reader process {i} did not start (said {said!r})")
        sock.settimeout(None)

    def ready(self, i: int) -> None:
        """Lane ``i``'s worker runs (a new one if the last one died); ReaderLost if
        none can be started (no interpreter, no fork under memory pressure)."""
        proc = self._procs[i]
        if proc is not None and proc.poll() is None:
            return
        with self._lock:
            self._kill(i)
            try:
                self._start(i)
                self._await(i)
            except (OSError, subprocess.SubprocessError, ValueError) as e:
                self._kill(i)  # a late "ready" must never be read as a reply
                if isinstance(e, ReaderLost):
                    raise
                raise ReaderLost(f"reader process {i} could not start: {e}") from None

    def send(
        self, i: int, slot: int, fd: int, *, pos: int, n: int, pieces: list[Piece], fresh: bool
    ) -> Sent:
        """Ask worker ``i`` for slot bytes [0, n) of lane ``i`` from file ``fd`` at
        ``pos``, every piece checked; ``answer`` waits for it.  ``fresh``: a new run
        of tensors starts here (the worker drops any running hash an aborted one
        left).  ReaderLost if the worker cannot be asked (it is killed)."""
        sock = self._socks[i]
        if sock is None:
            raise ReaderLost(f"reader process {i} is not running")
        at = (2 * i + slot) * self.size
        sent = Sent(i, [])
        for k, (lo, hi, part) in enumerate(_requests(pieces, n)):
            self._seq[i] += 1
            seq = self._seq[i]
            words = [f"{seq},{int(fresh and k == 0)},{at},{lo},{hi},{pos}"]
            words += [
                f"{p.a},{p.b},{p.ident},{int(p.first) | 2 * int(p.last)},{p.digest.hex()}"
                for p in part
            ]
            try:
                socket.send_fds(sock, [" ".join(words).encode("ascii")], [fd])
            except OSError as e:
                self._kill(i)
                raise ReaderLost(f"reader process {i}: {e}") from None
            sent.asked.append((seq, hi - lo, part))
        return sent

    def answer(self, sent: Sent) -> None:
        """Every reply to ``sent``, read in order; then CorruptBlobError for the first
        that found the file short or a checksum different.  A worker that does not
        answer in time (a minute, plus a second per MiB asked for), or answers out
        of step (each reply names its request), is killed: ReaderLost."""
        i = sent.lane
        sock = self._socks[i]
        if sock is None:
            raise ReaderLost(f"reader process {i} is not running")
        failed: CorruptBlobError | None = None
        for seq, size, part in sent.asked:
            try:
                sock.settimeout(REPLY_SECONDS + size / REPLY_RATE)
                reply = sock.recv(256)
            except OSError as e:  # a timeout too: a stopped or stuck worker
                self._kill(i)
                raise ReaderLost(f"reader process {i}: {e or type(e).__name__}") from None
            tag, _, said = reply.partition(b" ")
            if tag != str(seq).encode("ascii"):
                self._kill(i)
                why = "exited" if not reply else f"answered out of step ({reply[:40]!r})"
                raise ReaderLost(f"reader process {i} {why}")
            if said == b"ok" or failed is not None:
                continue
            if said == b"short":
                where = part[0].where if part else "blob"
                failed = CorruptBlobError(where, "file truncated inside a tensor")
            elif said.startswith(b"bad "):
                ident = int(said[4:])
                where = next((p.where for p in part if p.ident == ident), "blob")
                failed = CorruptBlobError(where, "checksum mismatch in tensor data")
            else:
                self._kill(i)
                raise ReaderLost(f"reader process {i}: {said.decode('ascii', 'replace')}")
        if failed is not None:
            raise failed

    def touch(self) -> None:
        """Every worker reads once into each of its slots, from a file of zeros (sparse,
        never on a disk): the pages of its mapping are mapped in the worker, and its
        first request answered, before a restore waits for either (``Ring.warm``)."""
        fd = os.memfd_create("persist-touch")
        try:
            os.ftruncate(fd, self.size)
            for i in range(self.n):
                self.ready(i)
                for slot in (0, 1):
                    self.answer(self.send(i, slot, fd, pos=0, n=self.size, pieces=[], fresh=True))
        finally:
            os.close(fd)

    def interrupt(self) -> None:
        """Kill every worker (a Ctrl-C: no reader thread waits on one); the next
        restore starts new ones."""
        for proc in list(self._procs):
            if proc is not None and proc.poll() is None:
                proc.kill()

    def _kill(self, i: int) -> None:
        """Worker ``i`` gone at once (called by lane ``i``'s thread): ``_stop`` without grace."""
        self._stop(i, grace=0.0)

    def _stop(self, i: int, grace: float = 5.0) -> None:
        """Worker ``i``'s socket closed (its next receive ends it), the worker given
        ``grace`` seconds to exit, then killed."""
        sock, proc = self._socks[i], self._procs[i]
        self._socks[i] = self._procs[i] = None
        if sock is not None:
            sock.close()
        if proc is not None:
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def close(self) -> None:
        """Stop every worker and close the shared file (the mapping stays until the
        lanes' views of it are gone); no worker starts after."""
        for i in range(self.n):
            self._stop(i)
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def _requests(pieces: list[Piece], n: int) -> list[tuple[int, int, list[Piece]]]:
    """The slot's bytes [0, n) as requests of at most MAX_MESSAGE bytes each: (lo, hi,
    the pieces inside), covering [0, n) back to back."""
    out: list[tuple[int, int, list[Piece]]] = []
    lo, size = 0, 64
    part: list[Piece] = []
    for p in pieces:
        words = 48 + 2 * len(p.digest) + len(str(p.ident))
        if part and size + words > MAX_MESSAGE - 64:
            out.append((lo, part[-1].b, part))
            lo, part, size = part[-1].b, [], 64
        part.append(p)
        size += words
    out.append((lo, n, part))
    return out
