"""How many bytes of a file share their blocks with another file, as the file system says.

On a copy-on-write file system a copy that shares extents costs no time and no space; this is
how ``--json`` tells that it happened (``shared_bytes``). Linux answers through the FIEMAP
ioctl, whose extents carry ``FIEMAP_EXTENT_SHARED`` (XFS, btrfs; ext4 and tmpfs never share).
Anywhere the question cannot be asked (another OS, a file system without FIEMAP, a file too
fragmented to count cheaply) the answer is None, "unknown" -- never an error: a write that
succeeded must not fail because of a statistic.
"""

from __future__ import annotations

import os
import struct
import sys
from typing import BinaryIO

#: ``_IOWR('f', 11, struct fiemap)``
FS_IOC_FIEMAP = 0xC020660B
FIEMAP_EXTENT_LAST = 0x0001
FIEMAP_EXTENT_SHARED = 0x2000
#: struct fiemap: fm_start, fm_length, fm_flags, fm_mapped_extents, fm_extent_count, fm_reserved
_FIEMAP = struct.Struct("=QQIIII")
#: struct fiemap_extent: fe_logical, fe_physical, fe_length, 2 reserved u64, fe_flags, 3 reserved u32
_EXTENT = struct.Struct("=QQQQQIIII")
#: extents asked for per call; a file copied by ckptfix has a handful (one per shared run)
_PER_CALL = 64
#: give up ("unknown") past this many calls: counting must stay cheap next to the write
_MAX_CALLS = 64


def shared_bytes(file: BinaryIO | int) -> int | None:
    """Bytes of ``file`` (an open file or descriptor) in extents shared with another file, or
    None where the platform cannot tell. A file object is flushed first (buffered bytes are not
    on disk, and could not be shared anyway). Delayed-allocation extents are counted as what
    they are, unshared, without forcing them to disk."""
    if sys.platform != "linux":
        return None
    import fcntl

    try:
        if not isinstance(file, int):
            file.flush()
            file = file.fileno()
        size = os.fstat(file).st_size
    except OSError:
        return None
    total, start = 0, 0
    for _ in range(_MAX_CALLS):
        request = bytearray(_FIEMAP.pack(start, (1 << 64) - 1 - start, 0, 0, _PER_CALL, 0))
        request += bytes(_EXTENT.size * _PER_CALL)
        try:
            fcntl.ioctl(file, FS_IOC_FIEMAP, request)
        except OSError:  # EOPNOTSUPP, ENOTTY (no FIEMAP here), EBADR ... : cannot tell
            return None
        mapped = _FIEMAP.unpack_from(request)[3]
        if mapped == 0:
            return total
        for i in range(mapped):
            logical, _, length, _, _, flags, _, _, _ = _EXTENT.unpack_from(request, _FIEMAP.size + i * _EXTENT.size)
            if flags & FIEMAP_EXTENT_SHARED:
                total += max(0, min(logical + length, size) - logical)
            if flags & FIEMAP_EXTENT_LAST:
                return total
            start = logical + length
    return None


def shared_bytes_of(paths: list[str]) -> int | None:
    """:func:`shared_bytes` summed over files; None if any of them cannot tell."""
    total = 0
    for path in paths:
        try:
            with open(path, "rb") as f:
                count = shared_bytes(f.fileno())
        except OSError:
            return None
        if count is None:
            return None
        total += count
    return total
