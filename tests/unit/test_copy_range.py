"""copy_range between offsets out of step modulo the block size (fileio/ranges.py).

The kernel's copy of such a range costs about twice a buffered one on a local file system (it
splices whole source pages, each landing across two destination pages), and no block can be
shared anyway, so it goes through a small buffer there -- but keeps the kernel's copy where that
is a server-side copy (NFS, SMB). In-step ranges keep the kernel's copy (test_cow.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from ckptfix.errors import BadInputError
from ckptfix.fileio import ranges
from ckptfix.fileio.ranges import BLOCK, SMALL_COPY, copy_range

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="file system types from /proc (Linux)")


def _kernel_copies(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    calls: list[tuple[int, int, int]] = []
    real = os.copy_file_range

    def recording(src: int, dst: int, count: int, offset_src: int, offset_dst: int) -> int:
        calls.append((count, offset_src, offset_dst))
        return real(src, dst, count, offset_src, offset_dst)

    monkeypatch.setattr(os, "copy_file_range", recording)
    return calls


def _copy(tmp_path: Path, src_offset: int, dst_offset: int, count: int) -> tuple[bytes, bytes]:
    data = os.urandom(src_offset + count + 100)
    (tmp_path / "src").write_bytes(data)
    with open(tmp_path / "src", "rb") as s, open(tmp_path / "dst", "wb") as d:
        copy_range(s.fileno(), src_offset, d.fileno(), dst_offset, count)
    return (tmp_path / "dst").read_bytes()[dst_offset:], data[src_offset : src_offset + count]


@linux_only
@pytest.mark.parametrize(
    ("src_offset", "dst_offset", "count"), [(100, 108, 700_001), (64, 0, SMALL_COPY), (5, 4095, 3 * 2**18)]
)
def test_out_of_step_ranges_go_through_a_buffer_on_a_local_file_system(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, src_offset: int, dst_offset: int, count: int
) -> None:
    assert ranges._file_system(os.stat(tmp_path).st_dev) in ranges._LOCAL_FILE_SYSTEMS, "tmp_path on a local disk"
    calls = _kernel_copies(monkeypatch)
    got, want = _copy(tmp_path, src_offset, dst_offset, count)
    assert got == want
    assert calls == []


@linux_only
def test_in_step_ranges_and_network_file_systems_keep_the_kernels_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _kernel_copies(monkeypatch)
    got, want = _copy(tmp_path, 100, 100 + 3 * BLOCK, 200_000)  # in step: may share blocks
    assert got == want and calls
    calls.clear()
    monkeypatch.setattr(ranges, "_file_system", lambda device: "nfs4")  # a server-side copy
    got, want = _copy(tmp_path, 100, 108, 200_000)
    assert got == want and calls


def test_a_source_that_ends_early_is_bad_input_in_the_buffered_copy(tmp_path: Path, monkeypatch: Any) -> None:
    (tmp_path / "src").write_bytes(os.urandom(SMALL_COPY + 10))
    monkeypatch.setattr(ranges, "_page_cache_copy", lambda src, dst: True)
    with (
        open(tmp_path / "src", "rb") as s,
        open(tmp_path / "dst", "wb") as d,
        pytest.raises(BadInputError, match="ended while its data was being copied"),
    ):
        copy_range(s.fileno(), 0, d.fileno(), 8, 2 * SMALL_COPY)


def test_the_bounce_buffer_keeps_both_copies_clear_of_4k_aliasing() -> None:
    """Source page -> buffer and buffer -> destination page: neither copy may have its
    destination fewer than 64 bytes after its source modulo the page (the slow case)."""
    for src in (0, 8, 64, 1344, 4088):
        for distance in range(BLOCK):
            dst = src + distance + 3 * BLOCK
            at = ranges._buffer_page_offset(src, dst)
            assert 0 <= at < BLOCK
            assert (at - src) % BLOCK >= ranges._NEAR, (src, dst, at)
            assert (dst - at) % BLOCK >= ranges._NEAR, (src, dst, at)


@linux_only
@pytest.mark.parametrize(("src_offset", "dst_offset"), [(8, 0), (0, 1344), (4032, 64)])
def test_the_out_of_step_copy_writes_from_a_buffer_placed_in_its_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, src_offset: int, dst_offset: int
) -> None:
    """Where malloc put the buffer (16 bytes into a page here) a source 8 bytes into its page
    copies at half speed; the buffer starts where :func:`_buffer_page_offset` says."""
    import ctypes

    starts: list[int] = []
    real = os.pwrite

    def recording(fd: int, data: Any, offset: int) -> int:
        view = memoryview(data)
        starts.append(ctypes.addressof(ctypes.c_char.from_buffer(view)) % BLOCK)
        view.release()
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", recording)
    # the Python loop (the native one places its buffer the same way: test_big_copies.py)
    monkeypatch.setattr(ranges, "native_copy_range", lambda *args: None)
    got, want = _copy(tmp_path, src_offset, dst_offset, 3 * ranges._BOUNCE + 5)
    assert got == want
    assert starts and set(starts) == {ranges._buffer_page_offset(src_offset, dst_offset)}


@linux_only
@pytest.mark.parametrize("file_system", ["ext4", "xfs"])
def test_a_copy_that_needs_a_crc_reads_its_source_once_where_nothing_can_be_shared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, file_system: str
) -> None:
    """ext4: through the buffer, the CRC computed on the way (no kernel copy, no worker's second
    read); a copy-on-write file system keeps the kernel's copy (it may share the blocks) and the
    worker's CRC. Same bytes and the same CRC either way."""
    import zlib

    from ckptfix.fileio.ranges import FileRange, OpenFiles, OutputStream

    monkeypatch.setattr(ranges, "_file_system", lambda device: file_system)
    calls = _kernel_copies(monkeypatch)
    background: list[object] = []
    real_background = OpenFiles.crc_in_background
    monkeypatch.setattr(
        OpenFiles, "crc_in_background", lambda self, source: background.append(source) or real_background(self, source)
    )
    data = os.urandom(3 * ranges._BOUNCE + 77)
    (tmp_path / "src").write_bytes(b"x" * 4 + data)  # in step with the output, after its 4-byte head
    with OpenFiles() as files, open(tmp_path / "dst", "wb") as out:
        stream = OutputStream(out)
        stream.write(b"head")
        crc = stream.copy(FileRange(str(tmp_path / "src"), 4, len(data)), files, want_crc=True)
        stream.write(b"tail")
        stream.flush()
    assert crc == zlib.crc32(data)
    assert (tmp_path / "dst").read_bytes() == b"head" + data + b"tail"
    assert (calls == [] and background == []) if file_system == "ext4" else (calls != [] and len(background) == 1)
