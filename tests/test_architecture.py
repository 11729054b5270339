"""The library's layout holds: the import contracts of pyproject.toml (`lint-imports`), no import
circles, and no import of the library's own modules deferred into a function body. (Files are
split by concern, not by a count of lines: no length is checked here; STYLE.md.)

Layers (docs/architecture.md): ``app -> lightning -> nn -> functional -> distributed | ops``; the
contracts check that every import runs down that list and that only ``lightning/`` and ``app/``
import Lightning. What the contracts do not see is checked here: circles inside a layer, and
imports hidden in function bodies (the usual way a circle is kept alive).
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "syncbn_lightning"
# The library without the service. (Lightning's public names are loaded on first use through
# importlib, so that `import syncbn_lightning` does not import Lightning: not an import statement.)
LIBRARY = [p for p in PACKAGE.rglob("*.py") if "app" not in p.relative_to(PACKAGE).parts]


def test_import_contracts_hold() -> None:
    command = shutil.which("lint-imports") or f"{Path(sys.executable).parent}/lint-imports"
    done = subprocess.run(
        [command], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def _library_graph() -> dict[str, set[str]]:
    graph = grimp.build_graph("syncbn_lightning", cache_dir=None)
    library = {m for m in graph.modules if not m.startswith("syncbn_lightning.app")}
    return {
        m: {d for d in graph.find_modules_directly_imported_by(m) if d in library} for m in library
    }


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in edges[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_the_library_import_graph_has_no_circle() -> None:
    edges = _library_graph()
    assert len(edges) > 20
    assert _cycles(edges) == []


def _deferred_own_imports(path: Path) -> list[int]:
    """Lines of ``path`` that import a module of this library inside a function body."""
    tree = ast.parse(path.read_text())
    found = []
    for func in ast.walk(tree):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(func):
            if isinstance(node, ast.ImportFrom) and (
                node.level > 0 or (node.module or "").startswith("syncbn_lightning")
            ):
                found.append(node.lineno)
            elif isinstance(node, ast.Import) and any(
                a.name.startswith("syncbn_lightning") for a in node.names
            ):
                found.append(node.lineno)
    return found


def test_no_import_of_the_library_is_deferred_into_a_function() -> None:
    deferred = [
        f"{path.relative_to(ROOT)}:{n}" for path in LIBRARY for n in _deferred_own_imports(path)
    ]
    assert deferred == []


def test_the_check_sees_a_deferred_import(tmp_path: Path) -> None:
    source = tmp_path / "mod.py"
    source.write_text("def f():\n    from .convert import KEEP\n    return KEEP\n")
    assert _deferred_own_imports(source) == [2]


def test_every_cuda_kernel_declares_its_block_size() -> None:
    """``__global__ void __launch_bounds__(...) name(``: without the bound ptxas may give a kernel
    more registers than its block can hold, and the launch fails on the GPU only ("too many
    resources requested for launch": the float64 merge kernels, 78 registers x 1024 threads)."""
    kernels = {
        f"{p.name}: {line.strip()}"
        for p in (ROOT / "csrc").rglob("*.cu*")
        for line in p.read_text().splitlines()
        if line.lstrip().startswith("__global__")
    }
    assert len(kernels) >= 9
    assert {k for k in kernels if "__launch_bounds__(" not in k} == set()


def test_the_built_in_strategies_compute_and_never_communicate() -> None:
    """The exchange interface and the built-in strategies import no collective, no flight
    recorder and no call-order queue: they say what travels and where a mismatch would be found,
    and the call (functional/function.py, order_report.py) sends, checks and reports."""
    graph = grimp.build_graph("syncbn_lightning")
    for module in ("exchange", "gather", "reduce"):
        imported = graph.find_modules_directly_imported_by(f"syncbn_lightning.functional.{module}")
        talking = sorted(m for m in imported if m.startswith("syncbn_lightning.distributed"))
        assert talking == [], (module, talking)
