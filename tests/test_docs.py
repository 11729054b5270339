"""The user documentation: the README stays a front page, the docs site builds, and neither cites
the project's internal bookkeeping (issue numbers, commit ids) that means nothing to a reader."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
USER_DOCS = [README, *sorted(DOCS.rglob("*.md"))]

#: "issue 12", "Issues #3", "#12" (not "call #1" of a quoted error message), "PR 4".
_ISSUE = re.compile(r"\b(?:issues?|PR)\s*#?\d+\b|(?<!call )(?<![\w&])#\d+\b", re.IGNORECASE)
#: A git commit id: 7-40 hex digits with at least one letter and one digit.
_COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")


def test_readme_is_a_front_page() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move details to docs/"
    text = "\n".join(lines)
    for must in ('python -m pytest -m "not slow"', "python -m pytest", "SyncBNCallback"):
        assert must in text, must


@pytest.mark.parametrize("path", USER_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_internal_references(path: Path) -> None:
    found = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        for pattern in (_ISSUE, _COMMIT):
            found += [f"{path.name}:{number}: {m[0]!r}" for m in pattern.finditer(line)]
        if re.search(r"has not run yet|not run on a GPU yet", line):
            found.append(f"{path.name}:{number}: status note for the team, not for readers")
    assert not found, "\n".join(found)


def test_patterns_catch_what_they_should() -> None:
    for text in ("see issue 12", "(#12)", "Issues #3", "at commit 71db57b"):
        assert _ISSUE.search(text) or _COMMIT.search(text), text
    for text in ("(call #1)", "4294967295", "## Heading", "`#[derive]`", "0.41762545"):
        assert not (_ISSUE.search(text) or _COMMIT.search(text)), text


def test_every_page_is_in_the_site_navigation() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())

    def pages(node: object) -> list[str]:
        if isinstance(node, str):
            return [node]
        if isinstance(node, dict):
            return [p for value in node.values() for p in pages(value)]
        if isinstance(node, list):
            return [p for item in node for p in pages(item)]
        return []

    listed = set(pages(config["nav"]))
    hidden = set(config.get("not_in_nav", "").split())
    on_disk = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert on_disk - hidden <= listed, sorted(on_disk - hidden - listed)
    assert listed <= on_disk, sorted(listed - on_disk)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason='needs ".[docs]"')
def test_site_builds_strict(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "api" / "index.html").read_text().count("SyncBatchNorm") > 5


def test_one_first_build_time_is_quoted_everywhere() -> None:
    """The README, Getting started, the kernels page and the build's own announcement quote the
    same measured first-build time (``MEASURED_BUILD_S``), and no page quotes another."""
    from syncbn_lightning.ops.build import MEASURED_BUILD_S

    quote = f"first build took {MEASURED_BUILD_S} s"
    for path in (README, DOCS / "getting-started.md", DOCS / "kernels.md"):
        text = " ".join(path.read_text().split())  # across line breaks
        assert quote in text, f"{path.name} does not quote {quote!r}"
    for path in USER_DOCS:
        text = " ".join(path.read_text().split())
        others = {
            int(n)
            for n in re.findall(r"(?:first|C\+\+) build (?:took|takes) (?:about )?(\d+) s", text)
        }
        assert others <= {MEASURED_BUILD_S}, f"{path.name} quotes {sorted(others)} s"
