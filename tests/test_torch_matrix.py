"""benchmarks/torch_matrix.py's reading of pytest's output and its table (the venvs and runs it
makes need the registry and minutes per release: its results are in docs/torch-versions.md)."""

from __future__ import annotations

import pytest

from benchmarks import torch_matrix


@pytest.mark.parametrize(
    ("output", "counts"),
    [
        ("...\n1161 passed, 496 skipped, 620 deselected, 30 warnings in 163.42s (0:02:43)\n",
         {"passed": 1161, "skipped": 496, "deselected": 620}),
        ("FAILED x\n2 failed, 10 passed, 1 error in 3.1s\n",
         {"failed": 2, "passed": 10, "error": 1}),
        ("Traceback (most recent call last):\n  ...\nKilled\n", {}),
    ],
)  # fmt: skip
def test_the_summary_line_is_read(output: str, counts: dict[str, int]) -> None:
    assert torch_matrix.summary_counts(output) == counts


def test_a_run_without_a_summary_says_how_it_ended() -> None:
    assert torch_matrix.summary_text({}, 124) == "timed out"
    assert torch_matrix.summary_text({}, -11) == "no summary (exit -11)"
    text = torch_matrix.summary_text({"passed": 3, "skipped": 1, "deselected": 9}, 0)
    assert text == "3 passed, 1 skipped"


def test_the_table_has_a_row_per_release() -> None:
    rows = [
        torch_matrix.Row("2.4.1", 81.0, 70.2, {"smoke": ("5 passed", 40.0)}),
        torch_matrix.Row("2.14.1", 0.0, 65.0, {"smoke": ("5 passed", 38.0),
                                               "fast": ("1150 passed", 170.0)}),
    ]  # fmt: skip
    header, rule, *lines = torch_matrix.table(rows)
    assert header.startswith("| torch |") and rule.startswith("|---")
    assert lines[0] == "| 2.4.1 | 81 | 70 | 5 passed (40 s) | - |"
    assert lines[1] == "| 2.14.1 | reused | 65 | 5 passed (38 s) | 1150 passed (170 s) |"
