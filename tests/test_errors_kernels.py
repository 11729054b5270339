"""Section 1 of ``docs/errors.md``: the implementation choice and the C++ kernels' checks.

Each test triggers the error of its row with the row's input and asserts the row's exception type
and message through :func:`_errors_doc.expect_row` (the doc is the one source of both).
"""

from __future__ import annotations

import fcntl
from pathlib import Path

import pytest
import torch
from _errors_doc import clean_environment, expect_row
from torch import nn

from syncbn_lightning import SyncBatchNorm, convert_sync_batchnorm
from syncbn_lightning.ops import build as ops_build
from syncbn_lightning.ops import dispatch as syncbn_ops


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No launcher or cluster variables, the default kernels, W&B quiet."""
    clean_environment(monkeypatch)


@pytest.fixture(scope="module")
def ext():
    """The compiled kernels (built on first use, then loaded from the cache)."""
    return ops_build.load_extension()


@pytest.fixture
def fresh_extension(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``SYNCBN_IMPL=ext`` with an empty cache and no extension loaded or failed in this process
    (both restored afterwards)."""
    monkeypatch.setattr(ops_build, "_ext_module", None)
    monkeypatch.setattr(ops_build, "_ext_error", None)
    monkeypatch.setattr(syncbn_ops, "_choices", {})  # the layers' remembered choice of kernels
    monkeypatch.setenv("SYNCBN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("SYNCBN_IMPL", "ext")


# ----------------------------------------------------------------------------- 1. kernels


def test_torch_below_the_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    """The package's import with an older torch imported: the check reads its version."""
    import importlib

    import syncbn_lightning

    monkeypatch.setattr(torch, "__version__", "2.3.1")
    with expect_row():
        importlib.reload(syncbn_lightning)


def test_impl_unknown_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SYNCBN_IMPL", "fast")
    with expect_row():
        SyncBatchNorm(4, force_sync=True)(torch.randn(2, 4))


def test_native_cuda_unknown_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SYNCBN_NATIVE_CUDA", "yes")
    layer = SyncBatchNorm(4, force_sync=True, device="meta")
    with expect_row():
        layer(torch.randn(2, 4, device="meta"))


def test_impl_argument_unknown() -> None:
    with expect_row():
        SyncBatchNorm(4, impl="cuda")


def test_impl_argument_not_a_string() -> None:
    with expect_row():
        convert_sync_batchnorm(nn.BatchNorm2d(4), impl=1)


def test_impl_ext_without_kernels_for_the_device(monkeypatch: pytest.MonkeyPatch, ext) -> None:
    monkeypatch.setenv("SYNCBN_IMPL", "ext")
    bn = SyncBatchNorm(4, force_sync=True, device="meta")
    with expect_row():
        bn(torch.randn(2, 4, device="meta"))


def test_impl_ext_build_fails(monkeypatch: pytest.MonkeyPatch, fresh_extension: None) -> None:
    monkeypatch.setenv("CXX", "/bin/false")
    with expect_row(build=ops_build.build_dir()):
        SyncBatchNorm(4, force_sync=True)(torch.randn(2, 4))


def test_impl_ext_build_lock_held(monkeypatch: pytest.MonkeyPatch, fresh_extension: None) -> None:
    monkeypatch.setenv("SYNCBN_BUILD_TIMEOUT", "1")
    build = ops_build.build_dir()
    with open(build / ".syncbn_build.flock", "w") as held:  # another build holds the lock
        fcntl.flock(held, fcntl.LOCK_EX)
        with expect_row(build=build):
            SyncBatchNorm(4, force_sync=True)(torch.randn(2, 4))


def test_kernel_input_one_dim(ext) -> None:
    with expect_row():
        ext.local_stats(torch.randn(5))


def test_kernel_input_integer(ext) -> None:
    with expect_row():
        ext.local_stats(torch.ones(2, 3, dtype=torch.int32))


def test_kernel_input_no_channels(ext) -> None:
    with expect_row():
        ext.local_stats(torch.ones(2, 0))


def test_kernel_input_wrong_device(ext) -> None:
    with expect_row():
        ext.local_stats(torch.ones(2, 3, device="meta"))


def test_kernel_stats_wrong_shape(ext) -> None:
    with expect_row():
        ext.normalize(torch.randn(2, 3), torch.zeros(4), torch.ones(3), None, None)


def test_kernel_stats_wrong_dtype(ext) -> None:
    mean = torch.zeros(3, dtype=torch.float64)
    with expect_row():
        ext.normalize(torch.randn(2, 3), mean, torch.ones(3), None, None)


def test_kernel_stats_wrong_device(ext) -> None:
    mean = torch.zeros(3, device="meta")
    with expect_row():
        ext.normalize(torch.randn(2, 3), mean, torch.ones(3), None, None)


def test_kernel_weight_wrong_shape(ext) -> None:
    with expect_row():
        ext.normalize(torch.randn(2, 3), torch.zeros(3), torch.ones(3), torch.ones(2), None)


def test_kernel_merge_means_wrong_shape(ext) -> None:
    with expect_row():
        ext.merge_stats(torch.ones(2), torch.zeros(3, 4), torch.zeros(3, 4), 1e-5, True)


def test_kernel_merge_half_stats(ext) -> None:
    half = torch.zeros(2, 4, dtype=torch.float16)
    with expect_row():
        ext.merge_stats(torch.ones(2), half, half, 1e-5, True)


def test_kernel_merge_mixed_dtypes(ext) -> None:
    counts = torch.ones(2, dtype=torch.float64)
    with expect_row():
        ext.merge_stats(counts, torch.zeros(2, 4), torch.zeros(2, 4), 1e-5, True)


def test_kernel_merge_eps_not_positive(ext) -> None:
    with expect_row():
        ext.merge_stats(torch.ones(1), torch.zeros(1, 4), torch.zeros(1, 4), 0.0, True)


def test_kernel_grad_out_wrong_shape(ext) -> None:
    x, mean, invstd = torch.randn(2, 3), torch.zeros(3), torch.ones(3)
    with expect_row():
        ext.backward_reduce(torch.randn(2, 4), x, mean, invstd, None, False, False)


def test_kernel_grad_out_wrong_dtype(ext) -> None:
    x, mean, invstd = torch.randn(2, 3), torch.zeros(3), torch.ones(3)
    dy = torch.randn(2, 3, dtype=torch.float64)
    with expect_row():
        ext.backward_reduce(dy, x, mean, invstd, None, False, False)


def test_kernel_count_not_one_element(ext) -> None:
    x, mean, invstd = torch.randn(2, 3), torch.zeros(3), torch.ones(3)
    with expect_row():
        ext.backward_elemt(x, x, mean, invstd, None, mean, mean, torch.ones(2))
