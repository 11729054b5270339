"""What the data config group states about the run, checked by the datamodule itself:
``data.num_classes`` against the annotations, ``data.global_batch_size`` against the Trainer
(both at ``setup``, on every rank), with the key and the fix in the message."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _lightning import quiet_trainer

from syncbn_lightning.app.tasks.datamodule import CocoDataModule

TINY = {"num_train": 4, "num_val": 2, "progress": False}


def _module(root: Path, **kwargs: Any) -> CocoDataModule:
    dm = CocoDataModule(str(root / "shapes"), batch_size=2, synthetic=TINY, **kwargs)
    dm.prepare_data()
    return dm


def _attach(dm: CocoDataModule, accumulate: int) -> None:
    dm.trainer = quiet_trainer(accumulate_grad_batches=accumulate)


def test_matching_expectations_pass(tmp_path: Path) -> None:
    dm = _module(tmp_path, num_classes=3, global_batch_size=4)
    _attach(dm, accumulate=2)
    dm.setup("fit")
    assert dm.num_classes == 3 and dm.hparams.global_batch_size == 4


def test_num_classes_is_checked_against_the_annotations(tmp_path: Path) -> None:
    dm = _module(tmp_path, num_classes=5)
    with pytest.raises(ValueError, match=r"data.num_classes=5 but the annotations .* list 3 "):
        dm.setup("fit")


def test_global_batch_size_is_checked_against_the_trainer(tmp_path: Path) -> None:
    dm = _module(tmp_path, global_batch_size=4)
    _attach(dm, accumulate=1)
    with pytest.raises(ValueError, match=r"data.global_batch_size=4 but this run steps with 2 "):
        dm.setup("fit")


def test_without_a_trainer_or_expectations_nothing_is_checked(tmp_path: Path) -> None:
    _module(tmp_path, global_batch_size=64).setup("fit")  # no Trainer: nothing to compare
    _module(tmp_path).setup("validate")


@pytest.mark.parametrize("key", ["num_classes", "global_batch_size"])
@pytest.mark.parametrize("value", [0, 2.5, True])
def test_bad_expectations_are_refused_at_construction(key: str, value: Any, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=rf"data.{key} must be an int >= 1"):
        CocoDataModule(str(tmp_path), **{key: value})
