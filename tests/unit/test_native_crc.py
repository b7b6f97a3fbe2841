"""The CRC-32 every copied zip record is checked with (ckptfix/native/crc.py, native/src/crc.rs).

The native CRC folds with carry-less multiplication where the CPU has it and uses a table
otherwise; both must equal ``zlib.crc32`` on every length and alignment, continuing from any
running value. The wrapper must give zlib's answer for every buffer kind the writers hand it,
on either engine, and the native call must release the GIL (the background CRC runs beside the
kernel's copy on another core).
"""

from __future__ import annotations

import ctypes
import mmap
import random
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import needs_native

from ckptfix import native
from ckptfix.native import crc

needs_library = needs_native

#: lengths around every boundary the folding code has (16-byte blocks, 64-byte folds, the
#: table tail) and a few big ones
LENGTHS = [*range(0, 200), 255, 256, 257, 1023, 1024, 1025, 4095, 4096, 65_535, 65_536, 1 << 20, (1 << 20) + 13]


@pytest.fixture(scope="module")
def noise() -> bytes:
    return random.Random(26).randbytes((1 << 20) + 64)


@pytest.fixture
def native_fn() -> Iterator[Any]:
    fn = crc._native()
    assert fn is not None, "CKPTFIX_ENGINE=python with a library built: run this file under another engine"
    yield fn


@needs_library
def test_native_equals_zlib_on_every_length_alignment_and_value(noise: bytes, native_fn: Any) -> None:
    rng = random.Random(1)
    for length in LENGTHS:
        for start in (0, 1, 7, 15, 16, 33) if length < 5000 else (0, 3):
            data = noise[start : start + length]
            value = rng.choice((0, 0xFFFFFFFF, rng.getrandbits(32)))
            assert crc.native_crc32(native_fn, data, value) == zlib.crc32(data, value), (length, start, value)


@needs_library
def test_native_running_value_continues_like_zlib(noise: bytes, native_fn: Any) -> None:
    """A record checked a chunk at a time (the background CRC reads 1 MiB at a time)."""
    value = 0
    for cut in range(0, len(noise), 100_003):
        value = crc.native_crc32(native_fn, noise[cut : cut + 100_003], value)
    assert value == zlib.crc32(noise)


def _kinds(tmp_path: Path, data: bytes) -> Iterator[tuple[str, Any]]:
    yield "bytes", data
    yield "bytearray", bytearray(data)
    yield "memoryview slice of a bytearray", memoryview(bytearray(b"xx" + data))[2:]
    yield "read-only memoryview", memoryview(data).toreadonly()
    if not data:
        return  # an empty file cannot be mapped
    path = tmp_path / "data.bin"
    path.write_bytes(data)
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        yield "read-only mmap", m


@pytest.mark.parametrize("size", [0, 10, crc.NATIVE_FROM - 1, crc.NATIVE_FROM, 200_001])
def test_the_wrapper_gives_zlibs_answer_for_every_buffer_kind(tmp_path: Path, noise: bytes, size: int) -> None:
    """On whichever engine this run uses (CI runs both)."""
    data = noise[:size]
    for kind, buf in _kinds(tmp_path, data):
        assert crc.crc32(buf) == zlib.crc32(data), kind
        assert crc.crc32(buf, 0x12345678) == zlib.crc32(data, 0x12345678), kind


def test_the_python_engine_never_calls_the_library(monkeypatch: pytest.MonkeyPatch, noise: bytes) -> None:
    native.library.cache_clear()
    monkeypatch.setenv("CKPTFIX_ENGINE", "python")
    called: list[object] = []
    monkeypatch.setattr(crc, "native_crc32", lambda *args: called.append(args))
    try:
        assert crc.crc32(noise) == zlib.crc32(noise)
    finally:
        monkeypatch.undo()
        native.library.cache_clear()
    assert not called


def _releases_gil(fn: Any) -> bool:
    """ctypes drops the GIL around a foreign call unless the function carries the PYTHONAPI flag
    (functions of a ``PyDLL``, or of ``ctypes.pythonapi``): read from the function itself, so
    the check does not depend on how the threads happen to be scheduled."""
    return not fn._flags_ & ctypes._FUNCFLAG_PYTHONAPI


@needs_library
def test_the_native_call_releases_the_gil(native_fn: Any) -> None:
    """The CRC runs on a worker thread beside the main thread's kernel copy (fileio/ranges.py),
    as zlib.crc32 did: the library must be called without the GIL. (This once compared timestamps
    of two threads, which a loaded machine can reorder; the flag is what decides.)"""
    assert _releases_gil(native_fn)
    path = native.library_path()
    assert path is not None
    holding = getattr(ctypes.PyDLL(str(path)), native_fn.__name__)
    assert not _releases_gil(holding)  # what a PyDLL load would be: the check can fail
