"""The native emitter's door: ``native/src/emit_py.rs`` pickles a live tree in torch's layout.

The emitter's cost in Python is the walk: a few Python steps per object, ~10 objects per
tensor. Handing the tree over as bytes would pay that walk again (a ``pickle.Pickler`` with a
reducer per record still makes a Python call or two per tensor, and measured ~0.8 s of the
Python emitter's ~2 s on the 200 000-tensor checkpoint). So the library reads the objects
themselves, through CPython's C API: this module gives it a table of C API function
addresses (from ``ctypes.pythonapi``: stable-ABI functions, so one library serves every
Python 3) and calls it through ``ctypes.PyDLL``, which keeps the GIL for the call.

This layer knows no model records: the caller (``pickling/writer.py``) names the types and
markers the tree may hold and their attribute names (:data:`OBJECT_FIELDS`).
"""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Mapping
from typing import Any

from . import OutBuf, call, library

#: the C API functions the library calls, in native/src/emit_py.rs ``PyApi`` order
_API_FUNCTIONS = (
    "PyDict_Next",
    "PyList_Size",
    "PyList_GetItem",
    "PyList_Append",
    "PyTuple_Size",
    "PyTuple_GetItem",
    "PyUnicode_AsUTF8AndSize",
    "PyLong_AsLongLongAndOverflow",
    "PyFloat_AsDouble",
    "PyObject_GetAttr",
    "PyObject_Type",
    "PyObject_CallObject",
    "PyObject_GetIter",
    "PyIter_Next",
    "Py_DecRef",
    "PyErr_Occurred",
    "PyErr_Clear",
)

#: the objects the caller supplies, in native/src/emit_py.rs ``PyTypes`` order: markers and
#: types first, then attribute names (``a_...``: the library reads ``getattr(obj, name)``)
OBJECT_FIELDS = (
    "none",
    "true_",
    "false_",
    "empty_hooks",
    "absent",
    "int",
    "float",
    "str_",
    "tuple",
    "list",
    "dict",
    "ordered_dict",
    "tensor",
    "storage",
    "global",
    "param",
    "reduce",
    "a_storage",
    "a_storage_offset",
    "a_shape",
    "a_stride",
    "a_requires_grad",
    "a_hooks",
    "a_rebuild",
    "a_dtype_global",
    "a_metadata",
    "a_param",
    "a_storage_type",
    "a_location",
    "a_numel",
    "a_module",
    "a_name",
    "a_allowed",
    "a_state",
    "a_func",
    "a_args",
    "a_items",
    "a_dict",
)


class _Api(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in _API_FUNCTIONS]


class _Objects(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in OBJECT_FIELDS]


class _Bound:
    """The emitter function of one loaded library, with its C API table."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        # the same library again, as a PyDLL: its calls keep the GIL (the library reads objects)
        self.fn = ctypes.PyDLL(lib._name).ckptfix_emit_torch_pickle
        self.fn.argtypes = (
            ctypes.POINTER(_Api),
            ctypes.POINTER(_Objects),
            ctypes.py_object,
            ctypes.py_object,
            ctypes.POINTER(OutBuf),
        )
        self.fn.restype = ctypes.c_int32
        api = ctypes.pythonapi
        self.api = _Api(*(ctypes.cast(getattr(api, name), ctypes.c_void_p).value for name in _API_FUNCTIONS))


_bound: _Bound | None = None


def _function() -> _Bound | None:
    global _bound
    lib = library()
    if lib is None:
        return None
    if _bound is None or _bound.lib is not lib:
        _bound = _Bound(lib)
    return _bound


def available() -> bool:
    """Whether the native emitter runs in this process (the native engine is loaded)."""
    return library() is not None


def torch_pickle(root: Any, objects: Mapping[str, Any]) -> tuple[bytes, list[Any]] | None:
    """``root`` pickled as ``torch.save`` lays it out, and the storage records in key order;
    None when the Python emitter is to run (the Python engine, or a tree holding something
    the native emitter leaves to it). ``objects`` maps each of :data:`OBJECT_FIELDS` to its
    object (kept alive by the caller)."""
    bound = _function()
    if bound is None:
        return None
    table = _Objects(*(id(objects[name]) for name in OBJECT_FIELDS))
    storages: list[Any] = []
    collecting = gc.isenabled()
    gc.disable()  # no collection (and so no finalizer's Python code) while the library reads
    try:
        data = call(bound.fn, ctypes.byref(bound.api), ctypes.byref(table), root, storages)
    finally:
        if collecting:
            gc.enable()
    if data is None:
        return None
    return data, storages
