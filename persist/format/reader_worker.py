"""A reader process of a staged restore (``format/readers``): run as a script.

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


def serve(view: memoryview, msg: bytes, fd: int, hashers: dict[str, Any]) -> bytes:
    """One request (its SEQ already taken off): read, hash, and the reply."""
    head, *pieces = msg.decode("ascii").split(" ")
    fresh, at, lo, hi, pos = (int(x) for x in head.split(","))
    if fresh:
        hashers.clear()
    read = lo
    held: list[tuple[int, int, str, int, str]] = []
    for p in pieces:
        a, b, ident, flags, digest = p.split(",")
        held.append((int(a), int(b), ident, int(flags), digest))
        if int(b) - read >= PIECE or int(b) == hi:
            if not _read(view, fd, at, read, int(b), pos):
                return b"short"
            read = int(b)
            bad = _check(view, at, held, hashers)
            if bad is not None:
                return b"bad " + bad.encode("ascii")
            held = []
    if read < hi:
        if not _read(view, fd, at, read, hi, pos):
            return b"short"
        bad = _check(view, at, held, hashers)
        if bad is not None:
            return b"bad " + bad.encode("ascii")
    return b"ok"


def _read(view: memoryview, fd: int, at: int, a: int, b: int, pos: int) -> bool:
    return os.preadv(fd, [view[at + a : at + b]], pos + a) == b - a


def _check(
    view: memoryview, at: int, held: list[tuple[int, int, str, int, str]], hashers: dict[str, Any]
) -> str | None:
    """The ID of the first piece whose tensor's checksum differs, else None."""
    for a, b, ident, flags, digest in held:
        part = view[at + a : at + b]
        if flags == 3:  # a whole tensor: one call
            if xxhash.xxh3_128_hexdigest(part) != digest:
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
            if h.hexdigest() != digest:
                return ident
    return None


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
