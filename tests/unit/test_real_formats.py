"""Checkpoints made by other setups than today's torch.save defaults (issue 15): legacy files
saved with any pickle protocol, and the pre-2018 ``torch._utils._rebuild_tensor``. Each is
checked against torch itself: what ckptfix writes loads with ``weights_only=True`` and equals
torch's own load -> edit -> save."""

from __future__ import annotations

import io
import pickle
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_same_tree

import ckptfix


def _stripped(tree: dict[str, Any]) -> dict[str, Any]:
    """torch's own edit: the same mapping type, keys without ``module.``."""
    return type(tree)((k.removeprefix("module."), v) for k, v in tree.items())


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_legacy_file_of_any_pickle_protocol_is_read_and_fixed(tmp_path: Path, protocol: int) -> None:
    """``torch.save(..., pickle_protocol=N, _use_new_zipfile_serialization=False)``: torch reads
    them all (weights_only too for 2-3), so must ckptfix -- not call them plain pickles."""
    src = tmp_path / f"legacy{protocol}.pth"
    tree = {"module.w": torch.arange(6.0).reshape(2, 3), "module.b": torch.ones(2, dtype=torch.float16)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.save(tree, src, _use_new_zipfile_serialization=False, pickle_protocol=protocol)
    ckpt = ckptfix.read_checkpoint(src)
    assert ckpt.format == "torch-legacy"
    out = tmp_path / "out.pth"
    report = ckptfix.fix_prefix(src, out)
    assert report.written and report.renamed == 2
    expected = _stripped(torch.load(src, weights_only=False))
    assert_same_tree(torch.load(out, weights_only=True), expected)


def test_a_legacy_file_whose_pickles_outgrow_the_first_read_is_read_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The legacy reader reads the file's head (1 MiB first, then doubling) rather than mapping
    the file. With the first read cut to 4 KiB, a tree pickle of ~40 KiB (300 tensors) must come
    out whole, as torch reads it, and the head must have grown by doubling (up to the file's
    size), no faster."""
    from ckptfix.formats import legacy_pickle

    src = tmp_path / "big_legacy.pth"
    tree = {f"module.blocks.{i}.weight": torch.full((2,), float(i)) for i in range(300)}
    torch.save(tree, src, _use_new_zipfile_serialization=False)
    sizes: list[int] = []
    original = legacy_pickle._pread
    monkeypatch.setattr(legacy_pickle, "_FIRST_READ", 4096)
    monkeypatch.setattr(legacy_pickle, "_pread", lambda fd, size, at: sizes.append(size) or original(fd, size, at))
    out = tmp_path / "out.pth"
    ckptfix.fix_prefix(src, out)
    heads = [s for s in sizes if s != 8]  # the storage counts are 8-byte reads
    whole = src.stat().st_size
    assert len(heads) >= 4 and heads == [min(4096 << i, whole) for i in range(len(heads))], (heads, whole)
    assert_same_tree(torch.load(out, weights_only=True), _stripped(torch.load(src, weights_only=True)))


def _old_rebuild_pickle(storage_key: str = "0") -> bytes:
    """What torch < 0.4 pickled for a tensor: ``_rebuild_tensor(storage, offset, size, stride)``
    (no requires_grad, no hooks), here inside a state dict, with torch's persistent id."""

    class Storage:
        pass

    class OldTensor:
        def __reduce__(self) -> Any:
            return (torch._utils._rebuild_tensor, (Storage(), 1, (2, 2), (2, 1)))

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            if isinstance(obj, Storage):
                return ("storage", torch.FloatStorage, storage_key, "cpu", 5)
            return None

    buffer = io.BytesIO()
    Pickler(buffer, protocol=2).dump(OrderedDict([("module.weight", OldTensor())]))
    return buffer.getvalue()


def test_pre_2018_rebuild_tensor_is_a_tensor(tmp_path: Path) -> None:
    """lpips v0.0 and other packages ship weights rebuilt by ``torch._utils._rebuild_tensor``."""
    import zipfile

    src = tmp_path / "old.pth"
    # a real torch zip whose data.pkl is replaced by the old-style pickle, same storage record
    torch.save({"x": torch.arange(5.0)}, src)
    with zipfile.ZipFile(src) as z:
        names = {n.split("/", 1)[1]: z.read(n) for n in z.namelist()}
        top = z.namelist()[0].split("/", 1)[0]
    names["data.pkl"] = _old_rebuild_pickle()
    rebuilt = tmp_path / "rebuilt.pth"
    with zipfile.ZipFile(rebuilt, "w") as z:
        for name, data in names.items():
            z.writestr(f"{top}/{name}", data)
    theirs = torch.load(rebuilt, weights_only=False)
    assert theirs["module.weight"].tolist() == [[1.0, 2.0], [3.0, 4.0]]

    summary = ckptfix.inspect_checkpoint(rebuilt)
    assert summary["tensors"] == 1
    out = tmp_path / "fixed.pth"
    assert ckptfix.fix_prefix(rebuilt, out).renamed == 1
    assert_same_tree(torch.load(out, weights_only=True), _stripped(theirs))


def test_every_safetensors_output_loads_with_huggingface_hub(tmp_path: Path) -> None:
    """huggingface_hub (and transformers) refuse a safetensors file whose metadata lacks
    ``"format": "pt"``; ckptfix writes metadata whenever it records tied weights, so it must
    write the marker too -- for single files, shards and write_checkpoint."""
    huggingface_hub = pytest.importorskip("huggingface_hub")
    from safetensors import safe_open

    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight
    src = tmp_path / "tied.pth"
    torch.save(model.state_dict(), src)
    single = tmp_path / "tied.safetensors"
    ckptfix.convert(src, single)
    ckpt = ckptfix.read_checkpoint(src)
    written = tmp_path / "written.safetensors"
    ckptfix.write_checkpoint(ckpt, ckpt.root, written)
    for path in (single, written):
        with safe_open(path, "pt") as f:
            assert f.metadata()["format"] == "pt"
        fresh = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
        result = huggingface_hub.load_torch_model(fresh, path, strict=False)
        assert not result.missing_keys or result.missing_keys == ["1.weight"]  # the tie, stored once
        assert torch.equal(fresh[0].weight, model[0].weight)


def test_scan_reads_shard_folders_indexes_and_dcp_folders(tmp_path: Path) -> None:
    """scan takes every input the readers take; a shard's finding says which shard."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from ckptfix.analysis.scan import scan_path

    src = tmp_path / "m.pth"
    torch.save({f"layer{i}.weight": torch.randn(64) for i in range(4)}, src)
    shards = tmp_path / "shards"
    ckptfix.convert(src, shards, ckptfix.ConvertOptions(out_format="pth", max_shard_size="600B"))
    index = next(shards.glob("*.index.json"))
    for target in (shards, index):
        result = scan_path(target)
        assert result.format == "sharded" and not result.error and not result.dangerous
        assert {g.where.split(":", 1)[0] for g in result.globals} == {p.name for p in shards.glob("*.bin")}
        assert len(list(shards.glob("*.bin"))) > 1

    folder = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(3), "step": 4}, checkpoint_id=str(folder))
    result = scan_path(folder)
    assert result.format == "dcp" and not result.error and not result.dangerous
    assert "torch.distributed.checkpoint.metadata.Metadata" in {g.name for g in result.globals}
    assert any(".distcp@" in g.where for g in result.globals)  # the items are scanned too


def _diff(a: Any, b: Any, tmp_path: Path) -> Any:
    from ckptfix.pipeline import diff_checkpoints

    torch.save({"t": a}, tmp_path / "a.pth")
    torch.save({"t": b}, tmp_path / "b.pth")
    return diff_checkpoints(tmp_path / "a.pth", tmp_path / "b.pth")


@pytest.mark.parametrize("dtype", ["bits8", "bits16", "float4_e2m1fn_x2"])
def test_diff_of_dtypes_without_arithmetic_compares_bits(tmp_path: Path, dtype: str) -> None:
    """torch cannot convert these to float64 ('copy_ not implemented'): never exit 5."""
    a = torch.arange(8, dtype=torch.uint8).view(getattr(torch, dtype))
    b = a.clone()
    b.view(torch.uint8)[3] ^= 0xFF
    assert _diff(a, a.clone(), tmp_path).equal
    report = _diff(a, b, tmp_path)
    assert not report.equal and report.different[0]["differing_elements"] == 1
    assert report.different[0]["max_abs_diff"] is None


def test_diff_complex_is_nan_aware_part_by_part(tmp_path: Path) -> None:
    nan_one = torch.tensor([complex(float("nan"), 1.0)], dtype=torch.complex64)
    payload = nan_one.clone()
    payload.view(torch.uint8)[0] ^= 1  # another NaN payload: the same value
    assert not torch.equal(nan_one.view(torch.uint8), payload.view(torch.uint8))
    assert _diff(nan_one, payload, tmp_path).equal
    other = torch.tensor([complex(float("nan"), 2.0)], dtype=torch.complex64)  # NaN real, other imaginary
    report = _diff(nan_one, other, tmp_path)
    assert not report.equal and report.different[0]["max_abs_diff"] == 1.0


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.eye(3).to_sparse(),
        lambda: torch.eye(3).to_sparse_csr(),
        lambda: torch.quantize_per_tensor(torch.linspace(-1, 1, 5), 0.1, 3, torch.qint8),
        lambda: torch.empty(3, 4, device="meta"),
        lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
    ],
    ids=["sparse-coo", "sparse-csr", "quantized", "meta", "nested"],
)
def test_diff_compares_other_tensor_kinds_by_their_parts(tmp_path: Path, make: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert _diff(make(), make(), tmp_path).equal


def test_diff_finds_a_difference_inside_a_sparse_or_quantized_tensor(tmp_path: Path) -> None:
    assert not _diff(torch.eye(3).to_sparse(), (2 * torch.eye(3)).to_sparse(), tmp_path).equal
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q1 = torch.quantize_per_tensor(torch.linspace(-1, 1, 5), 0.1, 3, torch.qint8)
        q2 = torch.quantize_per_tensor(torch.linspace(-1, 1, 5), 0.2, 3, torch.qint8)
    assert not _diff(q1, q2, tmp_path).equal


def test_api_reads_checkpoints_with_configs_like_the_cli(tmp_path: Path) -> None:
    """load/load_into take allow_globals= and sanitize= as the CLI takes --allow-global/--sanitize."""
    import argparse

    from ckptfix import UnsafeInputError, UsageError

    model = torch.nn.Linear(3, 2)
    path = tmp_path / "train.pth"
    torch.save({"state_dict": model.state_dict(), "args": argparse.Namespace(lr=0.1, name="run")}, path)
    with pytest.raises(UnsafeInputError):
        ckptfix.load(path)
    loaded = ckptfix.load(path, sanitize=True)
    assert loaded["args"] == {"lr": 0.1, "name": "run"}
    assert torch.equal(loaded["state_dict"]["weight"], model.weight)
    weights = ckptfix.load(path, allow_globals=["argparse.Namespace"], select="state_dict")
    assert torch.equal(weights["bias"], model.bias)
    with pytest.raises(UsageError, match="sanitize=True"):
        ckptfix.load(path, allow_globals=["argparse.Namespace"])  # the Namespace cannot be built safely
    fresh = torch.nn.Linear(3, 2)
    report = ckptfix.load_into(fresh, path, allow_globals=["argparse.Namespace"])
    assert report.missing == [] and torch.equal(fresh.weight, model.weight)


def test_load_into_can_skip_shape_mismatched_keys(tmp_path: Path) -> None:
    """Fine-tuning: a new head of another size; the backbone loads, the head is listed."""
    pretrained = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 10))
    path = tmp_path / "pretrained.pth"
    torch.save({"model": pretrained.state_dict()}, path)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3))
    with pytest.raises(ckptfix.LoadIntoError, match="size mismatch"):
        ckptfix.load_into(model, path, strict=False)
    report = ckptfix.load_into(model, path, strict=False, skip_mismatch=True)
    assert report.skipped == ["1.bias", "1.weight"]
    assert sorted(report.missing) == ["1.bias", "1.weight"]
    assert torch.equal(model[0].weight, pretrained[0].weight)


# --- torch.distributed.checkpoint folders, read without torch's pickle.load ------------------

DCP_SHARDED = Path(__file__).resolve().parents[2] / "fixtures" / "dcp_sharded_2ranks"


def _dcp_reference(folder: Path, tmp_path: Path) -> Any:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(folder, tmp_path / "reference.pth")
    return torch.load(tmp_path / "reference.pth", weights_only=False)


def test_dcp_sharded_by_two_ranks_is_assembled_like_torch(tmp_path: Path) -> None:
    """fixtures/dcp_sharded_2ranks: 2 gloo ranks, DTensor Shard(0) (FSDP2's layout), odd sizes."""
    ckpt = ckptfix.read_checkpoint(DCP_SHARDED)  # no --unsafe-load: nothing is unpickled by torch
    assert ckpt.format == "dcp" and ckpt.lazy
    reference = _dcp_reference(DCP_SHARDED, tmp_path)
    out = tmp_path / "whole.pth"
    ckptfix.convert(DCP_SHARDED, out)
    assert_same_tree(torch.load(out, weights_only=True), reference)
    st = tmp_path / "model.safetensors"
    ckptfix.convert(DCP_SHARDED, st, ckptfix.ConvertOptions(select="model"))
    from safetensors.torch import load_file

    assert_same_tree(dict(load_file(st)), dict(reference["model"]), check_stride=False)


def test_dcp_single_process_with_lists_and_values(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "dcp"
    state = {"model": {"module.w": torch.randn(3, 2)}, "opt": {"param_groups": [{"lr": 0.1, "params": [0]}]}, "step": 4}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(folder))
    out = tmp_path / "stripped.pth"
    report = ckptfix.convert(folder, out, ckptfix.ConvertOptions(strip_prefixes=("module.",)))
    assert report.renamed == 1
    expected = _dcp_reference(folder, tmp_path)
    expected["model"] = {"w": expected["model"]["module.w"]}
    assert_same_tree(torch.load(out, weights_only=True), expected)


def _rewrite_metadata(folder: Path, edit: Any) -> None:
    with open(folder / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # our own folder, made in the test
    edit(metadata)
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


def _dcp_copy(tmp_path: Path) -> Path:
    import shutil

    folder = tmp_path / "copy"
    shutil.copytree(DCP_SHARDED, folder)
    return folder


def test_hostile_dcp_metadata_is_refused(tmp_path: Path) -> None:
    """The .metadata pickle is read by the restricted reader: a payload is refused (exit 3) and
    never runs; items must stay inside their folder and files; chunks must tile their tensor."""
    import dataclasses

    from ckptfix import BadInputError, UnsafeInputError

    marker = tmp_path / "PWNED"

    class Evil:
        def __reduce__(self) -> Any:
            return (os.system, (f"touch {marker}",))

    import os

    folder = _dcp_copy(tmp_path)
    _rewrite_metadata(folder, lambda m: setattr(m, "planner_data", Evil()))
    with pytest.raises(UnsafeInputError, match="hostile"):
        ckptfix.read_checkpoint(folder)
    assert not marker.exists()

    def escape(m: Any) -> None:
        key = next(iter(m.storage_data))
        m.storage_data[key] = dataclasses.replace(m.storage_data[key], relative_path="../outside.distcp")

    def past_the_end(m: Any) -> None:
        key = next(iter(m.storage_data))
        m.storage_data[key] = dataclasses.replace(m.storage_data[key], length=10**9)

    def overlapping(m: Any) -> None:
        chunks = m.state_dict_metadata["model.w"].chunks
        chunks[1] = dataclasses.replace(chunks[1], offsets=chunks[0].offsets)

    def too_big(m: Any) -> None:
        m.state_dict_metadata["model.w"].size = torch.Size([7, 4])

    for edit, match in (
        (escape, "not a file in the folder"),
        (past_the_end, "past the end"),
        (overlapping, "chunk"),
        (too_big, "elements"),
    ):
        folder = _dcp_copy(tmp_path / edit.__name__)
        _rewrite_metadata(folder, edit)
        with pytest.raises(BadInputError, match=match):
            ckptfix.read_checkpoint(folder)


# --- EMA copies beside the model ------------------------------------------------------------


def _lightning_with_ema(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A Lightning checkpoint whose module holds ``model`` and ``model_ema`` (timm's ModelEmaV2)."""
    model = {"conv.weight": torch.randn(2, 3), "conv.bias": torch.randn(2)}
    ema = {k: v * 0.5 for k, v in model.items()}
    state_dict = {**{f"model.{k}": v for k, v in model.items()}, **{f"model_ema.{k}": v for k, v in ema.items()}}
    path = tmp_path / "lightning.ckpt"
    torch.save({"epoch": 3, "state_dict": state_dict, "optimizer_states": []}, path)
    return path, model, ema


def test_select_takes_the_model_and_ema_takes_the_ema_copy(tmp_path: Path) -> None:
    path, model, ema = _lightning_with_ema(tmp_path)
    out = tmp_path / "model.safetensors"
    report = ckptfix.convert(path, out, ckptfix.ConvertOptions(select="state_dict", strip_prefixes=("model.",)))
    from safetensors.torch import load_file

    assert_same_tree(dict(load_file(out)), model, check_stride=False)
    assert any("--ema selects it" in note for note in report.notes)
    out_ema = tmp_path / "ema.safetensors"
    ckptfix.convert(path, out_ema, ckptfix.ConvertOptions(select="state_dict", ema=True))
    assert_same_tree(dict(load_file(out_ema)), ema, check_stride=False)


def test_publish_picks_the_model_by_default_and_the_ema_copy_on_request(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from ckptfix.pipeline import publish

    path, model, ema = _lightning_with_ema(tmp_path)
    release = tmp_path / "release"
    release.mkdir()
    assert_same_tree(dict(load_file(publish(path, release, name="m").path)), model, check_stride=False)
    assert_same_tree(dict(load_file(publish(path, release, name="e", ema=True).path)), ema, check_stride=False)


def test_ema_entry_at_the_top_level_and_no_ema_at_all(tmp_path: Path) -> None:
    """timm's checkpoints keep ``state_dict_ema`` beside ``state_dict``; asking --ema of a
    checkpoint without one is a usage error, not a silent model copy."""
    from ckptfix.errors import InputMismatchError

    path = tmp_path / "timm.pth"
    torch.save({"state_dict": {"w": torch.ones(2)}, "state_dict_ema": {"w": torch.zeros(2)}}, path)
    out = tmp_path / "ema.pth"
    ckptfix.convert(path, out, ckptfix.ConvertOptions(ema=True))
    assert torch.equal(torch.load(out, weights_only=True)["w"], torch.zeros(2))
    plain = tmp_path / "plain.pth"
    torch.save({"w": torch.ones(2)}, plain)
    with pytest.raises(InputMismatchError, match="--ema"):
        ckptfix.convert(plain, tmp_path / "x.pth", ckptfix.ConvertOptions(ema=True))


def test_fit_and_load_into_use_the_model_not_its_ema_copy(tmp_path: Path) -> None:
    """A Lightning checkpoint with model and model_ema fits a bare model (the model's weights by
    default, the EMA copy with ema=True), instead of calling the EMA keys unexpected."""
    from ckptfix.pipeline import fit_checkpoint

    model = torch.nn.Linear(3, 2)
    ema = {k: v * 0.5 for k, v in model.state_dict().items()}
    state_dict = {f"model.{k}": v for k, v in model.state_dict().items()}
    state_dict |= {f"model_ema.{k}": v for k, v in ema.items()}
    path = tmp_path / "lightning.ckpt"
    torch.save({"state_dict": state_dict}, path)
    reference = tmp_path / "bare.pth"
    torch.save(torch.nn.Linear(3, 2).state_dict(), reference)

    fresh = torch.nn.Linear(3, 2)
    report = ckptfix.load_into(fresh, path)
    assert report.missing == [] and report.unexpected == [] and torch.equal(fresh.weight, model.weight)
    ckptfix.load_into(fresh, path, ema=True)
    assert torch.equal(fresh.weight, ema["weight"])

    for use_ema, expected in ((False, model.state_dict()), (True, ema)):
        out = tmp_path / f"fit-{use_ema}.pth"
        plan, written = fit_checkpoint(path, out, reference=reference, ema=use_ema)
        assert plan.loads_strictly and written is not None
        assert_same_tree(dict(torch.load(out, weights_only=True)), dict(expected))
