"""The torch zip container: odd inputs torch writes or accepts, and the exact layout we write."""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, assert_same_tree, reference_strip

import ckptfix
from ckptfix.fileio.atomic import atomic_output
from ckptfix.formats.torchzip import write_torch_zip

DP = FIXTURES / "dataparallel_tinynet.pth"


def _rezip(src: Path, dest: Path, *, compression: int = zipfile.ZIP_STORED, replace: dict | None = None) -> None:
    with zipfile.ZipFile(src) as z, zipfile.ZipFile(dest, "w", compression) as out:
        for info in z.infolist():
            name = info.filename.split("/", 1)[1]
            out.writestr(info.filename, (replace or {}).get(name, z.read(info)))


def test_crc32_disabled_checkpoint(tmp_path: Path) -> None:
    """set_crc32_options(False) writes CRC 0; Python's zipfile rejects it, we must not."""
    src, out = tmp_path / "nocrc.pth", tmp_path / "out.pth"
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(torch.load(DP, weights_only=True), src)
    finally:
        torch.serialization.set_crc32_options(True)
    with zipfile.ZipFile(src) as z, pytest.raises(zipfile.BadZipFile):
        z.read(next(n for n in z.namelist() if "/data/" in n))
    report = ckptfix.fix_prefix(src, out)
    assert report.written
    assert_same_tree(torch.load(out, weights_only=True), reference_strip(src))


def test_deflated_records_are_read_and_written_stored(tmp_path: Path) -> None:
    src, out = tmp_path / "deflated.pth", tmp_path / "out.pth"
    _rezip(DP, src, compression=zipfile.ZIP_DEFLATED)
    ckptfix.fix_prefix(src, out)
    assert_same_tree(torch.load(out, mmap=True, weights_only=True), reference_strip(DP))
    with zipfile.ZipFile(out) as z:
        assert {i.compress_type for i in z.infolist()} == {zipfile.ZIP_STORED}
        assert z.testzip() is None  # every CRC correct


def test_output_layout_matches_torch(tmp_path: Path) -> None:
    """64-byte aligned records, torch's record order, storages numbered in pickle order."""
    out = tmp_path / "out.pth"
    ckptfix.fix_prefix(DP, out)
    data = out.read_bytes()
    with zipfile.ZipFile(out) as z:
        names = [i.filename.split("/", 1)[1] for i in z.infolist()]
        assert z.testzip() is None
        for info in z.infolist():
            name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26 : info.header_offset + 30])
            assert (info.header_offset + 30 + name_len + extra_len) % 64 == 0, info.filename
    storages = [n for n in names if n.startswith("data/")]
    assert names[:4] == ["data.pkl", ".format_version", ".storage_alignment", "byteorder"]
    assert storages == [f"data/{i}" for i in range(len(storages))]
    assert names[-2:] == ["version", ".data/serialization_id"]


def test_torch_offset_calculating_loader_accepts_output(tmp_path: Path) -> None:
    """torch's calculate_storage_offsets mode assumes miniz's exact layout; ours must match it."""
    from torch.utils.serialization import config

    out = tmp_path / "out.pth"
    ckptfix.fix_prefix(FIXTURES / "lightning_tinynet.ckpt", out, prefix="model.")
    config.load.calculate_storage_offsets = True
    try:
        fast = torch.load(out, mmap=True, weights_only=True)
    finally:
        config.load.calculate_storage_offsets = False
    assert_same_tree(fast, torch.load(out, weights_only=True))
    assert_same_tree(fast["state_dict"], reference_strip(FIXTURES / "lightning_tinynet.ckpt", "model.")["state_dict"])


def test_zip64_records_load_in_torch_and_zipfile(tmp_path: Path) -> None:
    """Records past 4 GiB use zip64 fields; forced on here so a small file exercises them."""
    ckpt = ckptfix.read_checkpoint(DP)
    out = tmp_path / "zip64.pth"
    with atomic_output(out) as f:
        write_torch_zip(ckpt.root, f, source=ckpt.archive, zip64_threshold=1)
    with zipfile.ZipFile(out) as z:
        assert z.testzip() is None
    assert_same_tree(torch.load(out, weights_only=True), torch.load(DP, weights_only=True))
    assert_same_tree(torch.load(out, mmap=True, weights_only=True), torch.load(DP, weights_only=True))
    reread = ckptfix.read_checkpoint(out)
    assert len(reread.root) == len(ckpt.root)


def test_big_endian_byteorder_is_kept(tmp_path: Path) -> None:
    """A file marked big-endian is byte-swapped by torch on load; we must keep the mark."""
    src, out = tmp_path / "big.pth", tmp_path / "out.pth"
    _rezip(DP, src, replace={"byteorder": b"big"})
    ckptfix.fix_prefix(src, out)
    assert_same_tree(torch.load(out, weights_only=True), reference_strip(src))


def test_storage_shared_by_two_dtypes_views_and_offsets(tmp_path: Path) -> None:
    """Tied weights stay one storage; a slice keeps its offset into the shared storage."""
    base = torch.arange(24, dtype=torch.float32)
    sd = {
        "module.emb.weight": base.view(4, 6),
        "module.head.weight": base.view(4, 6),
        "module.part": base[5:11].view(2, 3),
        "module.t": base.view(4, 6).t(),
    }
    src, out = tmp_path / "tied.pth", tmp_path / "out.pth"
    torch.save(sd, src)
    ckptfix.fix_prefix(src, out)
    loaded = torch.load(out, weights_only=True)
    assert loaded["emb.weight"].untyped_storage().data_ptr() == loaded["head.weight"].untyped_storage().data_ptr()
    assert loaded["part"].storage_offset() == 5 and loaded["t"].stride() == (1, 6)
    with zipfile.ZipFile(out) as z:
        assert sum("/data/" in n for n in z.namelist()) == 1


def _exotic_cases() -> dict[str, torch.Tensor]:
    with_attr = torch.arange(6.0).view(2, 3)
    with_attr.note = "kept"  # tensors with Python attributes pickle via _rebuild_from_type_v2
    return {
        "attribute": with_attr,
        "sparse_coo": torch.eye(3).to_sparse(),
        "sparse_csr": torch.eye(3).to_sparse_csr(),
        "quantized": torch.quantize_per_tensor(torch.linspace(-1, 1, 5), 0.1, 3, torch.qint8),
        "meta": torch.empty(3, device="meta"),
        "conj": torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64).conj(),
    }


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("kind", list(_exotic_cases()))
def test_other_tensor_kinds_pass_through_unchanged(tmp_path: Path, kind: str) -> None:
    """Allow-listed calls we do not model (sparse, quantized, meta...) are written back as they were."""
    src, out = tmp_path / "in.pth", tmp_path / "out.pth"
    torch.save({f"module.{kind}": _exotic_cases()[kind], "module.plain": torch.ones(2)}, src)
    assert ckptfix.fix_prefix(src, out).written
    expected, got = torch.load(src, weights_only=True)[f"module.{kind}"], torch.load(out, weights_only=True)[kind]
    assert (got.layout, got.dtype, got.shape, got.device) == (
        expected.layout,
        expected.dtype,
        expected.shape,
        expected.device,
    )
    if kind == "quantized":
        assert torch.equal(got.int_repr(), expected.int_repr()) and got.q_scale() == expected.q_scale()
    elif kind != "meta":
        assert torch.equal(got.resolve_conj().to_dense(), expected.resolve_conj().to_dense())
    assert getattr(got, "note", None) == getattr(expected, "note", None)
