"""The values both the Python package and the C++/CUDA extension need, defined once.

Python modules import them from here; the extension includes ``csrc/include/shared_constants.h``,
which is generated from this file: ``python -m syncbn_lightning._shared`` rewrites it, and
``python -m syncbn_lightning._shared --check`` exits 1 while it is stale (as
``tests/test_shared_constants.py`` fails). Change a value here, never in the header. The comment
above each value is copied into the header beside its C++ twin.

Imports no torch: the flight files are read (``syncbn-flight``) in processes that never import it.
"""

from __future__ import annotations

import argparse
import ast
import re
import struct
import sys
from pathlib import Path

__all__ = [
    "ACC_DTYPES",
    "CALL_ORDER_MARK",
    "FLIGHT_DIRECTIONS",
    "FLIGHT_GROUP_BYTES",
    "FLIGHT_HEADER_FORMAT",
    "FLIGHT_HEADER_SIZE",
    "FLIGHT_OPS",
    "FLIGHT_RECORD_FIELDS",
    "FLIGHT_RECORD_FORMAT",
    "FLIGHT_RECORD_SIZE",
    "FLIGHT_WRITTEN_OFFSET",
    "GATHER_SUM_MAX_RANKS",
    "GRAD_HEADER",
    "HEADER_PATH",
    "INFO_FIELDS",
    "ORDER_FLAG_SLOTS",
    "REDUCE_HEADER",
    "ROW_HEADER",
    "SHIFT_MARK",
    "SHIFT_MISMATCH",
    "TAG_LIMIT",
    "field_offsets",
    "header_path",
    "render_header",
]

# ---------------------------------------------------------------------------------------------
# The call-order checks and the exchanges' layouts.

#: How every call-order error starts (the C++ kernels' and the reference's): the C++ path hands
#: an error with this mark to Python, which names each rank's layer.
CALL_ORDER_MARK = "syncbn call order:"
#: The error of a reduce exchange whose ranks shifted their sums by different running means.
SHIFT_MISMATCH = (
    f"{CALL_ORDER_MARK} the ranks of one sync group hold different running_mean buffers in a "
    f"layer with exchange='reduce', which shifts every rank's sums by its running mean and needs "
    f"the same one on every rank (as it is after every synchronized update). Load the same "
    f"checkpoint on every rank, keep the buffers in sync, or use exchange='gather'."
)
#: The part of SHIFT_MISMATCH that tells it from the other call-order errors (no layer to name).
SHIFT_MARK = "running_mean buffers"
#: Tags travel as floats of the acc dtype: exact below 2^24, so tags are taken modulo this.
TAG_LIMIT = 1 << 24
#: Values in front of the statistics in a gathered row: count, samples, layer tag, call tag.
ROW_HEADER = 4
#: Values in front of the sums in the reduce exchange's vector: count, samples, nonempty, then
#: the 12-bit chunks of the layer tag, the call tag and the running mean's fingerprint (two
#: chunks each), every chunk followed by its square.
REDUCE_HEADER = 3 + 2 * 6
#: Values of a merge's info (and grad_info): count, samples, order_ok, finite, layer tag, call tag.
INFO_FIELDS = 6
#: Values in front of the backward's sums (the call-order header): four 6-bit chunks of the layer
#: tag, then four of the call tag, every chunk followed by its square.
GRAD_HEADER = 16
#: The largest CPU group whose backward (and reduce) sums are all-gathered and summed in rank
#: order (bitwise reproducible); larger groups, and CUDA tensors, all-reduce them.
GATHER_SUM_MAX_RANKS = 8
#: Call-order flags a process keeps queued, unread, before a host sync reads them all (each
#: path's queue: distributed/call_order.py's, and the C++ path's slots of pinned memory and events).
ORDER_FLAG_SLOTS = 1024
#: The input dtypes the kernels take, each with its accumulation dtype (torch's names).
ACC_DTYPES = {
    "float16": "float32",
    "bfloat16": "float32",
    "float32": "float32",
    "float64": "float64",
}

# ---------------------------------------------------------------------------------------------
# The flight recorder's ring (distributed/flight_writer.py makes it and writes it from Python,
# csrc/layer/flight.cpp from C++, distributed/flight_file.py reads it): little-endian.

#: The ring's header: magic, rank, world size, pid, capacity, records written, job id.
FLIGHT_HEADER_FORMAT = "<8siiiiq24s"
#: Bytes of the ring's header (its format's 56, padded): the first record starts there.
FLIGHT_HEADER_SIZE = 64
#: Bytes of a record's group name (zero padded; a longer name is cut).
FLIGHT_GROUP_BYTES = 16
#: One record: the fields of FLIGHT_RECORD_FIELDS, two bytes of padding before the group name.
FLIGHT_RECORD_FORMAT = f"<qdqqiBB2x{FLIGHT_GROUP_BYTES}s"
#: The fields of a record, in the format's order.
FLIGHT_RECORD_FIELDS = ("seq", "time", "nbytes", "call", "layer_tag", "op", "direction", "group")
#: What a record's op and direction codes mean (the code is the index).
FLIGHT_OPS = ("all_gather", "all_reduce")
FLIGHT_DIRECTIONS = ("forward", "backward", "check")

_FORMAT_FIELD = re.compile(r"(\d*)([xcbB?hHiIlLqQnNefdspP])")


def field_offsets(fmt: str) -> list[int]:
    """The byte offset of each field of the ``struct`` format ``fmt`` (padding ``x`` is no
    field; ``"<qd2xi"`` -> ``[0, 8, 18]``)."""
    order, body = (fmt[0], fmt[1:]) if fmt[:1] in "<>=!@" else ("@", fmt)
    offsets, prefix = [], ""
    for count, code in _FORMAT_FIELD.findall(body):
        if code != "x":
            offsets.append(struct.calcsize(order + prefix))
        prefix += count + code
    return offsets


#: Bytes of one record.
FLIGHT_RECORD_SIZE = struct.calcsize(FLIGHT_RECORD_FORMAT)
#: Byte offset of the header's `written` count (int64), updated after each record is complete.
FLIGHT_WRITTEN_OFFSET = field_offsets(FLIGHT_HEADER_FORMAT)[5]

# ---------------------------------------------------------------------------------------------
# The generated header.

#: Where the generated header sits, under ``csrc/``.
HEADER_PATH = "include/shared_constants.h"

# Python name -> (C++ namespace, C++ name) of each scalar value.
_CPP_NAMES = {
    "CALL_ORDER_MARK": ("syncbn", "kCallOrderMark"),
    "SHIFT_MISMATCH": ("syncbn", "kShiftMismatch"),
    "SHIFT_MARK": ("syncbn", "kShiftMark"),
    "TAG_LIMIT": ("syncbn", "kTagLimit"),
    "ROW_HEADER": ("syncbn", "kRowHeader"),
    "REDUCE_HEADER": ("syncbn", "kReduceHeader"),
    "INFO_FIELDS": ("syncbn", "kInfoFields"),
    "GRAD_HEADER": ("syncbn", "kGradHeader"),
    "GATHER_SUM_MAX_RANKS": ("syncbn", "kGatherSumMaxRanks"),
    "ORDER_FLAG_SLOTS": ("syncbn", "kOrderFlagSlots"),
    "FLIGHT_HEADER_SIZE": ("syncbn::flight", "kHeaderSize"),
    "FLIGHT_WRITTEN_OFFSET": ("syncbn::flight", "kWrittenOffset"),
    "FLIGHT_RECORD_SIZE": ("syncbn::flight", "kRecordSize"),
    "FLIGHT_GROUP_BYTES": ("syncbn::flight", "kGroupBytes"),
}
# torch's dtype names -> c10::ScalarType's.
_SCALAR_TYPES = {"float16": "Half", "bfloat16": "BFloat16", "float32": "Float", "float64": "Double"}
_WIDTH = 100


def _comments() -> dict[str, list[str]]:
    """The ``#:`` comment lines above each top-level assignment of this file, by name."""
    lines = Path(__file__).read_text().splitlines()
    found: dict[str, list[str]] = {}
    for node in ast.parse("\n".join(lines)).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            above, row = [], node.lineno - 2
            while row >= 0 and lines[row].startswith("#:"):
                above.insert(0, lines[row][2:].strip())
                row -= 1
            found[node.targets[0].id] = above
    return found


def _cpp_literal(text: str, indent: int) -> str:
    """``text`` as adjacent C++ string literals, broken at spaces to fit :data:`_WIDTH`; a text
    starting with :data:`CALL_ORDER_MARK` starts with its macro instead."""
    head = ""
    if text.startswith(CALL_ORDER_MARK) and text != CALL_ORDER_MARK:
        head, text = "SYNCBN_CALL_ORDER_MARK ", text[len(CALL_ORDER_MARK) :]
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    room = _WIDTH - indent - 3  # quotes and the ';'
    pieces, current = [], ""
    for word in re.split(r"(?<= )", escaped):
        if current and len(current) + len(word) > room - (len(head) if not pieces else 0):
            pieces.append(current)
            current = ""
        current += word
    pieces.append(current)
    quoted = [f'"{piece}"' for piece in pieces]
    quoted[0] = head + quoted[0]
    return f"\n{' ' * indent}".join(quoted)


def _cpp_value(name: str, value: object) -> str:
    cpp = _CPP_NAMES[name][1]
    if isinstance(value, str):
        if name == "CALL_ORDER_MARK":
            return f"inline constexpr char {cpp}[] = SYNCBN_CALL_ORDER_MARK;"
        one_line = f"inline constexpr char {cpp}[] = {_cpp_literal(value, 0)};"
        if "\n" not in one_line and len(one_line) <= _WIDTH:
            return one_line
        return f"inline constexpr char {cpp}[] =\n    {_cpp_literal(value, 4)};"
    assert isinstance(value, int), name
    return f"constexpr int64_t {cpp} = {value};"


def _camel(name: str) -> str:
    return "k" + "".join(part.title() for part in name.split("_"))


def render_header() -> str:
    """The text of ``csrc/include/shared_constants.h`` for the values of this module."""
    comments = _comments()
    values = globals()

    def block(name: str) -> list[str]:
        return [
            *(f"// {c}".rstrip() for c in comments.get(name, [])),
            _cpp_value(name, values[name]),
        ]

    out = [
        "// GENERATED by `python -m syncbn_lightning._shared` from syncbn_lightning/_shared.py:",
        "// do not edit by hand. Change the value there and rerun it (`--check` exits 1, and",
        "// tests/test_shared_constants.py fails, while this file is stale).",
        "#pragma once",
        "",
        "#include <cstdint>",
        "",
        "// CALL_ORDER_MARK (kCallOrderMark below) as a string-literal macro, so that a message",
        '// starts with it at compile time: SYNCBN_CALL_ORDER_MARK " the rest".',
        f"#define SYNCBN_CALL_ORDER_MARK {_cpp_literal(CALL_ORDER_MARK, 4)}",
        "",
        *(f"// {c}" for c in comments["ACC_DTYPES"]),
        "// X(input, acc) once per input dtype, as c10::ScalarType names.",
        "#define SYNCBN_FOR_EACH_ACC_DTYPE(X) \\",
        *(
            f"  X({_SCALAR_TYPES[dtype]}, {_SCALAR_TYPES[acc]})"
            + (" \\" if i < len(ACC_DTYPES) - 1 else "")
            for i, (dtype, acc) in enumerate(ACC_DTYPES.items())
        ),
        "// The same, as text for messages.",
        "#define SYNCBN_INPUT_DTYPES_TEXT "
        + _cpp_literal(", ".join(list(ACC_DTYPES)[:-1]) + " or " + list(ACC_DTYPES)[-1], 4),
        "",
        "namespace syncbn {",
        "",
    ]
    for name, (namespace, _) in _CPP_NAMES.items():
        if namespace == "syncbn":
            out += [*block(name), ""]
    out += ["namespace flight {", ""]
    for name, (namespace, _) in _CPP_NAMES.items():
        if namespace == "syncbn::flight":
            out += [*block(name), ""]
    offsets = field_offsets(FLIGHT_RECORD_FORMAT)
    out += [
        "// Byte offset of each field of a record (FLIGHT_RECORD_FORMAT, FLIGHT_RECORD_FIELDS).",
        *(
            f"constexpr int64_t {_camel(field)}At = {offset};"
            for field, offset in zip(FLIGHT_RECORD_FIELDS, offsets, strict=True)
        ),
        "",
        *(f"// {c}" for c in comments["FLIGHT_OPS"]),
        "enum Op : uint8_t { "
        + ", ".join(f"{_camel(op)} = {code}" for code, op in enumerate(FLIGHT_OPS))
        + " };",
        "enum Direction : uint8_t { "
        + ", ".join(f"{_camel(d)} = {code}" for code, d in enumerate(FLIGHT_DIRECTIONS))
        + " };",
        "",
        "}  // namespace flight",
        "}  // namespace syncbn",
    ]
    return "\n".join(out) + "\n"


def header_path() -> Path:
    """The generated header of the C++ sources next to this package (a checkout's ``csrc/`` or
    the installed ``_csrc/``)."""
    package = Path(__file__).resolve().parent
    for csrc in (package.parent / "csrc", package / "_csrc"):
        if (csrc / "include").is_dir():
            return csrc / HEADER_PATH
    raise FileNotFoundError(f"no csrc/include beside or inside {package}")


def main(argv: list[str] | None = None) -> int:
    """``python -m syncbn_lightning._shared [--check] [--header PATH]``."""
    parser = argparse.ArgumentParser(prog="python -m syncbn_lightning._shared", description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if the header is stale")
    parser.add_argument("--header", type=Path, default=None, help="the header to write or check")
    args = parser.parse_args(argv)
    path = args.header or header_path()
    text = render_header()
    current = path.read_text() if path.is_file() else None
    if args.check:
        if current != text:
            print(f"{path} is stale: run `python -m syncbn_lightning._shared`", file=sys.stderr)
            return 1
        return 0
    if current != text:
        path.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
