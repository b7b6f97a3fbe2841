"""The legacy reader reads its pickles from a head of the file that doubles while they run past
it: only a pickle cut short by the head is worth a longer read, never one that is wrong."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from ckptfix.errors import BadInputError
from ckptfix.formats import legacy_pickle
from ckptfix.formats.legacy_pickle import MAGIC_NUMBER, PROTOCOL_VERSION, read_legacy


def _heads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    sizes: list[int] = []
    real = legacy_pickle._pread

    def pread(fd: int, size: int, offset: int) -> bytes:
        sizes.append(size)
        return real(fd, size, offset)

    monkeypatch.setattr(legacy_pickle, "_pread", pread)
    return sizes


def _read(path: Path) -> object:
    with path.open("rb") as f:
        return read_legacy(str(path), f, path.stat().st_size, set())


def test_a_corrupt_pickle_is_refused_from_the_first_head(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pickle wrong within the first read (an unknown opcode) fails the same on any longer
    head: re-reading up to the 1 GiB budget would cost memory and work for a refusal."""
    path = tmp_path / "bad.pt"
    header = b"".join(pickle.dumps(v, protocol=2) for v in (MAGIC_NUMBER, PROTOCOL_VERSION, {"little_endian": True}))
    path.write_bytes(header + b"\x80\x02\xff")
    with path.open("r+b") as f:
        f.truncate(16 << 20)  # a big file (sparse): the pickles' budget reaches past it
    sizes = _heads(monkeypatch)
    with pytest.raises(BadInputError, match="corrupt or hostile pickle"):
        _read(path)
    assert max(sizes) == legacy_pickle._FIRST_READ, sizes


def test_pickles_longer_than_the_first_head_are_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    path = tmp_path / "long.pt"
    note = "x" * (3 * legacy_pickle._FIRST_READ // 2)
    torch.save({"w": torch.arange(3.0), "note": note}, path, _use_new_zipfile_serialization=False)
    sizes = _heads(monkeypatch)
    tree = _read(path)
    assert isinstance(tree, dict) and tree["note"] == note and list(tree["w"].shape) == [3]
    assert sizes[:2] == [legacy_pickle._FIRST_READ, path.stat().st_size], sizes  # doubled, capped at the file
