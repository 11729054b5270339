"""The bad-input table of ``docs/errors.md``, read once, as the expected errors of its tests.

Each row of the doc's tables names an input, the exception type, the message and the test that
triggers it (``tests/test_errors_<part>.py::test_name``). The tests of ``tests/test_errors_*.py``
do not repeat the type or the message: each runs its trigger inside :func:`expect_row`, which looks
up the row of the running test and asserts exactly that type and message. A message is so written
twice: where the code raises it, and in the doc.

Message conventions (the doc's introduction explains them to readers): ``…`` stands for omitted
text, also across lines (a trailing ``…``: the message starts with this); ``<name>`` is a value the
test supplies as ``expect_row(name=value)``. Without ``…`` the quoted text is the whole message.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from _service import RENDEZVOUS_VARS

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "errors.md"

#: Where the exception names of the doc's ``exception`` column are looked up, in this order; a name
#: must resolve to one class (the same object wherever several of these modules export it).
EXCEPTION_MODULES = (
    "builtins",
    "syncbn_lightning",
    "syncbn_lightning.ops.build",
    "syncbn_lightning.app.config.checks",
    "torch",
    "hydra.errors",
    "lightning.pytorch.utilities.exceptions",
)

#: Variables that change what the rows' code checks: a launcher's rendezvous and cluster variables
#: (``train.validate`` reads them), the kernels' default choice, and W&B's mode.
ENVIRONMENT_VARS = (
    *RENDEZVOUS_VARS,
    "GROUP_RANK",
    "LOCAL_WORLD_SIZE",
    "SLURM_NTASKS",
    "SLURM_JOB_NAME",
    "LSB_JOBID",
    "SYNCBN_IMPL",
    "SYNCBN_RECOMPUTE",
    "WANDB_MODE",
)

_TEST_CELL = re.compile(r"`tests/(test_errors_\w+\.py)::(test_\w+)`")
_PLACEHOLDER = re.compile(r"<([a-z]+)>")


@dataclass(frozen=True)
class Row:
    """One row of the doc's tables.

    Args:
        section: the title of the ``##`` section the row is in.
        error: the exception's class name, as the doc writes it (``ValueError``, ``ConfigError``).
        message: the quoted message, with the doc's ``…`` and ``<name>`` conventions.
        file: the test file the row names, relative to ``tests/`` (``test_errors_layers.py``).
        test: the test function the row names.
        line: the row's line number in the doc (for failure messages).
    """

    section: str
    error: str
    message: str
    file: str
    test: str
    line: int


def _cells(line: str) -> list[str]:
    """The stripped cells of one markdown table line (``\\|`` is a pipe inside a cell)."""
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]


def _parse_row(cells: list[str], section: str, number: int) -> Row:
    """A :class:`Row` from the four cells ``input | exception | message | test`` of line
    ``number``; raises ``ValueError`` naming the line when a cell is not in the doc's format."""
    where = f"docs/errors.md:{number}"
    if len(cells) != 4:
        raise ValueError(f"{where}: a row needs 4 cells (input, exception, message, test)")
    _input, error, message, test = cells
    if not re.fullmatch(r"`\w+`", error):
        raise ValueError(f"{where}: the exception cell must be one `Name`, got {error!r}")
    if not (message.startswith("`` ") and message.endswith(" ``")):
        raise ValueError(f"{where}: the message cell must be quoted as `` text ``")
    found = _TEST_CELL.fullmatch(test)
    if found is None:
        raise ValueError(f"{where}: the test cell must be `tests/test_errors_*.py::test_name`")
    text = message[3:-3].replace("\\|", "|")
    return Row(section, error.strip("`"), text, found[1], found[2], number)


@functools.cache
def doc_rows() -> tuple[Row, ...]:
    """Every row of the doc's tables (header and separator lines excluded), in doc order."""
    rows = []
    section = ""
    for number, line in enumerate(DOC.read_text().splitlines(), start=1):
        if line.startswith("## "):
            section = line[3:].strip()
        if not line.startswith("|"):
            continue
        cells = _cells(line)
        if cells[0] == "input" or set("".join(cells)) <= set("-: "):
            continue
        rows.append(_parse_row(cells, section, number))
    return tuple(rows)


@functools.cache
def rows_by_test() -> dict[str, Row]:
    """The doc's rows by the name of their test; raises ``ValueError`` if two rows name one."""
    rows: dict[str, Row] = {}
    for row in doc_rows():
        if row.test in rows:
            raise ValueError(
                f"docs/errors.md:{row.line}: {row.test} is already named by line "
                f"{rows[row.test].line}"
            )
        rows[row.test] = row
    return rows


@functools.cache
def error_class(name: str) -> type[BaseException]:
    """The exception class the doc calls ``name``, looked up in :data:`EXCEPTION_MODULES`.

    Raises:
        LookupError: no module has an exception class of that name, or two have different ones.
    """
    found = {
        id(cls): cls
        for module in EXCEPTION_MODULES
        if isinstance(cls := getattr(importlib.import_module(module), name, None), type)
        and issubclass(cls, BaseException)
    }
    if len(found) != 1:
        what = "no exception class" if not found else "different classes"
        raise LookupError(f"{name!r}: {what} of that name in {', '.join(EXCEPTION_MODULES)}")
    return next(iter(found.values()))


def placeholders(text: str) -> set[str]:
    """The names of the ``<name>`` placeholders of a doc message (``<tmp>`` -> ``tmp``)."""
    return set(_PLACEHOLDER.findall(text))


def message_pattern(text: str, values: dict[str, object]) -> re.Pattern[str]:
    """The regular expression of a doc message: ``<name>`` -> ``str(values[name])``, ``…`` -> any
    text (also across lines), anchored at both ends.

    Raises:
        KeyError: the text has a placeholder that ``values`` does not give, or ``values`` gives one
            the text does not have (the row and its test disagree).
    """
    wanted = placeholders(text)
    if wanted != set(values):
        raise KeyError(f"the message's placeholders are {sorted(wanted)}, given {sorted(values)}")
    for name, value in values.items():
        text = text.replace(f"<{name}>", str(value))
    return re.compile(
        r"\A" + ".*?".join(re.escape(part) for part in text.split("…")) + r"\Z", re.DOTALL
    )


def current_test() -> tuple[str, str]:
    """``(file name, test function name)`` of the running test, from ``PYTEST_CURRENT_TEST``
    (``tests/test_errors_layers.py::test_bn_eps_zero (call)``; a parametrization is dropped)."""
    node_id = os.environ["PYTEST_CURRENT_TEST"].rsplit(" ", 1)[0]
    path, *_classes, name = node_id.split("::")
    return Path(path).name, name.split("[", 1)[0]


@contextlib.contextmanager
def expect_row(**values: object) -> Iterator[None]:
    """Assert that the block raises what the running test's row of the doc says.

    The exception must be exactly the row's type (not a subclass) and its whole message must
    match the row's (see :func:`message_pattern`; ``values`` fill its ``<name>`` placeholders).
    The test must be named by a row, in the file the row names.
    """
    file, test = current_test()
    row = rows_by_test().get(test)
    assert row is not None, f"{test} has no row in docs/errors.md"
    assert row.file == file, f"docs/errors.md:{row.line} names {row.file}, {test} is in {file}"
    error = error_class(row.error)
    pattern = message_pattern(row.message, values)
    with pytest.raises(error) as info:
        yield
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"
    assert pattern.search(str(info.value)), (
        f"docs/errors.md:{row.line} quotes\n  {row.message}\nthe code raised\n  {info.value}"
    )


def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset :data:`ENVIRONMENT_VARS` and keep W&B quiet, for the duration of one test."""
    for var in ENVIRONMENT_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
