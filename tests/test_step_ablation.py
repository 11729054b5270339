"""The step-mode ablation (``experiments/step_ablation.py``) measures what it says it measures.

Its ``causal_detached`` variant, one backward of the concatenated step, is the library's
``step_statistics(normalize="step")`` over K sequential micro-batches: the same outputs, the same
summed gradients and the same running statistics after the step, in float64. Its other variants
differ from it only where the table says, and the command prints one row per variant.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from experiments.step_ablation import StepNorm, Task, main, student
from syncbn_lightning import SyncBatchNorm, step_statistics

K, MICRO = 4, 2


def _twins() -> tuple[nn.Module, nn.Module, torch.Tensor, torch.Tensor]:
    """The ablation's student with ``causal_detached`` norms, the same weights with the
    library's layers (no group), and one step's inputs and labels, in float64."""
    torch.manual_seed(0)
    toy = student(lambda c: StepNorm(c, "causal_detached", K)).double()
    library = copy.deepcopy(toy)
    for i, layer in enumerate(library):
        if isinstance(layer, StepNorm):
            twin = SyncBatchNorm(layer.weight.numel()).double()
            twin.load_state_dict(layer.state_dict(), strict=False)
            library[i] = twin
    x, y = Task.of(0).batch(K * MICRO, torch.Generator().manual_seed(0))
    return toy, library, x.double(), y


def test_causal_detached_is_the_library_step_mode() -> None:
    toy, library, x, y = _twins()
    toy_out = toy(x)
    nn.functional.cross_entropy(toy_out, y).backward()
    outs = []
    with step_statistics(library, normalize="step"):
        for xs, ys in zip(x.chunk(K), y.chunk(K), strict=True):
            out = library(xs)
            (nn.functional.cross_entropy(out, ys) / K).backward()
            outs.append(out.detach())
    torch.testing.assert_close(torch.cat(outs), toy_out.detach(), rtol=0, atol=1e-10)
    for (name, a), b in zip(toy.named_parameters(), library.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=1e-10, msg=name)
    norms = [(a, b) for a, b in zip(toy, library, strict=True) if isinstance(a, StepNorm)]
    for a, b in norms:
        torch.testing.assert_close(b.running_mean, a.running_mean, rtol=0, atol=1e-12)
        torch.testing.assert_close(b.running_var, a.running_var, rtol=0, atol=1e-12)


def test_the_variants_differ_where_the_table_says() -> None:
    """``whole`` is BatchNorm over the step (torch's BatchNorm2d on the concatenation); ``micro``
    is BatchNorm per micro-batch; the detached variants have the same forward as their attached
    twins and another gradient."""
    torch.manual_seed(1)
    x = torch.randn(K * MICRO, 3, 4, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, 4, dtype=torch.float64)

    def run(variant: str) -> tuple[torch.Tensor, torch.Tensor]:
        norm = StepNorm(3, variant, K).double()
        out = norm(x)
        (grad,) = torch.autograd.grad((out * w).sum(), x)
        return out.detach(), grad

    bn = nn.functional.batch_norm
    whole, micro = run("whole"), run("micro")
    torch.testing.assert_close(whole[0], bn(x, None, None, training=True).detach())
    per_micro = torch.cat([bn(c, None, None, training=True) for c in x.chunk(K)])
    torch.testing.assert_close(micro[0], per_micro.detach())
    for attached in ("whole", "causal"):
        a, d = run(attached), run(f"{attached}_detached")
        torch.testing.assert_close(d[0], a[0], rtol=0, atol=1e-12)
        assert (d[1] - a[1]).abs().max() > 1e-3  # another backward


@pytest.mark.slow
def test_the_command_prints_a_row_per_variant(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--seeds", "2", "--steps", "3"])
    rows = capsys.readouterr().out.splitlines()[3:]
    assert [row.split(" | ")[0].lstrip("| ") for row in rows] == [
        "whole", "whole_detached", "causal", "causal_detached", "micro",
    ]  # fmt: skip
    assert all(row.count("±") == 4 for row in rows)
    assert rows[0].endswith("| 0.000 ± 0.000 |")  # the first variant's difference to itself
