"""Big records copied once, their CRC checked on the way (fileio/ranges.py, fileio/ziparchive.py,
native/src/copyrange.rs).

A zip record copied from a zip input is checked against the CRC its source recorded. Where the
kernel's copy cannot share blocks (ext4, tmpfs) the native engine copies such a record through a
buffer, folding its CRC while each piece is in cache, instead of the kernel's copy plus a worker's
second read of the same bytes. The outputs must be byte-identical to the two-pass path's and to
the Python loop's, and a record whose bytes do not match its recorded CRC must be refused exactly
as before: at close, in the same words, nothing written.
"""

from __future__ import annotations

import io
import os
import random
import sys
import tempfile
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import needs_native

from ckptfix import native
from ckptfix.errors import BadInputError
from ckptfix.fileio import ranges, ziparchive
from ckptfix.native import crc as native_crc

pytestmark = [
    needs_native,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="file system types from /proc (Linux)"),
]

#: a few pieces of the buffer, and not a whole number of them
SIZE = 3 * ranges._BOUNCE + 4321


@pytest.fixture(autouse=True)
def native_engine(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Load the library for these tests even in the CKPTFIX_ENGINE=python pass; the file
    system is ext4 as far as the writer can tell (whatever holds the temporary folder)."""
    monkeypatch.setenv("CKPTFIX_ENGINE", "native")
    native.library.cache_clear()
    monkeypatch.setattr(ranges, "_file_system", lambda device: "ext4")
    yield
    monkeypatch.undo()
    native.library.cache_clear()


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes]:
    path = tmp_path_factory.mktemp("big") / "src.bin"
    data = random.Random(26).randbytes(2 * SIZE + 8192)
    path.write_bytes(data)
    return path, data


class Seen:
    """What the copy did: kernel copies, background CRCs, native calls."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.kernel: list[int] = []
        self.background: list[ranges.FileRange] = []
        self.native: list[tuple[int, ...]] = []
        real_copy, real_background, real_native = (
            os.copy_file_range,
            ranges.OpenFiles.crc_in_background,
            ranges.native_copy_range,
        )

        def kernel(src: int, dst: int, count: int, offset_src: int, offset_dst: int) -> int:
            self.kernel.append(count)
            return real_copy(src, dst, count, offset_src, offset_dst)

        def background(files: ranges.OpenFiles, source: ranges.FileRange) -> Any:
            self.background.append(source)
            return real_background(files, source)

        def native_copy(*args: Any) -> int | None:
            self.native.append(args)
            return real_native(*args)

        monkeypatch.setattr(os, "copy_file_range", kernel)
        monkeypatch.setattr(ranges.OpenFiles, "crc_in_background", background)
        monkeypatch.setattr(ranges, "native_copy_range", native_copy)


def _archive(sources: list[ranges.FileRange]) -> bytes:
    """The zip add_copy writes for ``sources`` (named data/0, data/1...)."""
    with tempfile.TemporaryFile() as out, ranges.OpenFiles() as files:
        writer = ziparchive.ZipWriter(out, "archive")
        writer.add_bytes("data.pkl", b"\x80\x02}q\x00.")
        for i, source in enumerate(sources):
            writer.add_copy(f"data/{i}", source, files)
        writer.close()
        out.seek(0)
        return out.read()


def _sources(path: Path, data: bytes, crc_of: Any = zlib.crc32) -> list[ranges.FileRange]:
    """Two big records: one at a 64-byte offset (placed in step with its source: shares_blocks),
    one at an odd offset (placed at the next 64-byte boundary: out of step)."""
    spans = [(4096 + 64, SIZE), (SIZE + 8192 + 3, SIZE - 999)]
    return [ranges.FileRange(str(path), at, size, crc_of(data[at : at + size])) for at, size in spans]


ENGINES = {
    # the native engine: one pass, the CRC folded on the way
    "one pass": {},
    # the Python engine's path: the kernel's copy and a worker's CRC beside it
    "two passes": {"copies_natively": lambda: False},
    # the one pass in Python's own loop (what runs where the library declines a copy)
    "python loop": {"native_copy_range": lambda *args: None},
}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_big_records_are_the_same_bytes_by_every_path(
    source: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch, engine: str
) -> None:
    path, data = source
    sources = _sources(path, data)
    reference = _archive(sources)  # before any patch: the one pass, natively
    for name, value in ENGINES[engine].items():
        monkeypatch.setattr(ranges, name, value)
    seen = Seen(monkeypatch)
    assert _archive(sources) == reference
    if engine == "one pass":  # each record read once: no kernel copy, no worker
        assert seen.kernel == [] and seen.background == [] and [call[-1] for call in seen.native] == [True, True]
    elif engine == "two passes":  # (the out-of-step record's copy goes through the buffer, without a CRC)
        assert seen.kernel and len(seen.background) == 2 and [call[-1] for call in seen.native] == [False]
    with zipfile.ZipFile(io.BytesIO(reference)) as z:  # zipfile checks each CRC as it reads
        assert [z.read(f"archive/data/{i}") for i in range(2)] == [data[s.offset : s.offset + s.size] for s in sources]


@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_record_whose_bytes_do_not_match_its_crc_is_refused_by_every_path(
    source: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch, engine: str
) -> None:
    """The second record's recorded CRC is off by one bit: refused at close, in the words the
    two-pass path has always used, whichever path copied it."""
    path, data = source
    sources = _sources(path, data)
    sources[1] = ranges.FileRange(sources[1].path, sources[1].offset, sources[1].size, sources[1].crc ^ 1)  # type: ignore[operator]
    for name, value in ENGINES[engine].items():
        monkeypatch.setattr(ranges, name, value)
    closed: list[bool] = []
    real_close = ziparchive.ZipWriter.close
    monkeypatch.setattr(ziparchive.ZipWriter, "close", lambda self: closed.append(True) or real_close(self))
    with pytest.raises(BadInputError) as error:
        _archive(sources)
    assert closed == [True]  # raised by the check at close, after every record was copied
    assert error.value.message.startswith(f"{path}: the bytes copied into data/1 have CRC32 ")
    assert "the input is corrupt" in error.value.message


def test_the_native_copy_is_the_python_loop(source: tuple[Path, bytes], tmp_path: Path) -> None:
    """``copy_range`` in the library against ranges' own loop: same bytes, same CRC, with and
    without a CRC, in and out of step; the buffer placed where ``_buffer_page_offset`` says."""
    path, data = source
    for src_offset, dst_offset, count in ((0, 0, SIZE), (8, 4096, SIZE), (5, 4095, 70_000), (100, 164, 1)):
        for want_crc in (True, False):
            at = ranges._buffer_page_offset(src_offset, dst_offset)
            with open(path, "rb") as s, open(tmp_path / "n", "wb") as n, open(tmp_path / "p", "wb") as p:
                got = native_crc.copy_range(s.fileno(), src_offset, n.fileno(), dst_offset, count, at, want_crc)
                want = _python_loop(s.fileno(), src_offset, p.fileno(), dst_offset, count, want_crc)
            assert got == want == (zlib.crc32(data[src_offset : src_offset + count]) if want_crc else 0)
            assert (tmp_path / "n").read_bytes() == (tmp_path / "p").read_bytes()
            assert (tmp_path / "n").read_bytes()[dst_offset:] == data[src_offset : src_offset + count]


def _python_loop(src_fd: int, src_offset: int, dst_fd: int, dst_offset: int, count: int, crc: bool) -> int:
    saved = ranges.native_copy_range
    ranges.native_copy_range = lambda *args: None  # type: ignore[assignment]
    try:
        return ranges._bounce_copy(src_fd, src_offset, dst_fd, dst_offset, count, crc=crc)
    finally:
        ranges.native_copy_range = saved


def test_the_native_copy_leaves_what_it_cannot_finish_to_python(source: tuple[Path, bytes], tmp_path: Path) -> None:
    """A source that ends inside the range, an output it cannot write, a closed descriptor:
    ``None`` (Python then copies the range itself and raises its own error)."""
    path, data = source
    with open(path, "rb") as s, open(tmp_path / "out", "wb") as out, open(path, "rb") as read_only:
        assert native_crc.copy_range(s.fileno(), len(data) - 10, out.fileno(), 0, 20, 0, True) is None
        assert native_crc.copy_range(s.fileno(), 0, read_only.fileno(), 0, 100_000, 0, True) is None
        assert native_crc.copy_range(-1, 0, out.fileno(), 0, 10, 0, True) is None
        with pytest.raises(BadInputError, match="ended while its data was being copied"):
            ranges._bounce_copy(s.fileno(), len(data) - 10, out.fileno(), 0, 20, crc=True)
        with pytest.raises(OSError):
            ranges._bounce_copy(s.fileno(), 0, read_only.fileno(), 0, 100_000, crc=True)


def _peak_rss_since_reset() -> tuple[int, int]:
    """(current RSS, peak RSS) in bytes after the peak was reset (``/proc/self/clear_refs``)."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(status["VmRSS"].split()[0]) * 1024, int(status["VmHWM"].split()[0]) * 1024


def test_the_one_pass_copy_holds_one_buffer_whatever_the_size(tmp_path: Path) -> None:
    """Memory independent of the record's size: a 16 MiB copy with its CRC raises the peak RSS by
    about one buffer (256 KiB), nowhere near the record."""
    size = 16 << 20
    (tmp_path / "src").write_bytes(b"\x5a" * size)
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    except OSError:
        pytest.skip("this kernel cannot reset the peak RSS")
    before, _ = _peak_rss_since_reset()
    with open(tmp_path / "src", "rb") as s, open(tmp_path / "dst", "wb") as d:
        crc = ranges._bounce_copy(s.fileno(), 0, d.fileno(), 0, size, crc=True)
    _, peak = _peak_rss_since_reset()
    assert crc == zlib.crc32(b"\x5a" * size)
    assert peak - before < 8 << 20, f"peak RSS rose by {(peak - before) >> 20} MiB"
