"""Compact storages: write only the bytes tensors still reference.

``torch.save`` of a small view writes its whole storage, and dropping tensors (the optimizer,
``--drop``, ``--select`` of one view) can leave a storage mostly unreferenced. Before a .pth is
written, every storage whose tensors cover less than all of it is cut down to the span they
use; the tensors' offsets move with it, and tensors that shared the storage still share the
(smaller) one. Storages also reached in other ways (inside recorded calls such as sparse
tensors) are left whole, since their use cannot be measured.
"""

from __future__ import annotations

import math
from dataclasses import replace

from ..fileio.ranges import ComputedSource, OpenFiles, is_plain_range, read_all
from ..model.dtypes import DTYPE_ITEMSIZE
from ..model.refs import Source, StorageRef, TensorRef, Tree
from ..model.walk import substitute, walk
from ..pickling.writer import PickleResult, dumps, dumps_whole


def _extent(t: TensorRef) -> int:
    """Elements from the tensor's first to one past its last (0 for an empty tensor)."""
    shape = t.shape
    if len(shape) == 1 and t.stride[0] == 1:
        return shape[0]  # the usual small tensor (a bias, an optimizer moment)
    if 0 in shape:
        return 0
    return sum((n - 1) * s for n, s in zip(shape, t.stride)) + 1


def _slice_source(source: Source, start: int, length: int) -> Source:
    if is_plain_range(source):
        return source.sub(start, length)

    def produce(files: OpenFiles) -> bytes:
        return read_all(source, files)[start : start + length]

    return ComputedSource(length, produce)


def compact_storages(root: Tree) -> tuple[Tree, int]:
    """A copy of ``root`` whose storages hold only referenced bytes; returns it and the bytes saved."""
    users: dict[int, list[TensorRef]] = {}  # storages no tensor uses whole, and their tensors
    whole: set[int] = set()  # storages some tensor spans from first byte to last
    opaque: set[int] = set()
    storages: dict[int, StorageRef] = {}
    for _, leaf in walk(root):
        kind = type(leaf)
        if kind is TensorRef:
            storage = leaf.storage
            storage_id = id(storage)
            if storage_id in whole:
                continue
            if leaf.storage_offset == 0 and _extent(leaf) * DTYPE_ITEMSIZE[leaf.dtype] >= storage.nbytes:
                whole.add(storage_id)  # the usual case: nothing to cut, whoever else uses it
                continue
            users.setdefault(storage_id, []).append(leaf)
            storages[storage_id] = storage
        elif kind is StorageRef:
            opaque.add(id(leaf))  # a storage pickled on its own: its bytes are kept whole
    for storage_id in whole.intersection(users):
        del users[storage_id]
    replacements: dict[int, Tree] = {}
    saved = 0
    for storage_id, tensors in users.items():
        storage = storages[storage_id]
        if storage_id in opaque or storage.source is None or len({t.dtype for t in tensors}) != 1:
            continue
        itemsize = DTYPE_ITEMSIZE[tensors[0].dtype]
        used = [t for t in tensors if _extent(t)]
        if not used:
            start_b = end_b = 0
        else:
            start_b = min(t.storage_offset for t in used) * itemsize
            end_b = max(t.storage_offset + _extent(t) for t in used) * itemsize
        # the cut keeps whole elements of both the tensors' dtype and the storage's type: a
        # float32 view of part of a double keeps that whole double (rounding the end down
        # would leave a record torch refuses, or no element at all)
        unit = math.lcm(itemsize, storage.itemsize)
        start_b -= start_b % unit
        end_b = min(end_b + -end_b % storage.itemsize, storage.nbytes)
        if start_b == 0 and end_b >= storage.nbytes:
            continue
        source = _slice_source(storage.source, start_b, end_b - start_b)
        new_storage = replace(storage, numel=(end_b - start_b) // storage.itemsize, source=source)
        replacements[storage_id] = new_storage
        saved += storage.nbytes - new_storage.nbytes
        shift = start_b // itemsize
        for tensor in tensors:
            if id(tensor) not in replacements:
                offset = tensor.storage_offset - shift if _extent(tensor) else 0
                replacements[id(tensor)] = replace(tensor, storage=new_storage, storage_offset=offset)
    return (substitute(root, replacements) if replacements else root), saved


def pickle_compacted(root: Tree) -> PickleResult:
    """``root`` with its storages compacted (:func:`compact_storages`), pickled (``dumps``).

    With the native engine the emitter says, from the tensors it reads anyway, whether every
    storage is spanned whole by one of its tensors -- the usual case, where compaction has
    nothing to cut -- so the tree is not walked in Python once per tensor to find that out.
    Otherwise :func:`compact_storages` runs (the reference), and the pickle already made is
    kept when it cut nothing."""
    native = dumps_whole(root)
    if native is not None and native[1]:
        return native[0]
    compacted, _ = compact_storages(root)
    if native is not None and compacted is root:
        return native[0]
    return dumps(compacted)
