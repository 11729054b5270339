"""The extension's C++ files compile as two translation units (``ops/build_units.py``): the
files that include torch's registration, autograd or c10d headers in one, the kernels in the
other; each file exactly once, by path, so that a compiler error still names it."""

from __future__ import annotations

from pathlib import Path

from syncbn_lightning.ops import build as ops_build
from syncbn_lightning.ops import build_units


def _cpp_files() -> list[Path]:
    return ops_build.csrc_files(ops_build.csrc_dir(), ".cpp")


def test_each_file_is_in_one_unit_by_its_includes(tmp_path: Path) -> None:
    sources = _cpp_files()
    units = build_units.write_units([*sources, Path("kernel.cu")], tmp_path)
    assert units[-1] == "kernel.cu"  # nvcc's files are compiled one by one, after the units
    included = {}
    for unit in units[:-1]:
        name = Path(unit).stem.removeprefix("unity_")
        for line in Path(unit).read_text().splitlines()[1:]:
            path = Path(line.removeprefix('#include "').removesuffix('"'))
            assert path.is_absolute() and path not in included, line
            included[path] = name
    assert sorted(included) == sorted(p.resolve() for p in sources)
    heavy = ("#include <torch/library.h>", "#include <torch/csrc/")
    for path, unit in included.items():
        text = path.read_text()
        assert (unit == "operators") is any(h in text for h in heavy), (path, unit)
    assert {"operators", "kernels"} == set(included.values())
    assert included[(ops_build.csrc_dir() / "layer" / "layer.cpp").resolve()] == "operators"
    assert included[(ops_build.csrc_dir() / "cpu" / "backward_cpu.cpp").resolve()] == "kernels"


def test_a_unit_is_rewritten_only_when_it_changes(tmp_path: Path) -> None:
    """ninja decides by modification time: an unchanged unit must keep its own."""
    sources = _cpp_files()
    first = build_units.write_units(sources, tmp_path)
    stamps = [Path(u).stat().st_mtime_ns for u in first]
    assert build_units.write_units(sources, tmp_path) == first
    assert [Path(u).stat().st_mtime_ns for u in first] == stamps
    build_units.write_units(sources[1:], tmp_path)  # one file fewer: its unit changes
    assert [Path(u).stat().st_mtime_ns for u in first] != stamps


def test_the_extension_was_built_from_the_two_units() -> None:
    ops_build.load_extension()
    ninja = (ops_build.build_dir() / "build.ninja").read_text()
    objects = sorted(line.split(":")[0].split()[1] for line in ninja.splitlines()
                     if line.startswith("build ") and ": compile " in line)  # fmt: skip
    assert objects == ["unity_kernels.o", "unity_operators.o"], objects
