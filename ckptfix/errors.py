"""Error classes and the exit codes they map to.

Every failure a user can cause is one of these, so the CLI can print one line and exit with
a documented code instead of a traceback. Library users catch :class:`CkptfixError`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from enum import IntEnum
from functools import wraps
from typing import Any, TypeVar


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


#: the CPU build of torch: a few hundred MB, where the default Linux wheel pulls GBs of CUDA libraries
TORCH_CPU_INSTALL = "pip install torch --index-url https://download.pytorch.org/whl/cpu"


def torch_install_hint(platform: str = sys.platform, nvidia_driver: bool | None = None) -> str:
    """The command that installs the torch this machine needs: on Linux or Windows without an
    NVIDIA driver, the CPU build (``pip install 'ckptfix[torch]'`` would pull the CUDA one);
    elsewhere (a GPU, macOS, whose wheels hold no CUDA) the ``[torch]`` extra."""
    if nvidia_driver is None:
        nvidia_driver = os.path.exists("/proc/driver/nvidia") or os.path.exists(
            os.path.join(os.environ.get("SYSTEMROOT", "C:\\Windows"), "System32", "nvidia-smi.exe")
        )
    if platform.startswith(("linux", "win")) and not nvidia_driver:
        return f"{TORCH_CPU_INSTALL} (the CPU build; or pip install 'ckptfix[torch]' for the CUDA one)"
    return "pip install 'ckptfix[torch]'"


#: what every feature that runs through torch says when torch is not installed
NEEDS_TORCH = f"needs torch: {torch_install_hint()}"


class NeedsTorchError(UsageError):
    """Something that runs through torch was asked for (``--unsafe-load``, a tar-era file, DCP,
    ``fit --model``, ``load``/``load_into``) and torch is not installed (exit 2). The core install
    (``pip install ckptfix``) has no torch; the message says how to add the one this machine
    needs (:func:`torch_install_hint`)."""

    def __init__(self) -> None:
        super().__init__(NEEDS_TORCH)


class BadInputError(CkptfixError):
    """The input is not a readable checkpoint: empty, truncated, corrupt, wrong kind (exit 3)."""

    exit_code = ExitCode.BAD_INPUT


def group_by_module(names: Sequence[str]) -> str:
    """``omegaconf.nodes (AnyNode, IntegerNode), typing.Any``: names of one module together."""
    modules: dict[str, list[str]] = {}
    for name in names:
        module, _, short = name.rpartition(".") if " " not in name else (name, "", "")
        modules.setdefault(module, []).append(short)
    parts = [m if s == [""] else f"{m}.{s[0]}" if len(s) == 1 else f"{m} ({', '.join(s)})" for m, s in modules.items()]
    return ", ".join(parts[:20]) + (f" and {len(parts) - 20} more modules" if len(parts) > 20 else "")


#: how the ways out are spelled on the command line and in the Python API (``api=True``)
_CLI_SPELLING = {
    "sanitize": "--sanitize",
    "select": "--select {}",
    "unsafe": "--unsafe-load",
    "weights": "write the weights",
}
_API_SPELLING = {
    "sanitize": "sanitize=True",
    "select": "select={!r}",
    "unsafe": "unsafe_load=True",
    "weights": "load the weights",
}


class UnsafeInputError(BadInputError):
    """The pickle references globals outside the allow-list; nothing in it was run (exit 3).

    ``names`` are the globals as the pickle spells them, every one the pickle (or, with
    ``writing``, the output) holds that is not allowed, so the user fixes all of them in one
    go; ``shown`` is how to say each (``os.system (pickled as posix.system)``). ``hostile``
    names run code (``reasons`` says how, per name): the file is an attack and no way out but
    ``--unsafe-load`` of a file the user trusts is offered. For the rest the message gives the
    ways out, ready to paste: ``allow_options`` (default: one ``--allow-global`` per name),
    ``--sanitize`` when ``sanitizable``, ``--select PATH`` when ``select`` names the part with
    the weights, and ``--unsafe-load``; ``kept_along`` are the names those options keep without
    naming them. ``writing``: the file was read (its unknown classes as
    inert records) and it is the output that would carry them.
    """

    def __init__(
        self,
        names: str | Sequence[str],
        path: str | None = None,
        *,
        shown: Sequence[str] | None = None,
        sanitizable: bool = False,
        hostile: Sequence[str] = (),
        reasons: dict[str, str] | None = None,
        allow_options: Sequence[str] | None = None,
        select: str | None = None,
        writing: bool = False,
        kept_along: Sequence[str] = (),
        api: bool = False,
        drop: Sequence[str] = (),
        drop_with_sanitize: bool = False,
    ) -> None:
        self.global_names = [names] if isinstance(names, str) else list(names)
        self.shown = list(shown) if shown is not None else list(self.global_names)
        self.sanitizable = sanitizable
        self.hostile = list(hostile)
        self.reasons = dict(reasons or {})
        self.select = select
        self.writing = writing
        self.path = path
        if allow_options is None:
            allow_options = [f"--allow-global {n}" for n in self.global_names if n not in self.hostile]
        self.allow_options = list(allow_options)
        self.kept_along = list(kept_along)
        self.api = api
        self.drop = list(drop)
        self.drop_with_sanitize = drop_with_sanitize
        spell = _API_SPELLING if api else _CLI_SPELLING
        where = f"{path}: " if path else ""
        ways = []
        if self.hostile:
            named = {name: shown for name, shown in zip(self.global_names, self.shown)}
            for name in self.hostile:
                ways.append(f"{named.get(name, name)} {self.reasons.get(name, 'runs code when unpickled')}")
            ways[-1] += ": the file is hostile"
        # the API hands back real objects: ones kept by allow_globals could not be built, so that
        # way out is the command line's only
        keep = "" if api else " ".join(self.allow_options)
        if keep and self.kept_along:
            keep += f" (which also keeps {', '.join(self.kept_along)}: plain types they are rebuilt through)"
        if keep:
            whom = "the others" if self.hostile else "them as they are"
            ways.append(f"to keep {whom}, without running anything: {keep}")
        if sanitizable and not self.hostile:
            ways.append(f"to turn them into plain data: {spell['sanitize']}")
        if self.drop and not self.hostile and not api:
            import shlex

            drops = " ".join(f"--drop {shlex.quote(p)}" for p in self.drop)
            ways.append(
                f"to leave out what no rule turns into plain data: {'--sanitize ' if drop_with_sanitize else ''}{drops}"
            )
        if select and not self.hostile:
            ways.append(f"to {spell['weights']} only: {spell['select'].format(select)}")
        if not self.hostile:
            ways.append(
                f"only if you trust this file: {spell['unsafe']} (torch.load(weights_only=False) runs its code)"
            )
        count = len(self.global_names)
        listed = group_by_module(self.shown)
        if writing and api:
            message = (
                f"{where}refusing to return a tree that holds {count} global{'s' if count > 1 else ''} outside "
                f"the allow-list: {listed}; nothing from the file was run"
            )
        elif writing:
            message = (
                f"{where}refusing to write an output that carries {count} global{'s' if count > 1 else ''} outside "
                f"the allow-list: {listed}; nothing from the file was run"
            )
        else:
            message = (
                f"{where}refusing to load: the pickle references {listed}, which {'is' if count == 1 else 'are'} "
                "not on the allow-list of plain checkpoint contents; nothing from the file was run"
            )
        super().__init__(message, hint="; ".join(ways))

    @property
    def global_name(self) -> str:
        """The first refused global, as shown (kept for callers of the single-name error)."""
        return self.shown[0]

    def at(self, path: str) -> UnsafeInputError:
        """The same refusal, saying which file."""
        return self._again(path, self.api)

    def for_api(self) -> UnsafeInputError:
        """The same refusal, its ways out spelled as the Python API's arguments."""
        return self._again(self.path, True)

    def _again(self, path: str | None, api: bool) -> UnsafeInputError:
        return UnsafeInputError(
            self.global_names,
            path,
            shown=self.shown,
            sanitizable=self.sanitizable,
            hostile=self.hostile,
            reasons=self.reasons,
            allow_options=self.allow_options,
            select=self.select,
            writing=self.writing,
            kept_along=self.kept_along,
            api=api,
            drop=self.drop,
            drop_with_sanitize=self.drop_with_sanitize,
        )


class InputMismatchError(BadInputError):
    """What the command asks for does not fit this input: ``--select`` names no entry of it, it
    holds nothing safetensors can store, no state dict... (exit 3: a problem with one input, which
    a batch reports for that file, not a usage error of the whole command line)."""


class CheckFailedError(CkptfixError):
    """A requested check did not hold, e.g. --strict and nothing to change (exit 1)."""

    exit_code = ExitCode.CHECK_FAILED


class CannotWriteError(CkptfixError):
    """The output cannot be written: exists, same as input, no space, no permission (exit 4)."""

    exit_code = ExitCode.CANNOT_WRITE


def naming_file(exc: CkptfixError, path: str | None) -> CkptfixError:
    """``exc`` with its message naming the input ``path`` (unless it names it already), so every
    error line says which file it is about. A usage error (the command line itself), an output
    that cannot be written (it names the output) and a missing torch are left as they are."""
    if path is None or type(exc) is UsageError or isinstance(exc, (NeedsTorchError, CannotWriteError)):
        return exc
    if isinstance(exc, UnsafeInputError):
        return exc if exc.path else exc.at(path)
    if path not in exc.message:
        exc.message = f"{path}: {exc.message}"
        exc.args = (exc.message,)
    return exc


@contextmanager
def about_input(path: str | None) -> Iterator[None]:
    """Errors raised inside name the input ``path`` (see :func:`naming_file`)."""
    try:
        yield
    except CkptfixError as exc:
        named = naming_file(exc, path)
        if named is exc:
            raise
        raise named from None


_Call = TypeVar("_Call", bound=Callable[..., Any])


def names_input(func: _Call) -> _Call:
    """A library entry point whose first argument is the input path: its errors name that file."""

    @wraps(func)
    def run(path: Any, *args: Any, **kwargs: Any) -> Any:
        with about_input(str(path)):
            return func(path, *args, **kwargs)

    return run  # type: ignore[return-value]
