"""Small float64 nets and steps for the activation-checkpointing tests (``test_checkpoint*.py``):
the same net checkpointed in each of torch's ways and unchecked, and what a step measures."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from syncbn_lightning import SyncBatchNorm, convert_sync_batchnorm
from syncbn_lightning.distributed.flight import recorder as flight

#: How a test runs the net's forward: unchecked, or under one of torch's checkpoints.
MODES = ("plain", "reentrant", "non_reentrant", "sequential", "wrapper", "wrapper_reentrant")


class ResidualTail(nn.Module):
    """conv -> SyncBatchNorm with the shortcut added and ReLU fused (``add_act``)."""

    def __init__(self, channels: int, exchange: str, force_sync: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn = SyncBatchNorm(channels, exchange=exchange, force_sync=force_sync)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn.add_act(self.conv(x), x, nn.ReLU())


def net(exchange: str = "auto", seed: int = 0, force_sync: bool = False) -> nn.Sequential:
    """conv-BN-ReLU, conv-BN-ReLU, a residual tail (fused add and ReLU): float64, converted
    (``force_sync``: synchronized in a one-rank group too)."""
    torch.manual_seed(seed)
    body = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
    )
    converted = convert_sync_batchnorm(body, exchange=exchange, force_sync=force_sync)
    model = nn.Sequential(*converted, ResidualTail(4, exchange, force_sync))
    for layer in model.modules():
        if isinstance(layer, SyncBatchNorm):
            layer.reset_parameters()
            with torch.no_grad():  # affine parameters away from 1 and 0
                layer.weight.uniform_(0.5, 1.5)
                layer.bias.uniform_(-0.5, 0.5)
    return model.double()


def forward(model: nn.Module, x: torch.Tensor, mode: str) -> torch.Tensor:
    """``model(x)`` unchecked or under the checkpoint ``mode`` names (the wrapper: FSDP's
    ``checkpoint_wrapper`` around each of the model's children)."""
    if mode == "plain":
        return model(x)
    if mode in ("reentrant", "non_reentrant"):
        return checkpoint(model, x, use_reentrant=mode == "reentrant")
    if mode == "sequential":
        return checkpoint_sequential(model, 3, x, use_reentrant=False)
    if mode.startswith("wrapper"):
        return wrapped(model, mode)(x)
    raise ValueError(mode)


def wrapped(model: nn.Module, mode: str) -> nn.Module:
    """``model``'s children each in FSDP's ``checkpoint_wrapper`` (made once per model)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    cached = getattr(model, "_wrapped", None)
    if cached is None:
        impl = (
            CheckpointImpl.REENTRANT if mode.endswith("reentrant") else CheckpointImpl.NO_REENTRANT
        )
        cached = nn.Sequential(
            *(checkpoint_wrapper(child, checkpoint_impl=impl) for child in model.children())
        )
        object.__setattr__(model, "_wrapped", cached)
    return cached


def flight_records() -> dict[tuple[str, int], str]:
    """The flight recorder's records in this process, (group, seq) -> direction (its ring keeps
    the last 256: a step's are all there)."""
    recorder = flight.current_recorder()
    records = recorder.records() if recorder is not None else []
    return {(r.group, r.seq): r.direction for r in records}


def collectives_since(before: dict[tuple[str, int], str]) -> tuple[int, int]:
    """(forward, backward) collectives recorded since ``before`` (:func:`flight_records`)."""
    new = [d for key, d in flight_records().items() if key not in before]
    return sum(1 for d in new if d == "forward"), sum(1 for d in new if d == "backward")


def steps(
    model: nn.Module, mode: str, inputs: list[torch.Tensor], loss: Callable[[torch.Tensor], Any]
) -> dict[str, Any]:
    """Run one forward and backward per input under ``mode``; what a test compares: outputs,
    input and parameter gradients, buffers, and the collectives per step."""
    outputs, input_grads, collectives = [], [], []
    for x in inputs:
        before = flight_records()
        x = x.clone().requires_grad_()
        y = forward(model, x, mode)
        loss(y).backward()
        collectives.append(collectives_since(before))
        outputs.append(y.detach())
        input_grads.append(x.grad)
    return {
        "outputs": outputs,
        "input_grads": input_grads,
        "param_grads": [p.grad.clone() for p in model.parameters()],
        "buffers": {k: v.clone() for k, v in model.state_dict().items()},
        "collectives": collectives,
    }


def rank_inputs(rank: int, sizes: list[int], count: int, seed: int = 5) -> list[torch.Tensor]:
    """``count`` batches of this rank's share (``sizes[rank]`` samples) of float64 images."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        whole = torch.randn(sum(sizes), 3, 5, 5, generator=g, dtype=torch.float64) * 2 + 0.5
        batches.append(whole[sum(sizes[:rank]) : sum(sizes[: rank + 1])])
    return batches


def square_loss(y: torch.Tensor) -> torch.Tensor:
    return (y * y).sum()
