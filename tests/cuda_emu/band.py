"""Run one elementwise kernel under emulation on numel = INT32_MAX - 1000 (the 32-bit index band).

``python -m cuda_emu.band KERNEL LAYOUT`` from ``tests/``: KERNEL is ``normalize`` or
``backward_elemt``, LAYOUT ``channels_first`` (shape (1, 1, numel)) or ``channels_last`` (shape
(numel, 1)); both take the scalar path (numel is odd). Exits 0 after checking the first and last
4096 outputs and a strided sample of the rest against the reference; an out-of-bounds access
kills the process, as it would fault on a GPU. Run in a subprocess by tests/test_cuda_emu.py;
needs about 9 GB of memory.
"""

from __future__ import annotations

import sys

import torch
from _numerics import rel_err

from cuda_emu.build import load_emulator
from syncbn_lightning import reference as R

NUMEL = 2**31 - 1 - 1000
EDGE = 4096


def main(kernel: str, layout: str) -> None:
    emu = load_emulator()
    shape = (1, 1, NUMEL) if layout == "channels_first" else (NUMEL, 1)
    x = torch.empty(shape, dtype=torch.float16)
    flat = x.view(-1)
    flat.fill_(1.5)
    torch.manual_seed(0)
    flat[:EDGE] = torch.randn(EDGE).half()
    flat[-EDGE:] = torch.randn(EDGE).half()
    mean, invstd = torch.tensor([0.25]), torch.tensor([2.0])
    weight = torch.tensor([0.75])
    sum_dy, sum_dy_xmu, count = torch.tensor([3.0]), torch.tensor([-2.0]), torch.tensor(1e6)
    if kernel == "normalize":
        out = emu.normalize(x, mean, invstd, weight, None)

        def expect(part: torch.Tensor) -> torch.Tensor:
            return R.normalize(part.view(1, 1, -1), mean, invstd, weight, None).view(-1)

    else:  # the input doubles as the output gradient: 2 tensors of 4.3 GB instead of 3
        out = emu.backward_elemt(x, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count)

        def expect(part: torch.Tensor) -> torch.Tensor:
            p = part.view(1, 1, -1)
            return R.backward_elemt(p, p, mean, invstd, weight, sum_dy, sum_dy_xmu, count).view(-1)

    got = out.view(-1)
    for name, index in (
        ("head", slice(0, EDGE)),
        ("tail", slice(NUMEL - EDGE, NUMEL)),
        ("sample", slice(EDGE, NUMEL - EDGE, 1_000_003)),
    ):
        err = rel_err(got[index], expect(flat[index]))
        assert err <= 2e-3, f"{kernel} {layout}: {name} differs from the reference by {err}"
    print(f"ok {kernel} {layout} numel={NUMEL} launches={emu.take_launches()}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
