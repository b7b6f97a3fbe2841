"""The oracle's child process: asks torch itself what it sees in a file, with nothing from the file run.

Run by :mod:`oracle` (never imported by the suite). It reads one JSON request per line on stdin
and answers each with an 8-byte length and a pickle on stdout. For each file it runs

1. ``torch.load(path, weights_only=False, pickle_module=<recording>)`` -- the loader most training
   code still calls. The recording module's ``Unpickler`` is a subclass of CPython's C unpickler
   (``_pickle.Unpickler``, the one torch hands ``data.pkl`` to as a ``BytesIO``), so framing, memo,
   opcode and Python-2 renaming semantics are CPython's own. Its ``find_class`` lets the C
   implementation resolve the name -- with ``builtins.__import__`` intercepted for that one call,
   so a module that is not already imported becomes an inert stub instead of running its code --
   records the name CPython resolved, and hands back the real object only for torch's own
   weights-only allow-list (and DCP's metadata classes); everything else becomes an inert stand-in
   class, so ``posix.system(...)`` makes an inert object and reading goes on. torch's own
   ``StorageType`` shortcut is routed through the same recording.
2. ``torch.load(path, weights_only=True[, mmap=True])`` -- the tree and values torch gives.

A DCP folder is read through ``dcp_to_torch_save``'s loader path (``_load_state_dict`` with a
``FileSystemReader`` and the empty-state-dict planner) with ``pickle`` itself patched to record.

Limits: the parent sets a time limit per request (and kills this process past it); this process
caps its own address space (``ORACLE_MAX_AS``, bytes).
"""

from __future__ import annotations

import _compat_pickle
import _pickle
import builtins
import io
import json
import os
import pickle
import resource
import struct
import sys
import types
from typing import Any

import torch
import torch.serialization
from torch._weights_only_unpickler import _get_allowed_globals

_RealUnpickler = _pickle.Unpickler
_real_import = builtins.__import__
_RealStorageType = torch.serialization.StorageType

#: what the record hands back for real: torch's weights-only allow-list, plus what torch's own
#: loaders need to go on (nested pickles, DCP metadata); everything else is an inert stand-in
REAL: dict[str, Any] = dict(_get_allowed_globals())
REAL["torch.storage._load_from_bytes"] = __import__("torch.storage", fromlist=["_load_from_bytes"])._load_from_bytes
_DCP_NAMES = {
    "torch.distributed.checkpoint.metadata": (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    ),
    "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),
    "pathlib": ("PosixPath", "PurePosixPath", "Path"),
    "torch.serialization": ("_get_layout",),
    "torch": ("Size", "strided", "sparse_coo", "contiguous_format", "channels_last", "preserve_format"),
}

RECORD: list[str] = []


class Inert:
    """What a global outside the allow-list becomes: takes every call, state and item, does nothing."""

    oracle_name = "?"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Inert:
        return _stand_in(f"{self.oracle_name}()")()

    def __setstate__(self, state: Any) -> None:
        pass

    def append(self, item: Any) -> None:
        pass

    def extend(self, items: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _stand_in(f"{self.oracle_name}.{name}")()


_STAND_INS: dict[str, type] = {}


def _stand_in(full: str) -> type:
    cls = _STAND_INS.get(full)
    if cls is None:
        cls = _STAND_INS[full] = type(f"Inert[{full}]", (Inert,), {"oracle_name": full})
    return cls


class _StubModule(types.ModuleType):
    """A module that was not imported yet: its attributes are stand-ins, and importing it runs nothing."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _stand_in(f"{self.__name__}.{name}")


def _resolve(unpickler: Any, module: Any, name: Any) -> Any:
    """What CPython's ``find_class`` resolves, recorded; the real object only if allowed."""
    if type(name) is str and "Storage" in name:  # torch's wrapper asks StorageType first
        try:
            found = _RealStorageType(name)
        except KeyError:
            pass
        else:
            RECORD.append(f"{module}.{name}")
            return found
    imported: list[str] = []
    stubs: list[str] = []

    def recording_import(target: str, *args: Any, **kwargs: Any) -> Any:
        imported.append(target)
        if target in sys.modules:
            return _real_import(target, *args, **kwargs)
        sys.modules[target] = _StubModule(target)
        stubs.append(target)
        return sys.modules[target]

    builtins.__import__ = recording_import
    try:
        obj = _RealUnpickler.find_class(unpickler, module, name)
    finally:
        builtins.__import__ = _real_import
        for stub in stubs:
            sys.modules.pop(stub, None)
    resolved_module = imported[0] if imported else module
    mapped = _compat_pickle.NAME_MAPPING.get((module, name))
    resolved_name = mapped[1] if mapped is not None and mapped[0] == resolved_module else name
    full = f"{resolved_module}.{resolved_name}"
    RECORD.append(full)
    if full in REAL or resolved_name in _DCP_NAMES.get(resolved_module, ()):
        return obj
    return _stand_in(full)


class RecordingUnpickler(_RealUnpickler):  # type: ignore[misc]
    def find_class(self, module: str, name: str) -> Any:
        return _resolve(self, module, name)


def _load(file: Any, **kwargs: Any) -> Any:
    return RecordingUnpickler(file, **kwargs).load()


def _loads(data: bytes, /, **kwargs: Any) -> Any:
    return RecordingUnpickler(io.BytesIO(data), **kwargs).load()


recording_pickle = types.ModuleType("oracle_pickle")
recording_pickle.Unpickler = RecordingUnpickler  # type: ignore[attr-defined]
recording_pickle.load = _load  # type: ignore[attr-defined]
recording_pickle.loads = _loads  # type: ignore[attr-defined]
recording_pickle.UnpicklingError = pickle.UnpicklingError  # type: ignore[attr-defined]


class _StorageTypeFirstRefusal:
    """torch's ``find_class`` wrapper asks ``StorageType(name)`` first: refuse, so the name reaches
    the recording (which gives the same answer torch would have)."""

    def __init__(self, name: str) -> None:
        raise KeyError(name)


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:4000]}"


def _scrub(value: Any) -> Any:
    """The tree with stand-ins named (so it can be sent back with torch.save)."""
    if isinstance(value, Inert):
        return f"<inert {value.oracle_name}>"
    if isinstance(value, type) and issubclass(value, Inert):
        return f"<inert class {value.oracle_name}>"
    if type(value) is dict:
        return {_scrub(k): _scrub(v) for k, v in value.items()}
    if type(value) is list:
        return [_scrub(v) for v in value]
    if type(value) is tuple:
        return tuple(_scrub(v) for v in value)
    return value


def _unshared(value: Any) -> Any:
    """The tree with every tensor copied: torch.save refuses two tensors viewing one storage under
    two dtypes, which torch.load builds from a file whose storage key is named by two classes."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return type(value)((k, _unshared(v)) for k, v in value.items())
    if type(value) in (list, tuple):
        return type(value)(_unshared(v) for v in value)
    return value


def _saved(tree: Any) -> bytes | str:
    buffer = io.BytesIO()
    try:
        torch.save(tree, buffer)
    except RuntimeError as exc:
        if "as different types" not in str(exc):
            return f"cannot send the tree back: {_error(exc)}"
        buffer = io.BytesIO()  # values and dtypes sent; that sharing is lost
        torch.save(_unshared(tree), buffer)
    except Exception as exc:
        return f"cannot send the tree back: {_error(exc)}"
    return buffer.getvalue()


def _recorded_load(run: Any) -> tuple[list[str], str | None, Any]:
    RECORD.clear()
    torch.serialization.StorageType = _StorageTypeFirstRefusal  # type: ignore[misc,assignment]
    patched = {"Unpickler": RecordingUnpickler, "load": _load, "loads": _loads}
    saved = {k: getattr(pickle, k) for k in patched}
    for k, v in patched.items():
        setattr(pickle, k, v)
    result, error = None, None
    try:
        result = run()
    except BaseException as exc:
        error = _error(exc)
    finally:
        for k, v in saved.items():
            setattr(pickle, k, v)
        torch.serialization.StorageType = _RealStorageType  # type: ignore[misc]
    return list(RECORD), error, result


def _dcp_load(path: str) -> Any:
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    _load_state_dict(state, storage_reader=FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return state


def _one_pickle(data: bytes, stream: str) -> tuple[list[str], str | None, str | None]:
    """One raw pickle through CPython's C unpickler (recorded, as ``_recorded_load``), read from a
    ``BytesIO`` (how torch reads ``data.pkl``) or a buffered file (``peek()``: legacy files); and
    through torch's weights-only unpickler (its error, or None)."""
    import tempfile

    from torch._weights_only_unpickler import Unpickler as WeightsOnly

    def run() -> Any:
        if stream == "file":
            with tempfile.TemporaryFile() as f:
                f.write(data)
                f.seek(0)
                return RecordingUnpickler(f, encoding="utf-8").load()
        return RecordingUnpickler(io.BytesIO(data), encoding="utf-8").load()

    found, error, _ = _recorded_load(run)
    try:
        WeightsOnly(io.BytesIO(data), encoding="utf-8").load()
        wo_error = None
    except BaseException as exc:
        wo_error = _error(exc)
    return found, error, wo_error


def answer(request: dict[str, Any]) -> dict[str, Any]:
    if request.get("kind") == "pickles":
        import base64

        stream = request.get("stream", "bytesio")
        return {"results": [_one_pickle(base64.b64decode(p), stream) for p in request["pickles"]]}
    path = request["path"]
    if request.get("kind") == "dcp":
        found, error, tree = _recorded_load(lambda: _dcp_load(path))
        return {"globals": found, "error": error, "tree": None if error else _saved(_scrub(tree)), "wo_error": error}
    found, error, _ = _recorded_load(
        lambda: torch.load(path, weights_only=False, pickle_module=recording_pickle, map_location="cpu")
    )
    tree, wo_error = None, None
    try:
        tree = _saved(torch.load(path, weights_only=True, map_location="cpu", mmap=bool(request.get("mmap"))))
    except BaseException as exc:
        wo_error = _error(exc)
    return {"globals": found, "error": error, "tree": tree, "wo_error": wo_error}


def main() -> None:
    limit = int(os.environ.get("ORACLE_MAX_AS", str(8 << 30)))
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    out = sys.stdout.buffer
    out.write(b"ready\n")
    out.flush()
    for line in sys.stdin:
        reply = pickle.dumps(answer(json.loads(line)))
        out.write(struct.pack("<Q", len(reply)) + reply)
        out.flush()


if __name__ == "__main__":
    main()
