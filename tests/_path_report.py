"""Which path the synchronized layers of each test took, for the GPU check of the C++ path.

With ``SYNCBN_PATH_REPORT=<file>`` set (``benchmarks/native_check.py`` sets it for its test
steps), every plan a layer makes for a synchronized call appends one line to the file: the test
file it ran in (from ``PYTEST_CURRENT_TEST``, which the workers of ``tests/_dist.py`` inherit),
the device type, and ``1`` for the C++ path or ``0`` for the Python path. The check reads it
(``native_check.read_paths``): each
test file of its native step must show C++-path plans on CUDA, or the file did not test what
the step says it tested. Installed by ``conftest.py`` and by ``_dist``'s workers; nothing
happens without the variable.
"""

from __future__ import annotations

import os
from typing import Any

ENV = "SYNCBN_PATH_REPORT"


def install() -> None:
    """Wrap the layer's plan so that each synchronized plan is reported (see the module
    docstring); a no-op without ``SYNCBN_PATH_REPORT``."""
    path = os.environ.get(ENV)
    if not path:
        return
    from syncbn_lightning.functional import layer_call as sync_plan

    made = sync_plan.SyncPlan.__init__
    if getattr(made, "_reports_paths", False):
        return

    def init(self: Any, layer: Any, *args: Any, **kwargs: Any) -> None:
        made(self, layer, *args, **kwargs)
        if self.world_size == 1 and not layer.sync_options.force_sync:
            return  # a plain BatchNorm call: no path to choose
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split("::")[0]
        with open(path, "a") as report:  # one short append per plan: whole lines
            report.write(f"{test}\t{self.device}\t{int(self.native)}\n")

    init._reports_paths = True  # type: ignore[attr-defined]
    sync_plan.SyncPlan.__init__ = init  # type: ignore[method-assign]
