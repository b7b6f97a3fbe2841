"""The zip container's hot loops in the native core (native/src/zip*.rs).

:func:`read_directory` reads a zip's whole directory -- end records, every entry, names, local
headers, overlaps -- with the checks of ``fileio/ziparchive.py``'s Python reader (the
reference) and hands back columns: the names as one string and the numbers as packed arrays,
which :class:`~ckptfix.fileio.ziparchive.ZipDirectory` adopts without a Python object per
record (a training checkpoint has ~4 records per parameter). ``None`` means "the Python engine
reads it": the library is not loaded, or the archive has something the native reader leaves
to the reference (a non-ASCII name, an I/O error).
"""

from __future__ import annotations

import ctypes
import functools
from array import array
from collections.abc import Callable
from itertools import accumulate
from typing import Any, NamedTuple

from . import Input, call, call_into, function, library


class Columns(NamedTuple):
    """A directory as columns, in directory order (``ZipDirectory``'s own layout)."""

    names: list[str]
    data_offset: array[int]
    compressed_size: array[int]
    size: array[int]
    header_offset: array[int]
    crc: array[int]
    method: array[int]


def _decode(data: bytes) -> Columns:
    """zip.rs's ``Directory::encode``: ``u64 n``, four ``i64[n]`` columns, ``u32[n]``, ``u8[n]``,
    then the names joined by NUL (which no accepted name holds)."""
    view = memoryview(data)
    n = int.from_bytes(view[:8], "little")
    at = 8
    wide = []
    for _ in range(4):
        column = array("q")
        column.frombytes(view[at : at + 8 * n])
        wide.append(column)
        at += 8 * n
    crc = array("I")
    crc.frombytes(view[at : at + 4 * n])
    at += 4 * n
    method = array("B")
    method.frombytes(view[at : at + n])  # array("B", view) would iterate it
    at += n
    names = bytes(view[at:]).decode("ascii").split("\x00") if n else []
    if len(names) != n or crc.itemsize != 4:
        raise RuntimeError("native engine bug: a zip directory's columns do not add up")
    return Columns(names, wide[0], wide[1], wide[2], wide[3], crc, method)


def read_directory(fd: int, base: int, size: int, limit: int | None) -> Columns | None:
    """The directory of the zip in the open file ``fd`` (``size`` bytes from ``base``; reads stop
    ``limit`` bytes past ``base`` when given), or None for the Python engine. A refusal raises
    :class:`~ckptfix.errors.BadInputError` with the reference's message, less the file name."""
    fn = function("ckptfix_zip_read_directory", ctypes.c_int32, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64)
    if fn is None:
        return None
    data = call(fn, fd, base, size, -1 if limit is None else limit)
    return None if data is None else _decode(data)


def read_directory_bytes(archive: bytes) -> Columns | None:
    """The directory of a zip held in memory (differential tests and fuzzing)."""
    fn = function("ckptfix_zip_read_directory_bytes", ctypes.c_void_p, ctypes.c_size_t)
    if fn is None:
        return None
    source = Input(archive)
    data = call(fn, source.address, source.length)
    return None if data is None else _decode(data)


def available() -> bool:
    """Whether the native engine runs (the writer then lets small records wait for it)."""
    return library() is not None


def _items(items: list[bytes]) -> tuple[bytes, array[int]]:
    """Variable-length items as one blob and the end offset of each (``u64``)."""
    return b"".join(items), array("Q", accumulate(map(len, items)))


def small_records(
    names: list[bytes], data: list[bytes], crcs: array[int], offset: int, threshold: int
) -> tuple[bytes, array[int]] | None:
    """The bytes ``ZipWriter.add_small`` writes for each of these records, one after another
    from ``offset`` (local header, padding, data, descriptor), and each one's header offset; or
    None for the Python writer (the library is not loaded, or a value does not fit its field)."""
    fn = function(
        "ckptfix_zip_small_records", *(ctypes.c_void_p, ctypes.c_size_t) * 5, ctypes.c_uint64, ctypes.c_uint64
    )
    if fn is None or not 0 <= offset < 1 << 63 or not 0 <= threshold < 1 << 64:
        return None
    name_blob, name_ends = _items(names)
    data_blob, data_ends = _items(data)
    inputs = [Input(b) for b in (name_blob, name_ends, data_blob, data_ends, crcs)]
    built = call(fn, *(v for i in inputs for v in (i.address, i.length)), offset, threshold)
    if built is None:
        return None
    cut = len(built) - 8 * len(crcs)
    offsets = array("q")
    offsets.frombytes(memoryview(built)[cut:])
    return built[:cut], offsets


def central_directory(
    name_blob: bytes,
    name_ends: array[int],
    header_offsets: array[int],
    sizes: array[int],
    crcs: array[int],
    cd_offset: int,
    threshold: int,
) -> bytes | None:
    """``ZipWriter.close``'s central directory and end records for these records (named by
    ``name_blob``, the names end to end, ``name_ends`` where each ends: ``u64``), the directory
    starting at ``cd_offset``; or None for the Python writer."""
    written: list[bytes] = []
    done = write_central_directory(
        lambda view: written.append(bytes(view)),
        name_blob,
        name_ends,
        header_offsets,
        sizes,
        crcs,
        cd_offset,
        threshold,
    )
    return (written[0] if written else b"") if done else None


def write_central_directory(
    sink: Callable[[memoryview], object],
    name_blob: bytes | bytearray,
    name_ends: array[int],
    header_offsets: array[int],
    sizes: array[int],
    crcs: array[int],
    cd_offset: int,
    threshold: int,
) -> bool:
    """:func:`central_directory` handed to ``sink`` as a view of the library's buffer (not
    copied into a ``bytes``: ~70 bytes a record, 14 MB at 200 000 records); False for the
    Python writer. ``name_blob`` may be the writer's own ``bytearray`` (not resized meanwhile)."""
    fn = function(
        "ckptfix_zip_central_directory", *(ctypes.c_void_p, ctypes.c_size_t) * 5, ctypes.c_uint64, ctypes.c_uint64
    )
    if fn is None or not 0 <= cd_offset < 1 << 63 or not 0 <= threshold < 1 << 64:
        return False
    if name_ends.itemsize != 8 or header_offsets.itemsize != 8 or sizes.itemsize != 8 or crcs.itemsize != 4:
        return False
    inputs = [Input(b) for b in (name_blob, name_ends, header_offsets, sizes, crcs)]
    return call_into(sink, fn, *(v for i in inputs for v in (i.address, i.length)), cd_offset, threshold)


@functools.cache
def _copy_function(lib: ctypes.CDLL) -> Any:
    """``ckptfix_zip_copy_records`` of ``lib``, bound once (setting a ctypes function's argument
    types costs about a millisecond: one call per run of records)."""
    return function(
        "ckptfix_zip_copy_records", *(ctypes.c_void_p, ctypes.c_size_t) * 7, ctypes.c_uint64, ctypes.c_uint64
    )


class Copied(NamedTuple):
    """What :func:`copy_records` wrote: the records' bytes, and each one's header offset and CRC."""

    data: bytes
    header_offsets: array[int]
    crcs: array[int]


def copy_records(
    fds: array[int],
    files: array[int],
    offsets: array[int],
    sizes: array[int],
    crcs: array[int],
    name_blob: bytes,
    name_lengths: array[int],
    offset: int,
    threshold: int,
) -> Copied | None:
    """The bytes ``ZipWriter.add_copy`` writes for each of these small records, read from the
    open descriptors ``fds`` (record ``i`` is ``sizes[i]`` bytes of ``fds[files[i]]`` at
    ``offsets[i]``; ``crcs[i]`` the CRC its source recorded, -1 for none), one after another
    from ``offset``, named by ``name_blob`` (the names with the archive folder, end to end, each
    ``name_lengths[i]`` bytes long). None for the Python writer: the
    library is not loaded, or a record is one the reference refuses or words an error about (a
    CRC that does not match, a file that ends inside a record) -- it then raises its own."""
    lib = library()
    fn = None if lib is None else _copy_function(lib)
    if fn is None or not 0 <= offset < 1 << 63 or not 0 <= threshold < 1 << 64:
        return None
    widths = ((fds, 4), (files, 4), (offsets, 8), (sizes, 8), (crcs, 8))
    if any(column.itemsize != width for column, width in widths):
        return None
    name_ends = array("Q", accumulate(name_lengths))
    inputs = [Input(b) for b in (fds, files, offsets, sizes, crcs, name_blob, name_ends)]
    built = call(fn, *(v for i in inputs for v in (i.address, i.length)), offset, threshold)
    if built is None:
        return None
    n = len(sizes)
    view = memoryview(built)
    cut = len(built) - 12 * n
    header_offsets, written = array("q"), array("I")
    header_offsets.frombytes(view[cut : cut + 8 * n])
    written.frombytes(view[cut + 8 * n :])
    return Copied(built[:cut], header_offsets, written)
