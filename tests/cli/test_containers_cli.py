"""Zip containers read and written as torch reads them (issue 22): a pickle named in other case is
what torch runs, CRCs of copied records are checked, a serialization version torch refuses is
refused -- each compared with the oracle (torch itself, in a child process)."""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path

import pytest
import torch
from hostile import assert_refused, ck, system_call
from oracle import assert_reads_as_torch, assert_scan_sees_what_torch_resolves, torch_view

from ckptfix.analysis.scan import scan_path


def _zip_edit(
    src: Path, dest: Path, rename: dict[str, str] | None = None, data: dict[str, bytes] | None = None
) -> Path:
    """``src`` re-zipped (stored) with records renamed or replaced, by name inside the archive."""
    with zipfile.ZipFile(src) as z, zipfile.ZipFile(dest, "w") as out:
        for info in z.infolist():
            top, inner = info.filename.split("/", 1)
            content = (data or {}).get(inner, z.read(info))
            out.writestr(f"{top}/{(rename or {}).get(inner, inner)}", content)
    return dest


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small and a large (>= 64 KiB: copied by the kernel) storage, as torch.save writes them."""
    path = tmp_path_factory.mktemp("zip") / "base.pth"
    torch.save({"module.small": torch.arange(6.0), "module.big": torch.arange(20000.0)}, path)
    return path


# =========================================================================== DATA.PKL


@pytest.mark.parametrize("name", ["DATA.PKL", "Data.pkl", "data.PKL"])
def test_a_pickle_named_in_other_case_is_what_torch_runs_and_scan_sees_it(
    base: Path, tmp_path: Path, name: str
) -> None:
    evil = system_call(tmp_path / "ran")
    path = _zip_edit(base, tmp_path / "evil.pth", rename={"data.pkl": name}, data={"data.pkl": evil})
    view = assert_scan_sees_what_torch_resolves(path)
    assert "posix.system" in view.globals, view  # torch's lookup ignores case
    assert scan_path(path).dangerous
    assert_refused(ck("strip-module", path, tmp_path / "out.pth"), name, out=tmp_path / "out.pth")
    assert not (tmp_path / "ran").exists()


# =========================================================================== CRCs of copied records


def _with_crc(src: Path, dest: Path, inner: str, crc: int) -> Path:
    """``src`` with the CRC of record ``inner`` set to ``crc`` in its local header and directory."""
    data = bytearray(src.read_bytes())
    with zipfile.ZipFile(src) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/" + inner))
    struct.pack_into("<I", data, info.header_offset + 14, crc)
    at = data.index(b"PK\x01\x02")  # the first directory entry (a stored record holds no such bytes)
    while True:
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", data, at + 28)
        if data[at + 46 : at + 46 + name_len].decode().endswith("/" + inner):
            struct.pack_into("<I", data, at + 16, crc)
            break
        at += 46 + name_len + extra_len + comment_len
    dest.write_bytes(data)
    return dest


@pytest.mark.parametrize("record", ["data/0", "data/1"])  # small (pread) and big (kernel copy)
@pytest.mark.parametrize("command", [("strip-module",), ("convert", "--format", "pth"), ("strip-module", "--verify")])
def test_a_copied_record_whose_crc_is_wrong_is_refused(
    base: Path, tmp_path: Path, record: str, command: tuple[str, ...]
) -> None:
    with zipfile.ZipFile(base) as z:
        crc = z.getinfo(f"base/{record}").CRC
    path = _with_crc(base, tmp_path / "bad.pth", record, crc ^ 0x5A5A5A5A)
    assert torch_view(path).loads  # torch itself never checks a CRC
    out = tmp_path / "out.pth"
    assert_refused(ck(*command, path, out), "CRC32", record, out=out)


def test_records_saved_without_crcs_still_convert(tmp_path: Path) -> None:
    """CRC 0 everywhere (``set_crc32_options(False)``) is torch's own choice, not corruption."""
    path = tmp_path / "nocrc.pth"
    torch.serialization.set_crc32_options(False)
    try:
        torch.save({"module.big": torch.arange(20000.0), "module.small": torch.ones(3)}, path)
    finally:
        torch.serialization.set_crc32_options(True)
    out = tmp_path / "out.pth"
    assert ck("convert", "--format", "pth", path, out).returncode == 0
    assert_reads_as_torch(path, out)


# =========================================================================== serialization version


@pytest.mark.parametrize("value", [b"0\n", b"11\n", b"99\n"])
def test_a_version_torch_refuses_is_refused(base: Path, tmp_path: Path, value: bytes) -> None:
    path = _zip_edit(base, tmp_path / "v.pth", data={"version": value})
    view = torch_view(path)
    assert not view.loads and "version" in (view.weights_only_error or ""), view
    out = tmp_path / "out.pth"
    assert_refused(ck("convert", "--format", "pth", path, out), "version", out=out)


@pytest.mark.parametrize("value", [b"1\n", b"10\n", b"3"])
def test_a_version_torch_reads_is_carried(base: Path, tmp_path: Path, value: bytes) -> None:
    path = _zip_edit(base, tmp_path / "v.pth", data={"version": value})
    assert torch_view(path).loads
    out = tmp_path / "out.pth"
    assert ck("convert", "--format", "pth", path, out).returncode == 0
    assert_reads_as_torch(path, out)
