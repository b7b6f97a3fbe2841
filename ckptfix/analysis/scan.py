"""``scan``: list every global a checkpoint's pickles reference, without running any of them.

The pickles are run by the same VM the reader uses (:mod:`ckptfix.pickle_vm`), with hooks that
record instead of build: every GLOBAL/STACK_GLOBAL/INST is resolved exactly as the reader
resolves it (memo, DUP, POP and all), recorded, and replaced by an inert symbol; calls,
BUILD and persistent ids make inert symbols too, and nothing is refused. So what ``scan``
reports is exactly what the reader would meet. A pickle that names a global and is garbage
afterwards keeps its findings (``torch.load`` would have run the payload before failing).
Bytes that are pickles themselves (a ``torch.storage._load_from_bytes`` payload) are scanned
too, recursively; every consecutive pickle of a legacy file or raw pickle stream is scanned
(protocol 0 included), and in a zip every record whose name ends in ``.pkl`` in any case.

Verdicts, each with its reason:

* ``dangerous`` -- a global that runs code or touches the system when a pickle calls it
  (:data:`~ckptfix.pickling.globals.DANGEROUS`, a maintained list: ``os``/``subprocess``,
  ``eval``/``exec``/``getattr``, torch's own loaders...) and laundering attempts (BUILD on a
  global). An attack: ``scan`` exits 1.
* ``unknown`` -- a third-party or other class that is not on any list (``omegaconf``
  configs, a project's own classes). Importing it runs its package's code, so it is listed;
  it is no attack by itself (``--strict`` makes it fail too).
* ``safe`` -- ckptfix's allow-list (which ``torch.load(weights_only=True)`` also accepts) and
  the standard library's plain data types (containers, numbers, paths, ``typing`` names,
  numpy's array and scalar rebuilders).
"""

from __future__ import annotations

import contextlib
import mmap
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import BadInputError, CkptfixError
from ..fileio.ranges import RangeSource
from ..fileio.remote import as_path, consistent_reads, metadata_only
from ..fileio.ziparchive import read_record_bytes
from ..formats.dcp import METADATA_NAME, is_dcp_folder
from ..formats.detect import open_input, sniff
from ..formats.sharded import find_index, read_index
from ..formats.torchzip import MAX_PICKLE_BYTES, read_checked_directory
from ..pickling.globals import canonical_name, danger, plain_data
from ..pickling.reader import PYTHON_GLOBALS, TORCH_GLOBALS
from ..pickling.recording import record_globals


@dataclass
class Found:
    name: str
    verdict: str
    where: str
    reason: str = ""


#: what a sniffed kind is called in --json: the words ``inspect`` prints (``unknown``: not a
#: checkpoint format; ``pickle``: a file that is one plain pickle, DCP's .metadata)
SCAN_FORMAT_WORDS = {"zip": "torch-zip", "legacy": "torch-legacy", "tar": "torch-tar", "not-checkpoint": "unknown"}


@dataclass
class ScanResult:
    path: str
    format: str = ""
    globals: list[Found] = field(default_factory=list)
    error: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def dangerous(self) -> list[Found]:
        return [g for g in self.globals if g.verdict == "dangerous"]

    @property
    def unknown(self) -> list[Found]:
        return [g for g in self.globals if g.verdict == "unknown"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "input": self.path,
            "format": SCAN_FORMAT_WORDS.get(self.format, self.format) or "unknown",
            "problems": [self.error] if self.error else [],  # as verify's: "error" is the envelope's
            "notes": self.notes,
            "dangerous": sorted({g.name for g in self.dangerous}),
            "unknown": sorted({g.name for g in self.unknown}),
            "globals": [asdict(g) for g in self.globals],
        }


def classify(name: str) -> tuple[str, str]:
    """The verdict on one global (as pickled) and why."""
    if name.startswith("<"):
        return "dangerous", "laundering: the pickle changes or calls something the reader built"
    reason = danger(name)
    if reason is not None:
        return "dangerous", reason
    known = canonical_name(name)
    if known in TORCH_GLOBALS or known in PYTHON_GLOBALS:
        return "safe", "on the allow-list torch.load(weights_only=True) also accepts"
    if plain_data(known):
        return "safe", "a standard-library data type: nothing runs code"
    return "unknown", "not on any list: importing it runs its package's code"


def _plain(name: str) -> bool:
    """Globals whose results the reader builds itself: BUILD or items on them is laundering."""
    return name in TORCH_GLOBALS or name in PYTHON_GLOBALS


def scan_pickles(
    data: bytes | mmap.mmap, where: str, count: int | None = None, headerless: bool = False
) -> tuple[list[Found], str]:
    """Globals (and laundering attempts) in ``count`` consecutive pickles (all, if None) at the
    start of ``data``, nested pickles included, each with its verdict; and an error ("" if all
    read cleanly). See :func:`ckptfix.recording.record_globals`."""
    found, error = record_globals(data, where, _plain, count=count, headerless=headerless)
    return [Found(canonical_name(name), *_verdict(name, at)) for name, at in found], error


def _verdict(name: str, at: str) -> tuple[str, str, str]:
    verdict, reason = classify(name)
    return verdict, at, reason


@consistent_reads
def scan_path(path: str | Path) -> ScanResult:
    """Scan one checkpoint -- a file, a shard index or folder, a DCP folder -- never executing
    anything; bad input is reported in the result, never raised.

    A sharded checkpoint is scanned file by file (the globals say which shard); a DCP folder's
    ``.metadata`` is a plain pickle and is scanned as one."""
    target = as_path(path)  # a URL stays one (RemotePath)
    try:
        parts = _parts(target)
    except (OSError, CkptfixError) as exc:
        return ScanResult(str(path), error=str(exc))
    if parts is None:
        return _scan_file(target)
    kind, files, notes = parts
    result = ScanResult(str(path), kind, notes=notes)
    for file in files:
        part = _scan_pickle_file(file) if kind == "dcp" else _scan_file(file)
        result.globals += [Found(g.name, g.verdict, f"{file.name}:{g.where}", g.reason) for g in part.globals]
        result.error = result.error or (f"{file.name}: {part.error}" if part.error else "")
        if kind == "file":  # a folder holding one model file: that file's format
            result.format = part.format
    return result


def _parts(target: Path) -> tuple[str, list[Path], list[str]] | None:
    """The files of a checkpoint made of several (kind, files, notes), or None for one file."""
    if target.is_dir() and is_dcp_folder(target):
        note = "DCP tensor data files (*.distcp) are not scanned: only .metadata holds a pickle ckptfix can find"
        return "dcp", [target / METADATA_NAME], [note]
    index = find_index(target) if target.is_dir() else target
    if index is None:
        raise BadInputError(f"{target}: a folder with no checkpoint index or model file in it")
    if not index.name.lower().endswith(".index.json"):
        return None if index == target else ("file", [index], [])
    weight_map, _ = read_index(index)
    return "sharded", [index.parent / name for name in dict.fromkeys(weight_map.values())], []


def _scan_pickle_file(path: Path) -> ScanResult:
    """A file that is one plain pickle (DCP's .metadata)."""
    result = ScanResult(str(path), "pickle")
    try:
        f, size = open_input(str(path))
        with f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else contextlib.nullcontext(b"") as data:
            result.globals, result.error = scan_pickles(data, "pickle", count=1)
    except (OSError, CkptfixError, ValueError) as exc:
        result.error = str(exc)
    return result


def _scan_remote_file(f: RangeSource, size: int, result: ScanResult) -> ScanResult:
    """A remote file that is not a zip, scanned as :func:`_scan_file` scans a local one, from
    bytes fetched rather than a memory map: a safetensors file holds no pickle (its header is
    not even fetched), a legacy file or a pickle is fetched whole, up to the pickle limit."""
    what = sniff(f.pread(512, 0), size)
    result.format = what.kind
    if what.kind == "safetensors":
        return result
    if what.kind == "tar":
        result.error = "tar-era torch file: not scanned"
        return result
    if size > MAX_PICKLE_BYTES:
        result.error = f"a {what.kind} file of {size} bytes from a URL: not scanned remotely; download it first"
        return result
    data = f.pread(size, 0)
    if what.kind == "legacy" or (what.kind == "not-checkpoint" and "pickle" in what.description):
        found, result.error = scan_pickles(data, "pickles", count=5 if what.kind == "legacy" else None)
    else:
        found, _ = scan_pickles(data, "pickles", headerless=True)
        result.error = what.description
    result.globals.extend(found)
    return result


def _scan_file(path: Path) -> ScanResult:
    """Scan one file; never executes, never raises for bad input (the error is in the result)."""
    result = ScanResult(str(path))
    data: bytes | mmap.mmap
    try:
        with metadata_only():  # a remote file: its pickles are read, no tensor record's header
            f, size = open_input(str(path))  # never opens a FIFO or a device (they hang or never end)
        if isinstance(f, RangeSource) and sniff(f.pread(512, 0), size).kind != "zip":
            return _scan_remote_file(f, size, result)
        with f:
            what = sniff(f.read(512), size)
            result.format = what.kind
            if what.kind == "zip":
                records = read_checked_directory(f, size, str(path))
                for name, record in records.items():
                    if name.lower().endswith(".pkl"):
                        data = read_record_bytes(f, record, MAX_PICKLE_BYTES)
                        found, error = scan_pickles(data, name)
                        result.globals.extend(found)
                        result.error = result.error or (f"{name}: {error}" if error else "")
            elif what.kind == "legacy" or (what.kind == "not-checkpoint" and "pickle" in what.description):
                # a legacy file is exactly five pickles, then raw storage bytes (not opcodes)
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                    found, result.error = scan_pickles(data, "pickles", count=5 if what.kind == "legacy" else None)
                result.globals.extend(found)
            elif what.kind == "safetensors":
                pass  # JSON header and raw bytes: no code can be referenced
            elif what.kind == "tar":
                result.error = "tar-era torch file: not scanned"
            else:
                # not a format we know -- but a protocol 0/1 pickle has no header, and
                # pickle.load would still run whatever it names: record that, if anything
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else contextlib.nullcontext(b"") as data:
                    found, _ = scan_pickles(data, "pickles", headerless=True)
                result.globals.extend(found)
                result.error = what.description
    except (OSError, CkptfixError, ValueError) as exc:
        result.error = str(exc)
    return result
