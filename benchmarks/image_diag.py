"""What the machine's toolchain makes of a C++ extension's libstdc++: a diagnostic, never a verdict.

    python benchmarks/image_diag.py [--json FILE] [--budget 20]

The GPU machine's image crashed any extension (ours, and a plain ``load_inline``) whose code
formats an integer through an ostream (``benchmarks/RESULTS.md``, "Known defect of the GPU
image"): there the extension carried its own, static libstdc++ beside the one torch loads.
This prints, within ``--budget`` seconds:

* the compiler torch's ``cpp_extension`` links with (``c++ -v``), where it finds the shared
  libstdc++ (``-print-file-name=libstdc++.so``), and the link variables of the environment;
* the built extension's ``NEEDED`` entries and its link record (:mod:`syncbn_lightning.ops
  .link_record`);
* a probe library that formats ``12345L`` through an ``std::ostringstream``, linked three ways
  (the compiler's default, ``-static-libstdc++``, and the shared libstdc++ named explicitly), each
  loaded after ``import torch`` in a subprocess: what it printed and its exit code (-11: the
  crash). Where the default link crashes and the explicit one does not, the fix belongs in our
  build's link flags; where both crash, it is the image's toolchain.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PROBE = r"""
#include <cstring>
#include <sstream>
#include <string>
extern "C" int format_long(char* out, int size) {
  std::ostringstream text;
  text << "value " << 12345L;
  const std::string s = text.str();
  std::strncpy(out, s.c_str(), size - 1);
  return static_cast<int>(s.size());
}
"""

LOAD = """
import ctypes, sys, torch
library = ctypes.CDLL(sys.argv[1])
buffer = ctypes.create_string_buffer(64)
library.format_long(buffer, 64)
print(buffer.value.decode())
"""

#: The probe's link variants: name and extra flags.
VARIANTS = (
    ("default", []),
    ("static-libstdc++", ["-static-libstdc++"]),
    ("explicit shared", ["-Wl,--no-as-needed", "-l:libstdc++.so.6"]),
)


def _run(command: list[str], timeout: float) -> dict[str, Any]:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=max(timeout, 1))
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"command": command, "error": f"{type(exc).__name__}: {exc}"}
    return {"command": command, "rc": done.returncode, "out": (done.stdout + done.stderr)[-1500:]}


def _compiler() -> str:
    return os.environ.get("CXX") or shutil.which("c++") or "c++"


def toolchain(deadline: float) -> dict[str, Any]:
    cxx = _compiler()
    facts: dict[str, Any] = {"cxx": cxx}
    facts["version"] = _run([cxx, "-v"], deadline - time.monotonic())
    facts["libstdc++.so"] = _run(
        [cxx, "-print-file-name=libstdc++.so"], deadline - time.monotonic()
    )
    facts["environment"] = {
        k: os.environ[k] for k in ("CXX", "CC", "LDFLAGS", "CXXFLAGS", "CFLAGS") if k in os.environ
    }
    return facts


def extension() -> dict[str, Any]:
    """The built extension's link record, where it is built (nothing is built here)."""
    from syncbn_lightning.ops import build
    from syncbn_lightning.ops.link_record import link_record

    libraries = sorted(build.build_dir().glob("*.so"))
    if not libraries:
        return {"built": False, "directory": str(build.build_dir())}
    return {"built": True, "library": str(libraries[0]), **link_record(libraries[0])}


def probes(deadline: float) -> list[dict[str, Any]]:
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "probe.cpp"
        source.write_text(PROBE)
        for name, flags in VARIANTS:
            library = Path(tmp) / f"probe_{len(results)}.so"
            built = _run(
                [_compiler(), "-O2", "-shared", "-fPIC", str(source), "-o", str(library), *flags],
                deadline - time.monotonic(),
            )
            entry: dict[str, Any] = {"variant": name, "flags": flags, "build": built}
            if built.get("rc") == 0:
                from syncbn_lightning.ops.link_record import needed_libraries

                entry["needed"] = needed_libraries(library)
                entry["load"] = _run(
                    [sys.executable, "-c", LOAD, str(library)], deadline - time.monotonic()
                )
            results.append(entry)
            if time.monotonic() > deadline:
                break
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the findings to this JSON file")
    parser.add_argument("--budget", type=float, default=20.0, help="seconds in all")
    args = parser.parse_args()
    deadline = time.monotonic() + args.budget
    report = {"toolchain": toolchain(deadline), "extension": extension()}
    report["probes"] = probes(deadline)
    chain = report["toolchain"]
    print(f"compiler: {chain['cxx']}; environment: {chain['environment'] or 'no link variables'}")
    print(chain["version"].get("out", chain["version"].get("error", "")).strip()[-600:])
    print(f"libstdc++.so found at: {chain['libstdc++.so'].get('out', '').strip()}")
    print(f"extension: {json.dumps(report['extension'])}")
    for probe in report["probes"]:
        load = probe.get("load", {})
        rc, printed = load.get("rc", probe["build"].get("rc")), load.get("out", "").strip()
        print(f"probe [{probe['variant']}]: needed {probe.get('needed')}, exit {rc}, {printed!r}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
