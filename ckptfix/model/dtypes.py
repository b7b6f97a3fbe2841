"""dtype facts torch's pickles rely on, as plain tables so no torch import is needed.

torch.save names a tensor's element type through its storage class (``torch.FloatStorage``)
for the classic dtypes, and through an untyped byte storage plus an explicit dtype global
(``torch.uint16`` in ``_rebuild_tensor_v3``) for the dtypes added later.
"""

from __future__ import annotations

#: dtype name -> bytes per element (sub-byte "shell" dtypes occupy one byte each).
DTYPE_ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "complex128": 16,
    "complex64": 8,
    "complex32": 4,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
    "qint8": 1,
    "quint8": 1,
    "qint32": 4,
    "quint4x2": 1,
    "quint2x4": 1,
    "bits1x8": 1,
    "bits2x4": 1,
    "bits4x2": 1,
    "bits8": 1,
    "bits16": 2,
    **{f"int{n}": 1 for n in range(1, 8)},
    **{f"uint{n}": 1 for n in range(1, 8)},
}

#: storage class name (as pickled by torch.save) -> dtype of its elements.
STORAGE_DTYPE: dict[str, str] = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "ComplexDoubleStorage": "complex128",
    "ComplexFloatStorage": "complex64",
    "QInt8Storage": "qint8",
    "QInt32Storage": "qint32",
    "QUInt8Storage": "quint8",
    "QUInt4x2Storage": "quint4x2",
    "QUInt2x4Storage": "quint2x4",
    "UntypedStorage": "uint8",
}

#: legacy tensor type names (``torch.FloatTensor``), which old pickles may reference.
TENSOR_CLASS_NAMES: tuple[str, ...] = (
    "DoubleTensor",
    "FloatTensor",
    "HalfTensor",
    "BFloat16Tensor",
    "LongTensor",
    "IntTensor",
    "ShortTensor",
    "CharTensor",
    "ByteTensor",
    "BoolTensor",
)

#: Quantization schemes torch pickles as globals (``torch.per_tensor_affine``).
QSCHEMES: tuple[str, ...] = (
    "per_tensor_affine",
    "per_tensor_symmetric",
    "per_channel_affine",
    "per_channel_symmetric",
    "per_channel_affine_float_qparams",
)

#: safetensors dtype code -> dtype name (what safetensors.torch can load)
SAFETENSORS_DTYPES: dict[str, str] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2": "float8_e5m2",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
    "F4": "float4_e2m1fn_x2",
}
DTYPE_TO_SAFETENSORS: dict[str, str] = {v: k for k, v in SAFETENSORS_DTYPES.items()}
#: torch dtypes that pack several safetensors elements into one byte -> how many: safetensors
#: counts float4 values (``F4``, shape ``[2, 6]``), torch counts bytes of two (``[2, 3]``), so the
#: last dimension differs by this factor, and a 0-dim tensor of them has no safetensors shape
SAFETENSORS_PACKED: dict[str, int] = {"float4_e2m1fn_x2": 2}

#: dtype -> storage class torch.save uses for it (the rest use UntypedStorage + _rebuild_tensor_v3)
DTYPE_STORAGE: dict[str, str] = {v: k for k, v in STORAGE_DTYPE.items() if k != "UntypedStorage"}

#: the floating-point dtypes --dtype casts to
CASTABLE = ("float16", "bfloat16", "float32", "float64")
#: other names people give them (PyTorch's ``half``/``float``/``double``, the usual short forms)
CAST_ALIASES = {
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "fp32": "float32",
    "float": "float32",
    "fp64": "float64",
    "double": "float64",
}
