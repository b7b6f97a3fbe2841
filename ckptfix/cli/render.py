"""All of the CLI's human output, and its ``--json`` printing, in one place.

Names in reports come from the files (keys, paths, global names), so they may hold newlines or
terminal escapes: every human line goes through :func:`~ckptfix.errors.one_line`, while
``--json`` keeps the exact text (JSON escapes control characters itself).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import click

from ..errors import one_line

#: the version of every --json document's shape (bumped when a field changes meaning or goes).
#: 2: one envelope for every command (``command``, ``ok``, ``exit_code``), one name per concept
#: (``input``/``output``, ``*_bytes``, the format words ``inspect`` prints); README "JSON output"
SCHEMA_VERSION = 2

#: the keys every --json document starts with, success or failure (an error adds ``error``)
ENVELOPE = ("schema_version", "command", "ok", "exit_code")


def emit_json(command: str | None, exit_code: int, data: dict[str, Any]) -> None:
    """The --json document: the envelope (schema version, command, ``ok`` = exit code 0, the exit
    code), then the command's own fields, names exactly as the file holds them."""
    document: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "command": command,
        "ok": int(exit_code) == 0,
        "exit_code": int(exit_code),
    }
    document.update((k, v) for k, v in data.items() if k not in document)
    import json  # here: only --json needs it, and --help starts faster without (issue 26)

    click.echo(_named(json.dumps(document, indent=2, default=str)))


def json_error(command: str | None, exit_code: int, message: str, kind: str = "Error", hint: str | None = None) -> None:
    """What --json prints on stdout when the command fails (the one stderr line still goes out),
    so a script reading stdout always gets one JSON object."""
    emit_json(command, exit_code, {"error": {"type": kind, "message": message, "hint": hint}})


def json_exception(command: str | None, error: Exception, exit_code: int) -> None:
    message = getattr(error, "message", None) or str(error)
    json_error(command, exit_code, message, type(error).__name__, getattr(error, "hint", None))


def printable(data: Any) -> Any:
    """A copy of ``data`` for human output, every string in it passed through :func:`one_line`.

    Printed raw, a key holding ``\\n`` or ``\\x1b[31m`` would fake or hide report lines, or drive
    the user's terminal; escaped, each name stays on its line and visible.
    """
    if isinstance(data, str):
        return one_line(data)
    if isinstance(data, dict):
        return {printable(k): printable(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(printable(v) for v in data)
    return data


#: temporary files standing for a stream, and what output calls them (``<stdin>``, ``<stdout>``)
STREAM_NAMES: dict[str, str] = {}


def _named(text: str) -> str:
    for real, shown in STREAM_NAMES.items():
        text = text.replace(real, shown)
    return text


#: False while a --json run prints: its human lines (stderr) stay plain too
_colour_allowed = True
#: what each status word is shown in on a terminal
_COLOURS = {
    "FAIL": "red",
    "DANGEROUS": "red",
    "ERROR": "red",
    "error:": "red",
    "UNKNOWN": "yellow",
    "warning:": "yellow",
    "ok": "green",
}


def allow_colour(allowed: bool) -> None:
    """``--json`` runs turn colour off for the whole run (main() decides, before the command)."""
    global _colour_allowed
    _colour_allowed = allowed


def use_colour(stream: Any) -> bool:
    """Colour only where it helps: a terminal, ``NO_COLOR`` unset or empty (no-color.org), and
    not a --json run; never in pipes, files or CI logs."""
    isatty = getattr(stream, "isatty", None)
    return _colour_allowed and not os.environ.get("NO_COLOR") and bool(isatty and isatty())


def say(line: str, err: bool = False) -> None:
    """Print one line of human output, with anything non-printable in it escaped; its leading
    status word (FAIL, DANGEROUS, warning: ...) in colour on a terminal."""
    text = _named(one_line(line))
    word, space, rest = text.partition(" ")
    if word == "ckptfix:" and rest.startswith("error:"):  # "ckptfix: error: ..."
        word, space, rest = f"{word} error:", " ", rest[len("error:") :].lstrip(" ")
    colour = _COLOURS.get(word.removeprefix("ckptfix: "))
    if colour and space and use_colour(sys.stderr if err else sys.stdout):
        text = click.style(word, fg=colour, bold=True) + space + rest
    click.echo(text, err=err)


def clear_progress_line() -> None:
    """Erase the progress bar's line on a terminal, so the next line printed (an error) starts
    at column 0 instead of sharing the bar's line."""
    if sys.stderr.isatty():
        sys.stderr.write("\r\x1b[2K")
        sys.stderr.flush()


def no_close(ok: bool) -> None:
    """The closer of no progress bar."""


def byte_progress(path: str) -> tuple[Callable[[int], None] | None, Callable[[bool], None]]:
    """A byte-count progress bar on a terminal's stderr (large files only); nothing in CI logs or pipes.

    Returns the update callback and a closer taking whether the work succeeded.
    """
    try:
        size = os.path.getsize(path) if sys.stderr.isatty() else 0
    except OSError:  # a broken input is reported by the reader, with the right exit code
        size = 0
    if size < 64 << 20:
        return None, no_close
    bar = click.progressbar(length=size, file=sys.stderr, label="copying tensors", show_pos=False)
    bar.__enter__()

    def close(ok: bool) -> None:
        if ok:
            bar.update(size - bar.pos)  # headers and the pickle are not counted as they go
        bar.__exit__(None, None, None)

    return bar.update, close


def file_report(report: dict[str, Any], *, dry_run: bool) -> None:
    """One written (or unchanged) file, as ``IN OUT`` prints it: notes on stderr, the renames
    of a dry run, then the one-line result."""
    for note in report["notes"]:
        say(f"note: {note}", err=True)
    if dry_run:
        for change in report["state_dicts"]:
            for old, new in change["renames"][:20]:
                say(f"  {old} -> {new}")
            if len(change["renames"]) > 20:
                say(f"  ... and {len(change['renames']) - 20} more in {change['path'] or '(top level)'}")
    say(report["message"])


def batch_line(result: Any) -> str:
    """A file's line in a batch run (stderr, when there is no progress bar)."""
    return result.message if result.status == "unchanged" else f"{result.input}: {result.message}"


def batch_summary(summary: dict[str, Any], total: int, seconds: float, stopped_early: bool) -> str:
    stopped = "; stopped at the first failure" if stopped_early else ""
    counts = summary["counts"]
    return (
        f"{counts['written']} written, {counts['unchanged']} unchanged, {counts['failed']} failed "
        f"of {total} ({seconds:.2f} s){stopped}"
    )


def fit_plan(plan: Any) -> str:
    """The human fit report; every key is escaped (they come from the files, or the model)."""
    steps = [f"strip {p!r}" for p in plan.strips] + ([f"add {plan.add!r}"] if plan.add else [])
    lines = [f"fit: {', '.join(steps) or 'no renaming needed'}; {plan.matched} keys match the reference"]
    if plan.missing:
        lines.append(f"missing ({len(plan.missing)}): {', '.join(map(one_line, plan.missing[:20]))}")
    if plan.missing_num_batches_tracked:
        lines.append(
            f"missing num_batches_tracked ({len(plan.missing_num_batches_tracked)}): BatchNorm fills "
            "these in when loading; not an error"
        )
    if plan.unexpected:
        lines.append(f"unexpected ({len(plan.unexpected)}): {', '.join(map(one_line, plan.unexpected[:20]))}")
    for m in plan.shape_mismatches[:20]:
        lines.append(
            f"shape mismatch: {one_line(m['key'])}: checkpoint {m['checkpoint']} vs reference {m['reference']}"
        )
    return "\n".join(lines)


def verify_results(results: list[Any], quiet: bool) -> None:
    failed = [r for r in results if not r.ok]
    for r in results:
        if not r.ok:
            say(f"FAIL {r.input}: " + "; ".join(r.problems), err=True)
        elif not quiet:
            say(f"ok   {r.input} ({r.format})" + ("".join(f"; {n}" for n in r.notes)))
    if not quiet:
        click.echo(f"{len(results) - len(failed)} ok, {len(failed)} failed")


def scan_results(results: list[Any]) -> None:
    for r in results:
        verdicts: dict[str, set[str]] = {}
        for g in r.globals:
            verdicts.setdefault(g.verdict, set()).add(g.name)
        status = "DANGEROUS" if r.dangerous else ("ERROR" if r.error else "UNKNOWN" if r.unknown else "ok")
        say(f"{status} {r.path} ({r.format})" + (f": {r.error}" if r.error else ""))
        for note in r.notes:
            say(f"  note: {note}")
        reasons = {g.name: g.reason for g in r.dangerous}
        for name in sorted(reasons):
            say(f"  dangerous: {name}: {reasons[name]}")
        for verdict in ("unknown", "safe"):
            if verdict in verdicts:
                say(f"  {verdict}: {', '.join(sorted(verdicts[verdict]))}")
