"""A restricted unpickler for torch's ``data.pkl``: allow-listed globals only, nothing executed.

Python's pickle can call any importable function. ``find_class`` is the single door through
which a pickle reaches code, so ours answers every request from a fixed allow-list and refuses
everything else *before* the pickle gets to call it:

* torch names (tensor rebuild functions, storage classes, dtypes, ``torch.Size`` ...) become
  inert :class:`~ckptfix.tree.Global` markers; "calling" one only records the call;
* a few builtins that plain containers need (``OrderedDict``, ``set``, ``complex``, bytes via
  ``_codecs.encode``) are real but wrapped so their arguments cannot blow up memory.

The allow-list is the set of globals ``torch.load(weights_only=True)`` accepts by default, so
what we read is what a safe ``torch.load`` would read, and what we write loads the same way.
"""

from __future__ import annotations

import codecs
import fnmatch
import io
import pickle
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, BinaryIO

from .dtypes import DTYPE_ITEMSIZE, QSCHEMES, STORAGE_DTYPE, TENSOR_CLASS_NAMES
from .errors import BadInputError, UnsafeInputError
from .tree import Global, StorageRef, check_nesting, opaque_class

_REBUILD_FUNCTIONS = (
    "_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter",
    "_rebuild_parameter_with_state", "_rebuild_qtensor", "_rebuild_sparse_tensor",
    "_rebuild_nested_tensor", "_rebuild_wrapper_subclass", "_rebuild_meta_tensor_no_storage",
    "_rebuild_device_tensor_from_numpy", "_rebuild_device_tensor_from_cpu_tensor",
)


def _torch_allowed_names() -> frozenset[str]:
    names = {
        "torch.Size", "torch.device", "torch.Tensor", "torch.nn.parameter.Parameter",
        "torch.serialization._get_layout", "torch._tensor._rebuild_from_type_v2",
        "torch.storage.UntypedStorage", "torch.storage.TypedStorage",
    }
    names.update(f"torch._utils.{f}" for f in _REBUILD_FUNCTIONS)
    names.update(f"torch.{d}" for d in DTYPE_ITEMSIZE)
    names.update(f"torch.{q}" for q in QSCHEMES)
    for storage in STORAGE_DTYPE:
        if storage != "UntypedStorage":
            names.add(f"torch.{storage}")
            if not storage.startswith("Q"):
                names.add(f"torch.cuda.{storage}")
    for cls in TENSOR_CLASS_NAMES:
        names.update({f"torch.{cls}", f"torch.cuda.{cls}"})
        if cls not in ("BoolTensor",):
            names.update({f"torch.sparse.{cls}", f"torch.cuda.sparse.{cls}"})
    return frozenset(names)


#: torch globals a checkpoint may reference; they become inert :class:`Global` markers.
TORCH_GLOBALS: frozenset[str] = _torch_allowed_names()

#: old spellings that torch itself maps to the current ones when loading
_RENAMED_MODULES = {"__builtin__": "builtins", "torch.tensor": "torch._tensor"}
#: platform modules that pickles name instead of the module users know (os.system is posix.system)
_DISPLAY_MODULES = {"posix": "os", "nt": "os", "_operator": "operator", "_io": "io"}


def _safe_encode(text: Any, encoding: str = "utf-8", errors: str = "strict") -> bytes:
    """``_codecs.encode`` as protocol-2 pickles use it for ``bytes``: text codecs only."""
    if not isinstance(text, str) or codecs.lookup(encoding).name not in ("latin-1", "iso8859-1", "ascii", "utf-8"):
        raise BadInputError("corrupt pickle: _codecs.encode used for something other than bytes")
    return codecs.encode(text, encoding, errors)


def _safe_bytearray(*args: Any) -> bytearray:
    """``bytearray`` from text or bytes only: ``bytearray(10**12)`` must not allocate."""
    if args and not isinstance(args[0], (str, bytes)):
        raise BadInputError("corrupt pickle: bytearray built from something other than bytes")
    return bytearray(*args)


def _safe_complex(real: Any = 0.0, imag: Any = 0.0) -> complex:
    if not isinstance(real, (int, float)) or not isinstance(imag, (int, float)):
        raise BadInputError("corrupt pickle: complex built from non-numbers")
    return complex(real, imag)


#: real Python callables a plain checkpoint needs; safe whatever their arguments
PYTHON_GLOBALS: dict[str, Callable[..., Any]] = {
    "collections.OrderedDict": OrderedDict,
    "collections.Counter": Counter,
    "builtins.set": set,
    "builtins.frozenset": frozenset,
    "builtins.bytearray": _safe_bytearray,
    "builtins.complex": _safe_complex,
    "_codecs.encode": _safe_encode,
}


#: resolves a persistent id ``(storage_type, key, location, numel, view)`` to a storage;
#: ``view`` is the legacy format's ``(view_key, offset, size)`` or None
StorageLoader = Callable[[Global, str, str, int, Any], StorageRef]


def allowed_by_name(full: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(full, p) for p in patterns)


class _BoundedReader:
    """A file view whose reads never ask for more than the file holds, so a pickle declaring a
    2 GB string in a 1 KB file cannot make the reader allocate 2 GB."""

    def __init__(self, file: BinaryIO) -> None:
        self._file = file
        position = file.tell()
        self._end = file.seek(0, io.SEEK_END)
        file.seek(position)

    def read(self, n: int = -1) -> bytes:
        remaining = self._end - self._file.tell()
        return self._file.read(remaining if n < 0 else min(n, remaining))

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def readline(self) -> bytes:
        return self._file.readline(1 << 16)


class _RestrictedUnpickler(pickle._Unpickler):  # type: ignore[name-defined]
    """The pure-Python unpickler: its memo is a dict, so ``LONG_BINPUT 700000000`` costs one
    entry, where the C unpickler would grow an array of that many slots (gigabytes)."""

    def __init__(
        self, file: BinaryIO, load_storage: StorageLoader | None, globals_seen: set[str],
        allow: Sequence[str] = (),
    ) -> None:
        super().__init__(_BoundedReader(file))
        self._load_storage = load_storage
        self._globals_seen = globals_seen
        self._allow = allow

    def find_class(self, module: str, name: str) -> Any:
        module = _RENAMED_MODULES.get(module, module)
        full = f"{module}.{name}"
        self._globals_seen.add(full)
        if full in PYTHON_GLOBALS:
            return PYTHON_GLOBALS[full]
        if full in TORCH_GLOBALS:
            return Global(module, name)
        if self._allow and allowed_by_name(full, self._allow):
            return opaque_class(module, name)
        shown = _DISPLAY_MODULES.get(module)
        raise UnsafeInputError(f"{shown}.{name} (pickled as {full})" if shown else full)

    def persistent_load(self, pid: Any) -> StorageRef:
        if self._load_storage is None or not (isinstance(pid, tuple) and len(pid) in (5, 6)):
            raise BadInputError(f"corrupt pickle: unexpected persistent id {pid!r:.80}")
        tag, storage_type, key, location, numel = pid[:5]
        view = pid[5] if len(pid) == 6 else None
        tag, key, location = _text(tag), _text(key), _text(location)
        if (
            tag != "storage"
            or not isinstance(storage_type, Global)
            or not isinstance(key, str)
            or not isinstance(location, str)
            or type(numel) is not int
            or numel < 0
        ):
            raise BadInputError(f"corrupt pickle: unexpected persistent id {pid!r:.80}")
        return self._load_storage(storage_type, key, location, numel, view)


def _text(value: Any) -> Any:
    return value.decode("ascii", "replace") if isinstance(value, bytes) else value


def restricted_load(
    data: bytes | BinaryIO,
    load_storage: StorageLoader | None,
    globals_seen: set[str] | None = None,
    allow: Sequence[str] = (),
) -> Any:
    """Unpickle one pickle from ``data`` (bytes, or a file positioned at it) into a tree.

    ``load_storage`` resolves storage persistent ids (None: a pickle that must hold none).
    Raises :class:`UnsafeInputError` at the first global outside the allow-list and
    :class:`BadInputError` for anything malformed. ``globals_seen`` collects every global
    the pickle names (for ``inspect``). Reading from a file leaves it just after the pickle.
    Globals matching an ``allow`` pattern become :class:`OpaqueObject` records (never imported).
    """
    seen = globals_seen if globals_seen is not None else set()
    file = io.BytesIO(data) if isinstance(data, bytes) else data
    try:
        tree = _RestrictedUnpickler(file, load_storage, seen, allow).load()
        check_nesting(tree)
        return tree
    except BadInputError:
        raise
    except RecursionError as exc:
        raise BadInputError("corrupt or hostile pickle: nested too deeply") from exc
    except MemoryError as exc:
        raise BadInputError("corrupt or hostile pickle: it asks for more memory than is available") from exc
    except Exception as exc:  # pickle raises many kinds on garbage: one message for all
        raise BadInputError(f"corrupt pickle: {type(exc).__name__}: {exc}"[:300]) from exc
