"""Writes a checkpoint tree back as the protocol-2 pickle ``torch.save`` produces.

Python's own pickler cannot do this without torch: to write ``GLOBAL torch._utils
_rebuild_tensor_v2`` it imports the module to check the name. We emit the opcodes ourselves,
using only those that torch's ``weights_only`` unpickler understands, laid out the way
``torch.save`` lays them out (same memo use, same reduce forms), so the result loads with
``torch.load(weights_only=True)`` and compares equal to what torch would have written.

The emitter mirrors the reader (:mod:`ckptfix.pickle_vm`): a table from node type to writer
(:data:`_WRITERS`), an explicit stack of pending work instead of recursion (any depth the
reader accepts), and a memo by ``id`` so shared objects are written once and cycles close
exactly as pickle closes them (a container is memoized before its contents). Output goes
into one ``bytearray``; tensors -- the bulk of a training checkpoint -- are written by one
function without touching the stack in the common case.

Storages are renumbered ``"0", "1", ...`` in the order they first appear, as ``torch.save``
numbers them; :attr:`PickleResult.storages` lists them in that order for the zip writer.
Every global written must be a dotted Python identifier, so no name read from a file can
smuggle a newline (an opcode boundary) into the output.
"""

from __future__ import annotations

import struct
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import BadInputError, UnsafeInputError
from ..model.dtypes import DTYPE_ITEMSIZE
from ..model.refs import ABSENT, EMPTY_HOOKS, Global, OpaqueObject, ParamInfo, Reduce, StorageRef, TensorRef, Tree
from ..model.walk import walk
from ..native import emit as native_emit
from .names import is_dotted_identifier

_MARK, _TUPLE, _EMPTY_TUPLE = b"(", b"t", b")"
_TUPLE_N = (b")", b"\x85", b"\x86", b"\x87")
_EMPTY_DICT, _SETITEMS, _EMPTY_LIST, _APPENDS = b"}", b"u", b"]", b"e"
_NONE, _TRUE, _FALSE = b"N", b"\x88", b"\x89"
_REDUCE, _BUILD, _BINPERSID, _POP, _POP_MARK = b"R", b"b", b"Q", b"0", b"1"
_NEWOBJ, _NEWOBJ_EX = b"\x81", b"\x92"
_BATCH = 1000  # items per SETITEMS/APPENDS, as pickle does
_MEMO_STR = 40  # strings up to this many bytes are memoized by value (written once, fetched after)
# Python 3 names pickled under protocol 2 are written with their Python 2 spelling
_PY2_MODULES = {"builtins": "__builtin__"}
_ORDERED_DICT = Global("collections", "OrderedDict")
_COUNTER = Global("collections", "Counter")
_ENCODE = Global("_codecs", "encode")
_SET, _FROZENSET = Global("builtins", "set"), Global("builtins", "frozenset")
_BYTEARRAY, _COMPLEX = Global("builtins", "bytearray"), Global("builtins", "complex")
_REBUILD_V2 = Global("torch._utils", "_rebuild_tensor_v2")
_REBUILD_V3 = Global("torch._utils", "_rebuild_tensor_v3")
_REBUILD_PARAM = Global("torch._utils", "_rebuild_parameter")
_REBUILD_PARAM_STATE = Global("torch._utils", "_rebuild_parameter_with_state")
_STORAGE = "storage"

_pack_i = struct.Struct("<i").pack
_pack_I = struct.Struct("<I").pack
_pack_H = struct.Struct("<H").pack
_pack_d = struct.Struct(">d").pack


@dataclass
class PickleResult:
    data: bytes | bytearray
    #: storages in the order their new keys were given ("0", "1", ...)
    storages: list[StorageRef] = field(default_factory=list)


class _Raw(bytes):
    """Opcode bytes waiting on the work stack (a value of type ``bytes`` is data, not this)."""


class _Then:
    """A step to run when the work stack reaches it (e.g. close a tuple after its items)."""

    __slots__ = ("arg", "func")

    def __init__(self, func: Callable[[Any], None], arg: Any) -> None:
        self.func, self.arg = func, arg


class _Emitter:
    def __init__(self, only: frozenset[str] | None = None) -> None:
        self.out = bytearray(b"\x80\x02")
        #: every global this pickle may name (None: any allowed one); see :func:`dumps`
        self.only = only
        #: memo keys: id() of containers and records, the value of strings (ints and strs never
        #: compare equal); globals have their own table so no string can alias one
        self.memo: dict[Any, int] = {}
        self.global_memo: dict[str, int] = {}
        self.storage_keys: dict[int, str] = {}
        self.storages: list[StorageRef] = []
        self.alive: list[Any] = []  # temporaries made while writing, kept so their ids stay unique
        self.todo: list[Any] = []
        self.shared: set[int] = set()

    # -- memo ---------------------------------------------------------------------------
    def get(self, key: Any) -> bool:
        index = self.memo.get(key)
        if index is None:
            return False
        self.out += b"h" + bytes((index,)) if index < 256 else b"j" + _pack_I(index)
        return True

    def put(self, key: Any, always: bool = False) -> None:
        """Memoize the object with this id -- if the tree refers to it more than once, and always
        for lists and dicts: a tuple on a cycle is written twice before it is closed (pickle's
        recursion rule), and each time the container inside it must be a memo hit, not a new
        copy. Everything else (tensors, their tuples) would be a memo entry nobody reads."""
        if not always and key not in self.shared:
            return
        index = self.memo[key] = len(self.memo) + len(self.global_memo)
        self.out += b"q" + bytes((index,)) if index < 256 else b"r" + _pack_I(index)

    # -- atoms (written at once) ------------------------------------------------------------
    def atom(self, value: Any) -> bool:
        """Write ``value`` if it is an atom; False if it needs the work stack."""
        kind = type(value)
        out = self.out
        if kind is str:
            index = self.memo.get(value)
            if index is not None:
                out += b"h" + bytes((index,)) if index < 256 else b"j" + _pack_I(index)
            else:
                encoded = value.encode("utf-8", "surrogatepass")
                out += b"X" + _pack_I(len(encoded)) + encoded
                if len(encoded) <= _MEMO_STR:  # repeated names ('step', 'cpu', 'weight') are short
                    index = self.memo[value] = len(self.memo) + len(self.global_memo)
                    out += b"q" + bytes((index,)) if index < 256 else b"r" + _pack_I(index)
        elif kind is int:
            if 0 <= value < 256:
                out += b"K" + bytes((value,))
            elif 0 <= value < 65536:
                out += b"M" + _pack_H(value)
            elif -(2**31) <= value < 2**31:
                out += b"J" + _pack_i(value)
            else:
                encoded = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
                out += b"\x8a" + bytes((len(encoded),)) if len(encoded) < 256 else b"\x8b" + _pack_i(len(encoded))
                out += encoded
        elif kind is bool:
            out += _TRUE if value else _FALSE
        elif value is None:
            out += _NONE
        elif kind is float:
            out += b"G" + _pack_d(value)
        elif kind is Global:
            self.global_(value)
        else:
            return False
        return True

    def global_(self, value: Global) -> None:
        if not value.allowed:  # read as an inert record, never allowed: no output carries it
            raise UnsafeInputError(value.full, writing=True)
        if self.only is not None and value.full not in self.only:
            raise ValueError(f"ckptfix bug: {value.full} is not a global this pickle may name")
        index = self.global_memo.get(value.full)
        if index is not None:
            self.out += b"h" + bytes((index,)) if index < 256 else b"j" + _pack_I(index)
            return
        # the name written is module and name, so those are what is checked (``full`` is only
        # their cache: a record changed behind the frozen dataclass's back may disagree with it)
        if not is_dotted_identifier(value.full) or value.full != f"{value.module}.{value.name}":
            raise BadInputError(f"refusing to write a global named {value.full!r:.120}: not a Python name")
        module = _PY2_MODULES.get(value.module, value.module)
        self.out += b"c" + f"{module}\n{value.name}\n".encode()
        index = self.global_memo[value.full] = len(self.memo) + len(self.global_memo)
        self.out += b"q" + bytes((index,)) if index < 256 else b"r" + _pack_I(index)

    def int_tuple(self, values: tuple[int, ...]) -> None:
        """A shape or stride: a small tuple of ints, written without the memo (nothing refers
        to it twice)."""
        out = self.out
        n = len(values)
        if n > 3:
            out += _MARK
        for v in values:
            if 0 <= v < 256:
                out += b"K" + bytes((v,))
            else:
                self.atom(v)
        out += _TUPLE_N[n] if n <= 3 else _TUPLE

    # -- the loop -----------------------------------------------------------------------
    def run(self, root: Tree) -> None:
        todo = self.todo
        todo.append(root)
        atom, out = self.atom, self.out
        while todo:
            item = todo.pop()
            kind = type(item)
            if kind is _Raw:
                out += item
            elif kind is _Then:
                item.func(item.arg)
            elif not atom(item):
                writer = _WRITERS.get(kind)
                if writer is None:
                    writer = _writer_for_subclass(item)
                writer(self, item)

    def later(self, *items: Any) -> None:
        """Queue ``items`` to be written in order, before anything queued earlier."""
        self.todo.extend(reversed(items))

    def later_seq(self, items: Any) -> None:
        self.todo.extend(reversed(items if isinstance(items, list) else list(items)))

    # -- containers ---------------------------------------------------------------------
    def tuple_(self, value: tuple[Any, ...]) -> None:
        if self.get(id(value)):
            return
        n = len(value)
        if n == 0:
            self.out += _EMPTY_TUPLE
            return
        if n > 3:
            self.out += _MARK
        self.alive.append(value)
        self.todo.append(_Then(self._close_tuple, value))
        self.later_seq(value)

    def _close_tuple(self, value: tuple[Any, ...]) -> None:
        n = len(value)
        index = self.memo.get(id(value))
        if index is not None:  # the tuple reached itself through a list: pickle's recursion rule
            self.out += (_POP * n) if n <= 3 else _POP_MARK
            self.get(id(value))
            return
        self.out += _TUPLE_N[n] if n <= 3 else _TUPLE
        self.put(id(value))

    def list_(self, value: list[Any]) -> None:
        if self.get(id(value)):
            return
        self.out += _EMPTY_LIST
        self.put(id(value), always=True)
        self.alive.append(value)
        self.items(value)

    def items(self, values: list[Any]) -> None:
        self.later_seq(_batches(values, _APPENDS))

    def setitems(self, pairs: list[tuple[Any, Any]]) -> None:
        self.later_seq(_batches(pairs, _SETITEMS, pairs=True))

    def dict_(self, value: dict[Any, Any]) -> None:
        if self.get(id(value)):
            return
        self.out += _EMPTY_DICT
        self.put(id(value), always=True)
        self.alive.append(value)
        self.setitems(list(value.items()))

    def ordered_dict(self, value: OrderedDict[Any, Any]) -> None:
        """``OrderedDict()`` then items then BUILD with ``__dict__`` (``_metadata``)."""
        if self.get(id(value)):
            return
        self.global_(_ORDERED_DICT)
        self.out += _EMPTY_TUPLE + _REDUCE
        self.put(id(value), always=True)
        self.alive.append(value)
        state = getattr(value, "__dict__", None)
        if state:
            copy = dict(state)
            self.alive.append(copy)
            self.later(copy, _Raw(_BUILD))
        if value:
            self.setitems(list(value.items()))

    def counter(self, value: Counter[Any]) -> None:
        if self.get(id(value)):
            return
        self.global_(_COUNTER)
        plain = dict(value)
        self.alive.extend((value, plain))
        self.later((plain,), _Raw(_REDUCE), _Then(self.put, id(value)))

    def reduce_(self, value: Any, func: Global, args: tuple[Any, ...], state: Any = ABSENT) -> None:
        if self.get(id(value)):
            return
        self.global_(func)
        self.alive.append(value)
        pending: list[Any] = [args, _Raw(_REDUCE), _Then(self.put, id(value))]
        if state is not ABSENT:
            pending += [state, _Raw(_BUILD)]
        self.later_seq(pending)

    def record(self, value: Reduce) -> None:
        self.reduce_(value, value.func, value.args, value.state)

    def set_(self, value: set[Any] | frozenset[Any]) -> None:
        elements = list(value)
        self.alive.append(elements)
        self.reduce_(value, _SET if type(value) is set else _FROZENSET, (elements,))

    def bytes_(self, value: bytes) -> None:
        # protocol 2 has no bytes opcode torch's safe loader reads: pickle uses _codecs.encode
        self.reduce_(value, _ENCODE, (value.decode("latin-1"), "latin1"))

    def bytearray_(self, value: bytearray) -> None:
        self.reduce_(value, _BYTEARRAY, (bytes(value).decode("latin-1"), "latin-1"))

    def complex_(self, value: complex) -> None:
        self.reduce_(value, _COMPLEX, (value.real, value.imag))

    def opaque(self, value: OpaqueObject) -> None:
        """An allowed-by-name object, written back the way it was read: REDUCE or NEWOBJ(_EX),
        then its list/dict items, then its BUILD state."""
        if self.get(id(value)):
            return
        self.global_(value.global_)
        self.alive.append(value)
        pending: list[Any] = [value.args]
        if value.kind == "reduce":
            pending.append(_Raw(_REDUCE))
        elif value.kind == "newobj_ex":
            kwargs = dict(value.kwargs or {})
            self.alive.append(kwargs)
            pending += [kwargs, _Raw(_NEWOBJ_EX)]
        else:
            pending.append(_Raw(_NEWOBJ))
        pending.append(_Then(self.put, id(value)))
        pending += _batches(value.items, _APPENDS)
        pending += _batches(value.dictitems, _SETITEMS, pairs=True)
        if value.state is not ABSENT:
            pending += [value.state, _Raw(_BUILD)]
        self.later_seq(pending)

    def empty_hooks(self) -> None:
        self.global_(_ORDERED_DICT)
        self.out += _EMPTY_TUPLE + _REDUCE

    def global_value(self, value: Global) -> None:
        self.global_(value)

    # -- tensors ------------------------------------------------------------------------
    def storage(self, storage: StorageRef) -> None:
        key = self.storage_keys.get(id(storage))
        if key is None:
            key = self.storage_keys[id(storage)] = str(len(self.storages))
            self.storages.append(storage)
        out = self.out
        out += _MARK
        self.atom(_STORAGE)
        self.global_(storage.storage_type)
        encoded = key.encode()  # a fresh name per storage: nothing refers to it again, no memo
        out += b"X" + _pack_I(len(encoded)) + encoded
        self.atom(storage.location)
        numel = storage.numel
        if 0 <= numel < 256:
            out += b"K" + bytes((numel,))
        else:
            self.atom(numel)
        out += _TUPLE + _BINPERSID

    def tensor(self, t: TensorRef) -> None:
        """One tensor record, as torch.save writes it. The common case (a plain tensor or
        parameter with empty hooks, no metadata) is written here in one go; anything else
        it holds goes through the work stack like any other node."""
        memo = self.memo
        index = memo.get(id(t))
        if index is not None:
            self.out += b"h" + bytes((index,)) if index < 256 else b"j" + _pack_I(index)
            return
        out, atom = self.out, self.atom
        param = t.param
        if param is not None:
            self.global_(_REBUILD_PARAM_STATE if param.state is not ABSENT else _REBUILD_PARAM)
            out += _MARK
        self.global_(_REBUILD_V3 if t.rebuild == "v3" else _REBUILD_V2)
        out += _MARK
        self.storage(t.storage)
        offset = t.storage_offset
        out += b"K" + bytes((offset,)) if 0 <= offset < 256 else b""
        if not 0 <= offset < 256:
            atom(offset)
        self.int_tuple(t.shape)
        self.int_tuple(t.stride)
        pending: list[Any] = []
        if not atom(t.requires_grad):
            pending.append(t.requires_grad)
        self._hooks(t.hooks, pending)
        if t.rebuild == "v3":
            pending.append(t.dtype_global)
        if t.metadata is not ABSENT:
            pending.append(t.metadata)
        if param is None and not pending:  # the common case: finish here
            out += _TUPLE + _REDUCE
            self.put(id(t))
            return
        pending.append(_Raw(_TUPLE + _REDUCE))
        if param is not None:
            pending.append(param.requires_grad)
            self.alive.append(param)
            pending.append(param.hooks)
            if param.state is not ABSENT:
                pending.append(param.state)
            pending.append(_Raw(_TUPLE + _REDUCE))
        pending.append(_Then(self.put, id(t)))
        self.later_seq(pending)

    def _hooks(self, hooks: Any, pending: list[Any]) -> None:
        """``OrderedDict()`` per tensor, as torch.save writes its empty backward hooks."""
        if hooks is EMPTY_HOOKS and not pending:
            self.global_(_ORDERED_DICT)
            self.out += _EMPTY_TUPLE + _REDUCE
            return
        if pending or type(hooks) is not OrderedDict or hooks or getattr(hooks, "__dict__", None):
            pending.append(hooks)
            return
        if self.get(id(hooks)):
            return
        self.global_(_ORDERED_DICT)
        self.out += _EMPTY_TUPLE + _REDUCE
        self.put(id(hooks))
        self.alive.append(hooks)


def _batches(values: list[Any], closing: bytes, *, pairs: bool = False) -> list[Any]:
    """MARK, up to 1000 items (or key/value pairs), APPENDS/SETITEMS -- as pickle batches them."""
    pending: list[Any] = []
    for start in range(0, len(values), _BATCH):
        pending.append(_Raw(_MARK))
        if pairs:
            for key, item in values[start : start + _BATCH]:
                pending.append(key)
                pending.append(item)
        else:
            pending.extend(values[start : start + _BATCH])
        pending.append(_Raw(closing))
    return pending


def _writer_for_subclass(value: Any) -> Callable[[_Emitter, Any], None]:
    for kind, writer in _SUBCLASS_WRITERS:
        if isinstance(value, kind):
            return writer
    raise BadInputError(f"cannot write a {type(value).__name__} into a torch checkpoint")


#: node type -> writer: the one place that says how each kind of node is pickled
_WRITERS: dict[type, Callable[[_Emitter, Any], None]] = {
    tuple: _Emitter.tuple_,
    list: _Emitter.list_,
    dict: _Emitter.dict_,
    OrderedDict: _Emitter.ordered_dict,
    Counter: _Emitter.counter,
    set: _Emitter.set_,
    frozenset: _Emitter.set_,
    bytes: _Emitter.bytes_,
    bytearray: _Emitter.bytearray_,
    complex: _Emitter.complex_,
    TensorRef: _Emitter.tensor,
    StorageRef: lambda e, s: e.storage(s),
    Global: _Emitter.global_value,
    type(EMPTY_HOOKS): lambda e, _: e.empty_hooks(),
    Reduce: _Emitter.record,
    OpaqueObject: _Emitter.opaque,
}
#: subclasses made in code (a transform's own mapping type) fall back to their base's writer
_SUBCLASS_WRITERS: tuple[tuple[type, Callable[[_Emitter, Any], None]], ...] = (
    (OrderedDict, _Emitter.ordered_dict),
    (dict, _Emitter.dict_),
    (list, _Emitter.list_),
    (tuple, _Emitter.tuple_),
)


#: what the native emitter (native/src/emit.rs) reads the tree with: the types and markers it
#: knows and the attribute names of the records (anything else in a tree: the Python emitter)
_NATIVE_OBJECTS: dict[str, Any] = {
    "none": None,
    "true_": True,
    "false_": False,
    "empty_hooks": EMPTY_HOOKS,
    "absent": ABSENT,
    "int": int,
    "float": float,
    "str_": str,
    "tuple": tuple,
    "list": list,
    "dict": dict,
    "ordered_dict": OrderedDict,
    "tensor": TensorRef,
    "storage": StorageRef,
    "global": Global,
    "param": ParamInfo,
    "reduce": Reduce,
    "a_items": "items",
    "a_dict": "__dict__",
}
#: the record fields it reads from their slots: field -> (record class, attribute)
_NATIVE_SLOTS: dict[str, tuple[type, str]] = {
    **{f"t_{name}": (TensorRef, name) for name in ("storage", "storage_offset", "shape", "stride", "requires_grad")},
    **{f"t_{name}": (TensorRef, name) for name in ("hooks", "rebuild", "dtype_global", "metadata", "param")},
    **{f"s_{name}": (StorageRef, name) for name in ("storage_type", "location", "numel")},
    **{f"g_{name}": (Global, name) for name in ("module", "name", "allowed")},
    **{f"p_{name}": (ParamInfo, name) for name in ("requires_grad", "hooks", "state")},
    **{f"r_{name}": (Reduce, name) for name in ("func", "args", "state")},
}


def dumps(root: Tree, *, only: frozenset[str] | None = None) -> PickleResult:
    """Pickle ``root`` the way ``torch.save`` would; returns the bytes and storages in key order.

    One walk first finds the objects referred to more than once (shared, or in a cycle): only
    those get memo entries, so the memo stays small however many tensors there are.

    ``only``: the globals the pickle may name, for pickles that are not a checkpoint (a DCP
    folder's ``.metadata``: :data:`~ckptfix.pickling.globals.DCP_METADATA_WRITES`); naming any
    other is a ckptfix bug, never written. Those few small pickles are left to Python.

    With the native engine the library writes the same bytes (native/src/emit.rs mirrors this
    module step by step); a tree holding anything it leaves to Python comes back here.
    """
    if only is None:
        native = native_emit.torch_pickle(root, _NATIVE_OBJECTS, _NATIVE_SLOTS)
        if native is not None:
            return PickleResult(native[0], native[1])
    return dumps_python(root, only=only)


def dumps_whole(root: Tree) -> tuple[PickleResult, bool] | None:
    """The native engine's :func:`dumps`, and whether every storage a tensor uses is spanned
    whole by one of its tensors (so compaction, ``formats/compact.py``, has nothing to cut and
    need not walk the tree); None where the native emitter does not run."""
    native = native_emit.torch_pickle_whole(
        root, _NATIVE_OBJECTS, _NATIVE_SLOTS, ((TensorRef, "dtype"), (StorageRef, "itemsize")), DTYPE_ITEMSIZE
    )
    return None if native is None else (PickleResult(native[0], native[1]), native[2])


def dumps_python(root: Tree, *, only: frozenset[str] | None = None) -> PickleResult:
    """:func:`dumps` in Python: the reference engine, and the fallback for rare records."""
    emitter = _Emitter(only)
    shared = emitter.shared
    for _ in walk(root, revisit=lambda value: shared.add(id(value))):
        pass
    emitter.run(root)
    emitter.out += b"."
    return PickleResult(emitter.out, emitter.storages)  # the bytearray itself: no second copy
