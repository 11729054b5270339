"""Layer 4 in one process: without torch.distributed the layer is exactly ``nn.BatchNorm``; forced
sync on one rank matches it for every dtype and implementation; bad arguments and inputs give
errors naming them; the state_dict is BatchNorm's; CUDA tensors (``gpu``) train like BatchNorm.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _numerics import rel_err
from torch import nn

from syncbn_lightning import SyncBatchNorm
from syncbn_lightning.functional import sync_batch_norm

# ------------------------------------------------------------------------------------------------
# Single process: exactly nn.BatchNorm, dtype handling
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(6, 3), (4, 3, 5), (2, 3, 4, 4), (2, 3, 2, 3, 2)])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_without_distributed_it_is_exactly_batchnorm(shape: tuple[int, ...], momentum: Any) -> None:
    torch.manual_seed(0)
    ours = SyncBatchNorm(3, momentum=momentum)
    oracle = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}
    theirs = oracle[len(shape)](3, momentum=momentum)
    for _ in range(3):
        x = torch.randn(shape)
        torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)
    torch.testing.assert_close(ours.running_var, theirs.running_var, rtol=0, atol=0)
    ours.eval()
    theirs.eval()
    x = torch.randn(shape)
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)


@pytest.mark.parametrize("impl", ["ext", "ref"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_forced_sync_single_rank_matches_batchnorm(
    impl: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SYNCBN_IMPL", impl)
    torch.manual_seed(1)
    param_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    ours = SyncBatchNorm(4, force_sync=True, dtype=param_dtype)
    theirs = nn.BatchNorm2d(4, dtype=param_dtype)
    x = torch.randn(3, 4, 5, 5, dtype=dtype) * 3 + 1
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = ours(x1), theirs(x2)
    dy = torch.randn_like(y1)
    y1.backward(dy)
    y2.backward(dy)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, 2e-2)
    assert y1.dtype == dtype
    assert rel_err(y1, y2) <= tol
    assert rel_err(x1.grad, x2.grad) <= tol
    assert rel_err(ours.weight.grad, theirs.weight.grad) <= max(tol, 1e-5)
    assert rel_err(ours.running_var, theirs.running_var) <= max(tol, 1e-5)


def test_nan_in_the_input_propagates_like_batchnorm() -> None:
    x = torch.randn(4, 2, 3)
    x[1, 0, 2] = float("nan")
    ours, theirs = SyncBatchNorm(2, force_sync=True), nn.BatchNorm1d(2)
    y1, y2 = ours(x), theirs(x)
    assert torch.isnan(y1[:, 0]).all() and torch.isnan(y2[:, 0]).all()
    torch.testing.assert_close(y1[:, 1], y2[:, 1])


def test_track_running_stats_false_uses_batch_stats_in_eval() -> None:
    ours, theirs = (
        SyncBatchNorm(3, track_running_stats=False),
        nn.BatchNorm2d(3, track_running_stats=False),
    )
    ours.eval()
    theirs.eval()
    x = torch.randn(2, 3, 4, 4) * 5
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)
    assert ours.running_mean is None


# ------------------------------------------------------------------------------------------------
# Bad input: clear errors naming the argument
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_features": 0}, ValueError, "num_features must be > 0"),
        ({"num_features": -3}, ValueError, "num_features must be > 0"),
        ({"num_features": 2.5}, TypeError, "num_features must be an int"),
        ({"num_features": 4, "eps": 0.0}, ValueError, "eps must be a finite float > 0"),
        ({"num_features": 4, "eps": -1e-5}, ValueError, "eps must be a finite float > 0"),
        ({"num_features": 4, "momentum": 1.5}, ValueError, r"momentum must be in \[0, 1\]"),
        ({"num_features": 4, "momentum": -0.1}, ValueError, r"momentum must be in \[0, 1\]"),
        ({"num_features": 4, "momentum": "0.1"}, TypeError, "momentum must be a float"),
        ({"num_features": 4, "process_group": 2}, TypeError, "process_group must be"),
    ],
)
def test_constructor_rejects_bad_arguments(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        SyncBatchNorm(**kwargs)


@pytest.mark.parametrize(
    ("make_input", "error", "match"),
    [
        (lambda: torch.randn(4), ValueError, r"at least 2 dims, got 1-D input"),
        (lambda: torch.randn(2, 5, 3), ValueError, r"has 5 channels .* num_features=4"),
        (lambda: torch.ones(2, 4, 3, dtype=torch.int64), TypeError, "must be floating point"),
        (lambda: torch.randn(2, 4, dtype=torch.complex64), TypeError, "must be floating point"),
        (lambda: torch.randn(2, 4, 3, dtype=torch.float64), TypeError, "weight dtype"),
        (lambda: torch.randn(2, 4, 3, device="meta"), ValueError, r"model\.to\('meta'\)"),
    ],
)
@pytest.mark.parametrize("force_sync", [False, True])
def test_forward_rejects_bad_input(
    make_input: Any, error: type, match: str, force_sync: bool
) -> None:
    with pytest.raises(error, match=match):
        SyncBatchNorm(4, force_sync=force_sync)(make_input())


def test_one_value_per_channel_single_process_gives_torchs_error() -> None:
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        SyncBatchNorm(3, force_sync=True)(torch.randn(1, 3))
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        SyncBatchNorm(3)(torch.randn(1, 3))


def test_state_dict_is_batchnorm_compatible() -> None:
    ours, theirs = SyncBatchNorm(3), nn.BatchNorm2d(3)
    ours(torch.randn(4, 3, 2, 2))
    assert list(ours.state_dict()) == list(theirs.state_dict())
    theirs.load_state_dict(ours.state_dict())
    torch.testing.assert_close(theirs.running_mean, ours.running_mean)
    # an old checkpoint without num_batches_tracked (version 1) still loads
    old = {k: v for k, v in theirs.state_dict().items() if k != "num_batches_tracked"}
    old_meta = type(theirs.state_dict())(old)
    old_meta._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    fresh = SyncBatchNorm(3)
    fresh.load_state_dict(old_meta)
    assert fresh.num_batches_tracked.item() == 0


def test_mixed_precision_input_with_float32_parameters() -> None:
    x = torch.randn(4, 3, 5, 5).bfloat16()
    ours = SyncBatchNorm(3, force_sync=True)
    theirs = nn.BatchNorm2d(3)
    assert ours(x).dtype == torch.bfloat16
    assert rel_err(ours(x), theirs(x)) < 2e-2


def test_functional_form_matches_f_batch_norm() -> None:
    x = torch.randn(5, 3, 4)
    y, _mean, var, count, _samples = sync_batch_norm(x, None, None, 1e-5, None, 1)
    torch.testing.assert_close(y, F.batch_norm(x, None, None, training=True), rtol=1e-5, atol=1e-6)
    assert count.item() == 20
    torch.testing.assert_close(var, x.var((0, 2), correction=1))


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["auto", "ext", "ref"])
def test_cuda_tensors_train_like_batchnorm_with_every_implementation(
    impl: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CUDA inputs take the CUDA kernels (auto, ext) or the reference (ref), without a warning."""
    monkeypatch.setenv("SYNCBN_IMPL", impl)
    torch.manual_seed(5)
    ours = SyncBatchNorm(3, force_sync=True).cuda()
    theirs = nn.BatchNorm2d(3).cuda()
    x = (torch.randn(4, 3, 6, 6, device="cuda") * 2 + 1).requires_grad_(True)
    x2 = x.detach().clone().requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a fallback warning would be a defect
        y = ours(x)
    y2 = theirs(x2)
    dy = torch.randn_like(y)
    y.backward(dy)
    y2.backward(dy)
    assert rel_err(y, y2) < 1e-5 and rel_err(x.grad, x2.grad) < 1e-5
    assert rel_err(ours.running_var, theirs.running_var) < 1e-5
