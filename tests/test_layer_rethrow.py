"""The C++ layer's hand-off of a call-order mismatch keeps the kernel's error as thrown (issue 55,
item 5: ``throw original;`` in ``layer_comm.cpp`` turned a derived error into a base
``c10::Error``).

Today's call-order checks all throw a plain ``c10::Error`` (``TORCH_CHECK``), so no public path
shows the difference (``test_layer_tags.py`` checks what must hold there). This test calls
``syncbn::layer::call_order_failed`` itself from a small C++ probe linked against the built
extension, inside the handler of a ``c10::ValueError``, with the Python report returning
instead of raising: the error must reach Python as the ``ValueError`` it was, not as the
``RuntimeError`` of its base.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.utils.cpp_extension import load_inline

from syncbn_lightning.functional import native
from syncbn_lightning.ops import build

pytestmark = pytest.mark.slow

_PROBE = r"""
#include <torch/extension.h>
#include "layer.h"

// Throws a c10::ValueError and hands it to the layer's call-order report, as the kernels' callers
// in layer.cpp do from their catch blocks.
void value_error_through_call_order_failed() {
  try {
    TORCH_CHECK_VALUE(false, "a derived kernel error");
  } catch (const c10::Error&) {
    syncbn::layer::Settings settings;
    const at::Tensor data = at::zeros({2});
    syncbn::layer::call_order_failed(
        syncbn::layer::Mismatch::kBackwardSums, data, at::Tensor(), 2, settings);
  }
}
"""


def test_a_derived_error_reaches_python_as_thrown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    extension = build.build_dir() / f"{build.load_extension().__name__}.so"
    csrc = build.csrc_dir()
    probe = load_inline(
        name="syncbn_rethrow_probe",
        cpp_sources=_PROBE,
        functions=["value_error_through_call_order_failed"],
        extra_include_paths=[str(csrc / "layer"), str(build.include_dir(csrc))],
        extra_ldflags=[str(extension), f"-Wl,-rpath,{extension.parent}"],
        build_directory=str(tmp_path),
        verbose=False,
    )
    native.register_python_kernels()  # as the layer does before its first call
    reported: list[tuple[object, ...]] = []
    monkeypatch.setattr(native, "_order_failed", lambda *args, **kwargs: reported.append(args))
    with pytest.raises(ValueError, match="a derived kernel error"):
        probe.value_error_through_call_order_failed()
    assert len(reported) == 1  # the report ran, returned, and the kernel's error stood
