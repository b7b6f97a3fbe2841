"""A tensor's bytes in C order, little-endian: read as a range when the view is contiguous and
needs no swapping, gathered otherwise (safetensors output, diff, casts).

How a strided view is gathered, and why with ``pread`` and not over a memory map:

* A file that shrinks while it is mapped kills the process with SIGBUS when a gather touches a
  page past the new end, and Python cannot recover from that signal (the faulting copy would be
  retried forever, or the process dies leaving its temporary output behind). Checking the size
  before mapping does not help: the file can shrink after the check. ``os.pread`` instead
  returns short, which is one ``BadInputError`` (exit 3), and the atomic writer removes its
  temporary file. So nothing here maps an input. A remote object (a URL: no descriptor) is read
  by the same offsets through its ranged reader (:class:`~ckptfix.fileio.ranges.RangeSource`).
* Memory stays bounded: a view whose bytes span at most :data:`SPAN_LIMIT` (every dense tensor
  up to that size, however permuted, and every stride-0 expansion of a small storage) is read
  in one ``pread`` and handed out in C-order chunks of at most :data:`GATHER_CHUNK` bytes, so
  expanding 4 bytes to a terabyte costs a chunk of memory at a time (callers bound the total
  with ``--max-expand``). A wider span whose first dimension has the widest stride (a big
  big-endian tensor to swap, a slice of a wide matrix) is read a run of rows at a time. Any
  other wider span (a big tensor stored permuted) is gathered into its own output array,
  reading the storage in pieces of at most :data:`SPAN_LIMIT` along its widest stride: one
  tensor's worth of memory (a C-order chunk of it touches the whole storage, so reading it
  chunk by chunk would read the storage once per chunk).
* No numpy array over a caller's buffer outlives the gather: nothing exported stays alive in a
  traceback to stop a file or buffer from closing (``BufferError: cannot close exported
  pointers exist`` replaced the real error).

Big-endian checkpoints are swapped as torch swaps them: by the element size of the storage's
own type (``storage.byteswap(dtype)`` in ``torch.serialization._load``), once per storage, whatever
dtype the tensor views it as -- an untyped storage (``uint8``) is never swapped, and a
``float32`` view of a ``DoubleStorage`` sees the halves of swapped doubles.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ..errors import BadInputError
from ..fileio.ranges import OpenFiles, RangeSource, is_plain_range, iter_chunks, read_all
from .dtypes import DTYPE_ITEMSIZE
from .needs import need_torch

if TYPE_CHECKING:
    import torch

    from .refs import StorageRef, TensorRef

#: the most bytes one gathered chunk holds (what a writer or diff has in memory per step)
GATHER_CHUNK = 1 << 24
#: the most bytes of a storage read in one piece for a gather
SPAN_LIMIT = 1 << 25


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


def swap_unit_for(dtype: str) -> int:
    """Bytes per byte-swapped unit: the element size, or a half for complex numbers."""
    size = DTYPE_ITEMSIZE.get(dtype, 1)
    return size // 2 if dtype.startswith("complex") else size


def storage_swap_unit(storage: StorageRef) -> int:
    """Bytes per unit torch reverses when it loads ``storage`` (0: none): big-endian storages
    are swapped by their own type's element size (1 for untyped storages: nothing to do)."""
    if storage.byteorder != "big":
        return 0
    unit = swap_unit_for(storage.dtype)
    return unit if unit > 1 else 0


def _extent(shape: tuple[int, ...], byte_strides: tuple[int, ...], itemsize: int) -> int:
    """Bytes from a non-empty view's first element to one past its last."""
    return sum((n - 1) * s for n, s in zip(shape, byte_strides)) + itemsize


class _Reader:
    """Exact reads of a storage's bytes, by offset from the storage's first byte."""

    def __init__(self, read: Callable[[int, int], bytes], size: int, where: str) -> None:
        self._read, self.size, self._where = read, size, where

    def read(self, offset: int, size: int) -> bytes:
        if offset < 0 or offset + size > self.size:
            raise BadInputError(f"{self._where}: a view reads outside its storage")
        data = self._read(offset, size)
        if len(data) != size:
            raise BadInputError(f"{self._where}: the file ended inside tensor data (truncated while being read?)")
        return data


def _reader(t: TensorRef, files: OpenFiles) -> _Reader:
    import os

    storage = t.storage
    source = storage.source
    if source is None:
        raise BadInputError(f"storage {storage.key!r:.40} has no source bytes to read")
    if is_plain_range(source):
        f = files.file(source.path)
        if isinstance(f, RangeSource):  # a remote object: the same reads, as ranged requests
            return _Reader(lambda off, size: f.pread(size, source.offset + off), source.size, source.path)
        fd = f.fileno()
        return _Reader(lambda off, size: os.pread(fd, size, source.offset + off), source.size, source.path)
    data = read_all(source, files)  # compressed or computed: this one storage in memory
    return _Reader(lambda off, size: data[off : off + size], len(data), f"storage {storage.key!r:.40}")


def _swapped(raw: bytes, unit: int) -> Any:
    """``raw`` (a whole number of units) with each unit's bytes reversed, as a uint8 array."""
    import numpy as np

    return np.ascontiguousarray(np.frombuffer(raw, dtype=np.uint8).reshape(-1, unit)[:, ::-1]).reshape(-1)


def _read_span(reader: _Reader, start: int, size: int, unit: int) -> tuple[Any, int]:
    """``size`` bytes of the storage from ``start`` as a uint8 array, swapped when
    ``unit`` says so, and the index of ``start`` in it (a swap reads whole units)."""
    import numpy as np

    if not unit:
        return np.frombuffer(reader.read(start, size), dtype=np.uint8), 0  # read-only: only read from
    lo = start - start % unit
    hi = start + size + (-(start + size) % unit)
    return _swapped(reader.read(lo, hi - lo), unit), start - lo


def _element(itemsize: int) -> Any:
    """A numpy dtype of ``itemsize`` opaque bytes: copies move whole elements, not bytes."""
    import numpy as np

    return np.dtype(f"u{itemsize}") if itemsize in (1, 2, 4, 8) else np.dtype(f"V{itemsize}")


def _strided(flat: Any, at: int, shape: tuple[int, ...], byte_strides: tuple[int, ...], itemsize: int) -> Any:
    import numpy as np

    return np.ndarray(shape, dtype=_element(itemsize), buffer=flat, offset=at, strides=byte_strides)


def _chunks(view: Any, chunk: int) -> Iterator[bytes]:
    """``view`` (an array of whole elements) in C order, in pieces of at most ``chunk`` bytes:
    runs of indices along the first dimension whose one index fits (leading dimensions before
    it taken one index at a time). The boundaries depend only on the shape and item size, so
    two tensors of one shape are cut alike."""
    import itertools

    import numpy as np

    shape = view.shape
    if not shape:
        yield view.tobytes()
        return
    chunk = max(1, chunk // view.itemsize)  # in elements
    k, row = 0, view.size // shape[0]
    while k < len(shape) - 1 and row > chunk:
        k += 1
        row //= shape[k]
    step = max(1, chunk // max(row, 1))
    for lead in itertools.product(*(range(n) for n in shape[:k])):
        block = view[lead]
        for first in range(0, shape[k], step):
            yield np.ascontiguousarray(block[first : first + step]).tobytes()


def _fill(
    out: Any, reader: _Reader, start: int, shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int, unit: int
) -> None:
    """Gather the view at byte ``start`` into ``out`` (C order, whole elements), reading
    at most :data:`SPAN_LIMIT` bytes at a time: split along the widest stride until a piece fits."""
    pending = [(out, start, shape)]
    while pending:
        target, at, dims = pending.pop()
        span = _extent(dims, strides, itemsize)
        if span <= SPAN_LIMIT or all(n == 1 for n in dims):
            flat, first_byte = _read_span(reader, at, span, unit)
            target[...] = _strided(flat, first_byte, dims, strides, itemsize)
            continue
        dim = max((d for d in range(len(dims)) if dims[d] > 1), key=lambda d: strides[d])
        step = strides[dim]
        inner = span - (dims[dim] - 1) * step  # the span of one index along dim
        count = max(1, (SPAN_LIMIT - inner) // step + 1) if inner <= SPAN_LIMIT else 1
        for first in range(0, dims[dim], count):
            n = min(count, dims[dim] - first)
            index = (slice(None),) * dim + (slice(first, first + n),)
            pending.append((target[index], at + first * step, dims[:dim] + (n,) + dims[dim + 1 :]))


def tensor_c_chunks(t: TensorRef | torch.Tensor, files: OpenFiles, chunk: int = GATHER_CHUNK) -> Iterator[bytes]:
    """One tensor's elements in C order, little-endian (the bytes safetensors stores), in pieces
    of at most ``chunk`` bytes (see the module docstring): a range copy when the view is
    contiguous and needs no swap, a gather otherwise. Works for real torch tensors too."""
    import numpy as np

    from .refs import TensorRef

    if not isinstance(t, TensorRef):
        yield _torch_bytes(t)
        return
    itemsize = DTYPE_ITEMSIZE[t.dtype]
    if t.numel == 0:
        return
    start = t.storage_offset * itemsize
    unit = storage_swap_unit(t.storage)
    source = t.storage.source
    if not unit and is_plain_range(source) and is_c_contiguous(t.shape, t.stride):
        yield from iter_chunks(source.sub(start, t.nbytes), files)
        return
    reader = _reader(t, files)
    strides = tuple(s * itemsize for s in t.stride)
    span = _extent(t.shape, strides, itemsize)
    if span <= SPAN_LIMIT:
        flat, at = _read_span(reader, start, span, unit)
        yield from _chunks(_strided(flat, at, t.shape, strides, itemsize), chunk)
        return
    shape = t.shape
    inner = _extent(shape[1:], strides[1:], itemsize)  # one index along the first dimension
    if strides[0] == max(strides) and inner <= SPAN_LIMIT:
        # rows in storage order (a big contiguous tensor to swap, a slice of a wide matrix):
        # runs of rows read one span at a time, so memory stays at a span and a chunk
        rows = max(1, (SPAN_LIMIT - inner) // max(strides[0], 1) + 1)
        for first in range(0, shape[0], rows):
            n = min(rows, shape[0] - first)
            flat, at = _read_span(reader, start + first * strides[0], (n - 1) * strides[0] + inner, unit)
            yield from _chunks(_strided(flat, at, (n, *shape[1:]), strides, itemsize), chunk)
        return
    out = np.empty(shape, dtype=_element(itemsize))  # a big tensor stored permuted: its own size
    _fill(out, reader, start, shape, strides, itemsize, unit)
    yield from _chunks(out, chunk)


def storage_span_chunks(t: TensorRef, files: OpenFiles, chunk: int = GATHER_CHUNK) -> Iterator[bytes] | None:
    """The storage bytes ``t`` spans, from its first element to one past its last, as torch sees
    them (swapped), in pieces; None for an empty tensor. Two views of one shape, dtype and
    stride whose spans are equal hold equal elements, however far they expand the storage."""
    itemsize = DTYPE_ITEMSIZE[t.dtype]
    if t.numel == 0:
        return None
    start = t.storage_offset * itemsize
    size = _extent(t.shape, tuple(s * itemsize for s in t.stride), itemsize)
    unit = storage_swap_unit(t.storage)
    source = t.storage.source
    if not unit and is_plain_range(source):
        return iter_chunks(source.sub(start, size), files)
    reader = _reader(t, files)

    def pieces() -> Iterator[bytes]:
        for at in range(start, start + size, chunk):
            n = min(chunk, start + size - at)
            flat, first = _read_span(reader, at, n, unit)
            yield flat[first : first + n].tobytes()

    return pieces()


def _torch_bytes(t: Any) -> bytes:
    need_torch()
    import torch

    flat = t.detach().cpu().contiguous().reshape(-1)
    if flat.is_quantized:
        flat = flat.int_repr()
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def tensor_c_bytes(t: TensorRef | torch.Tensor, files: OpenFiles) -> bytes:
    """One tensor's elements in C order, little-endian, in one piece (:func:`tensor_c_chunks`)."""
    return b"".join(tensor_c_chunks(t, files))
