"""timm for the tests, which CI installs outside the environment (``.ci/run``).

timm needs torchvision, and the only torchvision 0.28 on PyPI for Linux is a CUDA build: beside
the CPU torch wheel its compiled library cannot load (it links ``libtorch_cuda.so``) and
``import torchvision`` then fails registering fake kernels for its ``nms``/``qnms`` operators. In
the environment that would also break ``import lightning`` (torchmetrics imports torchvision when
it is installed), so ``.ci/run`` puts both in ``<repo>/.third_party`` with ``pip install
--target``, a folder only these tests add to ``sys.path`` (last: an installed timm or torchvision
wins). Where torchvision's library does not load, :func:`import_timm` declares the two operator
schemas, without kernels, before importing it: torchvision's Python modules import, and its
compiled operators (which no test here calls) raise if called. A torchvision whose library loads
is used as it is.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

THIRD_PARTY = Path(__file__).resolve().parents[1] / ".third_party"
# The schemas of the operators torchvision's _meta_registrations.py registers fake kernels for.
_TORCHVISION_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_declared: list[torch.library.Library] = []  # kept alive: dropping a Library deregisters it


def _torchvision_library_loads() -> bool:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return True  # nothing to declare: the timm import below reports the missing package
    lib = next(Path(spec.submodule_search_locations[0]).glob("_C*.so"), None)
    if lib is None:
        return False
    try:
        torch.ops.load_library(str(lib))
    except OSError:
        return False
    return True


def _declare_torchvision_ops() -> None:
    if _declared or hasattr(torch.ops.torchvision, "nms") or _torchvision_library_loads():
        return
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for schema in _TORCHVISION_SCHEMAS:
        lib.define(schema)
    _declared.append(lib)


def import_timm() -> ModuleType:
    """``import timm`` (see the module docstring), or skip the test when it is not installed.

    With ``SYNCBN_REQUIRE_TIMM=1`` (set by ``.ci/run``) a missing timm fails instead.
    """
    added = THIRD_PARTY.is_dir() and str(THIRD_PARTY) not in sys.path
    if added:
        sys.path.append(str(THIRD_PARTY))
    try:
        _declare_torchvision_ops()
        import timm
    except ImportError as exc:
        if os.environ.get("SYNCBN_REQUIRE_TIMM") == "1":
            raise
        pytest.skip(f"timm is not importable ({exc}); see .ci/run for how CI installs it")
    finally:
        # Off the path again: processes spawned later inherit sys.path, and there an import of
        # lightning would find this torchvision without the declared schemas.
        if added:
            sys.path.remove(str(THIRD_PARTY))
    return timm
