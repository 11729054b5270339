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

import ast
import difflib
import inspect
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

__all__ = [
    "CHECKED_GROUPS",
    "accepted_keys",
    "check_keys",
    "check_override_keys",
    "check_overrides",
    "job_lists",
    "parse_command_line",
    "source_signature",
    "split_checked",
    "unknown_key",
]

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
    target, a target that cannot be located, or ``**kwargs`` going elsewhere).

    A target whose module is not imported yet is read from its source (:func:`source_signature`)
    rather than imported: ``lightning.pytorch.Trainer`` takes seconds to import, and this check
    runs before the service imports Lightning, so that a bad key is reported at once.
    """
    if not isinstance(node, DictConfig) or "_target_" not in node:
        return None
    target: str | None = str(node._target_)
    keys: set[str] = set(_HYDRA_KEYS)
    while target is not None:
        found = source_signature(target) or _imported_signature(target)
        if found is None:
            return None
        names, forwards_to = found
        keys |= names
        if forwards_to == "":
            return keys
        target = forwards_to
    return None


def _imported_signature(path: str) -> tuple[set[str], str | None] | None:
    """:func:`source_signature`'s answer from the imported object (importing it)."""
    from hydra.utils import get_object

    try:
        target = get_object(path)
        params = inspect.signature(target).parameters.values()
    except Exception:  # the constructor check reports a bad _target_ with its own message
        return None
    names = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        return names, ""
    forwards = getattr(target, "forwards_kwargs_to", None)
    return names, (f"{forwards.__module__}.{forwards.__qualname__}" if forwards else None)


def source_signature(path: str) -> tuple[set[str], str | None] | None:
    """The argument names of the function or class (its ``__init__``) at the dotted ``path``,
    read from its module's source with :mod:`ast`, without importing the module, and where its
    ``**kwargs`` go: ``""`` when it takes none, the dotted path of the callable named by a
    top-level ``<name>.forwards_kwargs_to = <callable>`` of its module, or ``None`` (unknown).

    Follows ``from X import name`` re-exports (``lightning.pytorch.Trainer`` is defined in
    ``lightning.pytorch.trainer.trainer``). Returns ``None`` when the module is already imported
    (the caller then inspects the object itself) or the source does not say plainly (a class
    without its own ``__init__``, a name bound by anything but ``def``, ``class`` or an import).
    ``tests/test_keys.py`` checks the answer against :func:`inspect.signature` for every target
    in ``conf/``.
    """
    for _ in range(8):  # re-exports followed
        module, _, name = path.rpartition(".")
        if not module or module in sys.modules:
            return None
        tree = _module_ast(module)
        if tree is None:
            return None
        found = _definition(tree, name, module)
        if isinstance(found, str):
            path = found
            continue
        if found is None:
            return None
        args = found.args
        names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
        if found.name == "__init__":
            names = names[1:]
        if args.kwarg is None:
            return set(names), ""
        forwards = _forwards_kwargs_to(tree, name, module)
        return set(names), forwards
    return None


def _module_ast(module: str) -> ast.Module | None:
    """The parsed source of ``module``, found on ``sys.path`` without importing any package."""
    from importlib.machinery import PathFinder

    search: list[str] | None = None
    spec = None
    parts = module.split(".")
    for depth in range(len(parts)):
        name = ".".join(parts[: depth + 1])
        parent = sys.modules.get(name)
        if parent is not None and depth < len(parts) - 1:
            search = list(getattr(parent, "__path__", []))
            continue
        spec = PathFinder.find_spec(name, search)
        if spec is None:
            return None
        search = list(spec.submodule_search_locations or [])
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    try:
        return ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None


def _definition(
    tree: ast.Module, name: str, module: str
) -> ast.FunctionDef | ast.AsyncFunctionDef | str | None:
    """What binds ``name`` at the top level of ``tree``: a function (a class's ``__init__``),
    the dotted path it is imported from, or ``None``."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
        if isinstance(node, ast.ClassDef) and node.name == name:
            return next(
                (
                    item
                    for item in node.body
                    if isinstance(item, ast.FunctionDef) and item.name == "__init__"
                ),
                None,
            )
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    return f"{_absolute(node, module)}.{alias.name}"
    return None


def _absolute(node: ast.ImportFrom, module: str) -> str:
    """The absolute module of ``from <node.module> import ...`` written in ``module``."""
    if not node.level:
        return str(node.module)
    package = module.rsplit(".", node.level)[0]
    return f"{package}.{node.module}" if node.module else package


def _forwards_kwargs_to(tree: ast.Module, name: str, module: str) -> str | None:
    """The dotted path of ``X`` in a top-level ``<name>.forwards_kwargs_to = X``, or ``None``."""
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(target := node.targets[0], ast.Attribute)
            and target.attr == "forwards_kwargs_to"
            and isinstance(target.value, ast.Name)
            and target.value.id == name
            and isinstance(node.value, ast.Name)
        ):
            found = _definition(tree, node.value.id, module)
            if isinstance(found, str):
                return found
            return f"{module}.{node.value.id}" if found is not None else None
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

    try:
        parsed = parse_command_line(argv)
    except Exception:
        return  # a bad override: Hydra reports it
    if parsed is None:
        return
    checked, rest = split_checked(parsed[1])
    if not checked:
        return
    for job in job_lists(rest):
        try:
            with initialize_config_dir(config_dir, version_base="1.3"):
                cfg = compose(config_name, overrides=job)
        except Exception:
            return  # Hydra reports it, with its own message
        check_override_keys(checked, cfg)


def parse_command_line(argv: Sequence[str]) -> tuple[Any, list[Any]] | None:
    """Hydra's reading of a command line: its arguments and parsed overrides; ``None`` when the
    command is not a job with the shipped config (``--help``, ``--info``, ``--cfg``, shell
    completion, another config) or Hydra's own parser refuses it (it then says why).

    Raises:
        hydra.errors.OverrideParseException: an override that is not valid syntax.
    """
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        args = get_args_parser().parse_args(list(argv))
    except (Exception, SystemExit):
        return None
    if args.help or args.hydra_help or args.info or args.shell_completion or args.cfg:
        return None
    if args.config_path or args.config_dir or args.config_name:
        return None
    return args, OverridesParser.create().parse_overrides(args.overrides)


def split_checked(overrides: list[Any]) -> tuple[list[Any], list[Any]]:
    """``(checked, rest)``: the ``group.key`` overrides of :data:`CHECKED_GROUPS`, the others."""
    checked = [
        o
        for o in overrides
        if o.package is None
        and "." in o.key_or_group
        and o.key_or_group.split(".")[0] in CHECKED_GROUPS
    ]
    return checked, [o for o in overrides if o not in checked]


def check_override_keys(checked: list[Any], cfg: DictConfig) -> None:
    """Each of the ``checked`` overrides against ``cfg``, composed without them (see
    :func:`_check_override`).

    Raises:
        UnknownKeyError: naming the first unknown key and the closest accepted one.
    """
    for override in checked:
        _check_override(override, cfg)


def job_lists(overrides: list[Any]) -> list[list[str]]:
    """The override lists of every job the other overrides' sweeps (``bn=local,sync``) make."""
    if not any(o.is_sweep_override() for o in overrides):
        return [[o.input_line for o in overrides]]
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    batches = BasicSweeper.split_arguments(overrides, None)
    return [job for batch in batches for job in batch]
