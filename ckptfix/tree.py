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
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from .dtypes import DTYPE_ITEMSIZE, DTYPE_STORAGE, STORAGE_DTYPE
from .errors import BadInputError

#: marks an optional positional argument that the pickle did not pass
ABSENT: Any = type("Absent", (), {"__repr__": lambda self: "ABSENT"})()


@dataclass(frozen=True)
class Global:
    """A module-level name the pickle refers to (``torch._utils._rebuild_tensor_v2``).

    Calling it (which the unpickler does for REDUCE) never runs the real function: it builds
    a :class:`TensorRef` for the tensor-rebuild functions and a :class:`Reduce` otherwise.
    """

    module: str
    name: str

    @property
    def full(self) -> str:
        return f"{self.module}.{self.name}"

    def __call__(self, *args: Any) -> Any:
        builder = _CALL_BUILDERS.get(self.full)
        return builder(self, args) if builder else Reduce(self, args)

    def __repr__(self) -> str:
        return self.full


class Reduce:
    """An allow-listed call recorded as data: ``func(*args)``, plus BUILD state if any."""

    __slots__ = ("args", "func", "state")

    def __init__(self, func: Global, args: tuple, state: Any = ABSENT) -> None:
        self.func, self.args, self.state = func, args, state

    def __setstate__(self, state: Any) -> None:  # the pickle's BUILD opcode
        self.state = state

    def __repr__(self) -> str:
        if self.func.full == "torch.Size" and self.args:
            return f"torch.Size({list(self.args[0])})"
        if self.func.full == "torch.device":
            return f"device({', '.join(map(repr, self.args))})"
        return f"{self.func.full}(...)"


class OpaqueObject:
    """An object of a global the user allowed by name (``--allow-global``): recorded, never built.

    Its class is made up on the spot (see :func:`opaque_class`); nothing is imported. The
    pickle's construction -- ``cls(*args)`` (REDUCE) or ``cls.__new__(cls, *args)`` (NEWOBJ),
    list/dict items, BUILD state -- is kept as data and written back exactly.
    """

    ckptfix_global: Global

    def __new__(cls, *args: Any, **kwargs: Any) -> OpaqueObject:
        obj = object.__new__(cls)
        obj.__dict__.update(ckptfix_args=args, ckptfix_kwargs=kwargs, ckptfix_called=False,
                            ckptfix_state=ABSENT, ckptfix_items=[], ckptfix_dictitems=[])
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.__dict__["ckptfix_called"] = True  # REDUCE calls the class; NEWOBJ only __new__

    def __setstate__(self, state: Any) -> None:
        self.__dict__["ckptfix_state"] = state

    def append(self, item: Any) -> None:
        self.ckptfix_items.append(item)

    def extend(self, items: Any) -> None:
        self.ckptfix_items.extend(items)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.ckptfix_dictitems.append((key, value))

    def __repr__(self) -> str:
        return f"<{self.ckptfix_global.full} (kept as is)>"


_OPAQUE_CLASSES: dict[str, type[OpaqueObject]] = {}


def opaque_class(module: str, name: str) -> type[OpaqueObject]:
    """A stand-in class for ``module.name``: same name for the writer, no behaviour at all."""
    full = f"{module}.{name}"
    cls = _OPAQUE_CLASSES.get(full)
    if cls is None:
        cls = type(name, (OpaqueObject,), {"ckptfix_global": Global(module, name), "__module__": "ckptfix.opaque"})
        _OPAQUE_CLASSES[full] = cls
    return cls


@dataclass(eq=False)
class StorageRef:
    """One storage record: ``data/<key>`` in the archive, with its dtype and device tag."""

    key: str
    storage_type: Global
    location: str
    numel: int
    itemsize: int
    dtype: str
    #: where the bytes are: a :class:`~ckptfix.sources.FileRange`
    source: Any = field(repr=False, default=None)
    #: byte order of the stored elements ("big" only for files saved on big-endian machines)
    byteorder: str = "little"

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True)
class ParamInfo:
    """What ``_rebuild_parameter(_with_state)`` adds on top of the tensor."""

    requires_grad: Any
    hooks: Any
    state: Any = ABSENT


@dataclass(eq=False)
class TensorRef:
    """A tensor without its data: a view (offset, shape, stride) into a :class:`StorageRef`."""

    storage: StorageRef
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    requires_grad: Any = False
    hooks: Any = None
    #: "v2" (dtype from the storage class) or "v3" (untyped storage + dtype global)
    rebuild: str = "v2"
    dtype_global: Global | None = None
    metadata: Any = ABSENT
    param: ParamInfo | None = None

    def __setstate__(self, state: Any) -> None:
        raise BadInputError("corrupt pickle: BUILD applied to a tensor")

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


def _as_int_tuple(value: Any, what: str) -> tuple[int, ...]:
    if isinstance(value, Reduce) and value.func.full == "torch.Size" and value.args:
        value = value.args[0]
    if not isinstance(value, (tuple, list)) or not all(type(v) is int and v >= 0 for v in value):
        raise BadInputError(f"corrupt tensor record: {what} is {value!r}")
    return tuple(value)


def _rebuild_tensor(func: Global, args: tuple) -> TensorRef:
    v3 = func.name == "_rebuild_tensor_v3"
    fixed = 7 if v3 else 6
    if len(args) not in (fixed, fixed + 1):
        raise BadInputError(f"corrupt tensor record: {func.name} got {len(args)} arguments")
    storage, offset, size, stride, requires_grad, hooks = args[:6]
    if not isinstance(storage, StorageRef) or type(offset) is not int or offset < 0:
        raise BadInputError("corrupt tensor record: bad storage or offset")
    shape, strides = _as_int_tuple(size, "size"), _as_int_tuple(stride, "stride")
    if len(shape) != len(strides):
        raise BadInputError("corrupt tensor record: size and stride differ in length")
    dtype_global = None
    if v3:
        dtype_global = args[6]
        if not isinstance(dtype_global, Global) or dtype_global.name not in DTYPE_ITEMSIZE:
            raise BadInputError(f"corrupt tensor record: unknown dtype {dtype_global!r}")
        dtype = dtype_global.name
        available = storage.nbytes // DTYPE_ITEMSIZE[dtype]
    else:
        dtype = storage.dtype
        available = storage.numel
    needed = 0 if 0 in shape else offset + sum((n - 1) * s for n, s in zip(shape, strides)) + 1
    if needed > available:
        raise BadInputError(
            f"corrupt tensor record: a {dtype} tensor of shape {list(shape)} needs {needed} "
            f"elements but its storage {storage.key!r} holds {available}"
        )
    return TensorRef(
        storage=storage, storage_offset=offset, shape=shape, stride=strides, dtype=dtype,
        requires_grad=requires_grad, hooks=hooks, rebuild="v3" if v3 else "v2",
        dtype_global=dtype_global, metadata=args[fixed] if len(args) > fixed else ABSENT,
    )


def _rebuild_parameter(func: Global, args: tuple) -> Any:
    with_state = func.name == "_rebuild_parameter_with_state"
    if len(args) != (4 if with_state else 3) or not isinstance(args[0], TensorRef):
        return Reduce(func, args)
    info = ParamInfo(args[1], args[2], args[3] if with_state else ABSENT)
    return replace(args[0], param=info)


_CALL_BUILDERS: dict[str, Callable[[Global, tuple], Any]] = {
    "torch._utils._rebuild_tensor_v2": _rebuild_tensor,
    "torch._utils._rebuild_tensor_v3": _rebuild_tensor,
    "torch._utils._rebuild_parameter": _rebuild_parameter,
    "torch._utils._rebuild_parameter_with_state": _rebuild_parameter,
}


def make_storage(
    storage_type: Global, key: str, location: str, numel: int, source: Any, byteorder: str = "little"
) -> StorageRef:
    """Build the :class:`StorageRef` for a persistent id ``('storage', type, key, loc, numel)``."""
    dtype = STORAGE_DTYPE.get(storage_type.name)
    if dtype is None:
        raise BadInputError(f"corrupt checkpoint: unknown storage type {storage_type.full}")
    return StorageRef(key, storage_type, location, numel, DTYPE_ITEMSIZE[dtype], dtype, source, byteorder)


def tensor_from_range(dtype: str, shape: tuple[int, ...], source: Any, location: str = "cpu") -> TensorRef:
    """A contiguous tensor whose bytes are ``source`` (as safetensors stores them), pickled as
    torch.save would pickle it: a typed storage for classic dtypes, untyped + dtype otherwise."""
    from collections import OrderedDict

    itemsize = DTYPE_ITEMSIZE[dtype]
    numel = source.size // itemsize
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= size
    storage_name = DTYPE_STORAGE.get(dtype)
    if storage_name:
        storage = StorageRef("0", Global("torch", storage_name), location, numel, itemsize, dtype, source)
        return TensorRef(storage, 0, shape, tuple(reversed(stride)), dtype, False, OrderedDict())
    storage = StorageRef("0", Global("torch.storage", "UntypedStorage"), location, source.size, 1, "uint8", source)
    return TensorRef(
        storage, 0, shape, tuple(reversed(stride)), dtype, False, OrderedDict(),
        rebuild="v3", dtype_global=Global("torch", dtype),
    )


# --------------------------------------------------------------------------- tree walking

Path = tuple[Any, ...]


#: containers nested deeper than this are refused at read time: real checkpoints nest a few
#: levels; a hostile pickle nests 10**5 deep to make every later walk slow or recursive code crash
MAX_NESTING = 1000


def check_nesting(root: Any, limit: int = MAX_NESTING) -> None:
    """Raise :class:`BadInputError` if containers nest deeper than ``limit`` (cycles are fine)."""
    seen: set[int] = set()
    stack: list[tuple[Any, int]] = [(root, 0)]
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            raise BadInputError(f"corrupt or hostile checkpoint: containers nested more than {limit} deep")
        if id(value) in seen:
            continue
        if isinstance(value, Mapping):
            seen.add(id(value))
            stack.extend((v, depth + 1) for v in value.values())
            stack.extend((k, depth + 1) for k in value if isinstance(k, tuple))
        elif isinstance(value, (list, tuple, set, frozenset)):
            seen.add(id(value))
            stack.extend((v, depth + 1) for v in value)
        elif isinstance(value, Reduce):
            seen.add(id(value))
            stack.append((value.args, depth + 1))
            stack.append((value.state, depth + 1))
        elif isinstance(value, OpaqueObject):
            seen.add(id(value))
            stack.extend((v, depth + 1) for v in value.__dict__.values())


def format_path(path: Path) -> str:
    """Dotted form of a container path, as ``--key`` accepts it ("" is the root)."""
    return ".".join(str(p) for p in path)


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


def children(value: Any) -> Iterator[tuple[Any, Any]]:
    """(key, child) pairs of a container, in order; nothing for leaves."""
    if isinstance(value, Mapping):
        yield from value.items()
    elif isinstance(value, (list, tuple)):
        yield from enumerate(value)


def _walk_leaves(root: Any) -> Iterator[tuple[Path, Any]]:
    """Every TensorRef and bare StorageRef in the tree, with paths, including inside recorded calls."""
    seen: set[int] = set()
    stack: list[tuple[Path, Any]] = [((), root)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, (TensorRef, StorageRef)):
            yield path, value
            continue
        if id(value) in seen:
            continue
        if isinstance(value, (Mapping, list, tuple, set, frozenset, Reduce, OpaqueObject)):
            seen.add(id(value))
        if isinstance(value, OpaqueObject):
            items = [("__args__", value.ckptfix_args), ("__items__", value.ckptfix_items),
                     ("__dictitems__", value.ckptfix_dictitems)]
            if value.ckptfix_state is not ABSENT:
                items.append(("__state__", value.ckptfix_state))
        elif isinstance(value, Reduce):
            items = list(enumerate(value.args))
            if value.state is not ABSENT:
                items.append(("__state__", value.state))
        elif isinstance(value, (set, frozenset)):
            items = list(enumerate(value))
        else:
            items = list(children(value))
        stack.extend((path + (k,), v) for k, v in reversed(items))


def iter_tensors(root: Any) -> Iterator[tuple[Path, TensorRef]]:
    """Every :class:`TensorRef` in the tree, with its path, including inside recorded calls."""
    for path, leaf in _walk_leaves(root):
        if isinstance(leaf, TensorRef):
            yield path, leaf


def iter_storages(root: Any) -> Iterator[StorageRef]:
    """Every distinct :class:`StorageRef` the tree uses, through tensors or directly."""
    seen: set[int] = set()
    for _, leaf in _walk_leaves(root):
        storage = leaf.storage if isinstance(leaf, TensorRef) else leaf
        if id(storage) not in seen:
            seen.add(id(storage))
            yield storage


def is_optimizer_state(value: Any) -> bool:
    """``Optimizer.state_dict()`` output: its keys are parameter ids and must never be renamed."""
    return isinstance(value, Mapping) and "state" in value and "param_groups" in value


def looks_like_state_dict(value: Any) -> bool:
    """A ``Module.state_dict()``-shaped mapping: string keys, every value a tensor.

    Values under keys ending in ``_extra_state`` may be anything (``get_extra_state``).
    """
    if not isinstance(value, Mapping) or not value:
        return False
    has_tensor = False
    for key, item in value.items():
        if not isinstance(key, str):
            return False
        if is_tensor_like(item):
            has_tensor = True
        elif not key.endswith("_extra_state"):
            return False
    return has_tensor


def find_state_dicts(root: Any) -> list[tuple[Path, Mapping]]:
    """All state-dict-like mappings in the tree, outermost first, with their paths.

    Optimizer states and mappings with non-string keys are not searched: their inner dicts
    (``{"exp_avg": ..., "exp_avg_sq": ...}``) look like state dicts but are not.
    """
    found: list[tuple[Path, Mapping]] = []
    stack: list[tuple[Path, Any]] = [((), root)]
    seen: set[int] = set()
    while stack:
        path, value = stack.pop()
        if id(value) in seen or not isinstance(value, (Mapping, list, tuple)):
            continue
        seen.add(id(value))
        if looks_like_state_dict(value):
            found.append((path, value))
            continue
        if is_optimizer_state(value):
            continue
        if isinstance(value, Mapping) and not all(isinstance(k, str) for k in value):
            continue
        stack.extend((path + (k,), v) for k, v in reversed(list(children(value))))
    return found


_MISSING = object()


def _lookup_key(container: Any, text: str) -> Any:
    if isinstance(container, Mapping):
        if text in container:
            return text
        if text.lstrip("-").isdigit() and int(text) in container:
            return int(text)
    elif isinstance(container, (list, tuple)) and text.isdigit() and int(text) < len(container):
        return int(text)
    return _MISSING


def resolve_path(root: Any, dotted: str) -> Path | None:
    """Turn a dotted path (``state_dict``, ``optimizer_states.0``) into a container path.

    Keys may themselves contain dots, so the longest matching key wins at each level.
    Returns None when nothing matches.
    """
    parts = dotted.split(".") if dotted else []
    path: list[Any] = []
    value, i = root, 0
    while i < len(parts):
        for j in range(len(parts), i, -1):
            key = _lookup_key(value, ".".join(parts[i:j]))
            if key is not _MISSING:
                path.append(key)
                value = value[key]
                i = j
                break
        else:
            return None
    return tuple(path)


def get_at(root: Any, path: Path) -> Any:
    """The value at ``path`` (a tuple of keys/indices)."""
    value = root
    for key in path:
        value = value[key]
    return value


def substitute(root: Any, replacements: dict[int, Any]) -> Any:
    """A copy of ``root`` where every object whose ``id`` is in ``replacements`` is replaced.

    Only containers on the way to a replaced object are copied; everything else is shared
    with ``root``. Replacing by identity keeps pickle-level sharing intact: a state dict
    referenced from two places (``model`` and ``ema`` being the same object) is replaced in
    both, exactly as torch's in-place edits would change it in both.
    """
    done: dict[int, Any] = {}

    def rebuild(value: Any) -> Any:
        key = id(value)
        if key in replacements:
            return replacements[key]
        if key in done:
            return done[key]
        if not isinstance(value, (Mapping, list, tuple, Reduce, OpaqueObject)):
            return value
        done[key] = value  # provisional: a cycle back to here keeps the original
        if isinstance(value, Mapping):
            items = [(k, rebuild(v)) for k, v in value.items()]
            changed = any(new is not old for (_, new), old in zip(items, value.values()))
            result = copy_mapping(value, items) if changed else value
        elif isinstance(value, Reduce):
            args, state = rebuild(value.args), rebuild(value.state)
            changed = args is not value.args or state is not value.state
            result = Reduce(value.func, args, state) if changed else value
        elif isinstance(value, OpaqueObject):
            parts = {k: rebuild(v) for k, v in value.__dict__.items()}
            changed = any(parts[k] is not v for k, v in value.__dict__.items())
            result = value
            if changed:
                result = object.__new__(type(value))
                result.__dict__.update(parts)
        else:
            elements = [rebuild(v) for v in value]
            changed = any(new is not old for new, old in zip(elements, value))
            result = type(value)(elements) if changed else value
        done[key] = result
        return result

    return rebuild(root)


def copy_mapping(original: Mapping, items: Any) -> Mapping:
    """A mapping of the same type as ``original`` with ``items``, keeping instance attributes
    such as the ``_metadata`` that ``Module.state_dict()`` attaches to its OrderedDict."""
    copy = type(original)()
    for k, v in items:
        copy[k] = v
    attrs = getattr(original, "__dict__", None)
    if attrs:
        copy.__dict__.update(attrs)
    return copy
