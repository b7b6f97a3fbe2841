"""Writes a checkpoint tree back as the protocol-2 pickle ``torch.save`` produces.

Python's own pickler cannot do this without torch: to write ``GLOBAL torch._utils
_rebuild_tensor_v2`` it imports the module to check the name. We emit the opcodes ourselves,
using only those that torch's ``weights_only`` unpickler understands, laid out the way
``torch.save`` lays them out (same memo use, same reduce forms), so the result loads with
``torch.load(weights_only=True)`` and compares equal to what torch would have written.

Storages are renumbered ``"0", "1", ...`` in the order they first appear, as ``torch.save``
numbers them; :attr:`PickleResult.storages` lists them in that order for the zip writer.
"""

from __future__ import annotations

import struct
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

from .errors import BadInputError
from .tree import ABSENT, Global, OpaqueObject, Reduce, StorageRef, TensorRef

_PROTO2 = b"\x80\x02"
_STOP = b"."
_MARK, _TUPLE, _EMPTY_TUPLE, _TUPLE1, _TUPLE2, _TUPLE3 = b"(", b"t", b")", b"\x85", b"\x86", b"\x87"
_EMPTY_DICT, _SETITEMS, _EMPTY_LIST, _APPENDS = b"}", b"u", b"]", b"e"
_NONE, _TRUE, _FALSE = b"N", b"\x88", b"\x89"
_BININT, _BININT1, _BININT2, _LONG1, _LONG4 = b"J", b"K", b"M", b"\x8a", b"\x8b"
_BINFLOAT, _BINUNICODE, _GLOBAL, _REDUCE, _BUILD, _BINPERSID = b"G", b"X", b"c", b"R", b"b", b"Q"
_BINPUT, _LONG_BINPUT, _BINGET, _LONG_BINGET = b"q", b"r", b"h", b"j"
_NEWOBJ, _NEWOBJ_EX = b"\x81", b"\x92"
_BATCH = 1000  # items per SETITEMS/APPENDS, as pickle does
_TUPLE_OPS = {0: _EMPTY_TUPLE, 1: _TUPLE1, 2: _TUPLE2, 3: _TUPLE3}
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


@dataclass
class PickleResult:
    data: bytes
    #: storages in the order their new keys were given ("0", "1", ...)
    storages: list[StorageRef] = field(default_factory=list)


class _Emitter:
    def __init__(self) -> None:
        self.out: list[bytes] = [_PROTO2]
        self.memo: dict[Any, int] = {}
        self.storage_keys: dict[int, str] = {}
        self.storages: list[StorageRef] = []
        self.alive: list[Any] = []

    # -- memo ---------------------------------------------------------------------------
    def _get(self, key: Any) -> bool:
        index = self.memo.get(key)
        if index is None:
            return False
        self.out.append(_BINGET + bytes([index]) if index < 256 else _LONG_BINGET + struct.pack("<I", index))
        return True

    def _put(self, key: Any) -> None:
        index = self.memo[key] = len(self.memo)
        self.out.append(_BINPUT + bytes([index]) if index < 256 else _LONG_BINPUT + struct.pack("<I", index))

    # -- values -------------------------------------------------------------------------
    def emit(self, value: Any) -> None:
        kind = type(value)
        if value is None:
            self.out.append(_NONE)
        elif kind is bool:
            self.out.append(_TRUE if value else _FALSE)
        elif kind is int:
            self._int(value)
        elif kind is float:
            self.out.append(_BINFLOAT + struct.pack(">d", value))
        elif kind is str:
            self._str(value)
        elif isinstance(value, TensorRef):
            self._tensor(value)
        elif isinstance(value, StorageRef):
            self._storage(value)
        elif isinstance(value, Global):
            self._global(value)
        elif isinstance(value, Reduce):
            self._reduce_node(value)
        elif isinstance(value, OpaqueObject):
            self._opaque(value)
        elif isinstance(value, type) and issubclass(value, OpaqueObject):
            self._global(value.ckptfix_global)
        elif kind is tuple:
            self._tuple(value)
        elif kind is list:
            self._list(value)
        elif kind is dict:
            self._dict(value)
        elif kind in (OrderedDict, Counter):
            self._special_mapping(value)
        elif kind is bytes:
            self._bytes(value)
        elif kind in (set, frozenset):
            self._reduce(value, _SET if kind is set else _FROZENSET, (list(value),))
        elif kind is bytearray:
            self._reduce(value, _BYTEARRAY, (bytes(value).decode("latin-1"), "latin-1"))
        elif kind is complex:
            self._reduce(value, _COMPLEX, (value.real, value.imag))
        else:
            raise BadInputError(f"cannot write a {kind.__name__} into a torch checkpoint")

    def _int(self, value: int) -> None:
        if 0 <= value < 256:
            self.out.append(_BININT1 + bytes([value]))
        elif 0 <= value < 65536:
            self.out.append(_BININT2 + struct.pack("<H", value))
        elif -(2**31) <= value < 2**31:
            self.out.append(_BININT + struct.pack("<i", value))
        else:
            encoded = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
            if len(encoded) < 256:
                self.out.append(_LONG1 + bytes([len(encoded)]) + encoded)
            else:
                self.out.append(_LONG4 + struct.pack("<i", len(encoded)) + encoded)

    def _str(self, value: str) -> None:
        if self._get(("str", value)):
            return
        encoded = value.encode("utf-8", "surrogatepass")
        self.out.append(_BINUNICODE + struct.pack("<I", len(encoded)) + encoded)
        self._put(("str", value))

    def _global(self, value: Global) -> None:
        if self._get(("global", value.module, value.name)):
            return
        module = _PY2_MODULES.get(value.module, value.module)
        self.out.append(_GLOBAL + f"{module}\n{value.name}\n".encode())
        self._put(("global", value.module, value.name))

    def _bytes(self, value: bytes) -> None:
        # protocol 2 has no bytes opcode torch's safe loader reads: pickle uses _codecs.encode
        if self._get(id(value)):
            return
        self._global(_ENCODE)
        self._tuple_of((value.decode("latin-1"), "latin1"))
        self.out.append(_REDUCE)
        self._put(id(value))

    def _tuple_of(self, items: tuple) -> None:
        op = _TUPLE_OPS.get(len(items))
        if op is None:
            self.out.append(_MARK)
        for item in items:
            self.emit(item)
        self.out.append(op if op is not None else _TUPLE)

    def _tuple(self, value: tuple) -> None:
        if self._get(id(value)):
            return
        self._tuple_of(value)
        self._put(id(value))
        self._keep_alive(value)

    def _list(self, value: list) -> None:
        if self._get(id(value)):
            return
        self.out.append(_EMPTY_LIST)
        self._put(id(value))
        self._keep_alive(value)
        for start in range(0, len(value), _BATCH):
            batch = value[start : start + _BATCH]
            self.out.append(_MARK)
            for item in batch:
                self.emit(item)
            self.out.append(_APPENDS)

    def _setitems(self, items: list) -> None:
        for start in range(0, len(items), _BATCH):
            self.out.append(_MARK)
            for key, item in items[start : start + _BATCH]:
                self.emit(key)
                self.emit(item)
            self.out.append(_SETITEMS)

    def _dict(self, value: dict) -> None:
        if self._get(id(value)):
            return
        self.out.append(_EMPTY_DICT)
        self._put(id(value))
        self._keep_alive(value)
        self._setitems(list(value.items()))

    def _special_mapping(self, value: OrderedDict | Counter) -> None:
        """OrderedDict/Counter: ``cls()`` then items then BUILD with ``__dict__`` (``_metadata``)."""
        if self._get(id(value)):
            return
        if type(value) is Counter:
            self._global(_COUNTER)
            self._tuple_of((dict(value),))
        else:
            self._global(_ORDERED_DICT)
            self.out.append(_EMPTY_TUPLE)
        self.out.append(_REDUCE)
        self._put(id(value))
        self._keep_alive(value)
        if type(value) is OrderedDict:
            self._setitems(list(value.items()))
        state = getattr(value, "__dict__", None)
        if state:
            self.emit(dict(state))
            self.out.append(_BUILD)

    def _reduce(self, value: Any, func: Global, args: tuple, state: Any = ABSENT) -> None:
        if self._get(id(value)):
            return
        self._global(func)
        self._tuple_of(args)
        self.out.append(_REDUCE)
        self._put(id(value))
        self._keep_alive(value)
        if state is not ABSENT:
            self.emit(state)
            self.out.append(_BUILD)

    def _reduce_node(self, value: Reduce) -> None:
        self._reduce(value, value.func, value.args, value.state)

    def _opaque(self, value: OpaqueObject) -> None:
        """An allowed-by-name object, written back the way it was read: REDUCE or NEWOBJ(_EX),
        then its list/dict items, then its BUILD state."""
        if self._get(id(value)):
            return
        self._global(value.ckptfix_global)
        self._tuple_of(value.ckptfix_args)
        if value.ckptfix_called:
            self.out.append(_REDUCE)
        elif value.ckptfix_kwargs:
            self.emit(dict(value.ckptfix_kwargs))
            self.out.append(_NEWOBJ_EX)
        else:
            self.out.append(_NEWOBJ)
        self._put(id(value))
        self._keep_alive(value)
        for start in range(0, len(value.ckptfix_items), _BATCH):
            self.out.append(_MARK)
            for item in value.ckptfix_items[start : start + _BATCH]:
                self.emit(item)
            self.out.append(_APPENDS)
        if value.ckptfix_dictitems:
            self._setitems(value.ckptfix_dictitems)
        if value.ckptfix_state is not ABSENT:
            self.emit(value.ckptfix_state)
            self.out.append(_BUILD)

    def _storage(self, storage: StorageRef) -> None:
        key = self.storage_keys.get(id(storage))
        if key is None:
            key = self.storage_keys[id(storage)] = str(len(self.storages))
            self.storages.append(storage)
        self._tuple_of(("storage", storage.storage_type, key, storage.location, storage.numel))
        self.out.append(_BINPERSID)

    def _tensor(self, tensor: TensorRef) -> None:
        if self._get(id(tensor)):
            return
        if tensor.param is not None:
            with_state = tensor.param.state is not ABSENT
            self._global(_REBUILD_PARAM_STATE if with_state else _REBUILD_PARAM)
            self.out.append(_MARK)
        self._plain_tensor(tensor)
        if tensor.param is not None:
            self.emit(tensor.param.requires_grad)
            self.emit(tensor.param.hooks)
            if tensor.param.state is not ABSENT:
                self.emit(tensor.param.state)
            self.out.append(_TUPLE)
            self.out.append(_REDUCE)
        self._put(id(tensor))
        self._keep_alive(tensor)

    def _plain_tensor(self, t: TensorRef) -> None:
        self._global(_REBUILD_V3 if t.rebuild == "v3" else _REBUILD_V2)
        self.out.append(_MARK)
        self._storage(t.storage)
        self.emit(t.storage_offset)
        self._tuple_of(t.shape)
        self._tuple_of(t.stride)
        self.emit(t.requires_grad)
        self.emit(t.hooks)
        if t.rebuild == "v3":
            self.emit(t.dtype_global)
        if t.metadata is not ABSENT:
            self.emit(t.metadata)
        self.out.append(_TUPLE)
        self.out.append(_REDUCE)

    def _keep_alive(self, value: Any) -> None:
        # the memo is keyed by id(): keep temporaries (e.g. a Counter's dict copy) alive so no
        # id is reused by a different object while the pickle is being written
        self.alive.append(value)


def dumps(root: Any) -> PickleResult:
    """Pickle ``root`` the way ``torch.save`` would; returns the bytes and storages in key order."""
    emitter = _Emitter()
    try:
        emitter.emit(root)
    except RecursionError as exc:
        raise BadInputError("the checkpoint is nested too deeply to write") from exc
    emitter.out.append(_STOP)
    return PickleResult(b"".join(emitter.out), emitter.storages)
