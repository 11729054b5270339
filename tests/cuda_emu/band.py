"""Run one elementwise kernel under emulation on numel = INT32_MAX - 1000 (the 32-bit index band).

``python -m cuda_emu.band KERNEL LAYOUT`` from ``tests/``: KERNEL is ``normalize`` or
``backward_elemt``, LAYOUT ``channels_first`` (shape (1, 1, numel)) or ``channels_last`` (shape
(numel, 1)); both take the scalar path (numel is odd). Exits 0 once
``_kernel_matrix.check_overflow_band`` passed; an out-of-bounds access kills the process, as it
would fault on a GPU. Run in a subprocess by tests/test_cuda_emu.py;
needs about 9 GB of memory.
"""

from __future__ import annotations

import sys

from _kernel_matrix import BAND_NUMEL, check_overflow_band

from cuda_emu.build import load_emulator


def main(kernel: str, layout: str) -> None:
    emu = load_emulator()
    check_overflow_band(emu, kernel, layout, "cpu")
    print(f"ok {kernel} {layout} numel={BAND_NUMEL} launches={emu.take_launches()}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
