"""Tensor bytes as numbers, in numpy: the ``--dtype`` casts and the values ``diff`` measures.

No torch: the core install has none. The casts give, bit for bit, what torch 2.x's CPU
``Tensor.to`` gives (a test compares every 16-bit pattern, and random 32/64-bit ones, NaNs and
halfway cases among them, against torch when it is installed):

* rounding is to nearest, ties to even, with subnormals, overflow to infinity, and a float64
  going to float16/bfloat16 rounded through float32 first (torch converts through ``float``,
  so a value can round twice -- numpy's direct float64->float16 rounds once and differs);
* a NaN stays NaN with its sign and the top bits of its payload, with the quiet bit set
  (a signalling NaN comes out quiet), as the x86 conversion instructions torch uses do; except
  that bfloat16, which torch rounds with integer arithmetic, gets a fixed NaN: ``0xFFFF`` from
  float32/float64 (torch's vectorised loop) and ``0x7FC0`` from float16 (its scalar one), and
  bfloat16 -> float32 is the bare 16-bit shift (no quieting).

The one place torch is not consistent with itself is a float64 NaN cast to bfloat16: its
vector loop writes ``0xFFFF`` and its tail loop ``0x7FC0``, depending on where the element falls;
here it is always ``0xFFFF``. Both are NaN.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

#: numpy's name for the dtypes it has natively (little-endian, as checkpoints store them)
_NUMPY = {
    "float64": "<f8",
    "float32": "<f4",
    "float16": "<f2",
    "int64": "<i8",
    "int32": "<i4",
    "int16": "<i2",
    "int8": "i1",
    "uint8": "u1",
    "uint16": "<u2",
    "uint32": "<u4",
    "uint64": "<u8",
    "complex128": "<c16",
    "complex64": "<c8",
    # quantized tensors' bytes are their integer representation (``int_repr``)
    "qint8": "i1",
    "quint8": "u1",
    "qint32": "<i4",
}

#: 8-bit float formats: (exponent bits, mantissa bits, exponent bias, NaN rule)
_FLOAT8 = {
    "float8_e4m3fn": (4, 3, 7, "fn"),  # no infinities; S.1111.111 is NaN
    "float8_e5m2": (5, 2, 15, "ieee"),  # IEEE-like: infinities and NaNs at exponent 31
    "float8_e4m3fnuz": (4, 3, 8, "fnuz"),  # no infinities, no -0: 0x80 is the one NaN
    "float8_e5m2fnuz": (5, 2, 16, "fnuz"),
}


def _float8_table(dtype: str) -> npt.NDArray[np.float64]:
    """The value of each of the 256 bit patterns of an 8-bit float format."""
    codes = np.arange(256, dtype=np.int64)
    if dtype == "float8_e8m0fnu":  # a bare exponent: 2**(e - 127), 0xFF is NaN
        table = np.ldexp(1.0, codes - 127)
        table[255] = np.nan
        return table
    ebits, mbits, bias, rule = _FLOAT8[dtype]
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent = (codes >> mbits) & ((1 << ebits) - 1)
    mantissa = codes & ((1 << mbits) - 1)
    normal = np.ldexp(1.0 + mantissa / (1 << mbits), exponent - bias)
    subnormal = np.ldexp(mantissa.astype(np.float64), 1 - bias - mbits)
    table = sign * np.where(exponent == 0, subnormal, normal)
    top = exponent == (1 << ebits) - 1
    if rule == "fn":
        table[top & (mantissa == (1 << mbits) - 1)] = np.nan
    elif rule == "ieee":
        table[top & (mantissa == 0)] = sign[top & (mantissa == 0)] * np.inf
        table[top & (mantissa != 0)] = np.nan
    else:  # fnuz
        table[0x80] = np.nan
    return table


def decode_wide(raw: bytes, dtype: str) -> npt.NDArray[Any] | None:
    """The elements of ``raw`` (C order, little-endian) as float64, or complex128 for complex
    dtypes -- what torch's ``.to(torch.float64)`` gives; None for dtypes without arithmetic
    (bits*, float4, sub-byte integers, packed quantized types)."""
    with np.errstate(all="ignore"):  # signalling NaNs become quiet: no warning about them
        return _decode_wide(raw, dtype)


def _decode_wide(raw: bytes, dtype: str) -> npt.NDArray[Any] | None:
    if dtype in _NUMPY:
        return np.frombuffer(raw, _NUMPY[dtype]).astype(np.complex128 if dtype.startswith("complex") else np.float64)
    if dtype == "bool":
        flags: npt.NDArray[np.bool_] = np.frombuffer(raw, np.uint8) != 0
        return flags.astype(np.float64)
    if dtype == "bfloat16":
        return _bfloat16_to_float32(raw).astype(np.float64)
    if dtype == "complex32":  # two float16 parts
        parts = np.frombuffer(raw, "<f2").reshape(-1, 2)
        wide = np.empty(len(parts), np.complex128)
        wide.real, wide.imag = parts[:, 0], parts[:, 1]
        return wide
    if dtype in _FLOAT8 or dtype == "float8_e8m0fnu":
        decoded: npt.NDArray[np.float64] = _float8_table(dtype)[np.frombuffer(raw, np.uint8)]
        return decoded
    return None


def _bfloat16_to_float32(raw: bytes) -> npt.NDArray[np.float32]:
    return (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)


#: the quiet bit of a NaN, per float width in bytes
_QUIET_BIT = {2: 0x0200, 4: 0x0040_0000, 8: 0x0008_0000_0000_0000}
_BITS = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def cast_float_bytes(raw: bytes, source: str, target: str) -> bytes:
    """``raw`` (``source`` elements, little-endian) cast to ``target``, both one of float16,
    bfloat16, float32, float64: the bytes torch's ``Tensor.to`` gives (see the module doc).
    Memory: the output and about one float32 copy of the input."""
    if source == target:
        return raw
    values: npt.NDArray[Any] = _bfloat16_to_float32(raw) if source == "bfloat16" else np.frombuffer(raw, _NUMPY[source])
    nan = np.isnan(values)
    with np.errstate(over="ignore", invalid="ignore"):
        if target in ("bfloat16", "float16"):  # torch goes through float32: a float64 may round twice
            single = values if values.dtype == np.float32 else values.astype(np.float32)
        if target == "bfloat16":  # round to nearest even on the bits (NaNs are set after)
            bits = single.view(np.uint32)
            rounded = (bits >> 16) & 1
            rounded += 0x7FFF
            rounded += bits
            rounded >>= 16
            half = rounded.astype("<u2")
            half[nan] = 0x7FC0 if source == "float16" else 0xFFFF
            return half.tobytes()
        if target == "float16":
            out = single.astype("<f2")
            if nan.any():  # sign, quiet bit and the payload's top 9 bits (numpy's own differ)
                payload = single.view(np.uint32)[nan]
                fixed = ((payload >> 16) & 0x8000) | 0x7E00 | ((payload >> 13) & 0x3FF)
                out.view(np.uint16)[nan] = fixed.astype(np.uint16)
            return out.tobytes()
        out = values.astype("<f4" if target == "float32" else "<f8")
    if nan.any() and not (source == "bfloat16" and target == "float32"):  # that one is a bare shift
        width = out.dtype.itemsize
        out.view(_BITS[width])[nan] |= _BITS[width](_QUIET_BIT[width])
    return out.tobytes()
