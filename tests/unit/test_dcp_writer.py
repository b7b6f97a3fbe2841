"""``--format dcp`` written without torch (issue 24): the folder is what torch's own
``FileSystemReader`` reads -- checked with ``dcp_to_torch_save`` and ``dcp.load(no_dist=True)``
against the source, bit for bit -- and its ``.metadata`` equals what ``dcp.save`` writes for the
same state dict. The FSDP2 load on two ranks is tests/e2e/test_dcp_fsdp.py."""

from __future__ import annotations

import errno
import pickle
import shutil
import sys
import tracemalloc
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_same_tree, no_temp_files

import ckptfix
from ckptfix.analysis.scan import scan_path
from ckptfix.errors import BadInputError, CannotWriteError
from ckptfix.formats import dcp_writer
from ckptfix.formats.dcp_writer import write_dcp


def _source() -> dict[str, Any]:
    """Every kind of entry a DCP folder holds: dtypes, views (a transpose, a strided slice, a
    narrow of a bigger storage), a scalar, an empty tensor, and values torch stores as bytes
    (ints, strings, tuples, a list of ints) beside a list that holds a tensor."""
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {
        "w": base,
        "t": base.t(),
        "sl": base[1:4, ::2],
        "row": base[2],
        "b": torch.linspace(-3, 3, 7, dtype=torch.bfloat16),
        "h": torch.tensor([[1.5, -2.25], [65504.0, 1e-7]], dtype=torch.float16),
        "i": torch.arange(-3, 4, dtype=torch.int32),
        "u": torch.arange(5, dtype=torch.uint8),
        "flags": torch.tensor([True, False, True]),
        "s": torch.tensor(3.0, dtype=torch.float64),
        "e": torch.zeros(0, 3),
        "step": 7,
        "name": "run-1",
        "nested": {"a": torch.arange(5, dtype=torch.int64).reshape(5, 1), "t": (1, 2.5), "d": {"q": [1, 2]}},
        "lst": [torch.ones(2), 5, {"x": torch.zeros(1)}],
        "pair": (torch.ones(2), "x"),  # a tuple is one value to torch, tensor and all
    }


def _target(source: Any) -> Any:
    """A state dict of the same structure to ``dcp.load`` into: zeroed tensors, None values."""
    if isinstance(source, torch.Tensor):
        return torch.zeros_like(source)
    if isinstance(source, dict):
        return {k: _target(v) for k, v in source.items()}
    if isinstance(source, list) and any(isinstance(v, (torch.Tensor, dict)) for v in source):
        return [_target(v) for v in source]
    return None


def _through_torch(folder: Path, tmp_path: Path) -> Any:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(folder, tmp_path / "back.pth")
    return torch.load(tmp_path / "back.pth", weights_only=False)


@pytest.fixture(scope="module")
def source_pth(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dcp_src") / "src.pth"
    torch.save(_source(), path)
    return path


@pytest.mark.parametrize("files", [1, 3])
def test_the_folder_loads_in_torch_as_the_source(source_pth: Path, tmp_path: Path, files: int) -> None:
    import torch.distributed.checkpoint as dcp

    out = tmp_path / "out"
    written = write_dcp(ckptfix.read_checkpoint(source_pth).root, out, overwrite=False, files=files)
    assert [p.name for p in written] == [".metadata", *(f"__{i}_0.distcp" for i in range(files))]
    assert no_temp_files(tmp_path)
    source = _source()
    assert_same_tree(_through_torch(out, tmp_path), source, check_stride=False)
    target = _target(source)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=str(out), no_dist=True)
    assert_same_tree(target, source, check_stride=False)
    # ckptfix reads its own folder back, lazily, without torch's pickle.load
    back = tmp_path / "back_ckptfix.pth"
    ckptfix.convert(out, back)
    assert_same_tree(torch.load(back, weights_only=True), source, check_stride=False)
    scanned = scan_path(out)
    assert not scanned.error and not scanned.dangerous and not scanned.unknown, scanned


def test_metadata_is_what_dcp_save_writes(source_pth: Path, tmp_path: Path) -> None:
    """Same keys in the same order, same tensor descriptions (dtype, size, chunks), same planner
    paths, the same items in the same order; only where the bytes land may differ."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_source(), checkpoint_id=str(tmp_path / "theirs"), no_dist=True)
    write_dcp(ckptfix.read_checkpoint(source_pth).root, tmp_path / "ours", overwrite=False)
    with open(tmp_path / "theirs" / ".metadata", "rb") as f:
        theirs = pickle.load(f)  # written by torch in this test
    with open(tmp_path / "ours" / ".metadata", "rb") as f:
        ours = pickle.load(f)  # written by ckptfix: the point of the test is that plain pickle reads it
    assert list(ours.state_dict_metadata.items()) == list(theirs.state_dict_metadata.items())
    assert ours.planner_data == theirs.planner_data and ours.version == theirs.version
    assert list(ours.storage_data) == list(theirs.storage_data)
    assert [i.relative_path for i in ours.storage_data.values()] == ["__0_0.distcp"] * len(theirs.storage_data)


def test_split_files_cut_tensors_as_torch_chunk_does(tmp_path: Path) -> None:
    """``files=3``: piece i of every tensor with >= 2 rows is ``torch.chunk(t, 3)[i]``, in file i
    (what FSDP2/DTensor ``Shard(0)`` gives rank i of 3); smaller ones stay whole."""
    torch.save({"a": torch.arange(20.0).reshape(10, 2), "b": torch.ones(2), "c": torch.ones(1, 4)}, tmp_path / "s.pth")
    write_dcp(ckptfix.read_checkpoint(tmp_path / "s.pth").root, tmp_path / "out", overwrite=False, files=3)
    with open(tmp_path / "out" / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    chunks = metadata.state_dict_metadata["a"].chunks
    pieces = torch.chunk(torch.empty(10, 2), 3)
    assert [tuple(c.sizes) for c in chunks] == [tuple(p.shape) for p in pieces] == [(4, 2), (4, 2), (2, 2)]
    assert [c.offsets[0] for c in chunks] == [0, 4, 8]
    files = {(k.fqn, k.index): v.relative_path for k, v in metadata.storage_data.items()}
    assert [files["a", i] for i in range(3)] == ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    assert len(metadata.state_dict_metadata["b"].chunks) == 2  # 2 rows: cut in two
    assert len(metadata.state_dict_metadata["c"].chunks) == 1  # one row: whole


def test_writing_does_not_import_torch(source_pth: Path, tmp_path: Path) -> None:
    """The whole DCP write (tensors, values, .metadata) runs with torch hidden from imports."""
    saved = {name: mod for name, mod in sys.modules.items() if name == "torch" or name.startswith("torch.")}
    for name in saved:
        sys.modules[name] = None  # type: ignore[assignment]  # an import of torch now fails
    try:
        report = ckptfix.convert(source_pth, tmp_path / "out", ckptfix.ConvertOptions(out_format="dcp", dcp_files=2))
    finally:
        sys.modules.update(saved)
    assert report.written and len(report.outputs) == 3
    assert_same_tree(_through_torch(tmp_path / "out", tmp_path), _source(), check_stride=False)


def test_memory_stays_at_one_tensor(tmp_path: Path) -> None:
    """Python memory stays far below the checkpoint's size: contiguous tensors are copied from
    the source by the kernel, a view is gathered one piece at a time."""
    mib = 1 << 20
    state = {f"layer{i}.weight": torch.full((mib // 4,), float(i)) for i in range(8)}  # 8 x 1 MiB
    state["view"] = torch.arange(float(mib // 4)).reshape(256, 1024).t()  # 1 MiB, gathered
    torch.save(state, tmp_path / "big.pth")
    root = ckptfix.read_checkpoint(tmp_path / "big.pth").root
    tracemalloc.start()
    try:
        write_dcp(root, tmp_path / "out", overwrite=False, files=2)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * mib, peak  # about the view (gathered in halves, then joined), not the 9 MiB written
    assert_same_tree(_through_torch(tmp_path / "out", tmp_path), state, check_stride=False)


def _sparse() -> Any:
    return torch.eye(2).to_sparse()


@pytest.mark.parametrize(
    ("tree", "error", "message"),
    [
        ([torch.ones(1)], CannotWriteError, "dict at the top level"),
        ({"a.b": torch.ones(1), "a": {"b": torch.ones(1)}}, BadInputError, "two entries flatten to the key 'a.b'"),
        ({"s": _sparse()}, BadInputError, "s is a tensor kind DCP stores only through torch"),
        ({("k", 1): torch.ones(1)}, BadInputError, "is not a string or a number"),
    ],
)
def test_what_dcp_cannot_hold_is_refused_before_writing(
    tmp_path: Path, tree: Any, error: type[Exception], message: str
) -> None:
    torch.save(tree, tmp_path / "in.pth")
    root = ckptfix.read_checkpoint(tmp_path / "in.pth").root
    with pytest.raises(error, match=message):
        write_dcp(root, tmp_path / "out", overwrite=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.pth"]


def test_a_dict_inside_itself_is_refused() -> None:
    tree: dict[str, Any] = {"w": torch.ones(1)}
    tree["self"] = {"again": tree}
    with pytest.raises(BadInputError, match="contains itself"):
        dcp_writer.plan_dcp(tree)


def test_a_failed_write_leaves_the_old_folder(
    source_pth: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Disk full on the third item: exit 4, the folder already there as it was, no scratch left."""
    out = tmp_path / "out"
    root = ckptfix.read_checkpoint(source_pth).root
    write_dcp(root, out, overwrite=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(CannotWriteError, match="already exists"):
        write_dcp(root, out, overwrite=False)
    real, calls = dcp_writer.write_torch_zip, []

    def full_disk(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(dcp_writer, "write_torch_zip", full_disk)
    with pytest.raises(CannotWriteError, match="no space left"):
        write_dcp(root, out, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert no_temp_files(tmp_path)
    shutil.rmtree(out)
