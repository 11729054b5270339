"""Layer 7: the service's other normalizations (``model.norm``): GroupNorm and frozen BatchNorm,
and the pretrained backbone the frozen baseline starts from.

Unit tests check the layers against their definitions and the library's converter against them;
two end-to-end tests train real 2-rank DDP jobs (``app.train``, gloo): a GroupNorm detector for
one step, and a detector with frozen BatchNorm from a backbone pretrained by
``recipe=backbone_pretrain``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _service import RENDEZVOUS_VARS, tiny_cfg
from torch import nn

import syncbn_lightning.app.train as app
from syncbn_lightning import SyncBatchNorm, convert_sync_batchnorm
from syncbn_lightning.app.tasks.centernet import CenterNet, TinyBackbone
from syncbn_lightning.app.tasks.norms import FrozenBatchNorm2d, gn_groups, make_norm
from syncbn_lightning.app.tasks.pretrained import load_backbone


@pytest.mark.parametrize(
    ("channels", "groups"), [(4, 1), (8, 2), (16, 4), (32, 8), (64, 16), (128, 32), (512, 32)]
)
def test_gn_groups_are_32_or_4_channels_each(channels: int, groups: int) -> None:
    assert gn_groups(channels) == groups
    assert make_norm("gn", channels).num_groups == groups


def test_unknown_norm_names_the_key() -> None:
    with pytest.raises(ValueError, match=r"model.norm must be one of \('bn', 'gn', 'frozen_bn'\)"):
        CenterNet(norm="ln")


def _trained_bn(channels: int = 6) -> nn.BatchNorm2d:
    bn = nn.BatchNorm2d(channels)
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    return bn.eval()


def test_frozen_bn_is_eval_batchnorm_in_both_modes_and_has_no_parameters() -> None:
    torch.manual_seed(0)
    bn = _trained_bn()
    frozen = FrozenBatchNorm2d(6)
    frozen.load_state_dict(bn.state_dict())  # num_batches_tracked is dropped
    x = torch.randn(2, 6, 5, 5)
    for mode in (True, False):
        frozen.train(mode)
        torch.testing.assert_close(frozen(x), bn(x), rtol=1e-5, atol=1e-6)
    assert list(frozen.parameters()) == []
    assert set(frozen.state_dict()) == {"weight", "bias", "running_mean", "running_var"}


def test_converter_leaves_frozen_bn_and_group_norm_alone() -> None:
    for norm, kind in (("frozen_bn", FrozenBatchNorm2d), ("gn", nn.GroupNorm)):
        model = TinyBackbone(8, norm)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        converted = convert_sync_batchnorm(model)
        layers = [m for m in converted.modules() if isinstance(m, kind)]
        assert len(layers) == 15
        assert not any(isinstance(m, SyncBatchNorm) for m in converted.modules())
        after = converted.state_dict()
        assert before.keys() == after.keys()
        assert all(torch.equal(before[k], after[k]) for k in before)
    # The same backbone with BatchNorm is converted layer for layer.
    converted = convert_sync_batchnorm(TinyBackbone(8, "bn"))
    assert sum(isinstance(m, SyncBatchNorm) for m in converted.modules()) == 15


def test_frozen_without_pretrained_weights_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"model.norm=frozen_bn .* model.init_backbone=<"):
        CenterNet(norm="frozen_bn")


def _classifier_checkpoint(path: Path, width: int) -> None:
    from syncbn_lightning.app.tasks.classifier import BackboneClassifier

    torch.save({"state_dict": BackboneClassifier(3, width).state_dict()}, path)


def test_load_backbone_copies_weights_and_statistics(tmp_path: Path) -> None:
    from syncbn_lightning.app.tasks.classifier import BackboneClassifier

    torch.manual_seed(0)
    source = BackboneClassifier(3, 8)
    for m in source.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-1, 1)
    torch.save({"state_dict": source.state_dict()}, tmp_path / "c.ckpt")
    detector = CenterNet(width=8, norm="frozen_bn", init_backbone=str(tmp_path / "c.ckpt"))
    load_backbone(detector.backbone, tmp_path / "c.ckpt")
    ours, theirs = detector.backbone.state_dict(), source.backbone.state_dict()
    assert set(theirs) - set(ours) == {k for k in theirs if k.endswith("num_batches_tracked")}
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_load_backbone_refuses_missing_foreign_and_misfit_checkpoints(tmp_path: Path) -> None:
    backbone = TinyBackbone(8)
    with pytest.raises(FileNotFoundError, match=r"model.init_backbone=.*no such file"):
        load_backbone(backbone, tmp_path / "none.ckpt")
    torch.save({"state_dict": {"fc.weight": torch.zeros(1)}}, tmp_path / "other.ckpt")
    with pytest.raises(ValueError, match=r"holds no 'backbone\.\*' weights"):
        load_backbone(backbone, tmp_path / "other.ckpt")
    _classifier_checkpoint(tmp_path / "w16.ckpt", 16)
    with pytest.raises(ValueError, match=r"does not fit this backbone .*same model.width"):
        load_backbone(backbone, tmp_path / "w16.ckpt")


# ----------------------------------------------------------------------------- end to end


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in RENDEZVOUS_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")


def _one_step(tmp_path: Path, data_dir: Path, *overrides: str) -> dict[str, torch.Tensor]:
    """Train ``overrides`` for one optimizer step on 2 ranks; return the checkpoint's weights."""
    cfg = tiny_cfg(
        tmp_path, data_dir, "trainer.devices=2", "trainer.max_steps=1", "logger=csv", *overrides
    )
    metrics = app.train(cfg)
    assert 0.0 <= metrics["val/mAP"] <= 1.0
    ckpt = torch.load(tmp_path / "out" / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 1
    return ckpt["state_dict"]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_group_norm_detector_trains_one_step_on_two_ranks(tmp_path: Path) -> None:
    state = _one_step(tmp_path, tmp_path / "data", "recipe=detection_gn")
    gn_weights = [v for k, v in state.items() if k.endswith(".weight") and v.dim() == 1]
    assert gn_weights and not any("running_mean" in k for k in state)  # GroupNorm, not BN
    assert any(not torch.equal(w, torch.ones_like(w)) for w in gn_weights)  # the step moved them


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_frozen_bn_detector_keeps_the_pretrained_statistics(tmp_path: Path) -> None:
    pretrain = tiny_cfg(
        tmp_path / "pre",
        tmp_path / "data",
        "recipe=backbone_pretrain",
        "logger=none",
        "data.batch_size=8",
    )
    app.train(pretrain)
    ckpt = tmp_path / "pre" / "out" / "checkpoints" / "last.ckpt"
    pretrained = torch.load(ckpt, weights_only=True)["state_dict"]
    state = _one_step(
        tmp_path / "det",
        tmp_path / "data",
        "recipe=detection_frozen",
        f"model.init_backbone={ckpt}",
    )
    frozen = [k for k in state if k.startswith("backbone.") and k.endswith("running_var")]
    assert len(frozen) == 15
    for key in frozen:  # statistics and affine as pretrained, after a training step
        for name in ("running_mean", "running_var", "weight", "bias"):
            k = key.replace("running_var", name)
            assert torch.equal(state[k], pretrained[k]), k
    conv = "backbone.stem.0.weight"
    assert not torch.equal(state[conv], pretrained[conv])  # while the convolutions train
