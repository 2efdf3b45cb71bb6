"""Where the host-RAM tier keeps its entries, and how much it may keep by default.

On CUDA with pinned memory, pages of pinned host memory (once they proved they
give back bit for bit what they were given); on CUDA without, device memory
(where ``persist serve`` leaves the tier off); elsewhere host or unified memory
as the arrays are.  The default budget: min(10% of MemAvailable, 8 GiB).
"""

from __future__ import annotations

import os

from ...cuda import pinned
from ...cuda.pinned_pool import Holder, cuda_holder, proven

__all__ = ["default_budget", "placement", "pinned_holder", "DEVICE_MEMORY"]

DEFAULT_CAP = 8 << 30  # bytes: the default budget's ceiling
DEFAULT_SHARE = 0.10  # of MemAvailable
DEVICE_MEMORY = "device memory"  # CUDA without pinned pages: where serve leaves it off


def default_budget(meminfo: str = "/proc/meminfo") -> int:
    """min(10% of MemAvailable, 8 GiB); 0 where MemAvailable cannot be read."""
    try:
        with open(meminfo, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    kib = int(line.split()[1])
                    return min(int(kib * 1024 * DEFAULT_SHARE), DEFAULT_CAP)
    except (OSError, ValueError, IndexError):
        pass  # no /proc (macOS): fall through to sysconf
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return 0
    return min(int(free * DEFAULT_SHARE), DEFAULT_CAP)


def placement() -> str:
    """Where a tier made now without a holder keeps its entries, in words."""
    if pinned.data_path().path == pinned.CUDA_PINNED:
        return "pinned host memory"
    here = pinned.backend()
    return {"cuda": DEVICE_MEMORY, "metal": "unified memory"}.get(here, "host memory")


def pinned_holder(max_bytes: int) -> tuple[Holder | None, str | None]:
    """(pinned pages, None) once they gave back bit for bit what they were given
    (``proven``), else (None, why not)."""
    holder = cuda_holder(max_bytes)
    why = proven(holder, max_bytes)
    return (holder, None) if why is None else (None, why)
