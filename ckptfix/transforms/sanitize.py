"""``--sanitize``: turn the objects a checkpoint pickles into plain data that
``torch.load(weights_only=True)`` accepts.

Training checkpoints hold config objects -- omegaconf ``DictConfig``/``ListConfig``,
dataclasses, Enums, ``argparse.Namespace``, ``pathlib`` paths, numpy scalars and arrays -- so
``torch.load`` (weights_only since torch 2.6) refuses them. The reader keeps each as an inert
record (nothing imported or run); this step decides what each becomes from its pickled
state alone, by one table of rules (:data:`RULES`, first match wins):

* omegaconf containers -> their ``_content`` (what ``OmegaConf.to_container(cfg)`` gives:
  dicts and lists, interpolations such as ``"${lr}"`` and ``"???"`` left as strings), value
  nodes -> their value;
* ``argparse.Namespace`` and any object whose state is its ``__dict__`` (dataclasses, plain
  classes; ``__slots__`` state too) -> a dict of its fields; a dict or list subclass -> its items;
* an object rebuilt from one value (``Enum`` members, ``Decimal``) -> that value; a
  ``namedtuple`` -> a tuple;
* ``pathlib`` paths -> str; ``datetime`` values -> ISO 8601 text, ``timedelta`` -> seconds;
* numpy scalars -> Python numbers, numpy arrays of numeric dtypes -> tensors (row-major,
  little-endian), numpy object arrays -> nested lists when every element converts, numpy
  dtypes -> their name;
* ``torch.torch_version.TorchVersion`` (a ``str`` subclass Lightning checkpoints carry) -> its string;
* a class or function named as a value (``typing.Any``, ``builtins.dict``) -> its name.

Objects the user allowed by name (``--allow-global``) pass through as they are. An object no
rule fits (a custom ``__reduce__`` with several arguments) stays, and the output check lists it.
numpy is used only to decode raw bytes the file carries, with a dtype parsed from a plain type
code (``'<f8'``); an array whose pickled shape does not match its bytes is corrupt input.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from ..errors import BadInputError, InputMismatchError
from ..fileio.ranges import ComputedSource, OpenFiles
from ..model.paths import Path, format_path
from ..model.refs import ABSENT, Global, OpaqueObject, TensorRef, Tree, tensor_from_range

if TYPE_CHECKING:
    import numpy as np
from ..model.walk import copy_mapping, substitute, walk
from ..pickling.globals import NUMPY_MODULES, canonical_name

#: numpy's limits on a shape: NPY_MAXDIMS (numpy 1.x), and a byte size that fits an npy_intp
_MAX_NDIM = 32
_MAX_BYTES = 2**63 - 1
_TYPE_CODE = re.compile(r"^[<>|=]?([biufc])(\d{1,2})$")
_TORCH_DTYPE = {
    "b1": "bool",
    "i1": "int8",
    "u1": "uint8",
    "i2": "int16",
    "i4": "int32",
    "i8": "int64",
    "u2": "uint16",
    "u4": "uint32",
    "u8": "uint64",
    "f2": "float16",
    "f4": "float32",
    "f8": "float64",
    "c8": "complex64",
    "c16": "complex128",
}


@dataclass
class SanitizeReport:
    replaced: list[dict[str, str]] = field(default_factory=list)


def _name(obj: OpaqueObject) -> str:
    return obj.global_.full


def _numpy_dtype(obj: Any) -> np.dtype[Any]:
    """A numpy dtype from a pickled ``numpy.dtype('f8', False, True)`` plus its byte-order state."""
    import numpy as np

    if not (isinstance(obj, OpaqueObject) and _name(obj) == "numpy.dtype" and obj.args):
        raise BadInputError(f"cannot sanitize: expected a numpy dtype, found {obj!r:.80}")
    code = obj.args[0]
    match = _TYPE_CODE.match(code) if isinstance(code, str) else None
    if not match or f"{match.group(1)}{match.group(2)}" not in _TORCH_DTYPE:
        raise InputMismatchError(f"cannot sanitize a numpy value of dtype {code!r:.40}: only numeric dtypes convert")
    state = obj.state
    order: Literal["<", ">", "="] = "="  # "|" (no byte order) and a missing state: native
    if isinstance(state, tuple) and len(state) > 1 and state[1] in ("<", ">"):
        order = state[1]
    dtype: np.dtype[Any] = np.dtype(match.group(1) + match.group(2)).newbyteorder(order)  # numpy types this Any
    return dtype


def _namespace(obj: OpaqueObject) -> Any:
    return dict(obj.state) if not obj.args and isinstance(obj.state, dict) else _NO_RULE


def _path(obj: OpaqueObject) -> Any:
    from pathlib import PurePosixPath, PureWindowsPath

    if not all(isinstance(a, str) for a in obj.args):
        return _NO_RULE
    return str((PureWindowsPath if "Windows" in _name(obj) else PurePosixPath)(*obj.args))


def _numpy_scalar(obj: OpaqueObject) -> Any:
    import numpy as np

    if len(obj.args) != 2:
        return _NO_RULE
    dtype, raw = _numpy_dtype(obj.args[0]), _plain(obj.args[1])
    raw = raw.encode("latin-1") if isinstance(raw, str) else raw
    if not isinstance(raw, bytes) or len(raw) != dtype.itemsize:
        raise BadInputError(f"cannot sanitize a corrupt numpy scalar ({_name(obj)})")
    return np.frombuffer(raw, dtype=dtype)[0].item()


def _numpy_dtype_name(obj: OpaqueObject) -> Any:
    return _numpy_dtype(obj).name


def _omegaconf(obj: OpaqueObject) -> Any:
    """Containers keep their values in ``_content`` (a dict, a list, or None/a string for a
    None, missing or interpolated container), value nodes in ``_val``. ``_parent`` and
    ``_metadata`` (types, flags, a back reference) are left out, as ``to_container`` does."""
    state = obj.state
    if not isinstance(state, dict):
        return _NO_RULE
    for key in ("_content", "_val"):
        if key in state:
            return state[key]
    return _NO_RULE


def _datetime(obj: OpaqueObject) -> Any:
    """``datetime``/``date``/``time`` pickle their C state as bytes: the stdlib constructor
    checks and decodes exactly that (no import beyond ``datetime``); ``timedelta`` pickles
    (days, seconds, microseconds)."""
    import datetime

    kind = getattr(datetime, _name(obj).rsplit(".", 1)[1])
    try:
        if kind is datetime.timedelta:
            return datetime.timedelta(*obj.args).total_seconds()
        raw = obj.args[0] if obj.args else None
        raw = raw.encode("latin-1") if isinstance(raw, str) else raw
        if not isinstance(raw, bytes) or (len(obj.args) > 1 and obj.args[1] is not None):
            return _NO_RULE  # a timezone object: left for the output check to list
        return kind(raw).isoformat()
    except (TypeError, ValueError, OverflowError):
        raise BadInputError(f"cannot sanitize a corrupt {_name(obj)}") from None


def _defaultdict(obj: OpaqueObject) -> Any:
    return dict(obj.dictitems) if obj.state is ABSENT else _NO_RULE


def _deque(obj: OpaqueObject) -> Any:
    return list(obj.items) if not obj.args or obj.args == ([],) else list(obj.args[0]) + list(obj.items)


def _reconstructor(obj: OpaqueObject) -> Any:
    """Protocol 0/1: ``copyreg._reconstructor(cls, base, state)`` then BUILD: an object."""
    return _fields(obj.state, obj.dictitems, obj.items) if len(obj.args) == 3 else _NO_RULE


def _fields(state: Any, dictitems: list[tuple[Any, Any]], items: list[Any]) -> Any:
    if dictitems:
        return dict(dictitems)
    if items:
        return list(items)
    if state is ABSENT or state is None:
        return {}
    if isinstance(state, dict):
        return dict(state)
    if isinstance(state, tuple) and len(state) == 2 and all(s is None or isinstance(s, dict) for s in state):
        return {**(state[0] or {}), **(state[1] or {})}  # (__dict__, __slots__ values)
    return _NO_RULE


def _generic(obj: OpaqueObject) -> Any:
    """Any other class, from the shape of its pickle: ``cls.__new__(cls, *args)`` + state (a
    dataclass, a plain object, a namedtuple), or ``cls(value)`` (an Enum member)."""
    if obj.kind == "reduce":
        if len(obj.args) == 1 and obj.state is ABSENT and not obj.items and not obj.dictitems:
            return obj.args[0]
        return _NO_RULE if obj.args else _fields(obj.state, obj.dictitems, obj.items)
    if obj.kwargs:
        return _NO_RULE
    if obj.args and obj.state is ABSENT and not obj.items and not obj.dictitems:
        return obj.args[0] if len(obj.args) == 1 else tuple(obj.args)
    return _fields(obj.state, obj.dictitems, obj.items) if not obj.args else _NO_RULE


def _version_string(obj: OpaqueObject) -> Any:
    """``TorchVersion("2.4.0")``: a ``str`` subclass pickled as ``cls.__new__(cls, "2.4.0")``."""
    if len(obj.args) == 1 and isinstance(obj.args[0], str) and not obj.items and not obj.dictitems:
        return str(obj.args[0])
    return _NO_RULE


def _is_object_dtype(obj: Any) -> bool:
    return isinstance(obj, OpaqueObject) and _name(obj) == "numpy.dtype" and obj.args[:1] in (("O8",), ("O4",), ("O",))


def _object_array(shape: Any, fortran: Any, items: Any) -> Any:
    """A numpy array of Python objects (``dtype=object``) as nested lists (what ``tolist()``
    gives), when its shape matches its items and every item is plain data or converts to it;
    ``_NO_RULE`` otherwise (the output check then names it)."""
    import numpy as np

    if not (isinstance(shape, tuple) and all(type(s) is int and s >= 0 for s in shape) and isinstance(items, list)):
        raise BadInputError("cannot sanitize a corrupt numpy object array")
    if len(shape) > _MAX_NDIM or math.prod(shape) != len(items):
        raise BadInputError(f"cannot sanitize a corrupt numpy object array: shape {shape!r:.80}, {len(items)} items")
    plain = [_plain(item) for item in items]
    if any(item is _NO_RULE or type(item) in (OpaqueObject, Global) for item in plain):
        return _NO_RULE
    array = np.empty(len(plain), dtype=object)
    array[:] = plain  # item by item: a list inside stays one element
    return array.reshape(shape, order="F" if fortran else "C").tolist()


_BUILTIN_TYPES = {"bytes": bytes, "str": str, "int": int, "float": float, "bool": bool, "complex": complex}
# not frozenset: torch's weights-only unpickler refuses it, so no plain form of one would load
_BUILTIN_TYPES |= {"tuple": tuple, "list": list, "dict": dict, "set": set}


def _builtin(obj: OpaqueObject) -> Any:
    """A builtin type called on a plain value (protocol 2 pickles ``b""`` as ``bytes()``)."""
    kind = _BUILTIN_TYPES[_name(obj).rsplit(".", 1)[1]]
    args = tuple(_plain(a) for a in obj.args)
    if obj.state is not ABSENT or obj.items or obj.dictitems or len(args) > 2:
        return _NO_RULE
    if any(type(a) not in (str, bytes, int, float, bool, tuple, list, dict) for a in args):
        return _NO_RULE
    if len(args) == 2 and not (kind is bytes and type(args[0]) is str and type(args[1]) is str):
        return _NO_RULE
    if kind is bytes and args and type(args[0]) is int:
        return _NO_RULE  # bytes(10**12) would allocate
    try:
        return kind(*args)
    except (TypeError, ValueError, LookupError, OverflowError):
        raise BadInputError(f"cannot sanitize a corrupt {_name(obj)}{args!r:.60}") from None


_NO_RULE: Any = object()
_PATHS = ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")

#: (does it apply to this global name, what it makes): the first that applies decides
RULES: tuple[tuple[Callable[[str], bool], Callable[[OpaqueObject], Any]], ...] = (
    (lambda n: n.startswith("builtins.") and n[9:] in _BUILTIN_TYPES, _builtin),
    (lambda n: n == "argparse.Namespace", _namespace),
    (lambda n: n in {f"pathlib.{p}" for p in _PATHS}, _path),
    (lambda n: n in {f"{m}.scalar" for m in NUMPY_MODULES}, _numpy_scalar),
    (lambda n: n in {f"{m}._reconstruct" for m in NUMPY_MODULES}, lambda obj: _array_to_tensor(obj)),
    (lambda n: n == "torch.torch_version.TorchVersion", _version_string),
    (lambda n: n == "numpy.dtype", _numpy_dtype_name),
    (lambda n: n.startswith("omegaconf."), _omegaconf),
    (lambda n: n in ("datetime.datetime", "datetime.date", "datetime.time", "datetime.timedelta"), _datetime),
    (lambda n: n == "collections.defaultdict", _defaultdict),
    (lambda n: n == "collections.deque", _deque),
    (lambda n: n == "copyreg._reconstructor", _reconstructor),
    (lambda n: not n.startswith(("numpy.", "torch.")), _generic),
)


def _convert(obj: OpaqueObject) -> Any:
    name = canonical_name(_name(obj))
    for applies, rule in RULES:
        if applies(name):
            return rule(obj)
    return _NO_RULE


def _array_to_tensor(obj: OpaqueObject) -> TensorRef:
    """A pickled numpy array as a tensor, after checking its shape against its bytes.

    The shape comes from the file, so its product is computed with Python integers (numpy's
    ``prod`` wraps around in int64: ``(2**62, 2**62)`` would claim 0 elements) and must equal
    the byte length exactly before numpy sees the shape; a corrupt array is bad input (exit 3).
    """
    import numpy as np

    state = obj.state
    if not (isinstance(state, tuple) and len(state) == 5):
        raise BadInputError("cannot sanitize a numpy array with an unexpected pickled state")
    _, shape, dtype_obj, fortran, raw = state
    if _is_object_dtype(dtype_obj):
        return _object_array(shape, fortran, raw)  # type: ignore[no-any-return]
    dtype, raw = _numpy_dtype(dtype_obj), _plain(raw)  # an empty array's b"" is pickled as bytes()
    raw = raw.encode("latin-1") if isinstance(raw, str) else raw
    if not (isinstance(shape, tuple) and all(type(s) is int and s >= 0 for s in shape) and isinstance(raw, bytes)):
        raise BadInputError("cannot sanitize a corrupt numpy array")
    too_big = f"cannot sanitize a corrupt numpy array: shape {shape!r:.80} is beyond what numpy can hold"
    if len(shape) > _MAX_NDIM or math.prod(s for s in shape if s) * dtype.itemsize > _MAX_BYTES:
        raise BadInputError(too_big)  # numpy refuses these even with a zero dimension
    count = math.prod(shape)
    if count * dtype.itemsize != len(raw):
        raise BadInputError(
            f"cannot sanitize a corrupt numpy array: shape {shape!r:.80} needs {count * dtype.itemsize} bytes of "
            f"{dtype.str}, the file holds {len(raw)}"
        )
    try:
        array = np.frombuffer(raw, dtype=dtype).reshape(shape, order="F" if fortran else "C")
    except (ValueError, OverflowError) as exc:
        raise BadInputError(too_big) from exc
    data = np.ascontiguousarray(array.astype(dtype.newbyteorder("<"), copy=False)).tobytes()
    torch_dtype = _TORCH_DTYPE[f"{dtype.kind}{dtype.itemsize}"]

    def produce(files: OpenFiles) -> bytes:
        return data

    return tensor_from_range(torch_dtype, tuple(shape), ComputedSource(len(data), produce))


def _plain(value: Any) -> Any:
    """What one record becomes, following records that become records (a node whose value is
    an Enum member); ``_NO_RULE`` if no rule fits."""
    for _ in range(_MAX_CHAIN):
        if type(value) is Global:
            return canonical_name(value.full) if not value.allowed else _NO_RULE
        if type(value) is not OpaqueObject or value.global_.allowed:
            return value
        value = _convert(value)
        if value is _NO_RULE:
            return value
    raise BadInputError("cannot sanitize: objects that stand for each other without end")


_MAX_CHAIN = 64


#: what a dict key becomes and the records it held, by the key's id (keys are alive in the tree):
#: a big tuple keying 20 000 dicts is converted once
_KeyCache = dict[int, tuple[Any, frozenset[str]]]


def _plain_key(key: Any, cache: _KeyCache) -> tuple[Any, frozenset[str]]:
    """A dict key as plain data (an Enum member as its value, a tuple of them) and the records
    it held; ``_NO_RULE`` where a record in it has no rule that makes it hashable (a dataclass
    becomes an unhashable dict). Tuples inside are done first (a stack, not recursion)."""
    stack: list[tuple[Any, bool]] = [(key, False)]
    while stack:
        value, ready = stack.pop()
        if id(value) in cache:
            continue
        if type(value) is tuple and not ready:
            stack.append((value, True))
            stack.extend((part, False) for part in value if id(part) not in cache)
            continue
        if type(value) is tuple:
            parts = [cache[id(part)] for part in value]
            plain = _NO_RULE if any(p is _NO_RULE for p, _ in parts) else tuple(p for p, _ in parts)
            cache[id(value)] = (plain, frozenset().union(*(names for _, names in parts)))
        elif (type(value) is Global and not value.allowed) or (
            type(value) is OpaqueObject and not value.global_.allowed
        ):
            plain = _plain(value)
            try:
                hash(plain)
            except TypeError:
                plain = _NO_RULE
            name = value.full if isinstance(value, Global) else _name(value)
            cache[id(value)] = (plain, frozenset((name,)))
        else:
            cache[id(value)] = (value, frozenset())
    return cache[id(key)]


def _rekeyed(mapping: Mapping[Any, Any], cache: _KeyCache) -> tuple[Any, frozenset[str]] | None:
    """A copy of ``mapping`` whose record keys are plain data (``{Split.TRAIN: ...}`` is
    ``{"train": ...}``) and the records they were, or None where it has none to convert, or
    they would not all stay distinct keys (the output check then names what is left)."""
    if all(type(k) not in (OpaqueObject, Global, tuple) for k in mapping):
        return None
    converted = [_plain_key(k, cache) for k in mapping]
    keys = [k for k, _ in converted]
    names = frozenset().union(*(n for _, n in converted))
    if not names or any(k is _NO_RULE for k in keys) or len(set(keys)) != len(keys):
        return None
    return copy_mapping(mapping, zip(keys, mapping.values())), names


def sanitize(root: Tree) -> tuple[Tree, SanitizeReport]:
    """A copy of ``root`` with every object read without being allowed replaced by plain data
    (see the module docstring); objects allowed by name pass through.

    One walk per converted object: the plain value may itself hold objects to convert (a
    config's fields), so each new container is walked in turn (a queue, not recursion: any
    depth the reader accepts). Replacements are by identity, so an object referenced twice
    (a config's parent link) is converted once and the tree's sharing is kept. A container is
    entered once over all the walks: 20 000 objects whose states share one big list would
    otherwise walk it 20 000 times (minutes for a 600 KB file).
    """
    report = SanitizeReport()
    replacements: dict[int, Tree] = {}
    queue: list[tuple[Path, Tree]] = [((), root)]
    entered: set[int] = set()  # everything entered stays alive (the tree, or a replacement)
    key_cache: _KeyCache = {}

    def descend(path: Path, value: Any) -> bool:
        if type(value) is OpaqueObject or id(value) in entered:
            return False  # allowed objects pass through whole, as they are
        entered.add(id(value))
        return True

    while queue:
        base, node = queue.pop()
        for path, value in walk(node, descend, leaves=True):
            if isinstance(value, Mapping) and id(value) not in replacements:
                rekeyed = _rekeyed(value, key_cache)
                if rekeyed is not None:  # its values are converted below, and mapped into it
                    replacements[id(value)] = rekeyed[0]
                    where = format_path(base + path) or "(top level)"
                    for name in sorted(rekeyed[1]):
                        report.replaced.append({"path": where, "global": name, "to": "dict keys"})
            if type(value) is OpaqueObject:
                convertible = not value.global_.allowed
            else:
                convertible = type(value) is Global and not value.allowed
            if not convertible or id(value) in replacements:
                continue
            new = _plain(value)
            if new is _NO_RULE:
                continue  # stays as it is: the output check names it
            replacements[id(value)] = new
            name = value.full if type(value) is Global else _name(value)
            kind = f"tensor {new.dtype}" if hasattr(new, "dtype") else type(new).__name__
            where = format_path(base + path) or "(top level)"
            report.replaced.append({"path": where, "global": name, "to": kind})
            if isinstance(new, (dict, list, tuple)):
                queue.append((base + path, new))
    for key, new in list(replacements.items()):  # a config whose _content is a re-keyed dict
        for _ in range(_MAX_CHAIN):
            if id(new) not in replacements or replacements[id(new)] is new:
                break
            new = replacements[id(new)]
        replacements[key] = new
    return (substitute(root, replacements) if replacements else root), report
