"""``docs/errors.md`` and the tests of its rows (``tests/test_errors_*.py``) stay in step.

The row tests take their exception type and message from the doc (:mod:`_errors_doc`), so what is
left to check is the pairing: every row names a test that exists in the file the row names, every
test of those files has a row, each test asserts its row exactly once through ``expect_row`` and
supplies exactly the ``<name>`` values its row's message has, and each row's exception name is a
known exception class.
"""

from __future__ import annotations

import ast

from _errors_doc import DOC, ROOT, doc_rows, error_class, placeholders, rows_by_test

#: Tests that check the doc itself rather than one of its rows (named in the doc's introduction).
SYNC_TESTS = {"test_doc_table_matches_these_tests"}


def _expect_row_calls(function: ast.FunctionDef) -> list[ast.Call]:
    """The ``expect_row(...)`` calls that are ``with`` items in ``function``."""
    return [
        item.context_expr
        for node in ast.walk(function)
        if isinstance(node, ast.With)
        for item in node.items
        if isinstance(item.context_expr, ast.Call)
        and isinstance(item.context_expr.func, ast.Name)
        and item.context_expr.func.id == "expect_row"
    ]


def _row_tests() -> dict[str, tuple[str, set[str]]]:
    """``{test name: (file name, keywords of its one expect_row call)}`` of the top-level tests
    of ``tests/test_errors_*.py`` (the tests in :data:`SYNC_TESTS` left out)."""
    found: dict[str, tuple[str, set[str]]] = {}
    for path in sorted((ROOT / "tests").glob("test_errors_*.py")):
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test_"):
                continue
            if node.name in SYNC_TESTS:
                continue
            assert node.name not in found, (
                f"{node.name} is in {found[node.name][0]} and {path.name}"
            )
            calls = _expect_row_calls(node)
            assert len(calls) == 1, f"{path.name}::{node.name} must use expect_row(...) once"
            assert not calls[0].args, f"{node.name}: expect_row takes the row's values by name"
            found[node.name] = (path.name, {keyword.arg for keyword in calls[0].keywords})
    return found


def test_doc_table_matches_these_tests() -> None:
    rows = rows_by_test()  # parses every row, and no two rows name one test
    tests = _row_tests()
    assert set(rows) - set(tests) == set(), "rows naming no test of tests/test_errors_*.py"
    assert set(tests) - set(rows) == set(), "tests without a row in docs/errors.md"
    for row in doc_rows():
        file, values = tests[row.test]
        where = f"docs/errors.md:{row.line} ({row.test})"
        assert row.file == file, f"{where}: the row names {row.file}, the test is in {file}"
        assert placeholders(row.message) == values, f"{where}: the test supplies {values}"
        error_class(row.error)  # a known exception class
    text = DOC.read_text()
    assert all(f"`{name}`" in text for name in SYNC_TESTS)
