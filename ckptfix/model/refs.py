"""The checkpoint tree: plain Python containers whose leaves are lazy references.

A checkpoint read by ckptfix is the object ``torch.load`` would return, except that

* every tensor is a :class:`TensorRef` -- dtype, shape, stride, offset and the
  :class:`StorageRef` holding its bytes, which stay in the file;
* every other torch object the pickle builds (``torch.Size``, ``torch.device``, sparse or
  quantized tensors) is a :class:`Reduce` record of the allow-listed call, kept as data and
  written back unchanged, never executed.

Containers (dict, OrderedDict with its ``_metadata``, list, tuple, set) are real Python
objects, so transforms are ordinary Python code and Python users can walk the tree.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from ..errors import BadInputError
from ..fileio.ranges import ComputedSource, FileRange
from .dtypes import DTYPE_ITEMSIZE, DTYPE_STORAGE, STORAGE_DTYPE

#: A checkpoint tree, or any node of one: what ``torch.load`` would return, with the records
#: below as leaves (or real torch tensors, for formats read through torch) inside plain
#: containers. ``Any`` on purpose: a tree holds whatever an allowed pickle builds, and code
#: walks it with ``isinstance`` checks; the alias says "a tree" in signatures where a bare
#: ``Any`` would say nothing.
Tree: TypeAlias = Any

#: where a storage's bytes are: a byte range of a file, or bytes made on demand (a dtype cast)
Source: TypeAlias = FileRange | ComputedSource

#: marks an optional positional argument that the pickle did not pass
ABSENT: Any = type("Absent", (), {"__repr__": lambda self: "ABSENT"})()


class _EmptyHooks:
    """The empty ``OrderedDict()`` torch.save pickles as every tensor's backward hooks.

    One shared, falsy, immutable marker instead of an OrderedDict per tensor (136 bytes each,
    200 000 in a training checkpoint); the writer spells it ``OrderedDict()`` again.
    """

    __slots__ = ()

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "OrderedDict()"


EMPTY_HOOKS: Any = _EmptyHooks()


@dataclass(frozen=True, slots=True)
class Global:
    """A module-level name the pickle refers to (``torch._utils._rebuild_tensor_v2``).

    Frozen, no ``__dict__`` and no ``__setstate__``: a pickle that fetches an allowed global
    cannot turn it into another one (the VM refuses BUILD on it, and nothing else writes it).

    ``allowed`` is False for a global read as an inert record although nothing allows it (a
    config class in a part of the checkpoint the output leaves out): the writers refuse to
    write one, so no output carries a global the user did not allow, whatever the caller did.
    """

    module: str
    name: str
    allowed: bool = field(default=True, compare=False)
    #: ``module.name``, computed once (writers and checks ask for it per tensor)
    full: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "full", f"{self.module}.{self.name}")

    def __repr__(self) -> str:
        return self.full


class Reduce:
    """An allow-listed call recorded as data: ``func(*args)`` (``torch.Size``, sparse tensors...).

    Made once by the reader, never changed: the VM refuses BUILD on it, as torch does.
    ``state`` is ABSENT for everything the reader makes; it exists for trees built in code.
    """

    __slots__ = ("args", "func", "state")

    def __init__(self, func: Global, args: tuple[Any, ...], state: Any = ABSENT) -> None:
        self.func, self.args, self.state = func, args, state

    def __repr__(self) -> str:
        if self.func.full == "torch.Size" and self.args and isinstance(self.args[0], (tuple, list)):
            return f"torch.Size({list(self.args[0])[:16]})"
        if self.func.full == "torch.device":
            return f"device({', '.join(repr(a)[:40] for a in self.args[:2])})"
        return f"{self.func.full}(...)"


class OpaqueObject:
    """An object of a global outside torch's allow-list: recorded, never built. Allowed by name
    (``--allow-global``), or read without being allowed (``global_.allowed`` False: no writer
    writes it).

    The pickle's construction is kept as data and written back exactly: ``kind`` is
    ``"reduce"`` (``cls(*args)``), ``"newobj"`` (``cls.__new__(cls, *args)``) or ``"newobj_ex"``
    (with ``kwargs``); ``items``/``dictitems`` are what APPENDS/SETITEMS added; ``state`` is what
    BUILD gave. The VM fills ``items``, ``dictitems`` and ``state`` while reading (``state`` only
    once); ``global_`` and ``kind`` never change.
    """

    __slots__ = ("args", "dictitems", "global_", "items", "kind", "kwargs", "state")

    def __init__(
        self, global_: Global, args: tuple[Any, ...], kind: str = "reduce", kwargs: dict[Any, Any] | None = None
    ) -> None:
        self.global_, self.args, self.kind, self.kwargs = global_, args, kind, kwargs
        self.items: list[Any] = []
        self.dictitems: list[tuple[Any, Any]] = []
        self.state: Any = ABSENT

    @property
    def name(self) -> str:
        return self.global_.full

    def __repr__(self) -> str:
        how = "kept as is" if self.global_.allowed else "not allowed: read as inert data"
        return f"<{self.global_.full} ({how})>"


@dataclass(eq=False, slots=True)
class StorageRef:
    """One storage record: ``data/<key>`` in the archive, with its dtype and device tag.

    No ``__dict__`` and no ``__setstate__``; the VM refuses BUILD/SETITEMS on it. Readers set
    ``source`` once, when they learn where the bytes are (the legacy format lists them after
    the pickle); :func:`check_extents` then checks every tensor against it.
    """

    key: str
    storage_type: Global
    location: str
    numel: int
    itemsize: int
    dtype: str
    #: where the bytes are (None until a reader knows: the legacy format lists them after the pickle)
    source: Source | None = field(repr=False, default=None)
    #: byte order of the stored elements ("big" only for files saved on big-endian machines)
    byteorder: str = "little"

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True, slots=True)
class ParamInfo:
    """What ``_rebuild_parameter(_with_state)`` adds on top of the tensor."""

    requires_grad: Any
    hooks: Any
    state: Any = ABSENT


@dataclass(eq=False, slots=True)
class TensorRef:
    """A tensor without its data: a view (offset, shape, stride) into a :class:`StorageRef`.

    Built by the reader from ``_rebuild_tensor*`` calls and never changed afterwards (transforms
    make new ones with :func:`dataclasses.replace`). Its extent is checked against the storage
    once the whole pickle is read (:func:`check_extents`), not while building it.
    """

    storage: StorageRef
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    requires_grad: Any = False
    hooks: Any = EMPTY_HOOKS
    #: "v2" (dtype from the storage class) or "v3" (untyped storage + dtype global)
    rebuild: str = "v2"
    dtype_global: Global | None = None
    metadata: Any = ABSENT
    param: ParamInfo | None = None

    @property
    def device(self) -> str:
        return self.storage.location

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_ITEMSIZE.get(self.dtype, 1)


def make_storage(
    storage_type: Global, key: str, location: str, numel: int, source: Source | None, byteorder: str = "little"
) -> StorageRef:
    """Build the :class:`StorageRef` for a persistent id ``('storage', type, key, loc, numel)``."""
    dtype = STORAGE_DTYPE.get(storage_type.name)
    if dtype is None:
        raise BadInputError(f"corrupt checkpoint: unknown storage type {storage_type.full}")
    return StorageRef(key, storage_type, location, numel, DTYPE_ITEMSIZE[dtype], dtype, source, byteorder)


def tensor_from_range(dtype: str, shape: tuple[int, ...], source: Source, location: str = "cpu") -> TensorRef:
    """A contiguous tensor whose bytes are ``source`` (as safetensors stores them), pickled as
    torch.save would pickle it: a typed storage for classic dtypes, untyped + dtype otherwise."""
    itemsize = DTYPE_ITEMSIZE[dtype]
    numel = source.size // itemsize
    stride, step = [], 1
    for size in reversed(shape):  # torch's contiguous strides: a 0-size dimension counts as 1
        stride.append(step)
        step *= max(size, 1)
    storage_name = DTYPE_STORAGE.get(dtype)
    if storage_name:
        storage = StorageRef("0", Global("torch", storage_name), location, numel, itemsize, dtype, source)
        return TensorRef(storage, 0, shape, tuple(reversed(stride)), dtype, False, EMPTY_HOOKS)
    storage = StorageRef("0", Global("torch.storage", "UntypedStorage"), location, source.size, 1, "uint8", source)
    return TensorRef(
        storage,
        0,
        shape,
        tuple(reversed(stride)),
        dtype,
        False,
        EMPTY_HOOKS,
        rebuild="v3",
        dtype_global=Global("torch", dtype),
    )


def is_torch_tensor(value: Any) -> bool:
    """True for a real ``torch.Tensor`` (from the torch fallback loader), without importing torch."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def is_tensor_like(value: Any) -> bool:
    """A leaf that holds tensor data: a :class:`TensorRef`, a rebuilt torch tensor kind, or a real tensor."""
    if isinstance(value, TensorRef):
        return True
    if isinstance(value, Reduce):
        name = value.func.full
        return name.startswith("torch._utils._rebuild") or name == "torch._tensor._rebuild_from_type_v2"
    return is_torch_tensor(value)


#: how torch pickles a tensor on the ``meta`` device: dtype, shape and stride, and no data at all
META_REBUILD = "torch._utils._rebuild_meta_tensor_no_storage"


def is_meta_tensor(value: Any) -> bool:
    """A tensor saved from the ``meta`` device (a model built with ``device="meta"``): it has a
    shape and a dtype but no data, so nothing can load weights from it."""
    if isinstance(value, Reduce):
        return value.func.full == META_REBUILD
    return is_torch_tensor(value) and bool(getattr(value, "is_meta", False))


def meta_shape(value: Reduce) -> tuple[str, list[int]]:
    """The dtype name and shape a meta tensor's rebuild call records."""
    dtype, shape = (value.args + (None, ()))[:2]
    name = getattr(dtype, "name", None) or str(dtype).replace("torch.", "")
    return name, [int(n) for n in shape] if isinstance(shape, (tuple, list)) else []
