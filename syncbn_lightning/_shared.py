"""The values both the Python package and the C++/CUDA extension need, defined once.

Python modules import them from here; the extension includes ``csrc/include/shared_constants.h``,
which ``tools/shared_header.py`` (outside the package: a development tool) generates from this
file, the comment above each value copied beside its C++ twin. Change a value here, never in the
header, and rerun the tool. The header records :func:`values_digest` of the values it was made
from and :func:`text_digest` of its own text: the extension's build refuses a header whose
values digest is not this file's or whose text was edited by hand (``ops/build.py``), and
``tools/shared_header.py --check`` exits 1 while it is stale.

Imports no torch: the flight files are read (``syncbn-flight``) in processes that never import it.
"""

from __future__ import annotations

import hashlib
import re
import struct

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
    "DIGEST_LINE",
    "HEADER_PATH",
    "TEXT_DIGEST_LINE",
    "INFO_FIELDS",
    "KEPT_PER_CHANNEL",
    "ORDER_FLAG_SLOTS",
    "REDUCE_HEADER",
    "ROW_HEADER",
    "SHIFT_MARK",
    "SHIFT_MISMATCH",
    "TAG_LIMIT",
    "field_offsets",
    "header_digest",
    "text_digest",
    "values_digest",
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
#: What a checkpointed forward keeps for its recompute, one vector of the acc dtype: mean,
#: mean_lo, invstd and var (this many vectors of one value per channel), then info and grad_info.
KEPT_PER_CHANNEL = 4
#: Values in front of the backward's sums (the call-order header): four 6-bit chunks of the layer
#: tag, then four of the call tag, every chunk followed by its square.
GRAD_HEADER = 16
#: The largest CPU group whose backward (and reduce) sums are all-gathered and summed in rank
#: order (bitwise reproducible); larger groups, and CUDA tensors, all-reduce them.
GATHER_SUM_MAX_RANKS = 8
#: Call-order flags a process keeps queued, unread, before a host sync reads them all (each
#: path's queue: distributed/call_order/checks.py's, and the C++ path's slots of pinned memory
#: and events).
ORDER_FLAG_SLOTS = 1024
#: The input dtypes the kernels take, each with its accumulation dtype (torch's names).
ACC_DTYPES = {
    "float16": "float32",
    "bfloat16": "float32",
    "float32": "float32",
    "float64": "float64",
}

# ---------------------------------------------------------------------------------------------
# The flight recorder's ring (distributed/flight/writer.py makes it and writes it from Python,
# csrc/layer/flight.cpp from C++, distributed/flight/file.py reads it): little-endian.

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

#: How the header's line that records :func:`values_digest` starts.
DIGEST_LINE = "// values digest: "
#: How the header's line that records :func:`text_digest` of the rest of it starts.
TEXT_DIGEST_LINE = "// text digest: "


def values_digest() -> str:
    """A digest of every value this module shares (its upper-case public names, by name): what
    the generated header was made from."""
    values = sorted((name, globals()[name]) for name in __all__ if name.isupper())
    return hashlib.sha256(repr(values).encode()).hexdigest()[:16]


def text_digest(text: str) -> str:
    """A digest of a generated header's text without its two digest lines: what its text digest
    line records while nobody edited it by hand."""
    kept = [
        line for line in text.splitlines() if not line.startswith((DIGEST_LINE, TEXT_DIGEST_LINE))
    ]
    return hashlib.sha256("\n".join(kept).encode()).hexdigest()[:16]


def header_digest(text: str, line: str = DIGEST_LINE) -> str | None:
    """The digest a generated header's text records on its ``line`` (:data:`DIGEST_LINE`: the
    values', :data:`TEXT_DIGEST_LINE`: the text's), ``None`` where it records none."""
    for row in text.splitlines():
        if row.startswith(line):
            return row[len(line) :].strip()
    return None
