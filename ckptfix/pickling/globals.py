"""What ckptfix knows about pickle globals besides the reader's allow-list (``reader``): one table
each, used by the reader's messages, ``scan``'s verdicts and ``--sanitize``.

* :data:`MODULE_ALIASES`: modules a pickle names instead of the one users know
  (``posix.system`` is ``os.system``; Python 2's ``__builtin__`` is ``builtins``).
* :data:`SANITIZABLE`: classes ``--sanitize`` turns into plain data.
* :data:`BENIGN`: data-only classes outside torch's weights-only allow-list (scan says "benign":
  keep them with ``--allow-global``, convert the sanitizable ones with ``--sanitize``).
"""

from __future__ import annotations

MODULE_ALIASES = {"__builtin__": "builtins", "posix": "os", "nt": "os", "_operator": "operator", "_io": "io"}


def canonical_name(name: str) -> str:
    """The name users know: ``posix.system`` is ``os.system``, ``__builtin__`` is ``builtins``."""
    if name.startswith("<"):
        return name
    module = name.rsplit(".", 1)[0]
    return MODULE_ALIASES.get(module, module) + name[len(module) :]


#: where a pickle's call runs code (by canonical name): a file naming one is hostile, so no hint
#: ever suggests keeping it (``--allow-global``) or loading the file (``--unsafe-load``)
CODE_EXECUTION = (
    *(
        f"{m}."
        for m in (
            *("os", "subprocess", "_posixsubprocess", "sys", "pty", "socket", "shutil", "runpy", "importlib", "imp"),
            *("ctypes", "_ctypes", "code", "codeop", "pickle", "_pickle", "marshal", "webbrowser", "multiprocessing"),
            *("timeit", "cProfile", "profile", "pdb", "bdb", "trace", "asyncio", "pydoc", "dill", "cloudpickle"),
            *("joblib", "torch.hub", "torch.ops", "torch.utils.cpp_extension", "torch._C", "torch.jit"),
            "torch.package",
        )
    ),
    *(f"builtins.{n}" for n in ("eval", "exec", "compile", "getattr", "setattr", "delattr", "__import__", "open")),
    *("builtins.breakpoint", "builtins.input", "io.open", "_io.open", "codecs.open"),
)


def runs_code(name: str) -> bool:
    """True for a global that executes code when a pickle calls it (``os.system``, ``eval`` ...)."""
    return canonical_name(name).startswith(CODE_EXECUTION)


#: where numpy keeps its pickle helpers (numpy 2 renamed numpy.core to numpy._core)
NUMPY_MODULES = ("numpy.core.multiarray", "numpy._core.multiarray")
SANITIZABLE = (
    "argparse.Namespace",
    "numpy.dtype",
    "numpy.ndarray",
    *(f"{m}.{n}" for m in NUMPY_MODULES for n in ("scalar", "_reconstruct")),
    *(f"pathlib.{n}" for n in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")),
)

#: what torch.distributed.checkpoint pickles into a folder's ``.metadata``: plain dataclasses
#: describing where each tensor's chunks are (torch 2.x)
DCP_METADATA = (
    *(
        f"torch.distributed.checkpoint.metadata.{n}"
        for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata")
    ),
    *(f"torch.distributed.checkpoint.metadata.{n}" for n in ("TensorProperties", "MetadataIndex", "StorageMeta")),
    "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
    "torch.distributed.checkpoint.filesystem._StorageInfo",
)

#: data-only classes scan calls benign: the sanitizable ones, DCP's metadata records, and these
BENIGN = frozenset(
    {
        *SANITIZABLE,
        *DCP_METADATA,
        "collections.defaultdict",
        "collections.deque",
        "datetime.datetime",
        "datetime.date",
        "datetime.timedelta",
        "decimal.Decimal",
        "fractions.Fraction",
        "uuid.UUID",
        "copyreg._reconstructor",
        *(f"builtins.{n}" for n in ("slice", "range", "object", "dict", "list", "tuple", "int", "float", "str")),
        *(f"builtins.{n}" for n in ("bytes", "bool")),
        *(
            f"numpy.dtypes.{k}DType"
            for k in ("Float64", "Float32", "Float16", "Int64", "Int32", "Int16", "Int8", "UInt8", "UInt16")
        ),
        *(f"numpy.dtypes.{k}DType" for k in ("UInt32", "UInt64", "Bool", "Complex64", "Complex128")),
    }
)
