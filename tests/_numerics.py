"""Error metrics shared by the tests."""

from __future__ import annotations

import torch


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Normwise relative error ``max|a - e| / max|e|`` (0 for two empty tensors).

    Elementwise relative error is meaningless where the expected value crosses zero (normalized
    outputs, gradients), so every "relative error" bound in the tests means this one.
    """
    if expected.numel() == 0:
        assert actual.numel() == 0
        return 0.0
    a, e = actual.detach().double(), expected.detach().double()
    scale = e.abs().max().clamp_min(torch.finfo(torch.float64).tiny)
    return ((a - e).abs().max() / scale).item()
