"""``diff``: compare two checkpoints of any formats, one tensor at a time.

Both sides are flattened to ``{dotted path: leaf}`` (a state dict's keys appear under its path:
``state_dict.fc.weight``; a bare state dict or a safetensors file gives the keys themselves).
Tensors are compared by their C-order little-endian bytes first -- equal bytes means equal,
NaN payloads and -0.0 included. Only tensors whose bytes differ are decoded (in numpy, the
values torch's ``.to(float64)`` gives; no torch is needed anywhere) to measure how much: max
absolute and relative difference and the number of differing elements; with ``rtol``/``atol``
they count as equal when ``isclose`` (torch's and numpy's: ``|a - b| <= atol + rtol * |b|``)
holds everywhere (NaN equal to NaN). Memory: two tensors at a time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from ..fileio.ranges import OpenFiles, read_all
from ..model.data import tensor_c_bytes
from ..model.dtypes import DTYPE_ITEMSIZE
from ..model.paths import Path, format_path
from ..model.refs import OpaqueObject, Reduce, StorageRef, TensorRef, is_tensor_like, is_torch_tensor
from ..model.walk import ATTRS, walk

_MAX_LISTED = 50


@dataclass
class DiffReport:
    """What differs between A and B; ``equal`` is the verdict."""

    #: the two inputs compared (A is the one the options transformed)
    input_a: str
    input_b: str
    equal: bool = True
    tensors_compared: int = 0
    tensors_equal: int = 0
    only_in_a: list[str] = field(default_factory=list)
    only_in_b: list[str] = field(default_factory=list)
    mismatched: list[dict[str, Any]] = field(default_factory=list)
    different: list[dict[str, Any]] = field(default_factory=list)
    values_differ: list[dict[str, Any]] = field(default_factory=list)
    hint: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def flatten(root: Any) -> dict[str, Any]:
    """``{dotted path: leaf}`` over mappings, lists and tuples; tensors, records, plain values and
    empty containers are leaves. Objects read as inert records (a config's ``DictConfig``) are
    compared by what was pickled: their class (``<object>``) and their arguments, items and state.
    One walk: a sub-tree shared by two paths is listed under the first, and a cycle ends where it
    closes (a config's parent links)."""
    leaves: dict[str, Any] = {}

    def into(path: Path, value: Any) -> bool:
        if type(value) is Reduce:  # a sparse, quantized, nested or meta tensor: compared by its parts
            return is_tensor_like(value)
        if type(value) is OpaqueObject:
            return True
        return isinstance(value, (Mapping, list, tuple)) and bool(value) and not is_tensor_like(value)

    for path, value in walk(root, lambda p, v: into(p, v) and ATTRS not in p, leaves=True):
        if ATTRS in path:
            continue  # _metadata is module versions, not values
        if not into(path, value):
            leaves[format_path(path)] = value
        elif type(value) is Reduce:
            leaves[f"{format_path(path)}.<rebuilt by>"] = value.func.full
        elif type(value) is OpaqueObject:
            leaves[f"{format_path(path)}.<object>"] = f"{value.global_.full} ({value.kind})"
    return leaves


def _dtype_of(t: Any) -> str:
    return t.dtype if isinstance(t, TensorRef) else str(t.dtype).replace("torch.", "")


def _shape_of(t: Any) -> list[int]:
    return list(t.shape)


def _measure(a: bytes, b: bytes, dtype: str, shape: list[int], rtol: float, atol: float) -> dict[str, Any]:
    """Decode two tensors whose bytes differ (in numpy, as torch's ``.to(float64)`` would) and
    say how far apart they are.

    Values are compared NaN-aware and part by part for complex numbers: two elements are equal
    when every part is equal or NaN on both sides (a NaN payload difference is not a value
    difference). Dtypes without arithmetic (bits*, float4, sub-byte and packed types) are
    compared bit for bit."""
    import numpy as np

    from ..model.numeric import decode_wide

    itemsize = DTYPE_ITEMSIZE[dtype]
    raw_a = np.frombuffer(a, np.uint8).reshape(-1, itemsize)
    raw_b = np.frombuffer(b, np.uint8).reshape(-1, itemsize)
    bit_different = (raw_a != raw_b).any(axis=1)
    numel = int(raw_a.shape[0])
    fa, fb = decode_wide(a, dtype), decode_wide(b, dtype)
    if fa is None or fb is None:
        count = int(bit_different.sum())
        return {
            "differing_elements": count,
            "bit_differing_elements": count,
            "numel": numel,
            "max_abs_diff": None,
            "max_rel_diff": None,
            "within_tolerance": count == 0,
        }
    is_complex = fa.dtype.kind == "c"
    # parts: (n, 2) real/imaginary for complex, (n, 1) otherwise
    pa = np.stack([fa.real, fa.imag], axis=1) if is_complex else fa.reshape(-1, 1)
    pb = np.stack([fb.real, fb.imag], axis=1) if is_complex else fb.reshape(-1, 1)
    with np.errstate(all="ignore"):  # inf - inf and the like are measured, not warned about
        both_nan = np.isnan(pa) & np.isnan(pb)
        same = ((pa == pb) | both_nan).all(axis=1)
        part_delta = np.where(both_nan, 0.0, np.abs(pa - pb))
        delta = np.sqrt((part_delta * part_delta).sum(axis=1)) if is_complex else part_delta[:, 0]
        magnitude = np.sqrt((pb * pb).sum(axis=1)) if is_complex else np.abs(pb[:, 0])
        finite = np.isfinite(delta)
        max_abs = float(delta[finite].max()) if finite.any() else float("inf")
        rel = delta / np.maximum(magnitude, np.finfo(np.float64).tiny)
        measurable = finite & np.isfinite(rel)  # a NaN part in B has no relative difference
        max_rel = float(rel[measurable].max()) if measurable.any() else float("inf")
        if (rtol or atol) and delta.size:
            close = np.isclose(pa, pb, rtol=rtol, atol=atol, equal_nan=True).all(axis=1)
        else:
            close = same
    return {
        "differing_elements": int((~close).sum()),
        "bit_differing_elements": int(bit_different.sum()),
        "numel": numel,
        "max_abs_diff": max_abs if finite.all() else float("inf"),
        "max_rel_diff": max_rel if finite.all() else float("inf"),
        "within_tolerance": bool(close.all()),
    }


#: the hint a --keys-only report carries: its verdict says nothing of tensor values
KEYS_ONLY_HINT = "tensor values were not read (--keys-only): keys, dtypes, shapes and other values compared"


def diff_trees(
    a_root: Any,
    b_root: Any,
    *,
    a_name: str = "A",
    b_name: str = "B",
    rtol: float = 0.0,
    atol: float = 0.0,
    keys_only: bool = False,
) -> DiffReport:
    """Compare two checkpoint trees (lazy or real tensors), reading one tensor pair at a time;
    with ``keys_only``, no tensor byte is read (tensors compare by dtype and shape)."""
    report = DiffReport(a_name, b_name)
    a, b = flatten(a_root), flatten(b_root)
    report.only_in_a = [k for k in a if k not in b]
    report.only_in_b = [k for k in b if k not in a]
    with OpenFiles() as files:
        for path, left in a.items():
            if path not in b:
                continue
            right = b[path]
            left_tensor = isinstance(left, TensorRef) or is_torch_tensor(left)
            right_tensor = isinstance(right, TensorRef) or is_torch_tensor(right)
            if left_tensor and right_tensor:
                _compare_tensor(report, path, left, right, None if keys_only else files, rtol, atol)
            elif type(left) is StorageRef and type(right) is StorageRef:
                _compare_storage(report, path, left, right, None if keys_only else files)
            elif left_tensor or right_tensor:
                report.values_differ.append({"path": path, "a": type(left).__name__, "b": type(right).__name__})
            elif isinstance(left, Reduce) or isinstance(right, Reduce):
                if not (
                    isinstance(left, Reduce)
                    and isinstance(right, Reduce)
                    and left.func == right.func
                    and _plain_equal(left.args, right.args)
                ):
                    report.values_differ.append({"path": path, "a": repr(left)[:80], "b": repr(right)[:80]})
            elif not _plain_equal(left, right):
                report.values_differ.append({"path": path, "a": repr(left)[:80], "b": repr(right)[:80]})
    if report.only_in_a and report.only_in_b:
        report.hint = _prefix_hint(report.only_in_a, report.only_in_b)
    elif keys_only:
        report.hint = KEYS_ONLY_HINT
    report.equal = not (
        report.only_in_a or report.only_in_b or report.mismatched or report.different or report.values_differ
    )
    return report


def _plain_equal(left: Any, right: Any) -> bool:
    if isinstance(left, float) and isinstance(right, float) and left != left and right != right:
        return True
    try:
        return bool(left == right) and type(left) is type(right)
    except Exception:
        return False


def _compare_tensor(
    report: DiffReport, path: str, left: Any, right: Any, files: OpenFiles | None, rtol: float, atol: float
) -> None:
    """``files`` None: dtype and shape only (--keys-only)."""
    report.tensors_compared += 1
    dtype_a, dtype_b = _dtype_of(left), _dtype_of(right)
    shape_a, shape_b = _shape_of(left), _shape_of(right)
    if dtype_a != dtype_b or shape_a != shape_b:
        report.mismatched.append({"path": path, "a": f"{dtype_a} {shape_a}", "b": f"{dtype_b} {shape_b}"})
        return
    if files is None:
        return
    bytes_a, bytes_b = tensor_c_bytes(left, files), tensor_c_bytes(right, files)
    if bytes_a == bytes_b:
        report.tensors_equal += 1
        return
    measured = _measure(bytes_a, bytes_b, dtype_a, shape_a, rtol, atol)
    if measured["within_tolerance"]:  # within rtol/atol, or only NaN payloads differ
        report.tensors_equal += 1
        return
    report.different.append({"path": path, "dtype": dtype_a, "shape": shape_a, **measured})


def _compare_storage(
    report: DiffReport, path: str, left: StorageRef, right: StorageRef, files: OpenFiles | None
) -> None:
    """A storage a tensor kind is rebuilt from (a quantized tensor's): dtype, size and bytes
    (not the bytes when ``files`` is None: --keys-only)."""
    if (left.dtype, left.numel) != (right.dtype, right.numel):
        report.mismatched.append(
            {"path": path, "a": f"{left.dtype} storage of {left.numel}", "b": f"{right.dtype} storage of {right.numel}"}
        )
    elif files is None:
        return
    elif left.source is None or right.source is None or read_all(left.source, files) != read_all(right.source, files):
        report.values_differ.append({"path": path, "a": "storage bytes", "b": "other storage bytes"})


def render(report: DiffReport) -> str:
    """Human-readable diff."""
    lines = []
    if report.equal and report.hint == KEYS_ONLY_HINT:
        return f"equal keys: {report.tensors_compared} tensors match in dtype and shape, every other value matches"
    if report.equal:
        lines.append(f"equal: {report.tensors_compared} tensors and every other value match")
        return "\n".join(lines)
    for title, items in (("only in A", report.only_in_a), ("only in B", report.only_in_b)):
        if items:
            more = f" ... (+{len(items) - _MAX_LISTED})" if len(items) > _MAX_LISTED else ""
            shown = ", ".join(items[:_MAX_LISTED]) + more
            lines.append(f"{title} ({len(items)}): {shown}")
    for m in report.mismatched[:_MAX_LISTED]:
        lines.append(f"shape/dtype differ: {m['path']}: {m['a']} vs {m['b']}")
    for d in report.different[:_MAX_LISTED]:
        how_far = (
            f", max abs diff {d['max_abs_diff']:.6g}, max rel diff {d['max_rel_diff']:.6g}"
            if d["max_abs_diff"] is not None
            else " (compared bit for bit: no arithmetic on this dtype)"
        )
        lines.append(f"values differ: {d['path']}: {d['differing_elements']}/{d['numel']} elements{how_far}")
    for v in report.values_differ[:_MAX_LISTED]:
        lines.append(f"value differs: {v['path']}: {v['a']} vs {v['b']}")
    if report.hint:
        lines.append(f"hint: {report.hint}")
    lines.append(
        f"different: {len(report.different)} of {report.tensors_compared} tensors differ in value, "
        f"{len(report.mismatched)} in shape/dtype, "
        f"{len(report.only_in_a) + len(report.only_in_b)} keys on one side only"
    )
    return "\n".join(lines)


def _prefix_hint(only_a: list[str], only_b: list[str]) -> str:
    """When the one-sided keys differ by a prefix, say which transform of A would match them."""
    from ..transforms.fit import plan_fit

    plan = plan_fit((), dict.fromkeys(only_a, ()), dict.fromkeys(only_b, ()))
    if not plan.matched or not (plan.strips or plan.add):
        return ""
    steps = [f"--strip-prefix {p}" for p in plan.strips] + ([f"--add-prefix {plan.add}"] if plan.add else [])
    options = " ".join(steps)
    return f"{plan.matched} of these keys match after `{options}` on A"
