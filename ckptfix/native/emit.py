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
import functools
import gc
import sys
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
    "PyObject_CallObject",
    "PyObject_GetIter",
    "PyIter_Next",
    "Py_DecRef",
    "PyErr_Occurred",
    "PyErr_Clear",
)

#: the objects the caller supplies, in native/src/emit_py.rs ``PyTypes`` order: markers and
#: types, then the attribute names read with ``getattr`` (``a_...``)
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
    "a_items",
    "a_dict",
)

#: the record slots the library reads directly, in ``PyTypes`` order after ``ob_type``: the
#: caller maps each to (class, attribute) and :func:`slot_offset` finds where it is
SLOT_FIELDS = (
    "t_storage",
    "t_storage_offset",
    "t_shape",
    "t_stride",
    "t_requires_grad",
    "t_hooks",
    "t_rebuild",
    "t_dtype_global",
    "t_metadata",
    "t_param",
    "s_storage_type",
    "s_location",
    "s_numel",
    "g_module",
    "g_name",
    "g_allowed",
    "p_requires_grad",
    "p_hooks",
    "p_state",
    "r_func",
    "r_args",
    "r_state",
)

_POINTER = ctypes.sizeof(ctypes.c_void_p)


def _offsets_of(probe: object, target: object, size: int) -> list[int]:
    """Where in ``probe``'s first ``size`` bytes a pointer to ``target`` is stored."""
    raw = ctypes.string_at(id(probe), size)
    key = id(target).to_bytes(_POINTER, sys.byteorder)
    return [at for at in range(0, size - _POINTER + 1, _POINTER) if raw[at : at + _POINTER] == key]


@functools.cache
def type_offset() -> int | None:
    """Where an object keeps its type pointer (``ob_type``), found on probes; None if unclear."""
    probes: tuple[object, ...] = (object(), 1.5, [], {}, ())
    # each probe is read only within its own fixed part (``__basicsize__``: 16 bytes for object())
    found = set.intersection(*(set(_offsets_of(p, type(p), type(p).__basicsize__)) for p in probes))
    return found.pop() if len(found) == 1 else None


@functools.cache
def slot_offset(cls: type, name: str) -> int | None:
    """Where instances of ``cls`` keep slot ``name``: set it to a fresh object on a probe
    instance and find that pointer. None unless it is a plain slot (a member descriptor) found
    exactly once within the instance."""
    if type(cls.__dict__.get(name)).__name__ != "member_descriptor" or cls.__itemsize__:
        return None
    probe: object = object.__new__(cls)
    marker = object()
    object.__setattr__(probe, name, marker)  # also on frozen dataclasses: their slots are plain
    found = _offsets_of(probe, marker, cls.__basicsize__)
    return found[0] if len(found) == 1 else None


class _Api(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in _API_FUNCTIONS]


class _Objects(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in OBJECT_FIELDS] + [
        (name, ctypes.c_size_t) for name in ("ob_type", *SLOT_FIELDS)
    ]


class _Uses(ctypes.Structure):
    """emit_py.rs's ``PyUses``: what the ``_whole`` entry point reads besides."""

    _fields_ = (
        ("t_dtype", ctypes.c_size_t),
        ("s_itemsize", ctypes.c_size_t),
        ("dtypes_ptr", ctypes.c_char_p),
        ("dtypes_len", ctypes.c_size_t),
    )


def gil_function(lib: ctypes.CDLL, name: str, *argtypes: Any) -> Any:
    """``name`` from ``lib`` loaded again as a PyDLL -- its calls keep the GIL, as a library that
    reads or builds Python objects needs -- taking ``argtypes`` and the output buffer, returning
    the status (the ``ffi`` conventions)."""
    fn = getattr(ctypes.PyDLL(lib._name), name)
    fn.argtypes = (*argtypes, ctypes.POINTER(OutBuf))
    fn.restype = ctypes.c_int32
    return fn


def api_table(table: type[ctypes.Structure], names: tuple[str, ...]) -> Any:
    """``table`` filled with the addresses of CPython's C API functions ``names``, in order:
    what the library calls Python through (it links no Python)."""
    api = ctypes.pythonapi
    return table(*(ctypes.cast(getattr(api, name), ctypes.c_void_p).value for name in names))


class _Bound:
    """The emitter functions of one loaded library, with its C API table."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        api, objects, tree = ctypes.POINTER(_Api), ctypes.POINTER(_Objects), ctypes.py_object
        self.fn = gil_function(lib, "ckptfix_emit_torch_pickle", api, objects, tree, ctypes.py_object)
        self.whole_fn = gil_function(
            lib,
            "ckptfix_emit_torch_pickle_whole",
            api,
            objects,
            ctypes.POINTER(_Uses),
            tree,
            ctypes.py_object,
            ctypes.POINTER(ctypes.c_uint8),
        )
        self.api = api_table(_Api, _API_FUNCTIONS)


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


def _objects(objects: Mapping[str, Any], slots: Mapping[str, tuple[type, str]]) -> _Objects | None:
    offsets = [type_offset(), *(slot_offset(*slots[name]) for name in SLOT_FIELDS)]
    if None in offsets:  # an interpreter whose objects are not laid out as probed
        return None
    return _Objects(*(id(objects[name]) for name in OBJECT_FIELDS), *offsets)


def _called(fn: Any, *args: Any) -> bytes | None:
    collecting = gc.isenabled()
    gc.disable()  # no collection (and so no finalizer's Python code) while the library reads
    try:
        return call(fn, *args)
    finally:
        if collecting:
            gc.enable()


@functools.cache
def _dtype_table(itemsizes: tuple[tuple[str, int], ...]) -> bytes:
    """``u8 len, name, u8 itemsize`` for each dtype (emit_py.rs's ``PyUses`` table); a dtype
    that does not fit is left out (the library then leaves its storages to Python)."""
    table = bytearray()
    for name, size in itemsizes:
        raw = name.encode()
        if len(raw) < 256 and 0 < size < 256:
            table += bytes((len(raw), *raw, size))
    return bytes(table)


def torch_pickle_whole(
    root: Any,
    objects: Mapping[str, Any],
    slots: Mapping[str, tuple[type, str]],
    uses: tuple[tuple[type, str], tuple[type, str]],
    itemsizes: Mapping[str, int],
) -> tuple[bytes, list[Any], bool] | None:
    """:func:`torch_pickle`, and whether every storage a tensor uses is spanned whole by one of
    them (offset 0, ``extent * itemsize >= storage bytes``: compaction has nothing to cut).
    ``uses`` names the tensor's dtype attribute and the storage's item size attribute as
    (class, attribute); ``itemsizes`` maps each dtype to its item size. None as
    :func:`torch_pickle`."""
    bound = _function()
    if bound is None:
        return None
    table = _objects(objects, slots)
    at = [slot_offset(*uses[0]), slot_offset(*uses[1])]
    if table is None or None in at:
        return None
    dtypes = _dtype_table(tuple(itemsizes.items()))
    use_table = _Uses(at[0], at[1], dtypes, len(dtypes))
    storages: list[Any] = []
    whole = ctypes.c_uint8(0)
    data = _called(
        bound.whole_fn,
        ctypes.byref(bound.api),
        ctypes.byref(table),
        ctypes.byref(use_table),
        root,
        storages,
        ctypes.byref(whole),
    )
    return None if data is None else (data, storages, bool(whole.value))


def torch_pickle(
    root: Any, objects: Mapping[str, Any], slots: Mapping[str, tuple[type, str]]
) -> tuple[bytes, list[Any]] | None:
    """``root`` pickled as ``torch.save`` lays it out, and the storage records in key order;
    None when the Python emitter is to run (the Python engine, or a tree holding something
    the native emitter leaves to it). ``objects`` maps each of :data:`OBJECT_FIELDS` to its
    object (kept alive by the caller), ``slots`` each of :data:`SLOT_FIELDS` to the class and
    attribute it names."""
    bound = _function()
    if bound is None:
        return None
    table = _objects(objects, slots)
    if table is None:
        return None
    storages: list[Any] = []
    data = _called(bound.fn, ctypes.byref(bound.api), ctypes.byref(table), root, storages)
    if data is None:
        return None
    return data, storages
