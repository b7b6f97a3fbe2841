"""The numpy code that replaced torch on the core paths gives torch's answers, checked against
torch: ``--dtype`` casts bit for bit (:mod:`ckptfix.model.numeric`), the values ``diff``
decodes, and ``diff``'s measurements (counts exactly, magnitudes to rounding); and every
function that imports torch asks :func:`~ckptfix.model.needs.need_torch` first, so a core
install without torch gets one line instead of an ImportError.
"""

from __future__ import annotations

import ast
import sys
from typing import Any

import numpy as np
import pytest
import torch
from conftest import ROOT, parsed

from ckptfix.analysis.diff import _measure
from ckptfix.errors import NEEDS_TORCH, NeedsTorchError
from ckptfix.model.dtypes import DTYPE_ITEMSIZE
from ckptfix.model.needs import need_torch
from ckptfix.model.numeric import cast_float_bytes, decode_wide


def _imports_torch(node: ast.AST) -> bool:
    if isinstance(node, ast.Import):
        return any(a.name.split(".")[0] == "torch" for a in node.names)
    if isinstance(node, ast.ImportFrom) and not node.level and node.module:
        return node.module.split(".")[0] == "torch" or node.module == "safetensors.torch"
    return False


def test_every_torch_import_is_gated() -> None:
    """In every function that imports torch, ``need_torch()`` is called on an earlier line."""
    ungated = []
    for path in sorted((ROOT / "ckptfix").rglob("*.py")):
        if path.name == "needs.py":
            continue
        for func in ast.walk(parsed(path)):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            gates = [
                n.lineno
                for n in ast.walk(func)
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "need_torch"
            ]
            for node in ast.walk(func):
                if _imports_torch(node) and not any(g < node.lineno for g in gates):
                    ungated.append(f"{path.relative_to(ROOT)}:{node.lineno} ({func.name})")
    assert not ungated, f"torch imported without need_torch() first: {ungated}"


def test_need_torch_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    need_torch()  # installed: nothing happens
    monkeypatch.setitem(sys.modules, "torch", None)  # as if it were not installed
    with pytest.raises(NeedsTorchError) as caught:
        need_torch()
    assert str(caught.value) == NEEDS_TORCH and NEEDS_TORCH.startswith("needs torch: pip install ")
    assert caught.value.exit_code == 2


def test_the_torch_hint_installs_the_cpu_build_where_there_is_no_gpu() -> None:
    from ckptfix.errors import TORCH_CPU_INSTALL, torch_install_hint

    assert torch_install_hint("linux", nvidia_driver=False).startswith(TORCH_CPU_INSTALL)
    assert "download.pytorch.org/whl/cpu" in TORCH_CPU_INSTALL
    assert torch_install_hint("linux", nvidia_driver=True) == "pip install 'ckptfix[torch]'"
    assert torch_install_hint("darwin", nvidia_driver=False) == "pip install 'ckptfix[torch]'"


CASTABLE = ["float16", "bfloat16", "float32", "float64"]


def _cast_inputs(dtype: str) -> bytes:
    """Every 16-bit pattern; for wider types random bits, NaNs with random payloads, and values
    one bit either side of the halfway points of float16/bfloat16 (and float64 values that
    round twice through float32)."""
    rng = np.random.default_rng(20260)
    if DTYPE_ITEMSIZE[dtype] == 2:
        return np.arange(1 << 16, dtype=np.uint16).tobytes()
    if dtype == "float32":
        bits = rng.integers(0, 1 << 32, 100_000, dtype=np.uint64).astype(np.uint32)
        halfway = [(bits & ~np.uint32(m)) | np.uint32((m + 1) >> 1) for m in (0xFFFF, 0x1FFF)]
        nans = bits | np.uint32(0x7F800000)
        return np.concatenate([bits, *halfway, halfway[0] + 1, halfway[0] - 1, nans]).tobytes()
    bits = rng.integers(0, 1 << 63, 100_000, dtype=np.uint64) | (rng.integers(0, 2, 100_000, dtype=np.uint64) << 63)
    normal = rng.standard_normal(50_000)
    near = rng.standard_normal(20_000).astype(np.float32).view(np.uint32)
    twice = [
        ((near & ~np.uint32(m)) | np.uint32((m + 1) >> 1)).view(np.float32).astype(np.float64) for m in (0xFFFF, 0x1FFF)
    ]
    twice = [t + np.copysign(2.0**-45, t) * np.abs(t) for t in twice]
    nans = bits[:1000] | np.uint64(0x7FF0000000000000)
    return np.concatenate([bits, normal.view(np.uint64), *(t.view(np.uint64) for t in twice), nans]).tobytes()


@pytest.mark.parametrize("target", CASTABLE)
@pytest.mark.parametrize("source", CASTABLE)
def test_numpy_casts_are_torch_casts_bit_for_bit(source: str, target: str) -> None:
    if source == target:
        return
    raw = _cast_inputs(source)
    expected = torch.frombuffer(bytearray(raw), dtype=getattr(torch, source)).to(getattr(torch, target))
    got = cast_float_bytes(raw, source, target)
    if source == "float64" and target == "bfloat16":
        # torch itself writes 0xFFFF or 0x7FC0 for a float64 NaN, by its place in the vector loop
        mine = torch.frombuffer(bytearray(got), dtype=torch.bfloat16)
        assert mine.isnan().equal(expected.isnan())
        keep = ~expected.isnan()
        assert mine[keep].view(torch.int16).equal(expected[keep].view(torch.int16))
        return
    assert got == expected.view(torch.uint8).numpy().tobytes()


def _torch_wide(raw: bytes, dtype: str) -> np.ndarray | None:
    """What torch's ``.to(float64)`` (``complex128``) gives, or None where torch has no arithmetic."""
    tdtype = getattr(torch, dtype, None)
    if tdtype is None or DTYPE_ITEMSIZE[dtype] != tdtype.itemsize:
        return None
    try:
        t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(tdtype)
        return t.to(torch.complex128 if tdtype.is_complex else torch.float64).numpy()
    except (RuntimeError, TypeError, NotImplementedError):
        return None


@pytest.mark.parametrize("dtype", sorted(DTYPE_ITEMSIZE))
def test_numpy_decoding_is_torchs(dtype: str) -> None:
    itemsize = DTYPE_ITEMSIZE[dtype]
    raw = np.random.default_rng(7).integers(0, 256, 4096 * itemsize, dtype=np.uint8)
    if itemsize == 1:
        raw[:256] = np.arange(256)  # every 8-bit pattern
    if dtype == "bool":
        raw &= 1
    mine, theirs = decode_wide(raw.tobytes(), dtype), _torch_wide(raw.tobytes(), dtype)
    if dtype in ("qint8", "quint8", "qint32"):  # quantized: the bytes are int_repr, decoded as those integers
        assert mine is not None and mine.dtype == np.float64
        return
    if theirs is None:
        assert mine is None, f"{dtype}: torch has no arithmetic on it, so diff compares bits"
        return
    assert mine is not None and mine.dtype == theirs.dtype, dtype
    np.testing.assert_array_equal(mine, theirs)  # NaN equal to NaN


def _measure_with_torch(a: bytes, b: bytes, dtype: str, rtol: float, atol: float) -> dict[str, Any]:
    """diff's measurement as it was written in torch (the reference the numpy one must match)."""
    itemsize = DTYPE_ITEMSIZE[dtype]
    raw_a = torch.frombuffer(bytearray(a), dtype=torch.uint8).reshape(-1, itemsize)
    raw_b = torch.frombuffer(bytearray(b), dtype=torch.uint8).reshape(-1, itemsize)
    bit_different = (raw_a != raw_b).any(dim=1)
    tdtype = getattr(torch, dtype)
    wide = torch.complex128 if tdtype.is_complex else torch.float64
    fa = torch.frombuffer(bytearray(a), dtype=tdtype).to(wide)
    fb = torch.frombuffer(bytearray(b), dtype=tdtype).to(wide)
    pa = torch.view_as_real(fa) if tdtype.is_complex else fa.unsqueeze(1)
    pb = torch.view_as_real(fb) if tdtype.is_complex else fb.unsqueeze(1)
    both_nan = torch.isnan(pa) & torch.isnan(pb)
    same = ((pa == pb) | both_nan).all(dim=1)
    part_delta = torch.where(both_nan, torch.zeros_like(pa), (pa - pb).abs())
    delta = part_delta.pow(2).sum(dim=1).sqrt() if tdtype.is_complex else part_delta[:, 0]
    magnitude = pb.pow(2).sum(dim=1).sqrt() if tdtype.is_complex else pb[:, 0].abs()
    finite = torch.isfinite(delta)
    max_abs = float(delta[finite].max()) if finite.any() else float("inf")
    rel = delta / magnitude.clamp_min(torch.finfo(torch.float64).tiny)
    measurable = finite & torch.isfinite(rel)
    max_rel = float(rel[measurable].max()) if measurable.any() else float("inf")
    close = torch.isclose(pa, pb, rtol=rtol, atol=atol, equal_nan=True).all(dim=1) if rtol or atol else same
    return {
        "differing_elements": int((~close).sum()),
        "bit_differing_elements": int(bit_different.sum()),
        "numel": int(raw_a.shape[0]),
        "max_abs_diff": max_abs if finite.all() else float("inf"),
        "max_rel_diff": max_rel if finite.all() else float("inf"),
        "within_tolerance": bool(close.all()),
    }


MEASURED = ["float32", "float64", "float16", "bfloat16", "complex64", "complex128", "int64", "uint8", "bool"]


@pytest.mark.parametrize("dtype", MEASURED)
@pytest.mark.parametrize(("rtol", "atol"), [(0.0, 0.0), (1e-3, 1e-5)])
def test_diff_measures_as_torch_did(dtype: str, rtol: float, atol: float) -> None:
    rng = np.random.default_rng(11)
    tdtype = getattr(torch, dtype)
    specials = [np.nan, np.inf, -np.inf, 0.0, -0.0]
    for trial in range(20):
        n = int(rng.integers(1, 300))
        if tdtype.is_floating_point or tdtype.is_complex:
            a_np = rng.standard_normal(n) + (1j * rng.standard_normal(n) if tdtype.is_complex else 0)
            b_np = a_np + rng.standard_normal(n) * 10.0 ** -int(rng.integers(1, 6))
            b_np = np.where(rng.random(n) < 0.5, a_np, b_np)
            a_np[rng.integers(0, n, 3)] = specials[trial % 5]
            b_np[rng.integers(0, n, 3)] = specials[(trial + 1) % 5]
            a, b = torch.from_numpy(a_np).to(tdtype), torch.from_numpy(b_np).to(tdtype)
        else:
            a = torch.from_numpy(rng.integers(0, 2, n)).to(tdtype)
            b = torch.from_numpy(rng.integers(0, 2, n)).to(tdtype)
        raw_a, raw_b = a.view(torch.uint8).numpy().tobytes(), b.view(torch.uint8).numpy().tobytes()
        if raw_a == raw_b:
            continue
        got, want = _measure(raw_a, raw_b, dtype, [n], rtol, atol), _measure_with_torch(raw_a, raw_b, dtype, rtol, atol)
        # counts and verdicts exactly; magnitudes to rounding (torch's complex |z| may differ in the last bit)
        assert got == {**want, **{k: pytest.approx(want[k], rel=1e-12) for k in ("max_abs_diff", "max_rel_diff")}}, (
            dtype,
            trial,
        )
