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

import struct
from collections.abc import Sequence
from typing import Any, BinaryIO

from ..errors import BadInputError, UnsafeInputError
from ..sources import FileRange
from ..tree import Global, StorageRef, make_storage
from ..unpickle import restricted_load

MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
PROTOCOL_VERSION = 1001


def read_legacy(path: str, f: BinaryIO, file_size: int, globals_seen: set[str], allow: Sequence[str] = ()) -> Any:
    """Parse a legacy torch file into a tree of lazy references (no tensor data is read)."""
    f.seek(0)
    if restricted_load(f, None) != MAGIC_NUMBER:
        raise BadInputError(f"{path}: not a legacy torch checkpoint (bad magic number)")
    if restricted_load(f, None) != PROTOCOL_VERSION:
        raise BadInputError(f"{path}: unsupported legacy torch protocol version")
    sys_info = restricted_load(f, None)
    if not isinstance(sys_info, dict):
        raise BadInputError(f"{path}: corrupt legacy checkpoint header")
    roots: dict[str, StorageRef] = {}
    views: dict[str, tuple[StorageRef, StorageRef, int]] = {}

    def load_storage(storage_type: Global, key: str, location: str, numel: int, view: Any) -> StorageRef:
        root = roots.get(key)
        if root is None:
            root = roots[key] = make_storage(storage_type, key, location, numel, None)
        if view is None:
            return root
        if not (isinstance(view, tuple) and len(view) == 3 and all(isinstance(v, (int, str)) for v in view)):
            raise BadInputError(f"{path}: corrupt storage view {view!r:.80}")
        view_key, offset, size = str(view[0]), view[1], view[2]
        if view_key not in views:
            if not (isinstance(offset, int) and isinstance(size, int) and offset >= 0 and offset + size <= numel):
                raise BadInputError(f"{path}: storage view {view_key!r} lies outside its storage")
            storage = make_storage(storage_type, view_key, location, size, None)
            views[view_key] = (storage, root, offset)
        return views[view_key][0]

    try:
        tree = restricted_load(f, load_storage, globals_seen, allow)
    except UnsafeInputError as exc:
        raise UnsafeInputError(exc.global_name, path) from None
    keys = restricted_load(f, None)
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise BadInputError(f"{path}: corrupt legacy checkpoint (bad storage key list)")
    offset = f.tell()
    for key in keys:
        storage = roots.get(key)
        if storage is None:
            raise BadInputError(f"{path}: storage {key!r} is listed but no tensor uses it")
        f.seek(offset)
        head = f.read(8)
        if len(head) < 8:
            raise BadInputError(f"{path}: the file ends before storage {key!r}: truncated")
        (count,) = struct.unpack("<q", head)
        size = count * storage.itemsize
        if count != storage.numel or offset + 8 + size > file_size:
            raise BadInputError(
                f"{path}: storage {key!r} holds {count} elements where {storage.numel} are declared, "
                "or runs past the end of the file: truncated or corrupt"
            )
        storage.source = FileRange(path, offset + 8, size)
        offset += 8 + size
    missing = [k for k, s in roots.items() if s.source is None]
    if missing:
        raise BadInputError(f"{path}: storage {missing[0]!r} is used but its data is missing: truncated or corrupt")
    for storage, root, start in views.values():
        storage.source = root.source.sub(start * root.itemsize, storage.nbytes)
    return tree
