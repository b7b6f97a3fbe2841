"""Many checkpoints per command: input expansion, output naming, parallel runs, one report.

Used by every writing command when it is given ``-o/--output-dir``, ``--in-place`` with
several inputs, or folders. Each file is processed by :func:`ckptfix.ops.convert` in a worker
process (``--jobs``); results come back in input order whatever the scheduling, so the report
and the exit code are reproducible. By default the first failure stops the run (files already
written stay); ``--continue-on-error`` processes everything and fails at the end.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import BadInputError, CannotWriteError, CkptfixError, ExitCode, UsageError, naming_file, one_line
from .fileio.remote import as_path
from .formats.detect import CHECKPOINT_SUFFIXES, FILE_FORMATS
from .formats.sharded import INDEX_NAMES, find_index
from .pickling.vm import many_commands

if TYPE_CHECKING:
    from concurrent.futures import Future

#: file names a folder scan treats as checkpoints


@dataclass
class FileResult:
    """The outcome for one input; ``report`` is that file's :class:`~ckptfix.ops.Report` as a dict."""

    input: str
    output: str | None
    status: str  # "written", "unchanged" (nothing to do), "failed"
    message: str = ""
    exit_code: int = 0
    input_bytes: int = 0
    output_bytes: int = 0
    seconds: float = 0.0
    report: dict[str, Any] | None = None
    #: for a failed file: ``{"type", "message", "hint"}``, the object ``--json`` shows for an error
    error: dict[str, Any] | None = None


@dataclass
class BatchReport:
    """The ``--json`` document of a batch run."""

    command: str
    files: list[FileResult] = field(default_factory=list)
    seconds: float = 0.0
    stopped_early: bool = False

    @property
    def failed(self) -> list[FileResult]:
        return [f for f in self.files if f.status == "failed"]

    @property
    def exit_code(self) -> int:
        return self.failed[0].exit_code if self.failed else 0

    def to_dict(self) -> dict[str, Any]:
        counts = {s: sum(1 for f in self.files if f.status == s) for s in ("written", "unchanged", "failed")}
        return {
            "command": self.command,
            "ok": self.exit_code == 0,
            "exit_code": self.exit_code,
            "counts": counts,
            "stopped_early": self.stopped_early,
            "seconds": round(self.seconds, 4),
            "files": [asdict(f) for f in self.files],
        }


def _is_checkpoint_folder(folder: Path) -> bool:
    from .formats.dcp import is_dcp_folder
    from .formats.deepspeed import is_deepspeed_folder

    return is_dcp_folder(folder) or is_deepspeed_folder(folder) or any((folder / n).is_file() for n in INDEX_NAMES)


def expand_inputs(paths: Sequence[str], recursive: bool) -> list[tuple[Path, Path]]:
    """(input, path relative to its root) for every checkpoint named or inside a named folder.

    A shard folder (with an ``*.index.json``), a DCP folder or a DeepSpeed folder is one checkpoint.
    """
    found: list[tuple[Path, Path]] = []
    for raw in paths:
        path = as_path(raw)  # a URL stays one (a RemotePath: listed through fsspec)
        if path.is_dir() and not _is_checkpoint_folder(path):
            found.extend((p, p.relative_to(path)) for p in _scan(path, recursive))
        else:
            found.append((path, Path(path.name)))
    if not found:
        raise UsageError(f"no checkpoints found in {', '.join(paths)} (looked for {', '.join(CHECKPOINT_SUFFIXES)})")
    return found


def _scan(folder: Path, recursive: bool) -> Iterator[Path]:
    """Checkpoints in ``folder`` (and sub-folders with ``recursive``), in sorted order, depth first.

    Iterative (a stack of folder listings), and each real folder is entered once: a symlink
    loop ends instead of recursing forever.
    """
    seen: set[tuple[int, int]] = set()

    def listing(current: Path) -> Iterator[Path] | None:
        try:
            info = current.stat()
            entries = sorted(current.iterdir())
        except OSError as exc:
            raise BadInputError(f"{current}: cannot list this folder ({exc.strerror or exc})") from None
        if (info.st_dev, info.st_ino) in seen:
            return None
        seen.add((info.st_dev, info.st_ino))
        return iter(entries)

    first = listing(folder)
    stack: list[tuple[Path, Iterator[Path]]] = [(folder, first)] if first else []
    while stack:
        current, entries = stack[-1]
        for entry in entries:
            if entry.is_dir():
                if _is_checkpoint_folder(entry):
                    yield entry
                elif recursive:
                    inner = listing(entry)
                    if inner is not None:
                        stack.append((entry, inner))
                        break
            elif entry.suffix.lower() in CHECKPOINT_SUFFIXES and not entry.name.endswith(".index.json"):
                if entry.name.startswith(".") and entry.name.endswith(".ckptfix-tmp"):
                    continue
                if find_index(current) is not None and "-of-" in entry.name:
                    continue  # a shard of a folder checkpoint
                yield entry
        else:
            stack.pop()


def output_path(relative: Path, out_dir: Path, out_format: str | None) -> Path:
    """Where an input goes under ``--output-dir``: the same relative name, with the suffix
    changed when the format changes (``.safetensors`` <-> ``.pth``)."""
    target = out_dir / relative
    if out_format == "safetensors" and target.suffix != ".safetensors":
        return target.with_suffix(".safetensors")
    if out_format == "pth" and target.suffix == ".safetensors":
        return target.with_suffix(".pth")
    return target


def process_one(
    command: str,
    in_path: str,
    out_path: str,
    options: Any,
    backup: str | None,
    progress: Callable[[int], None] | None = None,
    raise_bugs: bool = False,
) -> FileResult:
    """Run one file (in a worker process); the failure goes in the result. Only a bug (an
    exception that is neither ckptfix's nor the OS's) is raised, with ``raise_bugs``: then the
    CLI shows it as an internal error, with ``--debug``'s traceback."""
    from .pipeline import convert

    started = time.perf_counter()
    result = FileResult(in_path, out_path, "failed")
    backup_path = None
    try:
        result.input_bytes = _size(Path(in_path))
        if backup:
            backup_path = Path(in_path + backup)
            if backup_path.exists() and not options.force:
                raise CannotWriteError(f"{backup_path}: backup already exists", hint="pass --force to replace it")
            backup_path.unlink(missing_ok=True)
            _back_up(Path(in_path), backup_path)
        report = convert(in_path, out_path, options, command=command, progress=progress)
        result.report = report.to_dict()
        result.message = report.message
        result.status = "unchanged" if report.unchanged or not report.written else "written"
        result.output_bytes = report.output_bytes or 0
        if backup_path is not None and not report.written:
            backup_path.unlink(missing_ok=True)
    except CkptfixError as exc:
        exc = naming_file(exc, in_path)  # every error line names its file
        result.message, result.exit_code = str(exc), exc.exit_code
        result.error = {"type": type(exc).__name__, "message": one_line(exc.message), "hint": exc.hint}
    except OSError as exc:
        result.message, result.exit_code = f"{in_path}: {exc.strerror or exc}", ExitCode.CANNOT_WRITE
        result.error = {"type": type(exc).__name__, "message": result.message, "hint": None}
    except Exception as exc:  # a bug: report it for this file, keep the batch's report intact
        if raise_bugs:
            raise
        result.message, result.exit_code = f"internal error: {type(exc).__name__}: {exc}", ExitCode.INTERNAL
        result.error = {"type": "InternalError", "message": result.message, "hint": None}
    if result.status == "failed" and backup_path is not None and backup_path.exists() and not Path(in_path).exists():
        os.replace(backup_path, os.path.realpath(in_path))  # through a symlink, as --in-place writes
    result.seconds = round(time.perf_counter() - started, 4)
    return result


def _back_up(source: Path, backup: Path) -> None:
    """Keep ``source``'s current contents as ``backup`` (beside ``source``, even if it is a link).

    A hard link costs nothing and stays valid because ``--in-place`` renames a new file over
    the old one. It is made to the file a symlink points to: Linux's link() would otherwise
    link the symlink itself, a "backup" that shows the new contents once the target is
    rewritten. Where a hard link is impossible (the target on another file system, a file
    system without them) the contents are copied.
    """
    target = os.path.realpath(source)
    try:
        os.link(target, backup, follow_symlinks=False)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        shutil.copy2(target, backup)


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size if path.exists() else 0


class InOrder:
    """Hands results to ``on_result`` in input order, whatever order they finish in: a file's
    line (or its error) never comes before those of the files listed before it."""

    def __init__(self, on_result: Callable[[FileResult], None] | None) -> None:
        self.on_result = on_result
        self.waiting: dict[int, FileResult] = {}
        self.next = 0

    def add(self, index: int, result: FileResult) -> None:
        self.waiting[index] = result
        while self.next in self.waiting:
            self._emit(self.waiting.pop(self.next))
            self.next += 1

    def flush(self) -> None:
        """The rest, in order, gaps skipped (the files that never ran)."""
        for index in sorted(self.waiting):
            self._emit(self.waiting.pop(index))

    def _emit(self, result: FileResult) -> None:
        if self.on_result is not None:
            self.on_result(result)


def run_batch(
    command: str,
    jobs_list: Sequence[tuple[str, str]],
    options: Any,
    *,
    jobs: int,
    continue_on_error: bool,
    backup: str | None = None,
    on_result: Callable[[FileResult], None] | None = None,
    progress: Callable[[int], None] | None = None,
    raise_bugs: bool = False,
) -> BatchReport:
    """Process ``(input, output)`` pairs with ``jobs`` workers; results in input order.

    One file (``IN OUT`` is a batch of one) or ``jobs=1`` runs here, in this process, where
    ``progress`` (bytes) and ``raise_bugs`` (see :func:`process_one`) apply."""
    with nullcontext() if len(jobs_list) == 1 else many_commands():  # one tree kept: the only one
        return _run_batch(command, jobs_list, options, jobs, continue_on_error, backup, on_result, progress, raise_bugs)


def _run_batch(
    command: str,
    jobs_list: Sequence[tuple[str, str]],
    options: Any,
    jobs: int,
    continue_on_error: bool,
    backup: str | None,
    on_result: Callable[[FileResult], None] | None,
    progress: Callable[[int], None] | None,
    raise_bugs: bool,
) -> BatchReport:
    started = time.perf_counter()
    report = BatchReport(command)
    results: dict[int, FileResult] = {}
    if jobs <= 1 or len(jobs_list) == 1:
        for index, (src, dst) in enumerate(jobs_list):
            results[index] = process_one(command, src, dst, options, backup, progress, raise_bugs)
            if on_result:
                on_result(results[index])
            if results[index].status == "failed" and not continue_on_error:
                report.stopped_early = index < len(jobs_list) - 1
                break
    else:
        # imported here: the process pool pulls in multiprocessing (~10 ms), which one file
        # (the usual IN OUT command, where start-up is most of the time on a CoW file system) never needs
        from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

        in_order = InOrder(on_result)
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            pending: dict[Future[FileResult], int] = {}
            queue = list(enumerate(jobs_list))
            stop = False
            while (queue and not stop) or pending:
                while queue and not stop and len(pending) < jobs * 2:
                    index, (src, dst) = queue.pop(0)
                    pending[pool.submit(process_one, command, src, dst, options, backup)] = index
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    index = pending.pop(future)
                    results[index] = future.result()
                    in_order.add(index, results[index])
                    if results[index].status == "failed" and not continue_on_error:
                        stop = True
            in_order.flush()  # stopped early: what finished after a gap, still in input order
            report.stopped_early = stop and len(results) < len(jobs_list)
    report.files = [results[i] for i in sorted(results)]
    report.seconds = time.perf_counter() - started
    return report


def plan_outputs(
    inputs: Sequence[tuple[Path, Path]], out_dir: Path | None, in_place: bool, out_format: str | None
) -> list[tuple[str, str]]:
    """(input, output) pairs; refuses two inputs that would write the same output."""
    pairs: list[tuple[str, str]] = []
    seen: dict[str, str] = {}
    for src, relative in inputs:
        if in_place and src.is_dir():
            raise UsageError(f"{src}: --in-place cannot rewrite a folder checkpoint; use -o DIR")
        dst = src if in_place else output_path(relative, out_dir, out_format)  # type: ignore[arg-type]
        key = str(dst.resolve())
        if key in seen:
            raise UsageError(f"{seen[key]} and {src} would both be written to {dst}")
        seen[key] = str(src)
        is_folder_output = src.is_dir() and out_format not in FILE_FORMATS
        pairs.append((str(src), str(dst) + ("/" if is_folder_output else "")))
    return pairs
