"""Containers and folders read as torch reads them (issue 22, items 2-4 and the zip/safetensors
container cases), each compared with the oracle: what ``torch.load`` / DCP unpickles, ``scan``
must see; what torch refuses, ckptfix refuses; what torch loads, ckptfix reads the same."""

from __future__ import annotations

import pickle
import struct
from pathlib import Path

import pytest
from hostile import make_legacy_header, pkl, system_call, tar_era, tar_of
from oracle import assert_scan_sees_what_torch_resolves, torch_view

from ckptfix.analysis.scan import scan_path
from ckptfix.errors import BadInputError
from ckptfix.formats.checkpoint import read_checkpoint

# =========================================================================== tar polyglots


def tar_header_over(host: bytes, first_size: int) -> bytes:
    """``host`` with a v7 tar header of one regular member of ``first_size`` bytes written into its
    bytes 100-345 (printable digits and spaces only, so it fits inside a JSON string or a pickle's
    bytes): tarfile accepts the first block as a header whatever bytes 0-100 hold."""
    block = bytearray(host[:512].ljust(512, b"a"))
    fields = b"0000644 0000000 0000000 " + b"%011o " % first_size + b"00000000000 " + b" " * 8 + b"0"
    block[100 : 100 + len(fields)] = fields
    block[329:345] = b"0000000 0000000 "
    block[148:156] = b"%07o " % (256 + sum(block[:148]) + sum(block[156:]))
    return bytes(block) + host[512:]


def polyglot(host: bytes, members: dict[str, bytes]) -> bytes:
    """``host`` (whose bytes 100-345 are free) that is also a tar holding ``members``: the first
    member's data covers the host, the members follow it."""
    first = -(-max(len(host) - 512, 0) // 512) * 512
    return tar_header_over(host, first).ljust(512 + first, b"\0") + tar_of(members)


def safetensors_bytes(pad: int) -> bytes:
    header = b'{"__metadata__":{"p":"' + b"a" * 600 + b'"},"t":{"dtype":"U8","shape":[%d],"data_offsets":[0,%d]}}'
    header = (header % (pad, pad)).ljust(700)  # JSON may end in spaces: a fixed length
    return struct.pack("<Q", len(header)) + header


def safetensors_polyglot(members: dict[str, bytes]) -> bytes:
    """A valid safetensors file (one U8 tensor) whose JSON header holds a tar header and whose
    tensor bytes hold the tar members."""
    head_len = len(safetensors_bytes(0))
    first = -(-(head_len + 16 - 512) // 512) * 512  # the tar members start inside the tensor data
    tail = tar_of(members)
    pad = 512 + first - head_len + len(tail)
    head = safetensors_bytes(pad)
    body = b"\0" * (512 + first - head_len) + tail
    return tar_header_over(head + body, first)


HOSTS = {
    "tar-era": lambda m: tar_of(m),
    "pickle": lambda m: polyglot(pkl(b"B" + struct.pack("<I", 600) + b"x" * 600), m),
    "legacy": lambda m: polyglot(_legacy_host(), m),
    "safetensors": safetensors_polyglot,
}


def _legacy_host() -> bytes:
    """A legacy torch file (magic, protocol, sys_info: ckptfix reads it as legacy) whose sys_info
    pickle first pushes and pops 600 bytes (bytes 100-345 are free for a tar header)."""
    header = make_legacy_header()
    sys_info_at = len(pickle.dumps(0x1950A86A20F9469CFC6C, 2)) + len(pickle.dumps(1001, 2))
    rest = header[sys_info_at + 2 :]
    body = b"\x80\x02B" + struct.pack("<I", 600) + b"y" * 600 + b"0" + rest
    tree = pickle.dumps({"epoch": 1}, 2) + pickle.dumps([], 2)
    return header[:sys_info_at] + body + tree


@pytest.mark.parametrize("host", sorted(HOSTS))
@pytest.mark.parametrize("where", ["pickle", "views", "tensor", "count", "framed"])
def test_scan_reads_every_pickle_torchs_tar_reader_runs(tmp_path: Path, host: str, where: str) -> None:
    marker = tmp_path / "ran"
    path = tmp_path / "model.bin"
    path.write_bytes(HOSTS[host](tar_era(marker, where)))
    view = assert_scan_sees_what_torch_resolves(path)
    assert "posix.system" in view.globals, view  # the payload is where torch reads it
    assert view.weights_only_error and "tar" in view.weights_only_error
    result = scan_path(path)
    assert result.format == "tar" and result.dangerous and result.error, result
    with pytest.raises(BadInputError, match="tar format"):  # torch refuses it with weights_only=True
        read_checkpoint(path)
    assert not marker.exists()


def test_a_polyglot_named_safetensors_is_read_as_safetensors(tmp_path: Path) -> None:
    """torch.load of a ``.safetensors`` path goes to the safetensors library: no tar, no pickle."""
    path = tmp_path / "model.safetensors"
    path.write_bytes(safetensors_polyglot(tar_era(tmp_path / "ran", "pickle")))
    view = torch_view(path)
    assert view.globals == () and view.loads, view
    result = scan_path(path)
    assert result.format == "safetensors" and not result.globals and not result.error
    assert read_checkpoint(path).format == "safetensors"


def test_a_tar_error_after_the_first_header_falls_back_to_the_legacy_reader(tmp_path: Path) -> None:
    """A member cut short is a TarError torch catches: it then unpickles the file from byte 0,
    where a protocol-0 pickle sits in the first header's name field."""
    evil = b"cposix\nsystem\n(Vtrue\ntR."  # protocol 0, shorter than the name field
    whole = tar_of({"x": b"", "storages": b"s" * 2048})
    path = tmp_path / "model.pt"
    path.write_bytes(tar_header_over(evil + whole[len(evil) : 512], 0)[:512] + whole[512:2048])
    view = assert_scan_sees_what_torch_resolves(path)
    assert "posix.system" in view.globals, view
    assert scan_path(path).dangerous


# =========================================================================== DCP items


@pytest.fixture(scope="module")
def dcp_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DCP folder saved by torch: a tensor, an int and a dict (both non-tensor items)."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    folder = tmp_path_factory.mktemp("dcp") / "base"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(3), "step": 4, "cfg": {"a": 1}}, checkpoint_id=str(folder), no_dist=True)
    return folder


def _zip_blob(tmp_path: Path, payload: bytes) -> bytes:
    from hostile import make_base_zip, with_data_pkl

    return with_data_pkl(make_base_zip(tmp_path), payload, tmp_path / "item.pth").read_bytes()


#: an item blob whose unpickling calls posix.system, as torch.load(BytesIO) reads it
ITEM_BLOBS = {
    "zip": lambda tmp, evil: _zip_blob(tmp, evil),
    "legacy-pickle": lambda tmp, evil: evil,
    "protocol-0": lambda tmp, evil: b"cposix\nsystem\n(Vtrue\ntR.",
}


def dcp_with(base: Path, dest: Path, fqn: str, blob: bytes, *, duplicate: str = "") -> Path:
    """A copy of ``base`` whose item ``fqn`` is ``blob`` (in a new .distcp file); with ``duplicate``
    ("last" or "first") the original item stays and the blob's entry is a second key equal to it."""
    import dataclasses
    import shutil

    from torch.distributed.checkpoint.metadata import MetadataIndex

    shutil.copytree(base, dest)
    (dest / "__9_0.distcp").write_bytes(blob)
    with open(dest / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # made by torch in this test module
    old_key = next(k for k in metadata.storage_data if k.fqn == fqn)
    info = dataclasses.replace(metadata.storage_data[old_key], relative_path="__9_0.distcp", offset=0, length=len(blob))
    if not duplicate:
        metadata.storage_data[old_key] = info
    else:
        placeholder = "Q" * len(fqn)  # renamed to fqn in the pickle's bytes: two keys equal to torch
        new_key = MetadataIndex(placeholder, old_key.offset)
        old = metadata.storage_data.pop(old_key)
        pairs = [(old_key, old), (new_key, info)] if duplicate == "last" else [(new_key, info), (old_key, old)]
        metadata.storage_data.update(pairs)
    raw = pickle.dumps(metadata, protocol=2)
    if duplicate:
        assert raw.count(placeholder.encode()) == 1
        raw = raw.replace(placeholder.encode(), fqn.encode())
    (dest / ".metadata").write_bytes(raw)
    return dest


@pytest.mark.parametrize("blob", sorted(ITEM_BLOBS))
@pytest.mark.parametrize("fqn", ["step", "cfg.a"])
def test_scan_reads_every_dcp_item_torch_unpickles(dcp_base: Path, tmp_path: Path, blob: str, fqn: str) -> None:
    evil = system_call(tmp_path / "ran")
    folder = dcp_with(dcp_base, tmp_path / "dcp", fqn, ITEM_BLOBS[blob](tmp_path, evil))
    view = assert_scan_sees_what_torch_resolves(folder, dcp=True)
    assert "posix.system" in view.globals, view
    result = scan_path(folder)
    assert result.dangerous and any("__9_0.distcp" in g.where for g in result.dangerous), result
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize("evil_at", ["last", "first"])
def test_two_equal_metadata_index_keys_are_refused(dcp_base: Path, tmp_path: Path, evil_at: str) -> None:
    """torch's dict keeps the last of two equal MetadataIndex keys: whichever one holds the
    payload, scan sees it where torch reads it, and the reader refuses the folder as ambiguous."""
    evil = _zip_blob(tmp_path, system_call(tmp_path / "ran"))
    folder = dcp_with(dcp_base, tmp_path / "dcp", "step", evil, duplicate=evil_at)
    view = assert_scan_sees_what_torch_resolves(folder, dcp=True)
    assert ("posix.system" in view.globals) == (evil_at == "last"), view
    assert scan_path(folder).dangerous
    with pytest.raises(BadInputError, match="ambiguous"):
        read_checkpoint(folder)


def test_a_non_tensor_item_stored_under_chunk_offsets_is_refused_as_torch_fails(dcp_base: Path, tmp_path: Path) -> None:
    """torch looks a non-tensor item up as MetadataIndex(fqn): an entry with offsets is not it."""
    import shutil

    from torch.distributed.checkpoint.metadata import MetadataIndex

    folder = tmp_path / "dcp"
    shutil.copytree(dcp_base, folder)
    with open(folder / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # made by torch in this test module
    key = next(k for k in metadata.storage_data if k.fqn == "step")
    metadata.storage_data[MetadataIndex("step", (0,))] = metadata.storage_data.pop(key)
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    view = torch_view(folder, dcp=True)
    assert view.error and "step" in view.error, view
    with pytest.raises(BadInputError, match="no stored item"):
        read_checkpoint(folder)


# =========================================================================== folders with decoys


def _empty_dcp(folder: Path) -> None:
    from torch.distributed.checkpoint.metadata import Metadata

    with open(folder / ".metadata", "wb") as f:
        pickle.dump(Metadata(state_dict_metadata={}, storage_data={}), f)


def _safetensors(path: Path) -> None:
    import safetensors.torch
    import torch

    safetensors.torch.save_file({"w": torch.ones(2)}, str(path))


def _index(path: Path, shard: str) -> None:
    import json

    path.write_text(json.dumps({"metadata": {}, "weight_map": {"w": shard}}))


def _decoy_folder(folder: Path, layout: str, evil: bytes) -> Path:
    """A folder whose marker names one checkpoint, with a payload in a file torch or transformers
    would load; returns that file."""
    from hostile import make_base_zip, with_data_pkl

    folder.mkdir()
    base = make_base_zip(folder.parent)
    if layout == "empty-dcp":
        _empty_dcp(folder)
        return with_data_pkl(base, evil, folder / "model.pth")
    if layout == "index+bin":
        _safetensors(folder / "model-00001-of-00001.safetensors")
        _index(folder / "model.safetensors.index.json", "model-00001-of-00001.safetensors")
        return with_data_pkl(base, evil, folder / "pytorch_model.bin")
    if layout == "two-indexes":
        _safetensors(folder / "model-00001-of-00001.safetensors")
        _index(folder / "model.safetensors.index.json", "model-00001-of-00001.safetensors")
        _index(folder / "pytorch_model.bin.index.json", "pytorch_model-00001-of-00001.bin")
        return with_data_pkl(base, evil, folder / "pytorch_model-00001-of-00001.bin")
    if layout == "safetensors+bin":
        _safetensors(folder / "model.safetensors")
        return with_data_pkl(base, evil, folder / "pytorch_model.bin")
    assert layout == "training-args"
    _safetensors(folder / "model.safetensors")
    path = folder / "training_args.bin"
    path.write_bytes(evil)
    return path


@pytest.mark.parametrize("layout", ["empty-dcp", "index+bin", "two-indexes", "safetensors+bin", "training-args"])
def test_scan_and_verify_of_a_folder_check_every_checkpoint_like_file(tmp_path: Path, layout: str) -> None:
    from oracle import dangerous_names, missed_by_scan

    from ckptfix.analysis.verify import verify_path

    marker = tmp_path / "ran"
    decoy = _decoy_folder(tmp_path / "repo", layout, system_call(marker))
    view = torch_view(decoy)  # what torch.load / transformers would run
    assert dangerous_names(view.globals), view
    result = scan_path(decoy.parent)
    assert not missed_by_scan(view, [g.name for g in result.dangerous]), result
    assert any(g.where.startswith(decoy.name) for g in result.dangerous), result
    verified = verify_path(decoy.parent)
    assert not verified.ok and any(decoy.name in p for p in verified.problems), verified
    assert not marker.exists()


def test_a_folder_whose_files_are_all_its_checkpoint_stays_clean(tmp_path: Path) -> None:
    """The other files a folder may hold (configs, tokenizers) are not checkpoints: no noise."""
    from ckptfix.analysis.verify import verify_path

    folder = tmp_path / "repo"
    folder.mkdir()
    _safetensors(folder / "model.safetensors")
    (folder / "config.json").write_text('{"a": 1}')
    (folder / "README.md").write_text("# model\n")
    result = scan_path(folder)
    assert not result.error and not result.dangerous and not result.notes, result
    assert verify_path(folder).ok


@pytest.mark.parametrize("key", [b"step", 7])
def test_an_item_named_by_a_non_string_is_refused_as_torch_cannot_find_it(
    dcp_base: Path, tmp_path: Path, key: object
) -> None:
    """torch looks an item up as MetadataIndex(fqn) with the state dict's str fqn: an entry keyed
    by another type (``7`` for ``"7"``) never matches it, however it prints."""
    import shutil

    from torch.distributed.checkpoint.metadata import MetadataIndex

    folder = tmp_path / "dcp"
    shutil.copytree(dcp_base, folder)
    with open(folder / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # made by torch in this test module
    old = next(k for k in metadata.storage_data if k.fqn == "step")
    name = str(key) if isinstance(key, int) else "step"
    metadata.state_dict_metadata[name] = metadata.state_dict_metadata.pop("step")
    if metadata.planner_data and "step" in metadata.planner_data:
        metadata.planner_data[name] = (metadata.planner_data.pop("step"), (name,))[1]
    metadata.storage_data[MetadataIndex(key)] = metadata.storage_data.pop(old)  # type: ignore[arg-type]
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    view = torch_view(folder, dcp=True)
    assert view.error, view
    with pytest.raises(BadInputError, match="not a str"):
        read_checkpoint(folder)
