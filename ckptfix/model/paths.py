"""Dotted paths into a tree: ``Path`` (a tuple of keys), ``format_path``, and :func:`select`, the
one resolution of ``--select``, ``--key``, ``--select-b`` and the API's ``select=``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeAlias

from ..errors import InputMismatchError
from .refs import Tree

#: a place in a tree: the keys and indices from the root down ("" -- the root -- is ``()``)
Path: TypeAlias = tuple[Any, ...]


def format_path(path: Path) -> str:
    """Dotted form of a container path, as ``--key`` accepts it ("" is the root)."""
    # a record used as a key (a dtype) is shown as <torch.float32>, never as the string it spells
    return ".".join(str(p) if type(p) in (str, int) else f"<{p}>" for p in path)


_MISSING = object()


def _lookup_key(container: Any, text: str) -> Any:
    if isinstance(container, Mapping):
        if text in container:
            return text
        if text.lstrip("-").isdigit() and len(text) < 20 and int(text) in container:
            return int(text)
    elif isinstance(container, (list, tuple)) and text.isdigit() and len(text) < 20 and int(text) < len(container):
        return int(text)
    return _MISSING


def resolve_path(root: Tree, dotted: str) -> Path | None:
    """Turn a dotted path (``state_dict``, ``optimizer_states.0``) into a container path.

    Keys may themselves contain dots, so the longest matching key wins at each level.
    Returns None when nothing matches.
    """
    parts = dotted.split(".") if dotted else []
    path: list[Any] = []
    value, i = root, 0
    while i < len(parts):
        for j in range(len(parts), i, -1):
            key = _lookup_key(value, ".".join(parts[i:j]))
            if key is not _MISSING:
                path.append(key)
                value = value[key]
                i = j
                break
        else:
            return None
    return tuple(path)


def get_at(root: Tree, path: Path) -> Tree:
    """The value at ``path`` (a tuple of keys/indices)."""
    value = root
    for key in path:
        value = value[key]
    return value


def select(root: Any, dotted: str, *, flag: str = "--select") -> tuple[Path, Any]:
    """The path and value that ``dotted`` names in ``root``, for the option ``flag``; a name
    that matches nothing is a :class:`UsageError` that shows what the top level holds."""
    path = resolve_path(root, dotted)
    if path is None:
        if isinstance(root, Mapping):
            keys = [str(k) for k in list(root)[:12]]
            top = ", ".join(keys) + (", ..." if len(root) > 12 else "") if keys else "nothing (it is empty)"
        else:
            top = f"a {type(root).__name__}, not a mapping"
        raise InputMismatchError(f"{flag} {dotted}: no such entry; the top level holds: {top}")
    return path, get_at(root, path)
