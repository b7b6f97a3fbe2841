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
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, cast

from ..errors import BadInputError, CkptfixError
from ..fileio.ranges import FileSlice, RangeSource
from ..fileio.remote import RemotePath, as_path, consistent_reads, metadata_only
from ..fileio.ziparchive import read_directory, read_record_bytes
from ..formats.dcp import METADATA_NAME, DcpItem, dcp_items, is_dcp_folder, prefetch_items
from ..formats.deepspeed import is_deepspeed_folder
from ..formats.detect import (
    MEGATRON_NOT_READ,
    NOT_READ_BY_GLOBAL,
    checkpoint_like,
    megatron_backend,
    open_input,
    sniff_file,
)
from ..formats.sharded import find_index, other_checkpoints, read_index
from ..formats.tarera import record_tar
from ..formats.torchzip import MAX_PICKLE_BYTES, check_record_names
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
    if name.startswith("<not read to the end"):
        return "dangerous", "not read to the end (a limit of ckptfix's own): CPython reads on, and may run more"
    if name.startswith("<a read at byte"):
        return "dangerous", "CPython reads this pickle differently by stream (a read across a FRAME end)"
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
    ``.metadata`` is a plain pickle and is scanned with every item it lists. A folder's other
    checkpoint-like files (:func:`~ckptfix.formats.sharded.other_checkpoints`: what torch or
    ``transformers`` would load besides the checkpoint the folder's marker names) are scanned
    too, each finding naming its file; the verdict is the worst of them."""
    target = as_path(path)  # a URL stays one (RemotePath)
    result, is_dir = _scan_one(target)
    result.notes += _not_read(result, target if is_dir and not isinstance(target, RemotePath) else None)
    if not is_dir or result.format == "":
        return result
    try:
        marker = target / METADATA_NAME if is_dcp_folder(target) else find_index(target)
        others = other_checkpoints(target, marker) if marker is not None else []
    except (OSError, CkptfixError) as exc:
        result.error = result.error or f"the folder's other files were not scanned: {exc}"
        return result
    for other in others:
        part, _ = _scan_one(other)
        result.globals += [Found(g.name, g.verdict, f"{other.name}:{g.where}", g.reason) for g in part.globals]
        result.error = result.error or (f"{other.name}: {part.error}" if part.error else "")
    if others:
        names = ", ".join(p.name for p in others)
        result.notes.append(f"also scanned the folder's other checkpoint-like files: {names}"[:400])
    return result


def _not_read(result: ScanResult, folder: Path | None) -> list[str]:
    """What the scan found is a checkpoint kind ckptfix recognises but does not read: said, so
    that the verdict is not all the user learns (an FSDP1 file names ``getattr`` for a nested
    class, as protocol 2 pickles one)."""
    notes = [f"{NOT_READ_BY_GLOBAL[n][0]}" for n in sorted({g.name for g in result.globals}) if n in NOT_READ_BY_GLOBAL]
    backend = megatron_backend(folder) if folder is not None else None
    if backend is not None:
        notes.append(MEGATRON_NOT_READ.format(backend=backend) + "; its files are scanned as they are")
    return notes


def _scan_one(target: Path) -> tuple[ScanResult, bool]:
    """One checkpoint's scan, and whether ``target`` is a folder (asked once: for a URL, each
    question is a request)."""
    is_dir = False
    try:
        is_dir = target.is_dir()
        parts = _parts(target, is_dir)
    except (OSError, CkptfixError) as exc:
        return ScanResult(str(target), error=str(exc)), is_dir
    if parts is None:
        return _scan_file(target), is_dir
    if parts[0] == "dcp":
        return _scan_dcp(target), is_dir
    kind, files, notes = parts
    result = ScanResult(str(target), kind, notes=notes)
    for file in files:
        part = _scan_file(file)
        result.globals += [Found(g.name, g.verdict, f"{file.name}:{g.where}", g.reason) for g in part.globals]
        result.error = result.error or (f"{file.name}: {part.error}" if part.error else "")
        if kind == "file":  # a folder holding one model file: that file's format
            result.format = part.format
    return result, is_dir


def _parts(target: Path, is_dir: bool) -> tuple[str, list[Path], list[str]] | None:
    """The files of a checkpoint made of several (kind, files, notes), or None for one file."""
    if is_dir and is_dcp_folder(target):
        return "dcp", [target / METADATA_NAME], []
    if is_dir and is_deepspeed_folder(target):
        # every file torch might load: the tags' partitions and anything else checkpoint-like
        return "deepspeed", sorted(p for p in target.rglob("*") if p.is_file() and checkpoint_like(p)), []
    index = find_index(target) if is_dir else target
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
        with f, _whole(f, size, "pickle") as data:  # a remote one fetched (DCP's .metadata is small)
            result.globals, result.error = scan_pickles(data, "pickle", count=1)
    except (OSError, CkptfixError, ValueError) as exc:
        result.error = str(exc)
    return result


def _scan_zip(f: BinaryIO, size: int, path: str, result: ScanResult) -> None:
    """Every record of a zip whose name ends in ``.pkl`` in any case (torch's lookup ignores case:
    an ``archive/DATA.PKL`` is what torch unpickles), scanned before the names are judged, so a
    name the reader refuses still has its pickle's findings reported."""
    records = read_directory(f, size, path)
    for name, record in records.items():
        if name.lower().endswith(".pkl"):
            data = read_record_bytes(f, record, MAX_PICKLE_BYTES)
            found, error = scan_pickles(data, name)
            result.globals.extend(found)
            result.error = result.error or (f"{name}: {error}" if error else "")
    try:
        check_record_names(records, path)
    except BadInputError as exc:
        result.error = result.error or str(exc)


def _scan_dcp(folder: Path) -> ScanResult:
    """A DCP folder as torch's loader reads it: ``.metadata`` (plain ``pickle.load``), then every
    item it lists -- non-tensor items are ``torch.load(weights_only=False)``-ed from their
    ``.distcp`` byte range (a zip, or else legacy pickles: a BytesIO gets no tar attempt)."""
    result = ScanResult(str(folder), "dcp")
    meta = _scan_pickle_file(folder / METADATA_NAME)
    result.globals += [Found(g.name, g.verdict, f"{METADATA_NAME}:{g.where}", g.reason) for g in meta.globals]
    if meta.error:
        result.error = f"{METADATA_NAME}: {meta.error}"
    problems: list[str] = []
    try:
        items = dcp_items(folder, problems)
    except (OSError, CkptfixError) as exc:
        result.error = result.error or f"the items were not scanned: {exc}"
        return result
    with contextlib.ExitStack() as held:
        remote = _RemoteItems(folder, items, held) if isinstance(folder, RemotePath) else None
        for item in items:
            label = f"{item.relative_path}@{item.offset}"
            part = ScanResult(label)
            try:
                with _item_file(folder, item, remote) as (f, size):
                    if item.offset + item.length > size:
                        raise BadInputError(f"{label}: the item runs past the end of the file ({size} bytes)")
                    blob = FileSlice(f, item.offset, item.length)
                    if blob.read(4) == b"PK\x03\x04":
                        _scan_zip(cast(BinaryIO, blob), item.length, label, part)
                    else:
                        data = blob.pread(min(item.length, MAX_PICKLE_BYTES), 0)
                        part.globals, part.error = scan_pickles(data, "pickles", headerless=data[:1] != b"\x80")
            except (OSError, CkptfixError, ValueError) as exc:
                part.error = str(exc)
            result.globals += [Found(g.name, g.verdict, f"{label}:{g.where}", g.reason) for g in part.globals]
            result.error = result.error or (f"{item.fqn}: {part.error}" if part.error else "")
    result.error = result.error or "; ".join(problems)
    return result


class _RemoteItems:
    """A remote DCP folder's ``.distcp`` objects, each opened once (reading only metadata) for
    all its items, whose heads and tails are fetched ahead in coalesced batches."""

    def __init__(self, folder: Path, items: list[DcpItem], held: contextlib.ExitStack) -> None:
        self._folder, self._held = folder, held
        self._files: dict[str, tuple[BinaryIO, int]] = {}
        self._batches: dict[tuple[str, int], list[tuple[int, int]]] = {}
        by_file: dict[str, list[DcpItem]] = {}
        for item in items:
            by_file.setdefault(item.relative_path, []).append(item)
        for name, in_file in by_file.items():
            for first in range(0, len(in_file), _AHEAD_ITEMS):
                batch = in_file[first : first + _AHEAD_ITEMS]
                self._batches[(name, batch[0].offset)] = [(i.offset, i.length) for i in batch]

    def file(self, item: DcpItem) -> tuple[BinaryIO, int]:
        opened = self._files.get(item.relative_path)
        if opened is None:
            with metadata_only():
                f, size = open_input(str(self._folder / item.relative_path))
            opened = self._files[item.relative_path] = (self._held.enter_context(f), size)
        ahead = self._batches.pop((item.relative_path, item.offset), None)
        if ahead is not None:
            prefetch_items(opened[0], ahead)
        return opened


#: items of one remote object whose heads and tails are fetched ahead at once
_AHEAD_ITEMS = 128


@contextlib.contextmanager
def _item_file(folder: Path, item: DcpItem, remote: _RemoteItems | None) -> Iterator[tuple[BinaryIO, int]]:
    """The open file holding ``item`` and its size: a local file opened for it alone, a remote
    object opened once for the folder's scan."""
    if remote is not None:
        yield remote.file(item)
        return
    f, size = open_input(folder / item.relative_path)
    with f:
        yield f, size


#: where a finding in a safetensors file not named .safetensors comes from
TORCH_UNPICKLES_IT = "byte 0 (torch.load unpickles a file not named .safetensors)"


def _scan_file(path: Path) -> ScanResult:
    """Scan one file; never executes, never raises for bad input (the error is in the result)."""
    result = ScanResult(str(path))
    try:
        with metadata_only():  # a remote file: its pickles are read, no tensor record's header
            f, size = open_input(str(path))  # never opens a FIFO or a device (they hang or never end)
        with f:
            what = sniff_file(f, size, path)
            result.format = what.kind
            if what.kind == "zip":
                _scan_zip(f, size, str(path), result)
            elif what.kind == "legacy" or (what.kind == "not-checkpoint" and "pickle" in what.description):
                # a legacy file is exactly five pickles, then raw storage bytes (not opcodes)
                with _whole(f, size, what.kind) as data:
                    found, result.error = scan_pickles(data, "pickles", count=5 if what.kind == "legacy" else None)
                result.globals.extend(found)
            elif what.kind == "safetensors":
                # JSON header and raw bytes: nothing to run -- for the safetensors library, which
                # torch.load uses only for a path ending .safetensors: any other name (model.bin)
                # torch unpickles from byte 0, and a length and header can be made to be a pickle
                if not str(path).endswith(".safetensors"):
                    with _whole(f, size, what.kind) as data:
                        found, _ = scan_pickles(data, TORCH_UNPICKLES_IT, headerless=True)
                    result.globals.extend(found)
            elif what.kind == "tar":
                with _whole(f, size, what.kind) as data:
                    result.error = _scan_tar(f, data, size, result.globals)
            else:
                # not a format we know -- but a protocol 0/1 pickle has no header, and
                # pickle.load would still run whatever it names: record that, if anything
                with _whole(f, size, what.kind) as data:
                    found, _ = scan_pickles(data, "pickles", headerless=True)
                result.globals.extend(found)
                result.error = what.description
    except (OSError, CkptfixError, ValueError) as exc:
        result.error = str(exc)
    return result


def _whole(f: BinaryIO, size: int, kind: str) -> contextlib.AbstractContextManager[bytes | mmap.mmap]:
    """All of an open file's bytes: a local file mapped; a remote one (no descriptor to map)
    fetched whole, up to the pickle limit (a bigger one is not scanned: download it first)."""
    if isinstance(f, RangeSource):
        if size > MAX_PICKLE_BYTES:
            raise BadInputError(f"a {kind} file of {size} bytes from a URL: not scanned remotely; download it first")
        return contextlib.nullcontext(f.pread(size, 0))
    if not size:
        return contextlib.nullcontext(b"")
    return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def _scan_tar(f: Any, data: bytes | mmap.mmap, size: int, found: list[Found]) -> str:
    """Scan what torch's tar reader unpickles (:func:`ckptfix.formats.tarera.record_tar`); returns
    the error that keeps the file from being called clean (a tar-era file is never read safely)."""
    recorded, error = record_tar(f, data, size)
    found += [Found(canonical_name(name), *_verdict(name, at)) for name, at in recorded]
    return error
