"""The torch zip format (``torch.save`` since 1.6): read into a lazy tree, write by streaming.

Layout of such a file: a zip whose members all sit in one folder (``archive/``)::

    archive/data.pkl            the pickled object tree; tensors refer to storages by key
    archive/.format_version     "1": storages are numbered in the order they are pickled
    archive/.storage_alignment  "64": every record's data starts on a 64-byte boundary
    archive/byteorder           "little" or "big" (absent in old files: native order)
    archive/data/0 ...          raw storage bytes, one record per storage
    archive/version             the serialization version ("3")
    archive/.data/serialization_id

Reading parses ``data.pkl`` with the restricted unpickler and notes each storage's byte
range; writing re-pickles the (transformed) tree and copies storage records byte for byte.
"""

from __future__ import annotations

import contextlib
import re
import sys
from array import array
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import compress, count, repeat
from operator import add, attrgetter, is_, mul
from typing import Any, BinaryIO, cast

from ..errors import BadInputError, UnsafeInputError
from ..fileio.ranges import SMALL_COPY, FileRange, FileSlice, OpenFiles
from ..fileio.urls import is_url
from ..fileio.ziparchive import (
    STORED,
    NumberedNames,
    ZipDirectory,
    ZipRecord,
    ZipWriter,
    read_directory,
    read_record_bytes,
    shares_blocks,
)
from ..model.dtypes import DTYPE_ITEMSIZE, STORAGE_DTYPE
from ..model.refs import Global, Source, StorageRef, make_storage
from ..model.walk import check_extents
from ..native import records as native_records
from ..native.crc import crc32
from ..native.vm import release_freed_memory, steady_heap
from ..pickling.reader import restricted_load
from ..pickling.vm import Budgets
from .compact import pickle_compacted
from .detect import CHECKPOINT_SUFFIXES

#: data.pkl holds only structure (no tensor data); anything larger is hostile or not ours
MAX_PICKLE_BYTES = 1 << 30
#: how much larger than its compressed bytes a deflated data.pkl may be (real ones: 3-6x)
PICKLE_RATIO = 32
#: records written from our own knowledge rather than copied
_REGENERATED = {"data.pkl", ".format_version", ".storage_alignment", "byteorder", ".data/serialization_id"}
#: the serialization version, as torch.save (``version``) or newer writers (``.data/version``)
#: record it: read, checked and written back with the same value
_VERSION_RECORDS = ("version", ".data/version")
_VERSION = re.compile(rb"[0-9]{1,8}\r?\n?")
#: the versions torch's reader accepts (kMinSupportedFileFormatVersion, kMaxSupportedFileFormatVersion
#: in caffe2/serialize/versions.h; torch 2.13 refuses 0 and 11+)
MIN_VERSION, MAX_VERSION = 1, 10
#: every name torch's loader looks up, besides ``data/<key>`` storages
_TORCH_NAMES = _REGENERATED | set(_VERSION_RECORDS)


@dataclass
class TorchZipArchive:
    """What the writer needs from the input beyond the tree.

    Only records ckptfix read and checked reach an output: the pickle and the metadata are
    written anew, storages are copied by the byte range the pickle gives them, and the
    version records by their checked value. Anything else torch would never read is left
    out (``dropped``), so a file can't smuggle bytes through ckptfix that no check has seen.
    """

    path: str
    archive_name: str
    records: ZipDirectory = field(repr=False)
    byteorder: bytes | None
    versions: dict[str, bytes] = field(default_factory=dict)

    @property
    def dropped(self) -> list[str]:
        """Records that are neither torch metadata nor storages: not carried into outputs."""
        records = self.records
        joined = _joined(records)
        if joined is not None and joined.count("\0data/") + sum(n in records for n in _TORCH_NAMES) == len(records):
            return []  # every record is a storage or torch's (one count over the names: 200 000 of them)
        return _dropped_each(records)

    def notes(self) -> list[str]:
        """What a user should know about the input's records: the ones outputs leave out."""
        dropped = self.dropped
        if not dropped:
            return []
        shown = ", ".join(f"{self.archive_name}/{n}" for n in dropped[:3]) + (", ..." if len(dropped) > 3 else "")
        count = f"{len(dropped)} zip record" + ("s" if len(dropped) > 1 else "")
        return [f"not written to outputs ({count} torch never reads): {shown}"]


def _dropped_each(records: Collection[str]) -> list[str]:
    """:attr:`TorchZipArchive.dropped` name by name (the reference of its one-count test)."""
    return [name for name in records if name not in _TORCH_NAMES and not name.startswith("data/")]


def _refuse_wrapped(records: Mapping[str, ZipRecord], path: str) -> None:
    """A zip that carries a checkpoint file (a download bundle) rather than being one."""
    inside = [n for n in records if n.lower().endswith(CHECKPOINT_SUFFIXES)]
    if inside:
        raise BadInputError(f"{path}: a zip archive containing {inside[0]}: extract the checkpoint from it first")


def _joined(names: Collection[str]) -> str | None:
    """The names as one string, each after a NUL (``"\\0a\\0b"``): what the fast paths below ask
    their questions of, with a C loop each instead of a Python step per record (a training
    checkpoint has ~4 records per parameter). None when a name holds a NUL itself (the zip
    readers refuse those; any other mapping gets the per-name checks)."""
    joined = "\0" + "\0".join(names) if names else ""
    return joined if joined.count("\0") == len(names) else None


def _common_prefix(names: Collection[str]) -> tuple[str, str] | None:
    """``(top + "/", names joined as in _joined)`` when every name starts with the first name's
    top folder and a slash (torch's layout), else None."""
    joined = _joined(names)
    if not joined:
        return None
    top, slash, _ = next(iter(names)).partition("/")
    prefix = top + slash
    if not slash or joined.count("\0" + prefix) != len(names):  # a count of name starts
        return None
    return prefix, joined


def split_archive_names(records: ZipDirectory, path: str) -> ZipDirectory:
    """Strip the single top folder torch puts every record in; refuse other layouts."""
    common = _common_prefix(records)
    if common is not None:  # the usual layout: every name under one top folder
        prefix, joined = common
        # cutting one common prefix keeps the names unique (the readers refused clashes)
        return records.with_names(joined.replace("\0" + prefix, "\0")[1:].split("\0"), unique=True)
    return _split_each(records, path)


def _split_each(records: ZipDirectory, path: str) -> ZipDirectory:
    """:func:`split_archive_names` name by name: the reference of its one-prefix test."""
    tops = {name.split("/", 1)[0] for name in records}
    if len(tops) != 1 or any("/" not in name for name in records):
        _refuse_wrapped(records, path)
        raise BadInputError(f"{path}: a zip archive, but not a torch checkpoint (no single top folder)")
    return records.renamed(lambda name: name.split("/", 1)[1])


def check_record_names(records: Mapping[str, ZipRecord], path: str) -> None:
    """Refuse names by which torch and ckptfix would read different records.

    torch's zip reader (miniz) finds names ignoring case: an ``archive/BYTEORDER`` is the byte
    order to torch but an unknown record to a case-sensitive reader. And a second pickle
    (``extra.pkl``, ``data.PKL``) is never loaded by torch but may be by other tools, so it
    must not ride along unchecked. TorchScript archives and zips that hold no data.pkl are left
    to their own readers (ours refuses them with a clearer message).
    """
    if not _names_pass(records):
        _check_names_each(records, path)


def _check_names_each(records: Mapping[str, ZipRecord], path: str) -> None:
    """:func:`check_record_names` name by name: the reference, and what decides (and says why)
    wherever the all-at-once test :func:`_names_pass` does not pass."""
    relative = {name: name.split("/", 1)[-1] for name in records}
    torchscript = "constants.pkl" in relative.values() or any(n.startswith("code/") for n in relative.values())
    if torchscript or "data.pkl" not in {name.lower() for name in relative.values()}:
        return
    for full, name in relative.items():
        lower = name.lower()
        if lower.endswith(".pkl") and lower != "data.pkl":
            raise BadInputError(
                f"{path}: record {full!r} is a second pickle besides data.pkl: torch never loads it, other "
                "tools might, and ckptfix will not carry it unchecked; refusing"
            )
        if name != lower and (lower in _TORCH_NAMES or lower.startswith(("data/", ".data/"))):
            raise BadInputError(
                f"{path}: record {full!r} is torch's {lower!r} in other case: torch's zip reader ignores case "
                "and would read it, a case-sensitive reader would not; refusing"
            )


def _names_pass(records: Collection[str]) -> bool:
    """True when :func:`check_record_names` finds nothing to refuse, asked of all the names at
    once (C loops over one joined string); False when it must look name by name (it then
    refuses, or the layout is not the usual one: the per-name loop decides, as it always did)."""
    if not records:
        return True  # no data.pkl: left to the readers
    common = _common_prefix(records)
    if common is None:
        return False
    prefix, joined = common
    relative = joined.replace("\0" + prefix, "\0") + "\0"  # "\0name\0name\0", top folder cut
    if "\0constants.pkl\0" in relative or "\0code/" in relative:
        return True  # TorchScript: left to its reader
    if not relative.isascii():
        return False  # str.lower() of non-ASCII text: the per-name loop
    lower = relative.lower()
    if "\0data.pkl\0" not in lower:
        return True  # no data.pkl: left to the readers
    # no name in other case, and no pickle but data.pkl ("\0data.pkl\0" counted without overlap:
    # two data.pkl names in a row count once, and the per-name loop then looks)
    return lower == relative and lower.count(".pkl\0") == lower.count("\0data.pkl\0")


def read_checked_directory(f: BinaryIO, file_size: int, path: str) -> ZipDirectory:
    """The archive's records by full name, once the container (``read_directory``) and the
    names (``check_record_names``) pass: what both the reader and ``scan`` look at."""
    records = read_directory(f, file_size, path)
    check_record_names(records, path)
    return records


def _read_versions(f: BinaryIO, records: Mapping[str, ZipRecord], path: str) -> dict[str, bytes]:
    """The version records' values, checked to be the small number torch writes there."""
    versions = {}
    for name in _VERSION_RECORDS:
        if name in records:
            value = read_record_bytes(f, records[name], 16, path)
            if not _VERSION.fullmatch(value):
                raise BadInputError(f"{path}: record {name} holds {value[:16]!r}, not a version number")
            versions[name] = value
    # torch reads .data/version where there is one, else version (caffe2 inline_container.cc),
    # and refuses a value outside its range: carried into an output, torch could not load it
    if versions:
        effective = int(versions.get(".data/version", versions.get("version", b"3")))
        if not MIN_VERSION <= effective <= MAX_VERSION:
            raise BadInputError(
                f"{path}: serialization version {effective}, which torch refuses (it reads versions "
                f"{MIN_VERSION} to {MAX_VERSION}): not a file torch.load can read"
            )
    return versions


class _ZipStorages:
    """The storage of each persistent id: its ``data/<key>`` record, checked as torch checks it.

    Called per persistent id (the Python VM; the reference), or asked for all of them at once
    (:meth:`many`: the native VM's columns), with the same result: the record must exist and
    hold exactly the bytes the id declares, and as in torch's ``loaded_storages`` the first use
    of a key decides what later uses get, unless its storage is empty.
    """

    def __init__(self, records: ZipDirectory, path: str, base: int, order: str) -> None:
        self.records, self.path, self.base, self.order = records, path, base, order
        self.storages: dict[str, StorageRef] = {}
        #: see :class:`~ckptfix.pickling.native_tree.BulkStorageLoader`
        self.extents_checked = False

    def __call__(self, storage_type: Global, key: str, location: str, numel: int, view: Any) -> StorageRef:
        path, storages = self.path, self.storages
        if key in storages:
            return storages[key]
        record = self.records.get(f"data/{key}")
        if view is not None:
            raise BadInputError(f"{path}: corrupt pickle: a storage view in a zip checkpoint")
        if record is None:
            raise BadInputError(f"{path}: storage {key!r} is referenced but its record data/{key} is missing")
        storage = make_storage(storage_type, key, location, numel, record.source(path, self.base), self.order)
        if record.size != storage.nbytes:  # torch.load: "record size ... does not match expected size"
            raise BadInputError(
                f"{path}: storage data/{key} holds {record.size} bytes but the checkpoint "
                f"declares {storage.nbytes}: the file is truncated or corrupt (torch refuses it too)"
            )
        if storage.nbytes:  # as torch's loaded_storages: the first use decides, unless it is empty
            storages[key] = storage
        return storage

    def many(
        self, globals_: list[Global], kinds: list[int], keys: list[str], locations: list[str], numels: list[int]
    ) -> tuple[list[StorageRef], array[int]] | None:
        """Every persistent id's storage at once, in C loops over the columns (no Python call per
        storage but the records' own constructors), and each one's size in bytes; None where
        calling :meth:`__call__` per id must decide: a record missing, compressed or of another
        size, a storage class without a dtype, a key used with two classes -- the per-id calls
        then raise the reference's error, or (a later use of a key declaring another size,
        which torch ignores too) give the reference's result."""
        if not keys:
            return [], array("q")
        built = self._many_native(globals_, kinds, keys, locations, numels)
        if built is not None:
            return built
        names = list(map("data/".__add__, keys))
        columns = self.records.columns()
        start = self.records.rows(names[:1])[0]
        offsets: Iterable[int]
        crcs: Iterable[int]
        if start is not None and columns.names[start : start + len(names)] == names:
            # torch.save's layout: one record per key, in the order the pickle first names them
            # (the names are unique, so these are the rows a lookup per name would find)
            span = slice(start, start + len(names))
            sizes, compressed = columns.size[span].tolist(), any(columns.method[span])
            offsets, crcs = columns.data_offset[span], columns.crc[span]
        else:
            found = self.records.rows(names)
            if None in found:
                return None  # "storage ... is referenced but its record data/... is missing"
            rows = cast("list[int]", found)
            sizes, compressed = list(map(columns.size.__getitem__, rows)), any(map(columns.method.__getitem__, rows))
            offsets, crcs = map(columns.data_offset.__getitem__, rows), map(columns.crc.__getitem__, rows)
        del names
        if compressed:
            return None  # a compressed storage: its inflation is checked per record
        dtypes = [STORAGE_DTYPE.get(g.name) for g in globals_]  # as make_storage finds them
        itemsizes = [DTYPE_ITEMSIZE[d] if d else 0 for d in dtypes]
        if not all(map(itemsizes.__getitem__, set(kinds))):
            return None  # make_storage's "unknown storage type"
        if list(map(mul, numels, map(itemsizes.__getitem__, kinds))) != sizes:
            return None  # "holds N bytes but the checkpoint declares M"
        unique = len(set(keys))
        if unique != len(keys) and len(set(zip(keys, kinds))) != unique:
            return None  # one key, two storage classes: the first use decides the dtype
        path, base, order = self.path, self.base, self.order
        made = [
            StorageRef(key, globals_[kind], location, numel, itemsizes[kind], dtypes[kind], source, order)  # type: ignore[arg-type]
            for key, kind, location, numel, source in zip(
                keys,
                kinds,
                locations,
                numels,
                map(FileRange, repeat(path), map(add, repeat(base), offsets), sizes, crcs),
            )
        ]
        if unique != len(keys):  # the first use of a key decides, unless its storage is empty
            first = dict(zip(reversed(keys), reversed(made)))
            made = [first[key] if size else storage for key, size, storage in zip(keys, sizes, made)]
        return made, array("q", sizes)

    def _many_native(
        self, globals_: list[Global], kinds: list[int], keys: list[str], locations: list[str], numels: list[int]
    ) -> tuple[list[StorageRef], array[int]] | None:
        """:meth:`many` for torch.save's layout (storage ``i`` is the record after storage
        ``i - 1``'s, named ``data/<key>``, stored, of the declared size), its records built by
        the library without a Python call per storage (``native/src/vm_records.rs``: the same
        objects as :meth:`many`'s comprehension makes); None where it leaves :meth:`many` to
        decide (another layout, a compressed or wrongly sized record, no library)."""
        start = self.records.rows(["data/" + keys[0]])[0]
        if start is None:
            return None
        columns = self.records.columns()
        dtypes = [STORAGE_DTYPE.get(g.name) for g in globals_]  # as make_storage finds them
        itemsizes = [DTYPE_ITEMSIZE[d] if d else 0 for d in dtypes]
        return native_records.storages(
            StorageRef,
            FileRange,
            (kinds, keys, locations, numels),
            (globals_, itemsizes, dtypes),
            columns.names,
            start,
            (columns.size, columns.data_offset, columns.crc, columns.method),
            self.path,
            self.base,
            self.order,
        )


def read_torch_zip(
    path: str,
    f: BinaryIO,
    file_size: int,
    globals_seen: set[str],
    allow: Sequence[str] = (),
    *,
    inert_unknown: bool = False,
) -> tuple[Any, TorchZipArchive]:
    """Parse a torch zip checkpoint into a tree of lazy references (no tensor data is read).

    ``f`` may be a :class:`~ckptfix.fileio.ranges.FileSlice` (a zip inside ``path``): storages
    then point at their bytes in ``path`` itself."""
    steady_heap()
    base = f.base if isinstance(f, FileSlice) else 0
    raw = read_checked_directory(f, file_size, path)
    if not raw:
        raise BadInputError(f"{path}: an empty zip archive, not a checkpoint")
    archive_name = next(iter(raw)).split("/", 1)[0]
    records = split_archive_names(raw, path)
    joined = _joined(records)
    code = "\0code/" in joined if joined is not None else any(n.startswith("code/") for n in records)
    if "constants.pkl" in records or code:
        raise BadInputError(
            f"{path}: this is a TorchScript archive (a scripted/traced module), not a "
            "checkpoint; load it with torch.jit.load(), and use module.state_dict() to get weights"
        )
    if "data.pkl" not in records:
        _refuse_wrapped(raw, path)
        raise BadInputError(f"{path}: a zip archive without data.pkl: not a torch checkpoint")
    del raw  # the names with their top folder: 70 bytes a record, not needed again
    record = records["data.pkl"]
    # a compressed data.pkl is bounded by what it was compressed from, not what it claims:
    # pickles compress 3-6x; a few KB that inflate to a gigabyte of EMPTY_LIST are a bomb
    packed = record.method != STORED
    limit = min(MAX_PICKLE_BYTES, PICKLE_RATIO * record.compressed_size + (1 << 20)) if packed else MAX_PICKLE_BYTES
    pickle_bytes = read_record_bytes(f, record, limit, path)
    budgets = Budgets.for_length(min(len(pickle_bytes), PICKLE_RATIO * record.compressed_size)) if packed else None
    byteorder = None
    if "byteorder" in records:
        byteorder = read_record_bytes(f, records["byteorder"], 16, path)
        if byteorder not in (b"little", b"big"):
            raise BadInputError(f"{path}: unknown byte order {byteorder[:16]!r}")
    order = (byteorder or b"little").decode()
    versions = _read_versions(f, records, path)

    load_storage = _ZipStorages(records, path, base, order)
    try:
        root, _ = restricted_load(
            pickle_bytes,
            load_storage,
            globals_seen,
            allow,
            check_depth=False,
            budgets=budgets,
            inert_unknown=inert_unknown,
        )
    except UnsafeInputError as exc:
        raise exc.at(path) from None
    if not load_storage.extents_checked:  # the native pass found every extent fine, or Python looks
        check_extents(root, path)
    del pickle_bytes, load_storage
    release_freed_memory()
    return root, TorchZipArchive(path, archive_name, records, byteorder, versions)


def _serialization_id(crcs: array[int], total: int) -> bytes:
    """A 40-digit id like torch's: derived from the records written, so equal files match.
    ``crcs``: an ``array("I")``, hashed as little-endian 4-byte words (= chaining crc32 over
    each CRC's 4 bytes)."""
    if sys.byteorder != "little":
        crcs = array("I", crcs)
        crcs.byteswap()
    combined = crc32(crcs)
    return f"{total % 10**20:020d}{combined:020d}".encode()


def write_torch_zip(
    root: Any,
    out: BinaryIO,
    *,
    archive_name: str = "archive",
    source: TorchZipArchive | None = None,
    progress: Callable[[int], None] | None = None,
    zip64_threshold: int | None = None,
    embedded: bool = False,
    files: OpenFiles | None = None,
) -> list[StorageRef]:
    """Write ``root`` as a torch zip checkpoint into the open file ``out``.

    Storage bytes are copied from wherever the tree's :class:`StorageRef` s point (a zip
    record, a safetensors range, a legacy storage), cut down to the span tensors still use.
    ``source`` supplies the input's checked version records (nothing else is carried over: see
    :class:`TorchZipArchive`). All storages must share one
    byte order, which is recorded.
    Returns the storages written, in key order; ``progress`` gets each storage's byte count.

    Big storages copied unchanged are padded to share blocks with their source (see
    :func:`~ckptfix.fileio.ziparchive.shares_blocks`). Such a file no longer has miniz's exact
    layout, which torch's opt-in ``calculate_storage_offsets`` loader assumes: it would read
    wrong bytes, silently. That loader runs only for files that say ``.format_version`` >= 1,
    so those files leave the record out, as older torch versions did (nothing else reads it).

    ``embedded``: the archive is one item among others in ``out`` (a DCP ``.distcp`` file), its
    offsets counted from where it starts. ``files``: the caller's open inputs, for many small
    archives written from the same files.
    """
    pickled = pickle_compacted(root)
    release_freed_memory()  # the emitter's arrays, freed: before the directory's columns grow
    data, storages = pickled.data, pickled.storages
    del pickled  # ``data`` goes once written: the rest of the write does not hold it
    every = [s.source for s in storages]
    # the first storage with no bytes: the ones before it are written, then it is refused
    # (found by identity: ``None in every`` would call each source's __eq__)
    missing = next(compress(count(), map(is_, every, repeat(None))), None)
    sources = cast("list[Source]", every if missing is None else every[:missing])
    orders = set(map(attrgetter("byteorder"), storages))
    if len(orders) > 1:
        raise BadInputError("cannot write storages of both byte orders into one checkpoint")
    byteorder = orders.pop() if orders else "little"
    threshold = {"zip64_threshold": zip64_threshold} if zip64_threshold else {}
    writer = ZipWriter(out, archive_name, embedded=embedded, **threshold)
    crcs = array("I", [writer.add_bytes("data.pkl", data)])
    del data
    sizes = list(map(attrgetter("size"), sources))
    # only big records can share blocks: the others are not asked
    if not any(shares_blocks(s) for s, size in zip(sources, sizes) if size >= SMALL_COPY):
        crcs.append(writer.add_bytes(".format_version", b"1"))
    crcs.append(writer.add_bytes(".storage_alignment", b"64"))
    if source is None or source.byteorder is not None or byteorder != "little":
        crcs.append(writer.add_bytes("byteorder", byteorder.encode()))
    with contextlib.ExitStack() as stack:
        if files is None:
            files = stack.enter_context(OpenFiles())
        if _may_be_remote(sources):
            files.plan(sources)  # a remote input: fetched ahead, in this order
        writer.reserve(sum(sizes))  # a lower bound of what follows (the data, without headers)
        writer.add_copies(NumberedNames("data/", range(len(sources))), sources, files, progress, into=crcs)
        if missing is not None:
            raise BadInputError(f"storage {storages[missing].key!r} has no source bytes to copy")
        versions = source.versions if source else {}
        if "version" not in versions:
            crcs.append(writer.add_bytes("version", b"3\n"))
        for name, value in versions.items():
            crcs.append(writer.add_bytes(name, value))
        writer.add_bytes(".data/serialization_id", _serialization_id(crcs, sum(sizes)))
        writer.close()
    return storages


def _may_be_remote(sources: list[Source]) -> bool:
    """Whether any of ``sources`` is a range of a remote object (what :meth:`OpenFiles.plan`
    fetches ahead): one question per distinct file, not per storage."""
    return any(map(is_url, {s.path for s in sources if isinstance(s, FileRange)}))
