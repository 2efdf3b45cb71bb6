"""The staged restore's ring without a GPU: a lane whose copies are memmoves, host
buffers standing in for the zeroing kernel's, and the scatter as memmoves (as
tests/host_pages.py stands in for the pinned page pool)."""

from __future__ import annotations

import ctypes
from typing import Any

import mlx.core as mx
import numpy as np

from persist.cuda import pinned
from persist.cuda.pinned import CUDA_PINNED, Choice, Placed, Ring
from persist.engine.staged import restore as staging


class HostLane:
    """A lane without a GPU: its copies are memmoves, done when ``put`` returns."""

    def __init__(self, size: int) -> None:
        self.slots = [np.zeros(size, dtype=np.uint8) for _ in range(2)]
        self.turn = self.taken = self.copies = self.fetched = 0

    def enter(self) -> None:
        pass

    def take(self) -> int:
        self.turn ^= 1
        self.taken += 1
        return self.turn

    def put(self, slot: int, dst: int, n: int) -> None:
        ctypes.memmove(dst, self.slots[slot].ctypes.data, n)
        self.copies += 1

    def place(self, slot: int, copies: list[tuple[int, int, int, int, int, int]]) -> None:
        base = self.slots[slot].ctypes.data
        for src, dst, width, height, spitch, dpitch in copies:
            for r in range(height):
                ctypes.memmove(dst + r * dpitch, base + src + r * spitch, width)
        self.copies += 1

    def drain(self) -> None:
        pass

    def fetch(self, slot: int, src: int, n: int) -> None:
        ctypes.memmove(self.slots[slot].ctypes.data, src, n)
        self.fetched += 1

    def settle(self, slot: int) -> None:
        pass

    def current(self) -> None:
        pass


def host_buffers(sizes: list[int]) -> list[tuple[mx.array, int]]:
    """MLX host buffers (zeroed) and their addresses, as the zeroing kernel gives on CUDA."""
    outs = [mx.zeros((max(1, -(-n // 16)), 16), dtype=mx.uint8) for n in sizes]
    mx.eval(outs)
    return [(o, address(o)) for o in outs]


def address(a: mx.array) -> int:
    return int(np.frombuffer(memoryview(a), dtype=np.uint8).ctypes.data)


def host_scatter(staged: mx.array, placed: list[Placed]) -> None:
    base = address(staged)
    for c in (c for p in placed for c in staging.placement(p)):
        for r in range(c.height):
            ctypes.memmove(c.dst + r * c.dpitch, base + c.src + r * c.spitch, c.width)


def host_ring(lanes: int, size: int, direct: bool = False) -> Ring:
    """Lanes of host slots; ``direct``: each slot's pieces go straight to their tensors."""
    made: list[Any] = [HostLane(size) for _ in range(lanes)]
    return Ring(made, host_buffers, host_scatter, direct=direct)


def staged(ring: Ring) -> Any:
    return pinned.use(Choice(CUDA_PINNED, "test ring", ring))
