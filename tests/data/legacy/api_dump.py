"""Prints the public API of ``syncbn_lightning`` as JSON: each name of ``__all__`` with its
signature and, for classes, the signatures of the public methods and the public attributes their
syncbn_lightning classes define. ``api.json`` beside it is this script's output at the last
commit of the flat layout (``PYTHONPATH=<that checkout> python api_dump.py > api.json``);
tests/test_legacy.py checks that today's API still has all of it, unchanged."""

from __future__ import annotations

import inspect
import json
from typing import Any

import syncbn_lightning


def _class_members(cls: type) -> dict[str, Any]:
    members: dict[str, Any] = {}
    for klass in cls.__mro__:
        if klass.__module__.startswith("syncbn_lightning"):
            for name in vars(klass):
                if not name.startswith("_") and name not in members:
                    members[name] = getattr(cls, name)
    return members


def public_api() -> dict[str, Any]:
    """``{name: {"kind", "signature", ["methods", "attributes"]}}`` of every public name."""
    api: dict[str, Any] = {}
    for name in syncbn_lightning.__all__:
        obj = getattr(syncbn_lightning, name)
        try:
            signature: str | None = str(inspect.signature(obj))
        except ValueError:  # an exception class: the builtin constructor has none
            signature = None
        entry: dict[str, Any] = {
            "kind": "class" if inspect.isclass(obj) else "function",
            "signature": signature,
        }
        if inspect.isclass(obj):
            members = _class_members(obj)
            routines = {m: v for m, v in members.items() if inspect.isroutine(v)}
            entry["methods"] = {m: str(inspect.signature(v)) for m, v in sorted(routines.items())}
            entry["attributes"] = sorted(set(members) - set(routines))
        api[name] = entry
    return api


if __name__ == "__main__":
    print(json.dumps(public_api(), indent=1, sort_keys=True))
