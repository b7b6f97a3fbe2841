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

from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from ..fileio.ranges import OpenFiles, read_all
from ..model.data import tensor_c_chunks
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
    #: tensors of the same shape stored in another dtype ({"path", "a", "b"}): their values are
    #: compared (in float64) and count as equal within --rtol/--atol; the change itself is no failure
    dtype_changed: list[dict[str, Any]] = field(default_factory=list)
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
    return {**_compare_values(fa, fb, rtol, atol), "bit_differing_elements": int(bit_different.sum())}


def _compare_values(fa: Any, fb: Any, rtol: float, atol: float) -> dict[str, Any]:
    """How far apart two decoded tensors (float64 or complex128 arrays of one length) are."""
    import numpy as np

    numel = int(fa.size)
    is_complex = fa.dtype.kind == "c" or fb.dtype.kind == "c"
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
    expand_budget: int | None = None,
) -> DiffReport:
    """Compare two checkpoint trees (lazy or real tensors), reading one tensor pair at a time;
    with ``keys_only``, no tensor byte is read (tensors compare by dtype and shape).

    ``expand_budget`` bounds the bytes compared element by element (views of different layouts,
    or whose storages differ between elements); None: unbounded."""
    report = DiffReport(a_name, b_name)
    budget = _Budget(expand_budget)
    #: outcomes of tensor pairs already compared, by the two objects: a pickle that holds one
    #: tensor under a million paths (memoized) costs one comparison, not a million
    seen: dict[tuple[int, int], dict[str, Any] | None] = {}
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
                _compare_tensor(report, path, left, right, None if keys_only else files, rtol, atol, budget, seen)
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


#: the most tensor bytes diff expands by default beyond what the files store: views are
#: compared element by element (a stride-0 view of 4 stored bytes can be a terabyte), so that
#: work is bounded like safetensors output's (``default_expand_budget`` of both inputs)
DIFF_EXPAND_NAME = "diff's expansion budget (16x the inputs' size, at least 1 GiB)"


@dataclass
class _Budget:
    """Bytes diff may still compare element by element; None: unbounded (verify, which compares
    what was just written, already bounded by the writer's own budget)."""

    left: int | None

    def spend(self, path: str, t: Any) -> None:
        if self.left is None:
            return
        size = _nbytes(t)
        if size > self.left:
            from ..errors import BadInputError

            raise BadInputError(
                f"tensor {path!r}: comparing it element by element ({_dtype_of(t)} {list(t.shape)[:8]!s:.80}) "
                f"would read more than {DIFF_EXPAND_NAME}",
                hint="a view that expands its storage (stride 0) is compared in full; compare the files' storages "
                "by writing both as .pth, or drop the tensor (--drop)",
            )
        self.left -= size


def _nbytes(t: Any) -> int:
    return int(t.nbytes) if isinstance(t, TensorRef) else int(t.numel() * t.element_size())


def _paired(left: Iterator[bytes], right: Iterator[bytes]) -> Iterator[tuple[bytes, bytes]]:
    """The two byte streams cut at the same places (each piece a whole number of elements:
    both sides' pieces are). Bytes, not memoryviews: comparing bytes is a memcmp, comparing
    memoryviews goes element by element."""
    a, b, at_a, at_b = b"", b"", 0, 0
    while True:
        if at_a == len(a):
            a, at_a = next(left, b""), 0
        if at_b == len(b):
            b, at_b = next(right, b""), 0
        if not a or not b:
            if a or b:
                raise RuntimeError("two tensors of one shape and dtype gave different byte counts")
            return
        n = min(len(a) - at_a, len(b) - at_b)
        whole_a, whole_b = at_a == 0 and n == len(a), at_b == 0 and n == len(b)
        yield (a if whole_a else a[at_a : at_a + n]), (b if whole_b else b[at_b : at_b + n])
        at_a, at_b = at_a + n, at_b + n


def _same_storage_span(left: TensorRef, right: TensorRef, files: OpenFiles) -> bool:
    """True when two views of one layout read equal storage bytes over their whole span: then
    every element is equal, without expanding the views (a stride-0 view of a terabyte is a few
    stored bytes). False says nothing (bytes between the elements may differ)."""
    from ..model.data import storage_span_chunks

    if left.stride != right.stride or left.numel == 0:
        return False
    span_a, span_b = storage_span_chunks(left, files), storage_span_chunks(right, files)
    if span_a is None or span_b is None:
        return False
    return all(a == b for a, b in _paired(span_a, span_b))


def _without_common_broadcast(left: TensorRef, right: TensorRef) -> tuple[TensorRef, TensorRef, int]:
    """The two views with every dimension both repeat (stride 0 on both sides) cut to one index,
    and how many times each remaining element stands for: equal and measured alike, and an
    expanded view of a terabyte costs what its storage holds."""
    from dataclasses import replace

    shape_a, shape_b, repeat = list(left.shape), list(right.shape), 1
    for d, (sa, sb) in enumerate(zip(left.stride, right.stride)):
        if sa == 0 and sb == 0 and shape_a[d] > 1:
            repeat *= shape_a[d]
            shape_a[d] = shape_b[d] = 1
    if repeat == 1:
        return left, right, 1
    return replace(left, shape=tuple(shape_a)), replace(right, shape=tuple(shape_b)), repeat


def _compare_tensor(
    report: DiffReport,
    path: str,
    left: Any,
    right: Any,
    files: OpenFiles | None,
    rtol: float,
    atol: float,
    budget: _Budget,
    seen: dict[tuple[int, int], dict[str, Any] | None],
) -> None:
    """Compare two tensors a piece at a time (memory: a few chunks whatever their size); a pair
    compared before (``seen``) is counted with its earlier outcome. ``files`` None: dtype and
    shape only (--keys-only)."""
    report.tensors_compared += 1
    pair = (id(left), id(right))
    if pair in seen:
        outcome = seen[pair]
        if outcome is None:
            report.tensors_equal += 1
        elif "differing_elements" in outcome:
            report.different.append({**outcome, "path": path})
        else:
            report.mismatched.append({**outcome, "path": path})
        return
    before = (len(report.different), len(report.mismatched))
    _compare_new_pair(report, path, left, right, files, rtol, atol, budget)
    if len(report.different) > before[0]:
        seen[pair] = report.different[-1]
    elif len(report.mismatched) > before[1]:
        seen[pair] = report.mismatched[-1]
    else:
        seen[pair] = None


def _compare_new_pair(
    report: DiffReport,
    path: str,
    left: Any,
    right: Any,
    files: OpenFiles | None,
    rtol: float,
    atol: float,
    budget: _Budget,
) -> None:
    dtype_a, dtype_b = _dtype_of(left), _dtype_of(right)
    shape_a, shape_b = _shape_of(left), _shape_of(right)
    if files is not None and shape_a == shape_b and dtype_a != dtype_b:
        budget.spend(path, left)  # element by element, as below: a stride-0 view counts in full
        budget.spend(path, right)
        _compare_across_dtypes(report, path, left, right, files, rtol, atol)
        return
    if dtype_a != dtype_b or shape_a != shape_b:
        report.mismatched.append({"path": path, "a": f"{dtype_a} {shape_a}", "b": f"{dtype_b} {shape_b}"})
        return
    if files is None:  # --keys-only: dtype and shape match, no byte is read
        return
    repeat = 1
    if isinstance(left, TensorRef) and isinstance(right, TensorRef):
        if _same_storage_span(left, right, files):
            report.tensors_equal += 1
            return
        left, right, repeat = _without_common_broadcast(left, right)
    budget.spend(path, left)
    total: dict[str, Any] | None = None
    numel = 0
    itemsize = DTYPE_ITEMSIZE[dtype_a]
    for piece_a, piece_b in _paired(tensor_c_chunks(left, files), tensor_c_chunks(right, files)):
        count = len(piece_a) // itemsize
        numel += count
        if piece_a == piece_b:
            continue
        measured = _measure(piece_a, piece_b, dtype_a, [count], rtol, atol)
        total = measured if total is None else _merge(total, measured)
    if total is None or total["within_tolerance"]:  # equal, within rtol/atol, or only NaN payloads differ
        report.tensors_equal += 1
        return
    total["numel"] = numel * repeat
    for key in ("differing_elements", "bit_differing_elements"):
        total[key] *= repeat
    report.different.append({"path": path, "dtype": dtype_a, "shape": shape_a, **total})


def _merge(total: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    """Two pieces' measures as one tensor's."""
    merged = {k: total[k] + more[k] for k in ("differing_elements", "bit_differing_elements", "numel")}
    for key in ("max_abs_diff", "max_rel_diff"):
        values = [v for v in (total[key], more[key]) if v is not None]
        merged[key] = max(values) if values else None
    merged["within_tolerance"] = total["within_tolerance"] and more["within_tolerance"]
    return merged


def _compare_across_dtypes(
    report: DiffReport, path: str, left: Any, right: Any, files: OpenFiles, rtol: float, atol: float
) -> None:
    """Same shape, another dtype (a float32 checkpoint and its float16 export): the values are
    compared in float64 (exact for every dtype that has arithmetic), the dtype change is
    reported, and ``rtol``/``atol`` decide whether the values count as equal."""
    from ..model.numeric import decode_wide

    dtype_a, dtype_b = _dtype_of(left), _dtype_of(right)
    probe_a, probe_b = decode_wide(b"", dtype_a), decode_wide(b"", dtype_b)
    if probe_a is None or probe_b is None or (probe_a.dtype.kind == "c") != (probe_b.dtype.kind == "c"):
        report.mismatched.append(  # bits, packed or complex against real: no values to compare
            {"path": path, "a": f"{dtype_a} {_shape_of(left)}", "b": f"{dtype_b} {_shape_of(right)}"}
        )
        return
    report.dtype_changed.append({"path": path, "a": dtype_a, "b": dtype_b})
    measured: dict[str, Any] | None = None
    for raw_a, raw_b in _element_aligned(left, right, files, DTYPE_ITEMSIZE[dtype_a], DTYPE_ITEMSIZE[dtype_b]):
        more = _compare_values(decode_wide(raw_a, dtype_a), decode_wide(raw_b, dtype_b), rtol, atol)
        measured = more if measured is None else _merge_values(measured, more)
    if measured is None:  # no elements
        measured = _compare_values(probe_a, probe_b, rtol, atol)
    if measured["within_tolerance"]:
        report.tensors_equal += 1
        return
    entry = {"path": path, "dtype": f"{dtype_a} vs {dtype_b}", "shape": _shape_of(left), **measured}
    report.different.append({**entry, "bit_differing_elements": None})  # no common bit layout


def _element_aligned(
    left: Any, right: Any, files: OpenFiles, size_a: int, size_b: int
) -> Iterator[tuple[bytes, bytes]]:
    """Two tensors' C-order bytes as pairs of pieces holding the same elements: memory stays at a
    few gather chunks however large the tensors (their dtypes, so their byte sizes, differ)."""
    pieces_a, pieces_b = tensor_c_chunks(left, files), tensor_c_chunks(right, files)
    held_a, held_b = bytearray(), bytearray()
    while True:
        count = min(len(held_a) // size_a, len(held_b) // size_b)
        if count:
            yield bytes(held_a[: count * size_a]), bytes(held_b[: count * size_b])
            del held_a[: count * size_a], held_b[: count * size_b]
            continue
        if len(held_a) // size_a <= len(held_b) // size_b:
            piece = next(pieces_a, None)
            if piece is None:
                return
            held_a += piece
        else:
            piece = next(pieces_b, None)
            if piece is None:
                return
            held_b += piece


def _merge_values(total: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    """Two pieces' :func:`_compare_values` as one tensor's."""
    return {
        "differing_elements": total["differing_elements"] + more["differing_elements"],
        "numel": total["numel"] + more["numel"],
        "max_abs_diff": max(total["max_abs_diff"], more["max_abs_diff"]),
        "max_rel_diff": max(total["max_rel_diff"], more["max_rel_diff"]),
        "within_tolerance": total["within_tolerance"] and more["within_tolerance"],
    }


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
    if report.dtype_changed:
        changes: dict[tuple[str, str], int] = {}
        for change in report.dtype_changed:
            changes[(change["a"], change["b"])] = changes.get((change["a"], change["b"]), 0) + 1
        listed = ", ".join(f"{n} {a} -> {b}" for (a, b), n in changes.items())
        lines.append(f"dtypes differ (values compared across them): {listed}")
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
