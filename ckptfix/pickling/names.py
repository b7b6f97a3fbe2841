"""What a pickle global's name may look like, and what an ``--allow-global`` pattern may be.

A global is written into a pickle as text (``GLOBAL`` takes ``module\\nname\\n``; the writer
emits what the reader saw), so a name holding a newline, a space or other bytes could smuggle
opcodes into the output or match an allow-list glob nobody meant it to. Real globals are dotted
Python names (``numpy.core.multiarray.scalar``, ``Outer.Inner`` qualified names), so anything
else is refused: by the pickle reader and writer (:func:`is_dotted_identifier`) and, for the
user's patterns, when the command line is parsed (:func:`global_pattern_problem`).

ASCII only: every module torch, numpy or the standard library pickles is ASCII-named, and
non-ASCII identifiers would let look-alike letters pass for allowed names. No torch imports.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from ..errors import UsageError

#: one ``[...]`` set of a pattern part: identifier characters and ranges, optionally negated
#: with ``!`` (fnmatch's spelling); nothing that could stand for a dot, a space or a newline
_BRACKET = r"\[!?[A-Za-z0-9_-]+\]"
_PATTERN_TOKEN = re.compile(rf"[A-Za-z0-9_]+|[*?]|{_BRACKET}")


def is_dotted_identifier(name: str) -> bool:
    """Whether ``name`` is one or more ASCII Python identifiers joined by single dots.

    ``"os.path"``, ``"Outer.Inner"`` and ``"_codecs"`` are; ``""``, ``"a..b"``, ``".a"``,
    ``"a."``, ``"a b"``, ``"a\\nb"`` and ``"é"`` are not. Keywords pass, as ``str.isidentifier``
    says: they cannot smuggle anything, and ``setattr`` can give an object such an attribute.
    The reader and writer call this on a global's module and on its (possibly qualified) name.
    """
    if not isinstance(name, str) or not name or not name.isascii():
        return False
    return all(part.isidentifier() for part in name.split("."))


def _part_problem(part: str) -> str | None:
    if not part:
        return "an empty part (a leading, trailing or doubled dot)"
    tokens: list[str] = []
    position = 0
    while position < len(part):
        match = _PATTERN_TOKEN.match(part, position)
        if match is None and part[position] in "[]":
            return f"an unclosed or invalid [...] set in {part!r} (sets hold letters, digits, _ and - ranges)"
        if match is None:
            return f"the character {part[position]!r} (only letters, digits, _, *, ? and [...] sets are allowed)"
        tokens.append(match.group())
        position = match.end()
    # each wildcard stands for at least an identifier character; the literal parts must
    # still make an identifier (no part of a real name starts with a digit)
    shape = "".join("_" if token[0] in "*?[" else token for token in tokens)
    if not shape.isidentifier():
        return f"the part {part!r}, which no Python identifier matches"
    return None


def global_pattern_problem(pattern: str) -> str | None:
    """Why ``pattern`` is not an acceptable ``--allow-global`` value, or None if it is.

    A pattern is a dotted name whose parts may hold the glob characters ``*``, ``?`` and
    ``[...]`` sets (``numpy.*``, ``argparse.Namespace``, ``mymod.Conf[AB]``). Everything else
    -- whitespace, control characters, NUL, non-ASCII, empty parts -- is refused, so a
    pattern can never name (or be mistaken for) text that is not a Python global.
    """
    if not isinstance(pattern, str) or not pattern:
        return "it is empty"
    if not pattern.isascii():
        return "it holds non-ASCII characters"
    for part in pattern.split("."):
        problem = _part_problem(part)
        if problem is not None:
            return f"it holds {problem}"
    return None


def is_global_pattern(pattern: str) -> bool:
    """Whether ``pattern`` is a valid ``--allow-global`` value (see :func:`global_pattern_problem`)."""
    return global_pattern_problem(pattern) is None


def check_global_patterns(patterns: Iterable[str]) -> None:
    """Raise :class:`~ckptfix.errors.UsageError` (exit 2) naming the first bad ``--allow-global``
    pattern, before any file is read: a bad pattern is a typo or an attack, never a request."""
    for pattern in patterns:
        problem = global_pattern_problem(pattern)
        if problem is not None:
            raise UsageError(
                f"--allow-global {pattern!r}: not a dotted Python name: {problem}",
                hint="write a global as module.name, with * ? [...] globs inside parts, "
                "e.g. numpy.* or argparse.Namespace",
            )
