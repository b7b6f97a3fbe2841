"""Error classes and the exit codes they map to.

Every failure a user can cause is one of these, so the CLI can print one line and exit with
a documented code instead of a traceback. Library users catch :class:`CkptfixError`.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """Every exit status the CLI returns (the README's table is generated from the same list)."""

    OK = 0
    #: a requested check did not hold (verify, diff, fit, --strict, scan found something dangerous)
    CHECK_FAILED = 1
    #: the command line asks for something impossible
    USAGE = 2
    #: the input is unreadable, corrupt, hostile or unsafe; nothing from it was run
    BAD_INPUT = 3
    #: the output cannot be written (exists, no space, no permission, failed verification)
    CANNOT_WRITE = 4
    #: a bug in ckptfix: please report it (run with --debug for the traceback)
    INTERNAL = 5
    #: interrupted (Ctrl-C or SIGTERM); no partial output is left
    INTERRUPTED = 130


def one_line(text: str) -> str:
    """``text`` with control characters escaped, so an error is always exactly one line
    (names read from a hostile file may hold newlines or terminal escapes)."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


class CkptfixError(Exception):
    """Base class: a message for the user and the exit code the CLI returns."""

    exit_code: ExitCode = ExitCode.BAD_INPUT

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return one_line(self.message if not self.hint else f"{self.message} ({self.hint})")


class UsageError(CkptfixError):
    """The command line asks for something impossible (exit 2)."""

    exit_code = ExitCode.USAGE


class BadInputError(CkptfixError):
    """The input is not a readable checkpoint: empty, truncated, corrupt, wrong kind (exit 3)."""

    exit_code = ExitCode.BAD_INPUT


class UnsafeInputError(BadInputError):
    """The pickle references a global outside the allow-list; nothing in it was run (exit 3)."""

    def __init__(self, global_name: str, path: str | None = None) -> None:
        where = f"{path}: " if path else ""
        super().__init__(
            f"{where}refusing to load: the pickle references {global_name}, which is not on the "
            "allow-list of plain checkpoint contents; nothing from the file was run",
            hint=f"to keep it without running it: --allow-global {global_name.split(' ')[0]}; "
            "only if you trust this file: --unsafe-load (torch.load(weights_only=False) runs code from the file)",
        )
        self.global_name = global_name


class CheckFailedError(CkptfixError):
    """A requested check did not hold, e.g. --strict and nothing to change (exit 1)."""

    exit_code = ExitCode.CHECK_FAILED


class CannotWriteError(CkptfixError):
    """The output cannot be written: exists, same as input, no space, no permission (exit 4)."""

    exit_code = ExitCode.CANNOT_WRITE
