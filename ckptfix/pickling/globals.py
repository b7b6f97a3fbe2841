"""What ckptfix knows about pickle globals besides the reader's allow-list (``reader``): one table
each, used by the reader, the output check, ``scan``'s verdicts and ``--sanitize``.

* :data:`MODULE_ALIASES`: modules a pickle names instead of the one users know
  (``posix.system`` is ``os.system``; Python 2's ``__builtin__`` is ``builtins``).
* :data:`DANGEROUS`: globals that run code or touch the system when a pickle calls them, each
  with the reason. A file naming one is hostile: refused everywhere, whatever is selected or
  allowed (only ``--unsafe-load`` of a trusted file gets past it, through torch itself).
* :data:`PLAIN_DATA`: standard-library data types (containers, numbers, paths, ``typing``
  names). Nothing in them runs code; ``scan`` calls them safe, and ``--allow-global`` of a
  package keeps them along where its objects are rebuilt through them.
* :data:`SANITIZABLE`: classes ``--sanitize`` knows by name (it also converts any object from
  its pickled state alone: see :mod:`ckptfix.transforms.sanitize`).
"""

from __future__ import annotations

import sys
from _compat_pickle import IMPORT_MAPPING, NAME_MAPPING

from ..model.dtypes import DTYPE_ITEMSIZE

#: modules a pickle may name for the one users know: the C modules behind ``os``, ``operator``
#: and ``io``, and every Python 2 name that Python 3's unpickler maps (``fix_imports``, what
#: ``torch.load`` does too): a protocol-2 pickle of ``subprocess.Popen`` says ``commands.Popen``
MODULE_ALIASES = {"posix": "os", "nt": "os", "_operator": "operator", "_io": "io", **IMPORT_MAPPING}


#: the reader's VM renames these modules as it reads (``__builtin__.long`` arrives as ``builtins.long``)
_PY2_SPELLING = {"builtins": "__builtin__", "copyreg": "copy_reg"}


def canonical_name(name: str) -> str:
    """The name users know and Python 3 would import: ``posix.system`` is ``os.system``,
    ``commands.Popen`` is ``subprocess.Popen``, ``__builtin__.long`` is ``builtins.int``."""
    if name.startswith("<"):
        return name
    module, _, short = name.rpartition(".")
    mapped = NAME_MAPPING.get((module, short)) or NAME_MAPPING.get((_PY2_SPELLING.get(module, ""), short))
    if mapped is not None:
        return ".".join(mapped)
    return MODULE_ALIASES.get(module, module) + "." + short


def _modules(reason: str, *modules: str) -> dict[str, str]:
    return {f"{m}.": reason for m in modules}


def _names(reason: str, *names: str) -> dict[str, str]:
    return dict.fromkeys(names, reason)


#: canonical name (exact) or module prefix (ending in ".") -> why calling it from a pickle is an
#: attack. Maintained by hand: compared with picklescan's and modelscan's lists (see README).
DANGEROUS: dict[str, str] = {
    **_modules("runs shell commands, spawns processes or changes files", "os", "subprocess", "_posixsubprocess"),
    **_modules("runs shell commands, spawns processes or changes files", "pty", "shutil", "multiprocessing"),
    **_modules("reaches the interpreter's internals (modules, frames, exit)", "sys", "gc", "inspect"),
    **_modules("imports or runs Python code", "runpy", "importlib", "imp", "code", "codeop", "pydoc", "venv", "pip"),
    **_modules("runs Python code given as text", "timeit", "cProfile", "profile", "pdb", "bdb", "trace"),
    **_modules("calls native code", "ctypes", "_ctypes", "cffi"),
    **_modules("unpickles more bytes, which can name anything", "pickle", "_pickle", "marshal", "shelve"),
    **_modules("unpickles more bytes, which can name anything", "dill", "cloudpickle", "joblib"),
    **_names("unpickles more bytes, which can name anything", "numpy.load", "numpy.lib.npyio.load"),
    **_modules("opens network connections", "socket", "_socket", "ssl", "http", "urllib", "requests", "httplib"),
    **_modules("opens network connections or a browser", "ftplib", "smtplib", "telnetlib", "webbrowser", "aiohttp"),
    **_modules("runs an event loop that can start processes", "asyncio"),
    **_modules("loads and runs code or native operators", "torch.hub", "torch.ops", "torch.utils.cpp_extension"),
    **_modules("loads and runs code or native operators", "torch._C", "torch.jit", "torch.package"),
    **_names("evaluates Python code", *(f"builtins.{n}" for n in ("eval", "exec", "compile", "__import__"))),
    **_names("reaches any attribute of any object (getattr(os, 'system'))", "builtins.getattr"),
    **_names("changes attributes of live objects", "builtins.setattr", "builtins.delattr"),
    **_names("opens files", "builtins.open", "io.open", "io.FileIO", "codecs.open", "pathlib.Path.write_text"),
    **_names("waits for input or starts a debugger", "builtins.input", "builtins.breakpoint"),
    **_names("calls a method or attribute by name", "operator.attrgetter", "operator.methodcaller"),
    **_names("reaches the interpreter's internals (modules, frames, exit)", "builtins.vars", "builtins.globals"),
    **_names("reaches the interpreter's internals (modules, frames, exit)", "builtins.locals", "builtins.exit"),
    **_names("evaluates type annotations given as text", "typing.get_type_hints", "typing._eval_type"),
    **_names("writes files", "torch.save", "torch.serialization.save", "numpy.save", "numpy.savez"),
    **_names("unpickles nested bytes with weights_only=False", "torch.storage._load_from_bytes"),
    **_names("unpickles nested bytes with weights_only=False", "torch.load", "torch.serialization.load"),
    **_names("unpickles nested bytes with weights_only=False", "torch.serialization._load"),
    **_names("unpickles nested bytes with weights_only=False", "torch.serialization._legacy_load"),
    **_names("runs TorchScript code", "torch.jit.load"),
    **_names("builds code objects or functions from bytes", "types.CodeType", "types.FunctionType"),
    **_names("imports any module by name", "pkgutil.resolve_name", "builtins.apply"),
    **_names("opens files", "logging.FileHandler", "distutils.file_util.write_file"),
    **_names("runs shell commands", "imaplib.IMAP4_stream", "doctest.debug_script", "torch.utils.collect_env.run"),
    **_names("runs shell commands", *(f"uuid.{n}" for n in ("_get_command_stdout", "_popen", "getnode"))),
    **_modules("compiles and loads code", "torch._inductor", "torch._dynamo", "numpy.f2py", "ensurepip", "idlelib"),
    **_modules("runs Python source it is given (GraphModule's pickle execs its code)", "torch.fx"),
    **_modules("imports and calls any dotted name a dict gives, or evaluates text", "logging.config"),
    **_modules("imports and runs code from a file or folder", "zipimport", "site", "distutils", "setuptools"),
    **_modules("spawns processes", "_winapi", "torch.distributed.rpc"),
    **_modules("runs Python code given as text", "numpy.testing"),
    **_names("imports and calls any dotted name it is given", "hydra.utils.instantiate", "hydra.utils.call"),
    **_names("imports any module by name", "hydra.utils.get_method", "hydra.utils.get_class", "hydra.utils.get_object"),
    **_modules("imports any module by name", "hydra._internal.utils"),
    **_names("waits for input or starts a debugger", "builtins.help"),
    # found by an adversarial review against the oracle (each resolved by torch.load and run)
    **_modules("runs shell commands", "_osx_support", "mailcap", "pipes", "_bootsubprocess"),
    **_names("runs shell commands", *(f"platform.{n}" for n in ("_syscmd_file", "_syscmd_ver", "popen"))),
    **_names("runs shell commands", "platform.architecture"),
    **_modules("spawns processes or threads that run what it is given", "concurrent", "threading", "_thread"),
    **_modules("opens, creates or truncates files", "_pyio", "sqlite3", "_sqlite3", "dbm", "tempfile", "fileinput"),
    **_modules("opens, creates or truncates files", "logging.handlers", "zipfile", "tarfile", "shelve", "mmap"),
    **_names("opens, creates or truncates files", *(f"{m}.open" for m in ("gzip", "bz2", "lzma", "tokenize", "wave"))),
    **_modules("opens network connections or serves them", "socketserver", "xmlrpc", "poplib", "nntplib", "imaplib"),
    **_modules("registers code to run later", "atexit", "sched"),
    **_names("changes signal handling", *(f"signal.{n}" for n in ("signal", "alarm", "setitimer", "raise_signal"))),
    **_names("changes signal handling", "signal.pthread_kill", "signal.set_wakeup_fd", "signal.siginterrupt"),
    **_modules("downloads a file and unpickles it with weights_only=False", "torch.utils.model_zoo"),
    **_modules("runs test helpers that spawn processes or import code", "torch.testing._internal", "unittest.mock"),
}
_DANGEROUS_NAMES = {k: v for k, v in DANGEROUS.items() if not k.endswith(".")}
_DANGEROUS_PREFIXES = tuple(k for k in DANGEROUS if k.endswith("."))
#: the packages dangerous names live in (``torch`` for ``torch.load``): a dotted name through one
_DANGEROUS_ROOTS = frozenset(k.split(".", 1)[0] for k in DANGEROUS)


def resolved_name(module: str, name: str) -> str:
    """The global ``module`` + ``name`` reaches, as far as names tell: protocol 4 resolves a
    dotted ``name`` attribute by attribute (``pickle._getattribute``), so it can pass through a
    module that ``module`` imported: ``pathlib`` + ``os.system`` *is* ``os.system``, and
    ``collections`` + ``_sys.exit`` is ``sys.exit`` (``import sys as _sys``). No pickler writes
    such a name (qualified names pass through classes: ``Outer.Inner``), so the first part of
    ``name`` that names a standard-library or dangerous module decides; otherwise the name is
    ``module.name`` itself. :func:`danger` judges what this returns."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        root = MODULE_ALIASES.get(part, part.strip("_"))
        if root in sys.stdlib_module_names or root in _DANGEROUS_ROOTS:
            return ".".join((root, *parts[i + 1 :]))
    return f"{module}.{name}"


#: why a name that passes through a dunder attribute is refused (see :func:`danger`)
_THROUGH_DUNDER = "reaches the interpreter's internals through attributes (__globals__, __builtins__, __class__)"


def danger(name: str) -> str | None:
    """Why ``name`` (as pickled, canonical or :func:`resolved_name`) is an attack when a pickle
    calls it, or None. A dunder inside a dotted name (``Cfg.__init__.__globals__.get``) is one
    whatever the rest says: protocol 4 follows it attribute by attribute to any object."""
    if any(p[:2] == "__" == p[-2:] for p in name.split(".")[1:-1]):
        return _THROUGH_DUNDER
    known = canonical_name(name)
    reason = _DANGEROUS_NAMES.get(known)
    if reason is not None:
        return reason
    for prefix in _DANGEROUS_PREFIXES:
        if known.startswith(prefix):
            return DANGEROUS[prefix]
    return None


def runs_code(name: str) -> bool:
    """True for a global that executes code when a pickle calls it (``os.system``, ``eval`` ...)."""
    return danger(name) is not None


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

#: every global ckptfix's DCP writer may name in a ``.metadata`` it writes (and nothing else,
#: checked as it is written): the dataclasses above and what their fields hold -- sizes, dtypes
#: and the strided layout, spelled as torch pickles them (``torch.serialization._get_layout``)
DCP_METADATA_WRITES = frozenset(
    {
        *DCP_METADATA,
        "torch.Size",
        "torch.serialization._get_layout",
        *(f"torch.{dtype}" for dtype in DTYPE_ITEMSIZE),
    }
)

_BUILTIN_TYPES = ("dict", "list", "tuple", "set", "frozenset", "int", "float", "complex", "str", "bytes", "bool")
#: standard-library data types: nothing in them runs code when a pickle names or calls them
PLAIN_DATA = frozenset(
    {
        *SANITIZABLE,
        *DCP_METADATA,
        "collections.defaultdict",
        "collections.deque",
        "collections.OrderedDict",
        "datetime.datetime",
        "datetime.date",
        "datetime.time",
        "datetime.timedelta",
        "datetime.timezone",
        "decimal.Decimal",
        "fractions.Fraction",
        "uuid.UUID",
        "copyreg._reconstructor",
        "copyreg.__newobj__",
        "enum.Enum",
        *(f"builtins.{n}" for n in (*_BUILTIN_TYPES, "bytearray", "slice", "range", "object", "type", "NoneType")),
        *(f"builtins.{n}" for n in ("long", "unicode", "basestring", "Ellipsis", "NotImplemented")),
        *(f"numpy.dtypes.{k}DType" for k in ("Float64", "Float32", "Float16", "Int64", "Int32", "Int16", "Int8")),
        *(f"numpy.dtypes.{k}DType" for k in ("UInt8", "UInt16", "UInt32", "UInt64", "Bool", "Complex64", "Complex128")),
    }
)


def plain_data(name: str) -> bool:
    """A standard-library data type (:data:`PLAIN_DATA`), or one of ``typing``'s type names
    (``typing.Any``, ``typing.Optional``; not its functions, some of which evaluate text)."""
    known = canonical_name(name)
    if known in PLAIN_DATA:
        return True
    module, _, short = known.rpartition(".")
    return module in ("typing", "typing_extensions") and short[:1].isupper() and short != "ForwardRef"


#: modules whose plain data types objects are rebuilt through (a DictConfig's metadata names
#: ``typing.Any`` and ``builtins.dict``; a defaultdict holds its state): kept along by
#: ``--allow-global`` of the objects' own package, not something to allow one by one
_COMPANION_MODULES = ("builtins", "typing", "typing_extensions", "collections", "copyreg", "enum")


def companion(name: str) -> bool:
    """A plain data type that allowed objects may be rebuilt through (see above)."""
    return plain_data(name) and canonical_name(name).rpartition(".")[0] in _COMPANION_MODULES


def kept_along(names: list[str]) -> list[str]:
    """Those of ``names`` that :func:`allow_options` leaves to be kept along with the others."""
    return [] if all(companion(n) for n in names) else [canonical_name(n) for n in names if companion(n)]


def allow_options(names: list[str]) -> list[str]:
    """The ``--allow-global`` options that keep exactly ``names`` (as pickled), ready to paste:
    one ``'pkg.*'`` for two or more names of a third-party package, the exact names otherwise
    (a wildcard over a standard-library module or torch would cover far more than the file
    needs). Dangerous names are never allowed, wildcard or not, so none is listed."""
    if not all(companion(n) for n in names):
        names = [n for n in names if not companion(n)]  # kept along with the others
    by_package: dict[str, list[str]] = {}
    for name in dict.fromkeys(canonical_name(n) for n in names):
        if danger(name) is None:
            by_package.setdefault(name.split(".", 1)[0], []).append(name)
    options: list[str] = []
    for package, members in by_package.items():
        wide = package not in sys.stdlib_module_names and package not in MODULE_ALIASES and package != "torch"
        options += [f"'{package}.*'"] if wide and len(members) > 1 else members
    return [f"--allow-global {o}" for o in options]
