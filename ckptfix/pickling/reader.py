"""The reader's side of the pickle VM: one registry of allowed globals, inert records, nothing run.

:mod:`ckptfix.pickle_vm` executes the opcodes; this module answers the four questions through
which a pickle could reach code (:class:`ReaderHooks`):

* ``GLOBAL`` -- only names in :data:`TORCH_GLOBALS` / :data:`PYTHON_GLOBALS`, or matching an
  ``--allow-global`` pattern, and only valid dotted identifiers; the answer is always an inert
  :class:`~ckptfix.tree.Global` record (nothing is imported). Anything else stops the read at
  once, before the pickle can call it.
* ``REDUCE``/``NEWOBJ`` -- a table from global name to builder (:data:`BUILDERS`): tensor
  rebuilds make :class:`~ckptfix.tree.TensorRef` records, the few Python builtins a plain
  checkpoint needs make real (checked) values, other torch calls make a
  :class:`~ckptfix.tree.Reduce` record, allowed-by-name classes an
  :class:`~ckptfix.tree.OpaqueObject`. Calling anything else is refused.
* ``BUILD`` -- only where torch's own weights-only unpickler allows it and only on our records:
  an OrderedDict's attributes (handled by the VM) and allowed-by-name objects (once).
* persistent ids -- only ``("storage", <storage class>, key, location, numel[, view])``.

The allow-list is a subset of what ``torch.load(weights_only=True)`` accepts (a test checks),
so what we read is what a safe ``torch.load`` would read, and what we write loads the same way.
Nested pickles carried as bytes inside allowed-by-name objects are read by the same VM and
must name only allowed globals; ``torch.storage._load_from_bytes`` (``torch.load`` of its
bytes) is never allowed, not even by ``--allow-global``.
"""

from __future__ import annotations

import fnmatch
import functools
import gc
import mmap
from _compat_pickle import IMPORT_MAPPING, NAME_MAPPING
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import BadInputError, UnsafeInputError
from ..model.dtypes import DTYPE_ITEMSIZE, QSCHEMES, STORAGE_DTYPE, TENSOR_CLASS_NAMES
from ..model.paths import Path
from ..model.refs import ABSENT, EMPTY_HOOKS, Global, OpaqueObject, ParamInfo, Reduce, StorageRef, TensorRef, Tree
from ..model.walk import check_nesting, walk
from . import native_tree
from .globals import (
    MODULE_ALIASES,
    SANITIZABLE,
    allow_options,
    canonical_name,
    companion,
    danger,
    kept_along,
    resolved_name,
)
from .names import is_dotted_identifier
from .recording import looks_like_pickle, protocol2_bytes, record_globals
from .vm import Budgets, Hooks, PickleVM, collector_paused

_REBUILD_FUNCTIONS = (
    "_rebuild_tensor",
    "_rebuild_tensor_v2",
    "_rebuild_tensor_v3",
    "_rebuild_parameter",
    "_rebuild_parameter_with_state",
    "_rebuild_qtensor",
    "_rebuild_sparse_tensor",
    "_rebuild_nested_tensor",
    "_rebuild_wrapper_subclass",
    "_rebuild_meta_tensor_no_storage",
    "_rebuild_device_tensor_from_numpy",
    "_rebuild_device_tensor_from_cpu_tensor",
)


def _storage_class_names() -> frozenset[str]:
    names = {"torch.storage.UntypedStorage", "torch.storage.TypedStorage"}
    for storage in STORAGE_DTYPE:
        if storage != "UntypedStorage":
            names.add(f"torch.{storage}")
            if not storage.startswith("Q"):
                names.add(f"torch.cuda.{storage}")
    return frozenset(names)


#: storage classes a persistent id may name
STORAGE_GLOBALS: frozenset[str] = _storage_class_names()
#: dtype globals (``torch.float32``) a ``_rebuild_tensor_v3`` may name
DTYPE_GLOBALS: frozenset[str] = frozenset(f"torch.{d}" for d in DTYPE_ITEMSIZE)


def _torch_allowed_names() -> frozenset[str]:
    names = {
        "torch.Size",
        "torch.device",
        "torch.Tensor",
        "torch.nn.parameter.Parameter",
        "torch.serialization._get_layout",
        "torch._tensor._rebuild_from_type_v2",
    }
    names.update(STORAGE_GLOBALS)
    names.update(f"torch._utils.{f}" for f in _REBUILD_FUNCTIONS)
    names.update(DTYPE_GLOBALS)
    names.update(f"torch.{q}" for q in QSCHEMES)
    for cls in TENSOR_CLASS_NAMES:
        names.update({f"torch.{cls}", f"torch.cuda.{cls}"})
        if cls not in ("BoolTensor",):
            names.update({f"torch.sparse.{cls}", f"torch.cuda.sparse.{cls}"})
    return frozenset(names)


#: torch globals a checkpoint may reference; they become inert :class:`Global` records.
TORCH_GLOBALS: frozenset[str] = _torch_allowed_names()


def allowed_by_name(full: str, patterns: Sequence[str]) -> bool:
    """``full`` (as pickled, or as users know it: ``builtins.long`` for ``__builtin__.long``)
    matches one of the ``--allow-global`` patterns. Dangerous names never reach this."""
    known = canonical_name(full)
    return any(fnmatch.fnmatchcase(full, p) or fnmatch.fnmatchcase(known, p) for p in patterns)


def display_name(module: str, name: str) -> str:
    shown = MODULE_ALIASES.get(module)
    return f"{shown}.{name} (pickled as {module}.{name})" if shown else f"{module}.{name}"


# --------------------------------------------------------------------------- builders


def _as_int_tuple(value: Any, what: str, signed: bool = False) -> tuple[int, ...]:
    """A size or stride as a tuple of ints (a ``torch.Size`` or a list taken as one); strides
    may be ``signed`` (torch reads a negative stride where it spans no element: see
    :func:`_torch_strides`)."""
    if type(value) is not tuple:
        if type(value) is Reduce and value.func.full == "torch.Size" and len(value.args) == 1:
            value = value.args[0]
        if type(value) is list:
            value = tuple(value)
        if type(value) is not tuple:
            raise BadInputError(f"corrupt tensor record: its {what} is not a tuple of non-negative integers")
    for v in value:
        if type(v) is not int or (v < 0 and not signed):
            raise BadInputError(f"corrupt tensor record: its {what} is not a tuple of non-negative integers")
    shared = _SHAPES.get(value)  # checked first: (True,) == (1,), but only ints may match
    if shared is None:
        shared = value
        if len(_SHAPES) < _MAX_SHAPES and len(value) <= 8 and all(v < _SMALL for v in value):
            _SHAPES[value] = value
    return shared


#: checked shapes and strides, shared between tensors: torch.save pickles a new tuple per tensor,
#: and most tensors of a checkpoint have one of a few shapes (72 bytes saved per tuple; only
#: tuples of checked non-negative ints go in, and a tuple is looked up only once it is one).
#: Bounded, never cleared: at most 4096 tuples of up to 8 small ints (a file's 4000-digit sizes
#: must not stay pinned in a library user's process).
_SHAPES: dict[tuple[int, ...], tuple[int, ...]] = {}
_MAX_SHAPES = 4096
_SMALL = 1 << 40


#: fixed arguments of each tensor rebuild function (v2 and v3 take an optional metadata dict after them)
_TENSOR_ARGS = {"_rebuild_tensor": 4, "_rebuild_tensor_v2": 6, "_rebuild_tensor_v3": 7}


def _torch_strides(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[int, ...]:
    """The strides torch gives a tensor pickled with negative ones, or its refusal.

    torch sizes the storage a tensor needs in unsigned arithmetic (c10's
    ``computeStorageNbytes``): a negative stride over a dimension of more than one element
    overflows and is refused -- unless the tensor is empty, which needs no storage at all. The
    tensor it then makes replaces each negative stride, last dimension first, by 1 (the last)
    or the next dimension's size (at least 1) times its stride (``set_sizes_and_strides``): so
    ``(0,)`` with stride ``(-1,)`` loads as stride ``(1,)``, and that is what is written."""
    if 0 not in shape and any(s < 0 and n > 1 for n, s in zip(shape, strides)):
        raise BadInputError(
            "corrupt tensor record: a negative stride over a dimension of more than one element "
            "(torch refuses it too: its storage size overflows)"
        )
    out = list(strides)
    for d in reversed(range(len(out))):
        if out[d] < 0:
            out[d] = 1 if d == len(out) - 1 else max(shape[d + 1], 1) * out[d + 1]
    return _as_int_tuple(tuple(out), "stride")


def _tensor(func: Global, args: tuple[Any, ...]) -> TensorRef:
    """``_rebuild_tensor(storage, offset, size, stride)`` (pre-2018), ``_v2`` (+ requires_grad,
    hooks[, metadata]) and ``_v3`` (+ dtype). Only types are checked here: the extent is
    checked once the whole tree is known (:func:`~ckptfix.tree.check_extents`)."""
    fixed = _TENSOR_ARGS[func.name]
    if len(args) != fixed and (fixed == 4 or len(args) != fixed + 1):
        raise BadInputError(f"corrupt tensor record: {func.name} got {len(args)} arguments")
    storage, offset, size, stride = args[:4]
    if not isinstance(storage, StorageRef) or type(offset) is not int or offset < 0:
        raise BadInputError("corrupt tensor record: bad storage or offset")
    shape, strides = _as_int_tuple(size, "size"), _as_int_tuple(stride, "stride", signed=True)
    if len(shape) != len(strides):
        raise BadInputError("corrupt tensor record: size and stride differ in length")
    if strides and min(strides) < 0:
        strides = _torch_strides(shape, strides)
    requires_grad, hooks = (args[4], args[5]) if fixed >= 6 else (False, EMPTY_HOOKS)
    if type(requires_grad) is not bool:
        raise BadInputError("corrupt tensor record: requires_grad is not a bool")
    if type(hooks) is OrderedDict and not hooks and not gc.get_referents(hooks):
        hooks = EMPTY_HOOKS  # empty, no attributes (looking at __dict__ would allocate one)
    dtype_global = None
    dtype = storage.dtype
    if fixed == 7:
        dtype_global = args[6]
        if not isinstance(dtype_global, Global) or dtype_global.full not in DTYPE_GLOBALS:
            raise BadInputError("corrupt tensor record: its dtype is not a torch dtype")
        dtype = dtype_global.name
    return TensorRef(
        storage,
        offset,
        shape,
        strides,
        dtype,
        requires_grad,
        hooks,
        "v3" if fixed == 7 else "v2",
        dtype_global,
        args[fixed] if len(args) > fixed else ABSENT,
    )


def _parameter(func: Global, args: tuple[Any, ...]) -> TensorRef:
    with_state = func.name == "_rebuild_parameter_with_state"
    if len(args) != (4 if with_state else 3) or not isinstance(args[0], TensorRef) or args[0].param is not None:
        raise BadInputError(f"corrupt tensor record: {func.name} of something that is not a tensor")
    return replace(args[0], param=ParamInfo(args[1], args[2], args[3] if with_state else ABSENT))


#: what ``dict(value)`` / ``set(value)`` iterate, for the values a pickle can hold
_MAPPINGS = (dict, OrderedDict, Counter)
_SEQUENCES = (list, tuple, set, frozenset, str, bytes)


def _pairs(value: Any, what: str) -> list[tuple[Any, Any]]:
    """``dict(value)``'s items: a mapping's, or a sequence of 2-item sequences (``[[k, v], ...]``,
    how Python 2-era checkpoints pickle an OrderedDict: ``REDUCE(OrderedDict, ([[k, v], ...],))``)."""
    if type(value) in _MAPPINGS:
        return list(value.items())
    if type(value) in (list, tuple):
        pairs = []
        for item in value:
            if type(item) not in (list, tuple, str, bytes) or len(item) != 2:
                raise BadInputError(f"corrupt pickle: {what} built from something other than key-value pairs")
            pairs.append((item[0], item[1]))
        return pairs
    raise BadInputError(f"corrupt pickle: {what} built from something other than key-value pairs")


def _keys(builder: Callable[[Global, tuple[Any, ...]], Any], args: tuple[Any, ...]) -> list[Any]:
    """The values a builder's result will hash (dict keys, set elements), for the VM's key checks."""
    if not args or builder not in (_ordered_dict, _counter, _set):
        return []
    value = args[0]
    if type(value) in _MAPPINGS:
        return list(value)
    if builder is _ordered_dict:
        return [k for k, _ in _pairs(value, "OrderedDict")]
    return list(value) if type(value) in _SEQUENCES and type(value) is not str else []


def _ordered_dict(func: Global, args: tuple[Any, ...]) -> OrderedDict[Any, Any]:
    """``OrderedDict()``, ``OrderedDict(mapping)`` or ``OrderedDict([[key, value], ...])``: what
    torch's weights-only unpickler calls ``OrderedDict(*args)`` with."""
    if not args:
        return OrderedDict()
    if len(args) > 1:
        raise BadInputError("corrupt pickle: OrderedDict built with more than one argument")
    try:
        return OrderedDict(_pairs(args[0], "OrderedDict"))
    except TypeError:
        raise BadInputError("corrupt pickle: OrderedDict with an unhashable key") from None


def _counter(func: Global, args: tuple[Any, ...]) -> Counter[Any]:
    """``Counter()``, ``Counter(mapping)`` or ``Counter(elements)`` (counted)."""
    if args == ():
        return Counter()
    if len(args) == 1 and type(args[0]) in (*_MAPPINGS, *_SEQUENCES):
        try:
            return Counter(args[0])
        except TypeError:
            raise BadInputError("corrupt pickle: Counter of unhashable elements") from None
    raise BadInputError("corrupt pickle: Counter built from something other than a mapping or elements")


def _set(func: Global, args: tuple[Any, ...]) -> set[Any]:
    """``set(iterable)`` for the iterables a pickle can hold (a mapping gives its keys). Not
    ``frozenset``: torch's weights-only unpickler refuses it (ReaderHooks.make_frozenset)."""
    if args and not (len(args) == 1 and type(args[0]) in (*_SEQUENCES, *_MAPPINGS)):
        raise BadInputError(f"corrupt pickle: {func.name} built from something other than a list")
    try:
        return set(args[0] if args else ())
    except TypeError:
        raise BadInputError(f"corrupt pickle: {func.name} of unhashable elements") from None


def _encode(func: Global, args: tuple[Any, ...]) -> bytes:
    """``_codecs.encode`` as protocol-2 pickles use it for ``bytes``: text codecs only."""
    data = protocol2_bytes(args)
    if data is None:
        raise BadInputError("corrupt pickle: _codecs.encode used for something other than bytes")
    return data


#: the largest ``bytearray(n)`` built from a number (torch would allocate any size: a budget)
MAX_BYTEARRAY = 1 << 24


def _bytearray(func: Global, args: tuple[Any, ...]) -> bytearray:
    """``bytearray()`` from bytes, text and an encoding, a list of byte values, or a size up to
    :data:`MAX_BYTEARRAY` (``bytearray(10**12)`` must not allocate)."""
    if not args:
        return bytearray()
    first = args[0]
    if len(args) == 1 and type(first) is bytes:
        return bytearray(first)
    if len(args) == 1 and type(first) is int and 0 <= first <= MAX_BYTEARRAY:
        return bytearray(first)
    if len(args) == 1 and type(first) in (list, tuple) and all(type(v) is int and 0 <= v < 256 for v in first):
        return bytearray(first)
    if type(first) is str and len(args) in (2, 3) and all(type(a) is str for a in args):
        return bytearray(_encode(func, args))
    raise BadInputError("corrupt pickle: bytearray built from something other than bytes")


def _complex(func: Global, args: tuple[Any, ...]) -> complex:
    """``complex(real[, imag])`` from numbers, or ``complex(text)``."""
    if len(args) == 1 and type(args[0]) is str:
        try:
            return complex(args[0])
        except ValueError:
            raise BadInputError("corrupt pickle: complex built from malformed text") from None
    if len(args) > 2 or not all(type(a) in (int, float, bool, complex) for a in args):
        raise BadInputError("corrupt pickle: complex built from non-numbers")
    try:
        return complex(*args)
    except OverflowError:
        raise BadInputError("corrupt pickle: complex built from an integer too large") from None


#: global name -> what "calling" it builds. Torch names not listed become Reduce records.
BUILDERS: dict[str, Callable[[Global, tuple[Any, ...]], Any]] = {
    "torch._utils._rebuild_tensor": _tensor,
    "torch._utils._rebuild_tensor_v2": _tensor,
    "torch._utils._rebuild_tensor_v3": _tensor,
    "torch._utils._rebuild_parameter": _parameter,
    "torch._utils._rebuild_parameter_with_state": _parameter,
    "collections.OrderedDict": _ordered_dict,
    "collections.Counter": _counter,
    "builtins.set": _set,
    "builtins.bytearray": _bytearray,
    "builtins.complex": _complex,
    "_codecs.encode": _encode,
}


#: builders whose class's ``__new__`` ignores its arguments (NEWOBJ makes an empty one)
_EMPTY_NEW: dict[Callable[[Global, tuple[Any, ...]], Any], Callable[[], Any]] = {
    _ordered_dict: OrderedDict,
    _counter: Counter,
    _bytearray: bytearray,
}


def _plain_global(name: str) -> bool:
    return name in TORCH_GLOBALS or name in PYTHON_GLOBALS


def _opaque_reduce(func: Global, args: tuple[Any, ...]) -> OpaqueObject:
    return OpaqueObject(func, args, "reduce")


#: Python globals a plain checkpoint needs; each has a checked builder above
PYTHON_GLOBALS: frozenset[str] = frozenset(name for name in BUILDERS if not name.startswith("torch."))


# --------------------------------------------------------------------------- hooks

#: resolves a persistent id ``(storage_type, key, location, numel, view)`` to a storage;
#: ``view`` is the legacy format's ``(view_key, offset, size)`` or None
StorageLoader = Callable[[Global, str, str, int, Any], StorageRef]


class ReaderHooks(Hooks):
    """The allow-list reader: see the module docstring."""

    def __init__(
        self,
        load_storage: StorageLoader | None,
        globals_seen: set[str],
        allow: Sequence[str] = (),
        inert_unknown: bool = False,
    ) -> None:
        self.load_storage = load_storage
        self.globals_seen = globals_seen
        self.allow = tuple(allow)
        self.inert_unknown = inert_unknown
        #: globals read as inert records without being allowed (``inert_unknown``)
        self.unknown: list[Global] = []
        self._globals: dict[tuple[str, str], Global] = {}
        #: id of each Global handed out (one object per name) -> what calling it makes
        self._calls: dict[int, Callable[[Global, tuple[Any, ...]], Any]] = {}
        self._storage_ids: set[int] = set()
        self._opaque: set[int] = set()

    def find_global(self, module: str, name: str) -> Global:
        cached = self._globals.get((module, name))
        if cached is not None:
            return cached
        full = f"{module}.{name}"
        self.globals_seen.add(full)
        if not is_dotted_identifier(full):
            raise BadInputError(f"corrupt or hostile pickle: a global named {full!r:.120}, not a Python name")
        result = Global(module, name)
        if full not in TORCH_GLOBALS and full not in PYTHON_GLOBALS:
            reached = resolved_name(module, name)  # pathlib + os.system is os.system
            reason = danger(reached)
            if reason is not None:  # an attack wherever it is: never allowed, never read past
                shown = [display_name(module, name)]
                if reached != full:
                    shown = [f"{reached} (pickled as {full})"]
                raise UnsafeInputError(full, shown=shown, hostile=[full], reasons={full: reason})
            if self.allow and allowed_by_name(full, self.allow):
                self._opaque.add(id(result))
            elif self.inert_unknown:
                result = Global(module, name, allowed=False)
                self.unknown.append(result)
            else:
                raise UnsafeInputError(full, shown=[display_name(module, name)])
            self._calls[id(result)] = _opaque_reduce
        else:
            self._calls[id(result)] = BUILDERS.get(full, Reduce)
        if full in STORAGE_GLOBALS:
            self._storage_ids.add(id(result))
        self._globals[(module, name)] = result
        return result

    def call(self, func: Any, args: tuple[Any, ...]) -> Any:
        # one lookup by identity: every Global on the stack came from find_global, so its id
        # is in the table; anything else (a string, a tuple, a record) cannot be called
        builder = self._calls.get(id(func)) if type(func) is Global else None
        if builder is None:
            raise BadInputError(f"corrupt or hostile pickle: it calls a {type(func).__name__}, not an allowed global")
        for key in _keys(builder, args):  # dict keys and set elements are hashed: the VM's key checks
            if type(key) is not str:
                self.vm.check_key(key)
        return builder(func, args)

    def make_frozenset(self, items: list[Any]) -> Any:
        # the opcode spelling of ``builtins.frozenset(items)``: torch's weights-only unpickler
        # allows neither (its allow-list has ``builtins.set``, not frozenset; an output holding
        # one would not load), so it is that global's business -- refused, read as an inert
        # record, or kept by ``--allow-global builtins.frozenset`` -- as the pickled call is
        return self.call(self.find_global("builtins", "frozenset"), (items,))

    def new_object(self, cls: Any, args: tuple[Any, ...], kwargs: dict[Any, Any] | None) -> Any:
        builder = self._calls.get(id(cls)) if type(cls) is Global else None
        if builder is _opaque_reduce:
            return OpaqueObject(cls, args, "newobj_ex" if kwargs is not None else "newobj", kwargs)
        if kwargs is None and builder in _EMPTY_NEW:
            return _EMPTY_NEW[builder]()  # cls.__new__(cls, *args), as torch calls it: args ignored
        if kwargs is None and builder is _complex:
            return _complex(cls, args)
        raise BadInputError(f"corrupt or hostile pickle: NEWOBJ of {cls!r:.80}, which is not an allowed class")

    def build(self, inst: Any, state: Any) -> None:
        if type(inst) is OpaqueObject and inst.state is ABSENT:
            inst.state = state
            return
        raise BadInputError(
            f"corrupt or hostile pickle: BUILD on a {type(inst).__name__} (torch allows it on state-dict "
            "OrderedDicts and allowed classes only)"
        )

    def extend(self, target: Any, items: list[Any]) -> None:
        if type(target) is OpaqueObject:
            target.items.extend(items)
            return
        super().extend(target, items)

    def set_items(self, target: Any, pairs: list[tuple[Any, Any]]) -> None:
        if type(target) is OpaqueObject:
            target.dictitems.extend(pairs)
            return
        super().set_items(target, pairs)

    def check_key(self, key: Any) -> None:
        # records hash by identity (no __hash__ of the pickle's choosing runs): DCP's metadata
        # keys its storage table by MetadataIndex objects
        if type(key) is Global or type(key) is OpaqueObject:
            return
        super().check_key(key)

    def persistent_load(self, pid: Any) -> StorageRef:
        if self.load_storage is None or type(pid) is not tuple or len(pid) not in (5, 6):
            raise BadInputError("corrupt pickle: an unexpected persistent id (not a storage)")
        tag, storage_type, key, location, numel = pid[:5]
        if type(key) is bytes or type(location) is bytes or type(tag) is bytes:  # Python 2 strings
            tag, key, location = _text(tag), _text(key), _text(location)
        view = pid[5] if len(pid) == 6 else None
        if (
            tag != "storage"
            or id(storage_type) not in self._storage_ids
            or type(storage_type) is not Global
            or type(key) is not str
            or type(location) is not str
            or type(numel) is not int
            or numel < 0
        ):
            raise BadInputError("corrupt pickle: a malformed storage persistent id")
        return self.load_storage(storage_type, key, location, numel, view)


def _text(value: Any) -> Any:
    return value.decode("ascii", "replace") if type(value) is bytes else value


def restricted_load(
    data: bytes | mmap.mmap,
    load_storage: StorageLoader | None,
    globals_seen: set[str] | None = None,
    allow: Sequence[str] = (),
    *,
    start: int = 0,
    budgets: Budgets | None = None,
    check_depth: bool = True,
    inert_unknown: bool = False,
) -> tuple[Tree, int]:
    """Unpickle the pickle at ``data[start:]`` (bytes or a read-only mmap) into a tree.

    Returns the tree and the offset just after the pickle's STOP. ``load_storage`` resolves
    storage persistent ids (None: a pickle that must hold none). Raises
    :class:`UnsafeInputError` naming every dangerous global (:data:`~.globals.DANGEROUS`), and
    every global outside the allow-list unless ``inert_unknown``, and :class:`BadInputError` for
    anything malformed or over a budget. ``globals_seen`` collects every global the pickle names.
    Globals matching an ``allow`` pattern become :class:`OpaqueObject` records (never imported),
    and so do, with ``inert_unknown``, all other non-dangerous ones, marked not allowed (their
    :class:`Global` has ``allowed=False``: no writer writes one; see :func:`foreign_globals`).
    Where the user allowed some, the plain types objects are rebuilt through (``typing.Any``,
    ``builtins.dict``, ``collections.defaultdict``: :func:`~.globals.companion`) are kept along. Bytes that objects
    carry and that are pickles are read by the same VM: a dangerous name in them refuses the
    file, and in allowed objects every name must itself be allowed. ``check_depth=False``
    leaves the nesting check to the caller's :func:`~ckptfix.tree.check_extents`.
    """
    seen = globals_seen if globals_seen is not None else set()
    hooks = ReaderHooks(load_storage, seen, allow, inert_unknown)
    limits = budgets or Budgets.for_length(len(data) - start)
    fast = native_tree.load(data, start, limits, native_table(), hooks.find_global, load_storage)
    if fast is not None:  # the native engine read it (same tree); else the Python VM reads it
        tree, end = fast
    else:
        vm = PickleVM(data, hooks, limits, start)
        try:
            with collector_paused():  # the VM makes ~10 objects per tensor and no garbage cycles
                tree = vm.run()
        except UnsafeInputError as first:
            raise _every_refused(data, start, allow, inert_unknown) or first from None
        end = vm.pos
    if check_depth:
        check_nesting(tree)
    if hooks._opaque and hooks.unknown:
        for found in hooks.unknown:
            if companion(found.full):
                object.__setattr__(found, "allowed", True)  # kept along: see the docstring
    if hooks._opaque or hooks.unknown:
        _check_nested_pickles(tree, hooks)
    return tree, end


#: the builders the native VM runs itself (vm.rs's ``Kind``), by global name
_NATIVE_KINDS = {
    "torch._utils._rebuild_tensor": "1",
    "torch._utils._rebuild_tensor_v2": "2",
    "torch._utils._rebuild_tensor_v3": "3",
    "torch._utils._rebuild_parameter": "p",
    "torch._utils._rebuild_parameter_with_state": "q",
    "collections.OrderedDict": "o",
}


@functools.cache
def native_table() -> bytes:
    """The allow-list as the native VM takes it: ``kind[flags]\\tmodule\\tname`` per line.

    Names the Python VM renames before looking them up (Python 2 spellings, ``torch.tensor``) are
    left out: the native VM meets them as unknown names and leaves such a pickle to the Python VM.
    Kinds: a builder it runs (:data:`_NATIVE_KINDS`), ``x`` a Python builder it leaves to Python
    when called, ``r`` a torch name whose call is a :class:`Reduce` record; flags ``s`` a storage
    class, ``d`` a dtype; a fourth field gives a storage class's or a dtype's element size."""
    lines = []
    for full in sorted(TORCH_GLOBALS | PYTHON_GLOBALS):
        module, name = full.rsplit(".", 1)
        if (module, name) in NAME_MAPPING or module in IMPORT_MAPPING or module == "torch.tensor":
            continue
        kind = _NATIVE_KINDS.get(full) or ("x" if full in PYTHON_GLOBALS else "r")
        kind += ("s" if full in STORAGE_GLOBALS else "") + ("d" if full in DTYPE_GLOBALS else "")
        dtype = STORAGE_DTYPE.get(name) if full in STORAGE_GLOBALS else name if full in DTYPE_GLOBALS else None
        itemsize = f"\t{DTYPE_ITEMSIZE[dtype]}" if dtype else ""  # for the native extent check
        lines.append(f"{kind}\t{module}\t{name}{itemsize}\n")
    return "".join(lines).encode()


def _refused(name: str, allow: Sequence[str], inert_unknown: bool = False) -> bool:
    if name in TORCH_GLOBALS or name in PYTHON_GLOBALS:
        return False
    if danger(name) is not None:
        return True
    return not inert_unknown and not allowed_by_name(name, allow)


def _every_refused(
    data: bytes | mmap.mmap, start: int, allow: Sequence[str], inert_unknown: bool
) -> UnsafeInputError | None:
    """The refusal naming every global of the pickle at ``start`` that this read refuses (the
    reader stops at the first): the VM in recording mode over the same bytes, so one run shows
    the user everything at once. None if recording finds none (the reader's own error stands)."""
    found, _ = record_globals(data, "refused", _plain_global, count=1, start=start)
    names = list(dict.fromkeys(n for n, _ in found if not n.startswith("<") and _refused(n, allow, inert_unknown)))
    if not names:
        return None
    shown = [display_name(*n.rsplit(".", 1)) for n in names]
    reasons = {n: r for n in names if (r := danger(n)) is not None}
    return UnsafeInputError(
        names,
        shown=shown,
        sanitizable=all(n in SANITIZABLE for n in names),
        hostile=list(reasons),
        reasons=reasons,
        allow_options=None if reasons else allow_options(names),
        kept_along=() if reasons else kept_along(names),
    )


def _check_nested_pickles(tree: Tree, hooks: ReaderHooks) -> None:
    """Bytes inside objects of non-torch globals that are pickles -- with a protocol header or
    without (protocol 0/1), nested in each other -- are read by the VM in recording mode: a
    dangerous global or laundering in them refuses the file, and in allowed objects every
    global they name must be one this read allows. So no unread pickle is ever carried into an
    output. One walk over all such objects together: a sub-tree they share is looked at once,
    and each blob once however many objects hold it (the walk yields atoms on every path: a
    memoized 60 KB pickle in 2000 objects took 24 s before), first for the allowed ones."""
    opaque = tuple(value for _, value in walk(tree) if type(value) is OpaqueObject)
    allowed = tuple(value for value in opaque if value.global_.allowed)
    read: set[bytes] = set()  # by content: equal blobs (one str encoded many times) read once
    for carrier in (allowed, tuple(value for value in opaque if not value.global_.allowed)):
        for _, blob in walk(carrier, leaves=True):
            if type(blob) not in (bytes, bytearray) or len(blob) <= 2:
                continue
            data = bytes(blob)
            if data in read:
                continue
            read.add(data)
            found, _ = record_globals(data, "nested", _plain_global, headerless=not looks_like_pickle(data))
            for name, _ in found:
                module, _, short = name.rpartition(".")
                if name.startswith("<"):
                    raise BadInputError(f"corrupt or hostile pickle: a pickle carried as bytes holds {name}")
                if _refused(name, hooks.allow, inert_unknown=carrier is not allowed):
                    shown = [display_name(module, short) + " (in a pickle carried as bytes)"]
                    reason = danger(name)
                    hostile = [name] if reason else []
                    raise UnsafeInputError(name, shown=shown, hostile=hostile, reasons={name: reason or ""})


@dataclass
class ForeignGlobals:
    """The non-torch globals a tree holds (:func:`foreign_globals`)."""

    #: read as inert records without being allowed -> the first few paths where each occurs
    unallowed: dict[str, list[Path]] = field(default_factory=dict)
    #: allowed (by ``--allow-global``, or kept along with allowed objects)
    allowed: set[str] = field(default_factory=set)


def foreign_globals(root: Tree, paths_per_name: int = 3) -> ForeignGlobals:
    """Every global in ``root`` that is neither torch's nor a plain Python builder: objects,
    bare names (``typing.Any`` as a value), dict keys and what they hold (a record, or a tuple
    or frozenset of records: ``{(Split.TRAIN, 0): ...}``). What an output built from ``root``
    would carry -- every atom included, each container entered once: the keys are walked
    together, in rounds (keys inside keys), so 20 000 keys sharing one big list cost one walk
    of it, not 20 000."""
    result = ForeignGlobals()

    def note(path: Path, value: Any) -> None:
        found = value.global_ if type(value) is OpaqueObject else value
        if type(found) is not Global or found.full in TORCH_GLOBALS or found.full in PYTHON_GLOBALS:
            return
        if found.allowed:
            result.allowed.add(found.full)
            return
        where = result.unallowed.setdefault(found.full, [])
        if len(where) < paths_per_name:
            where.append(path)

    entered: set[int] = set()  # containers walked in any round (all stay alive in the tree)

    def descend(path: Path, value: Any) -> bool:
        if id(value) in entered:
            return False
        entered.add(id(value))
        return True

    roots: list[tuple[Path, Any]] = [((), root)]
    rounds: list[list[Any]] = []  # kept alive: a freed round's id must not match a later object
    while roots:
        keyed: list[tuple[Path, Any]] = []
        rounds.append([node for _, node in roots])
        for index, (path, value) in enumerate(walk(rounds[-1], descend, leaves=True)):
            if index == 0:
                continue  # the round's own list
            where = roots[path[0]][0] + path[1:]
            note(where, value)
            if isinstance(value, Mapping):
                keyed += [(where, key) for key in value if type(key) not in _PLAIN_KEYS]
        roots = keyed
    return result


#: dict keys that hold no global (everything else -- records, tuples, frozensets -- is walked)
_PLAIN_KEYS = frozenset({str, int, float, bool, type(None), bytes, complex})
