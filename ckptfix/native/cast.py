"""Casts over columns and gathered reads, through the native core (native/src/cast.rs,
native/src/gather.rs): a training checkpoint's ~50 000 small tensors cast to bfloat16 or
copied into a safetensors file cost one numpy cast or one Python read each; here a batch of
them costs one call.

The casts give the same bytes as :func:`ckptfix.model.numeric.cast_float_bytes` (the
reference: torch's ``Tensor.to``), element for element; a cast does not care where one
storage ends and the next begins, so many storages' elements go end to end into one call.
This layer knows bytes and dtype names, not model records.
"""

from __future__ import annotations

import ctypes
import functools
from array import array
from typing import Any

from . import Input, call, function, library

#: the float formats the native cast knows, by its codes (native/src/cast.rs ``Float``)
FLOAT_CODES = {"float16": 0, "bfloat16": 1, "float32": 2, "float64": 3}


@functools.cache
def _cast_fn(lib: Any) -> Any:
    return function(
        "ckptfix_cast_floats", ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32
    )


@functools.cache
def _gather_fn(lib: Any) -> Any:
    return function(
        "ckptfix_gather_ranges",
        ctypes.c_int32,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_void_p,
        ctypes.c_size_t,
    )


#: the exports this module calls: a library built before them (the same ABI version, so the
#: loader takes it) runs the Python paths, as crc.py's and records.py's callers do
_EXPORTS = ("ckptfix_cast_floats", "ckptfix_gather_ranges")


@functools.cache
def _has_exports(lib: Any) -> bool:
    return all(hasattr(lib, name) for name in _EXPORTS)


def _library() -> Any | None:
    """The loaded library when it has this module's exports, else None (the Python paths)."""
    lib = library()
    return lib if lib is not None and _has_exports(lib) else None


def available() -> bool:
    """Whether the native engine runs (the loader's choice, cached there) with these exports."""
    return _library() is not None


def cast_floats(data: Any, source: str, target: str, swap: bool = False) -> bytes | None:
    """``data`` (elements of ``source``, little-endian; big-endian with ``swap``) cast to
    ``target``; None where the native engine does not run or does not know the dtypes."""
    lib = _library()
    if lib is None or source not in FLOAT_CODES or target not in FLOAT_CODES:
        return None
    buf = Input(data)
    return call(_cast_fn(lib), buf.address, buf.length, FLOAT_CODES[source], FLOAT_CODES[target], int(swap))


def gather(fd: int, offsets: array[int], sizes: array[int]) -> bytes | None:
    """The ranges (``offsets[i]``, ``sizes[i]``: arrays of type ``'Q'``) of the open file ``fd``,
    end to end; None where the native engine does not run, or a range is not all in the file
    (the caller's Python reads then raise their own error)."""
    lib = _library()
    if lib is None or len(offsets) != len(sizes):
        return None
    first, second = Input(offsets), Input(sizes)
    return call(_gather_fn(lib), fd, first.address, first.length, second.address, second.length)
