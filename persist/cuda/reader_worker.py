"""A reader process of a staged restore (``cuda/readers``): run as a script.

    python reader_worker.py SOCKET_FD MAP_FD MAP_BYTES

Stdlib and xxhash only: it never imports MLX (no second CUDA context) nor
persist.  It maps the parent's shared slots, then answers requests on a
``SOCK_SEQPACKET`` socket, one message each, until the parent closes it:

    request  "SEQ,FRESH,AT,LO,HI,POS" then " A,B,ID,FLAGS,DIGEST" per piece, ASCII,
             with the blob's file descriptor attached (SCM_RIGHTS); FRESH 1 drops
             every running hash (a new run of tensors starts);
    effect   file bytes [POS + LO, POS + HI) read into slot bytes [AT + LO, AT + HI),
             each piece's slot bytes [AT + A, AT + B) hashed (xxh3-128): FLAGS bit 1
             starts a tensor, bit 2 ends it (then its digest, hex, is compared);
             a tensor across requests keeps its running hasher under ID;
    reply    "SEQ ok", "SEQ short" (the file ended first), "SEQ bad ID" (a checksum
             differs) or "SEQ error WHY": the request's SEQ first, so a reply can
             never be taken for another request's.

It says "ready" first, once its imports and the mapping are done.

Bytes are read about ``PIECE`` at a time and hashed right after, while they
are still in the core's cache.  SIGINT is ignored: a Ctrl-C reaches the
parent, which stops asking.
"""

from __future__ import annotations

import mmap
import os
import signal
import socket
import sys
from typing import Any

import xxhash

# bytes read before they are hashed; PERSIST_READ_PIECE sets it for a measurement
# (bench/cuda_stage_probe compares whole-slot reads)
PIECE = int(os.environ.get("PERSIST_READ_PIECE", 1 << 20))
MAX_MESSAGE = 1 << 16  # bytes of one request (the parent splits longer ones)


Check = tuple[int, int, str, int, bytes]  # slot bytes [a, b), ID, FLAGS, the tensor's digest
SHORT = "short"  # ``fill``'s answer when the file ended first


def fill(
    view: memoryview,
    fd: int,
    *,
    at: int,
    lo: int,
    hi: int,
    pos: int,
    pieces: list[Check],
    hashers: dict[str, Any],
    piece: int = PIECE,
) -> str | None:
    """File bytes [pos + lo, pos + hi) into ``view`` from ``at + lo``, about ``piece``
    bytes per read, each read's tensor pieces hashed right after, while they are
    still in the core's cache (``pieces`` in slot order, within [lo, hi)).  None
    when every checksum held; SHORT, or the ID of the first piece whose tensor's
    checksum differs.  Shared with the reader threads (``engine/staged/slot_reads``)."""
    read = lo
    held: list[Check] = []
    for check in pieces:
        held.append(check)
        b = check[1]
        if b - read >= piece or b == hi:
            if os.preadv(fd, [view[at + read : at + b]], pos + read) != b - read:
                return SHORT
            read, bad, held = b, _check(view, at, held, hashers), []
            if bad is not None:
                return bad
    if read < hi:
        if os.preadv(fd, [view[at + read : at + hi]], pos + read) != hi - read:
            return SHORT
        return _check(view, at, held, hashers)
    return None


def _check(view: memoryview, at: int, held: list[Check], hashers: dict[str, Any]) -> str | None:
    """The ID of the first piece whose tensor's checksum differs, else None."""
    for a, b, ident, flags, digest in held:
        part = view[at + a : at + b]
        if flags == 3:  # a whole tensor: one call
            if xxhash.xxh3_128_digest(part) != digest:
                return ident
            continue
        if flags & 1:
            hashers[ident] = xxhash.xxh3_128()
        h = hashers.get(ident)
        if h is None:  # a tensor's later piece without its start: refuse it
            return ident
        h.update(part)
        if flags & 2:
            del hashers[ident]
            if h.digest() != digest:
                return ident
    return None


def serve(view: memoryview, msg: bytes, fd: int, hashers: dict[str, Any]) -> bytes:
    """One request (its SEQ already taken off): read, hash, and the reply."""
    head, *words = msg.decode("ascii").split(" ")
    fresh, at, lo, hi, pos = (int(x) for x in head.split(","))
    if fresh:
        hashers.clear()
    pieces: list[Check] = []
    for w in words:
        a, b, ident, flags, digest = w.split(",")
        pieces.append((int(a), int(b), ident, int(flags), bytes.fromhex(digest)))
    got = fill(view, fd, at=at, lo=lo, hi=hi, pos=pos, pieces=pieces, hashers=hashers)
    if got is None:
        return b"ok"
    return b"short" if got == SHORT else b"bad " + got.encode("ascii")


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=int(sys.argv[1]))
    with mmap.mmap(int(sys.argv[2]), int(sys.argv[3])) as m:
        view = memoryview(m)
        hashers: dict[str, Any] = {}
        sock.send(b"ready")
        while True:
            msg, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 1)
            if not msg:  # the parent closed its end (or exited)
                break
            seq, _, body = msg.partition(b",")
            try:
                reply = serve(view, body, fds[0], hashers) if fds else b"error no descriptor"
            except (OSError, ValueError) as e:
                reply = b"error " + str(e).encode("ascii", "replace")[:200]
            finally:
                for f in fds:
                    os.close(f)
            sock.send(seq + b" " + reply)
        view.release()


if __name__ == "__main__":
    main()
