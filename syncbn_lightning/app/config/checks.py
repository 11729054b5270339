"""The config checks that need neither torch, Lightning nor W&B, run on a command line before any
is imported: a bad config is refused within a second, with nothing written.

:func:`check_command_line` composes every job of a ``train.py`` command line as Hydra will and
raises :class:`ConfigError` (one line naming the key and the fix) for an unknown config group
option (``recipe=does_not_exist``), an unknown key (``bn.grup_size=2``) or a value
:func:`check_config` refuses. :func:`~.config.validate` runs :func:`check_config` first, then
what needs the heavy stack (building the callback, the datamodule and the model), so that a
message does not depend on which of the two found the problem.

Imports Hydra, OmegaConf and the library's pure-Python modules (group sizes, the layers' options,
the exchange registry); never torch, Lightning, W&B or the service's models
(``tests/test_cli.py`` checks it in a fresh interpreter).
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from syncbn_lightning._files import shipped_dir
from syncbn_lightning.distributed.group_sizes import resolve_group_size
from syncbn_lightning.lightning.arguments import check_callback_arguments

from ..launch import launched_externally, missing_rendezvous
from ..tasks.coco_files import missing_files
from ..tasks.norm_choice import check_norm, check_norm_init
from ..wandb_auth import check_wandb
from .keys import (
    UnknownKeyError,
    check_keys,
    check_override_keys,
    job_lists,
    parse_command_line,
    split_checked,
)

__all__ = [
    "CONF_DIR",
    "ConfigError",
    "check_command_line",
    "check_config",
    "exit_on_config_error",
    "global_batch",
    "world",
]


def _conf_dir() -> Path:
    """The configs: a source checkout's ``conf/`` or the copy installed in the package."""
    hint = "reinstall syncbn_lightning[app] (the service's configs)"
    return shipped_dir("conf", "conf", "train.yaml", FileNotFoundError, hint)


#: The directory ``train.yaml`` and the config groups are composed from.
CONF_DIR = _conf_dir()


class ConfigError(ValueError):
    """A config the job cannot run with; the message is one line naming the key and the fix."""

    #: Where Hydra refused an override (a key that is not in the config): the config as composed
    #: up to that override, which names the keys there are without composing again.
    partial: Any = None


def global_batch(*factors: Any) -> int:
    """``${syncbn.global_batch:a,b,...}``: the product of per-device batch, devices, nodes and
    accumulation, shown in the config as ``data.global_batch_size``."""
    try:
        return math.prod(int(f) for f in factors)
    except (TypeError, ValueError):
        raise ValueError(
            f"data.global_batch_size needs integer batch_size, devices, num_nodes and "
            f"accumulate_grad_batches, got {factors}"
        ) from None


OmegaConf.register_new_resolver("syncbn.global_batch", global_batch, replace=True)


@contextlib.contextmanager
def exit_on_config_error() -> Iterator[None]:
    """The command line's answer to a :class:`ConfigError`: ``error: <message>`` on stderr, one
    line and no traceback, and exit code 2."""
    try:
        yield
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


@contextlib.contextmanager
def config_errors_in_one_line() -> Iterator[None]:
    """OmegaConf's errors (a missing ``???`` value, a bad interpolation) and the ``ValueError`` /
    ``TypeError`` of a check or constructor, raised in the block, as one-line
    :class:`ConfigError`; a ``ConfigError`` passes unchanged."""
    try:
        yield
    except ConfigError:
        raise
    except MissingMandatoryValue as e:
        raise ConfigError(f"{e.full_key} is required (it is ??? in the config): set it") from None
    except (OmegaConfBaseException, ValueError, TypeError) as e:
        raise ConfigError(str(e).splitlines()[0]) from None


# ----------------------------------------------------------------------------- the checks


def world(cfg: DictConfig) -> tuple[int, int]:
    devices, nodes = cfg.trainer.devices, cfg.trainer.num_nodes
    for key, value in (("trainer.devices", devices), ("trainer.num_nodes", nodes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key}={value!r}: must be a positive integer (processes per node)")
    return devices, nodes


def _check_trainer(cfg: DictConfig, devices: int, nodes: int) -> None:
    strategy = cfg.trainer.strategy
    accelerator = str(cfg.trainer.accelerator)
    if devices * nodes > 1 and strategy != "ddp":
        # ddp_spawn would pickle the loggers and datamodule into fresh processes; the service
        # starts (or is started as) one process per device instead.
        raise ConfigError(
            f"trainer.strategy={strategy!r} with {devices * nodes} processes: the service runs "
            f"DDP with one started process per device, use trainer.strategy=ddp"
        )
    if accelerator in ("gpu", "cuda"):
        import torch  # only here: a CPU config is checked without importing torch (seconds)

        if torch.cuda.device_count() < devices:
            raise ConfigError(
                f"trainer.accelerator={accelerator} with trainer.devices={devices}, but this "
                f"machine has {torch.cuda.device_count()} CUDA GPU(s): use trainer=cpu or fewer "
                f"devices"
            )
    if nodes > 1 and not launched_externally():
        missing = missing_rendezvous(nodes)
        if missing:
            raise ConfigError(
                f"trainer.num_nodes={nodes} needs torchrun/SLURM, or {', '.join(missing)} set on "
                f"every node (NODE_RANK=0 on the node at MASTER_ADDR); see docs/service.md"
            )


def _check_bn(cfg: DictConfig, devices: int, nodes: int) -> None:
    """The ``bn`` node's values, with :class:`~syncbn_lightning.SyncBNCallback`'s own checks."""
    if cfg.bn.implementation not in ("auto", "ext", "ref"):
        raise ConfigError(f"bn.implementation={cfg.bn.implementation!r}: use auto, ext or ref")
    if not cfg.bn.sync:
        return
    arguments = OmegaConf.to_container(cfg.bn, resolve=True)
    assert isinstance(arguments, dict)
    for key in ("_target_", "sync", "implementation"):
        arguments.pop(key, None)
    group_size = cfg.bn.group_size
    try:
        check_callback_arguments(impl=cfg.bn.implementation, **arguments)
        if group_size != "auto":
            resolve_group_size(group_size, devices * nodes, devices)
    except (ValueError, TypeError) as e:
        name = next((k for k in cfg.bn if str(e).startswith(str(k))), "group_size")
        raise ConfigError(f"bn.{name}={cfg.bn[name]!r}: {e}") from None


def _check_model(model: DictConfig) -> None:
    """``model.norm`` (and, for a detector, the pretrained backbone ``frozen_bn`` needs)."""
    if "norm" not in model:
        return
    try:
        if "init_backbone" in model:
            check_norm_init(model.norm, model.init_backbone)
        else:
            check_norm(model.norm)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_data_files(cfg: DictConfig) -> None:
    data = cfg.data
    if OmegaConf.is_missing(data, "root"):
        raise ConfigError("data.root is required: pass data.root=/path/to/a/coco-format/folder")
    if data.synthetic is None:
        splits = (data.train_split, data.val_split)
        missing = missing_files(
            data.root, splits=splits, images=data.images, annotations=data.annotations
        )
        if missing:
            raise ConfigError(
                f"data.root={data.root}: {len(missing)} required path(s) missing, e.g. "
                f"{missing[0]}; point data.root at a COCO-format folder, or use data=shapes"
            )
    expected = global_batch(
        data.batch_size,
        cfg.trainer.devices,
        cfg.trainer.num_nodes,
        cfg.trainer.accumulate_grad_batches,
    )
    if data.global_batch_size is not None and data.global_batch_size != expected:
        raise ConfigError(
            f"data.global_batch_size={data.global_batch_size}: it is derived, data.batch_size x "
            f"trainer.devices x trainer.num_nodes x trainer.accumulate_grad_batches = {expected}; "
            f"change those instead"
        )


def _check_wandb(cfg: DictConfig) -> None:
    wandb = cfg.logger.get("wandb")
    if wandb is None:
        return
    offline, log_model = wandb.get("offline", "auto"), wandb.get("log_model", False)
    try:
        check_wandb(offline, log_model)
    except ValueError as e:
        # The message starts with "<argument>=<value>:"; name the key as the config spells it.
        raise ConfigError(f"logger.wandb.{e}") from None


def _check_launch(launch: DictConfig) -> None:
    """The launcher's seconds: positive numbers (``abort_after_s`` may be null: no bound)."""
    for key in ("timeout_s", "default_timeout_s", "start_timeout_s", "abort_after_s"):
        value = launch.get(key)
        if value is None and key == "abort_after_s":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            null = ", or null" if key == "abort_after_s" else ""
            raise ConfigError(f"launch.{key}={value!r}: use a positive number of seconds{null}")


def _check_checkpoint(key: str, path: str | None, fix: str = "") -> None:
    """``path`` (the value of ``key``), when set, must be a checkpoint file: else a ConfigError
    naming the key, followed by ``fix``."""
    if path is not None and not Path(path).is_file():
        raise ConfigError(f"{key}={path}: no such checkpoint file{fix}")


def check_config(cfg: DictConfig) -> None:
    """Check what can be checked without torch, Lightning or W&B: the keys under ``bn``,
    ``trainer`` and ``data``, the world size, the Trainer's strategy and devices, every ``bn``
    argument and the group size, ``model.norm``, the data files and the derived global batch,
    ``launch``, ``ckpt_path``, ``model.init_backbone`` and the W&B settings.

    Raises:
        ConfigError: one line naming the offending key and how to fix it; a config error of
            OmegaConf (a missing ``???`` value, a bad interpolation) in the same form.
    """
    with config_errors_in_one_line():
        try:
            check_keys(cfg)  # first: an unknown key would otherwise surface as another key's error
        except UnknownKeyError as e:
            raise ConfigError(str(e)) from None
        devices, nodes = world(cfg)
        _check_trainer(cfg, devices, nodes)
        _check_bn(cfg, devices, nodes)
        _check_model(cfg.model)
        _check_data_files(cfg)
        _check_launch(cfg.launch)
        _check_checkpoint("ckpt_path", cfg.ckpt_path)
        _check_checkpoint(
            "model.init_backbone",
            cfg.model.get("init_backbone") or None,  # "" is no init, as for CenterNet
            "; give the checkpoint of a recipe=backbone_pretrain run",
        )
        _check_wandb(cfg)


# ----------------------------------------------------------------------------- the command line


def check_command_line(argv: Sequence[str], config_name: str = "train") -> None:
    """Compose every job of a ``train.py`` command line as Hydra will and :func:`check_config`
    it, before Lightning or W&B is imported and before Hydra creates the job's directory.

    A command that is not a job with the shipped config (``--help``, ``--cfg``, ``--info``,
    another config) is left to Hydra. A multirun's jobs are those of the command line's sweeps
    (Hydra's basic sweeper); the whole sweep is checked again, with the heavy checks, by
    :class:`~.config.ValidateJobs` before its first job.

    Raises:
        ConfigError: ``unknown key bn.grup_size: did you mean bn.group_size?``, ``recipe=x: no
            such option of recipe: use one of ...``, or any :func:`check_config` error.
    """
    from hydra.errors import OverrideParseException

    try:
        parsed = parse_command_line(argv)
    except OverrideParseException as e:
        cause, *more = str(e.message).splitlines()
        where = f"; see {more[0].removeprefix('See ').removesuffix(' for details')}" if more else ""
        message = f"{e.override}: not an override Hydra can parse ({cause}){where}"
        raise ConfigError(message) from None
    if parsed is None:
        return
    checked, rest = split_checked(parsed[1])
    # A plain override of a key that does not exist fails Hydra's composition (the config is in
    # struct mode), so where every checked override is plain and the job composes, its keys are
    # known: one composition (about 0.25 s) instead of two. Otherwise the keys are checked against
    # the config composed without them, which names an unknown key and the closest known one.
    plain = not any(o.is_add() or o.is_force_add() or o.is_delete() for o in checked)
    if not plain:
        _check_keys(checked, rest, config_name)
    for job in job_lists(parsed[1]):
        try:
            cfg = _compose(job, config_name, hydra=True)
        except ConfigError as exc:
            if plain:  # names an unknown key, if that was it
                _check_keys(checked, rest, config_name, exc.partial)
            raise
        with _hydra_node(cfg):
            check_config(cfg)


def _check_keys(checked: list[Any], rest: list[Any], config_name: str, partial: Any = None) -> None:
    """The ``checked`` overrides' keys against every job of the ``rest`` of the command line
    composed without them (:func:`~.keys.check_override_keys`), or against ``partial``, the
    config Hydra had composed when it refused one of them (no second composition, ~0.25 s)."""
    configs = (
        [partial]
        if partial is not None
        else (_compose(job, config_name) for job in job_lists(rest))
    )
    for cfg in configs if checked else ():
        try:
            check_override_keys(checked, cfg)
        except UnknownKeyError as e:
            raise ConfigError(str(e)) from None


def _compose(overrides: list[str], config_name: str, hydra: bool = False) -> DictConfig:
    """``overrides`` composed as Hydra will (with its ``hydra`` node when ``hydra``).

    Raises:
        ConfigError: an unknown option of a config group, naming the options there are; any
            other composition error, in one line.
    """
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException, MissingConfigException

    try:
        with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
            return compose(config_name, overrides=overrides, return_hydra_config=hydra)
    except MissingConfigException as e:
        group, _, option = (e.missing_cfg_file or "").rpartition("/")
        if not group or not e.options:
            raise ConfigError(str(e).splitlines()[0]) from None
        raise ConfigError(
            f"{group}={option}: no such option of {group}: use one of {', '.join(e.options)}"
        ) from None
    except HydraException as e:
        error = ConfigError(str(e).splitlines()[0])
        parent = getattr(e.__cause__, "parent_node", None)  # OmegaConf's error: where it failed
        error.partial = parent._get_root() if parent is not None else None
        raise error from None


@contextlib.contextmanager
def _hydra_node(cfg: DictConfig) -> Iterator[None]:
    """``cfg``'s ``hydra`` node as the running job's, so that ``${hydra:...}`` resolves (the data
    directory is ``${hydra:runtime.cwd}/data``), as it will when Hydra runs the job."""
    from hydra.core.hydra_config import HydraConfig

    hydra_config = HydraConfig.instance()
    saved = hydra_config.cfg
    hydra_config.set_config(cfg)
    try:
        yield
    finally:
        hydra_config.cfg = saved
