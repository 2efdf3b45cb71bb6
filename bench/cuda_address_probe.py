"""Does the PTX address kernel (``cuda/addressing``) load and tell the truth here?
Prints each step; run on the GPU machine: ``python3 -m bench.cuda_address_probe``."""

from __future__ import annotations

import traceback

import mlx.core as mx


def main() -> None:
    from persist.cuda import addressing, pinned
    from tests.cuda_memory import compiled_address, managed

    a = mx.zeros((4, 8, 64), dtype=mx.bfloat16) + 1
    mx.eval(a)
    try:
        print("ptx addresses:", addressing._kernel_addresses([a, a[:, 2:5, :]]))
    except Exception:
        traceback.print_exc()
    print("compiled address:", compiled_address(a))
    print("kernel_proven:", addressing.kernel_proven(), "direct:", pinned.direct())
    print("managed after:", managed(a))
    try:
        print("rows of view:", addressing.rows(a[:, 2:5, :]))
    except Exception:
        traceback.print_exc()
    z = addressing.zeroed([100, 4096])
    print("zeroed managed:", [managed(b) for b, _ in z], [at for _, at in z])


if __name__ == "__main__":
    main()
