"""The torch releases a user has: one virtual environment per release, the project installed into
it, then the release's smoke (``tests/test_torch_release.py``, slow tests included) and the fast
check (``pytest -m "not slow"``), each within a time limit. Prints one table row per release
(``docs/torch-versions.md`` carries the table with its date).

    python benchmarks/torch_matrix.py [--versions 2.4.1,2.8.0,2.14.1] [--venvs DIR]
        [--smoke-only] [--timeout 600]

The registry's default torch builds carry their CUDA libraries (several GB per release): a venv is
made once per release and reused (``--venvs``, default ``~/.cache/syncbn_lightning/venvs``).
The extension builds in each venv's own cache directory (the build cache's key holds the torch
version and the interpreter), and ``ninja``'s log there gives the first build's compile times.
``--smoke-only``: the smoke alone (what CI runs on the floor). Exits 1 when a release fails.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The floor, a release in the middle, the newest the registry serves here (2026-11-28).
DEFAULT_VERSIONS = ("2.4.1", "2.8.0", "2.14.1")
SMOKE = "tests/test_torch_release.py"
# pytest's summary line: "12 passed, 3 skipped, 1 failed in 9.1s".
_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|deselected)")


@dataclass
class Row:
    """One release's results."""

    version: str
    install_s: float = 0.0
    build_s: float = 0.0
    runs: dict[str, tuple[str, float]] = field(default_factory=dict)  # what -> (summary, s)
    failed: bool = False


def summary_counts(output: str) -> dict[str, int]:
    """The counts of pytest's last summary line in ``output`` (``{}`` when it has none)."""
    lines = [line for line in output.splitlines() if " in " in line and _COUNT.search(line)]
    if not lines:
        return {}
    return {kind.rstrip("s") if kind.startswith("error") else kind: int(n)
            for n, kind in _COUNT.findall(lines[-1])}  # fmt: skip


def summary_text(counts: dict[str, int], returncode: int) -> str:
    """``"1161 passed, 496 skipped"``-like text of ``counts``; a run that ended without a
    summary (killed at its limit, or crashed) says so with its exit status."""
    if not counts:
        return "timed out" if returncode == 124 else f"no summary (exit {returncode})"
    order = ("passed", "failed", "error", "skipped")
    return ", ".join(f"{counts[k]} {k}" for k in order if counts.get(k))


def _run(command: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run ``command`` in the checkout with a time limit: (exit status, stdout + stderr)."""
    try:
        done = subprocess.run(
            command, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
            env={**os.environ, **(env or {})}, check=False,
        )  # fmt: skip
        return done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return 124, out


def make_venv(version: str, venvs: Path, smoke_only: bool) -> tuple[Path, float]:
    """The venv of torch ``version`` (made and installed into on first use): its python and the
    seconds the installs took (0 when reused). The project goes in with its test extras, or for
    the smoke alone with Lightning and pytest only (what the smoke imports)."""
    folder = venvs / f"torch-{version}"
    python = folder / "bin" / "python"
    if python.exists():
        return python, 0.0
    started = time.perf_counter()
    smoke = [f"{ROOT}[lightning]", "pytest", "pytest-timeout"]
    project = smoke if smoke_only else [f"{ROOT}[test]"]
    steps = [
        [sys.executable, "-m", "venv", str(folder)],
        [str(python), "-m", "pip", "install", "-q", f"torch=={version}"],
        [str(python), "-m", "pip", "install", "-q", "-e", *project],
    ]
    for step in steps:
        code, out = _run(step, timeout=3600)
        if code != 0:
            raise RuntimeError(f"{' '.join(step)} failed (exit {code}): {out[-2000:]}")
    return python, time.perf_counter() - started


def check_release(version: str, venvs: Path, smoke_only: bool, timeout: float) -> Row:
    """Install (or reuse), build, and run the smoke and the fast check on torch ``version``."""
    row = Row(version)
    python, row.install_s = make_venv(version, venvs, smoke_only)
    env = {"SYNCBN_CACHE_DIR": str(python.parent.parent / "syncbn-cache")}
    started = time.perf_counter()
    code, out = _run(
        [str(python), "-c", "from syncbn_lightning.ops import build; build.load_extension()"],
        timeout=timeout, env=env,
    )  # fmt: skip
    row.build_s = time.perf_counter() - started
    if code != 0:
        row.runs["build"], row.failed = (f"build failed: {out.strip()[-300:]}", row.build_s), True
        return row
    runs = {"smoke": [SMOKE]} if smoke_only else {"smoke": [SMOKE], "fast": ["-m", "not slow"]}
    for what, args in runs.items():
        started = time.perf_counter()
        command = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
        code, out = _run(command, timeout=timeout, env=env)
        counts = summary_counts(out)
        row.runs[what] = (summary_text(counts, code), time.perf_counter() - started)
        if code != 0 or counts.get("failed") or counts.get("error"):
            row.failed = True
            print(out[-4000:], file=sys.stderr)
    return row


def table(rows: list[Row]) -> list[str]:
    """The markdown table of ``rows``."""
    lines = [
        '| torch | install s | first build s | smoke | fast check (`-m "not slow"`) |',
        "|---|---:|---:|---|---|",
    ]
    for row in rows:
        cells = []
        for what in ("smoke", "fast"):
            text, seconds = row.runs.get(what, row.runs.get("build", ("-", 0.0)))
            cells.append(f"{text} ({seconds:.0f} s)" if text != "-" else "-")
        installed = f"{row.install_s:.0f}" if row.install_s else "reused"
        lines.append(
            f"| {row.version} | {installed} | {row.build_s:.0f} | {cells[0]} | {cells[1]} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", default=",".join(DEFAULT_VERSIONS))
    parser.add_argument(
        "--venvs", type=Path, default=Path.home() / ".cache" / "syncbn_lightning" / "venvs"
    )
    parser.add_argument("--smoke-only", action="store_true")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per step")
    args = parser.parse_args(argv)
    versions = [v.strip() for v in args.versions.split(",") if v.strip()]
    if not versions:
        parser.error("--versions: name at least one torch release, e.g. 2.4.1")
    args.venvs.mkdir(parents=True, exist_ok=True)
    print(f"command: python benchmarks/torch_matrix.py {' '.join(argv or sys.argv[1:])}")
    print(f"date: {time.strftime('%Y-%m-%d')}, Python {sys.version.split()[0]}\n")
    rows = [check_release(v, args.venvs, args.smoke_only, args.timeout) for v in versions]
    print("\n".join(table(rows)))
    return 1 if any(row.failed for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
