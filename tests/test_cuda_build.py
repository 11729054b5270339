"""Layer 0 build check: the CUDA sources compile with torch's headers, on a machine without a GPU.

``nvcc`` compiles every ``.cu`` of ``csrc/cuda`` to an object for sm_90 and the host compiler
checks every ``.cpp`` under ``csrc/`` with ``-DWITH_CUDA`` (the dispatch's CUDA branch), so a
syntax or template error in the GPU code fails CI even though CI has no GPU. Skipped where
``nvcc`` is absent, unless
``SYNCBN_REQUIRE_NVCC=1`` (set by ``.ci/run``) makes a missing ``nvcc`` a failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from syncbn_lightning.ops import build as ops_build
from syncbn_lightning.ops import compile_check

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def nvcc() -> str:
    found = compile_check._nvcc()
    if found is None:
        if os.environ.get("SYNCBN_REQUIRE_NVCC") == "1":
            pytest.fail("SYNCBN_REQUIRE_NVCC=1 but nvcc is neither in CUDA_HOME nor on PATH")
        pytest.skip("nvcc is not installed")
    return found


def test_cuda_sources_compile_for_sm90(nvcc: str, tmp_path: Path) -> None:
    objects = compile_check.cuda_compile_check(tmp_path)
    assert [o.name for o in objects] == [
        "backward_cuda.o",
        "entry_cuda.o",
        "entry_reduce_cuda.o",
        "normalize_cuda.o",
        "order_flags_cuda.o",
        "stats_cuda.o",
    ]
    symbols = "".join(
        subprocess.run(
            ["nm", "-C", "--defined-only", str(o)], capture_output=True, text=True, check=True
        ).stdout
        for o in objects
    )
    # Every primitive's and fused step's CUDA twin is defined with the signature its caller uses
    # (ops/primitives.cpp for the primitives, ops/ops.cpp for the fused steps: their many
    # arguments in one struct).
    first = {
        "merge_normalize": "syncbn::MergeArgs const&",
        "reduce_merge_normalize": "syncbn::MergeArgs const&",
        "grad_sums": "syncbn::GradArgs const&",
        "grad_sums_residual": "syncbn::GradArgs const&",
        "grad_input": "syncbn::GradArgs const&",
    }
    for name in (
        "local_stats", "merge_stats", "normalize", "backward_reduce", "backward_elemt",
        "stats_row", "merge_normalize", "reduce_sums", "reduce_merge_normalize", "grad_sums",
        "grad_sums_residual", "grad_input",
    ):  # fmt: skip
        argument = first.get(name, "at::Tensor const&")
        assert f"syncbn::{name}_cuda({argument}" in symbols, name
    # The C++ path's call-order flags on CUDA devices (csrc/include/flag_store.h).
    assert "syncbn::cuda_flag_store(signed char)" in symbols


def test_compile_check_reports_a_broken_source(
    nvcc: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    csrc = tmp_path / "csrc"
    shutil.copytree(ops_build.include_dir(ops_build.csrc_dir()), ops_build.include_dir(csrc))
    (csrc / "cuda").mkdir()
    (csrc / "cuda" / "broken.cu").write_text(
        '#include "syncbn.h"\n__global__ void k(float* x) { x[threadIdx.x] = undefined_name; }\n'
    )
    monkeypatch.setattr(ops_build, "csrc_dir", lambda: csrc)
    with pytest.raises(
        ops_build.ExtensionBuildError, match=r"(?s)compile check failed .*undefined_name"
    ):
        compile_check.cuda_compile_check(tmp_path / "out")


def test_the_unity_units_compile_whole_with_cuda(nvcc: str, tmp_path: Path) -> None:
    """The extension's two units (every .cpp of a unit in one translation unit) compile with
    -DWITH_CUDA, as the CUDA build compiles them: the per-file check above cannot see a clash
    between two files of one unit."""
    units = compile_check.unity_compile_check(tmp_path)
    assert [u.name for u in units] == ["unity_operators.cpp", "unity_kernels.cpp"]
    included = "".join(u.read_text() for u in units)
    for source in ops_build.csrc_files(ops_build.csrc_dir(), ".cpp"):
        assert str(source.resolve()) in included, source
