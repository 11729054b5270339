"""A layer's call-order tag: the number its synchronized calls carry beside their statistics, so
that ranks calling different layers at the same collective are told apart (``csrc`` and the
reference steps compare the tags; the errors name the layers through the flight recorder's
names)."""

from __future__ import annotations

import zlib

from ..._shared import TAG_LIMIT

__all__ = ["TAG_LIMIT", "name_tag"]


def name_tag(name: str, salt: int = 0) -> int:
    """The call-order tag of a layer called ``name``: a hash below ``TAG_LIMIT`` (floats carry it
    exactly), the same on every rank; ``salt`` > 0 gives the alternatives tried when two layers of
    one model would share a tag."""
    key = name if salt == 0 else f"{name}#{salt}"
    return zlib.crc32(key.encode()) % TAG_LIMIT
