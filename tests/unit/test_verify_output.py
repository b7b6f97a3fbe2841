"""--verify re-reads what was written; a corrupted write is caught (exit 4) and replaces nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import FIXTURES

import ckptfix
from ckptfix.fileio import atomic as output
from ckptfix.fileio.ziparchive import read_directory


def _flip_tensor_byte(temp: Path) -> None:
    """The seam: damage the written file after the writer is done, as a bad disk would."""
    data = bytearray(temp.read_bytes())
    if data[:2] == b"PK":
        with open(temp, "rb") as f:
            records = read_directory(f, len(data), str(temp))
        offset = next(r.data_offset for name, r in records.items() if "/data/" in name and r.size)
    else:
        offset = len(data) - 3  # safetensors: the last tensor's bytes
    data[offset] ^= 0x40
    temp.write_bytes(bytes(data))


@pytest.fixture
def corrupting_writer():
    output.WRITE_HOOKS.append(_flip_tensor_byte)
    yield
    output.WRITE_HOOKS.remove(_flip_tensor_byte)


@pytest.mark.parametrize("name", ["out.pth", "out.safetensors"])
def test_verify_catches_corrupted_output(tmp_path: Path, corrupting_writer: None, name: str) -> None:
    out = tmp_path / name
    with pytest.raises(ckptfix.CannotWriteError, match="failed verification") as info:
        ckptfix.convert(FIXTURES / "dataparallel_tinynet.pth", out, ckptfix.ConvertOptions(verify=True))
    assert info.value.exit_code == 4
    assert not out.exists() and not list(tmp_path.iterdir())


def test_in_place_verifies_by_default_and_keeps_the_original(tmp_path: Path, corrupting_writer: None) -> None:
    src = tmp_path / "model.pth"
    src.write_bytes((FIXTURES / "dataparallel_tinynet.pth").read_bytes())
    before = src.read_bytes()
    with pytest.raises(ckptfix.CannotWriteError):
        ckptfix.fix_prefix(src, in_place=True)
    assert src.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["model.pth"]


def test_verify_passes_on_honest_writes(tmp_path: Path) -> None:
    for name in ("a.pth", "a.safetensors"):
        report = ckptfix.convert(
            FIXTURES / "lightning_tinynet.ckpt",
            tmp_path / name,
            ckptfix.ConvertOptions(select="state_dict", strip_prefixes=["model."], verify=True),
        )
        assert report.written and report.verify_seconds is not None
    assert set(torch.load(tmp_path / "a.pth", weights_only=True)) == {
        k[len("model.") :] for k in torch.load(FIXTURES / "lightning_tinynet.ckpt", weights_only=True)["state_dict"]
    }
