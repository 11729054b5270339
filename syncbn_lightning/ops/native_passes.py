"""The passes of ``benchmarks/gpu_check.sh native`` on a GPU, as recorded in this tree.

CUDA layers take the C++ path by default (``SYNCBN_NATIVE_CUDA`` unset) only where the loaded
extension's sources and the library's Python files are those of a pass listed here
(:func:`~syncbn_lightning.ops.dispatch.native_cuda_default`): a pass on one tree never switches
another. Entries are added by ``python tools/record_native_pass.py <OUT>/native_pass.json``, which
refuses a pass made on other sources than the checkout's; each names the two digests
(:func:`~syncbn_lightning.ops.build.sources_digest`,
:func:`~syncbn_lightning.ops.dispatch.python_path_digest`), the device, torch and the date.
This file itself is outside the digests.
"""

from __future__ import annotations

PASSES: tuple[dict[str, str], ...] = ()
