"""Layer 7: unknown keys under ``bn``, ``trainer`` and ``data`` (``app.config.keys``).

The command line as users run it (``python train.py`` in a subprocess): exit code 2, one line
naming the bad key and the closest valid one, nothing started or written. In process: the valid
keys come from the composed config and the targets' arguments, so a key added to a config or to a
constructor is valid without any list to update.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from syncbn_lightning import SyncBNCallback
from syncbn_lightning.app.config.checks import ConfigError, check_command_line
from syncbn_lightning.app.config.jobs import validate
from syncbn_lightning.app.config.keys import (
    UnknownKeyError,
    _imported_signature,
    accepted_keys,
    check_overrides,
    source_signature,
)
from syncbn_lightning.lightning.arguments import check_callback_arguments

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


@pytest.mark.parametrize(
    ("override", "bad", "closest"),
    [
        ("bn.grup_size=2", "bn.grup_size", "bn.group_size"),
        pytest.param(
            "+trainer.device=4", "trainer.device", "trainer.devices", marks=pytest.mark.slow
        ),
    ],
)
def test_cli_unknown_key_exits_2_before_any_rank(
    tmp_path: Path, override: str, bad: str, closest: str
) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "SYNCBN_RANK_CONFIG")}
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), override, f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        env={**env, "WANDB_SILENT": "true"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [f"error: unknown key {bad}: did you mean {closest}?"], proc.stderr
    assert not run_dir.exists()  # no output directory, no launcher, no rank logs
    assert "started" not in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["data.batch_sise=3"], "unknown key data.batch_sise: did you mean data.batch_size?"),
        (["~bn.momentm"], "unknown key bn.momentm: did you mean bn.momentum?"),
        (
            ["data.synthetic.num_trian=3"],
            "unknown key data.synthetic.num_trian: did you mean data.synthetic.num_train?",
        ),
        (["-m", "bn.grup_size=1,2"], "unknown key bn.grup_size: did you mean bn.group_size?"),
        # a key of another option is checked against the option chosen on the same command line
        (["bn=local", "+bn.grup_size=2"], "unknown key bn.grup_size: did you mean bn.group_size?"),
        (["trainer=gpu", "trainer.benchmrk=false"], "did you mean trainer.benchmark?"),
    ],
)
def test_command_line_names_the_closest_key(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_command_line(argv)
    assert str(info.value).endswith(message)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "argv",
    [
        ["bn.group_size=2", "trainer.devices=4"],
        ["+trainer.profiler=simple"],  # an argument of Trainer that no config sets
        ["+bn.on_nonfinite=skip"],  # SyncBNCallback's, through bn_callback's **callback_args
        ["trainer=gpu", "trainer.benchmark=false"],
        ["data=shapes_hard", "data.synthetic.clutter=2"],
        ["+data.synthetic.clutter=2"],  # deeper additions: left to generate_shapes' own check
        ["bn=local,sync", "-m", "bn.momentum=0.2"],
        ["model.width=8", "logger=none"],  # other groups are not this check's
        ["--help"],
    ],
)
def test_command_line_accepts_valid_keys(argv: list[str]) -> None:
    check_overrides(argv, str(CONF))  # the keys (values: test_cli.py)


def test_a_missing_group_option_is_named_before_the_keys() -> None:
    """The keys of ``bn`` are checked against the option the command line picks: a missing
    option is the error, in one line listing the options there are."""
    with pytest.raises(ConfigError, match=r"^bn=nonexistent: no such option of bn: use one of "):
        check_command_line(["bn=nonexistent", "bn.grup_size=2"])


def _targets() -> list[str]:
    """The ``_target_`` of every option of the checked groups in ``conf/``."""
    found = set()
    for group in ("bn", "trainer", "data"):
        for option in (CONF / group).glob("*.yaml"):
            for line in option.read_text().splitlines():
                if line.startswith("_target_:"):
                    found.add(line.split(":", 1)[1].split("#")[0].strip())
    return sorted(found)


@pytest.mark.parametrize("target", _targets())
def test_source_signatures_match_the_imported_ones(target: str) -> None:
    """The keys read from a target's source, without importing it (the command line's check
    runs before Lightning is imported), are those :func:`inspect.signature` gives; so is where
    its ``**kwargs`` go. (Run in a fresh interpreter: here the modules are imported already and
    the source reading would step aside.)"""
    code = f"""
import json, sys
from syncbn_lightning.app.config.keys import source_signature
names, forwards = source_signature({target!r})
print(json.dumps([sorted(names), forwards, "lightning" in sys.modules]))
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    names, forwards, lightning_imported = json.loads(done.stdout)
    imported = _imported_signature(target)
    assert imported is not None
    assert (set(names), forwards) == imported
    assert not lightning_imported
    assert source_signature(target) is None  # imported here: the caller inspects it


def test_the_callback_and_its_argument_check_take_the_same_arguments() -> None:
    callback = inspect.signature(SyncBNCallback).parameters
    check = inspect.signature(check_callback_arguments).parameters
    assert [(p.name, p.kind, p.default) for p in callback.values()] == [
        (p.name, p.kind, p.default) for p in check.values()
    ]


def test_a_key_added_to_a_config_is_valid_at_once(tmp_path: Path) -> None:
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    with open(conf / "bn" / "sync.yaml", "a") as f:
        f.write("fold_every: 4\n")
    check_overrides(["bn.fold_every=2"], str(conf))
    with pytest.raises(UnknownKeyError, match=r"did you mean bn\.fold_every\?$"):
        check_overrides(["bn.fold_evrey=2"], str(conf))


def test_accepted_keys_follow_the_targets() -> None:
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("train")
    bn = accepted_keys(cfg.bn)
    assert bn is not None
    assert {"sync", "implementation", "group_size", "precise_bn_forward"} <= bn
    assert set(inspect.signature(SyncBNCallback).parameters) <= bn  # forwarded **callback_args
    trainer = accepted_keys(cfg.trainer)
    assert trainer is not None and {"devices", "profiler", "max_epochs"} <= trainer
    assert "device" not in trainer
    for group in ("bn", "trainer", "data"):  # every shipped key is accepted
        assert set(cfg[group]) <= accepted_keys(cfg[group]), group


def test_validate_names_the_unknown_key_first(tmp_path: Path) -> None:
    """``+bn.grup_size=2``: before this check the callback's TypeError was reported as a
    problem of ``bn.group_size``."""
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose(
            "train",
            overrides=[
                f"paths.output_dir={tmp_path}",
                f"paths.data_dir={tmp_path}",
                "+bn.grup_size=2",
            ],
        )
    with pytest.raises(
        ConfigError, match=r"^unknown key bn.grup_size: did you mean bn.group_size\?$"
    ):
        validate(cfg)
