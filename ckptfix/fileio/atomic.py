"""Writing output files atomically: complete or absent, never partial.

Data goes to a temporary file beside the destination, which is renamed over it only after
the last byte is written. Whatever happens before that (an exception, Ctrl-C, SIGTERM, a full
disk) the temporary file is removed and the destination is untouched. Even SIGKILL, which no
code can catch, leaves at worst a hidden ``.NAME.*.ckptfix-tmp`` file, never a truncated
destination. The rename also makes ``--in-place`` safe when the input is memory-mapped or still
open: the old file keeps its data until every reader closes it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import BinaryIO

from ..errors import CannotWriteError, UsageError
from .held import holding
from .urls import is_url

TEMP_SUFFIX = ".ckptfix-tmp"

#: called with the temporary file after it is written and before it is checked and renamed:
#: a seam for tests that must corrupt real output bytes (e.g. to prove --verify catches it)
WRITE_HOOKS: list[Callable[[Path], None]] = []


def _current_umask() -> int:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def check_destination(source: str | Path, dest: str | Path, *, overwrite: bool, in_place: bool) -> None:
    """Refuse before any work is done: OUT is IN without --in-place, or exists without --force."""
    source, dest = Path(source), Path(dest)
    same = dest.exists() and source.exists() and os.path.samefile(source, dest)
    if same and not in_place:
        raise UsageError(
            f"{dest}: the output is the input file",
            hint="pass --in-place to replace it atomically, or choose another output path",
        )
    if dest.exists() and not (overwrite or in_place):
        raise CannotWriteError(f"{dest}: already exists", hint="pass --force to overwrite it")
    if dest.is_dir():
        raise CannotWriteError(f"{dest}: is a directory")
    if not dest.parent.is_dir():
        raise CannotWriteError(f"{dest}: the folder {dest.parent} does not exist")


def describe_os_error(exc: OSError, dest: Path) -> str:
    reasons: dict[int | None, str] = {
        errno.ENOSPC: "no space left on the device",
        errno.EDQUOT: "disk quota exceeded",
        errno.EACCES: "permission denied",
        errno.EPERM: "operation not permitted",
        errno.EROFS: "the file system is read-only",
        errno.EFBIG: "file too large (a file-size limit or the file system's maximum)",
    }
    return f"{dest}: cannot write: {reasons.get(exc.errno, exc.strerror or str(exc))}"


@contextmanager
def atomic_output(
    dest: str | Path, check: Callable[[Path], None] | None = None, *, in_place: bool = False
) -> Iterator[BinaryIO]:
    """Yield a binary file to write; on success it becomes ``dest`` with a umask-honouring mode.
    A URL ``dest`` (a :class:`~ckptfix.fileio.remote.RemotePath`) is an upload, streamed and
    committed the same way: complete or absent (:func:`~ckptfix.fileio.remote.upload_output`).

    ``check`` runs on the complete temporary file before the rename; if it raises, the
    temporary file is removed and ``dest`` is left as it was.

    ``in_place=True`` means ``dest`` is an existing file being rewritten, and the result should
    be that same file with new contents, as an editor saving it would leave it: when ``dest``
    is a symlink the file it points to is replaced (the temporary file goes beside it, so the
    rename stays on one file system) and the link stays a link; and the replacement keeps the
    original's permission bits (a private 0600 file must not become world-readable) and, where
    allowed (root, or a group the user is in), its owner and group.
    """
    if is_url(os.fspath(dest)):  # an object in a store: uploaded as it is written, committed at the end
        if check is not None or in_place:
            raise UsageError(
                f"{dest}: an output URL is uploaded as it is written; it cannot be checked or replaced in place"
            )
        from .remote import upload_output

        with upload_output(os.fspath(dest)) as out:
            yield out
        return
    dest = Path(dest)
    target = Path(os.path.realpath(dest)) if in_place else dest
    original = _stat_or_none(target) if in_place else None
    # The name is chosen before the file exists and the file is created inside the try: a
    # SIGTERM (raised here as KeyboardInterrupt) landing right after creation still finds the
    # name to remove -- with mkstemp it could land before the name was assigned, leaving a
    # 0-byte temporary file behind. os.urandom is what secrets.token_hex reads; importing
    # secrets (hmac, hashlib, OpenSSL) cost ~4 ms of every writing command's start-up.
    temp = str(target.parent / f".{target.name}.{os.urandom(6).hex()}{TEMP_SUFFIX}")
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError as exc:
        raise CannotWriteError(describe_os_error(exc, dest)) from exc
    except BaseException:
        _remove(temp)
        raise
    held = holding()
    try:
        with os.fdopen(fd, "wb") as out:
            yield out
            out.flush()
            for hook in WRITE_HOOKS:
                hook(Path(temp))
            if check is not None:
                check(Path(temp))
            if original is not None:
                _copy_owner(out.fileno(), original)  # before chmod: chown may clear set-id bits
                os.fchmod(out.fileno(), stat.S_IMODE(original.st_mode))
            else:
                os.fchmod(out.fileno(), 0o666 & ~_current_umask())
        if held is not None:  # renamed when the hold commits
            held.hold(partial(_rename, temp, target, dest), partial(_remove, temp), partial(_remove, str(target)))
            return
        os.replace(temp, target)
    except OSError as exc:
        _remove(temp)
        raise CannotWriteError(describe_os_error(exc, dest)) from exc
    except BaseException:
        _remove(temp)
        raise


def _rename(temp: str, target: Path, dest: str | Path) -> None:
    try:
        os.replace(temp, target)
    except OSError as exc:
        raise CannotWriteError(describe_os_error(exc, Path(dest))) from exc


def _stat_or_none(path: Path) -> os.stat_result | None:
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None


def _copy_owner(fd: int, original: os.stat_result) -> None:
    """Give the new file the original's owner and group where the OS lets us.

    Only root may give a file away; anyone may set the group to one they belong to. Where
    neither is allowed the new file keeps the writer's ids, as any rewrite by that user would
    (EPERM, or EINVAL for ids unmapped in a user namespace, is not an error).
    """
    current = os.fstat(fd)
    if (current.st_uid, current.st_gid) == (original.st_uid, original.st_gid):
        return
    for uid in (original.st_uid, -1):
        try:
            os.fchown(fd, uid, original.st_gid)
            return
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.EINVAL):
                raise


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
