"""JSON from untrusted files (safetensors headers, shard indexes), parsed without ambiguity.

Python's ``json`` is more forgiving than the safetensors library's parser (Rust's serde_json),
and a header two parsers read differently is how a file shows one thing to a checker and
another to a loader. So, unlike ``json.loads``:

* a key repeated in one object is an error (``json`` keeps the last value, other readers may
  keep the first: ``{"w": F32, "w": I32}`` would be two different tensors);
* ``NaN``/``Infinity`` are errors (not JSON; serde_json refuses them), and ``-0`` is read as
  the float serde_json makes of it, so it is refused wherever an integer is required;
* nesting too deep for Python's recursion limit is an error, not a ``RecursionError``;
* the text must be UTF-8;
* with ``serde_numbers=True`` (safetensors headers, which only serde_json reads), a number
  serde_json cannot hold is an error, as it is there ("number out of range"): a float literal
  beyond the double range (``1e400``: Python makes it ``inf``) and an integer too large for a
  u64/i64 whose double value overflows too (serde_json falls back to a double for the rest).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from typing import Any, NoReturn


class JSONError(ValueError):
    """The bytes are not JSON ckptfix accepts; the message says why (no location prefix)."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise JSONError(f"the key {key!r:.200} appears twice in one object")
            seen.add(key)
    return result


def _no_constant(name: str) -> NoReturn:
    raise JSONError(f"{name} is not valid JSON")


def _integer(text: str) -> int | float:
    # serde_json reads "-0" as the float -0.0; everything else with no fraction or exponent is an int
    return -0.0 if text == "-0" else int(text)


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise JSONError(f"the number {text[:40]}{'...' if len(text) > 40 else ''} is out of range (beyond a double)")
    return value


def _ranged_integer(text: str) -> int | float:
    value = _integer(text)
    if abs(value) >= _U64 and math.isinf(float(text)):  # float(text): no int-digits limit
        raise JSONError(f"the number {text[:40]}... is out of range (beyond a u64 and a double)")
    return value


_U64 = 1 << 64
#: the shortest run of digits whose value can exceed a double (~1.8e308 has 309 digits)
_LONG_DIGITS = re.compile(rb"[0-9]{309}")


def loads(raw: bytes, *, serde_numbers: bool = False) -> Any:
    """Parse ``raw`` strictly (see the module docstring); raises :class:`JSONError`."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JSONError(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    try:
        # a parse_int hook costs a Python call per integer: only when a "-0" could be there
        # (None is json's own default, int)
        parse_int: Any = _integer if "-0" in text else None
        parse_float: Any = None
        if serde_numbers:
            parse_float = _finite_float  # only floats pay a Python call: headers hold few
            if _LONG_DIGITS.search(raw):  # integers pay one only where one could overflow
                parse_int = _ranged_integer
        return json.loads(
            text,
            object_pairs_hook=_no_duplicates,
            parse_constant=_no_constant,
            parse_int=parse_int,
            parse_float=parse_float,
        )
    except RecursionError as exc:
        raise JSONError("nested too deeply") from exc
    except JSONError:
        raise
    except ValueError as exc:  # JSONDecodeError, or an integer literal of more than 4300 digits
        raise JSONError(f"invalid JSON: {exc}") from exc


def depth(value: Any) -> int:
    """How many arrays/objects deep ``value`` is (0 for a scalar); iterative, so any depth works."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children: Iterator[Any] | list[Any] = iter(item.values())
        elif isinstance(item, list):
            children = item
        else:
            deepest = max(deepest, level)
            continue
        deepest = max(deepest, level + 1)
        stack.extend((child, level + 1) for child in children)
    return deepest


def is_text(value: Any) -> bool:
    """A str that is valid Unicode text: JSON's ``\\ud800`` escapes give Python strings with lone
    surrogates, which serde_json refuses and no UTF-8 file can hold."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def strings_in(value: Any) -> Iterator[str]:
    """Every key and string inside ``value`` (iteratively)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            yield from item.keys()
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
