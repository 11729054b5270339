"""Our layer is a ``torch.nn.SyncBatchNorm`` exactly where torch's own can run: off the CPU
(``syncbn_lightning/torch_class.py``). Here the "meta" device stands in for a GPU (any device but
the CPU takes the torch class); the real-GPU check (DDP logging ``has_sync_bn``) is marked ``gpu``.
"""

from __future__ import annotations

import copy
import pickle
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from syncbn_lightning import SyncBatchNorm, convert_sync_batchnorm
from syncbn_lightning.nn.batchnorm import SyncBatchNormOnDevice


def test_a_layer_is_a_torch_syncbatchnorm_exactly_off_the_cpu() -> None:
    layer = SyncBatchNorm(4)
    assert type(layer) is SyncBatchNorm and not isinstance(layer, nn.SyncBatchNorm)
    layer.to("meta")
    assert isinstance(layer, nn.SyncBatchNorm) and isinstance(layer, SyncBatchNorm)
    assert repr(layer).startswith("SyncBatchNorm(4, ")  # printed as the class users made
    layer.to_empty(device="cpu")
    assert type(layer) is SyncBatchNorm
    assert type(SyncBatchNorm(4, device="meta")) is SyncBatchNormOnDevice
    on_meta = convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(3)).to("meta"))
    assert type(on_meta[0]) is SyncBatchNormOnDevice  # converted where its tensors already are
    no_tensors = SyncBatchNorm(4, affine=False, track_running_stats=False).to("meta")
    assert type(no_tensors) is SyncBatchNorm  # nothing says where it lives: stays ours only


def test_the_torch_class_runs_our_forward_and_keeps_the_state() -> None:
    """The same layer in both classes: our forward (torch's would refuse CPU tensors), the same
    state_dict, and copies and pickles that keep the class."""
    torch.manual_seed(0)
    ours, as_torch = SyncBatchNorm(4), SyncBatchNorm(4)
    as_torch.load_state_dict(ours.state_dict())
    as_torch.__class__ = SyncBatchNormOnDevice  # what a GPU would do, on CPU tensors
    x = torch.randn(3, 4, 5, 5)
    torch.testing.assert_close(as_torch(x), ours(x), rtol=0, atol=0)
    torch.testing.assert_close(as_torch.running_var, ours.running_var, rtol=0, atol=0)
    assert list(as_torch.state_dict()) == list(ours.state_dict())
    assert type(copy.deepcopy(as_torch)) is SyncBatchNormOnDevice


def test_the_class_follows_the_tensors_through_pickles_and_state_dicts(tmp_path: Path) -> None:
    """A model saved on a GPU and loaded with map_location="cpu" must not stay a torch
    SyncBatchNorm on the CPU (DDP on gloo would refuse it); the class follows the tensors."""
    saved_on_device = SyncBatchNorm(4)
    saved_on_device.__class__ = SyncBatchNormOnDevice  # as if saved from a GPU, mapped to CPU
    assert type(pickle.loads(pickle.dumps(saved_on_device))) is SyncBatchNorm
    torch.save(nn.Sequential(saved_on_device), tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", map_location="cpu", weights_only=False)
    assert type(loaded[0]) is SyncBatchNorm
    assert type(pickle.loads(pickle.dumps(SyncBatchNorm(4).to("meta")))) is SyncBatchNormOnDevice
    layer = SyncBatchNorm(4, device="meta")
    layer.load_state_dict(SyncBatchNorm(4).state_dict(), assign=True)  # CPU tensors assigned
    assert type(layer) is SyncBatchNorm


def test_the_torch_class_can_be_constructed_like_ours() -> None:
    """Code that clones a layer with type(layer)(...) on a GPU model builds the torch class."""
    layer = SyncBatchNormOnDevice(4, eps=1e-3, momentum=None, device="meta", dtype=torch.float64)
    assert layer.weight.device.type == "meta" and layer.weight.dtype == torch.float64
    assert layer.eps == 1e-3 and layer.momentum is None and layer.process_group is None
    assert type(layer) is SyncBatchNormOnDevice
    assert type(SyncBatchNormOnDevice(4)) is SyncBatchNorm  # made on the CPU: ours


def test_subclasses_keep_their_own_class() -> None:
    class Mine(SyncBatchNorm):
        pass

    layer = Mine(4).to("meta")
    assert type(layer) is Mine and not isinstance(layer, nn.SyncBatchNorm)


@pytest.mark.distributed
@pytest.mark.slow
def test_ddp_on_cpu_still_accepts_the_layers() -> None:
    """DDP raises for CPU modules holding a torch SyncBatchNorm; ours stay out of that class on
    the CPU, so gloo training works (and DDP logs has_sync_bn as false there)."""
    with tempfile.TemporaryDirectory() as tmp:
        store = f"file://{Path(tmp) / 'store'}"
        dist.init_process_group("gloo", init_method=store, rank=0, world_size=1)
        try:
            model = convert_sync_batchnorm(nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)))
            ddp = nn.parallel.DistributedDataParallel(model)
            ddp(torch.randn(2, 3, 4, 4)).sum().backward()
            assert not ddp._get_ddp_logging_data().get("has_sync_bn")
        finally:
            dist.destroy_process_group()


@pytest.mark.gpu
def test_on_a_gpu_ddp_sees_a_syncbatchnorm() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        store = f"file://{Path(tmp) / 'store'}"
        dist.init_process_group("nccl", init_method=store, rank=0, world_size=1)
        try:
            model = convert_sync_batchnorm(nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)))
            model = model.cuda()
            assert isinstance(model[1], nn.SyncBatchNorm)
            ddp = nn.parallel.DistributedDataParallel(model, device_ids=[0])
            ddp(torch.randn(2, 3, 4, 4, device="cuda")).sum().backward()
            assert ddp._get_ddp_logging_data().get("has_sync_bn")
            assert type(model.cpu()[1]) is SyncBatchNorm
        finally:
            dist.destroy_process_group()
