"""Zip records of a remote object whose data offsets are learnt when their data is read.

Its own module because both sides use it: the zip reader (through
:mod:`~ckptfix.fileio.ranges`, which names what a ranged source does) and the remote file
(:mod:`~ckptfix.fileio.remote`, which the ranges module opens lazily: neither may import the other).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

__all__ = ["VIRTUAL", "DeferredRecords"]

#: where a remote zip's tensor records are addressed until their local headers are read (with
#: their data, in the same ranged requests: see :meth:`RangeSource.defer`): ``VIRTUAL +
#: header_offset + i`` is byte ``i`` of the record's data. Far past any real object, and each
#: record's addresses lie below the next record's (a header is at least 30 bytes)
VIRTUAL = 1 << 60


class DeferredRecords(Protocol):
    """Records of a remote archive whose data offsets are not known yet (their local headers,
    which say where the data starts, are read together with the data: not one request each
    before it). Implemented by the zip reader, which alone knows how to check a header."""

    def find(self, offset: int) -> tuple[int, int]:
        """(the record holding the address ``offset`` >= :data:`VIRTUAL`, the offset within its data)."""
        ...

    def span(self, index: int) -> tuple[int, int, int]:
        """(its local header's offset, the header's least length, where the next record starts):
        its header and data lie in ``[header, next)``, or the archive is refused."""
        ...

    def resolve(self, index: int, read: Callable[[int, int], bytes]) -> int:
        """Its data offset, once its local header (read by ``read(offset, size)``) agrees with
        the zip directory and its data ends before the next record; else :class:`BadInputError`."""
        ...
