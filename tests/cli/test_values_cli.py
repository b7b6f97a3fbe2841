"""Offsets, sizes and views at the edges, through the CLI, compared with torch (the oracle):
an empty tensor at a huge storage offset is written as torch reads it (or refused where torch
refuses it), and views that expand a few stored bytes to a terabyte are compared and verified
by their storage, within a named budget, in bounded memory -- never an internal error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hostile import PROTO, assert_refused, ck, items, make_base_zip, pid, tensor, with_data_pkl
from oracle import assert_reads_as_torch, torch_view
from safetensors.torch import load_file


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_base_zip(tmp_path_factory.mktemp("base"))


@pytest.mark.parametrize("offset", [2**62, 2**63 - 1, 2**63, 2**64 + 5, 2**80])
def test_an_empty_tensor_at_a_huge_offset(offset: int, base: Path, tmp_path: Path) -> None:
    pkl = PROTO + items(("w", tensor(pid("0", 4), offset=offset, size=(0,))), ("x", tensor(pid("0", 4)))) + b"."
    source = with_data_pkl(base, pkl, tmp_path / "in.pth")
    view = torch_view(source)
    for out in (tmp_path / "out.pth", tmp_path / "out.safetensors"):
        result = ck("convert", source, out, "--verify")
        if not view.loads:  # torch refuses the offset: so does ckptfix, with one line
            assert_refused(result, "offset", out=out)
            continue
        assert result.returncode == 0, result.stderr
        if out.suffix == ".pth":
            assert_reads_as_torch(source, out)
        else:
            loaded = load_file(out)
            assert loaded["w"].shape == (0,) and torch.equal(loaded["x"], view.tree["x"])
    publish = ck("publish", source, tmp_path / "pub")
    assert publish.returncode == (0 if view.loads else 3), publish.stderr


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A torch.save zip whose storage data/0 holds arange(2**16) as float32 (256 KiB)."""
    path = tmp_path_factory.mktemp("wide") / "wide.pth"
    torch.save({"w": torch.arange(2.0**16)}, path)
    return path


def expanded(base: Path, dest: Path, shape: tuple[int, ...], stride: tuple[int, ...], offset: int = 0) -> Path:
    """``{"w": a view of base's storage}``: a stride-0 view of a terabyte is a few stored bytes."""
    numel = 4 if base.name == "base.pth" else 2**16
    pkl = PROTO + items(("w", tensor(pid("0", numel), offset, shape, stride))) + b"."
    return with_data_pkl(base, pkl, dest)


TIB = (2**18, 2**20)  # float32: 1 TiB


def test_a_terabyte_view_is_diffed_and_verified_by_its_storage(base: Path, tmp_path: Path) -> None:
    a = expanded(base, tmp_path / "a.pth", TIB, (0, 0))
    b = expanded(base, tmp_path / "b.pth", TIB, (0, 0))
    result = ck("diff", a, b)
    assert result.returncode == 0 and "equal" in result.stdout, result.stderr
    other = expanded(base, tmp_path / "c.pth", TIB, (0, 0), offset=1)  # 1.0 everywhere instead of 0.0
    result = ck("diff", a, other, "--json")
    assert result.returncode == 1, result.stderr
    assert f'"differing_elements": {2**38}' in result.stdout
    out = tmp_path / "out.pth"
    result = ck("convert", a, out, "--verify")
    assert result.returncode == 0, result.stderr
    assert torch_view(out).tree["w"].shape == TIB


def test_expanding_views_compared_element_by_element_are_bounded_by_a_named_budget(wide: Path, tmp_path: Path) -> None:
    """A column broadcast and a row broadcast of one 2**16 vector: 16 GiB each, nothing in common
    to cut away, so diff would compare 16 GiB element by element."""
    n = 2**16
    rows = expanded(wide, tmp_path / "rows.pth", (n, n), (0, 1))
    cols = expanded(wide, tmp_path / "cols.pth", (n, n), (1, 0))
    assert torch_view(rows).loads and torch_view(cols).loads
    assert_refused(ck("diff", rows, cols), "budget", "'w'")
    out = tmp_path / "rows.safetensors"
    assert_refused(ck("convert", rows, out), "--max-expand", out=out)


def test_an_expanding_view_within_the_budget_is_written_and_verified_in_pieces(wide: Path, tmp_path: Path) -> None:
    """32 MiB out of 16 KiB stored, in pieces of GATHER_CHUNK (16 MiB): diff and --verify agree."""
    a = expanded(wide, tmp_path / "a.pth", (2**11, 2**12), (0, 1))
    out = tmp_path / "a.safetensors"
    result = ck("convert", a, out, "--verify", "--max-expand", "100MB")
    assert result.returncode == 0, result.stderr
    assert torch.equal(load_file(out)["w"], torch_view(a).tree["w"])
    assert ck("diff", a, out).returncode == 0
