"""The service's config: composition helpers and the checks a job passes before anything starts.

:func:`validate` reads a composed config (``conf/``) and raises :class:`ConfigError`, one line
naming the key and the fix, for anything a job could not run with: first the checks that need no
Lightning (:func:`.checks.check_config`, which the command line also runs before importing
Lightning), then building the data and model nodes as the job will. :func:`build` instantiates
one config group; :class:`ValidateJobs` validates a run, or every job of a multirun, before Hydra
creates its first directory.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.experimental.callback import Callback
from hydra.utils import instantiate
from omegaconf import DictConfig
from typing_extensions import override

from syncbn_lightning.lightning.callback import SyncBNCallback

from .checks import check_config, config_errors_in_one_line, exit_on_config_error

__all__ = ["ValidateJobs", "ValidateSweep", "bn_callback", "build", "sweep_overrides", "validate"]

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- validation


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


def validate(cfg: DictConfig) -> None:
    """Check the whole config before any process is started or any file is written:
    :func:`.checks.check_config`, then the data and model nodes built as the job will build them
    (their constructors check their own arguments).

    Raises:
        ConfigError: one line naming the offending key and how to fix it.
    """
    check_config(cfg)
    with config_errors_in_one_line():
        build(cfg, "data")
        build(cfg, "model")


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


class ValidateJobs(Callback):
    """Hydra callback (``hydra.callbacks`` in ``train.yaml``): :func:`validate` a run's config, or
    every job's config of a multirun as the launcher will compose it, before Hydra creates the
    first directory (a run's ``outputs/<date>/<time>/``, ``.hydra/`` and ``train.log``), so that a
    refused config leaves nothing behind and a bad combination fails the whole sweep at once
    (``error: <message>``, exit code 2) instead of after the jobs before it trained.
    """

    @override
    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        with exit_on_config_error(), _as_running_job(config):
            validate(config)

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
        with exit_on_config_error():
            for overrides in jobs:
                job = loader.load_sweep_config(config, overrides)
                with _as_running_job(job):
                    validate(job)


#: The name of :class:`ValidateJobs` in configs written before it also checked single runs.
ValidateSweep = ValidateJobs


@contextlib.contextmanager
def _as_running_job(job: DictConfig) -> Iterator[None]:
    """``${hydra:...}`` in the job's config (``paths.data_dir``) reads the job's Hydra node, as it
    will when the job runs."""
    hydra_config = HydraConfig.instance()
    saved = hydra_config.cfg
    hydra_config.set_config(job)
    try:
        yield
    finally:
        hydra_config.cfg = saved
