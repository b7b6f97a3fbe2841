"""The zip container in both engines: the native reader (native/src/zip.rs) against the Python
reference (``read_directory_python``) on mutated real archives, and the native writer's bytes
(native/src/zipwrite.rs) against the Python writer's.

The reader must give the same columns or the same refusal (the same message: the native engine
words them as the reference does), or leave the archive to the Python engine (``None``); the
writer must give the same bytes. Both engines run in one process whatever CKPTFIX_ENGINE says:
the library is loaded here for the comparison when it is built at all.
"""

from __future__ import annotations

import importlib.util
import io
import os
import random
import struct
import sys
import tempfile
import zipfile
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import FIXTURES, needs_native
from hostile import make_base_zip, with_data_pkl

from ckptfix import native
from ckptfix.errors import BadInputError
from ckptfix.fileio import ranges, ziparchive
from ckptfix.fileio.ranges import FileSlice
from ckptfix.native import zip as native_zip
from ckptfix.native import zipsources as native_sources

pytestmark = needs_native


@pytest.fixture(autouse=True)
def native_engine(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Load the library for these tests even in the CKPTFIX_ENGINE=python pass."""
    monkeypatch.setenv("CKPTFIX_ENGINE", "native")
    native.library.cache_clear()
    yield
    monkeypatch.undo()
    native.library.cache_clear()


# -- the reader ---------------------------------------------------------------------------------

Outcome = tuple[str, object]


def _python_outcome(f: io.FileIO, size: int, path: str) -> Outcome:
    try:
        return "ok", ziparchive.read_directory_python(f, size, path).columns()
    except BadInputError as exc:
        return "bad", exc.message
    except Exception as exc:
        return "other", type(exc).__name__


def _native_outcome(data: bytes, path: str) -> Outcome | None:
    try:
        columns = native_zip.read_directory_bytes(data)
    except BadInputError as exc:
        return "bad", f"{path}: {exc.message}"
    return None if columns is None else ("ok", columns)


def _hostile_cases() -> list[bytes]:
    """tests/cli/test_zip_hostile.py's hostile archives, made from a fresh torch.save file."""
    spec = importlib.util.spec_from_file_location(
        "_zip_hostile_cases", Path(__file__).parents[1] / "cli" / "test_zip_hostile.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    buffer = io.BytesIO()
    torch.save(module._STATE, buffer)
    base = buffer.getvalue()
    return [base, *(make(base) for make, _ in module.HOSTILE.values())]


def _written(fill: Callable[[ziparchive.ZipWriter], None], threshold: int, use_native: bool = True) -> bytes:
    """The bytes of an archive ``fill`` adds records to (the writer needs a real file)."""
    with tempfile.TemporaryFile() as out:
        writer = ziparchive.ZipWriter(out, "archive", zip64_threshold=threshold)
        writer._native = use_native
        fill(writer)
        writer.close()
        out.seek(0)
        return out.read()


def _writer_zip(threshold: int) -> bytes:
    """An archive from ckptfix's own writer, with zip64 fields from ``threshold`` bytes on."""

    def fill(writer: ziparchive.ZipWriter) -> None:
        writer.add_bytes("data.pkl", b"\x80\x02}q\x00.")
        for i in range(6):
            writer.add_small(f"data/{i}", bytes(range(i * 40 % 256)) * 3, i)
        writer.add_bytes("version", b"3\n")

    return _written(fill, threshold)


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> list[bytes]:
    folder = tmp_path_factory.mktemp("bases")
    real = [p.read_bytes() for p in sorted(FIXTURES.glob("*.p*")) if p.read_bytes()[:2] == b"PK"]
    base_zip = make_base_zip(folder)
    stored = io.BytesIO()
    with zipfile.ZipFile(base_zip) as z, zipfile.ZipFile(stored, "w", zipfile.ZIP_DEFLATED) as out:
        for info in z.infolist():
            out.writestr(info, z.read(info))
    with_pkl = with_data_pkl(base_zip, b"\x80\x02]q\x00.", folder / "with.pth", zipfile.ZIP_DEFLATED)
    made = [base_zip.read_bytes(), stored.getvalue(), with_pkl.read_bytes(), _writer_zip(300), _writer_zip(1 << 32)]
    return real[:3] + made + _hostile_cases()


_SIGNATURES = (b"PK\x01\x02", b"PK\x03\x04", b"PK\x05\x06", b"PK\x06\x06", b"PK\x06\x07")
_WIDTHS = {1: "<B", 2: "<H", 4: "<I", 8: "<Q"}


def _mutate(rng: random.Random, data: bytes) -> bytes:
    """One to three edits, mostly to the zip structures (fields near a signature)."""
    out = bytearray(data)
    for _ in range(rng.choice((1, 1, 2, 3))):
        sigs = [m for s in _SIGNATURES for m in _find_all(bytes(out), s)]
        kind = rng.random()
        if sigs and kind < 0.6:  # a field of a header: a boundary value, or the old one +-1
            width = rng.choice((1, 2, 2, 4, 4, 8))
            at = rng.choice(sigs) + rng.randrange(4, 60)
            if at + width > len(out):
                continue
            (old,) = struct.unpack_from(_WIDTHS[width], out, at)
            top = (1 << 8 * width) - 1
            value = rng.choice(
                (0, 1, top, top - 1, old + 1, old - 1, old * 2, rng.randrange(top + 1), 1 << 8 * width - 1)
            )
            struct.pack_into(_WIDTHS[width], out, at, value & top)
        elif kind < 0.7:  # a byte anywhere
            if out:
                out[rng.randrange(len(out))] = rng.randrange(256)
        elif kind < 0.8:  # cut the end, or the start
            cut = rng.randrange(len(out) + 1)
            out = out[:cut] if rng.random() < 0.7 else out[cut:]
        elif kind < 0.9:  # bytes inserted or removed somewhere
            at = rng.randrange(len(out) + 1)
            if rng.random() < 0.5:
                out[at:at] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 48)))
            else:
                del out[at : at + rng.randrange(1, 48)]
        elif sigs:  # a name's character changed (case, separators, dots, a non-ASCII byte)
            at = rng.choice(sigs) + rng.choice((30, 46)) + rng.randrange(0, 12)
            if at < len(out):
                out[at] = rng.choice(b"/\\.:AZaz\x00\x7f\xc3\x80 ")
    return bytes(out)


def _find_all(data: bytes, needle: bytes) -> Iterator[int]:
    at = data.find(needle)
    while at >= 0:
        yield at
        at = data.find(needle, at + 1)


def test_native_reader_agrees_with_the_reference_on_mutated_archives(bases: list[bytes], tmp_path: Path) -> None:
    """~2500 archives: each the same columns or the same refusal in both engines; the native
    one declines (leaves it to Python) only where the reference does something it does not
    imitate (non-ASCII names, a struct too short to unpack)."""
    rng = random.Random(26)
    path = str(tmp_path / "fuzzed.pth")
    outcomes: Counter[str] = Counter()
    messages: set[str] = set()
    mismatches = []
    with open(path, "w+b", buffering=0) as f:
        assert isinstance(f, io.FileIO)
        inputs = [*bases, *(_mutate(rng, rng.choice(bases)) for _ in range(2500))]
        for i, data in enumerate(inputs):
            f.seek(0)
            f.truncate()
            f.write(data)
            expected = _python_outcome(f, len(data), path)
            got = _native_outcome(data, path)
            outcomes["declined" if got is None else got[0]] += 1
            if got is not None and got[0] == "bad":
                messages.add(str(got[1]).split("'")[0])
            if got is not None and got != expected:
                mismatches.append((i, expected, got))
            if i % 8 == 0:  # the descriptor path, as read_directory takes it
                try:
                    fd_outcome: Outcome | None = _native_fd_outcome(f, len(data), path)
                except Exception as exc:
                    fd_outcome = "other", type(exc).__name__
                if fd_outcome is not None and fd_outcome != expected:
                    mismatches.append((i, expected, fd_outcome))
    assert not mismatches, mismatches[:3]
    assert outcomes["ok"] >= 150 and outcomes["bad"] >= 1500 and len(messages) >= 25, (outcomes, len(messages))
    assert outcomes["declined"] < 0.1 * len(inputs), outcomes


def _native_fd_outcome(f: io.FileIO, size: int, path: str) -> Outcome | None:
    try:
        columns = ziparchive._read_directory_native(f, size, path)
    except BadInputError as exc:
        return "bad", exc.message
    return None if columns is None else ("ok", columns)


def test_every_refusal_of_the_reference_is_reached_natively(bases: list[bytes], tmp_path: Path) -> None:
    """The hostile archives (one per refusal in tests/cli/test_zip_hostile.py, a non-UTF-8 name
    included) are refused by the native reader itself with the reference's message, none left
    to Python."""
    path = tmp_path / "hostile.pth"
    refused = []
    for data in bases:
        path.write_bytes(data)
        with open(path, "rb", buffering=0) as f:
            expected = _python_outcome(f, len(data), str(path))
        if expected[0] == "bad":
            assert _native_outcome(data, str(path)) == expected
            refused.append(expected[1])
    assert len(refused) >= 15 and any("not valid UTF-8" in str(m) for m in refused), refused


def test_a_zip_inside_a_file_is_read_within_its_slice(tmp_path: Path) -> None:
    """A FileSlice (a .distcp item): offsets relative to the slice, no read outside it."""
    inner = (FIXTURES / "dataparallel_tinynet.pth").read_bytes()
    path = tmp_path / "outer.bin"
    path.write_bytes(b"x" * 1000 + inner + b"PK\x05\x06" + b"\0" * 40)
    with open(path, "rb") as f:
        part = FileSlice(f, 1000, len(inner))
        expected = ziparchive.read_directory_python(part, len(inner), str(path)).columns()
        got = ziparchive._read_directory_native(part, len(inner), str(path))
        cut = FileSlice(f, 1000, len(inner) - 1)  # the end record cut short: refused, as in Python
        with pytest.raises(BadInputError) as python_error:
            ziparchive.read_directory_python(cut, len(inner) - 1, str(path))
        with pytest.raises(BadInputError) as native_error:
            ziparchive._read_directory_native(cut, len(inner) - 1, str(path))
    assert got == expected and len(expected.names) == 15
    assert native_error.value.message == python_error.value.message


def test_read_directory_uses_the_native_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the library loaded, read_directory's result is the native reader's (never parsed
    in Python), and a ZipDirectory built from columns answers like one built record by record."""
    monkeypatch.setattr(ziparchive, "read_directory_python", lambda *args: pytest.fail("Python engine ran"))
    path = FIXTURES / "lightning_tinynet.ckpt"
    with open(path, "rb") as f:
        records = ziparchive.read_directory(f, path.stat().st_size, str(path))
    monkeypatch.undo()
    with open(path, "rb", buffering=0) as f:
        reference = ziparchive.read_directory_python(f, path.stat().st_size, str(path))
    assert list(records) == list(reference) and all(records[n] == reference[n] for n in reference)
    assert sorted(records.spans()) == sorted(reference.spans())


# -- the writer ---------------------------------------------------------------------------------


def _write(rng: random.Random, use_native: bool, threshold: int) -> bytes:
    def fill(writer: ziparchive.ZipWriter) -> None:
        writer.add_bytes("data.pkl", rng.randbytes(rng.randrange(200)))
        for i in range(rng.randrange(1, 400)):
            name = f"data/{i}" + "x" * rng.choice((0, 0, 0, 1, 7, 63, 300))
            writer.add_small(name, rng.randbytes(rng.choice((0, 1, 3, 64, 500, 4000))), rng.getrandbits(32))
            if rng.random() < 0.05:
                writer.add_bytes(f"mid/{i}", rng.randbytes(rng.randrange(100)))  # between runs of small ones
        writer.add_bytes("version", b"3\n")

    return _written(fill, threshold, use_native)


@pytest.mark.parametrize("threshold", [0xFFFFFFFF, 1 << 40, 100_000, 20_000, 1_000, 1])
def test_native_writer_bytes_are_the_python_writers(threshold: int) -> None:
    """Small records laid out natively, and the central directory with zip64 and classic end
    records, are the Python writer's bytes -- zip64 fields included, wherever the threshold
    falls (in a record, in its 4 KiB margin, or at every offset)."""
    for seed in range(4):
        native_bytes = _write(random.Random(seed), True, threshold)
        python_bytes = _write(random.Random(seed), False, threshold)
        assert native_bytes == python_bytes, (threshold, seed)
    if threshold >= 1 << 32:
        with zipfile.ZipFile(io.BytesIO(native_bytes)) as z:  # CRCs here are random: names only
            assert z.namelist()[0] == "archive/data.pkl" and z.namelist()[-1] == "archive/version"


def test_native_writer_declines_what_python_refuses() -> None:
    """A name too long for its 16-bit field: the Python writer's struct.error either way
    (the native writer leaves it to Python rather than writing a different file)."""
    for use_native in (True, False):
        with pytest.raises(struct.error):
            _written(lambda writer: writer.add_small("x" * 70_000, b"abc", 0), 0xFFFFFFFF, use_native)


def test_the_native_writers_archive_reads_back_in_both_readers(tmp_path: Path) -> None:
    data = _write(random.Random(7), True, 5_000)
    path = tmp_path / "written.zip"
    path.write_bytes(data)
    with open(path, "rb", buffering=0) as f:
        reference = ziparchive.read_directory_python(f, len(data), str(path)).columns()
    assert native_zip.read_directory_bytes(data) == reference
    assert os.path.getsize(path) == len(data) and len(reference.names) >= 3


def test_the_native_writer_lays_out_small_records_and_the_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison above holds because the native writer ran, not because it declined."""
    monkeypatch.setattr(ziparchive.ZipWriter, "_add_small_python", lambda *args: pytest.fail("Python add_small"))
    monkeypatch.setattr(ziparchive.ZipWriter, "_close_python", lambda *args: pytest.fail("Python directory"))
    for threshold in (0xFFFFFFFF, 1_000):
        assert _write(random.Random(3), True, threshold)[:4] == b"PK\x03\x04"


# -- copies: add_copies against add_copy -----------------------------------------------------------


@pytest.fixture(scope="module")
def copy_sources(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two source files of random bytes (one 200 KiB, one a few KiB)."""
    folder = tmp_path_factory.mktemp("copies")
    rng = random.Random(26)
    big, small = folder / "big.bin", folder / "small.bin"
    big.write_bytes(rng.randbytes(200_000))
    small.write_bytes(rng.randbytes(5_000))
    return big, small


def _copy_plan(
    rng: random.Random, files: tuple[Path, Path]
) -> tuple[list[str], list[ranges.FileRange | ranges.ComputedSource]]:
    """Names and sources as a writer meets them: small ranges of two files in and out of order,
    with no CRC, the right one, or 0 (CRCs off); empty ones; big ones (kernel copies) and
    computed ones between runs."""
    contents = [p.read_bytes() for p in files]
    names: list[str] = []
    sources: list[ranges.FileRange | ranges.ComputedSource] = []
    for i in range(rng.randrange(1, 300)):
        which = rng.randrange(2)
        size = rng.choice((0, 1, 8, 300, 4000, 4000)) if rng.random() < 0.95 else 70_000
        size = min(size, len(contents[which]))
        offset = rng.randrange(len(contents[which]) - size + 1)
        data = contents[which][offset : offset + size]
        crc = rng.choice((None, zlib.crc32(data), 0))
        if rng.random() < 0.03:
            sources.append(ranges.ComputedSource(size, lambda _files, data=data: data))
        else:
            sources.append(ranges.FileRange(str(files[which]), offset, size, crc))
        names.append(f"data/{i}")
    return names, sources


def _copied(
    names: list[str],
    sources: list[ranges.FileRange | ranges.ComputedSource],
    use_native: bool,
    batch: bool,
    threshold: int = 0xFFFFFFFF,
    prefix: bytes = b"",
) -> tuple[bytes, list[int]]:
    """The archive written with add_copies (``batch``) or add_copy per record, after ``prefix``
    (embedded: offsets count from the archive's start, as a .distcp item's do)."""
    with tempfile.TemporaryFile() as out, ranges.OpenFiles() as files:
        out.write(prefix)
        writer = ziparchive.ZipWriter(out, "archive", zip64_threshold=threshold, embedded=bool(prefix))
        writer._native = use_native
        writer.add_bytes("data.pkl", b"\x80\x02}q\x00.")
        if batch:
            crcs = writer.add_copies(names, sources, files)
        else:
            crcs = [writer.add_copy(name, source, files) for name, source in zip(names, sources)]
        writer.add_bytes("version", b"3\n")
        writer.close()
        out.seek(0)
        return out.read(), crcs


@pytest.mark.parametrize("threshold", [0xFFFFFFFF, 100_000, 1_000])
def test_add_copies_writes_what_add_copy_writes(copy_sources: tuple[Path, Path], threshold: int) -> None:
    """The same archive and CRCs from add_copies (native runs of small records) as from the
    reference's add_copy per record, with the Python writer or the native one, zip64 or not."""
    for seed in range(3):
        names, sources = _copy_plan(random.Random(seed), copy_sources)
        reference = _copied(names, sources, False, False, threshold)
        for use_native, batch in ((True, True), (True, False), (False, True)):
            assert _copied(names, sources, use_native, batch, threshold) == reference, (seed, use_native, batch)
    with zipfile.ZipFile(io.BytesIO(reference[0])) as z:  # the CRCs are right (or 0): zipfile checks them
        for name, source in zip(names, sources):
            if not isinstance(source, ranges.FileRange) or source.crc != 0:
                z.read(f"archive/{name}")


def test_add_copies_copies_small_records_natively(
    copy_sources: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The comparison above holds because the library copied the small records: add_copy is
    asked only for the big and computed ones."""
    names, sources = _copy_plan(random.Random(5), copy_sources)
    asked: list[str] = []
    real = ziparchive.ZipWriter.add_copy

    def add_copy(self: ziparchive.ZipWriter, name: str, source: Any, files: ranges.OpenFiles) -> int:
        asked.append(name)
        return real(self, name, source, files)

    monkeypatch.setattr(ziparchive.ZipWriter, "add_copy", add_copy)
    _copied(names, sources, True, True)
    expected = [n for n, s in zip(names, sources) if not isinstance(s, ranges.FileRange) or s.size >= ranges.SMALL_COPY]
    assert asked == expected and len(expected) < len(names)


def test_add_copies_from_an_embedded_archive_into_an_embedded_one(tmp_path: Path) -> None:
    """Records of a zip stored inside another file (a .distcp item: its FileRanges are absolute
    offsets of the outer file) copied into an archive written after other bytes: the same
    bytes as add_copy's, and the copy's records read back as the source's."""
    names = [f"data/{i}" for i in range(40)]
    inner = _written(
        lambda w: [
            w.add_small(n, bytes([i]) * (i * 37 % 500), zlib.crc32(bytes([i]) * (i * 37 % 500)))
            for i, n in enumerate(names)
        ],
        0xFFFFFFFF,
    )
    outer = tmp_path / "outer.distcp"
    outer.write_bytes(b"y" * 777 + inner)
    with open(outer, "rb") as f:
        records = ziparchive.read_directory(FileSlice(f, 777, len(inner)), len(inner), str(outer))
    sources: list[ranges.FileRange | ranges.ComputedSource] = [
        records[f"archive/{n}"].source(str(outer), 777) for n in names
    ]
    reference = _copied(names, sources, False, False, prefix=b"z" * 1000)
    assert _copied(names, sources, True, True, prefix=b"z" * 1000) == reference
    with zipfile.ZipFile(io.BytesIO(reference[0][1000:])) as z:
        assert [z.read(f"archive/{n}") for n in names] == [bytes([i]) * (i * 37 % 500) for i in range(40)]


@pytest.mark.parametrize("fault", ["crc", "truncated"])
def test_add_copies_refuses_what_add_copy_refuses(copy_sources: tuple[Path, Path], fault: str) -> None:
    """A record whose bytes do not match its recorded CRC, or that the file ends inside: the
    reference's error, in its words, from the batch as from add_copy."""
    names, sources = _copy_plan(random.Random(9), copy_sources)
    path = str(copy_sources[1])
    bad = ranges.FileRange(path, 10, 20, 1234) if fault == "crc" else ranges.FileRange(path, 4_990, 20)
    sources[len(sources) // 2] = bad
    messages = []
    for use_native, batch in ((False, False), (True, True)):
        with pytest.raises(BadInputError) as error:
            _copied(names, sources, use_native, batch)
        messages.append(error.value.message)
    assert messages[0] == messages[1] and ("CRC32" in messages[0] or "ended inside" in messages[0])


def _columns_reference(
    sources: list[Any], small: int
) -> tuple[list[int], list[int], list[int], list[int], list[int], list[Any]]:
    """zipsources.rs's columns, in Python: which sources are small stored ranges of a file, and
    their file (by path object, in order of first use), offset, size and CRC (-1: none)."""
    kinds, files, offsets, sizes, crcs, paths = [], [], [], [], [], []  # type: ignore[var-annotated]
    index: dict[int, int] = {}
    for s in sources:
        ints = type(s) is ranges.FileRange and type(s.offset) is int and type(s.size) is int
        crc_ok = ints and (s.crc is None or (type(s.crc) is int and 0 <= s.crc < 1 << 32))
        if not (crc_ok and s.deflated_size is None and s.offset >= 0 and 0 <= s.size < small and type(s.path) is str):
            kinds.append(0)
            files.append(0), offsets.append(0), sizes.append(0), crcs.append(0)
            continue
        if id(s.path) not in index:
            index[id(s.path)] = len(paths)
            paths.append(s.path)
        kinds.append(1)
        files.append(index[id(s.path)]), offsets.append(s.offset), sizes.append(s.size)
        crcs.append(-1 if s.crc is None else s.crc)
    return kinds, files, offsets, sizes, crcs, paths


def test_source_columns_are_read_as_python_reads_them() -> None:
    """The library's columns of a writer's sources are what Python reads from the same objects:
    only exact FileRanges of a str path, stored, with offsets, sizes and CRCs in range count as
    small records; anything else is left to the Python writer."""

    class Sub(ranges.FileRange):
        pass

    rng = random.Random(4)
    paths = ["a.pth", "b.pth", "s3://bucket/c.pth"]
    for _ in range(30):
        sources: list[Any] = []
        for _ in range(rng.randrange(0, 60)):
            path = rng.choice(paths)
            kind = rng.randrange(12)
            size = rng.choice((0, 1, 65535, 65536, 1 << 40))
            offset = rng.choice((0, 7, 1 << 40, -1))
            crc = rng.choice((None, 0, 123, 0xFFFFFFFF, 1 << 32, -1, True))
            if kind == 0:
                sources.append(ranges.ComputedSource(3, lambda _files: b"abc"))
            elif kind == 1:
                sources.append(ranges.FileRange(path, offset, size, crc, 10))  # deflated
            elif kind == 2:
                sources.append(Sub(path, offset, size, crc))
            elif kind == 3:
                sources.append(ranges.FileRange(Path(path), offset, size, crc))  # type: ignore[arg-type]
            elif kind == 4:
                sources.append(ranges.FileRange(path + "x" * rng.randrange(2), offset, True, crc))  # type: ignore[arg-type]
            else:
                sources.append(ranges.FileRange(path, offset, size, crc))
        got = native_sources.source_columns(sources, ranges.FileRange, ranges.SMALL_COPY)
        assert got is not None
        kinds, files, offsets, sizes, crcs, names = _columns_reference(sources, ranges.SMALL_COPY)
        assert list(got.kinds) == kinds and list(got.files) == files and list(got.offsets) == offsets
        assert list(got.sizes) == sizes and list(got.crcs) == crcs
        assert len(got.paths) == len(names) and all(a is b for a, b in zip(got.paths, names))
    # a value past 64 bits: the whole list is left to Python (which refuses it, or copies it)
    assert native_sources.source_columns([ranges.FileRange("a", 1 << 70, 1)], ranges.FileRange, 10) is None
