"""The extension's error messages are built from strings only (``csrc/include/check.h``).

On the GPU machine's image every extension links libstdc++ statically, and an ostream that
formats an integer inside the extension crashes the process (``benchmarks/RESULTS.md``, "Known
defect of the GPU image"). So no check in ``csrc/`` may hand numbers to TORCH_CHECK's own
formatting, and no code there may format through a stream: every check is a ``SYNCBN_CHECK``
(its ``_VALUE`` and ``_TYPE`` forms), whose pieces become strings first. The messages still name
the numbers, as the behavioural tests below show.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from syncbn_lightning.ops import build as ops_build

CSRC = Path(__file__).resolve().parents[1] / "csrc"
CHECK_HEADER = CSRC / "include" / "check.h"
SOURCES = sorted(p for p in CSRC.rglob("*") if p.suffix in (".h", ".cuh", ".cpp", ".cu"))

#: torch's checks that format their message themselves (through an ostream).
TORCH_CHECKS = re.compile(
    r"\b(TORCH_CHECK\w*|TORCH_INTERNAL_ASSERT\w*|AT_ERROR|AT_ASSERT\w*|TORCH_WARN\w*)\s*\("
)
#: Formatting through a stream.
STREAMS = re.compile(r"\b(std::)?(o|i)?stringstream\b|\bstd::(ostream|cout|cerr)\b|\bc10::str\(")


def _code(path: Path) -> str:
    """``path``'s text without comments and string literals (what the compiler reads as code)."""
    text = path.read_text()
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r'"(\\.|[^"\\])*"', '""', text)
    return re.sub(r"//[^\n]*", " ", text)


def test_every_check_in_csrc_is_a_syncbn_check() -> None:
    offenders = [
        f"{path.relative_to(CSRC)}: {match.group(1)}"
        for path in SOURCES
        if path != CHECK_HEADER
        for match in TORCH_CHECKS.finditer(_code(path))
    ]
    assert not offenders, (
        "use SYNCBN_CHECK (csrc/include/check.h), whose message is built from strings, instead "
        f"of torch's own checks: {offenders}"
    )
    assert "SYNCBN_CHECK(" in _code(CSRC / "ops" / "common.cpp")  # the rule is not vacuous


def test_nothing_in_csrc_formats_through_a_stream() -> None:
    offenders = [
        f"{path.relative_to(CSRC)}: {match.group(0)}"
        for path in SOURCES
        for match in STREAMS.finditer(_code(path))
    ]
    assert not offenders, f"format with check::message (csrc/include/check.h): {offenders}"


def test_the_rules_catch_what_they_name(tmp_path: Path) -> None:
    """The two patterns find a TORCH_CHECK that formats a number and a stream (outside
    comments and strings), and nothing in a comment or a string."""
    probe = tmp_path / "probe.cpp"
    probe.write_text(
        '// TORCH_CHECK(x, "in a comment", 1);\n'
        'const char* s = "std::ostringstream TORCH_CHECK(";\n'
        'void f(int n) { TORCH_CHECK(n > 0, "n must be > 0, got ", n); }\n'
        "void g(int n) { std::ostringstream out; out << n; }\n"
    )
    code = _code(probe)
    assert [m.group(1) for m in TORCH_CHECKS.finditer(code)] == ["TORCH_CHECK"]
    assert [m.group(0) for m in STREAMS.finditer(code)] == ["std::ostringstream"]


@pytest.fixture(scope="module")
def ops():
    ops_build.load_extension()
    return torch.ops.syncbn


def test_messages_still_name_the_numbers(ops) -> None:
    """Integers, shapes, doubles, dtypes and devices reach the message as text."""
    with pytest.raises(RuntimeError, match=r"got 1-D input of shape \[3\]"):
        ops.local_stats(torch.zeros(3))
    counts, means = torch.ones(2), torch.zeros(2, 4)
    with pytest.raises(RuntimeError, match=r"`eps` must be > 0, got -0\.25"):
        ops.merge_stats(counts, means, means, -0.25, True)
    with pytest.raises(RuntimeError, match=r"`means` must be float32 or float64, got Half"):
        ops.merge_stats(counts.half(), means.half(), means.half(), 1e-5, True)
    with pytest.raises(RuntimeError, match=r"`m2s` must have the shape of `means` \[2, 4\], got"):
        ops.merge_stats(counts, means, torch.zeros(2, 3), 1e-5, True)


@pytest.mark.slow
def test_an_extension_with_a_static_libstdcxx_still_raises_messages_with_numbers(tmp_path) -> None:
    """The GPU image's defect, reproduced here: linked with ``-static-libstdc++`` beside torch's
    shared one, an ostream inside the extension formats no number (this machine: it prints
    nothing; the image: it crashes). Built so, the extension's checks still name their numbers
    (they never use a stream), its link record says libstdc++ is static, and the layers then run
    Python's input checks in front of the C++ path."""
    code = textwrap.dedent(
        """
        import torch, torch.distributed as dist
        from syncbn_lightning.ops import build
        spec = build._build_spec
        def static_spec(cuda=None):
            s = spec(cuda)
            s["ldflags"] = [*s["ldflags"], "-static-libstdc++"]
            s["name"] += "_static"
            return s
        build._build_spec = static_spec
        ext = build.load_extension()
        assert ext.static_libstdcxx, "the record should say libstdc++ is static"
        try:
            torch.ops.syncbn.local_stats(torch.zeros(3))
        except RuntimeError as exc:
            assert "got 1-D input of shape [3]" in str(exc), str(exc)
        dist.init_process_group("gloo", init_method="file://" + STORE, rank=0, world_size=1)
        from syncbn_lightning import SyncBatchNorm
        layer = SyncBatchNorm(4, force_sync=True)
        layer(torch.randn(2, 4, 3))
        assert layer._sync_plan.native and layer._sync_plan.checks_first
        try:
            layer(torch.randn(2, 3, 3))
        except ValueError as exc:
            assert "SyncBatchNorm input has 3 channels" in str(exc), str(exc)
        dist.destroy_process_group()
        print("ok")
        """
    ).replace("STORE", repr(str(tmp_path / "store")))
    env = {**os.environ, "SYNCBN_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
