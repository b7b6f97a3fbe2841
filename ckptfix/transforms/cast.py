"""``--dtype``: cast the floating-point tensors of state dicts, storage by storage.

What is cast: tensors of dtype float16, bfloat16, float32 or float64 inside state-dict-like
mappings (all of them, or those under ``--key``). Integers, bools (``num_batches_tracked``),
complex and float8 tensors, optimizer state and loose tensors elsewhere in a training
checkpoint are left alone, as are keys matching a ``--dtype-keep`` glob.

How: a storage is cast as a whole, so tensors that share it (tied weights, views) keep sharing
it, with the same offsets, shapes and strides. A storage also used by a tensor that must not be
cast is left alone, and the report says so. The cast itself runs in numpy, without torch
(:mod:`ckptfix.model.numeric`), one storage at a time while the output is written: values are
bitwise what ``tensor.to(dtype)`` gives, and memory stays at one storage's worth.

With the native engine, small storages (a training checkpoint's ~50 000 parameters) are cast in
batches (:class:`_CastBatch`): when the writer asks for the first storage of a batch, the
library reads all of the batch's source ranges in one call and casts them in one more
(``ckptfix/native/cast.py``: the same bytes as numpy's cast, element for element); the others
are then slices of that. Memory stays at one batch's worth (:data:`BATCH_BYTES`).
"""

from __future__ import annotations

import fnmatch
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import BadInputError, UsageError
from ..fileio.ranges import SMALL_COPY, ComputedSource, FileRange, OpenFiles, is_local_range, read_all
from ..model.data import storage_swap_unit
from ..model.dtypes import CAST_ALIASES, CASTABLE, DTYPE_ITEMSIZE, DTYPE_STORAGE
from ..model.paths import format_path
from ..model.refs import Global, StorageRef, TensorRef
from ..model.walk import census, substitute
from ..native import cast as native_cast
from .prefix import select_state_dicts


@dataclass
class CastReport:
    dtype: str
    tensors: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    kept: list[str] = field(default_factory=list)
    shared_with_uncast: list[str] = field(default_factory=list)


def _cast_bytes(storage: StorageRef, target: str, files: OpenFiles) -> bytes:
    import numpy as np

    from ..model.numeric import cast_float_bytes

    if storage.source is None:
        raise BadInputError(f"storage {storage.key!r:.40} has no source bytes to cast")
    raw = read_all(storage.source, files)
    unit = storage_swap_unit(storage)  # as torch: by the storage's own type
    if unit:
        raw = np.frombuffer(raw, dtype=np.uint8).reshape(-1, unit)[:, ::-1].tobytes()
    if not raw:
        return b""
    return cast_float_bytes(raw, storage.dtype, target)


#: the most source bytes one native batch reads and casts at once (and storages in it)
BATCH_BYTES = 1 << 22
BATCH_COUNT = 8192


class _CastBatch:
    """Small storages of one file, dtype and byte order, cast together on the first request.

    ``produce(i, files)`` gives storage ``i``'s cast bytes: the first call reads every member's
    range (one native call) and casts them all (one more), the rest slice the result; it is
    dropped once every member has been asked for. Where the library declines (a range not all
    in the file), each storage is cast by :func:`_cast_bytes`, which raises the reference's error.

    Members are counted, not requests: a safetensors output writes each view of a storage in
    full, so a storage split into views (a fused qkv weight) is asked for once per view; the
    member that completed the batch is kept (its views come one after another), so its later
    views do not cast the batch again.
    """

    __slots__ = (
        "_asked",
        "_blob",
        "_declined",
        "_ends",
        "_last",
        "_left",
        "_offsets",
        "_sizes",
        "_total",
        "storages",
        "target",
    )

    def __init__(self, target: str) -> None:
        self.storages: list[StorageRef] = []
        self.target = target
        self._offsets = array("Q")
        self._sizes = array("Q")
        self._total = 0
        self._blob: bytes | None = None
        self._ends: list[int] = []
        self._left = 0
        #: which members have had their bytes from the current blob
        self._asked = bytearray()
        #: the member whose request freed the blob, and its bytes
        self._last: tuple[int, bytes] | None = None
        self._declined = False

    def add(self, storage: StorageRef, source: FileRange) -> int:
        self.storages.append(storage)
        self._offsets.append(source.offset)
        self._sizes.append(source.size)
        self._total += source.size
        return len(self.storages) - 1

    def full(self) -> bool:
        return len(self.storages) >= BATCH_COUNT or self._total >= BATCH_BYTES

    def produce(self, i: int, files: OpenFiles) -> bytes:
        if self._declined:
            return _cast_bytes(self.storages[i], self.target, files)
        if self._blob is None and self._last is not None and self._last[0] == i:
            return self._last[1]
        if self._blob is None:
            self._blob = self._cast_all(files)
            if self._blob is None:  # asked once: each member is then read by the reference
                self._declined = True
                return _cast_bytes(self.storages[i], self.target, files)
            self._left = len(self.storages)
            self._asked = bytearray(self._left)
        blob, ends = self._blob, self._ends
        start = ends[i - 1] if i else 0
        data = blob[start : ends[i]]
        if not self._asked[i]:
            self._asked[i] = 1
            self._left -= 1
        if self._left <= 0:  # every member asked for: free the batch (asked again: cast again)
            self._blob, self._last = None, (i, data)
        return data

    def _cast_all(self, files: OpenFiles) -> bytes | None:
        first = self.storages[0]
        assert isinstance(first.source, FileRange)
        raw = native_cast.gather(files.file(first.source.path).fileno(), self._offsets, self._sizes)
        if raw is None:
            return None
        out = native_cast.cast_floats(raw, first.dtype, self.target, swap=bool(storage_swap_unit(first)))
        if out is None:
            return None
        scale = DTYPE_ITEMSIZE[self.target]
        unit = first.itemsize
        total = 0
        ends = []
        for size in self._sizes:
            total += size // unit * scale
            ends.append(total)
        self._ends = ends
        return out


def _batchable(storage: StorageRef) -> FileRange | None:
    """The storage's source, when the native batch cast can take it: a plain range of a local
    file, small, holding exactly the storage's bytes."""
    source = storage.source
    if not is_local_range(source) or source.size >= SMALL_COPY or source.size != storage.nbytes:
        return None
    return source


def _retyped(tensor: TensorRef, storage: StorageRef, dtype: str) -> TensorRef:
    """``dataclasses.replace(tensor, storage=storage, dtype=dtype, rebuild="v2",
    dtype_global=None)``, field by field: ``replace`` costs ~5x more, once per cast tensor
    (a test checks that these are all of TensorRef's fields)."""
    return TensorRef(
        storage,
        tensor.storage_offset,
        tensor.shape,
        tensor.stride,
        dtype,
        tensor.requires_grad,
        tensor.hooks,
        "v2",
        None,
        tensor.metadata,
        tensor.param,
    )


#: the fields :func:`_retyped` passes, in order
RETYPED_FIELDS = (
    "storage",
    "storage_offset",
    "shape",
    "stride",
    "dtype",
    "requires_grad",
    "hooks",
    "rebuild",
    "dtype_global",
    "metadata",
    "param",
)


def _cast_storage(
    storage: StorageRef, target: str, storage_type: Global, batches: dict[tuple[str, str, int], _CastBatch] | None
) -> StorageRef:
    itemsize = DTYPE_ITEMSIZE[target]
    size = storage.numel * itemsize
    source = _batchable(storage) if batches is not None else None
    if source is None or batches is None:
        computed = ComputedSource(size, lambda files: _cast_bytes(storage, target, files))
    else:
        key = (source.path, storage.dtype, storage_swap_unit(storage))
        batch = batches.get(key)
        if batch is None or batch.full():
            batch = batches[key] = _CastBatch(target)
        i = batch.add(storage, source)
        computed = ComputedSource(size, lambda files: batch.produce(i, files))
    return StorageRef(
        key=storage.key,
        storage_type=storage_type,
        location=storage.location,
        numel=storage.numel,
        itemsize=itemsize,
        dtype=target,
        source=computed,
    )


def cast_floats(root: Any, dtype: str, keep: Sequence[str] = (), keys: Sequence[str] = ()) -> tuple[Any, CastReport]:
    """A copy of ``root`` whose state dicts' floating tensors are ``dtype`` (a name in
    :data:`CASTABLE` or an alias such as ``fp16``/``bf16``/``half``); plus what changed."""
    dtype = CAST_ALIASES.get(dtype, dtype)
    if dtype not in CASTABLE:
        raise UsageError(f"--dtype {dtype}: choose one of {', '.join([*CASTABLE, *CAST_ALIASES])}")
    report = CastReport(dtype)
    wanted: dict[int, TensorRef] = {}
    names: dict[int, str] = {}
    kept_ids: set[int] = set()
    for path, state_dict in select_state_dicts(root, keys):
        prefix = format_path(path)
        for name, value in state_dict.items():
            if not isinstance(value, TensorRef) or value.dtype not in CASTABLE or value.dtype == dtype:
                continue
            full = f"{prefix}.{name}" if prefix else name
            if keep and any(fnmatch.fnmatchcase(name, g) or fnmatch.fnmatchcase(full, g) for g in keep):
                report.kept.append(full)
                kept_ids.add(id(value))
                continue
            wanted[id(value)] = value
            names.setdefault(id(value), full)
    for same in kept_ids.intersection(wanted):  # one tensor object under a kept and a cast name
        report.shared_with_uncast.append(names[same])
        del wanted[same]
    users: dict[int, list[TensorRef]] = {}
    for tensor in census(root).tensors:
        users.setdefault(id(tensor.storage), []).append(tensor)
    replacements: dict[int, Any] = {}
    batches: dict[tuple[str, str, int], _CastBatch] | None = {} if native_cast.available() else None
    target = Global("torch", DTYPE_STORAGE[dtype])
    for storage_id, tensors in users.items():
        if len(tensors) == 1:  # the common case, without the generators below
            if id(tensors[0]) not in wanted:
                continue
        else:
            inside = [id(t) in wanted for t in tensors]
            if not any(inside):
                continue
            if not all(inside):
                report.shared_with_uncast += list(dict.fromkeys(names[id(t)] for t in tensors if id(t) in wanted))
                continue
        storage = tensors[0].storage
        new_storage = _cast_storage(storage, dtype, target, batches)
        replacements[storage_id] = new_storage
        report.bytes_before += storage.nbytes
        report.bytes_after += new_storage.nbytes
        for tensor in tensors:
            if id(tensor) not in replacements:
                replacements[id(tensor)] = _retyped(tensor, new_storage, dtype)
                report.tensors += 1
    return (substitute(root, replacements) if replacements else root), report
