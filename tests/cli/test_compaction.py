"""Storages only partly referenced are written as just the referenced bytes; sharing survives."""

from __future__ import annotations

from pathlib import Path

import torch
from conftest import invoke_cli

import ckptfix


def test_small_slice_of_large_storage_costs_little(tmp_path: Path) -> None:
    big = torch.randn(1 << 20)  # 4 MiB
    head = big[1000:1010]
    tied = torch.randn(64)
    torch.save({"module.head": head, "module.a": tied, "module.b": tied, "module.c": tied[8:16]}, tmp_path / "in.pth")
    assert (tmp_path / "in.pth").stat().st_size > 4 << 20  # torch.save wrote the whole 4 MiB storage
    assert invoke_cli("strip-module", tmp_path / "in.pth", tmp_path / "out.pth").returncode == 0
    assert (tmp_path / "out.pth").stat().st_size < 10 * 4 + (64 << 10)
    out = torch.load(tmp_path / "out.pth", weights_only=True)
    assert torch.equal(out["head"], head)
    assert out["a"].data_ptr() == out["b"].data_ptr()  # ties stay tied
    assert out["c"].untyped_storage().data_ptr() == out["a"].untyped_storage().data_ptr()
    assert torch.equal(out["c"], tied[8:16]) and out["c"].storage_offset() == 8


def test_dropping_the_optimizer_drops_its_bytes_and_compacts_views(tmp_path: Path) -> None:
    flat = torch.randn(1 << 18)  # one flat buffer, as DeepSpeed keeps parameters
    state = {"model": {"w": flat[:100].view(10, 10), "b": flat[100:110]}, "optimizer": {"flat": flat}}
    torch.save(state, tmp_path / "train.pth")
    report = ckptfix.convert(tmp_path / "train.pth", tmp_path / "w.pth", ckptfix.ConvertOptions(drop=["optimizer"]))
    assert report.written and (tmp_path / "w.pth").stat().st_size < 110 * 4 + (64 << 10)
    out = torch.load(tmp_path / "w.pth", weights_only=True)
    assert torch.equal(out["model"]["w"], flat[:100].view(10, 10)) and torch.equal(out["model"]["b"], flat[100:110])
    assert out["model"]["w"].untyped_storage().nbytes() == 110 * 4  # one storage, just the used span
