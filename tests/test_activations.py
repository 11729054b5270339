"""The one activation registry (``syncbn_lightning.ops.activations.ACTIVATIONS``) against everything
that must agree with it: the C++ kernels' ``ActKind`` enum, the names ``SyncBatchNormAct`` accepts,
the modules it fuses, and the documentation's table (generated from it)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from syncbn_lightning import SyncBatchNormAct
from syncbn_lightning.ops.activations import (
    ACTIVATIONS,
    activate,
    by_name,
    fused_activation,
    make_activation,
    markdown_table,
)

ROOT = Path(__file__).resolve().parents[1]
HEADER = ROOT / "csrc" / "include" / "activation.h"


def _cpp_kinds() -> dict[str, int]:
    """``ActKind``'s enumerators as ``{snake_name: value}``, and ``kActKinds``, from the header."""
    text = HEADER.read_text()
    body = re.search(r"enum class ActKind\s*:\s*int64_t\s*\{(.*?)\};", text, re.S)
    assert body, "csrc/include/activation.h has no `enum class ActKind : int64_t { ... };`"
    kinds = {}
    for name, value in re.findall(r"\bk(\w+)\s*=\s*(\d+)", body.group(1)):
        kinds[re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()] = int(value)
    count = re.search(r"constexpr int64_t kActKinds\s*=\s*(\d+);", text)
    assert count, "csrc/include/activation.h has no kActKinds"
    kinds["<count>"] = int(count.group(1))
    return kinds


def test_the_registry_is_the_cpp_enum() -> None:
    expected = {a.name: a.code for a in ACTIVATIONS} | {"<count>": len(ACTIVATIONS)}
    assert _cpp_kinds() == expected


def test_every_cpp_kind_has_a_case_in_the_kernels() -> None:
    """Each kind other than the identity is handled by the forward, the gradient and the vector
    dispatch of ``FusedAct`` (a new enumerator without its cases would silently be the identity)."""
    text = HEADER.read_text()
    for kind in (name for name in _cpp_kinds() if name not in ("identity", "<count>")):
        camel = "k" + "".join(part.capitalize() for part in kind.split("_"))
        cases = len(re.findall(rf"case ActKind::{camel}\b", text))
        assert cases >= 3, (kind, cases)


@pytest.mark.parametrize("row", ACTIVATIONS, ids=[a.name for a in ACTIVATIONS])
def test_each_row_builds_its_module_and_is_fused(row) -> None:
    module = make_activation(row.name)
    assert type(module) is row.module
    code, param = fused_activation(module)
    assert code == row.code and by_name(row.name.upper()) is row
    layer = SyncBatchNormAct(4, act=row.name)
    assert layer.fused_activation == (row.code, param)
    z = torch.linspace(-4, 4, 33)
    torch.testing.assert_close(activate(z, row.code, param), module(z))


def test_modules_the_kernels_do_not_compute_are_not_fused() -> None:
    assert fused_activation(nn.GELU(approximate="tanh")) is None
    assert fused_activation(nn.Tanh()) is None
    assert fused_activation(None) == (0, 0.0)
    assert fused_activation(nn.LeakyReLU(0.2)) == (by_name("leaky_relu").code, 0.2)
    with pytest.raises(ValueError, match="act='swish' is not a known activation"):
        make_activation("swish")


def test_the_docs_table_is_generated_from_the_registry() -> None:
    table = markdown_table().splitlines()
    assert len(table) == 2 + len(ACTIVATIONS)
    for line, row in zip(table[2:], ACTIVATIONS, strict=True):
        assert f'`"{row.name}"`' in line and f"nn.{row.module.__name__}" in line
    page = (ROOT / "docs" / "timm.md").read_text()
    hook = (ROOT / "docs" / "hooks" / "activations.py").read_text()
    marker = re.search(r'MARKER = "(.*)"', hook)
    assert marker and marker.group(1) in page
    assert "docs/hooks/activations.py" in (ROOT / "mkdocs.yml").read_text()
