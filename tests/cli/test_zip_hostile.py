"""Hostile zip containers: archives torch and ckptfix (or two zip readers) would read differently.

Each case starts from a small real ``torch.save`` file made here and edits its bytes (or
re-zips it with :mod:`zipfile`): no committed blobs. Every case must be refused by every
command with one clear line naming the problem and no output file, and ``scan`` must not call
it clean. Genuine files -- torch's own, protocol 4, re-zipped with deflate -- must still work.
"""

from __future__ import annotations

import io
import pickle
import struct
import warnings
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import invoke_cli, no_temp_files, tensor_bytes
from safetensors.torch import load_file

from ckptfix.errors import BadInputError
from ckptfix.fileio.ranges import inflate_chunks

_STATE = {"module.w": torch.arange(6.0).view(2, 3), "module.b": torch.ones(3), "module.n": torch.arange(5)}


# -- reading and patching a zip by hand ------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """Where one record's central directory entry and local header are in the file."""

    central: int
    local: int
    name: str


def _eocd(data: bytes) -> int:
    return data.rindex(b"PK\x05\x06")


def _entries(data: bytes) -> dict[str, Entry]:
    """Records by their name inside the archive folder (``data.pkl``, ``data/0``...)."""
    count, _, at = struct.unpack_from("<HII", data, _eocd(data) + 10)
    found = {}
    for _ in range(count):
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", data, at + 28)
        name = data[at + 46 : at + 46 + name_len].decode()
        (local,) = struct.unpack_from("<I", data, at + 42)
        found[name.split("/", 1)[1]] = Entry(at, local, name)
        at += 46 + name_len + extra_len + comment_len
    return found


def _data_span(data: bytes, entry: Entry) -> tuple[int, int]:
    """(start, end) of a record's stored bytes, from its local header and central sizes."""
    name_len, extra_len = struct.unpack_from("<HH", data, entry.local + 26)
    start = entry.local + 30 + name_len + extra_len
    (csize,) = struct.unpack_from("<I", data, entry.central + 20)
    return start, start + csize


def _patch(data: bytes, *edits: tuple[int, str, int]) -> bytes:
    """``data`` with each (offset, struct format, value) written in."""
    out = bytearray(data)
    for offset, fmt, value in edits:
        struct.pack_into(fmt, out, offset, value)
    return bytes(out)


def _rezip(
    data: bytes,
    *,
    add: tuple[tuple[str, bytes], ...] = (),
    replace: dict[str, bytes] | None = None,
    compression: int = zipfile.ZIP_STORED,
) -> bytes:
    """The archive rewritten by Python's zipfile (sizes in local headers, no data descriptors)."""
    buf = io.BytesIO()
    with (
        zipfile.ZipFile(io.BytesIO(data)) as z,
        zipfile.ZipFile(buf, "w", compression) as out,
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")  # zipfile warns about the duplicate name we add on purpose
        for info in z.infolist():
            out.writestr(info.filename, (replace or {}).get(info.filename, z.read(info)))
        for name, payload in add:
            out.writestr(name, payload)
    return buf.getvalue()


def _rename(data: bytes, placeholder: bytes, name: bytes) -> bytes:
    """Rename a record in both its local header and its directory entry (same length)."""
    assert len(placeholder) == len(name) and data.count(placeholder) == 2
    return data.replace(placeholder, name)


# -- the hostile cases -------------------------------------------------------------------------


def _case_conflict(base: bytes) -> bytes:
    return _rezip(base, add=(("archive/data.PKL", pickle.dumps({"w": 1}, protocol=2)),))


def _duplicate_name(base: bytes) -> bytes:
    return _rezip(base, add=(("archive/data.pkl", pickle.dumps({"w": 1}, protocol=2)),))


def _local_name_differs(base: bytes) -> bytes:
    entry = _entries(base)["data.pkl"]
    start = entry.local + 30
    assert base[start : start + len(entry.name)] == entry.name.encode()
    return base[:start] + b"archive/data.pkx" + base[start + len(entry.name) :]


def _local_method_differs(base: bytes) -> bytes:
    return _patch(base, (_entries(base)["data.pkl"].local + 8, "<H", 8))


def _local_sizes_differ(base: bytes) -> bytes:
    data = _rezip(base)
    entry = _entries(data)["data.pkl"]
    (size,) = struct.unpack_from("<I", data, entry.local + 22)
    return _patch(data, (entry.local + 18, "<I", size - 1), (entry.local + 22, "<I", size - 1))


def _overlapping_records(base: bytes) -> bytes:
    """data/0's directory entry stretches over data/1's header and bytes (a Fifield-style bomb)."""
    entries = _entries(base)
    start, _ = _data_span(base, entries["data/0"])
    _, end = _data_span(base, entries["data/1"])
    central = entries["data/0"].central
    return _patch(base, (central + 20, "<I", end - start), (central + 24, "<I", end - start))


def _second_pickle(base: bytes) -> bytes:
    return _rezip(base, add=(("archive/extra.pkl", pickle.dumps({"w": 1}, protocol=2)),))


def _second_pickle_upper_case(base: bytes) -> bytes:
    return _rezip(base, add=(("archive/notes.PKL", pickle.dumps([1, 2], protocol=2)),))


def _torch_name_in_other_case(base: bytes) -> bytes:
    """torch's reader would find this as ``byteorder`` (and swap every tensor); a case-sensitive one not."""
    data = _rezip(base, replace={"archive/byteorder": b"big"})
    return _rename(data, b"archive/byteorder", b"archive/BYTEORDER")


def _deflated(base: bytes) -> tuple[bytes, Entry]:
    data = _rezip(base, compression=zipfile.ZIP_DEFLATED)
    return data, _entries(data)["data.pkl"]


def _deflate_ratio_bomb(base: bytes) -> bytes:
    """data.pkl declares 2000x its compressed size: more than deflate can produce."""
    data, entry = _deflated(base)
    (csize,) = struct.unpack_from("<I", data, entry.central + 20)
    return _patch(data, (entry.central + 24, "<I", csize * 2000), (entry.local + 22, "<I", csize * 2000))


def _deflate_size_lie(base: bytes) -> bytes:
    """data.pkl inflates to one byte more than it declares."""
    data, entry = _deflated(base)
    (size,) = struct.unpack_from("<I", data, entry.central + 24)
    return _patch(data, (entry.central + 24, "<I", size - 1), (entry.local + 22, "<I", size - 1))


def _deflate_corrupt(base: bytes) -> bytes:
    """data.pkl's deflate stream starts with a reserved block type."""
    data, entry = _deflated(base)
    start, _ = _data_span(data, entry)
    return _patch(data, (start, "<B", 0x07))


def _name_with_dotdot(base: bytes) -> bytes:
    return _rezip(base, add=(("archive/../../etc/evil", b"x"),))


def _name_absolute(base: bytes) -> bytes:
    return _rezip(base, add=(("/archive/evil", b"x"),))


def _name_with_nul(base: bytes) -> bytes:
    return _rename(_rezip(base, add=(("archive/PLACEHOLDER", b"x"),)), b"PLACEHOLDER", b"PLACE\x00OLDER")


def _name_not_utf8(base: bytes) -> bytes:
    return _rename(_rezip(base, add=(("archive/PLACEHOLDER", b"x"),)), b"PLACEHOLDER", b"PLACE\xff\xfeLDER")


def _zip64_fields(data: bytes) -> tuple[int, int]:
    """Offsets of the classic end record and of the zip64 end record torch always writes."""
    eocd = _eocd(data)
    (eocd64,) = struct.unpack_from("<Q", data, eocd - 20 + 8)
    assert data[eocd64 : eocd64 + 4] == b"PK\x06\x06"
    return eocd, eocd64


def _set_counts(data: bytes, classic: int, zip64: int) -> bytes:
    eocd, eocd64 = _zip64_fields(data)
    return _patch(
        data,
        (eocd + 8, "<H", classic),
        (eocd + 10, "<H", classic),
        (eocd64 + 24, "<Q", zip64),
        (eocd64 + 32, "<Q", zip64),
    )


def _count_too_small(base: bytes) -> bytes:
    """One entry fewer declared than the directory holds: miniz would see n-1 records, zipfile n."""
    count = len(_entries(base)) - 1
    return _set_counts(base, count, count)


def _count_huge(base: bytes) -> bytes:
    """A few hundred bytes claiming 2**40 entries."""
    return _set_counts(base, 0xFFFF, 1 << 40)


def _end_records_disagree(base: bytes) -> bytes:
    count = len(_entries(base))
    return _set_counts(base, count, count - 1)


def _gap_before_end_record(base: bytes) -> bytes:
    """Bytes between the directory and the zip64 end record (locator updated to match)."""
    eocd, eocd64 = _zip64_fields(base)
    data = base[:eocd64] + b"\0" * 16 + base[eocd64:]
    return _patch(data, (eocd + 16 - 20 + 8, "<Q", eocd64 + 16))


def _zip64_placeholder_without_value(base: bytes) -> bytes:
    """Sizes set to the zip64 placeholder, with no zip64 field to give them."""
    central = _entries(base)["data.pkl"].central
    return _patch(base, (central + 20, "<I", 0xFFFFFFFF), (central + 24, "<I", 0xFFFFFFFF))


def _encrypted(base: bytes) -> bytes:
    central = _entries(base)["data.pkl"].central
    (flags,) = struct.unpack_from("<H", base, central + 8)
    return _patch(base, (central + 8, "<H", flags | 1))


#: name -> (how to make it from a torch.save file, words the error line must hold)
HOSTILE: dict[str, tuple[Callable[[bytes], bytes], str]] = {
    "case-conflict": (_case_conflict, "differ only in case"),
    "duplicate-name": (_duplicate_name, "two records named 'archive/data.pkl'"),
    "local-name-differs": (_local_name_differs, "in its local header"),
    "local-method-differs": (_local_method_differs, "compression method 8 in its local header"),
    "local-sizes-differ": (_local_sizes_differ, "sizes or CRC in its local header"),
    "overlapping-records": (_overlapping_records, "'archive/data/0' and 'archive/data/1' overlap"),
    "second-pickle": (_second_pickle, "'archive/extra.pkl' is a second pickle"),
    "second-pickle-upper-case": (_second_pickle_upper_case, "'archive/notes.PKL' is a second pickle"),
    "torch-name-in-other-case": (_torch_name_in_other_case, "'archive/BYTEORDER' is torch's 'byteorder'"),
    "deflate-ratio-bomb": (_deflate_ratio_bomb, "zip bomb"),
    "deflate-size-lie": (_deflate_size_lie, "does not inflate to its declared size"),
    "deflate-corrupt": (_deflate_corrupt, "corrupt compressed data"),
    "name-with-dotdot": (_name_with_dotdot, "climbs out of the archive"),
    "name-absolute": (_name_absolute, "is an absolute path"),
    "name-with-nul": (_name_with_nul, "holds a NUL byte"),
    "name-not-utf8": (_name_not_utf8, "not valid UTF-8"),
    "count-too-small": (_count_too_small, "more than the 8 entries"),
    "count-huge": (_count_huge, "1099511627776 entries cannot fit"),
    "end-records-disagree": (_end_records_disagree, "describe different directories"),
    "gap-before-end-record": (_gap_before_end_record, "16 bytes the zip directory does not account for"),
    "zip64-placeholder-without-value": (_zip64_placeholder_without_value, "lacks the zip64 sizes"),
    "encrypted": (_encrypted, "is encrypted"),
}


@pytest.fixture
def base(tmp_path: Path) -> bytes:
    """A real torch.save file whose records live in ``archive/`` (6 records, 3 storages)."""
    path = tmp_path / "archive.pth"
    torch.save(_STATE, path)
    return path.read_bytes()


def _run_all(*commands: list) -> list:
    """Run CLI commands one after the other (in-process)."""
    return [invoke_cli(*args) for args in commands]


def _one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_archive_is_refused_by_every_command(tmp_path: Path, base: bytes, case: str) -> None:
    make, expected = HOSTILE[case]
    src = tmp_path / "hostile.pth"
    src.write_bytes(make(base))
    out_pth, out_st = tmp_path / "out.pth", tmp_path / "out.safetensors"
    inspect, strip, convert, verify, scan = _run_all(
        ["inspect", src],
        ["strip-module", src, out_pth],
        ["convert", src, out_st],
        ["verify", src],
        ["scan", src],
    )
    for result in (inspect, strip, convert):
        assert result.returncode == 3, (result.args, result.stderr)
        assert expected in _one_line(result.stderr)
    # verify is a CI gate: every failed check, unreadable input included, is its exit 1
    assert verify.returncode == 1 and expected in _one_line(verify.stderr)
    assert scan.returncode == 3 and scan.stdout.startswith("ERROR") and expected in scan.stdout, scan.stdout
    assert not out_pth.exists() and not out_st.exists() and no_temp_files(tmp_path)


def _deflated_storage_size_lie(base: bytes) -> bytes:
    """data/0 declares 4 bytes more than its deflate stream holds (its tensor needs fewer)."""
    data = _rezip(base, compression=zipfile.ZIP_DEFLATED)
    entry = _entries(data)["data/0"]
    (size,) = struct.unpack_from("<I", data, entry.central + 24)
    return _patch(data, (entry.central + 24, "<I", size + 4), (entry.local + 22, "<I", size + 4))


def test_compressed_storage_is_checked_while_streamed(tmp_path: Path, base: bytes) -> None:
    """Storages are read only when written (inspect never inflates them), so the size check
    happens while streaming: the write fails cleanly and leaves no output."""
    src = tmp_path / "lying.pth"
    src.write_bytes(_deflated_storage_size_lie(base))
    out_pth, out_st = tmp_path / "out.pth", tmp_path / "out.safetensors"
    strip, convert, verify = _run_all(["strip-module", src, out_pth], ["convert", src, out_st], ["verify", src])
    # the record's declared size is not its storage's: refused on reading, as torch refuses it
    # ("record size ... does not match"), before any streaming
    for result in (strip, convert):
        assert result.returncode == 3, result.stderr
        assert "holds 28 bytes but the checkpoint declares 24" in _one_line(result.stderr)
    assert verify.returncode == 1 and "holds 28 bytes but the checkpoint declares 24" in verify.stderr
    assert not out_pth.exists() and not out_st.exists() and no_temp_files(tmp_path)


class _CountingFile(io.BytesIO):
    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.bytes_read = 0

    def read(self, n: int | None = -1) -> bytes:
        chunk = super().read(n)
        self.bytes_read += len(chunk)
        return chunk


def test_inflating_stops_at_the_end_of_the_stream() -> None:
    """Compressed bytes after the deflate stream are not read (nor kept in memory)."""
    stream = zlib.compressobj(wbits=-15)
    payload = stream.compress(b"abc" * 1000) + stream.flush()
    f = _CountingFile(payload + bytes(32 << 20))
    assert b"".join(inflate_chunks(f, 0, len(f.getvalue()), 3000, "test")) == b"abc" * 1000
    assert f.bytes_read <= 4 << 20


def test_inflating_a_bomb_stops_at_the_declared_size() -> None:
    """A stream that inflates far past its declared size yields no more than declared, in bounded chunks."""
    stream = zlib.compressobj(9, wbits=-15)
    bomb = stream.compress(bytes(64 << 20)) + stream.flush()  # 64 MiB of zeros in ~64 KB
    yielded = []
    with pytest.raises(BadInputError, match="does not inflate to its declared size"):
        for chunk in inflate_chunks(io.BytesIO(bomb), 0, len(bomb), 10 << 20, "test"):
            yielded.append(len(chunk))
    assert yielded and sum(yielded) <= 10 << 20 and max(yielded) <= 4 << 20


# -- what must keep working ----------------------------------------------------------------------


def _genuine(tmp_path: Path, kind: str) -> Path:
    src = tmp_path / "archive.pth"
    if kind == "protocol-4":
        torch.save(_STATE, src, pickle_protocol=4)
    else:
        torch.save(_STATE, src)
    if kind == "deflated":
        src.write_bytes(_rezip(src.read_bytes(), compression=zipfile.ZIP_DEFLATED))
        with zipfile.ZipFile(src) as z:
            assert {i.compress_type for i in z.infolist()} == {zipfile.ZIP_DEFLATED}
    if kind == "zip64-local-headers":  # sizes in the local headers' zip64 fields, no data descriptors
        with zipfile.ZipFile(io.BytesIO(src.read_bytes())) as z, zipfile.ZipFile(src, "w") as out:
            for info in z.infolist():
                with out.open(zipfile.ZipInfo(info.filename), "w", force_zip64=True) as record:
                    record.write(z.read(info))
    return src


@pytest.mark.parametrize("kind", ["torch-save", "protocol-4", "deflated", "zip64-local-headers"])
def test_genuine_archives_still_work(tmp_path: Path, kind: str) -> None:
    src = _genuine(tmp_path, kind)
    out_pth, out_st = tmp_path / "out.pth", tmp_path / "out.safetensors"
    results = _run_all(
        ["inspect", src], ["strip-module", src, out_pth], ["convert", src, out_st], ["verify", src], ["scan", src]
    )
    for result in results:
        assert result.returncode == 0, (result.args, result.stdout, result.stderr)
    stripped = torch.load(out_pth, weights_only=True, mmap=True)
    converted = load_file(out_st)
    for key, tensor in _STATE.items():
        assert tensor_bytes(stripped[key.removeprefix("module.")]) == tensor_bytes(tensor)
        assert tensor_bytes(converted[key]) == tensor_bytes(tensor)


def test_unknown_records_are_not_carried_into_outputs(tmp_path: Path, base: bytes) -> None:
    """A record torch never reads is left out of every output (a note says so), not copied unchecked."""
    src, out = tmp_path / "extra.pth", tmp_path / "out.pth"
    src.write_bytes(_rezip(base, add=(("archive/extra/notes.txt", b"anything at all"),)))
    result = invoke_cli("strip-module", src, out)
    assert result.returncode == 0, result.stderr
    assert "archive/extra/notes.txt" in result.stderr and "not written to outputs" in result.stderr
    with zipfile.ZipFile(out) as z:
        names = [n.split("/", 1)[1] for n in z.namelist()]
    assert not any("notes" in n for n in names)
    assert names[-2:] == ["version", ".data/serialization_id"]
    assert set(torch.load(out, weights_only=True)) == {"w", "b", "n"}
    assert invoke_cli("scan", src).returncode == 0


def test_version_records_are_checked_and_kept(tmp_path: Path, base: bytes) -> None:
    kept, out = tmp_path / "kept.pth", tmp_path / "out.pth"
    kept.write_bytes(_rezip(base, add=(("archive/.data/version", b"3\n"),)))
    assert invoke_cli("strip-module", kept, out).returncode == 0
    with zipfile.ZipFile(out) as z:
        assert z.read("archive/.data/version") == b"3\n" and z.read("archive/version") == b"3\n"
    bogus = tmp_path / "bogus.pth"
    bogus.write_bytes(_rezip(base, replace={"archive/version": b"3; rm -rf ~\n"}))
    result = invoke_cli("strip-module", bogus, tmp_path / "out2.pth")
    assert result.returncode == 3 and "not a version number" in _one_line(result.stderr)
    assert not (tmp_path / "out2.pth").exists()
