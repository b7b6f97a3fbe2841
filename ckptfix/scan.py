"""``scan``: list every global a checkpoint's pickles reference, without running any of them.

The pickle opcodes are read with :func:`pickletools.genops`, which decodes and never executes.
Globals come from GLOBAL/INST (module and name in the opcode) and STACK_GLOBAL (the two
strings pushed before it, memo included). Byte and text constants that are pickles
themselves (a nested ``torch.storage._load_from_bytes`` payload, a legacy storage pickled
inside) are scanned too, recursively.

Verdicts: ``safe`` (on ckptfix's allow-list, which ``torch.load(weights_only=True)`` also
accepts), ``benign`` (known data classes that ``--allow-global`` can keep and ``--sanitize`` can
convert), ``dangerous`` (everything else: ``os``/``subprocess``/``builtins.eval``..., torch's
own loaders, and any unknown module -- unknown code is dangerous until proven otherwise).
"""

from __future__ import annotations

import io
import pickletools
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from .detect import sniff
from .errors import CkptfixError
from .formats.torchzip import MAX_PICKLE_BYTES, read_checked_directory
from .unpickle import PYTHON_GLOBALS, TORCH_GLOBALS
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


def scan_pickle(data: bytes | BinaryIO, where: str, depth: int = 0) -> list[Found]:
    """Globals in the pickle at the start of ``data`` (and in nested pickles). A stream is left
    just after the pickle's STOP, so consecutive pickles can be scanned in turn."""
    found: list[Found] = []
    strings: list[str] = []
    memo: dict[int, Any] = {}
    last: Any = None
    stream = io.BytesIO(data) if isinstance(data, bytes) else data
    for opcode, arg, _ in pickletools.genops(stream):
        if opcode.name in ("GLOBAL", "INST"):
            full = canonical(arg.replace(" ", ".", 1))
            found.append(Found(full, classify(full), where))
        elif opcode.name == "STACK_GLOBAL":
            if len(strings) >= 2:
                full = canonical(f"{strings[-2]}.{strings[-1]}")
                found.append(Found(full, classify(full), where))
            else:
                found.append(Found("<STACK_GLOBAL with computed name>", "dangerous", where))
        elif isinstance(arg, str) and opcode.name.endswith(("UNICODE", "STRING")):
            strings.append(arg)
            last = arg
        elif isinstance(arg, bytes):
            last = arg
        if opcode.name in ("BINPUT", "LONG_BINPUT", "PUT", "MEMOIZE"):
            memo[arg if arg is not None else len(memo)] = last
        elif opcode.name in ("BINGET", "LONG_BINGET", "GET") and isinstance(memo.get(arg), str):
            strings.append(memo[arg])
        if depth < _MAX_DEPTH and isinstance(arg, (bytes, str)) and len(arg) > 2:
            raw = arg.encode("latin-1", "ignore") if isinstance(arg, str) else arg
            if raw[:1] == b"\x80" and 2 <= raw[1] <= 5:
                found.extend(_scan_nested(raw, f"{where} (nested pickle)", depth + 1))
        if opcode.name == "STOP":
            break
    return found


def _scan_nested(raw: bytes | BinaryIO, where: str, depth: int) -> list[Found]:
    """Every pickle in a row at the start of ``raw`` (the legacy format is five of them)."""
    found: list[Found] = []
    stream = io.BytesIO(raw) if isinstance(raw, bytes) else raw
    while True:
        start = stream.tell()
        if stream.read(1) != b"\x80":
            break
        stream.seek(start)
        try:
            found.extend(scan_pickle(stream, where, depth))
        except Exception:  # not (or no longer) a pickle: the raw data after the pickles
            break
    return found


def scan_path(path: str | Path) -> ScanResult:
    """Scan one file; never executes, never raises for bad input (the error is in the result)."""
    result = ScanResult(str(path))
    try:
        size = Path(path).stat().st_size
        with open(path, "rb") as f:
            what = sniff(f.read(512), size)
            result.format = what.kind
            if what.kind == "zip":
                records = read_checked_directory(f, size, str(path))
                for name, record in records.items():
                    if name.lower().endswith(".pkl"):
                        data = read_record_bytes(f, record, MAX_PICKLE_BYTES)
                        result.globals.extend(scan_pickle(data, name))
            elif what.kind == "legacy" or (what.kind == "not-checkpoint" and "pickle" in what.description):
                f.seek(0)
                result.globals.extend(_scan_nested(f, "pickles", 0))
            elif what.kind == "safetensors":
                pass  # JSON header and raw bytes: no code can be referenced
            elif what.kind == "tar":
                result.error = "tar-era torch file: not scanned"
            else:
                result.error = what.description
    except (OSError, CkptfixError, ValueError) as exc:
        result.error = str(exc)
    return result
