"""Byte sizes for people: ``parse_size("5GB")`` for options such as ``--max-shard-size``,
``format_size`` for messages."""

from __future__ import annotations

import re

from ..errors import UsageError


def format_size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``2GB`` = 2e9 bytes, ``2GiB`` = 2 * 2**30 (the hub's convention); a bare number is bytes."""
    match = _SIZE.match(text)
    if not match:
        raise UsageError(f"invalid size {text!r}: write e.g. 500MB, 2GB or 5GiB")
    number, unit, suffix = float(match.group(1)), match.group(2).upper(), (match.group(3) or "").upper()
    base = 1024 if suffix == "IB" else 1000
    return int(number * base ** " KMGT".index(unit or " "))
