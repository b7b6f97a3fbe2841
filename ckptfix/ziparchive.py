"""Reading and writing the zip container that ``torch.save`` uses, by byte offsets.

Why our own zip code instead of :mod:`zipfile`:

* files saved after ``torch.serialization.set_crc32_options(False)`` carry CRC 0, and
  :mod:`zipfile` refuses to read them; torch itself does not check CRCs;
* tensor records are copied into the output without ever being read into Python, so all we
  need from a record is *where its bytes are*;
* the writer mirrors torch's own (miniz) layout byte for byte -- 64-byte aligned records padded
  with an ``FB`` extra field, a data descriptor after each record, zip64 end records -- so
  ``torch.load(mmap=True)`` and torch's ``calculate_storage_offsets`` loader both accept it.
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass
from typing import BinaryIO

from .errors import BadInputError
from .sources import FileRange, OpenFiles, OutputStream

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


@dataclass(slots=True)
class ZipRecord:
    """One member of the archive: its name and where its (possibly compressed) bytes are."""

    name: str
    data_offset: int
    compressed_size: int
    size: int
    method: int
    crc: int

    def source(self, path: str) -> FileRange:
        """The record's bytes as a :class:`FileRange` of the archive file ``path``."""
        deflated = self.compressed_size if self.method == DEFLATED else None
        return FileRange(path, self.data_offset, self.size, self.crc, deflated)


def read_directory(f: BinaryIO, file_size: int, path: str) -> dict[str, ZipRecord]:
    """Return the archive's records by name, reading only the central directory and headers.

    Every offset and size is checked against the file size, so a truncated or hostile file
    fails here with :class:`BadInputError` instead of later with a short read.
    """
    tail_len = min(file_size, 22 + _U16_MAX)
    f.seek(file_size - tail_len)
    tail = f.read(tail_len)
    pos = tail.rfind(_EOCD_SIG)
    if pos < 0 or pos + _EOCD.size > len(tail):
        raise BadInputError(
            f"{path}: the zip directory at the end of the file is missing: the file is "
            "truncated (an interrupted download or copy?)"
        )
    (_, _, _, _, count, cd_size, cd_offset, _) = _EOCD.unpack_from(tail, pos)
    eocd_at = file_size - tail_len + pos
    if count == _U16_MAX or cd_size == _U32_MAX or cd_offset == _U32_MAX:
        count, cd_size, cd_offset = _read_zip64_end(f, eocd_at, file_size, path)
    if cd_offset + cd_size > eocd_at or count * _CENTRAL_HEADER.size > cd_size:
        raise BadInputError(f"{path}: corrupt zip directory (offsets point outside the file)")
    f.seek(cd_offset)
    directory = f.read(cd_size)
    records: dict[str, ZipRecord] = {}
    at = 0
    for _ in range(count):
        if directory[at : at + 4] != _CENTRAL_SIG or at + _CENTRAL_HEADER.size > len(directory):
            raise BadInputError(f"{path}: corrupt zip directory entry")
        fields = _CENTRAL_HEADER.unpack_from(directory, at)
        method, crc, csize, usize = fields[4], fields[7], fields[8], fields[9]
        name_len, extra_len, comment_len, header_offset = fields[10], fields[11], fields[12], fields[16]
        name_at = at + _CENTRAL_HEADER.size
        name = directory[name_at : name_at + name_len].decode("utf-8", "replace")
        extra = directory[name_at + name_len : name_at + name_len + extra_len]
        usize, csize, header_offset = _apply_zip64_extra(extra, usize, csize, header_offset)
        at = name_at + name_len + extra_len + comment_len
        if name in records:
            raise BadInputError(f"{path}: the zip holds two records named {name!r}")
        data_offset = _local_data_offset(f, header_offset, file_size, path, name)
        if data_offset + csize > cd_offset or data_offset + csize > file_size:
            raise BadInputError(
                f"{path}: record {name!r} extends past the end of its data: the file is truncated "
                "or corrupt"
            )
        if method not in (STORED, DEFLATED):
            raise BadInputError(f"{path}: record {name!r} uses zip compression method {method}")
        if method == STORED and csize != usize:
            raise BadInputError(f"{path}: record {name!r} has inconsistent sizes")
        records[name] = ZipRecord(name, data_offset, csize, usize, method, crc)
    return records


def _read_zip64_end(f: BinaryIO, eocd_at: int, file_size: int, path: str) -> tuple[int, int, int]:
    loc_at = eocd_at - _EOCD64_LOCATOR.size
    if loc_at < 0:
        raise BadInputError(f"{path}: corrupt zip64 directory")
    f.seek(loc_at)
    sig, _, eocd64_at, _ = _EOCD64_LOCATOR.unpack(f.read(_EOCD64_LOCATOR.size))
    if sig != _EOCD64_LOCATOR_SIG or eocd64_at + _EOCD64.size > loc_at:
        raise BadInputError(f"{path}: corrupt zip64 directory locator")
    f.seek(eocd64_at)
    fields = _EOCD64.unpack(f.read(_EOCD64.size))
    if fields[0] != _EOCD64_SIG:
        raise BadInputError(f"{path}: corrupt zip64 end record")
    return fields[7], fields[8], fields[9]


def _apply_zip64_extra(extra: bytes, usize: int, csize: int, offset: int) -> tuple[int, int, int]:
    at = 0
    while at + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, at)
        body = extra[at + 4 : at + 4 + size]
        if tag == 0x0001:
            values = [v[0] for v in struct.iter_unpack("<Q", body[: len(body) // 8 * 8])]
            if usize == _U32_MAX and values:
                usize = values.pop(0)
            if csize == _U32_MAX and values:
                csize = values.pop(0)
            if offset == _U32_MAX and values:
                offset = values.pop(0)
        at += 4 + size
    return usize, csize, offset


def _local_data_offset(f: BinaryIO, header_offset: int, file_size: int, path: str, name: str) -> int:
    if header_offset + _LOCAL_HEADER.size > file_size:
        raise BadInputError(f"{path}: record {name!r} lies outside the file: truncated or corrupt")
    f.seek(header_offset)
    header = f.read(_LOCAL_HEADER.size)
    fields = _LOCAL_HEADER.unpack(header)
    if fields[0] != _LOCAL_SIG:
        raise BadInputError(f"{path}: record {name!r} has no valid local header: corrupt zip")
    return header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]


def read_record_bytes(f: BinaryIO, record: ZipRecord, limit: int) -> bytes:
    """Read a (small) record into memory, inflating it if needed, refusing more than ``limit``."""
    if record.size > limit:
        raise BadInputError(f"record {record.name!r} declares {record.size} bytes, over the {limit}-byte limit")
    f.seek(record.data_offset)
    raw = f.read(record.compressed_size)
    if len(raw) != record.compressed_size:
        raise BadInputError(f"record {record.name!r} is truncated")
    if record.method == STORED:
        return raw
    inflater = zlib.decompressobj(-15)
    data = inflater.decompress(raw, limit + 1)
    if len(data) != record.size:
        raise BadInputError(f"record {record.name!r} does not inflate to its declared size")
    return data


@dataclass
class _Written:
    name: bytes
    header_offset: int
    size: int
    crc: int


class ZipWriter:
    """Writes a zip the way torch's ``PyTorchStreamWriter`` does, one record after another.

    Record bytes either come from memory (:meth:`add_bytes`) or are copied between files by
    the kernel (:meth:`add_copy`), so memory use does not depend on the record sizes.
    """

    def __init__(self, out: BinaryIO, archive_name: str, *, zip64_threshold: int = _U32_MAX) -> None:
        self._stream = OutputStream(out)
        self._prefix = archive_name
        self._written: list[_Written] = []
        self._zip64_threshold = zip64_threshold

    @property
    def _offset(self) -> int:
        return self._stream.offset

    def _needs_zip64(self, value: int) -> bool:
        return value >= self._zip64_threshold

    def _start_record(self, name: str, size: int) -> bytes:
        full = f"{self._prefix}/{name}".encode()
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
        padding = -start % RECORD_ALIGNMENT
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
        self._written.append(_Written(full, header_offset, size, crc))

    def _write(self, data: bytes) -> None:
        self._stream.write(data)

    def add_bytes(self, name: str, data: bytes) -> int:
        """Add a record from memory; returns its CRC32."""
        header_offset = self._offset
        full = self._start_record(name, len(data))
        self._write(data)
        crc = zlib.crc32(data)
        self._finish_record(full, header_offset, len(data), crc)
        return crc

    def add_copy(self, name: str, source: FileRange, files: OpenFiles) -> int:
        """Add a record whose bytes come from ``source``; returns its CRC32.

        A stored range with a known CRC (a zip record) is copied by the kernel and keeps the
        CRC the source recorded (CRC 0 stays 0, as torch wrote it); anything else is streamed
        in bounded chunks and its CRC computed on the way.
        """
        header_offset = self._offset
        full = self._start_record(name, source.size)
        crc = self._stream.copy(source, files, want_crc=True)
        assert crc is not None
        self._finish_record(full, header_offset, source.size, crc)
        return crc

    def close(self) -> None:
        """Write the central directory and the (zip64 and classic) end records."""
        cd_offset = self._offset
        for entry in self._written:
            zip64 = b""
            size32, offset32 = entry.size, entry.header_offset
            if self._needs_zip64(entry.size):
                zip64 += struct.pack("<QQ", entry.size, entry.size)
                size32 = _U32_MAX
            if self._needs_zip64(entry.header_offset):
                zip64 += struct.pack("<Q", entry.header_offset)
                offset32 = _U32_MAX
            extra = struct.pack("<HH", 0x0001, len(zip64)) + zip64 if zip64 else b""
            self._write(
                _CENTRAL_HEADER.pack(
                    _CENTRAL_SIG, 0, 0, 0x0808, STORED, 0, 0, entry.crc, size32, size32,
                    len(entry.name), len(extra), 0, 0, 0, 0, offset32,
                )
                + entry.name
                + extra
            )
        cd_size = self._offset - cd_offset
        count = len(self._written)
        eocd64_at = self._offset
        self._write(_EOCD64.pack(_EOCD64_SIG, 44, 0x031E, 0x2D, 0, 0, count, count, cd_size, cd_offset))
        self._write(_EOCD64_LOCATOR.pack(_EOCD64_LOCATOR_SIG, 0, eocd64_at, 1))
        self._write(
            _EOCD.pack(
                _EOCD_SIG, 0, 0, min(count, _U16_MAX), min(count, _U16_MAX),
                min(cd_size, _U32_MAX), min(cd_offset, _U32_MAX), 0,
            )
        )
        self._stream.flush()


def copy_range(src_fd: int, src_offset: int, dst_fd: int, dst_offset: int, count: int) -> None:
    """Copy ``count`` bytes between files without passing them through Python.

    Uses ``copy_file_range`` (in-kernel, may share extents on CoW filesystems), and a
    bounded ``pread``/``pwrite`` loop where the kernel or filesystem cannot do that.
    """
    done = 0
    copier = getattr(os, "copy_file_range", None)
    while done < count and copier is not None:
        try:
            n = copier(src_fd, dst_fd, count - done, src_offset + done, dst_offset + done)
        except OSError as exc:
            if exc.errno in (18, 22, 38, 95):  # EXDEV, EINVAL, ENOSYS, EOPNOTSUPP: try another way
                copier = None
                break
            raise
        if n == 0:
            raise BadInputError("the input file ended while its data was being copied (truncated?)")
        done += n
    while done < count:
        chunk = os.pread(src_fd, min(count - done, 1 << 20), src_offset + done)
        if not chunk:
            raise BadInputError("the input file ended while its data was being copied (truncated?)")
        os.pwrite(dst_fd, chunk, dst_offset + done)
        done += len(chunk)
