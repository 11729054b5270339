"""What the built extension links: its ELF ``NEEDED`` entries, recorded beside it at build time.

The GPU machine's image links every extension's libstdc++ statically (no ``libstdc++`` among
the ``.so``'s ``NEEDED``), and there an ostream that formats a number inside the extension
crashes the process (``benchmarks/RESULTS.md``, "Known defect of the GPU image"). The
extension's own checks build their messages without streams (``csrc/include/check.h``), but
torch's headers may still format through one; so where the record says libstdc++ is static,
Python's input checks run in front of the C++ path, and a user's mistake is a Python exception
there too. The record is ``<library>.link.json``: ``{"needed": [...], "static_libstdcxx": bool}``,
``static_libstdcxx`` true also where the ``NEEDED`` entries cannot be read (the safe side).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

__all__ = ["link_record", "needed_libraries", "write_link_record"]

_SHT_DYNAMIC = 6
_DT_NULL, _DT_NEEDED = 0, 1


def needed_libraries(library: Path) -> list[str] | None:
    """The ``NEEDED`` entries of the ELF shared object ``library`` (64-bit, little-endian, as
    torch's Linux builds are), or ``None`` where it is not such a file or has no dynamic
    section."""
    data = library.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return None
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQII", data, shoff + i * shentsize) for i in range(shnum)]
    for _name, kind, _flags, _addr, offset, size, link, _info in sections:
        if kind != _SHT_DYNAMIC:
            continue
        strings = sections[link][4]
        needed = []
        for entry in range(offset, offset + size, 16):
            tag, value = struct.unpack_from("<qQ", data, entry)
            if tag == _DT_NULL:
                break
            if tag == _DT_NEEDED:
                end = data.index(b"\0", strings + value)
                needed.append(data[strings + value : end].decode())
        return needed
    return None


def write_link_record(library: Path) -> dict[str, Any]:
    """Read ``library``'s ``NEEDED`` entries and write its record beside it (see the module
    docstring); returns the record."""
    needed = needed_libraries(library)
    record = {
        "needed": needed,
        "static_libstdcxx": needed is None or not any(n.startswith("libstdc++") for n in needed),
    }
    path = _record_path(library)
    partial = path.with_name(f"{path.name}.{os.getpid()}")  # the ranks of a node may race here
    partial.write_text(json.dumps(record, indent=1) + "\n")
    partial.replace(path)
    return record


def link_record(library: Path) -> dict[str, Any]:
    """``library``'s record, written now where the build left none (a build of an older
    version of the package)."""
    path = _record_path(library)
    if path.is_file():
        return json.loads(path.read_text())
    return write_link_record(library)


def _record_path(library: Path) -> Path:
    return library.with_name(library.name + ".link.json")
