"""Unknown keys under ``bn``, ``trainer`` and ``data``: one line naming the key and the closest
valid one, before any process starts.

Two checks, both deriving the valid keys from what the code and the configs already say (never a
hand-kept list, so a key another option or constructor adds is valid at once):

* :func:`check_keys` reads a composed config: every key of those groups must be an argument of the
  node's ``_target_`` (``lightning.pytorch.Trainer``, the datamodule, the ``bn`` builder and the
  :class:`~syncbn_lightning.SyncBNCallback` it forwards to). :func:`~.config.validate` calls it, so
  ``+trainer.device=4`` fails there, before the launcher starts a rank.
* :func:`check_overrides` reads the command line before Hydra does: Hydra refuses a key that is
  not in the config (``bn.grup_size=2``) with a multi-line message whose hint (``+bn.grup_size=2``)
  leads to a worse error. It composes the config with the command line's group choices and checks
  each ``group.key=value`` against it (and against the ``_target_``'s arguments for ``+key``).
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Iterable, Sequence
from typing import Any

from omegaconf import DictConfig

__all__ = ["CHECKED_GROUPS", "accepted_keys", "check_keys", "check_overrides", "unknown_key"]

#: The config groups whose keys are checked (the others are checked by their constructors).
CHECKED_GROUPS = ("bn", "trainer", "data")

#: Keys Hydra's ``instantiate`` reads itself.
_HYDRA_KEYS = frozenset({"_target_", "_convert_", "_recursive_", "_partial_", "_args_"})


class UnknownKeyError(ValueError):
    """A key no option of its group defines and its ``_target_`` does not take (one line)."""


def accepted_keys(node: Any) -> set[str] | None:
    """The keys ``instantiate(node)`` accepts: the arguments of its ``_target_``, plus those of
    the callable named by the target's ``forwards_kwargs_to`` attribute when it takes
    ``**kwargs`` (``bn_callback`` forwards to ``SyncBNCallback``); ``None`` when unknown (no
    target, a target that cannot be located, or ``**kwargs`` going elsewhere)."""
    if not isinstance(node, DictConfig) or "_target_" not in node:
        return None
    from hydra.utils import get_object

    try:
        target = get_object(str(node._target_))
    except Exception:  # the constructor check reports a bad _target_ with its own message
        return None
    keys: set[str] = set(_HYDRA_KEYS)
    while target is not None:
        try:
            params = inspect.signature(target).parameters.values()
        except (TypeError, ValueError):
            return None
        keys |= {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            return keys
        target = getattr(target, "forwards_kwargs_to", None)
    return None


def unknown_key(key: str, candidates: Iterable[str]) -> UnknownKeyError:
    """The error for ``key`` (``bn.grup_size``): the closest of ``candidates`` (keys of the same
    node, without its prefix) by :func:`difflib.get_close_matches`, or the list of them."""
    prefix, _, name = key.rpartition(".")
    names = sorted({c for c in candidates if not c.startswith("_")})
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    if close:
        return UnknownKeyError(f"unknown key {key}: did you mean {prefix}.{close[0]}?")
    return UnknownKeyError(f"unknown key {key}: {prefix} takes {', '.join(names)}")


def check_keys(cfg: DictConfig) -> None:
    """Check that every key under :data:`CHECKED_GROUPS` is an argument of its node's target.

    Raises:
        UnknownKeyError: naming the first unknown key and the closest accepted one.
    """
    for group in CHECKED_GROUPS:
        node = cfg.get(group)
        accepted = accepted_keys(node)
        if accepted is None:
            continue
        for key in node:
            if key not in accepted:
                raise unknown_key(f"{group}.{key}", accepted)


def _node_keys(node: Any) -> set[str]:
    return {str(k) for k in node} if isinstance(node, DictConfig) else set()


def _check_override(override: Any, cfg: DictConfig) -> None:
    """One ``group.a.b=value`` override against the composed ``cfg`` (see :func:`check_overrides`).

    A plain override or a deletion (``~``) needs the key in the config, as Hydra does, but says so
    in one line. An addition (``+``/``++``) one level under the group needs an argument of the
    group's target; deeper additions are left to the constructors' own checks.
    """
    key: str = override.key_or_group
    parts = key.split(".")
    parent: Any = cfg
    for depth, part in enumerate(parts[:-1]):
        if not isinstance(parent, DictConfig) or part not in parent:
            if override.is_add() or override.is_force_add():
                return  # a new subtree: left to the constructors
            raise unknown_key(".".join(parts[: depth + 1]), _node_keys(parent))
        parent = parent[part]
    name = parts[-1]
    accepted = accepted_keys(parent) if len(parts) == 2 else None
    exists = isinstance(parent, DictConfig) and name in parent
    if override.is_add() or override.is_force_add():
        if not exists and accepted is not None and name not in accepted:
            raise unknown_key(key, accepted)
        return
    if exists or not isinstance(parent, DictConfig):
        return
    if accepted is not None and name in accepted and not override.is_delete():
        raise UnknownKeyError(
            f"{key} is not in the config: add it with +{override.input_line.lstrip('+')}"
        )
    raise unknown_key(key, _node_keys(parent) | (accepted or set()))


def check_overrides(argv: Sequence[str], config_dir: str, config_name: str = "train") -> None:
    """Check the command line's keys under :data:`CHECKED_GROUPS` before Hydra composes it.

    Args:
        argv: the command line's arguments (``sys.argv[1:]``), Hydra's flags included.
        config_dir: the directory of ``config_name``.yaml and its groups.
        config_name: the primary config.

    Raises:
        UnknownKeyError: one line naming the first unknown key and the closest valid one.

    Note:
        Anything else that is wrong (a bad group option, a parse error, ``--config-dir``) is left
        to Hydra: this check returns without a word when it cannot compose the config.
    """
    from hydra import compose, initialize_config_dir
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        args = get_args_parser().parse_args(list(argv))
        overrides = OverridesParser.create().parse_overrides(args.overrides)
    except (Exception, SystemExit):
        return
    if args.help or args.hydra_help or args.info or args.shell_completion:
        return
    if args.config_path or args.config_dir or args.config_name:
        return
    checked = [
        o
        for o in overrides
        if o.package is None
        and "." in o.key_or_group
        and o.key_or_group.split(".")[0] in CHECKED_GROUPS
    ]
    if not checked:
        return
    rest = [o for o in overrides if o not in checked]
    for job in _jobs(rest):
        try:
            with initialize_config_dir(config_dir, version_base="1.3"):
                cfg = compose(config_name, overrides=job)
        except Exception:
            return  # Hydra reports it, with its own message
        for override in checked:
            _check_override(override, cfg)


def _jobs(overrides: list[Any]) -> list[list[str]]:
    """The override lists of every job the other overrides' sweeps (``bn=local,sync``) make."""
    if not any(o.is_sweep_override() for o in overrides):
        return [[o.input_line for o in overrides]]
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    batches = BasicSweeper.split_arguments(overrides, None)
    return [job for batch in batches for job in batch]
