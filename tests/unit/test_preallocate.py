"""A safetensors output's blocks allocated ahead, in one call, where that is cheap and sure
(``OutputStream.reserve``, ``fileio/ranges.py``): ext4 files mapped by extents. Same bytes out;
an output reserved but written shorter is cut to what was written; a full disk fails before the
copy, as a write error, and leaves nothing behind."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import ckptfix
from ckptfix.errors import CannotWriteError
from ckptfix.fileio import ranges
from ckptfix.fileio.ranges import OutputStream


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three tensors (one 256 KiB, copied as a range) in a torch zip."""
    path = tmp_path_factory.mktemp("prealloc") / "in.pth"
    torch.save({"a": torch.arange(65536.0), "b": torch.ones(3, 5), "c": torch.zeros(7, dtype=torch.int64)}, path)
    return path


def _recording(monkeypatch: pytest.MonkeyPatch, *, allowed: bool) -> list[tuple[int, int]]:
    """Every ``posix_fallocate`` call (offset, length), with ``preallocates`` answering ``allowed``."""
    calls: list[tuple[int, int]] = []
    real = os.posix_fallocate

    def recording(fd: int, offset: int, length: int) -> None:
        calls.append((offset, length))
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", recording)
    monkeypatch.setattr(ranges, "_PREALLOCATE_FROM", 0)  # the fixture is small
    monkeypatch.setattr(ranges, "preallocates", lambda fd: allowed)
    return calls


def test_a_safetensors_output_is_reserved_once_at_its_exact_size(
    source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _recording(monkeypatch, allowed=True)
    ckptfix.convert(source, tmp_path / "reserved.safetensors")
    assert calls == [(0, (tmp_path / "reserved.safetensors").stat().st_size)]
    calls = _recording(monkeypatch, allowed=False)
    ckptfix.convert(source, tmp_path / "plain.safetensors")
    assert calls == []
    assert (tmp_path / "reserved.safetensors").read_bytes() == (tmp_path / "plain.safetensors").read_bytes()
    stored, expected = load_file(tmp_path / "reserved.safetensors"), torch.load(source, weights_only=True)
    assert stored.keys() == expected.keys() and all(torch.equal(stored[k], expected[k]) for k in expected)


def test_what_was_reserved_but_not_written_is_cut_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _recording(monkeypatch, allowed=True)
    with open(tmp_path / "out", "wb") as f:
        stream = OutputStream(f)
        stream.reserve(100_000)
        stream.write(b"0123456789")
        stream.flush()
    assert calls == [(0, 100_000)]
    assert (tmp_path / "out").read_bytes() == b"0123456789"


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EOPNOTSUPP])
def test_a_full_disk_fails_before_the_copy_and_other_refusals_are_ignored(
    source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    _recording(monkeypatch, allowed=True)

    def refusing(fd: int, offset: int, length: int) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "posix_fallocate", refusing)
    out = tmp_path / "out.safetensors"
    if code == errno.ENOSPC:
        with pytest.raises(CannotWriteError, match="no space left"):
            ckptfix.convert(source, out)
        assert list(tmp_path.iterdir()) == []  # neither the output nor a temporary file
    else:
        ckptfix.convert(source, out)
        assert load_file(out).keys() == {"a", "b", "c"}


@pytest.mark.parametrize(
    ("file_system", "flags", "expected"),
    [("ext4", 0x80000, True), ("ext4", 0, False), ("xfs", 0x80000, False), ("nfs4", 0x80000, False)],
)
def test_only_ext4_files_mapped_by_extents_are_preallocated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, file_system: str, flags: int, expected: bool
) -> None:
    """Elsewhere ``posix_fallocate`` may write a byte into every block instead (ext2/3-style
    files, NFS before 4.2), or the blocks would be dropped again where the copy shares them."""

    def ioctl(fd: int, request: int, buffer: Any, mutate: bool = True) -> int:
        assert request == ranges._FS_IOC_GETFLAGS[os.uname().machine]
        buffer[:4] = flags.to_bytes(4, "little")
        return 0

    monkeypatch.setattr(ranges, "_file_system", lambda device: file_system)
    monkeypatch.setattr(fcntl, "ioctl", ioctl)
    (tmp_path / "f").write_bytes(b"")
    with open(tmp_path / "f", "rb") as f:
        assert ranges.preallocates(f.fileno()) is (expected and os.uname().machine in ranges._FS_IOC_GETFLAGS)


def test_the_flags_are_read_from_the_real_file(tmp_path: Path) -> None:
    """The ioctl itself, unpatched: on ext4 a new file is mapped by extents (``lsattr``'s ``e``)."""
    (tmp_path / "f").write_bytes(b"")
    with open(tmp_path / "f", "rb") as f:
        on_ext4 = ranges._file_system(os.fstat(f.fileno()).st_dev) == "ext4"
        assert ranges.preallocates(f.fileno()) is (on_ext4 and os.uname().machine in ranges._FS_IOC_GETFLAGS)
