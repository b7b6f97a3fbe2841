"""``--sanitize``: turn known-benign objects into plain data that ``weights_only=True`` accepts.

Training checkpoints often hold ``argparse.Namespace`` arguments, numpy scalars and arrays,
and ``pathlib`` paths, so ``torch.load`` (weights_only since torch 2.6) refuses them. They are
read as opaque records (nothing imported or run) and replaced by:

* ``argparse.Namespace`` -> ``dict`` of its attributes;
* numpy scalars -> Python ``int``/``float``/``bool``/``complex``;
* numpy arrays of numeric dtypes -> tensors (row-major, little-endian);
* ``pathlib`` paths -> ``str``.

numpy is used only to decode the raw bytes the file carries, with a dtype parsed from a
plain type code (``'<f8'``); anything else is refused with the global's name. An array whose
pickled shape does not match its bytes (or that numpy could not hold) is corrupt input, exit 3.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from ..errors import BadInputError, UsageError
from ..fileio.ranges import ComputedSource, OpenFiles
from ..model.paths import Path, format_path
from ..model.refs import OpaqueObject, TensorRef, Tree, tensor_from_range

if TYPE_CHECKING:
    import numpy as np
from ..model.walk import substitute, walk
from ..pickling.globals import NUMPY_MODULES, SANITIZABLE

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
        raise UsageError(f"cannot sanitize a numpy value of dtype {code!r:.40}: only numeric dtypes convert")
    state = obj.state
    order: Literal["<", ">", "="] = "="  # "|" (no byte order) and a missing state: native
    if isinstance(state, tuple) and len(state) > 1 and state[1] in ("<", ">"):
        order = state[1]
    dtype: np.dtype[Any] = np.dtype(match.group(1) + match.group(2)).newbyteorder(order)  # numpy types this Any
    return dtype


def _convert(obj: OpaqueObject) -> Any:
    name = _name(obj)
    if name == "argparse.Namespace" and not obj.args and isinstance(obj.state, dict):
        return dict(obj.state)
    if name.startswith("pathlib.") and all(isinstance(a, str) for a in obj.args):
        from pathlib import PurePosixPath, PureWindowsPath

        pure = PureWindowsPath if "Windows" in name else PurePosixPath
        return str(pure(*obj.args))
    if name in (f"{m}.scalar" for m in NUMPY_MODULES) and len(obj.args) == 2:
        import numpy as np

        dtype, raw = _numpy_dtype(obj.args[0]), obj.args[1]
        raw = raw.encode("latin-1") if isinstance(raw, str) else raw
        if not isinstance(raw, bytes) or len(raw) != dtype.itemsize:
            raise BadInputError(f"cannot sanitize a corrupt numpy scalar ({name})")
        return np.frombuffer(raw, dtype=dtype)[0].item()
    if name in (f"{m}._reconstruct" for m in NUMPY_MODULES):
        return _array_to_tensor(obj)
    raise UsageError(
        f"--sanitize does not know how to turn {name} into plain data; drop it (--drop PATH) or keep it "
        f"as it is (--allow-global {name}, then the output needs weights_only=False)"
    )


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
    dtype = _numpy_dtype(dtype_obj)
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


def sanitize(root: Tree) -> tuple[Tree, SanitizeReport]:
    """A copy of ``root`` with every opaque object of a known kind replaced by plain data.

    One walk per converted object: a Namespace's dict may itself hold objects to convert, so
    each new dict is walked in turn (a queue, not recursion: any depth the reader accepts).
    """
    report = SanitizeReport()
    replacements: dict[int, Tree] = {}
    queue: list[tuple[Path, Tree]] = [((), root)]

    def descend(path: Path, value: Any) -> bool:
        return type(value) is not OpaqueObject

    while queue:
        base, node = queue.pop()
        for path, value in walk(node, descend):
            if type(value) is not OpaqueObject or id(value) in replacements or _name(value) not in SANITIZABLE:
                continue  # objects allowed by name by the user pass through as they are
            new = _convert(value)
            replacements[id(value)] = new
            kind = f"tensor {new.dtype}" if hasattr(new, "dtype") else type(new).__name__
            where = format_path(base + path) or "(top level)"
            report.replaced.append({"path": where, "global": _name(value), "to": kind})
            if isinstance(new, dict):
                queue.append((base + path, new))
    return (substitute(root, replacements) if replacements else root), report
