"""How the files beside this script were made: run once with syncbn_lightning at commit 18954e7,
the last commit before the library was split into subpackages (`python make_legacy.py` from this
folder). tests/test_legacy.py loads them with today's code; nothing regenerates them.

* ``model.pt``: ``torch.save`` of a whole converted model (pickled classes at their old module
  paths: ``syncbn_lightning.batchnorm.SyncBatchNorm``, ``syncbn_lightning.batchnorm_act
  .SyncBatchNormAct``) after two synchronized training steps, plus its input and expected outputs.
* ``lightning.ckpt``: a Lightning checkpoint of ``tests/_lightning.BNNet`` trained 3 steps on two
  gloo ranks with ``SyncBNCallback(group_size=1)`` (state_dict with plain BatchNorm keys, the
  callback's state under ``"SyncBNCallback"``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # tests/, for _lightning


def _model() -> nn.Module:
    from syncbn_lightning import SyncBatchNormAct, convert_sync_batchnorm

    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 4, 1),
    )
    net = convert_sync_batchnorm(net, force_sync=True, momentum=0.2)
    net.add_module("act", SyncBatchNormAct(4, act="silu", force_sync=True))
    return net


def make_model() -> None:
    net = _model()
    x = torch.randn(5, 3, 6, 6, generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        net(x).square().mean().backward()
        opt.step()
    net.train()
    train_out = net(x).detach()
    net.eval()
    eval_out = net(x).detach()
    net.train()
    torch.save(
        {"model": net, "input": x, "train_output": train_out, "eval_output": eval_out},
        HERE / "model.pt",
    )


def make_checkpoint() -> None:
    from _lightning import BNNet, trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from syncbn_lightning import SyncBNCallback

    ckpt = ModelCheckpoint(dirpath=str(HERE / "tmp_ckpt"), save_last=True)
    trainer(
        2,
        [SyncBNCallback(group_size=1, log_every_n_steps=1), ckpt],
        max_steps=3,
        enable_checkpointing=True,
    ).fit(BNNet(batch_size=[3, 2]))
    (HERE / "tmp_ckpt" / "last.ckpt").rename(HERE / "lightning.ckpt")
    for leftover in (HERE / "tmp_ckpt").iterdir():
        leftover.unlink()
    (HERE / "tmp_ckpt").rmdir()


if __name__ == "__main__":
    make_model()
    make_checkpoint()
