"""Every code block of README.md runs, as a reader would run it.

The README's fences are read with markdown-it-py (what the docs site's Markdown parsers agree
on), and each ``python``, ``bash`` and ``console`` block is executed in a fresh working directory
that looks like the clone (the repository's top-level entries linked in), each command in its
own process, the way a reader pastes it into a shell:

* ``python``: the block's first line names its file (``# plain_pytorch.py``); the test writes
  it there. It runs as a ``bash`` line of the README runs it (``torchrun --nproc_per_node=2
  plain_pytorch.py``), else as ``python <file>``.
* ``bash``: every line is one command (``&&`` chains included), run by ``bash`` with the
  README's working directory; it must exit 0. Two kinds of command cannot run as they stand
  inside the test suite, and are run as follows instead, which the test states per line:
  ``pip install ARGS`` runs as ``pip install --dry-run ARGS`` (the suite must not change its
  own environment; what it checks is that the requirement resolves and is already met), and
  ``python -m pytest ARGS`` as ``python -m pytest ARGS --collect-only -q`` (the suite cannot
  run itself; what it checks is that the selection is valid and selects tests).
* ``console``: ``$ command`` lines, each followed by its expected output, compared exactly.
* ``text`` blocks are output shown to the reader, not run; one that directly follows a ``bash``
  block is what its last command prints: each of its lines other than ``...`` must match a line
  of that output, numbers and ``<placeholders>`` standing for any value. Every other fence must
  have one of these four languages (``test_every_block_has_a_language_the_test_knows``).

The blocks train and start processes: one test per block, slow-marked except the checks of the
README's structure.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RUN = ("python", "bash", "console")
SHOWN = ("text",)
#: Top-level entries of the clone that are not linked into the README's working directory.
NOT_LINKED = {".git", "outputs", "multirun", "data", "lightning_logs", "wandb", "site", "build"}


@dataclass(frozen=True)
class Block:
    """A fenced code block of the README: its language, text and first line number."""

    lang: str
    text: str
    line: int

    @property
    def file(self) -> str | None:
        """The file a ``python`` block names in its first line (``# name.py``)."""
        found = re.fullmatch(r"#\s*([\w.-]+\.py)", self.text.splitlines()[0].strip())
        return found[1] if found else None


def readme_blocks() -> list[Block]:
    tokens = MarkdownIt("commonmark").parse(README.read_text())
    return [
        Block(t.info.strip().split()[0] if t.info.strip() else "", t.content, t.map[0] + 1)
        for t in tokens
        if t.type == "fence" and t.map is not None
    ]


def _blocks(lang: str) -> list[Block]:
    return [b for b in readme_blocks() if b.lang == lang]


def _commands(block: Block) -> list[str]:
    """The commands of a ``bash`` block: its lines without comments, blank lines dropped."""
    commands = []
    for line in block.text.splitlines():
        tokens = shlex.split(line, comments=True)
        if tokens:
            commands.append(line.split(" #", 1)[0].strip())
    return commands


def as_run_in_the_suite(command: str) -> str:
    """``command`` as the test runs it (see the module docstring): ``pip install`` as a dry run,
    ``python -m pytest`` as a collection; every other command as it stands."""
    parts = [part.strip() for part in command.split("&&")]
    out = []
    for part in parts:
        if part.startswith("pip install "):
            part = "python -m pip install --dry-run " + part.removeprefix("pip install ")
        elif part.startswith("python -m pytest"):
            part += " --collect-only -q -p no:cacheprovider"
        out.append(part)
    return " && ".join(out)


def _shown_after(block: Block) -> Block | None:
    """The ``text`` block right after ``block`` (the next fence), if any."""
    blocks = readme_blocks()
    following = blocks[blocks.index(block) + 1 :]
    return following[0] if following and following[0].lang == "text" else None


def shown_line_pattern(line: str) -> re.Pattern[str]:
    """A shown output line as a pattern: numbers and ``<name>`` match any value.

    Example:
        >>> bool(shown_line_pattern("val/acc=0.93 in <dir>").search("x val/acc=0.8672 in /tmp/a"))
        True
    """
    parts = re.split(r"(<[^>]+>|\d+(?:\.\d+)?)", line.strip())
    body = "".join(
        r".+?" if p.startswith("<") else r"\d+(?:\.\d+)?" if p[:1].isdigit() else re.escape(p)
        for p in parts
    )
    return re.compile(body)


def _workspace(tmp_path: Path) -> Path:
    """A working directory that looks like the clone, with every named Python block written."""
    work = tmp_path / "clone"
    work.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in NOT_LINKED:
            (work / entry.name).symlink_to(entry)
    for block in _blocks("python"):
        assert block.file is not None, f"README.md:{block.line}: name the file (# name.py)"
        (work / block.file).write_text(block.text)
    return work


def _run(command: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "SYNCBN_RANK_CONFIG")}
    env.update(WANDB_SILENT="true", PYTHONPATH=str(ROOT))
    # The interpreter running the tests, and its environment's scripts (syncbn-train, torchrun).
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(
        ["bash", "-c", command],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# ----------------------------------------------------------------------------- the structure


def test_every_block_has_a_language_the_test_knows() -> None:
    blocks = readme_blocks()
    assert {b.lang for b in blocks} <= {*RUN, *SHOWN}, [(b.line, b.lang) for b in blocks]
    assert len([b for b in blocks if b.lang in RUN]) >= 6


def test_every_python_block_is_a_named_file_a_command_runs() -> None:
    commands = [c for b in _blocks("bash") for c in _commands(b)]
    for block in _blocks("python"):
        assert block.file is not None, f"README.md:{block.line}: name the file (# name.py)"
        runs = [c for c in commands if block.file in shlex.split(c)]
        mentioned = f"python {block.file}" in README.read_text()
        assert runs or mentioned, f"README.md says nowhere how to run {block.file}"


def test_shown_output_lines_match_the_lines_they_stand_for() -> None:
    pattern = shown_line_pattern("[train][INFO] - batch_size: norm batch 32 >= 32: reliable")
    assert pattern.search("[2026-11-26][train][INFO] - batch_size: norm batch 4 >= 16: reliable")
    assert not pattern.search("[train][INFO] - batch_size: norm batch 4 < 16: noisy")


def test_the_suite_runs_pip_and_pytest_lines_as_it_says() -> None:
    assert as_run_in_the_suite('pip install torch==2.13.0 && pip install -e ".[app]"') == (
        "python -m pip install --dry-run torch==2.13.0 && "
        'python -m pip install --dry-run -e ".[app]"'
    )
    assert as_run_in_the_suite('python -m pytest -m "not slow"') == (
        'python -m pytest -m "not slow" --collect-only -q -p no:cacheprovider'
    )
    assert as_run_in_the_suite("python train.py recipe=x") == "python train.py recipe=x"


# ----------------------------------------------------------------------------- running them


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("block", _blocks("bash"), ids=lambda b: f"line{b.line}")
def test_bash_block(block: Block, tmp_path: Path) -> None:
    work = _workspace(tmp_path)
    done = None
    for command in _commands(block):
        run = as_run_in_the_suite(command)
        done = _run(run, work, timeout=900)
        where = f"README.md:{block.line}: {command}\n(run as: {run})"
        assert done.returncode == 0, f"{where}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        if "--dry-run" in run:  # met already: at most the project itself would be installed
            wanted = re.findall(r"^Would install (.*)$", done.stdout, re.MULTILINE)
            extra = [p for w in wanted for p in w.split() if not p.startswith("syncbn_lightning")]
            assert extra == [], f"{where}: not installed here: {extra}"
        if "--collect-only" in run:
            counts = re.search(
                r"(\d+)(?:/\d+)? tests? collected|(\d+) tests? selected", done.stdout
            )
            assert counts and int(counts[1] or counts[2]) > 100, f"{where}\n{done.stdout[-500:]}"
    shown = _shown_after(block)
    if shown is not None and done is not None:
        printed = (done.stdout + done.stderr).splitlines()
        for line in shown.text.splitlines():
            if line.strip() in ("", "..."):
                continue
            pattern = shown_line_pattern(line)
            assert any(pattern.search(p) for p in printed), f"README.md:{shown.line}: {line}"


def _python_blocks_no_bash_line_runs() -> list[Block]:
    commands = [c for b in _blocks("bash") for c in _commands(b)]
    return [b for b in _blocks("python") if not any(b.file in shlex.split(c) for c in commands)]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("block", _python_blocks_no_bash_line_runs(), ids=lambda b: f"{b.file}")
def test_python_block_runs_as_a_script(block: Block, tmp_path: Path) -> None:
    """The blocks no ``bash`` line runs (the others run there), as ``python <file>``."""
    work = _workspace(tmp_path)
    done = _run(f"python {block.file}", work, timeout=500)
    assert done.returncode == 0, f"README.md:{block.line}\n{done.stderr[-3000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("block", _blocks("console"), ids=lambda b: f"line{b.line}")
def test_console_block_prints_what_it_shows(block: Block, tmp_path: Path) -> None:
    work = _workspace(tmp_path)
    lines = block.text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("$ ")]
    assert starts, f"README.md:{block.line}: no $ command"
    for start, end in zip(starts, [*starts[1:], len(lines)], strict=True):
        command, expected = lines[start][2:], lines[start + 1 : end]
        done = _run(command, work, timeout=120)
        printed = (done.stdout + done.stderr).splitlines()
        assert printed == expected, f"README.md:{block.line}: {command}\n{done.stderr[-2000:]}"
        assert list(work.glob("outputs")) == []  # a refused config writes nothing
