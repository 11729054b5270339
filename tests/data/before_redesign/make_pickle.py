"""How ``model.pt`` beside this script was made: run once with syncbn_lightning at commit e3381e2,
the last commit before the library was rebuilt around one synchronized call (issue 71), with
``python make_pickle.py`` from this folder. ``tests/test_legacy.py`` loads it with today's code;
nothing regenerates it.

``model.pt``: ``torch.save`` of a whole converted model after a synchronized training step
(``force_sync=True``, no process group: every kernel of the synchronized path): its layers hold
their ``SyncOptions`` and the last batch's record (``BatchRecord``: the group's mean, variance and
info tensors), pickled at the module paths of that commit; with its input and the outputs it gave
in eval and in training mode.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent


def make_model() -> None:
    from syncbn_lightning import SyncBatchNormAct, convert_sync_batchnorm

    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 1)
    )
    net = convert_sync_batchnorm(net, force_sync=True, momentum=0.2, exchange="reduce")
    net.add_module("act", SyncBatchNormAct(4, act="silu", force_sync=True))
    x = torch.randn(5, 3, 6, 6, generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    opt.zero_grad()
    net(x).square().mean().backward()
    opt.step()
    assert net[1].last_batch is not None and net[1].last_batch.mean is not None
    with torch.no_grad():
        train_out = net(x).detach()  # batch statistics (and one more running-stat update)
    net.eval()
    eval_out = net(x).detach()  # the running statistics saved below
    net.train()
    torch.save(
        {"model": net, "input": x, "train_output": train_out, "eval_output": eval_out},
        HERE / "model.pt",
    )


if __name__ == "__main__":
    make_model()
