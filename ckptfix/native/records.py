"""The reader's storage records built natively (``native/src/vm_records.rs``), or None.

Resolving 200 000 persistent ids in Python costs two dataclass ``__init__`` frames per storage
(its record and its byte range) and a ``"data/" + key`` string to look each up. The library
builds those objects itself through CPython's C API, as :mod:`ckptfix.native.emit` reads them:
a table of stable-ABI function addresses from ``ctypes.pythonapi``, a call through
``ctypes.PyDLL`` (the GIL held), each record allocated as ``object.__new__`` allocates it and
its slots set where :func:`~ckptfix.native.emit.slot_offset` found them on a probe.

This layer knows no model records: the caller (``formats/torchzip.py``) names the classes
and their slot names (:data:`STORAGE_SLOTS`, :data:`RANGE_SLOTS`, in the classes' field order).
"""

from __future__ import annotations

import ctypes
import functools
from array import array
from collections.abc import Sequence
from typing import Any

from . import Input, library
from .emit import _called, api_table, gil_function, slot_offset, type_offset

#: the C API functions the library calls, in vm_records.rs ``RecApi`` order
_API_FUNCTIONS = (
    "PyType_GenericAlloc",
    "PyLong_FromLongLong",
    "PyLong_AsLongLongAndOverflow",
    "PyList_New",
    "PyList_Size",
    "PyList_GetItem",
    "PyList_SetItem",
    "PyList_Append",
    "PyUnicode_AsUTF8AndSize",
    "Py_IncRef",
    "Py_DecRef",
    "PyErr_Occurred",
    "PyErr_Clear",
)

#: the storage record's slots the library sets, in vm_records.rs ``RecSpec`` order
STORAGE_SLOTS = ("key", "storage_type", "location", "numel", "itemsize", "dtype", "source", "byteorder")
#: the byte range's slots, likewise
RANGE_SLOTS = ("path", "offset", "size", "crc", "deflated_size")


class _Api(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in _API_FUNCTIONS]


class _Spec(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_void_p) for name in ("storage_type", "range_type", "str_type", "int_type", "none")),
        ("path", ctypes.c_void_p),
        ("order", ctypes.c_void_p),
        ("ob_type", ctypes.c_size_t),
        *((f"s_{name}", ctypes.c_size_t) for name in STORAGE_SLOTS),
        *((f"r_{name}", ctypes.c_size_t) for name in RANGE_SLOTS),
        ("base", ctypes.c_int64),
    ]


class _Columns(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_void_p) for name in ("kinds", "keys", "locations", "numels")),
        *((name, ctypes.c_void_p) for name in ("kind_globals", "kind_itemsizes", "kind_dtypes", "names")),
        ("start", ctypes.c_size_t),
    ]


class _Bound:
    """The storage builder of one loaded library, with its C API table."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self.fn = gil_function(
            lib,
            "ckptfix_vm_storages",
            ctypes.POINTER(_Api),
            ctypes.POINTER(_Spec),
            ctypes.POINTER(_Columns),
            *(ctypes.c_void_p, ctypes.c_size_t) * 4,
            ctypes.py_object,
        )
        self.api = api_table(_Api, _API_FUNCTIONS)


_bound: _Bound | None = None


def _function() -> _Bound | None:
    global _bound
    lib = library()
    if lib is None or not hasattr(lib, "ckptfix_vm_storages"):
        return None  # no library, or one built before the builder (the Python resolver runs)
    if _bound is None or _bound.lib is not lib:
        _bound = _Bound(lib)
    return _bound


@functools.cache
def _offsets(storage_class: type, range_class: type) -> tuple[int, ...] | None:
    """``ob_type`` and each slot's offset, or None where one is not a plain slot."""
    found = [
        type_offset(),
        *(slot_offset(storage_class, name) for name in STORAGE_SLOTS),
        *(slot_offset(range_class, name) for name in RANGE_SLOTS),
    ]
    if (
        None in found
        or tuple(getattr(storage_class, "__slots__", ())) != STORAGE_SLOTS
        or tuple(getattr(range_class, "__slots__", ())) != RANGE_SLOTS
    ):
        return None  # every slot must be set here: a record with another field would be half-made
    return tuple(found)  # type: ignore[arg-type]


def storages(
    storage_class: type,
    range_class: type,
    columns: tuple[list[int], list[str], list[str], list[int]],
    kind_tables: tuple[Sequence[Any], list[int], list[Any]],
    names: list[str],
    start: int,
    directory: tuple[array[int], array[int], array[int], array[int]],
    path: str,
    base: int,
    order: str,
) -> tuple[list[Any], array[int]] | None:
    """``storage_class(key, kind_globals[kind], location, numel, kind_itemsizes[kind],
    kind_dtypes[kind], range_class(path, base + data_offset[row], size[row], crc[row], None),
    order)`` for each persistent id's ``(kind, key, location, numel)`` in ``columns``, its record
    at row ``start + i`` named ``"data/" + key``, and each one's size: built natively, or None
    where the library leaves it to the caller (no library, or anything but torch.save's layout
    of stored records of exactly the declared size). ``directory``: the size, data offset,
    CRC and method columns (``array`` q, q, I, B)."""
    bound = _function()
    offsets = _offsets(storage_class, range_class)
    if bound is None or offsets is None or not 0 <= base < 1 << 63:
        return None
    kinds, keys, locations, numels = columns
    kind_globals, kind_itemsizes, kind_dtypes = (list(t) for t in kind_tables)
    kind_dtypes = ["" if d is None else d for d in kind_dtypes]  # item size 0 marks those: never built
    keep = (kinds, keys, locations, numels, kind_globals, kind_itemsizes, kind_dtypes, names)
    spec = _Spec(*(id(o) for o in (storage_class, range_class, str, int, None, path, order)), *offsets, base)
    table = _Columns(*(id(o) for o in keep), start)
    sizes, offsets_, crcs, methods = directory
    if (sizes.itemsize, offsets_.itemsize, crcs.itemsize, methods.itemsize) != (8, 8, 4, 1):
        return None
    inputs = [Input(c) for c in directory]
    result: list[list[Any]] = []
    data = _called(
        bound.fn,
        ctypes.byref(bound.api),
        ctypes.byref(spec),
        ctypes.byref(table),
        *(v for i in inputs for v in (i.address, i.length)),
        result,
    )
    del keep
    if data is None or len(result) != 1:
        return None
    made = array("q")
    made.frombytes(data)
    return result[0], made
