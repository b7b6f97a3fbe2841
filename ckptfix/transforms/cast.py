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
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import BadInputError, UsageError
from ..fileio.ranges import ComputedSource, OpenFiles, read_all
from ..model.data import storage_swap_unit
from ..model.dtypes import CAST_ALIASES, CASTABLE, DTYPE_ITEMSIZE, DTYPE_STORAGE
from ..model.paths import format_path
from ..model.refs import Global, StorageRef, TensorRef
from ..model.walk import census, substitute
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


def _cast_storage(storage: StorageRef, target: str) -> StorageRef:
    itemsize = DTYPE_ITEMSIZE[target]
    return StorageRef(
        key=storage.key,
        storage_type=Global("torch", DTYPE_STORAGE[target]),
        location=storage.location,
        numel=storage.numel,
        itemsize=itemsize,
        dtype=target,
        source=ComputedSource(storage.numel * itemsize, lambda files: _cast_bytes(storage, target, files)),
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
            if any(fnmatch.fnmatchcase(name, g) or fnmatch.fnmatchcase(full, g) for g in keep):
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
    for storage_id, tensors in users.items():
        if not any(id(t) in wanted for t in tensors):
            continue
        if not all(id(t) in wanted for t in tensors):
            report.shared_with_uncast += list(dict.fromkeys(names[id(t)] for t in tensors if id(t) in wanted))
            continue
        storage = tensors[0].storage
        new_storage = _cast_storage(storage, dtype)
        replacements[storage_id] = new_storage
        report.bytes_before += storage.nbytes
        report.bytes_after += new_storage.nbytes
        for tensor in tensors:
            if id(tensor) not in replacements:
                replacements[id(tensor)] = replace(
                    tensor, storage=new_storage, dtype=dtype, rebuild="v2", dtype_global=None
                )
                report.tensors += 1
    return (substitute(root, replacements) if replacements else root), report
