"""The ``ckptfix`` command line: parse, call the library, print. No logic of its own.

``commands`` holds the commands (the writing ones as a table), ``options`` the option bundles
they share, ``render`` all text output; this module is the entry point, the one place where an
error becomes an exit code.
"""

from __future__ import annotations

import signal
import sys
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import click

from ..errors import CkptfixError, ExitCode, one_line
from .commands import WRITE_COMMANDS, WriteCommand, cli
from .render import allow_colour, json_exception, say

__all__ = ["WRITE_COMMANDS", "WriteCommand", "cli", "main"]


def _on_sigterm(signum: int, frame: Any) -> None:
    # turn SIGTERM into an exception so temporary files are cleaned up on the way out
    raise KeyboardInterrupt


#: options that make a command print its help and do nothing else
_HELP = frozenset(("--help", "-h"))


def _ending(last: bool) -> AbstractContextManager[None]:
    """For ``main`` without ``argv`` (the console script, ``python -m ckptfix``: the process exits
    after this one command): :func:`~ckptfix.pickling.vm.last_command`, so what the command read is
    left to the operating system rather than freed. Imported here, not above: ``--help`` skips it."""
    if not last:
        return nullcontext()
    from ..pickling.vm import last_command

    return last_command()


def _print_traceback() -> None:
    """``--debug``'s traceback; ``traceback`` imported only then (~5 ms of every start-up)."""
    import traceback

    traceback.print_exc()


def main(argv: list[str] | None = None) -> None:
    """Console entry point: maps every error to one stderr line and a documented exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    as_json = "--json" in args[: args.index("--")] if "--" in args else "--json" in args
    # the command's name, for the --json envelope of an error (options before it take no value)
    command = next((a for a in args if not a.startswith("-")), None)
    command = command if command in cli.commands else None
    signal.signal(signal.SIGTERM, _on_sigterm)
    allow_colour(not as_json)
    try:
        with _ending(argv is None and command is not None and not _HELP.intersection(args)):
            code = cli.main(args=args, prog_name="ckptfix", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("ckptfix: interrupted", err=True)
        code = ExitCode.INTERRUPTED
    except click.ClickException as exc:
        exc.show()
        code = exc.exit_code
        if as_json:
            json_exception(command, exc, code)
    except CkptfixError as exc:
        if debug:
            _print_traceback()
        say(f"ckptfix: error: {exc}", err=True)
        code = exc.exit_code
        if as_json:
            json_exception(command, exc, code)
    except KeyboardInterrupt:
        click.echo("ckptfix: interrupted; no output was written", err=True)
        code = ExitCode.INTERRUPTED
    except BrokenPipeError:
        code = ExitCode.OK
    except Exception as exc:
        if debug:
            _print_traceback()
        click.echo(
            one_line(f"ckptfix: internal error (please report with --debug): {type(exc).__name__}: {exc}"), err=True
        )
        code = ExitCode.INTERNAL
        if as_json:
            json_exception(command, exc, code)
    sys.exit(int(code) if isinstance(code, int) else 0)
