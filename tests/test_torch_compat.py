"""What users of ``torch.nn.SyncBatchNorm`` and Lightning's ``TorchSyncBatchNorm`` write, with
our layers: torch's classmethod converter, groups that do not include every rank, and the
LayerSync plugin applied by hand outside a Trainer. Real gloo ranks (``_dist.run_distributed``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed
from torch import nn

from syncbn_lightning import SyncBatchNorm, SyncBNLayerSync, revert_sync_batchnorm

# gloo processes and a Lightning Trainer: outside the fast check.
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.ReLU(), nn.BatchNorm2d(4))


def _batch(rank: int) -> torch.Tensor:
    torch.manual_seed(100 + rank)
    return torch.randn(2 + rank, 3, 4, 4)  # uneven: 2 and 3 samples


def test_classmethod_converter_returns_our_layers() -> None:
    net = SyncBatchNorm.convert_sync_batchnorm(_net(), process_group=None)
    layers = [m for m in net.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert [type(m) for m in layers] == [SyncBatchNorm, SyncBatchNorm]
    assert type(revert_sync_batchnorm(net)[1]) is nn.BatchNorm2d


def _layer_sync_worker(rank: int, world: int) -> list[float]:
    # Outside a Trainer, LOCAL_WORLD_SIZE unset, group_size=None: the plugin converts and the
    # layers synchronize over the world, as Lightning's TorchSyncBatchNorm().apply does.
    plugin = SyncBNLayerSync()
    net = plugin.apply(_net())
    assert [type(m) for m in net if isinstance(m, nn.modules.batchnorm._BatchNorm)] == [
        SyncBatchNorm,
        SyncBatchNorm,
    ]
    net(_batch(rank))
    assert type(plugin.revert(net)[1]) is nn.BatchNorm2d
    return net[1].running_mean.tolist()


def test_layer_sync_apply_outside_a_trainer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    means = run_distributed(_layer_sync_worker, 2, timeout=120)
    assert means[0] == means[1]  # one group: the same running statistics on both ranks
    # ... equal to one BatchNorm over both ranks' batches
    reference = _net()
    reference(torch.cat([_batch(0), _batch(1)]))
    torch.testing.assert_close(torch.tensor(means[0]), reference[1].running_mean)


def test_layer_sync_node_outside_a_trainer_says_what_it_needs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    for message in run_distributed(_node_worker, 2, timeout=120):
        assert message.startswith("SyncBNLayerSync(group_size='node') needs the number"), message


def _node_worker(rank: int, world: int) -> str:
    try:
        SyncBNLayerSync(group_size="node").apply(_net())
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_layer_sync_without_torch_distributed_converts_for_a_local_batch() -> None:
    net = SyncBNLayerSync().apply(_net())
    assert type(net[1]) is SyncBatchNorm
    x = torch.randn(2, 3, 4, 4)
    torch.testing.assert_close(net(x), _net()(x))


def _non_member_worker(rank: int, world: int) -> str:
    group = dist.new_group([0])  # on rank 1: torch's "not a member" placeholder
    net = SyncBatchNorm.convert_sync_batchnorm(_net(), process_group=group)
    net.eval()
    net(_batch(rank))  # evaluation needs no group
    net.train()
    if rank == 0:
        net(_batch(rank))  # a group of one rank: plain BatchNorm over this batch
        return "trained"
    try:
        net(_batch(rank))
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_groups_without_this_rank_convert_and_fail_only_when_trained() -> None:
    results = run_distributed(_non_member_worker, 2, timeout=120)
    assert results[0] == "trained"
    assert results[1].startswith(
        "this rank (global rank 1) is not a member of the layer's process_group, so it cannot "
        "train the layer with it (evaluation works)"
    ), results[1]
