"""Whole operations -- read, transform, write -- as the CLI runs them, callable from Python."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .checkpoint import Checkpoint, read_checkpoint
from .errors import CheckFailedError, UsageError
from .output import atomic_output, check_destination
from .summary import summarize
from .transforms import TransformResult, add_prefix, normalize_prefix, strip_prefix

_UNSUPPORTED_OUTPUTS = (".safetensors", ".json")


@dataclass
class FixReport:
    """What a writing command did; ``to_dict()`` is the ``--json`` document."""

    command: str
    input: str
    output: str | None
    format: str
    prefix: str
    dry_run: bool
    written: bool = False
    renamed: int = 0
    state_dicts: list[dict[str, Any]] = field(default_factory=list)
    output_bytes: int | None = None
    seconds: float = 0.0
    message: str = ""
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def write_checkpoint(
    ckpt: Checkpoint, root: Any, out_path: str | os.PathLike, *, progress: Callable[[int], None] | None = None
) -> int:
    """Write ``root`` (``ckpt``'s tree, possibly transformed) to ``out_path`` atomically.

    Returns the number of bytes written. The caller checks the destination first
    (:func:`~ckptfix.output.check_destination`); this only guarantees all-or-nothing.
    """
    out_path = Path(out_path)
    if out_path.suffix.lower() in _UNSUPPORTED_OUTPUTS:
        raise UsageError(f"{out_path}: writing {out_path.suffix} files is not supported yet; write a .pth file")
    with atomic_output(out_path) as out:
        ckpt.write(root, out, progress=progress)
    return out_path.stat().st_size


def fix_prefix(
    in_path: str | os.PathLike,
    out_path: str | os.PathLike | None = None,
    *,
    mode: str = "strip",
    prefix: str = "module.",
    keys: Sequence[str] = (),
    dry_run: bool = False,
    force: bool = False,
    in_place: bool = False,
    strict: bool = False,
    unsafe_load: bool = False,
    progress: Callable[[int], None] | None = None,
) -> FixReport:
    """Strip (``mode="strip"``) or add (``mode="add"``) a key prefix, as ``strip-module``/``add-module`` do.

    Writes nothing when no key changes (raises :class:`CheckFailedError` with ``strict``),
    when ``dry_run`` is set, or when a rename would make two keys collide.
    """
    if mode not in ("strip", "add"):
        raise UsageError(f"unknown mode {mode!r}")
    prefix = normalize_prefix(prefix)
    in_path = str(in_path)
    if in_place:
        if out_path is not None and Path(out_path).resolve() != Path(in_path).resolve():
            raise UsageError("give either OUT or --in-place, not both")
        out_path = in_path
    if out_path is None:
        raise UsageError("missing OUT: give an output path, or --in-place to replace the input")
    out_path = str(out_path)
    if not dry_run:
        check_destination(in_path, out_path, overwrite=force, in_place=in_place)
    started = time.perf_counter()
    ckpt = read_checkpoint(in_path, unsafe_load=unsafe_load)
    transform = strip_prefix if mode == "strip" else add_prefix
    result: TransformResult = transform(ckpt.root, prefix, keys)
    report = FixReport(
        command=f"{mode}-module", input=in_path, output=out_path, format=ckpt.format, prefix=prefix,
        dry_run=dry_run, renamed=result.renamed, notes=list(ckpt.notes),
        state_dicts=[c.to_dict() for c in result.changes],
    )
    if not result.changes:
        layout = ", ".join(e["path"] for e in summarize(ckpt)["tree"][:8])
        report.message = f"{in_path}: found no state dict to change (layout: {layout}); nothing written"
    elif result.renamed == 0:
        why = f"no key starts with {prefix!r}" if mode == "strip" else f"every key already starts with {prefix!r}"
        report.message = f"{in_path}: {why}; nothing written"
    if report.message:
        report.seconds = time.perf_counter() - started
        if strict:
            raise CheckFailedError(report.message)
        return report
    verb = "stripped" if mode == "strip" else "added"
    where = ", ".join(f"{c.path or '(top level)'} ({len(c.renamed)}/{c.keys})" for c in result.changes)
    if dry_run:
        report.message = f"would have {verb} {prefix!r} on {result.renamed} keys in {where}; nothing written (dry run)"
    else:
        report.output_bytes = write_checkpoint(ckpt, result.root, out_path, progress=progress)
        report.written = True
        report.message = f"{verb} {prefix!r} on {result.renamed} keys in {where}; wrote {out_path}"
    report.seconds = time.perf_counter() - started
    return report


def inspect_checkpoint(path: str | os.PathLike, *, unsafe_load: bool = False) -> dict[str, Any]:
    """The ``inspect`` report as plain data; reads structure only, never tensor data."""
    return summarize(read_checkpoint(path, unsafe_load=unsafe_load))
