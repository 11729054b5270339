"""Why ``step_statistics(normalize="step")`` trains badly: which of its two departures costs.

Step mode normalizes micro-batch k of an optimizer step over micro-batches 1..k, the earlier
ones detached. It differs from BatchNorm over the whole step in two ways: the **count** (each
micro-batch sees a different, growing set of samples) and the **path** (no gradient reaches a
micro-batch's samples through the later micro-batches' statistics). This toy separates them in a
2 x 2, plus torch's per-micro-batch BatchNorm:

===================  ====================================  ==============
variant              micro-batch k normalized over          gradient path
===================  ====================================  ==============
``whole``            every micro-batch of the step          whole
``whole_detached``   every micro-batch of the step          own only
``causal``           micro-batches 1..k                     whole
``causal_detached``  micro-batches 1..k (``"step"`` mode)   own only
``micro``            micro-batch k alone (torch)            whole
===================  ====================================  ==============

"Own only": the other micro-batches' statistics are constants in the backward. Within one
optimizer step the weights do not change, so the K micro-batches' summed gradients equal one
backward of the concatenated step with a group-aware normalization (:class:`StepNorm`): that is
how every variant runs here. ``causal_detached`` is the library's step mode, and
``tests/test_step_ablation.py`` checks it against ``SyncBatchNorm`` inside ``step_statistics``.

The task: a small conv net learns a fixed random conv teacher's 10 classes from inputs with a
random per-sample gain and offset (so normalization matters). Every variant shares the seed's
initialization, data and running-statistics rule (one update per step from the whole step's
statistics), so only the training calls' normalization differs. It prints, per variant, the final
training loss (under the variant's own training normalization), the held-out loss and accuracy with
the running statistics (mean ± std over seeds), and the accuracy's difference to the first
variant's on the same seed::

    python -m experiments.step_ablation --seeds 8 --steps 1200
"""

from __future__ import annotations

import argparse
import functools
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

#: Each variant: (micro-batch k's statistics include micro-batch j) and (j's are detached in k's).
VARIANTS: dict[str, tuple[Callable[[int, int], bool], bool]] = {
    "whole": (lambda j, k: True, False),
    "whole_detached": (lambda j, k: True, True),
    "causal": (lambda j, k: j <= k, False),
    "causal_detached": (lambda j, k: j <= k, True),
    "micro": (lambda j, k: j == k, False),
}


class StepNorm(nn.Module):
    """BatchNorm2d over a whole optimizer step's K micro-batches concatenated on dim 0 (equal
    sizes), each micro-batch normalized with the statistics :data:`VARIANTS` names.

    The running statistics take one update per training forward (one per step) from the whole
    step's mean and unbiased variance, whatever the variant.
    """

    def __init__(self, channels: int, variant: str, micro_batches: int, momentum: float = 0.1):
        super().__init__()
        self.include, self.detach = VARIANTS[variant]
        self.micro_batches, self.momentum, self.eps = micro_batches, momentum, 1e-5
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.register_buffer("running_mean", torch.zeros(channels))
        self.register_buffer("running_var", torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (1, -1, 1, 1)
        if not self.training:
            mean, var = self.running_mean.view(shape), self.running_var.view(shape)
            return (x - mean) / (var + self.eps).sqrt() * self.weight.view(shape) + self.bias.view(
                shape
            )
        groups = x.unflatten(0, (self.micro_batches, -1))  # (K, n, C, H, W)
        means = groups.mean(dim=(1, 3, 4))  # (K, C): every micro-batch's own statistics
        m2s = ((groups - means[:, None, :, None, None]) ** 2).sum(dim=(1, 3, 4))
        count = groups[0, :, 0].numel()  # the samples of one micro-batch in one channel
        outputs = []
        for k in range(self.micro_batches):
            mean, var = self._merged(means, m2s, count, k)
            scale = self.weight / (var + self.eps).sqrt()
            outputs.append(
                (groups[k] - mean.view(shape)) * scale.view(shape) + self.bias.view(shape)
            )
        with torch.no_grad():
            whole_var = x.var(dim=(0, 2, 3), unbiased=True)
            self.running_mean.lerp_(x.mean(dim=(0, 2, 3)), self.momentum)
            self.running_var.lerp_(whole_var, self.momentum)
        return torch.cat(outputs)

    def _merged(
        self, means: torch.Tensor, m2s: torch.Tensor, count: int, k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch k's mean and biased variance: the count-weighted merge of the included
        micro-batches' (mean, M2), the others' detached where the variant says so."""
        parts = [
            (means[j], m2s[j])
            if j == k or not self.detach
            else (means[j].detach(), m2s[j].detach())
            for j in range(self.micro_batches)
            if self.include(j, k)
        ]
        mean = torch.stack([m for m, _ in parts]).mean(dim=0)  # equal counts: a plain mean
        m2 = sum(m2 + count * (m - mean) ** 2 for m, m2 in parts)
        return mean, m2 / (count * len(parts))


def student(norm: Callable[[int], nn.Module], width: int = 16) -> nn.Sequential:
    """Three conv-norm-ReLU blocks, pooled, to 10 classes."""
    layers: list[nn.Module] = []
    channels = 3
    for out in (width, 2 * width, 2 * width):
        layers += [nn.Conv2d(channels, out, 3, padding=1, bias=False), norm(out), nn.ReLU()]
        layers.append(nn.MaxPool2d(2))
        channels = out
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10))


@dataclass(frozen=True)
class Task:
    """The seed's teacher: labels are the argmax of a fixed random conv net's 10 outputs, each
    output standardized over a reference sample (so the classes are about balanced)."""

    teacher: nn.Module
    center: torch.Tensor
    scale: torch.Tensor

    @classmethod
    @functools.cache
    def of(cls, seed: int) -> Task:
        torch.manual_seed(10_000 + seed)
        teacher = nn.Sequential(
            nn.Conv2d(3, 8, 5, padding=2), nn.Tanh(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
            nn.Linear(8, 10),
        )  # fmt: skip
        teacher.requires_grad_(False)
        logits = teacher(torch.randn(10_000, 3, 16, 16) * 2 + torch.randn(10_000, 1, 1, 1) * 2)
        return cls(teacher, logits.mean(dim=0), logits.std(dim=0))

    def batch(self, size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``size`` inputs (3x16x16 noise with a random gain and offset per sample) and their
        labels."""
        gain = torch.rand(size, 1, 1, 1, generator=generator) * 3 + 0.5
        offset = torch.randn(size, 1, 1, 1, generator=generator) * 2
        x = torch.randn(size, 3, 16, 16, generator=generator) * gain + offset
        return x, ((self.teacher(x) - self.center) / self.scale).argmax(dim=1)


@dataclass(frozen=True)
class Outcome:
    """One trained variant: its mean training loss over the last tenth of the steps (under its
    own training normalization), and its held-out loss and accuracy with the running
    statistics (what every variant is judged by alike)."""

    final_loss: float
    held_out_loss: float
    accuracy: float


def train(
    variant: str, seed: int, steps: int, micro_batches: int = 4, micro_size: int = 2
) -> Outcome:
    """Train the seed's student with ``variant``'s normalization (SGD, momentum 0.9)."""
    task = Task.of(seed)
    torch.manual_seed(seed)
    net = student(lambda c: StepNorm(c, variant, micro_batches))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x, y = task.batch(micro_batches * micro_size, data)
        # The step's mean loss: each micro-batch's mean over K, summed, as accumulation does.
        loss = nn.functional.cross_entropy(net(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    net.eval()
    with torch.no_grad():
        x, y = task.batch(2000, torch.Generator().manual_seed(1_000_000 + seed))
        logits = net(x)
    tail = losses[-max(1, steps // 10) :]
    return Outcome(
        sum(tail) / len(tail),
        nn.functional.cross_entropy(logits, y).item(),
        (logits.argmax(dim=1) == y).float().mean().item(),
    )


def _spread(values: Sequence[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = parser.parse_args(argv)
    runs = {v: [train(v, seed, args.steps) for seed in range(args.seeds)] for v in args.variants}
    base = runs[args.variants[0]]
    print(
        f"{args.seeds} seeds x {args.steps} steps of 4 micro-batches x 2 samples; mean ± std over "
        f"seeds; a difference is paired (the same seed's {args.variants[0]})"
    )
    print(
        "| variant | final training loss | held-out loss | held-out accuracy "
        f"| accuracy - {args.variants[0]}'s |"
    )
    print("|---|---|---|---|---|")
    for variant, outcomes in runs.items():
        paired = [o.accuracy - b.accuracy for o, b in zip(outcomes, base, strict=True)]
        cells = [
            _spread([o.final_loss for o in outcomes]),
            _spread([o.held_out_loss for o in outcomes]),
            _spread([o.accuracy for o in outcomes]),
            _spread(paired),
        ]
        print(f"| {variant} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
