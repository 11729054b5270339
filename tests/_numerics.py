"""Error metrics shared by the tests."""

from __future__ import annotations

import copy

import torch


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Normwise relative error ``max|a - e| / max|e|`` (0 for two empty tensors).

    Elementwise relative error is meaningless where the expected value crosses zero (normalized
    outputs, gradients), so every "relative error" bound in the tests means this one.
    """
    if expected.numel() == 0:
        assert actual.numel() == 0
        return 0.0
    a, e = actual.detach().cpu().double(), expected.detach().cpu().double()
    scale = e.abs().max().clamp_min(torch.finfo(torch.float64).tiny)
    return ((a - e).abs().max() / scale).item()


def sum_err(actual: torch.Tensor, truth: torch.Tensor, abs_sum: torch.Tensor) -> float:
    """Error of a computed sum relative to the sum of its terms' magnitudes, ``max|a - t| / Σ|x|``.

    A floating-point sum of terms ``x_i`` is only accurate to ``O(n·eps)·Σ|x_i|``, not to the
    size of the result: when the terms nearly cancel (Σdy of random gradients), the result is
    tiny and the normwise error of a correct kernel can be arbitrarily large. ``truth`` is the sum
    in float64 and ``abs_sum`` the float64 sum of ``|x_i|``, per channel.
    """
    if truth.numel() == 0:
        return 0.0
    scale = abs_sum.detach().cpu().double().clamp_min(torch.finfo(torch.float64).tiny)
    a, t = actual.detach().cpu().double(), truth.detach().cpu().double()
    return ((a - t).abs() / scale).max().item()


def assert_one_graph_and_compiled_matches_eager(net: torch.nn.Module, x: torch.Tensor) -> None:
    """``torch._dynamo.explain``: one graph, no break; then ``net`` compiled (``aot_eager``,
    ``fullgraph``) gives eager's output and input gradient (loss: the output's squares summed)."""
    torch._dynamo.reset()
    explained = torch._dynamo.explain(net)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    compiled = torch.compile(copy.deepcopy(net), backend="aot_eager", fullgraph=True)
    results = []
    for model in (net, compiled):
        xi = x.clone().requires_grad_(True)
        out = model(xi)
        out.square().sum().backward()
        results.append((out.detach(), xi.grad))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-5, atol=1e-5)
