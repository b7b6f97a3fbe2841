"""``scan``: list every global a checkpoint's pickles reference, without running any of them.

The pickles are run by the same VM the reader uses (:mod:`ckptfix.pickle_vm`), with hooks that
record instead of build: every GLOBAL/STACK_GLOBAL/INST is resolved exactly as the reader
resolves it (memo, DUP, POP and all), recorded, and replaced by an inert symbol; calls,
BUILD and persistent ids make inert symbols too, and nothing is refused. So what ``scan``
reports is exactly what the reader would meet. A pickle that names a global and is garbage
afterwards keeps its findings (``torch.load`` would have run the payload before failing).
Bytes that are pickles themselves (a ``torch.storage._load_from_bytes`` payload) are scanned
too, recursively; every consecutive pickle of a legacy file or raw pickle stream is scanned
(protocol 0 included), and in a zip every record whose name ends in ``.pkl`` in any case.

Verdicts: ``safe`` (on ckptfix's allow-list, which ``torch.load(weights_only=True)`` also
accepts), ``benign`` (known data classes that ``--allow-global`` can keep and ``--sanitize`` can
convert), ``dangerous`` (everything else: ``os``/``subprocess``/``builtins.eval``..., torch's
own loaders, and any unknown module -- unknown code is dangerous until proven otherwise).
"""

from __future__ import annotations

import mmap
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .detect import open_input, sniff
from .errors import BadInputError, CkptfixError
from .formats.torchzip import MAX_PICKLE_BYTES, read_checked_directory
from .pickle_vm import Hooks, PickleVM
from .tree import Global
from .unpickle import PYTHON_GLOBALS, TORCH_GLOBALS, _encode, looks_like_pickle
from .ziparchive import read_record_bytes

BENIGN = {
    "argparse.Namespace", "pathlib.Path", "pathlib.PosixPath", "pathlib.WindowsPath", "pathlib.PurePath",
    "pathlib.PurePosixPath", "pathlib.PureWindowsPath", "collections.defaultdict", "collections.deque",
    "datetime.datetime", "datetime.date", "datetime.timedelta", "decimal.Decimal", "fractions.Fraction",
    "uuid.UUID", "builtins.slice", "builtins.range", "copyreg._reconstructor", "builtins.object",
    "builtins.dict", "builtins.list", "builtins.tuple", "builtins.int", "builtins.float", "builtins.str",
    "builtins.bytes", "builtins.bool",
} | {
    f"{np}.{name}" for np in ("numpy.core.multiarray", "numpy._core.multiarray")
    for name in ("_reconstruct", "scalar")
} | {"numpy.dtype", "numpy.ndarray"} | {f"numpy.dtypes.{k}DType" for k in (
    "Float64", "Float32", "Float16", "Int64", "Int32", "Int16", "Int8", "UInt8", "UInt16", "UInt32", "UInt64",
    "Bool", "Complex64", "Complex128")}
_RENAMED = {"__builtin__": "builtins", "posix": "os", "nt": "os"}
_MAX_DEPTH = 8


@dataclass
class Found:
    name: str
    verdict: str
    where: str


@dataclass
class ScanResult:
    path: str
    format: str = ""
    globals: list[Found] = field(default_factory=list)
    error: str = ""

    @property
    def dangerous(self) -> list[Found]:
        return [g for g in self.globals if g.verdict == "dangerous"]

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "format": self.format, "error": self.error,
                "dangerous": sorted({g.name for g in self.dangerous}),
                "globals": [asdict(g) for g in self.globals]}


def canonical(name: str) -> str:
    """The name users know: ``posix.system`` is ``os.system``, ``__builtin__`` is ``builtins``."""
    module = name.rsplit(".", 1)[0]
    return _RENAMED.get(module, module) + name[len(module):]


def classify(name: str) -> str:
    canonical_name = canonical(name)
    if canonical_name in TORCH_GLOBALS or canonical_name in PYTHON_GLOBALS:
        return "safe"
    if canonical_name in BENIGN:
        return "benign"
    return "dangerous"


class _Symbol:
    """What a call or a persistent id "returns" while scanning: nothing real, just a name."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class ScanHooks(Hooks):
    """Record every global; build nothing; refuse nothing (budgets and malformed input still stop)."""

    def __init__(self, where: str, found: list[Found], depth: int) -> None:
        self.where, self.found, self.depth = where, found, depth

    def find_global(self, module: str, name: str) -> Any:
        full = canonical(f"{module}.{name}")
        self.found.append(Found(full, classify(full), self.where))
        return _Symbol(full)

    def call(self, func: Any, args: tuple) -> Any:
        if isinstance(func, _Symbol) and func.name == "_codecs.encode":
            try:  # protocol 2 spells bytes this way: rebuild them, a nested pickle may hide inside
                data = _encode(Global("_codecs", "encode"), args)
                self._nested(data)
                return data
            except BadInputError:
                pass
        for arg in args:
            if type(arg) in (bytes, bytearray):
                self._nested(bytes(arg))
        return _Symbol(f"{getattr(func, 'name', '?')}(...)")

    def new_object(self, cls: Any, args: tuple, kwargs: dict | None) -> Any:
        return self.call(cls, args)

    def build(self, inst: Any, state: Any) -> None:
        pass

    def persistent_load(self, pid: Any) -> Any:
        return _Symbol("persistent id")

    def extend(self, target: Any, items: list) -> None:
        pass

    def set_items(self, target: Any, pairs: list) -> None:
        pass

    def check_key(self, key: Any) -> None:
        pass

    def _nested(self, data: bytes) -> None:
        if self.depth < _MAX_DEPTH and looks_like_pickle(data):
            found, _ = scan_pickles(data, f"{self.where} (nested pickle)", self.depth + 1)
            self.found.extend(found)


def scan_pickles(data: bytes | Any, where: str, depth: int = 0, count: int | None = None) -> tuple[list[Found], str]:
    """Globals in ``count`` consecutive pickles (all, if None) at the start of ``data`` (bytes
    or an mmap), nested pickles included; returns them and an error ("" if all read cleanly).

    Without ``count``, stops quietly where the data stops being pickles after at least one
    complete pickle, if the failed attempt named no global (trailing non-pickle bytes).
    """
    found: list[Found] = []
    pos, complete = 0, 0
    while pos < len(data) and (count is None or complete < count):
        before = len(found)
        vm = PickleVM(data, ScanHooks(where, found, depth), start=pos)
        try:
            vm.run()
        except BadInputError as exc:
            if count is None and complete and len(found) == before:
                return found, ""
            return found, str(exc)
        pos = vm.pos
        complete += 1
    if count is not None and complete < count:
        return found, f"only {complete} of the {count} pickles are there (truncated)"
    return found, ""


def scan_path(path: str | Path) -> ScanResult:
    """Scan one file; never executes, never raises for bad input (the error is in the result)."""
    result = ScanResult(str(path))
    try:
        f, size = open_input(str(path))  # never opens a FIFO or a device (they hang or never end)
        with f:
            what = sniff(f.read(512), size)
            result.format = what.kind
            if what.kind == "zip":
                records = read_checked_directory(f, size, str(path))
                for name, record in records.items():
                    if name.lower().endswith(".pkl"):
                        data = read_record_bytes(f, record, MAX_PICKLE_BYTES)
                        found, error = scan_pickles(data, name)
                        result.globals.extend(found)
                        result.error = result.error or (f"{name}: {error}" if error else "")
            elif what.kind == "legacy" or (what.kind == "not-checkpoint" and "pickle" in what.description):
                # a legacy file is exactly five pickles, then raw storage bytes (not opcodes)
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                    found, result.error = scan_pickles(data, "pickles", count=5 if what.kind == "legacy" else None)
                result.globals.extend(found)
            elif what.kind == "safetensors":
                pass  # JSON header and raw bytes: no code can be referenced
            elif what.kind == "tar":
                result.error = "tar-era torch file: not scanned"
            else:
                result.error = what.description
    except (OSError, CkptfixError, ValueError) as exc:
        result.error = str(exc)
    return result
