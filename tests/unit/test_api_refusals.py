"""``ckptfix.load`` vets a file before torch sees it and speaks only CkptfixErrors: a file whose
storages claim more than it holds is refused before torch is called (torch would allocate the
claim first: ``UntypedStorage(2**40)``), with ``unsafe_load=True`` too; and whatever torch still
refuses comes back as one BadInputError, never torch's own exception. Compared with the oracle."""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hostile import PROTO, g, items, legacy_file, make_base_zip, make_legacy_header, pid, tensor, with_data_pkl
from oracle import torch_view

import ckptfix

NAMESPACE = g("argparse", "Namespace") + b")\x81"  # unusual and harmless: --unsafe-load's case


def huge_legacy(tmp_path: Path, numel: int) -> Path:
    tree = b"\x80\x02" + items(("ns", NAMESPACE), ("w", tensor(pid("0", numel, legacy=True), size=(1,)))) + b"."
    return legacy_file(make_legacy_header(), tree, [("0", 1, bytes(4))], tmp_path / "huge.pt")


def huge_zip(tmp_path: Path, numel: int) -> Path:
    pkl = PROTO + items(("ns", NAMESPACE), ("w", tensor(pid("0", numel), size=(1,)))) + b"."
    return with_data_pkl(make_base_zip(tmp_path), pkl, tmp_path / "huge.pth")


@pytest.mark.parametrize("numel", [2**38, 2**20, 5])
@pytest.mark.parametrize("make", [huge_legacy, huge_zip])
@pytest.mark.parametrize("unsafe_load", [False, True])
def test_storage_claims_are_checked_before_torch_is_called(
    make: Any, numel: int, unsafe_load: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = make(tmp_path, numel)
    called = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: called.append(a))
    with pytest.raises(ckptfix.BadInputError, match="declare"):
        ckptfix.load(path, unsafe_load=unsafe_load)
    assert not called, "torch.load was asked to read a file whose storages claim more than it holds"


def version_99(tmp_path: Path) -> Path:
    src, dest = make_base_zip(tmp_path), tmp_path / "v99.pth"
    with zipfile.ZipFile(src) as z, zipfile.ZipFile(dest, "w") as out:
        for info in z.infolist():
            out.writestr(info.filename, b"99\n" if info.filename.endswith("/version") else z.read(info))
    return dest


def test_what_torch_refuses_comes_back_as_a_ckptfix_error(tmp_path: Path) -> None:
    path = version_99(tmp_path)
    assert "version 99" in (torch_view(path).weights_only_error or "")
    for mmap in (True, False):
        with pytest.raises(ckptfix.CkptfixError, match="version 99"):
            ckptfix.load(path, mmap=mmap)
