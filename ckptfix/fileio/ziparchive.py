"""Reading and writing the zip container that ``torch.save`` uses, by byte offsets.

Why our own zip code instead of :mod:`zipfile`:

* files saved after ``torch.serialization.set_crc32_options(False)`` carry CRC 0, and
  :mod:`zipfile` refuses to read them; torch itself does not check CRCs;
* tensor records are copied into the output without ever being read into Python, so all we
  need from a record is *where its bytes are*;
* the writer mirrors torch's own (miniz) layout -- 64-byte aligned records padded with an
  ``FB`` extra field, a data descriptor after each record, zip64 end records -- so
  ``torch.load(mmap=True)`` accepts it; byte for byte, so torch's ``calculate_storage_offsets``
  loader does too, except that a big record copied unchanged from a 64-aligned place is padded
  further, to sit at the same offset modulo 4096 as in its source: a copy-on-write file system
  can then share its blocks instead of copying them (see :func:`shares_blocks`).
"""

from __future__ import annotations

import io
import re
import struct
from array import array
from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate, chain, groupby
from typing import TYPE_CHECKING, BinaryIO, NamedTuple, TypeGuard, cast, overload

from ..errors import BadInputError
from ..native import zip as native_zip
from ..native import zipsources as native_sources
from ..native.crc import crc32
from .deferred import VIRTUAL
from .ranges import (
    BLOCK,
    SMALL_COPY,
    ComputedSource,
    FileRange,
    FileSlice,
    OpenFiles,
    OutputStream,
    RangeSource,
    WindowedReader,
    inflate_chunks,
    is_local_range,
    is_plain_range,
)
from .urls import is_url

if TYPE_CHECKING:  # imported when a worker is first needed: concurrent.futures imports logging (~7 ms)
    from concurrent.futures import Future

_LOCAL_SIG = b"PK\x03\x04"
_CENTRAL_SIG = b"PK\x01\x02"
_EOCD_SIG = b"PK\x05\x06"
_EOCD64_SIG = b"PK\x06\x06"
_EOCD64_LOCATOR_SIG = b"PK\x06\x07"
_DESCRIPTOR_SIG = b"PK\x07\x08"
_U32_MAX = 0xFFFFFFFF
_U16_MAX = 0xFFFF
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
_CENTRAL_HEADER = struct.Struct("<4sHHHHHHIIIHHHHHII")
_EOCD = struct.Struct("<4sHHHHIIH")
_EOCD64 = struct.Struct("<4sQHHIIQQQQ")
_EOCD64_LOCATOR = struct.Struct("<4sIQI")

#: Alignment torch uses for record data (``.storage_alignment``), needed for mmap loading.
RECORD_ALIGNMENT = 64
#: Compression methods we can read: stored (what torch writes) and deflate (re-zipped files).
STORED, DEFLATED = 0, 8
#: Deflate emits at least 2 bits per 258-byte match, so no deflate stream inflates to more than
#: ~1032x its own size: a record declaring more is lying about its size (a bomb or corruption).
MAX_DEFLATE_RATIO = 1032
#: General-purpose flag bits: encrypted (0, 6, 13: we cannot read it; miniz refuses it too), and
#: "sizes and CRC follow the data" (3: the local header's own are then zero, not comparable).
_ENCRYPTED_FLAGS = 0x0001 | 0x0040 | 0x2000
_DATA_DESCRIPTOR_FLAG = 0x0008
_ZIP64_EXTRA = 0x0001


@dataclass(slots=True)
class ZipRecord:
    """One member of the archive: its name and where its (possibly compressed) bytes are.

    ``header_offset`` is where its local header starts; the record owns the bytes from there
    to ``data_offset + compressed_size``, and no other record may own any of them.
    """

    name: str
    data_offset: int
    compressed_size: int
    size: int
    method: int
    crc: int
    header_offset: int

    def source(self, path: str, base: int = 0) -> FileRange:
        """The record's bytes as a :class:`FileRange` of the archive file ``path`` (whose zip
        starts at ``base``: a zip stored inside another file); a deflated record must pass
        :func:`check_inflation` first."""
        deflated = self.compressed_size if self.method == DEFLATED else None
        if deflated is not None:
            check_inflation(self, path)
        return FileRange(path, base + self.data_offset, self.size, self.crc, deflated)


@dataclass(frozen=True)
class _End:
    """Where the central directory is, as the end records say (zip64 values already applied)."""

    count: int
    cd_offset: int
    cd_size: int


class _Entry(NamedTuple):
    """One central directory entry, fields as stored (zip64 values already applied).

    A named tuple: a training checkpoint's directory has ~4 entries per parameter."""

    raw_name: bytes
    flags: int
    method: int
    crc: int
    compressed_size: int
    size: int
    header_offset: int


def read_directory(f: BinaryIO, file_size: int, path: str) -> ZipDirectory:
    """Return the archive's records by name, reading only the central directory and headers.

    Every offset and size is checked against the file size, so a truncated or hostile file
    fails here with :class:`BadInputError` instead of later with a short read. Beyond that the
    directory must be one that every zip reader sees the same way -- torch's miniz, Python's
    :mod:`zipfile` and ours -- since a checkpoint we vetted must be the one torch then loads:

    * names are valid UTF-8 paths, unique even ignoring case (miniz looks names up ignoring
      case, so of ``data.pkl`` and ``data.PKL`` it might load the one we did not check);
    * the end records agree with each other and the directory fills exactly the space they
      give it (miniz trusts the entry count, :mod:`zipfile` the directory size);
    * each local header agrees with its directory entry on name, method and (when stated)
      sizes and CRC, and no two records share a byte (overlapping records are how zip bombs
      and "different file in every tool" archives are built);
    * a compressed record declares no more than deflate could produce from its bytes.

    The native engine (native/src/zip.rs) runs the same checks on a local file, in the same
    order, with the same messages; :func:`read_directory_python` is the reference it is
    tested against, and what runs when it is not loaded or leaves the archive to it.
    """
    columns = _read_directory_native(f, file_size, path)
    if columns is not None:
        return ZipDirectory.adopt(columns)
    return read_directory_python(f, file_size, path)


def _read_directory_native(f: BinaryIO, file_size: int, path: str) -> native_zip.Columns | None:
    """The native reader's columns for a local file (a remote one's reads are planned by
    :func:`_plan_remote_reads`, in Python), or None for the Python engine."""
    limit: int | None
    if isinstance(f, FileSlice) and f.source is None:
        base, limit = f.base, f.size
    elif isinstance(f, (io.BufferedReader, io.FileIO)):
        base, limit = 0, None
    else:
        return None
    try:
        return native_zip.read_directory(f.fileno(), base, file_size, limit)
    except BadInputError as exc:
        raise BadInputError(f"{path}: {exc.message}") from None


def read_directory_python(f: BinaryIO, file_size: int, path: str) -> ZipDirectory:
    """:func:`read_directory` in Python: the reference engine."""
    end = _read_end(f, file_size, path)
    f.seek(end.cd_offset)
    entries = _parse_central_directory(f.read(end.cd_size), end.count, path)
    names = [_checked_name(entry.raw_name, path) for entry in entries]
    _refuse_name_clashes(names, path)
    records = ZipDirectory()
    view = WindowedReader.over(f)
    deferred = _deferred_records(f, names, entries)
    for name, entry in zip(names, entries):
        _check_entry(entry, name, path)
        if name in deferred:  # see _deferred_records: its header is read with its data
            data_offset = VIRTUAL + entry.header_offset
        else:
            data_offset = _check_local_header(view, entry, name, file_size, path)
            if data_offset + entry.compressed_size > end.cd_offset:
                raise BadInputError(
                    f"{path}: record {name!r} extends past the end of its data: the file is truncated or corrupt"
                )
        records.add(name, data_offset, entry.compressed_size, entry.size, entry.method, entry.crc, entry.header_offset)
    _refuse_overlaps(records, path)
    if deferred:
        cast(RangeSource, f).defer(_DeferredHeaders(records, end.cd_offset, file_size, path))
    return records


def _deferred_records(f: BinaryIO, names: list[str], entries: list[_Entry]) -> frozenset[str]:
    """For a remote archive, the records whose local headers are not read now.

    A local header says where the record's data starts (its extra field's length is not in the
    directory), so a reader of a local file checks every header up front. Remotely that is a
    request per record: a training checkpoint has ~4 records per parameter. Tensor records
    (``*/data/*``; a record named .pkl in any case is read, as scan reads every one) are
    therefore addressed from :data:`~ckptfix.fileio.ranges.VIRTUAL` until their data is
    read: the remote file then fetches ``[local header, next record)`` in the same coalesced
    ranged reads as the data, and checks the header (:class:`_DeferredHeaders`) before any of
    the data is used. Reading only metadata (``inspect``, ``scan``), they are never read at all.
    The other records' headers are fetched ahead (coalesced, concurrent) and checked now."""
    if not isinstance(f, RangeSource):
        return frozenset()
    if not f.defers:  # outside a command: no later open would find them (see RemoteFile.defers)
        f.prefetch([(e.header_offset, _LOCAL_HEADER.size + len(e.raw_name)) for e in entries])
        return frozenset()
    deferred = frozenset(name for name in names if _tensor_record(name) and not name.lower().endswith(".pkl"))
    f.prefetch(
        [(e.header_offset, _LOCAL_HEADER.size + len(e.raw_name)) for n, e in zip(names, entries) if n not in deferred]
    )
    return deferred


class _DeferredHeaders:
    """The tensor records of a remote archive whose local headers are checked when their data
    is read (see :func:`_deferred_records`, :class:`~ckptfix.fileio.ranges.DeferredRecords`).

    Every record is sorted by header offset here, so each deferred one knows the next record's
    start: its header and data must end before it, which with :func:`_refuse_overlaps` (run on
    the least extent of each deferred record) is the same no-shared-byte rule a local archive
    is held to, and with the same messages."""

    def __init__(self, records: ZipDirectory, cd_offset: int, file_size: int, path: str) -> None:
        order = sorted(range(len(records)), key=records._header_offset.__getitem__)
        self._records = records
        self._names = list(records)
        self._sorted = array("q", order)  # rows of ``records`` by header offset
        self._starts = array("q", (records._header_offset[i] for i in order))
        self._cd_offset, self._file_size, self._path = cd_offset, file_size, path

    def find(self, offset: int) -> tuple[int, int]:
        import bisect

        at = offset - VIRTUAL
        index = bisect.bisect_right(self._starts, at) - 1
        row = self._sorted[index] if index >= 0 else -1
        records = self._records
        if row < 0 or records._data_offset[row] < VIRTUAL or at - self._starts[index] > records._compressed_size[row]:
            raise RuntimeError(f"{self._path}: a read at no record's data ({at})")
        return index, at - self._starts[index]

    def span(self, index: int) -> tuple[int, int, int]:
        row = self._sorted[index]
        head = _LOCAL_HEADER.size + len(self._names[row].encode())
        return self._starts[index], head, self._next_start(index)

    def _next_start(self, index: int) -> int:
        return self._starts[index + 1] if index + 1 < len(self._starts) else self._cd_offset

    def resolve(self, index: int, read: Callable[[int, int], bytes]) -> int:
        row = self._sorted[index]
        name, r = self._names[row], self._records
        entry = _Entry(
            name.encode(), 0, r._method[row], r._crc[row], r._compressed_size[row], r._size[row], r._header_offset[row]
        )
        data_offset = _check_local_header(_Reads(read), entry, name, self._file_size, self._path)
        end = data_offset + entry.compressed_size
        if end > self._cd_offset:
            raise BadInputError(
                f"{self._path}: record {name!r} extends past the end of its data: the file is truncated or corrupt"
            )
        if end > self._next_start(index):
            following = self._names[self._sorted[index + 1]]
            raise BadInputError(_overlap_message(self._path, name, following))
        return data_offset


@dataclass(frozen=True)
class _Reads:
    """``read(offset, size)`` as the object :func:`_check_local_header` reads through."""

    read: Callable[[int, int], bytes]


def _tensor_record(name: str) -> bool:
    """``<archive>/data/<key>``: where torch keeps storage bytes."""
    return name.split("/")[1:2] == ["data"] and name.count("/") >= 2


#: name lookups a directory answers by scanning its names before it builds a dict (see below)
_SCANS = 16


class ZipDirectory(Mapping[str, ZipRecord]):
    """The archive's records by name, stored as columns: a training checkpoint has ~4 records
    per parameter, and a :class:`ZipRecord` object each cost ~500 bytes (measured: 107 MiB for
    200 000 records). Here a record costs its name, a list slot and 37 bytes of arrays; the
    :class:`ZipRecord` is made when asked for (the reader asks once per storage).

    The names are a list in row order; the name -> row dict is built only once a reader looks
    up more than a few names (:data:`_SCANS`). The native reader's directory and its renamed
    copies are asked a handful of names (``data.pkl``, ``byteorder``, the first storage's
    record), and a dict of 200 000 fresh strings cost ~0.05 s each time it was built (two per
    read), 0.7 s at 1 M records, where its inserts miss the caches (bench/RESULTS.md "Native
    core, slice 3: reader"); a list scan is a C loop over pointers that mostly compares lengths.
    """

    def __init__(self) -> None:
        self._names: list[str] = []
        #: name -> row, once built (see the class); ``add`` keeps it
        self._index: dict[str, int] | None = {}
        #: lookups answered by scanning the names (the dict is built after :data:`_SCANS`)
        self._scans = 0
        self._data_offset = array("q")
        self._compressed_size = array("q")
        self._size = array("q")
        self._header_offset = array("q")
        self._crc = array("I")  # CRC-32: 4 bytes
        self._method = array("B")

    def add(
        self, name: str, data_offset: int, compressed_size: int, size: int, method: int, crc: int, header_offset: int
    ) -> None:
        index = self._lookup()
        if name in index:  # as a dict assignment did: the name's row is the new record's
            raise ValueError(f"zip record {name!r} added twice")
        index[name] = len(self._names)
        self._names.append(name)
        self._data_offset.append(data_offset)
        self._compressed_size.append(compressed_size)
        self._size.append(size)
        self._method.append(method)
        self._crc.append(crc)
        self._header_offset.append(header_offset)

    @classmethod
    def adopt(cls, columns: native_zip.Columns) -> ZipDirectory:
        """The native reader's columns as a directory (no object per record is made, and no
        dict until one is needed: the names are unique, checked by the reader)."""
        return cls._with(columns.names, None, columns)

    @classmethod
    def _with(cls, names: list[str], index: dict[str, int] | None, columns: Sequence[object]) -> ZipDirectory:
        records = cls.__new__(cls)
        records._names, records._index, records._scans = names, index, 0
        (
            records._data_offset,
            records._compressed_size,
            records._size,
            records._header_offset,
            records._crc,
            records._method,
        ) = cast("tuple[array[int], ...]", columns[1:])
        return records

    def _lookup(self) -> dict[str, int]:
        """The name -> row dict, built on first need."""
        if self._index is None:
            self._index = dict(zip(self._names, range(len(self._names))))
        return self._index

    def _row(self, name: object) -> int | None:
        """The row of ``name`` (None if absent): a dict lookup, or a scan of the names while
        few have been asked."""
        if self._index is not None or self._scans >= _SCANS:
            return self._lookup().get(cast(str, name))
        hash(name)  # an unhashable key fails as a dict lookup would
        self._scans += 1
        try:
            return self._names.index(cast(str, name))
        except ValueError:
            return None

    def columns(self) -> native_zip.Columns:
        """The records as columns, in directory order (what the differential tests compare)."""
        return native_zip.Columns(
            self._names,
            self._data_offset,
            self._compressed_size,
            self._size,
            self._header_offset,
            self._crc,
            self._method,
        )

    def renamed(self, rename: Callable[[str], str]) -> ZipDirectory:
        """The same records under new names (sharing the columns); names must stay unique."""
        return self.with_names([rename(name) for name in self._names])

    def rows(self, names: Iterable[str]) -> list[int | None]:
        """Each name's row in :meth:`columns` (None where there is no such record), looked up
        in one C loop: the reader resolves 200 000 storages at once."""
        names = names if isinstance(names, list) else list(names)
        if len(names) <= 1:
            return [self._row(name) for name in names]
        return list(map(self._lookup().get, names))

    def with_names(self, names: list[str], *, unique: bool = False) -> ZipDirectory:
        """The same records under ``names`` (one per record, in directory order), sharing the
        columns. ``unique``: the caller knows the names are unique (a bijection of names that
        were: :func:`~ckptfix.formats.torchzip.split_archive_names` cutting one common
        prefix), so no dict is built to check it; otherwise they are checked."""
        if len(names) != len(self._names):
            raise ValueError("renaming made two records share a name")
        index = None
        if not unique:
            index = dict(zip(names, range(len(names))))
            if len(index) != len(names):
                raise ValueError("renaming made two records share a name")
        return ZipDirectory._with(names, index, self.columns())

    def __getitem__(self, name: str) -> ZipRecord:
        i = self._row(name)
        if i is None:
            raise KeyError(name)
        return ZipRecord(
            name,
            self._data_offset[i],
            self._compressed_size[i],
            self._size[i],
            self._method[i],
            self._crc[i],
            self._header_offset[i],
        )

    def __contains__(self, name: object) -> bool:
        return self._row(name) is not None

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def spans(self) -> Iterator[tuple[int, int, str]]:
        """(first byte, one past the last, name) of each record, local header included; for a
        record whose header is not read yet (:class:`_DeferredHeaders`), its least extent."""
        for i, name in enumerate(self._names):
            if self._data_offset[i] >= VIRTUAL:  # a remote record whose header is read with its data
                yield self._header_offset[i], self._header_offset[i] + _LOCAL_HEADER.size + len(name.encode()), name
            else:
                yield self._header_offset[i], self._data_offset[i] + self._compressed_size[i], name


#: the tail read first for the end records (a remote item's tail is fetched ahead this long)
_SHORT_TAIL = 4096 + 22


def _read_end(f: BinaryIO, file_size: int, path: str) -> _End:
    """The end of central directory record (and its zip64 twin), checked for consistency.

    The directory must end exactly where the end records begin: data before the archive or
    between its parts is where readers disagree (:mod:`zipfile` shifts every offset by such a
    prefix, newer miniz versions too, we do not).
    """
    # the last 4 KiB first (an archive without a comment, as torch writes them, ends there; a
    # signature found there is also the last in the longest tail), then as far as a comment reaches
    for tail_len in dict.fromkeys((min(file_size, _SHORT_TAIL), min(file_size, 22 + _U16_MAX))):
        f.seek(file_size - tail_len)
        tail = f.read(tail_len)
        pos = tail.rfind(_EOCD_SIG)
        if pos >= 0:
            break
    if pos < 0 or pos + _EOCD.size > len(tail):
        raise BadInputError(
            f"{path}: the zip directory at the end of the file is missing: the file is "
            "truncated (an interrupted download or copy?)"
        )
    (_, disk, cd_disk, disk_count, count, cd_size, cd_offset, _) = _EOCD.unpack_from(tail, pos)
    eocd_at = file_size - tail_len + pos
    if disk or cd_disk or disk_count != count:
        raise BadInputError(f"{path}: a multi-disk (split) zip archive; join its parts first")
    zip64 = _read_zip64_end(f, eocd_at, path)
    directory_end = eocd_at
    if zip64 is None:
        if count == _U16_MAX or cd_size == _U32_MAX or cd_offset == _U32_MAX:
            raise BadInputError(f"{path}: corrupt zip64 directory (its locator is missing)")
    else:
        wide, directory_end = zip64
        for classic, value, sentinel in (
            (count, wide.count, _U16_MAX),
            (cd_size, wide.cd_size, _U32_MAX),
            (cd_offset, wide.cd_offset, _U32_MAX),
        ):
            if classic not in (sentinel, value):
                raise BadInputError(
                    f"{path}: the zip64 end record and the classic one describe different directories "
                    "(zip readers would disagree on the records); refusing"
                )
        count, cd_size, cd_offset = wide.count, wide.cd_size, wide.cd_offset
    if cd_offset + cd_size > directory_end:
        raise BadInputError(f"{path}: corrupt zip directory (offsets point outside the file)")
    if count * _CENTRAL_HEADER.size > cd_size:
        raise BadInputError(f"{path}: corrupt zip directory ({count} entries cannot fit in its {cd_size} bytes)")
    if cd_offset + cd_size != directory_end:
        raise BadInputError(
            f"{path}: {directory_end - cd_offset - cd_size} bytes the zip directory does not account for "
            "(data before the archive or between its directory and end record: zip readers disagree on "
            "where its records are); refusing"
        )
    return _End(count, cd_offset, cd_size)


def _read_zip64_end(f: BinaryIO, eocd_at: int, path: str) -> tuple[_End, int] | None:
    """The zip64 end record's values and offset, or None when there is no zip64 locator.

    miniz uses the zip64 record whenever the locator is there, :mod:`zipfile` reads it right
    before the locator whatever the locator says: so it must be exactly there.
    """
    loc_at = eocd_at - _EOCD64_LOCATOR.size
    if loc_at < 0:
        return None
    f.seek(loc_at)
    sig, locator_disk, eocd64_at, _ = _EOCD64_LOCATOR.unpack(f.read(_EOCD64_LOCATOR.size))
    if sig != _EOCD64_LOCATOR_SIG:
        return None
    if locator_disk or eocd64_at != loc_at - _EOCD64.size:
        raise BadInputError(f"{path}: corrupt zip64 directory locator")
    f.seek(eocd64_at)
    fields = _EOCD64.unpack(f.read(_EOCD64.size))
    if fields[0] != _EOCD64_SIG:
        raise BadInputError(f"{path}: corrupt zip64 end record")
    if fields[4] or fields[5] or fields[6] != fields[7]:
        raise BadInputError(f"{path}: a multi-disk (split) zip archive; join its parts first")
    return _End(fields[7], fields[9], fields[8]), eocd64_at


def _parse_central_directory(directory: bytes, count: int, path: str) -> list[_Entry]:
    """The ``count`` entries of the directory, which must fill it exactly.

    miniz reads ``count`` entries, :mod:`zipfile` reads entries until the bytes run out:
    a directory with more or fewer entries than declared shows each of them different files.
    """
    entries: list[_Entry] = []
    append = entries.append
    unpack = _CENTRAL_HEADER.unpack_from
    header_size = _CENTRAL_HEADER.size
    end = len(directory)
    at = 0
    for _ in range(count):
        if at + header_size > end or directory[at : at + 4] != _CENTRAL_SIG:
            raise BadInputError(f"{path}: corrupt zip directory entry")
        (_, _, _, flags, method, _, _, crc, csize, usize, name_len, extra_len, comment_len, _, _, _, header_offset) = (
            unpack(directory, at)
        )
        name_at = at + header_size
        at = name_at + name_len + extra_len + comment_len
        if at > end:
            raise BadInputError(f"{path}: corrupt zip directory entry (it runs past the directory)")
        raw_name = directory[name_at : name_at + name_len]
        if extra_len or _U32_MAX in (usize, csize, header_offset):
            extra = directory[name_at + name_len : name_at + name_len + extra_len]
            usize, csize, header_offset = _apply_zip64_extra(extra, usize, csize, header_offset, path, raw_name)
        append(_Entry(raw_name, flags, method, crc, csize, usize, header_offset))
    if at != len(directory):
        raise BadInputError(
            f"{path}: the zip directory holds more than the {count} entries its end record declares "
            "(zip readers would disagree on the records); refusing"
        )
    return entries


def _apply_zip64_extra(
    extra: bytes, usize: int, csize: int, offset: int, path: str, raw_name: bytes
) -> tuple[int, int, int]:
    """Replace the 0xFFFFFFFF placeholders with the zip64 extra field's values (in the order
    the format gives them); a placeholder without its value, or a malformed field, is refused."""
    if not extra and usize != _U32_MAX and csize != _U32_MAX and offset != _U32_MAX:
        return usize, csize, offset  # the usual directory entry: no extra block, nothing to replace
    placeholders = [usize == _U32_MAX, csize == _U32_MAX, offset == _U32_MAX]
    values = [usize, csize, offset]
    wide = next((body for tag, body in _extra_fields(extra, path, raw_name) if tag == _ZIP64_EXTRA), b"")
    given = [v for (v,) in struct.iter_unpack("<Q", wide[: len(wide) // 8 * 8])]
    if len(given) < sum(placeholders):
        raise BadInputError(f"{path}: record {_shown(raw_name)} lacks the zip64 sizes its directory entry announces")
    for i, placeholder in enumerate(placeholders):
        if placeholder:
            values[i] = given.pop(0)
    return values[0], values[1], values[2]


def _extra_fields(extra: bytes, path: str, raw_name: bytes) -> list[tuple[int, bytes]]:
    """The (tag, body) fields of an extra block; each must fit in the block (as zipfile requires)."""
    fields = []
    at = 0
    while at < len(extra):
        if at + 4 > len(extra):
            raise BadInputError(f"{path}: record {_shown(raw_name)} has a corrupt extra field")
        tag, size = struct.unpack_from("<HH", extra, at)
        if at + 4 + size > len(extra):
            raise BadInputError(f"{path}: record {_shown(raw_name)} has a corrupt extra field")
        fields.append((tag, extra[at + 4 : at + 4 + size]))
        at += 4 + size
    return fields


def _shown(raw_name: bytes) -> str:
    """A record name for a message, before it is known to be valid UTF-8."""
    return repr(raw_name.decode("utf-8", "backslashreplace"))


#: names made of these, not starting with "/" and holding no "..", pass every check below
_PLAIN_NAME = re.compile(rb"[A-Za-z0-9_.-][A-Za-z0-9_./-]*")


def _checked_name(raw_name: bytes, path: str) -> str:
    """The record's name, refused unless it is a plain relative path in valid UTF-8.

    Tools that extract the archive would write ``..`` or absolute names outside the target
    folder, and a NUL ends the name early in C readers (miniz) but not in Python.
    """
    if _PLAIN_NAME.fullmatch(raw_name) and b".." not in raw_name:
        return raw_name.decode("ascii")  # the usual torch name: nothing below can object to it
    try:
        name = raw_name.decode("utf-8")
    except UnicodeDecodeError:
        raise BadInputError(f"{path}: record name {_shown(raw_name)} is not valid UTF-8; refusing") from None
    parts = name.replace("\\", "/").split("/")
    if not name:
        raise BadInputError(f"{path}: a record with an empty name; refusing")
    if "\x00" in name:
        raise BadInputError(f"{path}: record name {name!r} holds a NUL byte; refusing")
    if parts[0] == "" or ":" in parts[0]:
        raise BadInputError(f"{path}: record name {name!r} is an absolute path; refusing")
    if ".." in parts:
        raise BadInputError(f"{path}: record name {name!r} climbs out of the archive with '..'; refusing")
    return name


def _refuse_name_clashes(names: list[str], path: str) -> None:
    """Names must be unique, and unique ignoring case: miniz (torch's reader) ignores case."""
    seen: dict[str, str] = {}
    for name in names:
        other = seen.get(name.casefold())
        if other == name:
            raise BadInputError(f"{path}: the zip holds two records named {name!r}; refusing")
        if other is not None:
            raise BadInputError(
                f"{path}: records {other!r} and {name!r} differ only in case; torch's zip reader ignores "
                "case and could load the one ckptfix did not check; refusing"
            )
        seen[name.casefold()] = name


def _check_entry(entry: _Entry, name: str, path: str) -> None:
    """Method, encryption and sizes of one directory entry, before any of its bytes are read."""
    if entry.flags & _ENCRYPTED_FLAGS:
        raise BadInputError(f"{path}: record {name!r} is encrypted")
    if entry.method not in (STORED, DEFLATED):
        raise BadInputError(f"{path}: record {name!r} uses zip compression method {entry.method}")
    if entry.method == STORED and entry.compressed_size != entry.size:
        raise BadInputError(f"{path}: record {name!r} has inconsistent sizes")
    if entry.method == DEFLATED and entry.size > entry.compressed_size * MAX_DEFLATE_RATIO:
        raise BadInputError(
            f"{path}: record {name!r} claims to inflate {entry.compressed_size} bytes to {entry.size}, more "
            f"than deflate can ({MAX_DEFLATE_RATIO}x): a zip bomb or a corrupt size; refusing"
        )


def _check_local_header(view: WindowedReader | _Reads, entry: _Entry, name: str, file_size: int, path: str) -> int:
    """Return where the record's data starts, after checking its local header agrees with
    the directory on what any reader uses: the name, the method and (unless a data
    descriptor follows the data) the sizes and CRC."""
    if entry.header_offset + _LOCAL_HEADER.size > file_size:
        raise BadInputError(f"{path}: record {name!r} lies outside the file: truncated or corrupt")
    raw_name = entry.raw_name
    head = view.read(entry.header_offset, _LOCAL_HEADER.size + len(raw_name))
    (sig, _, flags, method, _, _, crc, csize, usize, name_len, extra_len) = _LOCAL_HEADER.unpack_from(head)
    if sig != _LOCAL_SIG:
        raise BadInputError(f"{path}: record {name!r} has no valid local header: corrupt zip")
    data_offset: int = entry.header_offset + _LOCAL_HEADER.size + name_len + extra_len
    if data_offset > file_size:
        raise BadInputError(f"{path}: record {name!r} lies outside the file: truncated or corrupt")
    if name_len != len(raw_name) or head[_LOCAL_HEADER.size :] != raw_name:
        local_name = view.read(entry.header_offset + _LOCAL_HEADER.size, name_len)
        raise BadInputError(
            f"{path}: record {name!r} is named {_shown(local_name)} in its local header; zip readers "
            "would disagree on what it is; refusing"
        )
    if method != entry.method:
        raise BadInputError(
            f"{path}: record {name!r} has compression method {method} in its local header but "
            f"{entry.method} in the zip directory; refusing"
        )
    if not flags & _DATA_DESCRIPTOR_FLAG:
        if _U32_MAX in (csize, usize):
            extra = view.read(entry.header_offset + _LOCAL_HEADER.size + name_len, extra_len)
            usize, csize, _ = _apply_zip64_extra(extra, usize, csize, 0, path, raw_name)
        if (crc, csize, usize) != (entry.crc, entry.compressed_size, entry.size):
            raise BadInputError(
                f"{path}: record {name!r} has other sizes or CRC in its local header than in the zip "
                "directory; refusing"
            )
    return data_offset


def _refuse_overlaps(records: ZipDirectory, path: str) -> None:
    """No byte may belong to two records (local header to end of data)."""
    previous: tuple[int, int, str] | None = None
    for span in sorted(records.spans()):
        if previous is not None and span[0] < previous[1]:
            raise BadInputError(_overlap_message(path, previous[2], span[2]))
        previous = span


def _overlap_message(path: str, first: str, second: str) -> str:
    return (
        f"{path}: records {first!r} and {second!r} overlap in the file (a zip bomb "
        "or an archive that reads differently in different tools); refusing"
    )


#: how many times larger than its compressed bytes a deflated record may inflate: real data
#: deflates 1.1x (weights) to ~6x (pickles); a zip bomb, ~1000x
INFLATE_RATIO = 64
#: the absolute budget below which a record is never refused for its ratio (a small record of
#: zeros deflates far beyond the ratio and costs nothing)
INFLATE_FLOOR = 16 << 20


def check_inflation(record: ZipRecord, path: str = "") -> None:
    """Refuse a deflated record that declares more than :data:`INFLATE_RATIO` times its
    compressed bytes (and more than :data:`INFLATE_FLOOR`): every reader, writer and check that
    inflates records passes here first, so a kilobyte-sized file cannot make any command
    produce, hold or compare gigabytes (each inflation is also streamed in bounded chunks)."""
    if record.method != DEFLATED or record.size <= max(INFLATE_FLOOR, INFLATE_RATIO * record.compressed_size):
        return
    where = f"{path}: record {record.name!r}" if path else f"record {record.name!r}"
    raise BadInputError(
        f"{where} is deflated from {record.compressed_size} bytes but declares {record.size} "
        f"(more than {INFLATE_RATIO}x): a zip bomb, or not a checkpoint torch.save wrote; refusing"
    )


def read_record_bytes(f: BinaryIO, record: ZipRecord, limit: int, path: str = "") -> bytes:
    """Read a (small) record into memory, inflating it if needed, refusing more than ``limit``.

    Compressed bytes are read and inflated in bounded chunks, so memory stays at the
    record's declared size however many compressed bytes the file holds. ``path`` (the
    archive's) only makes error messages say which file.
    """
    where = f"{path}: record {record.name!r}" if path else f"record {record.name!r}"
    if record.size > limit:
        raise BadInputError(f"{where} declares {record.size} bytes, over the {limit}-byte limit")
    check_inflation(record, path)
    if record.method == STORED:
        f.seek(record.data_offset)
        raw = f.read(record.compressed_size)
        if len(raw) != record.compressed_size:
            raise BadInputError(f"{where} is truncated")
        return raw
    return b"".join(inflate_chunks(f, record.data_offset, record.compressed_size, record.size, where))


def shares_blocks(source: FileRange | ComputedSource) -> TypeGuard[FileRange]:
    """Whether :class:`ZipWriter` places ``source``'s record at its source offset modulo
    :data:`~ckptfix.fileio.ranges.BLOCK` (so a copy-on-write file system shares its blocks)
    rather than at the next 64-byte boundary.

    Only bytes copied as they are from a local file (a plain range; a remote object's bytes
    are streamed, and its tensor records' offsets are not known before they are read: see
    :func:`_deferred_records`) can be shared; only records of at least
    :data:`~ckptfix.fileio.ranges.SMALL_COPY` are worth up to 4 KiB of padding; and only a
    64-aligned source offset keeps the 64-byte alignment torch needs (a 4096-congruent offset
    is 64-aligned exactly when the source one is: safetensors tensors often are not).
    """
    return is_local_range(source) and source.size >= SMALL_COPY and source.offset % RECORD_ALIGNMENT == 0


def _check_crc(name: str, source: FileRange | ComputedSource, recorded: int | None, actual: int) -> None:
    if recorded and actual != recorded:
        where = source.path if isinstance(source, FileRange) else "the input"
        raise BadInputError(
            f"{where}: the bytes copied into {name} have CRC32 {actual:08x}, but the input's record says "
            f"{recorded:08x}: the input is corrupt (run `ckptfix verify` on it); nothing was written"
        )


_DESCRIPTOR = struct.Struct("<4sIII")
#: small records wait for the native engine to lay them out until this many bytes or records
_PENDING_LIMIT = 1 << 20
_PENDING_COUNT = 4096
#: a run of small records copied by the native engine goes in calls of at most this many records
#: and (past its first record) bytes: memory stays bounded whatever the run's length
_COPY_COUNT = 4096
_COPY_BYTES = 1 << 20
#: the "FB" extra field's length and padding, for every padding torch's 64-byte alignment needs
_PAD_LENGTH = [struct.pack("<H", n) + b"Z" * n for n in range(RECORD_ALIGNMENT)]


class NumberedNames(Sequence[str]):
    """The record names ``prefix + str(n)`` for ``n`` in ``numbers`` (``data/0``, ``data/1``...),
    without a string made per name until one is asked for."""

    def __init__(self, prefix: str, numbers: range) -> None:
        self.prefix, self.numbers = prefix, numbers

    def __len__(self) -> int:
        return len(self.numbers)

    def __iter__(self) -> Iterator[str]:
        return map(self.prefix.__add__, map(str, self.numbers))

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> NumberedNames: ...

    def __getitem__(self, index: int | slice) -> str | NumberedNames:
        if isinstance(index, slice):
            return NumberedNames(self.prefix, self.numbers[index])
        return f"{self.prefix}{self.numbers[index]}"


class ZipWriter:
    """Writes a zip the way torch's ``PyTorchStreamWriter`` does, one record after another.

    Record bytes either come from memory (:meth:`add_bytes`) or are copied between files by
    the kernel (:meth:`add_copy`), so memory use does not depend on the record sizes.
    """

    def __init__(
        self, out: BinaryIO, archive_name: str, *, zip64_threshold: int = _U32_MAX, embedded: bool = False
    ) -> None:
        self._stream = OutputStream(out)
        self._prefix = archive_name
        #: ``embedded``: the archive starts at ``out``'s current position (one item among others
        #: in a DCP ``.distcp`` file) and its offsets count from there, as torch.save writes
        #: into a stream and as torch reads such an item back (through a view of its byte range)
        self._base = self._stream.offset if embedded else 0
        # what the central directory needs of each record written, as columns (~4 records a
        # parameter in a training checkpoint: an object each would cost ~180 bytes)
        self._name_blob = bytearray()  # the names (with the archive folder) end to end
        self._name_ends = array("Q")  # where each one ends in it
        self._header_offsets = array("q")
        self._sizes = array("q")
        self._crcs = array("I")
        #: copied records to check against the CRC their source recorded: (name, source,
        #: recorded, the CRC of the bytes copied, or the worker computing it beside the kernel)
        self._crc_checks: list[tuple[str, FileRange, int, int | Future[int]]] = []
        self._zip64_threshold = zip64_threshold
        #: small records not written yet (:meth:`add_small`), for the native engine to lay out
        #: as a run: their full names, bytes and CRCs
        self._pending_names: list[bytes] = []
        self._pending_data: list[bytes] = []
        self._pending_crcs = array("I")
        self._pending_bytes = 0
        #: whether the native engine lays out small runs and the directory (tests turn it off)
        self._native = native_zip.available()

    @property
    def _offset(self) -> int:
        """Where the next record starts, from the archive's first byte (once the small records
        waiting are written: every other write reads this first)."""
        if self._pending_crcs:
            self._write_pending()
        return self._stream.offset - self._base

    def _write_pending(self) -> None:
        """Write the small records waiting, laid out by the native engine (the same bytes as
        :meth:`_add_small_python`'s), or one by one in Python where it declines."""
        names, data, crcs = self._pending_names, self._pending_data, self._pending_crcs
        self._pending_names, self._pending_data, self._pending_crcs = [], [], array("I")
        self._pending_bytes = 0
        offset = self._stream.offset - self._base  # offsets count from the archive's first byte
        built = native_zip.small_records(names, data, crcs, offset, self._zip64_threshold)
        if built is None:
            for name, record, crc in zip(names, data, crcs, strict=True):
                self._add_small_python(name, record, crc)
            return
        records, offsets = built
        self._write(records)
        self._add_names(b"".join(names), map(len, names))
        self._header_offsets.extend(offsets)
        self._sizes.extend(map(len, data))
        self._crcs.extend(crcs)

    def _needs_zip64(self, value: int) -> bool:
        return value >= self._zip64_threshold

    def _start_record(self, name: str, size: int, source_offset: int | None = None) -> bytes:
        """Write the local header; the ``FB`` extra field pads the data to the next 64-byte
        boundary, or, given ``source_offset``, to the next offset congruent to it modulo
        :data:`BLOCK` (at most 4095 bytes: an extra field holds up to 65535)."""
        return self._start_full_record(f"{self._prefix}/{name}".encode(), size, source_offset)

    def _start_full_record(self, full: bytes, size: int, source_offset: int | None = None) -> bytes:
        offset = self._offset
        zip64 = b""
        if self._needs_zip64(size) or self._needs_zip64(offset):
            body = b""
            if self._needs_zip64(size):
                body += struct.pack("<QQ", 0, 0)
            if self._needs_zip64(offset):
                body += struct.pack("<Q", offset)
            zip64 = struct.pack("<HH", 0x0001, len(body)) + body
        start = offset + _LOCAL_HEADER.size + len(full) + len(zip64) + 4
        # the block a copy-on-write file system shares is a block of the whole file
        padding = -start % RECORD_ALIGNMENT if source_offset is None else (source_offset - start - self._base) % BLOCK
        extra = zip64 + b"FB" + struct.pack("<H", padding) + b"Z" * padding
        header = _LOCAL_HEADER.pack(_LOCAL_SIG, 0, 0x0808, STORED, 0, 0, 0, 0, 0, len(full), len(extra))
        self._write(header + full + extra)
        return full

    def _finish_record(self, full: bytes, header_offset: int, size: int, crc: int) -> None:
        if self._needs_zip64(size) or self._needs_zip64(header_offset):
            descriptor = struct.pack("<4sIQQ", _DESCRIPTOR_SIG, crc, size, size)
        else:
            descriptor = struct.pack("<4sIII", _DESCRIPTOR_SIG, crc, size, size)
        self._write(descriptor)
        self._record_written(full, header_offset, size, crc)

    def _write(self, data: bytes | bytearray | memoryview) -> None:
        self._stream.write(data)

    def _add_names(self, blob: bytes, lengths: Iterable[int]) -> None:
        """Note the names of records written (``blob``: the names end to end, of these lengths)."""
        ends = accumulate(lengths, initial=len(self._name_blob))
        next(ends)  # (the initial value: where the first one starts)
        self._name_ends.extend(ends)
        self._name_blob += blob

    def _record_written(self, full: bytes, header_offset: int, size: int, crc: int) -> None:
        self._name_blob += full
        self._name_ends.append(len(self._name_blob))
        self._header_offsets.append(header_offset)
        self._sizes.append(size)
        self._crcs.append(crc)

    def reserve(self, size: int) -> None:
        """Say that at least ``size`` more bytes will follow (the records' data, known before the
        first is copied): the file system may allocate their blocks now, in one call
        (:meth:`~ckptfix.fileio.ranges.OutputStream.reserve`; headers and the directory come on
        top, allocated as they are written)."""
        self._stream.reserve(size)

    def add_bytes(self, name: str, data: bytes | bytearray) -> int:
        """Add a record from memory; returns its CRC32."""
        header_offset = self._offset
        full = self._start_record(name, len(data))
        self._write(data)
        crc = crc32(data)
        self._finish_record(full, header_offset, len(data), crc)
        return crc

    def add_small(self, name: str, data: bytes, crc: int) -> None:
        """A small record whose bytes and CRC are known: header, data and descriptor in one
        write (a training checkpoint has ~4 records per parameter; this is their path).

        With the native engine the records wait (up to :data:`_PENDING_LIMIT` bytes) and are
        laid out as a run, from columns: the same bytes, without a Python pass over each."""
        if self._native:
            self._pending_names.append(f"{self._prefix}/{name}".encode())
            self._pending_data.append(data)
            self._pending_crcs.append(crc)
            self._pending_bytes += len(data)
            if self._pending_bytes >= _PENDING_LIMIT or len(self._pending_crcs) >= _PENDING_COUNT:
                self._write_pending()
            return
        self._add_small_python(f"{self._prefix}/{name}".encode(), data, crc)

    def _add_small_python(self, full: bytes, data: bytes, crc: int) -> None:
        """:meth:`add_small` in Python (the reference), for the record named ``full`` (with its
        archive folder)."""
        offset = self._offset
        size = len(data)
        if self._needs_zip64(size) or self._needs_zip64(offset + size + 4096):
            self._start_full_record(full, size)
            self._write(data)
            self._finish_record(full, offset, size, crc)
            return
        padding = -(offset + _LOCAL_HEADER.size + len(full) + 4) % RECORD_ALIGNMENT
        header = _LOCAL_HEADER.pack(_LOCAL_SIG, 0, 0x0808, STORED, 0, 0, 0, 0, 0, len(full), 4 + padding)
        descriptor = _DESCRIPTOR.pack(_DESCRIPTOR_SIG, crc, size, size)
        self._write(b"".join((header, full, b"FB", _PAD_LENGTH[padding], data, descriptor)))
        self._record_written(full, offset, size, crc)

    def add_copy(self, name: str, source: FileRange | ComputedSource, files: OpenFiles) -> int:
        """Add a record whose bytes come from ``source``; returns its CRC32.

        A stored range of a local file is copied by the kernel (adjacent ones merged into one
        call), anything else streamed in bounded chunks (a remote object's ranges too: there is
        no descriptor to copy from). Where the source recorded a CRC (a zip record), the bytes
        are checked against it: a record whose bytes do not match its CRC is corrupt, and
        copying its CRC along would make the output pass every check. A kernel-copied record's
        CRC is computed on a worker thread from the same source bytes while the kernel copies
        them, and checked before the archive is closed (:meth:`close`); a streamed one's as it
        streams. CRC 0 marks a file saved with ``torch.serialization.set_crc32_options(False)``:
        it stays 0, unchecked, as torch wrote it. See :func:`shares_blocks` for where the
        record's data lands.
        """
        recorded = source.crc if isinstance(source, FileRange) else None
        if is_plain_range(source) and source.size < SMALL_COPY:
            data = files.small_read(source.path, source.offset, source.size)
            if len(data) != source.size:
                raise BadInputError(f"{source.path}: the file ended inside tensor data (truncated?)")
            crc = 0 if recorded == 0 else crc32(data)
            _check_crc(name, source, recorded, crc)
            self.add_small(name, data, crc)
            return crc
        once: FileRange | None = None  # the range copied in one pass, its CRC computed on the way
        if recorded and is_local_range(source):  # (a FileRange: it recorded a CRC)
            unchecked = FileRange(source.path, source.offset, source.size)
            if self._stream.copies_once(unchecked, files):
                once = unchecked
            else:
                self._crc_checks.append((name, source, recorded, files.crc_in_background(unchecked)))
        header_offset = self._offset
        place = source.offset if shares_blocks(source) else None
        full = self._start_record(name, source.size, place)
        copied_crc = self._stream.copy(source if once is None else once, files, want_crc=True)
        assert copied_crc is not None
        if once is not None and recorded and is_local_range(source):  # checked at close, as the worker's are
            self._crc_checks.append((name, source, recorded, copied_crc))
        if not is_local_range(source):  # streamed (a remote object too): the CRC is of the bytes written
            _check_crc(name, source, recorded, copied_crc)
            if recorded == 0 and is_plain_range(source):
                copied_crc = 0  # unchecked, kept as torch wrote it, as a local copy keeps it
        self._finish_record(full, header_offset, source.size, copied_crc)
        return copied_crc

    def add_copies(
        self,
        names: Sequence[str],
        sources: list[FileRange | ComputedSource],
        files: OpenFiles,
        progress: Callable[[int], None] | None = None,
        *,
        into: array[int] | None = None,
    ) -> list[int] | array[int]:
        """:meth:`add_copy` for each name and source, in order; returns their CRCs (appended to
        ``into`` and returned, given an ``array("I")``: 4 bytes a record, where a list holds an
        int object of ~32 bytes for each; 200 000 storages: 7.7 MB). ``progress``
        gets byte counts as they are written (for a run of records, their sum). ``names`` may
        be a :class:`NumberedNames` (``data/0``, ``data/1``...: made without a string each).

        The same bytes and the same errors as calling :meth:`add_copy` for each. With the native
        engine, runs of small records (a stored range of a local file below
        :data:`~ckptfix.fileio.ranges.SMALL_COPY`: a training checkpoint has ~4 per parameter)
        are read from their objects into columns, read from their files, checked against their
        recorded CRCs and laid out by the library, in calls of up to :data:`_COPY_COUNT` records
        or :data:`_COPY_BYTES` bytes -- no Python call per record; any other record, and a run
        the library leaves to Python (a CRC that does not match, a file that ends inside a
        record: the reference raises its own error), goes through :meth:`add_copy`.
        """
        if len(names) != len(sources):
            raise ValueError("add_copies needs one name per source")
        crcs: list[int] | array[int] = [] if into is None else into
        columns = native_sources.source_columns(sources, FileRange, SMALL_COPY) if self._native else None
        if columns is not None and any(map(is_url, columns.paths)):
            columns = None  # a remote object's bytes have no descriptor: they stream through add_copy
        if columns is None:
            self._copy_each(names, sources, range(len(sources)), files, crcs, progress)
            return crcs
        fds = array("i", [-1]) * len(columns.paths)  # opened as runs need them
        start = 0
        for kind, run in groupby(columns.kinds):
            end = start + len(list(run))
            if kind:
                self._copy_small_run(start, end, names, sources, columns, fds, files, crcs, progress)
            else:
                self._copy_each(names, sources, range(start, end), files, crcs, progress)
            start = end
        return crcs

    def _copy_each(
        self,
        names: Sequence[str],
        sources: list[FileRange | ComputedSource],
        rows: range,
        files: OpenFiles,
        crcs: list[int] | array[int],
        progress: Callable[[int], None] | None,
    ) -> None:
        for name, source in zip(names[rows.start : rows.stop], sources[rows.start : rows.stop]):
            crcs.append(self.add_copy(name, source, files))
            if progress:
                progress(source.size)

    def _copy_small_run(
        self,
        start: int,
        end: int,
        names: Sequence[str],
        sources: list[FileRange | ComputedSource],
        columns: native_sources.SourceColumns,
        fds: array[int],
        files: OpenFiles,
        crcs: list[int] | array[int],
        progress: Callable[[int], None] | None,
    ) -> None:
        """Rows ``start:end`` of ``columns`` (small stored ranges), by the library in bounded calls."""
        i = start
        while i < end:
            j = min(end, i + _COPY_COUNT)
            total = sum(columns.sizes[i:j])
            if total > _COPY_BYTES:
                ends = list(accumulate(columns.sizes[i:j]))
                j = i + max(1, bisect_right(ends, _COPY_BYTES))
                total = ends[j - i - 1]
            for k in set(columns.files[i:j]):
                if fds[k] < 0:
                    fds[k] = files.file(columns.paths[k]).fileno()
            blob, lengths = self._full_names(names[i:j])
            offset = self._offset  # (writes the small records waiting first)
            copied = native_zip.copy_records(
                fds,
                columns.files[i:j],
                columns.offsets[i:j],
                columns.sizes[i:j],
                columns.crcs[i:j],
                blob,
                lengths,
                offset,
                self._zip64_threshold,
            )
            if copied is None:  # the reference writes them, or raises its error
                self._copy_each(names, sources, range(i, j), files, crcs, None)
            else:
                self._write(copied.data)
                self._add_names(blob, lengths)
                self._header_offsets.extend(copied.header_offsets)
                self._sizes.extend(columns.sizes[i:j])
                self._crcs.extend(copied.crcs)
                crcs.extend(copied.crcs)
            if progress:
                progress(total)
            i = j

    def _full_names(self, names: Sequence[str]) -> tuple[bytes, array[int]]:
        """Record names with the archive folder, end to end, and each one's length in bytes
        (built by C loops: a training checkpoint has ~4 records per parameter)."""
        if isinstance(names, NumberedNames):
            head = f"{self._prefix}/{names.prefix}"
            keys = list(map(str, names.numbers))
            blob = (head + head.join(keys)).encode() if keys else b""
            if len(blob) == len(head) * len(keys) + sum(map(len, keys)):  # an ASCII prefix
                return blob, array("q", map(len(head.encode()).__add__, map(len, keys)))
        full = list(map(f"{self._prefix}/".__add__, names))
        blob = "".join(full).encode()
        lengths = array("q", map(len, full))
        if len(blob) != sum(lengths):  # a non-ASCII name: lengths in bytes, one by one
            lengths = array("q", [len(name.encode()) for name in full])
        return blob, lengths

    def close(self) -> None:
        """Write the central directory and the (zip64 and classic) end records, once every
        copied record's bytes matched the CRC its source recorded."""
        for record, source, recorded, actual in self._crc_checks:
            _check_crc(record, source, recorded, actual if isinstance(actual, int) else actual.result())
        self._crc_checks.clear()
        cd_offset = self._offset
        # written from the library's buffer and the writer's own columns: no copy of either
        if self._native and native_zip.write_central_directory(
            self._write,
            self._name_blob,
            self._name_ends,
            self._header_offsets,
            self._sizes,
            self._crcs,
            cd_offset,
            self._zip64_threshold,
        ):
            self._stream.flush()
            return
        self._close_python(cd_offset)

    def _close_python(self, cd_offset: int) -> None:
        """:meth:`close`'s directory and end records in Python (the reference)."""
        blob, ends = bytes(self._name_blob), self._name_ends
        names = map(blob.__getitem__, map(slice, chain((0,), ends), ends))
        for name, header_offset, size, crc in zip(names, self._header_offsets, self._sizes, self._crcs):
            zip64 = b""
            size32, offset32 = size, header_offset
            if self._needs_zip64(size):
                zip64 += struct.pack("<QQ", size, size)
                size32 = _U32_MAX
            if self._needs_zip64(header_offset):
                zip64 += struct.pack("<Q", header_offset)
                offset32 = _U32_MAX
            extra = struct.pack("<HH", 0x0001, len(zip64)) + zip64 if zip64 else b""
            self._write(
                _CENTRAL_HEADER.pack(
                    _CENTRAL_SIG,
                    0,
                    0,
                    0x0808,
                    STORED,
                    0,
                    0,
                    crc,
                    size32,
                    size32,
                    len(name),
                    len(extra),
                    0,
                    0,
                    0,
                    0,
                    offset32,
                )
                + name
                + extra
            )
        cd_size = self._offset - cd_offset
        count = len(self._name_ends)
        eocd64_at = self._offset
        self._write(_EOCD64.pack(_EOCD64_SIG, 44, 0x031E, 0x2D, 0, 0, count, count, cd_size, cd_offset))
        self._write(_EOCD64_LOCATOR.pack(_EOCD64_LOCATOR_SIG, 0, eocd64_at, 1))
        self._write(
            _EOCD.pack(
                _EOCD_SIG,
                0,
                0,
                min(count, _U16_MAX),
                min(count, _U16_MAX),
                min(cd_size, _U32_MAX),
                min(cd_offset, _U32_MAX),
                0,
            )
        )
        self._stream.flush()
