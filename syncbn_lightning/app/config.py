"""The service's config: composition helpers and the checks a job passes before anything starts.

:func:`validate` reads a composed config (``conf/``) and raises :class:`ConfigError`, one line
naming the key and the fix, for anything a job could not run with; :func:`build` instantiates one
config group; :class:`ValidateSweep` validates every job of a multirun before the first one starts.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.experimental.callback import Callback
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException
from typing_extensions import override

from syncbn_lightning._files import shipped_dir
from syncbn_lightning.distributed.groups import resolve_group_size
from syncbn_lightning.lightning.callback import SyncBNCallback

from .keys import UnknownKeyError, check_keys, check_overrides
from .launch import launched_externally, missing_rendezvous
from .loggers import check_wandb

__all__ = [
    "CONF_DIR",
    "ConfigError",
    "ValidateSweep",
    "bn_callback",
    "build",
    "check_command_line",
    "exit_on_config_error",
    "sweep_overrides",
    "validate",
    "world",
]

log = logging.getLogger(__name__)


def _conf_dir() -> Path:
    """The configs: a source checkout's ``conf/`` or the copy installed in the package."""
    hint = "reinstall syncbn_lightning[app] (the service's configs)"
    return shipped_dir("conf", "conf", "train.yaml", FileNotFoundError, hint)


#: The directory ``train.yaml`` and the config groups are composed from.
CONF_DIR = _conf_dir()


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


class ConfigError(ValueError):
    """A config the job cannot run with; the message is one line naming the key and the fix."""


# ----------------------------------------------------------------------------- validation


def world(cfg: DictConfig) -> tuple[int, int]:
    devices, nodes = cfg.trainer.devices, cfg.trainer.num_nodes
    for key, value in (("trainer.devices", devices), ("trainer.num_nodes", nodes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key}={value!r}: must be a positive integer (processes per node)")
    return devices, nodes


def build(cfg: DictConfig, group: str) -> Any:
    """``instantiate`` one config group, the node as it stands.

    Raises:
        ValueError / TypeError: the constructor's own error, unwrapped from Hydra's.
    """
    try:
        # Plain containers, not DictConfig, reach the constructors: hyper-parameters saved in
        # checkpoints must load with torch.load(weights_only=True), which refuses DictConfig.
        return instantiate(cfg[group], _convert_="all")
    except InstantiationException as e:
        if isinstance(e.__cause__, (ValueError, TypeError)):
            raise e.__cause__ from None
        raise


def bn_callback(
    sync: bool = True, implementation: str = "auto", **callback_args: Any
) -> SyncBNCallback | None:
    """The ``bn`` config group's ``_target_``: a :class:`~syncbn_lightning.SyncBNCallback` with
    ``callback_args`` and ``implementation`` as its ``impl``, or ``None`` when ``sync`` is false
    (the model's BatchNorm is left alone: no callback at all)."""
    return SyncBNCallback(impl=implementation, **callback_args) if sync else None


# The keys check (.keys.accepted_keys) follows bn_callback's **callback_args to these arguments.
bn_callback.forwards_kwargs_to = SyncBNCallback  # type: ignore[attr-defined]


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
    if accelerator in ("gpu", "cuda") and torch.cuda.device_count() < devices:
        raise ConfigError(
            f"trainer.accelerator={accelerator} with trainer.devices={devices}, but this machine "
            f"has {torch.cuda.device_count()} CUDA GPU(s): use trainer=cpu or fewer devices"
        )
    if nodes > 1 and not launched_externally():
        missing = missing_rendezvous(nodes)
        if missing:
            raise ConfigError(
                f"trainer.num_nodes={nodes} needs torchrun/SLURM, or {', '.join(missing)} set on "
                f"every node (NODE_RANK=0 on the node at MASTER_ADDR); see docs/service.md"
            )


def _check_bn(cfg: DictConfig, devices: int, nodes: int) -> None:
    if cfg.bn.implementation not in ("auto", "ext", "ref"):
        raise ConfigError(f"bn.implementation={cfg.bn.implementation!r}: use auto, ext or ref")
    if not cfg.bn.sync:
        return
    group_size = cfg.bn.group_size
    try:
        build(cfg, "bn")  # the callback validates every argument it takes
        if group_size != "auto":
            resolve_group_size(group_size, devices * nodes, devices)
    except (ValueError, TypeError) as e:
        name = next((k for k in cfg.bn if str(e).startswith(str(k))), "group_size")
        raise ConfigError(f"bn.{name}={cfg.bn[name]!r}: {e}") from None


def _check_data(cfg: DictConfig) -> None:
    from .tasks.coco import missing_files

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
    build(cfg, "data")


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


def validate(cfg: DictConfig) -> None:
    """Check the whole config before any process is started or any file is written.

    Raises:
        ConfigError: one line naming the offending key and how to fix it.
    """
    try:
        check_keys(cfg)  # first: an unknown key would otherwise surface as another key's error
        devices, nodes = world(cfg)
        _check_trainer(cfg, devices, nodes)
        _check_bn(cfg, devices, nodes)
        _check_data(cfg)
        build(cfg, "model")
        abort = cfg.launch.abort_after_s
        if abort is not None and (
            isinstance(abort, bool) or not isinstance(abort, (int, float)) or abort <= 0
        ):
            raise ConfigError(
                f"launch.abort_after_s={abort!r}: use a positive number of seconds, or null"
            )
        if cfg.ckpt_path is not None and not Path(cfg.ckpt_path).is_file():
            raise ConfigError(f"ckpt_path={cfg.ckpt_path}: no such checkpoint file")
        _check_wandb(cfg)
    except ConfigError:
        raise
    except MissingMandatoryValue as e:
        raise ConfigError(f"{e.full_key} is required (it is ??? in the config): set it") from None
    except (OmegaConfBaseException, ValueError, TypeError) as e:
        raise ConfigError(str(e).splitlines()[0]) from None


def check_command_line(argv: list[str]) -> None:
    """Check the keys under ``bn``, ``trainer`` and ``data`` of a ``train.py`` command line
    before Hydra composes it (see :func:`.keys.check_overrides`).

    Raises:
        ConfigError: ``unknown key bn.grup_size: did you mean bn.group_size?``
    """
    try:
        check_overrides(argv, str(CONF_DIR))
    except UnknownKeyError as e:
        raise ConfigError(str(e)) from None


@contextlib.contextmanager
def exit_on_config_error() -> Iterator[None]:
    """The command line's answer to a :class:`ConfigError`: ``error: <message>`` on stderr, one
    line and no traceback, and exit code 2."""
    try:
        yield
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


# ----------------------------------------------------------------------------- multirun

_BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def sweep_overrides(config: DictConfig) -> list[list[str]] | None:
    """The overrides of every job a multirun of ``config`` will launch, as Hydra's basic sweeper
    expands them (``hydra.sweeper.params``, then the command line's, as a cartesian product);
    ``None`` for another sweeper (Optuna, Ax, ...), which picks its jobs as it goes."""
    if config.hydra.sweeper.get("_target_") != _BASIC_SWEEPER:
        return None
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = config.hydra.sweeper.get("params") or {}
    arguments = [f"{key}={value}" for key, value in params.items()]
    arguments += list(config.hydra.overrides.task)
    parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
    batches = BasicSweeper.split_arguments(parser.parse_overrides(arguments), None)
    return [job for batch in batches for job in batch]


class ValidateSweep(Callback):
    """Hydra callback (``hydra.callbacks`` in ``train.yaml``): before a multirun's first job,
    compose every job's config as the launcher will and :func:`validate` it, so that a bad
    combination fails the whole sweep at once (``error: <message>``, exit code 2) instead of
    after the jobs before it trained. Nothing is written: the sweep directory does not exist yet.
    """

    @override
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        jobs = sweep_overrides(config)
        if jobs is None:
            log.warning(
                "sweeper %s: each job's config is checked when it starts",
                config.hydra.sweeper._target_,
            )
            return
        loader = GlobalHydra.instance().config_loader()
        hydra_config = HydraConfig.instance()
        saved = hydra_config.cfg
        try:
            with exit_on_config_error():
                for overrides in jobs:
                    job = loader.load_sweep_config(config, overrides)
                    # ${hydra:...} in the job's config (paths.data_dir) reads the job's Hydra node,
                    # as it will when the launcher runs it.
                    hydra_config.set_config(job)
                    validate(job)
        finally:
            hydra_config.cfg = saved
