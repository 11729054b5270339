"""Record a pass of ``benchmarks/gpu_check.sh native`` in ``syncbn_lightning/ops/native_passes.py``.

    python tools/record_native_pass.py <OUT>/native_pass.json

The pass names the digests of the sources it ran on (the extension's and the library's Python
files). It is recorded only when both are this checkout's: a pass of another tree would switch
CUDA layers to the C++ path on code the GPU never ran. Once recorded, CUDA layers of this tree
take the C++ path by default (``SYNCBN_NATIVE_CUDA`` unset); any later change of those files
puts them back on the Python path until the check passes again. A development tool, outside the
package.
"""

from __future__ import annotations

import argparse
import json
import pprint
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout's package, whether or not it is installed

from syncbn_lightning.ops import build, native_passes  # noqa: E402
from syncbn_lightning.ops.dispatch import python_path_digest  # noqa: E402

RECORD = Path(native_passes.__file__)
_MARK = "PASSES: tuple[dict[str, str], ...] = "


def check_pass(entry: dict[str, Any]) -> None:
    """Refuse ``entry`` unless its digests are this checkout's.

    Raises:
        ValueError: naming the digest that differs and what to do.
    """
    here = {"extension": build.sources_digest(build.csrc_dir()), "python": python_path_digest()}
    for key, digest in here.items():
        if entry.get(key) != digest:
            raise ValueError(
                f"the pass ran on other {key} sources ({entry.get(key)!r}, this checkout has "
                f"{digest!r}): run benchmarks/gpu_check.sh native on this tree and record that pass"
            )


def record_pass(entry: dict[str, Any], record: Path = RECORD) -> None:
    """Append ``entry`` (checked by :func:`check_pass`) to the ``PASSES`` of ``record``."""
    check_pass(entry)
    text = record.read_text()
    head, _, _ = text.partition(_MARK)
    passes = [*native_passes.PASSES, {k: str(v) for k, v in entry.items()}]
    body = pprint.pformat(tuple(passes), width=96, sort_dicts=False)
    record.write_text(f"{head}{_MARK}{body}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("native_pass", type=Path, help="the check's OUT/native_pass.json")
    args = parser.parse_args()
    try:
        record_pass(json.loads(args.native_pass.read_text()))
    except ValueError as exc:
        raise SystemExit(f"record_native_pass: {exc}") from None
    print(f"recorded in {RECORD}: CUDA layers of this tree now take the C++ path by default")


if __name__ == "__main__":
    main()
