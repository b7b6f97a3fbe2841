"""CRC-32 (zip's, zlib's) of big buffers through the native core, ``zlib.crc32`` otherwise.

Every byte ckptfix copies into a zip record is checksummed (a copied record is checked against
the CRC its source recorded), so on a large checkpoint the CRC is a pass over the whole file
beside the kernel's copy. zlib computes it at 1-3 GB/s on the machines measured; the native
core folds it with carry-less multiplication at ~10-20 GB/s (``native/src/crc.rs``).

Both give the same number for every input (the native tests check it against zlib on every
length and alignment); which one runs is an implementation detail. Small buffers stay with
zlib: a ctypes call costs a few microseconds, which is what zlib needs for ~16 KiB. Like
``zlib.crc32``, the native call releases the GIL (ctypes does for every ``CDLL`` call), so a
worker thread's CRC runs beside the main thread's copy.
"""

from __future__ import annotations

import ctypes
import functools
import zlib
from typing import Any

from . import Input, call, function, library

#: below this many bytes zlib is as fast as the call into the library (measured on the 2-core dev
#: VM, CPU time: a call costs ~4 us, zlib takes 5 us for 16 KiB and 20 us for 64 KiB, where the
#: native CRC takes 6 and 10)
NATIVE_FROM = 1 << 15


def _native() -> Any | None:
    """``ckptfix_crc32``, or None when the Python engine runs (asked each time: the engine is
    the loader's choice, cached there)."""
    lib = library()
    return None if lib is None else _bind(lib)


@functools.cache
def _bind(lib: Any) -> Any:
    return function("ckptfix_crc32", ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_uint32))


def crc32(data: Any, value: int = 0) -> int:
    """The CRC-32 of ``data`` (any bytes-like object) continuing from ``value``, as
    ``zlib.crc32(data, value)`` returns it."""
    if len(data) < NATIVE_FROM or (fn := _native()) is None:
        return zlib.crc32(data, value)
    return native_crc32(fn, data, value)


def native_crc32(fn: Any, data: Any, value: int) -> int:
    """One call into ``ckptfix_crc32`` (``data`` is borrowed for the call, not copied)."""
    buf = Input(data)
    result = ctypes.c_uint32()
    if call(fn, value & 0xFFFFFFFF, buf.address, buf.length, ctypes.byref(result)) is None:
        return zlib.crc32(data, value)  # not reached: the native CRC supports every input
    return result.value


@functools.cache
def _bind_copy(lib: Any) -> Any:
    u64 = ctypes.c_uint64
    if not hasattr(lib, "ckptfix_copy_range"):  # a library built before it (same ABI otherwise)
        return None
    return function(
        "ckptfix_copy_range",
        ctypes.c_int32,
        u64,
        ctypes.c_int32,
        u64,
        u64,
        ctypes.c_uint32,
        ctypes.c_uint32,
        ctypes.POINTER(ctypes.c_uint32),
    )


def copies_natively() -> bool:
    """Whether :func:`copy_range` runs in the native core (the native engine is loaded)."""
    lib = library()
    return lib is not None and _bind_copy(lib) is not None


def copy_range(
    src_fd: int, src_offset: int, dst_fd: int, dst_offset: int, count: int, page_offset: int, want_crc: bool
) -> int | None:
    """Copy ``count`` bytes of ``src_fd`` at ``src_offset`` to ``dst_fd`` at ``dst_offset``
    through one buffer placed ``page_offset`` bytes into a page, in the native core
    (``native/src/copyrange.rs``): each piece read once, its CRC-32 folded while it is in the
    CPU's cache, then written. Returns that CRC (0 without ``want_crc``), or None where the
    Python engine runs or the copy did not complete (an I/O error, a source that ended early):
    the caller then copies the range itself and raises its own error. ctypes releases the GIL
    for the call."""
    lib = library()
    fn = None if lib is None else _bind_copy(lib)
    if fn is None:
        return None
    result = ctypes.c_uint32()
    done = call(fn, src_fd, src_offset, dst_fd, dst_offset, count, page_offset, int(want_crc), ctypes.byref(result))
    return None if done is None else result.value
