"""The zip writer's sources as columns, read by the native core from the objects themselves
(native/src/zipsources.rs): a training checkpoint has ~200 000 small storages, and putting
their file, offset, size and CRC into columns cost a few Python steps each. The library reads
each ``FileRange``'s slots through the C API, as the emitter reads records (``emit.py``: a
table of C API functions, slot offsets found on probe objects, the GIL held, no Python code
run); anything else in the list is marked for the Python writer.

This layer knows no model records: the caller names the range class and its attributes.
"""

from __future__ import annotations

import ctypes
import functools
from array import array
from typing import Any, NamedTuple

from . import OutBuf, call, library
from .emit import _API_FUNCTIONS, _Api, slot_offset, type_offset

#: the range attributes read, in native/src/zipsources.rs ``PyRanges`` order
RANGE_FIELDS = ("path", "offset", "size", "crc", "deflated_size")


class _Ranges(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("file_range", "none", "int", "str_", "list")] + [
        (name, ctypes.c_size_t) for name in ("ob_type", *RANGE_FIELDS)
    ]
    _fields_ += [("small", ctypes.c_uint64)]


class SourceColumns(NamedTuple):
    """``kinds[i]`` is 1 for a small stored range of a local or remote file (the others are 0
    and their other columns 0); ``files[i]`` indexes ``paths``; ``crcs[i]`` is -1 for none."""

    kinds: bytes
    files: array[int]
    offsets: array[int]
    sizes: array[int]
    crcs: array[int]
    paths: list[str]


@functools.cache
def _bound(lib: ctypes.CDLL) -> tuple[Any, _Api]:
    fn = ctypes.PyDLL(lib._name).ckptfix_zip_source_columns
    fn.argtypes = (
        ctypes.POINTER(_Api),
        ctypes.POINTER(_Ranges),
        ctypes.py_object,
        ctypes.py_object,
        ctypes.POINTER(OutBuf),
    )
    fn.restype = ctypes.c_int32
    api = ctypes.pythonapi
    return fn, _Api(*(ctypes.cast(getattr(api, name), ctypes.c_void_p).value for name in _API_FUNCTIONS))


def source_columns(sources: list[Any], range_class: type, small: int) -> SourceColumns | None:
    """The columns of ``sources`` (an exact list), whose ranges are ``range_class`` objects
    (with :data:`RANGE_FIELDS`) and "small" below ``small`` bytes; None where the native engine
    does not run (or the objects are not laid out as probed)."""
    lib = library()
    if lib is None or type(sources) is not list:
        return None
    offsets = [type_offset(), *(slot_offset(range_class, name) for name in RANGE_FIELDS)]
    if None in offsets or not 0 <= small < 1 << 63:
        return None
    fn, api = _bound(lib)
    table = _Ranges(id(range_class), id(None), id(int), id(str), id(list), *offsets, small)
    paths: list[str] = []
    data = call(fn, ctypes.byref(api), ctypes.byref(table), sources, paths)
    if data is None:
        return None
    n = len(sources)
    view = memoryview(data)
    files, wide = array("I"), [array("q") for _ in range(3)]
    files.frombytes(view[n : 5 * n])
    for k, column in enumerate(wide):
        column.frombytes(view[5 * n + 8 * n * k : 5 * n + 8 * n * (k + 1)])
    return SourceColumns(bytes(view[:n]), files, wide[0], wide[1], wide[2], paths)
