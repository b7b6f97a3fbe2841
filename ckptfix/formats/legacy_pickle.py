"""torch's legacy format (``_use_new_zipfile_serialization=False``), read without torch.

Many weights shipped inside pip packages are in this format. Its layout is a run of pickles
followed by raw storages::

    pickle: magic number 0x1950a86a20f9469cfc6c
    pickle: protocol version 1001
    pickle: sys_info {"protocol_version", "little_endian", "type_sizes"}
    pickle: the object tree; storages are persistent ids
            ("storage", StorageType, root_key, location, numel, view_metadata)
    pickle: the sorted list of storage keys
    then, per key in that order: int64 element count (little-endian), then the raw bytes
    (always little-endian on disk: torch swaps when saving on a big-endian machine)

All pickles go through the same restricted unpickler as the zip format, so this path is as
safe as that one, needs no torch, and copies tensor bytes straight from the file.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from typing import Any, BinaryIO, NamedTuple

from ..errors import BadInputError, UnsafeInputError
from ..fileio.ranges import FileRange
from ..model.refs import Global, StorageRef, Tree, make_storage
from ..model.walk import check_extents
from ..pickling.reader import restricted_load
from ..pickling.vm import Budgets, TruncatedPickleError
from .torchzip import MAX_PICKLE_BYTES

MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
PROTOCOL_VERSION = 1001

#: the first read of the file's head: where the pickles of most legacy files end
_FIRST_READ = 1 << 20


def _one_key_space(path: str, key: str) -> BadInputError:
    """torch keeps storages and views in one table by key: a name used for both would make torch
    read one where we read the other."""
    return BadInputError(
        f"{path}: storage key {key!r:.40} names both a storage and a view of another storage (torch would "
        "read one in place of the other); refusing"
    )


def read_legacy(
    path: str,
    f: BinaryIO,
    file_size: int,
    globals_seen: set[str],
    allow: Sequence[str] = (),
    *,
    inert_unknown: bool = False,
) -> Tree:
    """Parse a legacy torch file into a tree of lazy references (no tensor data is read).

    The pickles are read from a copy of the file's head, taken with ``pread`` -- never a memory
    map, which SIGBUSes when another process shrinks the file while it is read. Where they end is
    known only once they are read, so the head starts at 1 MiB and doubles while the pickles run
    past it, up to the pickle budget the zip format has (:data:`MAX_PICKLE_BYTES`): work and
    memory stay within twice the pickles' size. The budgets are the whole file's, as before. The
    storages' byte ranges are known only after the last pickle, so every tensor and view extent
    is checked then, against the real bytes (:func:`check_extents`).
    """
    if file_size == 0:
        raise BadInputError(f"{path}: an empty file")
    fd = f.fileno()
    cap = min(file_size, MAX_PICKLE_BYTES + _FIRST_READ)
    size = min(file_size, _FIRST_READ)
    while True:
        head = _pread(fd, size, 0)
        try:
            pickles = _read_pickles(path, head, file_size, globals_seen, allow, inert_unknown)
            break
        except TruncatedPickleError:
            # the pickles run past the head read so far: read on (any other refusal is final: a
            # pickle that is wrong within the head fails the same way on a longer one, and
            # reading on would cost up to the budget's memory for nothing)
            if len(head) < size or size >= cap:  # the whole file (or the budget) was read
                raise
            size = min(size * 2, cap)
    del head
    return _attach_storages(path, fd, file_size, pickles)


def _pread(fd: int, size: int, offset: int) -> bytes:
    """``size`` bytes at ``offset``, fewer where the file ends first (it may shrink meanwhile)."""
    parts, got = [], 0
    while got < size:
        part = os.pread(fd, size - got, offset + got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


class _Pickles(NamedTuple):
    """What the pickles say: the tree, the storage keys in file order and where their data
    starts, and the storages and views the tree named."""

    tree: Tree
    keys: list[str]
    offset: int
    roots: dict[str, StorageRef]
    views: dict[str, tuple[StorageRef, StorageRef, int]]


def _read_pickles(
    path: str,
    data: bytes,
    file_size: int,
    globals_seen: set[str],
    allow: Sequence[str],
    inert_unknown: bool,
) -> _Pickles:
    budgets = Budgets.for_length(file_size)
    magic, pos = restricted_load(data, None, budgets=budgets)
    if type(magic) is not int or magic != MAGIC_NUMBER:
        raise BadInputError(f"{path}: not a legacy torch checkpoint (bad magic number)")
    version, pos = restricted_load(data, None, start=pos, budgets=budgets)
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise BadInputError(f"{path}: unsupported legacy torch protocol version")
    sys_info, pos = restricted_load(data, None, start=pos, budgets=budgets)
    if not isinstance(sys_info, dict):
        raise BadInputError(f"{path}: corrupt legacy checkpoint header")
    roots: dict[str, StorageRef] = {}
    views: dict[str, tuple[StorageRef, StorageRef, int]] = {}

    def load_storage(storage_type: Global, key: str, location: str, numel: int, view: Any) -> StorageRef:
        if key in views:
            raise _one_key_space(path, key)
        root = roots.get(key)
        if root is None:
            root = roots[key] = make_storage(storage_type, key, location, numel, None)
        elif root.numel == 0 and view is None:
            # as torch: the first use decides the type and size, but an empty first one is not
            # kept -- each later use gets a new empty storage of its own type (torch checks its
            # data pointer, which is null for an empty storage)
            return make_storage(storage_type, key, location, 0, FileRange(path, 0, 0))
        if view is None:
            return root
        if not (
            type(view) is tuple
            and len(view) == 3
            and type(view[1]) is int
            and type(view[2]) is int
            and type(view[0]) in (str, bytes)
            and view[1] >= 0
            and view[2] >= 0
        ):
            raise BadInputError(f"{path}: corrupt storage view in a persistent id")
        view_key = view[0] if type(view[0]) is str else view[0].decode("ascii", "replace")
        if view_key in roots:
            raise _one_key_space(path, view_key)
        if view_key not in views:
            # as torch: offset and size count elements of the view's own dtype
            storage = make_storage(storage_type, view_key, location, view[2], None)
            views[view_key] = (storage, root, view[1] * storage.itemsize)
        return views[view_key][0]

    try:
        tree, pos = restricted_load(
            data,
            load_storage,
            globals_seen,
            allow,
            start=pos,
            budgets=budgets,
            check_depth=False,
            inert_unknown=inert_unknown,
        )
    except UnsafeInputError as exc:
        raise exc.at(path) from None
    keys, offset = restricted_load(data, None, start=pos, budgets=budgets)
    if type(keys) is not list or not all(type(k) is str for k in keys):
        raise BadInputError(f"{path}: corrupt legacy checkpoint (bad storage key list)")
    return _Pickles(tree, keys, offset, roots, views)


def _attach_storages(path: str, fd: int, file_size: int, pickles: _Pickles) -> Tree:
    """Each storage's bytes, after the pickles: an int64 count then the data, in key order."""
    tree, keys, offset, roots, views = pickles
    sources: dict[str, FileRange] = {}
    for key in keys:
        storage = roots.get(key)
        if storage is None:
            raise BadInputError(f"{path}: storage {key!r:.40} is listed but no tensor uses it")
        if key in sources:
            raise BadInputError(f"{path}: storage {key!r:.40} is listed twice")
        counted = _pread(fd, 8, offset) if offset + 8 <= file_size else b""
        if len(counted) < 8:  # the file ends there, or has shrunk since it was opened
            raise BadInputError(f"{path}: the file ends before storage {key!r:.40}: truncated")
        (count,) = struct.unpack("<q", counted)
        size = count * storage.itemsize
        if count != storage.numel or offset + 8 + size > file_size:
            raise BadInputError(
                f"{path}: storage {key!r:.40} holds {count} elements where {storage.numel} are declared, "
                "or runs past the end of the file: truncated or corrupt"
            )
        sources[key] = FileRange(path, offset + 8, size)
        storage.source = sources[key]
        offset += 8 + size
    missing = [k for k in roots if k not in sources]
    if missing:
        raise BadInputError(f"{path}: storage {missing[0]!r:.40} is used but its data is missing: truncated or corrupt")
    for view_key, (storage, root, start) in views.items():
        if start + storage.nbytes > root.nbytes:
            raise BadInputError(
                f"{path}: storage view {view_key!r:.40} ({storage.nbytes} bytes at byte {start}) lies outside "
                f"its storage {root.key!r:.40} ({root.nbytes} bytes); torch refuses it too"
            )
        storage.source = sources[root.key].sub(start, storage.nbytes)  # root.source, as a FileRange
    check_extents(tree, path)
    return tree
