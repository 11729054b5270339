"""Layer 7: recipes (``conf/recipe/``) never undo a group option chosen on the command line.

A recipe picks options (``override /bn: local`` in its defaults list, which a group given on the
command line beats) and sets only keys on which every option of their group agrees (the run's
shape). So every option of every group keeps, under every recipe, each key that tells it from
the group's other options. Configs are composed with Hydra's compose API, as ``python train.py``
composes them; one test runs the command line itself (``--cfg job``).
"""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from syncbn_lightning.distributed.group_sizes import (
    DEFAULT_TARGET_NORM_BATCH,
    norm_batch_verdict,
    resolve_group_size,
)

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
GROUPS = ("bn", "trainer", "model", "data", "logger", "callbacks")
RECIPES = sorted(p.stem for p in (CONF / "recipe").glob("*.yaml"))
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))]


@functools.cache
def _compose(*overrides: str) -> DictConfig:
    """``python train.py OVERRIDES`` composed (cached: the tests only read it)."""
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("train", overrides=list(overrides), return_hydra_config=True)


def _leaves(node: Any, prefix: str = "") -> dict[str, Any]:
    """``{dotted key: value}`` of a config node, interpolations unresolved (``${...}`` strings)."""
    container = OmegaConf.to_container(node, resolve=False) if OmegaConf.is_config(node) else node
    if not isinstance(container, dict) or not container:
        return {prefix: container}
    leaves: dict[str, Any] = {}
    for key, value in container.items():
        leaves.update(_leaves(value, f"{prefix}.{key}" if prefix else str(key)))
    return leaves


def _group(cfg: DictConfig, group: str) -> dict[str, Any]:
    return _leaves(cfg[group], group)


def _shape_keys(group: str) -> set[str]:
    """Keys every option of ``group`` sets to the same value: the only ones a recipe may set."""
    options = [_group(_compose(f"{group}={o}", "~recipe"), group) for g, o in OPTIONS if g == group]
    first = options[0]
    return {k for k, v in first.items() if all(k in o and o[k] == v for o in options[1:])}


@pytest.fixture(scope="module")
def shape_keys() -> dict[str, set[str]]:
    return {group: _shape_keys(group) for group in GROUPS}


def test_recipes_are_found() -> None:
    assert RECIPES == [
        "backbone_pretrain",
        "classifier_sanity",
        "detection_frozen",
        "detection_gn",
        "detection_group2",
        "detection_large_batch",
        "detection_local_bn",
        "detection_small_batch",
    ]
    assert {g for g, _ in OPTIONS} == set(GROUPS)


@pytest.mark.parametrize("recipe", [None, *RECIPES], ids=lambda r: r or "default")
@pytest.mark.slow
def test_chosen_options_survive_every_recipe(
    recipe: str | None, shape_keys: dict[str, set[str]]
) -> None:
    """``python train.py GROUP=OPTION [recipe=R]`` keeps every key that makes OPTION itself."""
    for group, option in OPTIONS:
        alone = _group(_compose(f"{group}={option}", "~recipe"), group)
        extra = [f"recipe={recipe}"] if recipe else []
        cfg = _compose(f"{group}={option}", *extra)
        assert cfg.hydra.runtime.choices[group] == option, (group, option, recipe)
        with_recipe = _group(cfg, group)
        undone = {
            k: (v, with_recipe.get(k))
            for k, v in alone.items()
            if with_recipe.get(k, "<missing>") != v and k not in shape_keys[group]
        }
        assert not undone, f"{group}={option} with recipe {recipe or 'default'} undoes {undone}"


def test_recipes_set_only_shape_keys(shape_keys: dict[str, set[str]]) -> None:
    """What a recipe changes in a group's node (over the group's default option) is a key every
    option of the group agrees on; anything else must come through an option it picks."""
    for recipe in RECIPES:
        cfg = _compose(f"recipe={recipe}")
        base = _compose("~recipe", *(f"{g}={cfg.hydra.runtime.choices[g]}" for g in GROUPS))
        for group in GROUPS:
            before, after = _group(base, group), _group(cfg, group)
            changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
            assert changed <= shape_keys[group], (recipe, group, changed - shape_keys[group])


@pytest.mark.parametrize(
    ("recipe", "choices", "keys"),
    [
        ("detection_small_batch", {"bn": "sync"}, {"bn.group_size": None, "trainer.devices": 2}),
        ("detection_local_bn", {"bn": "local"}, {"bn.group_size": 1, "data.batch_size": 2}),
        ("detection_group2", {"bn": "group2"}, {"bn.group_size": 2, "trainer.devices": 4}),
        (
            "detection_large_batch",
            {"bn": "sync"},
            {"trainer.devices": 1, "trainer.strategy": "auto", "data.batch_size": 4},
        ),
    ],
)
def test_recipes_pick_their_options_when_none_is_chosen(
    recipe: str, choices: dict[str, str], keys: dict[str, Any]
) -> None:
    cfg = _compose(f"recipe={recipe}")
    assert {g: cfg.hydra.runtime.choices[g] for g in choices} == choices
    assert {k: OmegaConf.select(cfg, k) for k in keys} == keys
    assert cfg.bn.precise_bn_batches == 16


def _norm_batch(cfg: DictConfig) -> int:
    """Samples per BatchNorm forward of a composed config (what SyncBNCallback's warning reads)."""
    world = cfg.trainer.devices * cfg.trainer.num_nodes
    if world == 1:
        return cfg.data.batch_size
    return resolve_group_size(cfg.bn.group_size, world, cfg.trainer.devices) * cfg.data.batch_size


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_reads_its_batch_against_the_one_target(recipe: str) -> None:
    """No recipe changes ``bn.target_norm_batch``: ``auto``, the callback's warning and the
    report read every job's normalization batch against the one default."""
    cfg = _compose(f"recipe={recipe}")
    assert cfg.bn.target_norm_batch == DEFAULT_TARGET_NORM_BATCH == 16


@pytest.mark.parametrize(
    ("overrides", "band"),
    [
        ([], "noisy"),  # the default job: 2 processes x 2 images over the world
        (["~recipe"], "noisy"),
        (["recipe=detection_local_bn"], "noisy"),
        (["recipe=detection_group2"], "noisy"),
        (["recipe=detection_small_batch", "trainer.devices=8"], "enough"),  # 8 x 2 = 16
        (["recipe=classifier_sanity"], "reliable"),  # 2 x 16 = 32
    ],
    ids=["default", "no_recipe", "local_bn", "group2", "eight_devices", "classifier_sanity"],
)
def test_the_warning_and_the_report_give_a_recipe_one_verdict(
    overrides: list[str], band: str
) -> None:
    """The verdict both give a composed job (``norm_batch_verdict`` on its normalization batch,
    its global batch and its target): small batches warn, with the fix the report prints."""
    cfg = _compose(*overrides)
    world = cfg.trainer.devices * cfg.trainer.num_nodes
    verdict = norm_batch_verdict(
        _norm_batch(cfg), cfg.data.batch_size * world, cfg.bn.target_norm_batch
    )
    assert verdict.band == band, verdict.text


@pytest.mark.slow
def test_cli_keeps_the_chosen_bn_option() -> None:
    """The issue's reproduction: ``python train.py bn=local --cfg job`` shows groups of one."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "bn=local", "--cfg", "job"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    cfg = yaml.safe_load(proc.stdout)
    assert cfg["bn"]["group_size"] == 1
    assert cfg["recipe"]["name"] == "detection_small_batch"
