"""A tensor's bytes in C order, little-endian: read as a range when the view is contiguous,
gathered with numpy over the storage otherwise (safetensors output, diff, casts)."""

from __future__ import annotations

import mmap
from typing import TYPE_CHECKING

from ..errors import BadInputError
from ..fileio.ranges import OpenFiles, is_local_range, is_plain_range, read_all
from .dtypes import DTYPE_ITEMSIZE
from .needs import need_torch

if TYPE_CHECKING:
    import torch

    from .refs import TensorRef


def is_c_contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """True if the view's elements are consecutive in row-major order (size-1 dims ignored)."""
    expected = 1
    for size, step in zip(reversed(shape), reversed(stride)):
        if size == 0:
            return True
        if size != 1 and step != expected:
            return False
        expected *= size
    return True


def gather_c_order(
    buffer: bytes | mmap.mmap,
    base: int,
    itemsize: int,
    shape: tuple[int, ...],
    stride: tuple[int, ...],
    swap_unit: int = 0,
) -> bytes:
    """Copy a strided view (element strides) starting at byte ``base`` into C-order bytes.

    ``swap_unit`` > 1 reverses each group of that many bytes (big-endian sources into
    little-endian output: the element size, or half of it for complex numbers).
    """
    import numpy as np

    numel = 1
    for s in shape:
        numel *= s
    if numel == 0:
        return b""
    raw = np.frombuffer(buffer, dtype=np.uint8)
    view = np.lib.stride_tricks.as_strided(
        raw[base:], shape=(*shape, itemsize), strides=(*(s * itemsize for s in stride), 1), writeable=False
    )
    data = np.ascontiguousarray(view)
    if swap_unit > 1:
        data = data.reshape(-1, swap_unit)[:, ::-1]
    return np.ascontiguousarray(data).tobytes()


def swap_unit_for(dtype: str) -> int:
    """Bytes per byte-swapped unit: the element size, or a half for complex numbers."""
    size = DTYPE_ITEMSIZE.get(dtype, 1)
    return size // 2 if dtype.startswith("complex") else size


def tensor_c_bytes(t: TensorRef | torch.Tensor, files: OpenFiles) -> bytes:
    """One tensor's elements in C order, little-endian: the bytes safetensors would store.

    Works for :class:`~ckptfix.tree.TensorRef` (read from its storage's source: a range read
    when the view is contiguous, a gather otherwise) and for real torch tensors.
    """
    from .refs import TensorRef

    if not isinstance(t, TensorRef):
        need_torch()
        import torch

        flat = t.detach().cpu().contiguous().reshape(-1)
        if flat.is_quantized:
            flat = flat.int_repr()
        return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    source = t.storage.source
    itemsize = DTYPE_ITEMSIZE[t.dtype]
    start = t.storage_offset * itemsize
    swap = swap_unit_for(t.dtype) if t.storage.byteorder == "big" else 0
    buffer: bytes | mmap.mmap
    if is_plain_range(source) and swap <= 1 and is_c_contiguous(t.shape, t.stride):
        return read_all(source.sub(start, t.nbytes), files)
    if is_local_range(source):
        buffer, base = files.map(source.path), source.offset + start
    elif source is None:
        raise BadInputError(f"storage {t.storage.key!r:.40} has no source bytes to read")
    else:  # compressed, computed or remote (never mapped): this one storage in memory
        buffer, base = read_all(source, files), start
    return gather_c_order(buffer, base, itemsize, t.shape, t.stride, swap)
