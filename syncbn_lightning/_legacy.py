"""Module paths of earlier versions, still importable: the library was one flat package until it
was split into ``ops``, ``distributed``, ``functional``, ``nn`` and ``lightning``.

Whole-model pickles (``torch.save(model)``) name the classes of a converted model by their module
path, and so do users' imports and Hydra ``_target_`` strings (``syncbn_lightning.callback
.SyncBNCallback``). An import of an old path gets the module that holds those names now, with a
``DeprecationWarning`` naming the new path.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

__all__ = ["MOVED", "install"]

#: Old module -> the module that holds its public names now.
MOVED = {
    "syncbn_lightning._backend": "syncbn_lightning.ops.build",
    "syncbn_lightning.activation": "syncbn_lightning.ops.activations",
    "syncbn_lightning.batchnorm": "syncbn_lightning.nn.batchnorm",
    "syncbn_lightning.batchnorm_act": "syncbn_lightning.nn.batchnorm_act",
    "syncbn_lightning.call_order": "syncbn_lightning.distributed.call_order",
    "syncbn_lightning.callback": "syncbn_lightning.lightning.callback",
    "syncbn_lightning.convert": "syncbn_lightning.nn.convert",
    "syncbn_lightning.data_parallel": "syncbn_lightning.nn.data_parallel",
    "syncbn_lightning.ddp_setup": "syncbn_lightning.lightning.ddp_setup",
    "syncbn_lightning.exchange": "syncbn_lightning.functional.reduce",
    "syncbn_lightning.function": "syncbn_lightning.functional.function",
    "syncbn_lightning.groups": "syncbn_lightning.distributed.groups",
    "syncbn_lightning.impl": "syncbn_lightning.ops.dispatch",
    "syncbn_lightning.layer_sync": "syncbn_lightning.lightning.layer_sync",
    "syncbn_lightning.metrics": "syncbn_lightning.nn.running_stats",
    "syncbn_lightning.monitoring": "syncbn_lightning.lightning.monitoring",
    "syncbn_lightning.precise_bn": "syncbn_lightning.nn.precise_bn",
    "syncbn_lightning.reference": "syncbn_lightning.ops.reference",
    "syncbn_lightning.torch_class": "syncbn_lightning.nn.batchnorm",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths of :data:`MOVED`; loading one puts the new module in its place in
    ``sys.modules`` (the import system returns what ``sys.modules`` holds after loading)."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> object:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        new = MOVED[module.__name__]
        warnings.warn(
            f"{module.__name__} is now {new}; import it from there (or the public names from "
            f"syncbn_lightning)",
            DeprecationWarning,
            stacklevel=2,
        )
        sys.modules[module.__name__] = importlib.import_module(new)


def install() -> None:
    """Make the old paths importable (once per process)."""
    if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModules())
