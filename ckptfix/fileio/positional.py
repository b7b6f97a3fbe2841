"""A file read by positioned reads: the one piece a slice of a local file and a remote object share."""

from __future__ import annotations

import io


class PositionalFile(io.RawIOBase):
    """A read-only, seekable file whose every read is one positioned read, :meth:`pread`
    (a slice of a local file, a remote object): ``seek``/``tell``/``read`` once for both."""

    size: int
    _pos: int = 0

    def pread(self, size: int, offset: int) -> bytes:
        raise NotImplementedError

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        origin = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        self._pos = max(0, origin + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        left = max(0, self.size - self._pos)
        count = left if size is None or size < 0 else min(size, left)
        data = self.pread(count, self._pos)
        self._pos += len(data)
        return data
