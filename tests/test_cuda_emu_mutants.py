"""The emulation tests can fail: seeded bugs in the CUDA kernels of ``csrc/`` make them fail.

Each mutant is a copy of ``csrc/`` with one bug (in the file of ``csrc/cuda/`` that holds the
code), built by the emulation in a fresh interpreter (``SYNCBN_EMU_CSRC``) and run against a few
cases of ``tests/test_cuda_emu.py``, which must fail.
A build costs about a minute, so these run with ``SYNCBN_EMU_FULL=1`` only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from syncbn_lightning.ops import build as ops_build

pytestmark = [
    pytest.mark.cuda_emu,
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("SYNCBN_EMU_FULL") != "1", reason="mutants run with SYNCBN_EMU_FULL=1"
    ),
]

TESTS = Path(__file__).resolve().parent
# Cases that exercise every reduction kernel (channels-first and -last, split and not), under
# the forward and reverse schedules (a missing barrier shows under some orders only).
MATRIX = [
    f"test_cuda_emu.py::test_emulated_kernels_match_reference_and_float64[{shape}-torch.float32-{order}]"
    for shape in ("(2, 4, 200, 168)", "(4, 5, 7, 7)", "(9000, 1)")
    for order in ("forward", "reverse")
]
BAND = ["test_cuda_emu.py::test_elementwise_kernels_in_the_32_bit_overflow_band"]
WRONG_RESULT = "FAILED test_cuda_emu.py::test_emulated_kernels"


def _no_barriers(text: str) -> str:
    assert "__syncthreads();" in text
    return text.replace("__syncthreads();", "")


def _broken_chan_merge(text: str) -> str:
    """Chan's M2 update without the n_a factor: a[2] += b[2] + d^2 * f instead of d^2 * n_a * f."""
    right = "a[2] += b[2] + d * d * a[0] * f;"
    assert right in text
    return text.replace(right, "a[2] += b[2] + d * d * f;")


def _index_bound_of_numel_alone(text: str) -> str:
    """32-bit indices whenever numel <= INT32_MAX: the grid-stride step wraps in the band."""
    right = (
        "const bool small = g.N * g.C * g.S + max_stride <= std::numeric_limits<int32_t>::max();"
    )
    assert right in text
    return text.replace(right, "const bool small = g.N * g.C * g.S <= INT32_MAX; (void)max_stride;")


RESIDUAL = [
    f"test_cuda_emu_fused.py::test_fused_residual_kernels_match_cpu_operators[{exchange}-dtype0-1]"
    for exchange in ("gather", "reduce")
]
WRONG_RESIDUAL = "FAILED test_cuda_emu_fused.py::test_fused_residual"


def _residual_not_added(text: str) -> str:
    """The two-input normalize kernel forgets the residual."""
    right = "if constexpr (K == 2) out[e] += in[1][e];"
    assert right in text
    return text.replace(right, "")


def _vector_residual_grad_without_residual(text: str) -> str:
    """The vectorized residual reduction computes act'(z) instead of act'(z + r)."""
    right = "             to_acc<acc_t>(rr.v[e]);"
    assert right in text
    return text.replace(right, "             acc_t(0) * to_acc<acc_t>(rr.v[e]);")


@pytest.mark.parametrize(
    ("source", "mutate", "cases", "failure"),
    [
        # The barriers of the reductions' block and partial folds.
        ("cuda/cuda_reduce.cuh", _no_barriers, MATRIX, WRONG_RESULT),
        # Chan's merge of two Welford states (WelfordOp).
        ("cuda/stats_cuda.cu", _broken_chan_merge, MATRIX, WRONG_RESULT),
        # The elementwise launcher's choice of 32-bit indices.
        ("cuda/cuda_elemt.cuh", _index_bound_of_numel_alone, BAND, "was killed by SIGSEGV"),
        # The fused residual tail: forward (normalize) and backward (the reduction's loads).
        ("cuda/normalize_cuda.cu", _residual_not_added, RESIDUAL, WRONG_RESIDUAL),
        (
            "cuda/backward_cuda.cu",
            _vector_residual_grad_without_residual,
            RESIDUAL,
            WRONG_RESIDUAL,
        ),
    ],
    ids=[
        "no_barriers",
        "broken_chan_merge",
        "index_bound_of_numel_alone",
        "residual_not_added",
        "vector_residual_grad_without_residual",
    ],
)
def test_a_seeded_kernel_bug_fails_the_emulation_tests(
    source: str, mutate, cases: list[str], failure: str, tmp_path: Path
) -> None:
    csrc = tmp_path / "csrc"
    shutil.copytree(ops_build.csrc_dir(), csrc)
    mutated = csrc / source
    mutated.write_text(mutate(mutated.read_text()))
    env = {**os.environ, "SYNCBN_EMU_CSRC": str(csrc), "SYNCBN_EMU_FULL": "0"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *cases],
        cwd=TESTS,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-3000:]  # tests failed (not an error collecting them)
    assert "failed" in output and failure in output
    print(output[-2500:])  # which cases failed and why, for the record (pytest -s)
