"""Zip containers read and written as torch reads them (issue 22): a pickle named in other case is
what torch runs, CRCs of copied records are checked, a serialization version torch refuses is
refused -- each compared with the oracle (torch itself, in a child process)."""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import assert_same_tree
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


# =========================================================================== outputs overlapping inputs


def _shards(folder: Path, fmt: str = "safetensors") -> Path:
    import ckptfix

    src = folder.parent / f"{folder.name}-src.pth"
    torch.save({f"layer{i}.weight": torch.arange(64.0) + i for i in range(4)}, src)
    ckptfix.convert(src, folder, ckptfix.ConvertOptions(out_format=fmt, max_shard_size="600B"))
    assert len(list(folder.glob(f"*-of-*.{'bin' if fmt == 'pth' else fmt}"))) > 1
    return folder


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def _assert_overlap_refused(args: list[object], folder: Path, before: dict[str, bytes]) -> None:
    result = ck(*args)
    assert result.returncode == 2, (result.returncode, result.stderr[-1000:])
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("ckptfix: error: ") and "input" in lines[0], result.stderr
    assert "Traceback" not in result.stderr
    assert _snapshot(folder) == before, "an input file was changed"


@pytest.mark.parametrize(
    "spelling", ["same", "index-in", "dotdot", "symlink", "shard-file", "hardlink", "bin-shards", "sharded-into-parent"]
)
def test_an_output_overlapping_the_input_is_refused_and_nothing_is_written(tmp_path: Path, spelling: str) -> None:
    folder = _shards(tmp_path / "shards", "pth" if spelling == "bin-shards" else "safetensors")
    index = next(folder.glob("*.index.json"))
    first = sorted(folder.glob("*-of-*"))[0]
    view = torch_view(first)
    args: list[object] = ["convert", folder, f"{folder}/", "--force", "--max-shard-size", "600B"]
    if spelling == "index-in":
        args[1] = index
    elif spelling == "dotdot":
        args[2] = f"{tmp_path}/x/../shards/"
        (tmp_path / "x").mkdir()
    elif spelling == "symlink":
        (tmp_path / "link").symlink_to(folder)
        args[2] = f"{tmp_path}/link/"
    elif spelling == "shard-file":
        args = ["convert", folder, first, "--force"]
    elif spelling == "hardlink":
        other = tmp_path / "other.safetensors"
        other.hardlink_to(first)
        args = ["convert", folder, other, "--force"]
    elif spelling == "bin-shards":
        args += ["--format", "pth"]
    elif spelling == "sharded-into-parent":
        single = folder / "pytorch_model.bin"
        torch.save({"w": torch.ones(3)}, single)
        args = ["convert", single, f"{folder}/", "--format", "pth", "--force"]
    before = _snapshot(folder)
    _assert_overlap_refused(args, folder, before)
    assert_same_tree(torch_view(first).tree, view.tree)  # torch still reads the input as before


def test_a_dcp_output_replacing_the_input_folder_is_refused(tmp_path: Path) -> None:
    import shutil

    folder = tmp_path / "dcp"
    shutil.copytree(Path(__file__).resolve().parents[2] / "fixtures" / "dcp_sharded_2ranks", folder)
    before = _snapshot(folder)
    _assert_overlap_refused(["convert", folder, folder, "--format", "dcp", "--force"], folder, before)
    _assert_overlap_refused(["convert", folder, tmp_path, "--format", "dcp", "--force"], folder, before)


def test_a_file_written_beside_its_input_is_fine(tmp_path: Path) -> None:
    """Not an overlap: a single file's folder receives shards under names the input does not have."""
    src = tmp_path / "ddp.pth"
    torch.save({"module.w": torch.arange(300.0), "module.b": torch.ones(200)}, src)
    assert ck("convert", src, f"{tmp_path}/", "--max-shard-size", "1KB").returncode == 0
    shard = sorted(tmp_path.glob("model-*-of-*.safetensors"))[0]
    assert torch_view(shard).loads
    out = tmp_path / "bare.pth"
    assert ck("strip-module", src, out).returncode == 0
    assert set(torch_view(out).tree) == {"w", "b"}


# =========================================================================== safetensors numbers


@pytest.mark.parametrize("number", [b"1e400", b"-" + b"9" * 400, b"[1e309]"])
def test_a_conversion_refuses_a_header_number_the_library_refuses(tmp_path: Path, number: bytes) -> None:
    from safetensors import safe_open

    header = b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":' + number + b"}}"
    path = tmp_path / "odd.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))
    with pytest.raises(Exception, match="out of range"):  # the loader itself refuses it
        safe_open(str(path), "pt")
    out = tmp_path / "out.pth"
    assert_refused(ck("convert", path, out), "out of range", out=out)
