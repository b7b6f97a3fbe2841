"""Where tensor bytes live, and how to get them out in the order a writer needs.

Every storage read by ckptfix points at a :class:`FileRange` -- a byte range of a file on disk
(a zip record, a safetensors data range, a legacy-format storage). Writers either copy a range
as it is (in the kernel, no Python buffer) or, when a tensor is a strided view or the bytes
need swapping, gather exactly that one tensor's elements into C order with numpy over a
memory map -- so memory stays at one tensor's worth at most.

On a copy-on-write file system (XFS with reflink, btrfs; ZFS clones only whole records) the
kernel's copy shares the input's blocks instead of copying bytes, but only whole blocks, and
only when a ``copy_file_range`` call *starts* on a block boundary in both files (measured on
XFS: 0 -> 0 all shared, 64 -> 64 nothing, 4096 -> 4096 all but a partial last block). Writers
therefore place big ranges at an output offset congruent to their source offset modulo
:data:`BLOCK`, and :func:`copy_range` copies the head up to the next boundary on its own.
"""

from __future__ import annotations

import errno
import functools
import io
import os
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, BinaryIO, Protocol, TypeGuard, cast, runtime_checkable

from ..errors import BadInputError
from ..native.crc import copies_natively, crc32
from ..native.crc import copy_range as native_copy_range
from .deferred import DeferredRecords
from .positional import PositionalFile
from .urls import is_url

if TYPE_CHECKING:  # imported when first needed: concurrent.futures costs ~6 ms (it imports logging)
    from concurrent.futures import Future, ThreadPoolExecutor

_CHUNK = 1 << 22
#: records smaller than this are copied through the output buffer rather than by the kernel,
#: and keep their natural place (no padding to share blocks: not worth 4 KiB each)
SMALL_COPY = 1 << 16
#: the block size copy-on-write file systems share extents in (4 KiB on XFS and btrfs as
#: usually made); the zip extra field that pads a record holds at most 64 KiB, so this is also
#: about as far as a writer can go
BLOCK = 4096
#: how many bytes of merged copies may wait for the kernel: progress is reported as records are
#: added, so it runs at most this far ahead of the bytes really copied (and 256 MiB copies cost
#: the same per byte as one call for the whole file)
MERGE_LIMIT = 1 << 28
#: the buffer the background CRC reads through: small enough to stay in cache between the
#: read and the CRC, large enough that the per-call cost vanishes (measured: flat 256 KiB-4 MiB)
_CRC_CHUNK = 1 << 20


@runtime_checkable
class RangeSource(Protocol):
    """A file read by ranges rather than through a descriptor: a remote object
    (:class:`~ckptfix.fileio.remote.RemoteFile`). Readers that would ``pread`` a descriptor ask
    it instead; it can be told what is about to be read, and streams big ranges itself."""

    metadata_only: bool
    defers: bool

    def pread(self, size: int, offset: int) -> bytes: ...

    def prefetch(self, ranges: list[tuple[int, int]], gap: int = ...) -> None: ...

    def iter_range(self, offset: int, size: int) -> Iterator[bytes]: ...

    def check_unchanged(self) -> None: ...

    def plan(self, ranges: list[tuple[int, int]]) -> None: ...

    def defer(self, records: DeferredRecords) -> None: ...


@dataclass(slots=True, unsafe_hash=True)
class FileRange:
    """``size`` bytes of ``path`` starting at ``offset``.

    ``crc`` is the CRC32 of those bytes when the source recorded one (zip records), so a zip
    writer can reuse it. ``deflated_size`` is set for deflate-compressed zip records: then
    ``offset`` points at compressed data of that length, which inflates to ``size`` bytes.
    Treated as immutable (hashable by value); not frozen only because a training checkpoint
    makes one per storage and a frozen dataclass costs 5x more to build.
    """

    path: str
    offset: int
    size: int
    crc: int | None = None
    deflated_size: int | None = None

    def sub(self, start: int, length: int) -> FileRange:
        """A plain sub-range (only for stored, uncompressed sources)."""
        if self.deflated_size is not None:
            raise ValueError("cannot take a sub-range of compressed data")
        return FileRange(self.path, self.offset + start, length)


@dataclass(frozen=True, eq=False)
class ComputedSource:
    """Bytes made when the writer asks for them (a dtype cast): ``produce`` returns exactly
    ``size`` bytes. Used for one storage at a time, so memory stays bounded."""

    size: int
    produce: Callable[[OpenFiles], bytes]


@dataclass(frozen=True, eq=False)
class JoinedSource(ComputedSource):
    """Bytes that are several file ranges end to end: a tensor split across files (a ZeRO
    parameter whose fp32 master weights straddle two ranks' partitions). ``pieces`` tile the
    bytes exactly once, in order (checked when it is made); writers copy them piece by piece
    (:meth:`OutputStream.copy`, :func:`iter_chunks`), and ``produce`` joins them only for a
    caller that needs the one tensor in memory (a cast, a gather)."""

    pieces: tuple[FileRange, ...] = ()

    @classmethod
    def of(cls, pieces: tuple[FileRange, ...]) -> JoinedSource:
        if not pieces or any(not is_plain_range(p) or p.size <= 0 or p.offset < 0 for p in pieces):
            raise ValueError("a joined source needs non-empty, uncompressed pieces")
        size = sum(p.size for p in pieces)
        return cls(size, lambda files: b"".join(read_all(p, files) for p in pieces), pieces)


class WindowedReader:
    """Small reads of one file, in mostly increasing order, served from one buffered window.

    Why not a memory map: the kernel maps a file's page cache in large folios (up to 2 MiB per
    fault on ext4/XFS), so touching one 30-byte zip header per 6 MB tensor counted the whole
    file into our RSS (measured: 362 MiB peak to read a 1.2 GB checkpoint's directory), and a
    file truncated while mapped kills the process with SIGBUS. A read is short where the file
    ends; callers check lengths.
    """

    def __init__(
        self,
        fd: int,
        window: int = 1 << 16,
        *,
        base: int = 0,
        end: int | None = None,
        source: RangeSource | None = None,
    ) -> None:
        self._fd = fd
        self._read_at = source.pread if source is not None else partial(os.pread, fd)
        self._window = window
        self._base = base  # offsets are relative to here (a FileSlice's start)
        self._end = end  # and nothing at or past this relative offset is read
        self._start = 0
        self._buffer = b""

    def _pread(self, size: int, offset: int) -> bytes:
        if self._end is not None:
            size = max(0, min(size, self._end - offset))
        return self._read_at(size, self._base + offset)

    def read(self, offset: int, size: int) -> bytes:
        if size <= 0:
            return b""
        at = offset - self._start
        if at >= 0 and at + size <= len(self._buffer):
            return self._buffer[at : at + size]
        if size >= self._window:
            return self._pread(size, offset)
        self._buffer = self._pread(self._window, offset)
        self._start = offset
        return self._buffer[:size]

    @classmethod
    def over(cls, f: BinaryIO) -> WindowedReader:
        """A reader over the open file ``f``, or over just its part when it is a :class:`FileSlice`."""
        if isinstance(f, FileSlice):
            if f.source is not None:  # it windows and keeps what it fetched itself: pass reads through
                return cls(-1, 1, base=f.base, end=f.size, source=f.source)
            return cls(f.fileno(), base=f.base, end=f.size)
        if isinstance(f, RangeSource):  # it windows and keeps what it fetched itself: pass reads through
            return cls(-1, 1, source=f)
        return cls(f.fileno())


class FileSlice(PositionalFile):
    """``size`` bytes of an open file from ``base`` on, read as if they were a whole file.

    For a zip stored inside another file (each item of a torch.distributed.checkpoint
    ``.distcp`` file is a ``torch.save`` zip): the zip reader's offsets are relative to the
    slice, and no read reaches outside it. The file is not closed with the slice. A slice of a
    remote object (a :class:`RangeSource`) reads through the object's own cached, planned
    ranged reads, and has no descriptor (nothing maps it).
    """

    def __init__(self, f: BinaryIO, base: int, size: int) -> None:
        super().__init__()
        self.source: RangeSource | None = f if isinstance(f, RangeSource) else None
        self._fd = -1 if self.source is not None else f.fileno()
        self.base, self.size = base, size
        self._pos = 0

    def fileno(self) -> int:
        if self.source is not None:
            raise io.UnsupportedOperation("a slice of a remote object has no file descriptor")
        return self._fd

    def pread(self, size: int, offset: int) -> bytes:
        if self.source is not None:
            return self.source.pread(max(0, min(size, self.size - offset)), self.base + offset)
        return os.pread(self._fd, size, self.base + offset)

    def close(self) -> None:
        pass  # the underlying file belongs to the caller


class OpenFiles:
    """Input files opened once per write and closed together."""

    def __init__(self) -> None:
        self._files: dict[str, BinaryIO] = {}
        self._windows: dict[str, WindowedReader] = {}
        self._stack = ExitStack()
        self._worker: ThreadPoolExecutor | None = None

    def file(self, path: str) -> BinaryIO:
        f = self._files.get(path)
        if f is None:
            if is_url(path):  # a remote object: read by ranges, checked unchanged when done
                from .remote import RemoteFile

                remote = RemoteFile(path)
                self._stack.callback(remote.close)  # after the check (callbacks run last first)
                self._stack.callback(remote.check_unchanged)
                f = self._files[path] = cast(BinaryIO, remote)
            else:
                f = self._files[path] = self._stack.enter_context(open(path, "rb"))  # noqa: SIM115
        return f

    def plan(self, sources: Iterable[FileRange | ComputedSource | None]) -> None:
        """Say which ranges a writer is about to read, in its order. Local files ignore it; a
        remote object fetches them ahead (coalesced, concurrent, bounded: see
        :meth:`~ckptfix.fileio.remote.RemoteFile.plan`)."""
        wanted: dict[str, list[tuple[int, int]]] = {}
        for source in sources:
            if isinstance(source, FileRange) and is_url(source.path):
                size = source.size if source.deflated_size is None else source.deflated_size
                wanted.setdefault(source.path, []).append((source.offset, size))
        for path, ranges in wanted.items():
            f = self.file(path)
            if isinstance(f, RangeSource):
                f.plan(ranges)

    def small_read(self, path: str, offset: int, size: int) -> bytes:
        """A few bytes of ``path`` (a small tensor record), through a read window per file
        rather than a ``pread`` each (a training checkpoint has ~4 records per parameter)."""
        window = self._windows.get(path)
        if window is None:
            window = self._windows[path] = WindowedReader.over(self.file(path))
        return window.read(offset, size)

    def crc_in_background(self, source: FileRange) -> Future[int]:
        """Start computing ``source``'s CRC32 on a worker thread (one per write, made on first
        use). The CRC (:func:`ckptfix.native.crc.crc32`: the native core's, else zlib's) and
        ``pread`` release the GIL, so this runs on another core while the caller's
        ``copy_file_range`` copies the same bytes in the kernel."""
        if self._worker is None:
            from concurrent.futures import ThreadPoolExecutor

            self._worker = self._stack.enter_context(ThreadPoolExecutor(1, thread_name_prefix="ckptfix-crc"))
        return self._worker.submit(crc_of_range, self.file(source.path).fileno(), source.offset, source.size)

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> OpenFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class _PendingCopy:
    """Output bytes ``[dst, dst + size)`` that are ``size`` bytes of ``path`` at ``offset``,
    not yet handed to the kernel (see :class:`OutputStream`)."""

    files: OpenFiles
    path: str
    offset: int
    size: int
    dst: int


class OutputStream:
    """An output file written front to back, taking bytes from memory or from file ranges.

    Copies from a file are held back and merged while the output goes on repeating that file
    byte for byte: a range that continues the last one, and small writes equal to the bytes
    that follow it there (a zip record's data descriptor and the next local header, when a
    surgery kept the records where they were), up to :data:`MERGE_LIMIT` bytes. So
    ``strip-module`` copies a checkpoint's records in a few ``copy_file_range`` calls: one call
    costs ~0.5 ms on ext4 (measured: 200 calls for 1.2 GB took 0.5 s where one took 0.35 s),
    and on a copy-on-write file system a few shared extents are cheaper to make and to read
    back than hundreds.
    Call :meth:`flush` before closing the :class:`OpenFiles` given to :meth:`copy`.
    """

    def __init__(self, out: BinaryIO) -> None:
        self._out = out
        try:
            self._fd: int | None = out.fileno()
        except (OSError, ValueError):  # an upload stream: bytes go through it, none by the kernel
            self._fd = None
        self.offset = out.tell()
        self._pending: _PendingCopy | None = None
        self._reserved_end = 0

    def reserve(self, size: int) -> None:
        """Say that ``size`` more bytes will follow (the output's exact remaining length): where
        that is cheap and sure (:func:`preallocates`), the file system allocates their blocks
        now, in one call. An output with no room left then fails here, before any byte is
        copied, and :meth:`flush` cuts off whatever was reserved but not written (a writer that
        wrote less than it said must not leave zeros at the end)."""
        if self._fd is None or size < _PREALLOCATE_FROM or not preallocates(self._fd):
            return
        try:
            os.posix_fallocate(self._fd, self.offset, size)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise
            return  # anything else: the blocks are allocated as the bytes come, as without it
        self._reserved_end = max(self._reserved_end, self.offset + size)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        pending = self._pending
        if pending is not None:
            if len(data) <= SMALL_COPY and pending.size < MERGE_LIMIT and _repeats(pending, data):
                pending.size += len(data)
                self.offset += len(data)
                return
            self._copy_pending()
        self._out.write(data)
        self.offset += len(data)

    def copy(self, source: FileRange | ComputedSource, files: OpenFiles, *, want_crc: bool = False) -> int | None:
        """Append ``source``'s bytes: by the kernel when they are stored as they are, else
        streamed in chunks. Returns the CRC32 when ``want_crc``: for a local stored range the
        one the source recorded where there is one (the bytes are unchanged), else computed on
        a worker thread while the kernel copies, so a CRC costs no more wall time than the copy
        it rides along; for streamed bytes (a remote object's included), the CRC of what was
        written."""
        if source.size == 0:  # nothing to read, wherever it claims to be
            return 0 if want_crc else None
        if is_plain_range(source):
            return self._copy_plain(source, files, want_crc)
        if isinstance(source, JoinedSource) and not want_crc:
            for piece in source.pieces:  # each piece by the kernel (a CRC streams them instead)
                self._copy_plain(piece, files, False)
            return None
        return self._stream(iter_chunks(source, files), want_crc)

    def copies_once(self, source: FileRange, files: OpenFiles) -> bool:
        """Whether :meth:`copy` of ``source`` (a local range with no recorded CRC) with
        ``want_crc`` reads each byte once -- through a buffer, the CRC folded while the piece is
        in the CPU's cache, in the native core -- rather than the kernel's copy plus a worker's
        second read for the CRC. Where the kernel's copy could not share blocks anyway
        (:func:`_never_shared`) and the native core runs: measured on the dev VM (loaded), 1.2 GB
        in step, CPU of the process, 7 runs: the one pass 0.69-0.81 s (median 0.76) against
        0.99-1.76 s (median 1.08) for the kernel's copy and the worker's second read. The
        Python engine keeps the two passes (its CRC, zlib's, runs on the worker's core, beside
        the copy: one pass there would put it in line)."""
        return (
            self._fd is not None
            and source.size >= SMALL_COPY
            and is_local_range(source)
            and copies_natively()
            and _never_shared(files.file(source.path).fileno(), self._fd)
        )

    def _stream(self, chunks: Iterator[bytes], want_crc: bool) -> int | None:
        """Write ``chunks`` through the buffer; their CRC32 when ``want_crc``."""
        crc_value = 0
        for chunk in chunks:
            if want_crc:
                crc_value = crc32(chunk, crc_value)
            self.write(chunk)
        return crc_value if want_crc else None

    def _copy_plain(self, source: FileRange, files: OpenFiles, want_crc: bool) -> int | None:
        """:meth:`copy` of bytes stored as they are in one file."""
        if source.size < SMALL_COPY:
            # a small record (a training checkpoint has ~4 per parameter): one pread into the
            # buffered output beats a flush plus a copy_file_range call per record
            data = files.small_read(source.path, source.offset, source.size)
            if len(data) != source.size:
                raise BadInputError(f"{source.path}: the file ended inside tensor data (truncated?)")
            self.write(data)
            if not want_crc:
                return None
            return source.crc if source.crc is not None else crc32(data)
        if not is_local_range(source) or self._fd is None:  # no descriptor to copy from or to: streamed
            return self._stream(iter_chunks(source, files), want_crc)
        if want_crc and source.crc is None and _never_shared(files.file(source.path).fileno(), self._fd):
            return self._copy_with_crc(files.file(source.path).fileno(), source)
        crc = files.crc_in_background(source) if want_crc and source.crc is None else None
        pending = self._pending
        if (
            pending is not None
            and pending.path == source.path
            and pending.offset + pending.size == source.offset
            and pending.size < MERGE_LIMIT
        ):
            pending.size += source.size
        else:
            self._copy_pending()
            self._out.flush()
            self._pending = _PendingCopy(files, source.path, source.offset, source.size, self.offset)
        self.offset += source.size
        if crc is None:
            return source.crc
        self._copy_pending()  # now, while the worker computes the CRC beside it
        return crc.result()

    def _copy_with_crc(self, src_fd: int, source: FileRange) -> int:
        """Copy ``source`` through the placed buffer, its CRC32 computed on each piece while it is
        in the CPU's cache: one read of the source instead of two (the kernel's copy, then a
        worker's read for the CRC). Only where the kernel's copy could not share blocks anyway
        (:func:`_never_shared`). Measured on the dev VM, 1.2 GB in step, CPU: kernel copy plus
        the CRC's read 1.15-1.35 s, this 0.66-1.0 s."""
        assert self._fd is not None
        self._copy_pending()
        self._out.flush()
        crc = _bounce_copy(src_fd, source.offset, self._fd, self.offset, source.size, crc=True)
        self.offset += source.size
        self._out.seek(self.offset)
        return crc

    def _copy_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            assert self._fd is not None  # copies are held back only for an output with a descriptor
            src_fd = pending.files.file(pending.path).fileno()
            copy_range(src_fd, pending.offset, self._fd, pending.dst, pending.size)
            self._out.seek(pending.dst + pending.size)

    def flush(self) -> None:
        self._copy_pending()
        self._out.flush()
        if self._reserved_end > self.offset:
            assert self._fd is not None  # reserved only for an output with a descriptor
            os.ftruncate(self._fd, self.offset)
            self._reserved_end = self.offset


#: outputs shorter than this are not preallocated (one more system call is not worth it)
_PREALLOCATE_FROM = 1 << 24
#: ``FS_IOC_GETFLAGS`` (``_IOR('f', 1, long)``) where ``long`` is 8 bytes and ioctl numbers use
#: the generic layout, and the flag it reports for a file mapped by extents (``lsattr``'s ``e``)
_FS_IOC_GETFLAGS = {"x86_64": 0x80086601, "aarch64": 0x80086601}
_FS_EXTENT_FL = 0x00080000


def preallocates(fd: int) -> bool:
    """Whether :meth:`OutputStream.reserve` allocates ``fd``'s blocks ahead: on ext4, for a file
    mapped by extents (every file of a file system made with them, the default since 2008).

    Why: ext4 then skips its per-page bookkeeping of delayed allocation as the bytes come
    (measured on the dev VM, 1.2 GB written into a new file, CPU of the writing process: the
    kernel's in-step copy 0.41 -> 0.32 s, the buffered out-of-step copy 0.44 -> 0.36 s; the
    time until ``sync`` returns unchanged). Why only there: ``posix_fallocate`` falls back to
    writing a byte into every block where the file system has no ``fallocate`` of its own
    (ext4 files mapped by block lists, ext2/3, NFS before v4.2), which would cost more than it
    saves; other file systems were not measured, and on a copy-on-write one (XFS, btrfs) blocks
    allocated ahead would be dropped again where the kernel's copy shares the input's."""
    machine = os.uname().machine if hasattr(os, "uname") else ""
    if machine not in _FS_IOC_GETFLAGS or not hasattr(os, "posix_fallocate"):
        return False
    if _file_system(os.fstat(fd).st_dev) != "ext4":
        return False
    import fcntl  # Linux only, and only for a big output

    flags = bytearray(8)
    try:
        fcntl.ioctl(fd, _FS_IOC_GETFLAGS[machine], flags, True)
    except OSError:
        return False
    return bool(int.from_bytes(flags[:4], "little") & _FS_EXTENT_FL)


def _repeats(pending: _PendingCopy, data: bytes | bytearray | memoryview) -> bool:
    """Whether ``data`` is what the pending copy's file holds right after it."""
    return pending.files.small_read(pending.path, pending.offset + pending.size, len(data)) == data


def is_plain_range(source: object) -> TypeGuard[FileRange]:
    """True for bytes that sit in a file as they are (copyable by the kernel, mappable): a
    :class:`FileRange` with no compression."""
    return isinstance(source, FileRange) and source.deflated_size is None


def is_local_range(source: object) -> TypeGuard[FileRange]:
    """True for a plain range of a local file: one the kernel can copy and a worker can CRC by
    its descriptor. A remote object's range (a URL) is plain but has no descriptor: its bytes
    stream through Python, and their CRC is computed on the way."""
    return is_plain_range(source) and not is_url(source.path)


def iter_chunks(source: FileRange | ComputedSource, files: OpenFiles) -> Iterator[bytes]:
    """The bytes of ``source`` in bounded chunks, inflating compressed records."""
    if isinstance(source, JoinedSource):
        for piece in source.pieces:  # stored ranges, so the loop below reads each
            yield from _stored_chunks(piece, files)
        return
    if isinstance(source, ComputedSource):
        data = source.produce(files)
        if len(data) != source.size:
            raise RuntimeError(f"computed data is {len(data)} bytes, expected {source.size}")
        yield data
        return
    if source.deflated_size is None:
        yield from _stored_chunks(source, files)
        return
    yield from inflate_chunks(files.file(source.path), source.offset, source.deflated_size, source.size, source.path)


def _stored_chunks(source: FileRange, files: OpenFiles) -> Iterator[bytes]:
    """The bytes of an uncompressed range in bounded chunks."""
    f = files.file(source.path)
    if isinstance(f, RangeSource):
        yield from f.iter_range(source.offset, source.size)  # concurrent ranged reads, in order
        return
    done = 0
    while done < source.size:
        f.seek(source.offset + done)
        chunk = f.read(min(_CHUNK, source.size - done))
        if not chunk:
            raise BadInputError(f"{source.path}: the file ended inside tensor data (truncated?)")
        done += len(chunk)
        yield chunk


def inflate_chunks(f: BinaryIO, offset: int, compressed_size: int, size: int, where: str) -> Iterator[bytes]:
    """Inflate the raw deflate stream of ``compressed_size`` bytes at ``offset`` of ``f``,
    which must yield exactly ``size`` bytes.

    Memory stays at one chunk in and one chunk out whatever the stream claims: output is
    requested a chunk at a time, inflating stops as soon as it passes ``size``, and reading
    stops at the end of the deflate stream (bytes after it are ignored, as miniz does, instead
    of piling up in the inflater). A corrupt stream is bad input, not an internal error.
    """
    inflater = zlib.decompressobj(-15)
    read, produced = 0, 0
    while not inflater.eof and produced <= size:
        data = inflater.unconsumed_tail
        if not data and read < compressed_size:
            f.seek(offset + read)
            data = f.read(min(compressed_size - read, _CHUNK))
            read += len(data)
        try:
            # with no input left, an empty call still drains what zlib holds back (its output
            # was capped at one chunk): stopping there would lose the stream's last bytes
            out = inflater.decompress(data, _CHUNK)
        except zlib.error as exc:
            raise BadInputError(f"{where}: corrupt compressed data ({exc})") from None
        if not out and not data:
            break  # no input and nothing more to give: the stream is cut short
        produced += len(out)
        if out and produced <= size:
            yield out
    if produced != size or not inflater.eof:
        raise BadInputError(f"{where}: a compressed record does not inflate to its declared size")


def read_all(source: FileRange | ComputedSource, files: OpenFiles) -> bytes:
    """The whole range in memory: used only for one storage that must be gathered from."""
    return b"".join(iter_chunks(source, files))


def _reads(
    fd: int, offset: int, size: int, buffer_size: int, *, page_offset: int | None = None
) -> Iterator[bytes | memoryview]:
    """``size`` bytes of ``fd`` from ``offset``, a piece at a time, read into one reused buffer
    where the OS has ``preadv`` (a fresh multi-MiB ``bytes`` per read would be page-faulted in
    anew); each piece is valid until the next is asked for. A file that ends early (truncated
    while read) is bad input, never a short result.

    ``page_offset``: the buffer starts at that offset within a memory page (an anonymous map,
    page-aligned, viewed from there) rather than wherever ``malloc`` put it; see
    :func:`_bounce_copy`."""
    length = min(size, buffer_size)
    if page_offset is None:
        view = memoryview(bytearray(length))
    else:
        view = _page_buffer(length + BLOCK)[page_offset : page_offset + length]
    preadv = getattr(os, "preadv", None)
    done = 0
    while done < size:
        want = min(size - done, len(view))
        if preadv is not None:
            got = preadv(fd, [view[:want]], offset + done)
            chunk: bytes | memoryview = view[:got]
        else:
            chunk = os.pread(fd, want, offset + done)
            got = len(chunk)
        if got == 0:
            raise BadInputError("the input file ended while its data was being copied (truncated?)")
        yield chunk
        done += got


#: each thread's page-aligned buffer (:func:`_page_buffer`)
_PAGE_BUFFERS = threading.local()


def _page_buffer(size: int) -> memoryview:
    """A page-aligned buffer of at least ``size`` bytes: an anonymous map, one per thread, made
    once and kept (a fresh map for each of a checkpoint's tensors cost 200 ``munmap`` calls and
    its pages faulted in anew each time: ~0.04 s of CPU per 1.2 GB)."""
    buffer = getattr(_PAGE_BUFFERS, "buffer", None)
    if buffer is None or len(buffer) < size:
        import mmap  # only the out-of-step copy asks, on a local file system (Linux)

        buffer = _PAGE_BUFFERS.buffer = mmap.mmap(-1, size)
    return memoryview(buffer)


def crc_of_range(fd: int, offset: int, size: int) -> int:
    """CRC32 of ``size`` bytes of ``fd`` at ``offset``."""
    crc = 0
    for chunk in _reads(fd, offset, size, _CRC_CHUNK):
        crc = crc32(chunk, crc)
    return crc


def crc_of(source: FileRange, files: OpenFiles) -> int:
    crc = 0
    for chunk in iter_chunks(source, files):
        crc = crc32(chunk, crc)
    return crc


def copy_range(src_fd: int, src_offset: int, dst_fd: int, dst_offset: int, count: int) -> None:
    """Copy ``count`` bytes between files without passing them through Python.

    Uses ``copy_file_range`` (in-kernel, may share extents on CoW filesystems), and a
    bounded ``pread``/``pwrite`` loop where the kernel or filesystem cannot do that.

    When the two offsets are congruent modulo :data:`BLOCK` but not on a boundary, the head up
    to the next boundary is copied first and the aligned rest handed over in one call (the
    kernel shares blocks only for a call that starts on a boundary; it returns short at a
    partial last block, and the loop copies that tail).

    When they are not congruent, nothing can be shared, and on a local file system the
    kernel's copy costs about twice a buffered one: it splices whole source pages, each of
    which lands across two destination pages (measured on ext4, 1.2 GB in 200 ranges 8 bytes
    out of step: 0.9-1.3 s of CPU, against 0.5-0.7 s through a 256 KiB buffer and 0.55 s for
    ranges in step). Such ranges go through :func:`_bounce_copy` instead, where
    :func:`_page_cache_copy` says the kernel's copy is a page-cache copy too (not a network
    file system's server-side copy, which moves no bytes through this machine).
    """
    if count >= SMALL_COPY and (src_offset - dst_offset) % BLOCK and _page_cache_copy(src_fd, dst_fd):
        _bounce_copy(src_fd, src_offset, dst_fd, dst_offset, count)
        return
    head = -dst_offset % BLOCK if (src_offset - dst_offset) % BLOCK == 0 else 0
    done = 0
    copier = getattr(os, "copy_file_range", None)
    while done < count and copier is not None:
        upto = head if done < head else count
        try:
            n = copier(src_fd, dst_fd, min(upto, count) - done, src_offset + done, dst_offset + done)
        except OSError as exc:
            if exc.errno in (18, 22, 38, 95):  # EXDEV, EINVAL, ENOSYS, EOPNOTSUPP: try another way
                copier = None
                break
            raise
        if n == 0:
            raise BadInputError("the input file ended while its data was being copied (truncated?)")
        done += n
    if done < count:
        _bounce_copy(src_fd, src_offset + done, dst_fd, dst_offset + done, count - done)


#: the buffer :func:`_bounce_copy` moves bytes through: small enough to stay in the CPU's cache
#: between the read and the write (measured: 256 KiB beat 1 MiB by ~20%)
_BOUNCE = 1 << 18
#: a copy whose destination lies less than this many bytes after its source, modulo the page
#: size, runs at half speed (see :func:`_buffer_page_offset`)
_NEAR = 64


def _buffer_page_offset(src_offset: int, dst_offset: int) -> int:
    """Where in a page the bounce buffer should start so that neither of its two copies (source
    page -> buffer by ``pread``, buffer -> destination page by ``pwrite``) has its destination
    just after its source modulo the page size.

    Such a copy runs at about half speed (the kernel's ``rep movsb`` on x86: loads that alias
    the stores just made, 4 KiB apart). Measured on the dev VM (AMD EPYC, ext4, 1.2 GB copied by
    :func:`copy_range`, CPU seconds, 5 runs): with the buffer where ``malloc`` put it, source
    8 bytes into its page to a page boundary 0.79-0.81, 0 -> 1344 0.87-0.89, 64 -> 0 0.43-0.45;
    with the buffer placed here 0.44, 0.51-0.53 and 0.43-0.46 (the kernel's own copy of in-step
    ranges, as ``cp``: 0.41). The two distances add up to the destination's distance from the
    source, so they split it evenly (both at least :data:`_NEAR`), or, where it is short, are
    both made about half a page.
    """
    distance = (dst_offset - src_offset) % BLOCK
    to_buffer = distance // 2 if distance >= 2 * _NEAR else BLOCK // 2 + distance // 2
    return (src_offset + to_buffer) % BLOCK


def _bounce_copy(src_fd: int, src_offset: int, dst_fd: int, dst_offset: int, count: int, *, crc: bool = False) -> int:
    """Copy through one reused buffer (:func:`_reads`), placed for speed (:func:`_buffer_page_offset`);
    returns the CRC32 of the bytes copied when ``crc`` (else 0).

    The native core runs the same loop without a Python call per piece (~4 800 pieces per
    1.2 GB: preadv, the CRC call and pwrite each); where it declines (the Python engine, or
    the copy did not complete) this loop copies the range from the start and raises its own
    error."""
    at = _buffer_page_offset(src_offset, dst_offset)
    native = native_copy_range(src_fd, src_offset, dst_fd, dst_offset, count, at, crc)
    if native is not None:
        return native
    done = 0
    crc_value = 0
    for chunk in _reads(src_fd, src_offset, count, _BOUNCE, page_offset=at):
        if crc:
            crc_value = crc32(chunk, crc_value)
        written = 0
        while written < len(chunk):
            written += os.pwrite(dst_fd, chunk[written:], dst_offset + done + written)
        done += len(chunk)
    return crc_value


#: file systems whose ``copy_file_range`` copies through this machine's page cache (or shares
#: blocks, which out-of-step ranges never can): a buffered copy is no worse there. Anything
#: else -- NFS and SMB copy on the server, FUSE and cluster file systems do what they do --
#: keeps the kernel's copy.
_LOCAL_FILE_SYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "tmpfs", "bcachefs", "jfs"})


#: local file systems whose copies never share blocks (no reflink): there the kernel's copy of
#: a range is a page-cache copy like any other, and a copy that needs a CRC can read once
_NEVER_SHARED = frozenset({"ext2", "ext3", "ext4", "tmpfs"})


def _never_shared(src_fd: int, dst_fd: int) -> bool:
    """Whether both files are on a file system of :data:`_NEVER_SHARED` (Linux)."""
    return all(_file_system(os.fstat(fd).st_dev) in _NEVER_SHARED for fd in (src_fd, dst_fd))


def _page_cache_copy(src_fd: int, dst_fd: int) -> bool:
    """Whether both files are on a file system of :data:`_LOCAL_FILE_SYSTEMS` (Linux)."""
    return all(_file_system(os.fstat(fd).st_dev) in _LOCAL_FILE_SYSTEMS for fd in (src_fd, dst_fd))


@functools.cache
def _file_system(device: int) -> str | None:
    """The type of the file system mounted from ``device`` (``/proc/self/mountinfo``: "ID
    PARENT MAJOR:MINOR ROOT MOUNTPOINT OPTIONS [TAGS...] - TYPE SOURCE OPTIONS"), or None
    where that cannot be told (not Linux, not mounted as seen from here)."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                major, _, minor = fields[2].partition(":")
                if os.makedev(int(major), int(minor)) == device:
                    return fields[fields.index("-") + 1]
    except (OSError, ValueError, IndexError):
        return None
    return None
