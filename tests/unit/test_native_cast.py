"""The native cast over columns and the gathered reads (ckptfix/native/cast.py,
native/src/cast.rs, native/src/gather.rs).

The native cast must give, bit for bit, what the reference gives
(:func:`ckptfix.model.numeric.cast_float_bytes`) and what torch's ``Tensor.to`` gives: every
16-bit pattern; random 32/64-bit ones; NaNs with payloads (signalling and quiet, both signs);
infinities; subnormals of every width; -0.0; values that round up to infinity; halfway
cases; float64 values that round twice through float32.
"""

from __future__ import annotations

import os
from array import array
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import needs_native

from ckptfix.model.numeric import cast_float_bytes
from ckptfix.native import cast as native_cast

pytestmark = needs_native

CASTABLE = ["float16", "bfloat16", "float32", "float64"]

#: named special values of each width, as bits
SPECIALS = {
    2: [0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x7BFF, 0x7C00, 0xFC00, 0x7C01, 0xFC01, 0x7E00, 0x7D55]
    + [0x7F80, 0xFF80, 0x7F81, 0xFFC1, 0x7FC0, 0x0080, 0x007F, 0x7F7F, 0xFF7F],
    4: [0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x00800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000]
    + [0xFF800000, 0x7F800001, 0xFFC12345, 0x7FBFFFFF, 0x7FC00000, 0x477FF000, 0x477FEFFF, 0x477FF001]
    + [0x7F7F8000, 0x7F7FFFFF, 0x33000000, 0x33000001, 0x33800000, 0x387FE000, 0x387FF000, 0x38800000],
    8: [0x0, 0x8000000000000000, 0x1, 0x7FF0000000000000, 0xFFF0000000000000, 0x7FF0000000000001]
    + [0xFFF8000000000123, 0x7FF7FFFFFFFFFFFF, 0x7FEFFFFFFFFFFFFF, 0x47EFFFFFE0000000, 0x47EFFFFFF0000000]
    + [0x40EFFE0000000000, 0x40EFFE0000000001, 0x3E70000000000000, 0x36A0000000000000, 0x000FFFFFFFFFFFFF],
}


def _inputs(dtype: str) -> bytes:
    """Every 16-bit pattern; for wider types the specials, random bits, NaNs with random
    payloads and values next to the halfway points of float16/bfloat16."""
    width = np.dtype(np.float64 if dtype == "float64" else np.float32).itemsize if dtype[-2:] != "16" else 2
    if width == 2:
        return np.arange(1 << 16, dtype=np.uint16).tobytes()
    rng = np.random.default_rng(2026)
    kind = np.uint32 if width == 4 else np.uint64
    bits = rng.integers(0, np.iinfo(kind).max, 20_000, dtype=kind, endpoint=True)
    exp = kind(0x7F800000 if width == 4 else 0x7FF0000000000000)
    shift = 0 if width == 4 else 29
    halfway = [(bits & ~kind(m << shift)) | kind(((m + 1) >> 1) << shift) for m in (0xFFFF, 0x1FFF)]
    near = [h + kind(1) for h in halfway] + [h - kind(1) for h in halfway]
    specials = np.array(SPECIALS[width], dtype=kind)
    return np.concatenate([specials, bits, *halfway, *near, bits[:2000] | exp]).tobytes()


@pytest.mark.parametrize("target", CASTABLE)
@pytest.mark.parametrize("source", CASTABLE)
def test_native_casts_are_the_references_and_torchs_bit_for_bit(source: str, target: str) -> None:
    raw = _inputs(source)
    got = native_cast.cast_floats(raw, source, target)
    assert got == cast_float_bytes(raw, source, target), f"{source} -> {target}: not the Python engine's bytes"
    expected = torch.frombuffer(bytearray(raw), dtype=getattr(torch, source)).to(getattr(torch, target))
    if source == "float64" and target == "bfloat16":
        # torch itself writes 0xFFFF or 0x7FC0 for a float64 NaN, by its place in the vector loop
        mine = torch.frombuffer(bytearray(got), dtype=torch.bfloat16)
        assert mine.isnan().equal(expected.isnan())
        keep = ~expected.isnan()
        assert mine[keep].view(torch.int16).equal(expected[keep].view(torch.int16))
        return
    assert got == expected.view(torch.uint8).numpy().tobytes(), f"{source} -> {target}: not torch's bytes"


def test_special_values_come_out_as_torch_makes_them() -> None:
    """A few cases spelled out: values that round up to infinity, subnormals, -0.0, NaN payloads."""
    f32 = np.array([65520.0, 65519.996, -(2.0**-25), 1.5 * 2.0**-25, -0.0, 3.4e38], dtype="<f4")
    half = native_cast.cast_floats(f32.tobytes(), "float32", "float16")
    assert half == bytes.fromhex("007c ff7b 0080 0100 0080 007c")
    nan = np.array([0xFFA12345], dtype="<u4")  # a negative signalling NaN with a payload
    assert (
        native_cast.cast_floats(nan.tobytes(), "float32", "float64")
        == np.array([0xFFFC2468A0000000], dtype="<u8").tobytes()
    )


def test_swap_casts_big_endian_elements() -> None:
    values = np.array([1.5, -2.25, np.inf, 1e-40], dtype=">f4")
    little = values.astype("<f4").tobytes()
    for target in CASTABLE:
        assert native_cast.cast_floats(values.tobytes(), "float32", target, swap=True) == cast_float_bytes(
            little, "float32", target
        )


def test_partial_elements_and_unknown_dtypes() -> None:
    from ckptfix.errors import BadInputError

    with pytest.raises(BadInputError):
        native_cast.cast_floats(b"\0\0\0", "float32", "float16")
    assert native_cast.cast_floats(b"\0\0", "int16", "float16") is None
    assert native_cast.cast_floats(b"", "float64", "bfloat16") == b""


def test_gather_reads_ranges_end_to_end(tmp_path: Path) -> None:
    data = os.urandom(600_000)
    path = tmp_path / "f"
    path.write_bytes(data)
    ranges = [(10, 5), (3, 2), (500_000, 40), (7, 0), (1000, 300_000), (599_990, 10)]
    with path.open("rb") as f:
        got = native_cast.gather(f.fileno(), array("Q", [o for o, _ in ranges]), array("Q", [s for _, s in ranges]))
        assert got == b"".join(data[o : o + s] for o, s in ranges)
        # a range past the end: left to the Python reader (None), never short bytes
        assert native_cast.gather(f.fileno(), array("Q", [599_990]), array("Q", [11])) is None
