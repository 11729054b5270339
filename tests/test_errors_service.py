"""Sections 9-10 of ``docs/errors.md``: the service's ``train.py`` configs and the COCO datasets.

Each test triggers the error of its row with the row's input and asserts the row's exception type
and message through :func:`_errors_doc.expect_row` (the doc is the one source of both). Configs are
composed with Hydra and passed to ``train.validate``, in this process: nothing is started or
written.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _errors_doc import ROOT, clean_environment, expect_row
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

import syncbn_lightning.app.train as app
from syncbn_lightning.app.config.checks import check_command_line
from syncbn_lightning.app.tasks.coco import CocoDetection

CONF = ROOT / "conf"


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No launcher or cluster variables, the default kernels, W&B quiet."""
    clean_environment(monkeypatch)


def _compose(tmp_path: Path, *overrides: str) -> DictConfig:
    paths = [f"paths.output_dir={tmp_path / 'out'}", f"paths.data_dir={tmp_path / 'data'}"]
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("train", overrides=[*paths, *overrides])


def _validate(tmp_path: Path, *overrides: str) -> None:
    """``python train.py OVERRIDES`` up to its config check (nothing is started or written)."""
    app.validate(_compose(tmp_path, *overrides))


# ----------------------------------------------------------------------------- 9. train.py


def test_config_devices_zero(tmp_path: Path) -> None:
    with expect_row():
        _validate(tmp_path, "trainer.devices=0")


def test_config_model_monitor_not_logged(tmp_path: Path) -> None:
    with expect_row():
        _validate(tmp_path, "model.monitor=val/map")


def test_config_global_batch_size_set(tmp_path: Path) -> None:
    with expect_row():
        _validate(tmp_path, "data.global_batch_size=32")


def test_config_devices_auto(tmp_path: Path) -> None:
    with expect_row():
        _validate(tmp_path, "trainer.devices=auto")


def test_config_strategy_not_ddp(tmp_path: Path) -> None:
    with expect_row():
        _validate(tmp_path, "trainer.strategy=ddp_spawn")


def test_config_more_gpus_than_present(tmp_path: Path) -> None:
    with expect_row(gpus=torch.cuda.device_count()):
        _validate(tmp_path, "trainer=gpu", "trainer.devices=64")


def test_config_nodes_without_rendezvous(tmp_path: Path) -> None:
    with expect_row():
        _validate(tmp_path, "trainer.num_nodes=2")


def test_config_group_size_not_dividing_devices(tmp_path: Path) -> None:
    with expect_row():
        _validate(tmp_path, "trainer.devices=4", "bn.group_size=3")


def test_config_group_size_unknown_name(tmp_path: Path) -> None:
    with expect_row():
        _validate(tmp_path, "bn.group_size=banana")


def test_config_group_size_zero(tmp_path: Path) -> None:
    with expect_row():
        _validate(tmp_path, "bn.group_size=0")


def test_config_momentum_out_of_range(tmp_path: Path) -> None:
    with expect_row():
        _validate(tmp_path, "bn.momentum=2")


def test_config_eps_zero(tmp_path: Path) -> None:
    with expect_row():
        _validate(tmp_path, "bn.eps=0")


def test_config_eps_not_a_number(tmp_path: Path) -> None:
    with expect_row():
        _validate(tmp_path, "bn.eps=abc")


def test_config_precise_bn_at_unknown(tmp_path: Path) -> None:
    with expect_row():
        _validate(tmp_path, "bn.precise_bn_at=epoch")


def test_config_implementation_unknown(tmp_path: Path) -> None:
    with expect_row():
        _validate(tmp_path, "bn.implementation=cuda")


def test_config_data_root_missing(tmp_path: Path) -> None:
    with expect_row():
        _validate(tmp_path, "data=coco")


def test_config_data_root_does_not_exist(tmp_path: Path) -> None:
    with expect_row():
        _validate(tmp_path, "data=coco", "data.root=/nonexistent/coco")


def test_config_data_files_missing(tmp_path: Path) -> None:
    root = tmp_path / "coco"
    (root / "train2017").mkdir(parents=True)  # images, but no annotations and no val split
    with expect_row(root=root):
        _validate(tmp_path, "data=coco", f"data.root={root}")


def test_config_data_batch_size_zero(tmp_path: Path) -> None:
    with expect_row():
        _validate(tmp_path, "data.batch_size=0")


def test_config_synthetic_clutter_negative(tmp_path: Path) -> None:
    with expect_row():
        _validate(tmp_path, "data=shapes_hard", "data.synthetic.clutter=-1")


def test_config_synthetic_photometric_out_of_range(tmp_path: Path) -> None:
    with expect_row():
        _validate(tmp_path, "data=shapes_hard", "data.synthetic.photometric=1.5")


def test_config_data_unknown_key(tmp_path: Path) -> None:
    with expect_row():
        _validate(tmp_path, "+data.foo=1")


def test_config_key_misspelt() -> None:
    with expect_row():
        check_command_line(["bn.grup_size=2"])


def test_config_key_added_unknown(tmp_path: Path) -> None:
    with expect_row():
        _validate(tmp_path, "+trainer.device=4")


def test_config_key_needs_plus() -> None:
    with expect_row():
        check_command_line(["trainer.profiler=simple"])


def test_config_model_optimizer_unknown(tmp_path: Path) -> None:
    with expect_row():
        _validate(tmp_path, "model.optim.name=lamb")


def test_config_model_norm_unknown(tmp_path: Path) -> None:
    with expect_row():
        _validate(tmp_path, "model.norm=ln")


def test_config_frozen_bn_without_pretrained_backbone(tmp_path: Path) -> None:
    with expect_row():
        _validate(tmp_path, "recipe=detection_frozen")


def test_config_init_backbone_missing(tmp_path: Path) -> None:
    with expect_row():
        _validate(tmp_path, "recipe=detection_frozen", "model.init_backbone=/nonexistent.ckpt")


def test_config_ckpt_path_missing(tmp_path: Path) -> None:
    with expect_row():
        _validate(tmp_path, "ckpt_path=/nonexistent.ckpt")


def test_config_ckpt_path_is_a_directory(tmp_path: Path) -> None:
    with expect_row(dir=tmp_path):
        _validate(tmp_path, f"ckpt_path={tmp_path}")


def test_config_wandb_offline_invalid(tmp_path: Path) -> None:
    with expect_row():
        _validate(tmp_path, "logger.wandb.offline=maybe")


def test_config_wandb_log_model_offline_auto(tmp_path: Path) -> None:
    with expect_row():
        _validate(tmp_path, "logger.wandb.log_model=true")


def test_config_wandb_log_model_offline_true(tmp_path: Path) -> None:
    with expect_row():
        _validate(tmp_path, "logger.wandb.log_model=all", "logger.wandb.offline=true")


def test_config_wandb_log_model_unknown(tmp_path: Path) -> None:
    with expect_row():
        _validate(tmp_path, "logger.wandb.log_model=sometimes")


def test_config_logger_unknown_option() -> None:
    with expect_row():
        check_command_line(["logger=banana"])


def test_config_recipe_unknown() -> None:
    with expect_row():
        check_command_line(["recipe=does_not_exist"])


def test_config_override_syntax() -> None:
    with expect_row():
        check_command_line(["bn.momentum=["])


# ---------------------------------------------------------------------------- 10. datasets


def _annotations(path: Path, annotations: list[dict[str, object]]) -> Path:
    coco = {
        "images": [{"id": 1, "file_name": "x.png"}],
        "categories": [{"id": 1}],
        "annotations": annotations,
    }
    path.write_text(json.dumps(coco))
    return path


def test_dataset_images_dir_missing(tmp_path: Path) -> None:
    with expect_row(tmp=tmp_path):
        CocoDetection(tmp_path / "nope", tmp_path / "a.json", 64)


def test_dataset_annotation_file_missing(tmp_path: Path) -> None:
    with expect_row(tmp=tmp_path):
        CocoDetection(tmp_path, tmp_path / "a.json", 64)


def test_dataset_not_coco_json(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text("[]")
    with expect_row(tmp=tmp_path):
        CocoDetection(tmp_path, tmp_path / "a.json", 64)


def test_dataset_unknown_category(tmp_path: Path) -> None:
    box = {"id": 7, "image_id": 1, "category_id": 5, "bbox": [0, 0, 4, 4]}
    annotations = _annotations(tmp_path / "a.json", [box])
    with expect_row(tmp=tmp_path):
        CocoDetection(tmp_path, annotations, 64)


def test_dataset_image_file_missing(tmp_path: Path) -> None:
    dataset = CocoDetection(tmp_path, _annotations(tmp_path / "a.json", []), 64)
    with expect_row(tmp=tmp_path):
        dataset[0]
