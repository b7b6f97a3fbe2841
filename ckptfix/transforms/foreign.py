"""What an output may carry of the classes a checkpoint pickles besides torch's.

ckptfix never imports or calls anything from a checkpoint, so reading an unknown class as an
inert record is safe (:func:`~ckptfix.pickling.reader.restricted_load` with ``inert_unknown``).
What must not happen is *writing* an output that carries a global the user did not allow. So a
writing command reads the whole file that way, transforms it, and then :func:`check_output`
looks at exactly what it is about to write:

* unknown globals only in parts the output leaves out (``hyper_parameters`` beside the
  ``state_dict`` that ``--select`` took, or everything but the tensors in a safetensors output)
  are *ignored*: listed in the report, no flag needed;
* unknown globals in the output refuse the write, naming every one of them at once, grouped by
  module, with the ways out ready to paste: ``--allow-global`` (kept as they are), ``--sanitize``
  (plain data; offered only where it would convert all of them), ``--select PATH`` (the
  weights, where a state dict free of them exists), ``--unsafe-load``.

Dangerous globals (``os.system``, ``eval``...) never get this far: the reader refuses the file.
The writers refuse any not-allowed global too, so this check is the message, not the guard.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..errors import CkptfixError, UnsafeInputError
from ..formats.checkpoint import Checkpoint
from ..model.paths import Path, format_path
from ..model.statedicts import find_state_dicts
from ..pickling.globals import allow_options, companion, kept_along
from ..pickling.reader import PYTHON_GLOBALS, TORCH_GLOBALS, ForeignGlobals, display_name, foreign_globals


@dataclass
class OutputGlobals:
    """What :func:`check_output` found: globals kept in the output (allowed), and those left
    out with the parts that held them (``{"path": top-level entry, "global": name}``)."""

    kept: list[str] = field(default_factory=list)
    ignored: list[dict[str, str]] = field(default_factory=list)

    def notes(self) -> list[str]:
        notes = []
        if self.kept:
            notes.append(f"kept as they are (allowed): {', '.join(self.kept)}")
        if self.ignored:
            by_path: dict[str, list[str]] = {}
            # the classes themselves first, the plain types they are rebuilt through after
            for entry in sorted(self.ignored, key=lambda e: companion(e["global"])):
                by_path.setdefault(entry["path"], []).append(entry["global"])
            held = "; ".join(
                f"{path} holds {', '.join(names[:4])}" + (f" and {len(names) - 4} more" if len(names) > 4 else "")
                for path, names in by_path.items()
            )
            notes.append(f"ignored, not in the output (classes outside the allow-list, read as inert data): {held}")
        return notes


def has_foreign(ckpt: Checkpoint) -> bool:
    """Whether the read met any global besides torch's and the plain Python builders in a tree
    of records (the checks here cost a walk over the tree; most checkpoints need none)."""
    return ckpt.lazy and any(name not in TORCH_GLOBALS and name not in PYTHON_GLOBALS for name in ckpt.globals)


def unallowed_globals(ckpt: Checkpoint) -> dict[str, list[Path]]:
    """The classes ``ckpt`` holds that nothing allows (read as inert records), with where."""
    return foreign_globals(ckpt.root).unallowed if has_foreign(ckpt) else {}


def check_output(
    whole: Any,
    output: Any | None,
    *,
    converted: Iterable[str] = (),
    sanitize_requested: bool = False,
    select_given: bool = False,
) -> OutputGlobals:
    """Check the tree about to be written (``output``; None when the output carries no pickled
    objects, as safetensors) against the whole checkpoint as read (``whole``).

    ``converted``: the paths (as formatted) of the objects ``--sanitize`` turned into plain data:
    what was under them is neither kept nor ignored. Raises :class:`UnsafeInputError` naming
    every not-allowed global in ``output``.
    """
    in_output = foreign_globals(output) if output is not None else ForeignGlobals()
    if in_output.unallowed:
        raise _refusal(whole, output, in_output, sanitize_requested, select_given)
    if output is whole:  # the whole tree is written, and holds none: nothing was left out
        return OutputGlobals(kept=sorted(in_output.allowed))
    everywhere = foreign_globals(whole, paths_per_name=_PATHS_PER_NAME)
    prefixes = tuple(converted)
    result = OutputGlobals(kept=sorted(in_output.allowed))
    for name, paths in everywhere.unallowed.items():
        left_out = [p for p in paths if not _under(format_path(p), prefixes)]
        if left_out:
            result.ignored.append({"path": _top(left_out[0]), "global": name})
    return result


#: occurrences looked at per global to tell "left out" from "converted" (a name seen this often
#: inside converted objects only is taken as converted)
_PATHS_PER_NAME = 64


def _under(path: str, prefixes: tuple[str, ...]) -> bool:
    if "(top level)" in prefixes:  # the root itself was converted
        return True
    return any(path == p or path.startswith((f"{p}.", f"{p}[")) for p in prefixes)


def _top(path: Path) -> str:
    return format_path(path[:1]) or "(top level)"


@dataclass
class WaysOut:
    """What works on a part holding classes outside the allow-list: ``sanitizable`` when
    ``--sanitize`` turns every one into plain data; else ``drop``, the ``--drop`` patterns of the
    entries it leaves (top-most first), and ``converts_some`` when it turns the others."""

    sanitizable: bool
    drop: list[str] = field(default_factory=list)
    converts_some: bool = False


#: entries listed for --drop at most (a suggestion, not an inventory)
_MAX_DROPS = 8


def ways_out(part: Any, sanitized: bool = False) -> WaysOut:
    """Try ``--sanitize`` on ``part`` (unless it is ``sanitized`` already) and say what works:
    every fix a command suggests must be one that runs."""
    from .sanitize import sanitize
    from .select import literal_glob

    before = foreign_globals(part).unallowed
    try:
        left = before if sanitized else foreign_globals(sanitize(part)[0], paths_per_name=_MAX_DROPS).unallowed
    except CkptfixError:  # a trial only: what it cannot convert means "no"
        left = foreign_globals(part, paths_per_name=_MAX_DROPS).unallowed
    if not left:
        return WaysOut(sanitizable=True)
    if sanitized:
        left = foreign_globals(part, paths_per_name=_MAX_DROPS).unallowed
    entries: list[Path] = []
    for paths in left.values():
        for path in paths:
            cut = next((i for i, k in enumerate(path) if type(k) not in (str, int) or str(k).startswith("__")), None)
            entries.append(tuple(path[:cut]))
    tops = sorted({p for p in entries if p and not any(q != p and p[: len(q)] == q for q in entries if q)})
    drop = [literal_glob(format_path(p)) for p in tops[:_MAX_DROPS]]
    return WaysOut(sanitizable=False, drop=drop, converts_some=not sanitized and set(left) != set(before))


def _refusal(
    whole: Any, output: Any, found: ForeignGlobals, sanitize_requested: bool, select_given: bool
) -> UnsafeInputError:
    names = list(found.unallowed)
    shown = [display_name(*name.rsplit(".", 1)) for name in names]
    ways = ways_out(output, sanitized=sanitize_requested)
    select = None
    if not select_given:
        for path, state_dict in find_state_dicts(whole):
            if path and not foreign_globals(state_dict).unallowed:
                select = format_path(path)
                break
    return UnsafeInputError(
        names,
        shown=shown,
        sanitizable=ways.sanitizable and not sanitize_requested,
        drop=ways.drop,
        drop_with_sanitize=ways.converts_some or sanitize_requested,
        allow_options=allow_options(names),
        kept_along=kept_along(names),
        select=select,
        writing=True,
    )
