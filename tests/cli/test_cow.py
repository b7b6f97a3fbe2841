"""Copy-on-write layout (issue 14): big tensors land where a CoW file system can share their blocks.

The kernel shares blocks only for a copy that starts on a 4096-byte boundary in both files, so
a record copied unchanged must sit at an output offset congruent to its source offset modulo
4096. These tests check that rule on plain offsets (any file system) and that the outputs still
load everywhere; ``test_cow_xfs.py`` checks the blocks really are shared on an XFS mount.
"""

from __future__ import annotations

import json
import os
import struct
import zipfile
from pathlib import Path
from typing import Any

import torch
from conftest import assert_same_tree, invoke_cli
from safetensors.torch import load_file, save_file

import ckptfix
from ckptfix.fileio import extents, ranges
from ckptfix.fileio.ziparchive import RECORD_ALIGNMENT

BLOCK = 4096
BIG = 1 << 16  # records at least this big are placed to share blocks


def _ddp_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """Big and small tensors, names of varied lengths (so headers shift records around)."""
    g = torch.Generator().manual_seed(seed)
    sd = {f"module.{'block.' * (i % 4)}layer{i}.weight": torch.randn(20_000 + 999 * i, generator=g) for i in range(8)}
    sd["module.bias"] = torch.randn(7, generator=g)
    sd["module.half"] = torch.randn(40_001, generator=g).half()  # 80 002 bytes: not a multiple of 64
    sd["module.tiny"] = torch.arange(3)
    return sd


def _local_extras(path: Path) -> dict[str, tuple[int, bytes]]:
    """Record name -> (data offset, local extra field bytes), from the local headers."""
    data = path.read_bytes()
    found = {}
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
            extra_at = info.header_offset + 30 + name_len
            found[info.filename] = (extra_at + extra_len, data[extra_at : extra_at + extra_len])
    return found


def _storage_offsets(path: Path) -> dict[str, tuple[int, int]]:
    """Tensor name -> (file offset of its storage's bytes, storage bytes), as ckptfix reads them."""
    root = ckptfix.read_checkpoint(path).root
    return {name: (t.storage.source.offset, t.storage.nbytes) for name, t in root.items()}


def _check_zip_layout(src: Path, out: Path, rename: Any = lambda name: name) -> int:
    """Every record 64-aligned with a well-formed extra block; every big tensor copied from a
    64-aligned offset at its source offset mod 4096. Returns how many records were placed so."""
    for name, (offset, extra) in _local_extras(out).items():
        assert offset % RECORD_ALIGNMENT == 0, name
        assert len(extra) <= 0xFFFF
        at = 0
        while at < len(extra):  # tag, length, body ... filling the block exactly
            _, size = struct.unpack_from("<HH", extra, at)
            at += 4 + size
        assert at == len(extra), f"{name}: malformed extra field"
    before, after = _storage_offsets(src), _storage_offsets(out)
    placed = 0
    for name, (offset, size) in before.items():
        new_offset, new_size = after[rename(name)]
        assert new_size == size
        if size >= BIG and offset % RECORD_ALIGNMENT == 0:
            assert new_offset % BLOCK == offset % BLOCK, f"{name}: {offset} -> {new_offset}"
            placed += 1
    return placed


def _loads_everywhere(out: Path, expected: Any) -> None:
    """torch.load (plain, mmap, and mmap with computed offsets) and zipfile's CRC check."""
    from torch.utils.serialization import config

    assert_same_tree(torch.load(out, weights_only=True), expected)
    assert_same_tree(torch.load(out, mmap=True, weights_only=True), expected)
    config.load.calculate_storage_offsets = True
    try:
        assert_same_tree(torch.load(out, mmap=True, weights_only=True), expected)
    finally:
        config.load.calculate_storage_offsets = False
    with zipfile.ZipFile(out) as z:
        assert z.testzip() is None


def test_strip_module_places_big_records_at_their_source_offset_mod_4096(tmp_path: Path) -> None:
    src, out = tmp_path / "ddp.pth", tmp_path / "bare.pth"
    sd = _ddp_state()
    torch.save(sd, src)
    ckptfix.fix_prefix(src, out)
    assert _check_zip_layout(src, out, lambda n: n.removeprefix("module.")) == 9
    _loads_everywhere(out, {k.removeprefix("module."): v for k, v in sd.items()})


def test_add_module_and_rename_keep_the_rule(tmp_path: Path) -> None:
    src = tmp_path / "bare.pth"
    sd = {k.removeprefix("module."): v for k, v in _ddp_state(1).items()}
    torch.save(sd, src)
    added = tmp_path / "ddp.pth"
    ckptfix.fix_prefix(src, added, mode="add")
    assert _check_zip_layout(src, added, lambda n: "module." + n) == 9
    renamed = tmp_path / "renamed.pth"
    result = invoke_cli("rename", added, renamed, "--rule", r"^module\.block\.=>m.b.")
    assert result.returncode == 0, result.stderr
    assert _check_zip_layout(added, renamed, lambda n: n.replace("module.block.", "m.b.", 1)) == 9
    _loads_everywhere(renamed, {n.replace("module.block.", "m.b.", 1): v for n, v in torch.load(added).items()})


def test_small_records_keep_64_byte_padding_and_the_format_version(tmp_path: Path) -> None:
    """A file of small tensors is laid out exactly as torch would (calculate_storage_offsets
    needs that and .format_version says so); only files with shared records leave it out."""
    src, out, big_out = tmp_path / "small.pth", tmp_path / "out.pth", tmp_path / "big.pth"
    torch.save({f"module.w{i}": torch.randn(100) for i in range(5)}, src)
    ckptfix.fix_prefix(src, out)
    for name, (_, extra) in _local_extras(out).items():
        assert len(extra) < 4 + RECORD_ALIGNMENT, name  # "FB" + length + at most 63 bytes
    with zipfile.ZipFile(out) as z:
        assert any(n.endswith("/.format_version") for n in z.namelist())
    torch.save(_ddp_state(), src)
    ckptfix.fix_prefix(src, big_out)
    with zipfile.ZipFile(big_out) as z:
        assert not any(n.endswith("/.format_version") for n in z.namelist())


def test_records_from_unaligned_places_fall_back_to_64_bytes(tmp_path: Path) -> None:
    """safetensors data often sits at offsets that are not 64-aligned: congruence mod 4096
    would break torch's 64-byte alignment, so those records are simply 64-aligned."""
    src, out = tmp_path / "odd.safetensors", tmp_path / "out.pth"
    tensors = {"a": torch.randn(3), "b": torch.randn(30_000), "c": torch.randn(20_001)}
    save_file(tensors, src)
    offsets = _storage_offsets(src)
    assert any(o % RECORD_ALIGNMENT for o, size in offsets.values() if size >= BIG)  # the case under test
    ckptfix.convert(src, out)
    placed = _check_zip_layout(src, out)
    assert placed == sum(1 for o, size in offsets.values() if size >= BIG and o % RECORD_ALIGNMENT == 0)
    _loads_everywhere(out, tensors)


def _data_start(path: Path) -> int:
    return 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]


def _st_source(path: Path) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    tensors = {f"module.layer{i}.weight": torch.randn(30_000 + i, generator=g) for i in range(6)}
    tensors["module.ln.weight"] = torch.randn(5, generator=g).half()
    save_file(tensors, path, metadata={"format": "pt"})
    return tensors


def test_safetensors_rename_keeps_the_data_section_at_its_offset_mod_4096(tmp_path: Path) -> None:
    src, out = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    tensors = _st_source(src)
    ckptfix.convert(src, out, ckptfix.ConvertOptions(strip_prefixes=("module.",)))
    start, new_start = _data_start(src), _data_start(out)
    assert new_start % BLOCK == start % BLOCK and new_start % 8 == 0
    assert out.read_bytes()[new_start:] == src.read_bytes()[start:]  # one unchanged data section
    loaded = load_file(out)
    assert_same_tree(loaded, {k.removeprefix("module."): v for k, v in tensors.items()})
    header = out.read_bytes()[8:new_start]
    assert header.rstrip(b" ") == header.strip() and json.loads(header)["__metadata__"] == {"format": "pt"}
    assert len(ckptfix.read_checkpoint(out).root) == len(tensors)


def test_safetensors_unchanged_file_is_copied_whole(tmp_path: Path) -> None:
    src, out = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    _st_source(src)
    ckptfix.convert(src, out)
    assert out.read_bytes() == src.read_bytes()


def test_safetensors_dropping_tensors(tmp_path: Path) -> None:
    """Dropping the last tensors keeps one shared run; dropping from the middle splits it, and
    the file stays valid (no holes) with the longest run placed to share."""
    src = tmp_path / "a.safetensors"
    tensors = _st_source(src)
    data = src.read_bytes()
    header = json.loads(data[8 : _data_start(src)])
    by_offset = sorted((v["data_offsets"], k) for k, v in header.items() if k != "__metadata__")
    last, middle = by_offset[-1][1], by_offset[2][1]
    for dropped in (last, middle):
        out = tmp_path / "out.safetensors"
        ckptfix.convert(src, out, ckptfix.ConvertOptions(drop=(dropped,), force=True))
        loaded = load_file(out)
        assert_same_tree(loaded, {k: v for k, v in tensors.items() if k != dropped})
        assert len(ckptfix.read_checkpoint(out).root) == len(tensors) - 1
        new_header = json.loads(out.read_bytes()[8 : _data_start(out)])
        if dropped == last:
            assert _data_start(out) % BLOCK == _data_start(src) % BLOCK
            kept = by_offset[-1][0][0]
            assert out.read_bytes()[_data_start(out) :] == data[_data_start(src) : _data_start(src) + kept]
        else:
            # the longer run (after the dropped tensor) is the one placed to share
            after = [k for (_, k) in by_offset[3:]]
            src_at = _data_start(src) + header[after[0]]["data_offsets"][0]
            out_at = _data_start(out) + new_header[after[0]]["data_offsets"][0]
            assert src_at % BLOCK == out_at % BLOCK


def test_safetensors_to_pth_shares_aligned_tensors_and_writes_right_crcs(tmp_path: Path) -> None:
    src, out = tmp_path / "a.safetensors", tmp_path / "out.pth"
    tensors = {f"w{i}": torch.randn(16 * (4096 + i)) for i in range(4)}  # 64-aligned sizes
    save_file(tensors, src)
    ckptfix.convert(src, out)
    assert _check_zip_layout(src, out) == sum(
        1 for o, size in _storage_offsets(src).values() if size >= BIG and o % RECORD_ALIGNMENT == 0
    )
    _loads_everywhere(out, tensors)  # zipfile.testzip checks every CRC computed beside the copy


def test_copy_range_starts_the_kernel_copy_on_a_block_boundary(tmp_path: Path, monkeypatch: Any) -> None:
    calls: list[tuple[int, int, int]] = []
    real = os.copy_file_range

    def recording(src: int, dst: int, count: int, offset_src: int, offset_dst: int) -> int:
        calls.append((count, offset_src, offset_dst))
        return real(src, dst, min(count, 3 * BLOCK), offset_src, offset_dst)  # short returns too

    monkeypatch.setattr(os, "copy_file_range", recording)
    (tmp_path / "src").write_bytes(os.urandom(40_000))
    with open(tmp_path / "src", "rb") as s, open(tmp_path / "dst", "wb") as d:
        d.write(b"x" * 4196)
        d.flush()
        ranges.copy_range(s.fileno(), 100, d.fileno(), 4196, 30_000)
    assert calls[0] == (BLOCK - 100, 100, 4196)  # the head, up to the boundary
    assert [c[2] % BLOCK for c in calls[1:]] == [0] * (len(calls) - 1)
    assert calls[1][0] == 30_000 - (BLOCK - 100)  # the aligned rest, asked for in one call
    assert (tmp_path / "dst").read_bytes()[4196:] == (tmp_path / "src").read_bytes()[100:30_100]


def test_shared_bytes_is_reported_and_unknown_when_the_platform_cannot_tell(tmp_path: Path, monkeypatch: Any) -> None:
    src, out = tmp_path / "ddp.pth", tmp_path / "bare.pth"
    torch.save(_ddp_state(), src)
    result = invoke_cli("strip-module", src, out, "--json")
    assert result.returncode == 0, result.stderr
    shared = json.loads(result.stdout)["shared_bytes"]
    assert shared is None or 0 <= shared <= out.stat().st_size

    import fcntl

    def unsupported(*_: Any) -> None:
        raise OSError(95, "Operation not supported")

    monkeypatch.setattr(fcntl, "ioctl", unsupported)
    with open(out, "rb") as f:
        assert extents.shared_bytes(f.fileno()) is None
    report = ckptfix.fix_prefix(src, tmp_path / "again.pth")
    assert report.written and report.shared_bytes is None


def _hub_shards(folder: Path) -> dict[str, torch.Tensor]:
    from huggingface_hub import save_torch_state_dict

    g = torch.Generator().manual_seed(4)
    tensors = {f"layer{i}.weight": torch.randn(100_000 + i, generator=g) for i in range(6)}
    folder.mkdir()
    save_torch_state_dict(tensors, str(folder), max_shard_size="1MB")
    return tensors


def test_unchanged_shards_are_copied_whole_and_renamed_ones_keep_their_offsets(tmp_path: Path) -> None:
    hub, same, renamed = tmp_path / "hub", tmp_path / "same", tmp_path / "renamed"
    tensors = _hub_shards(hub)
    shards = sorted(hub.glob("*.safetensors"))
    assert len(shards) > 1
    ckptfix.convert(hub, same, ckptfix.ConvertOptions(max_shard_size="1MB"))
    for shard in shards:
        assert (same / shard.name).read_bytes() == shard.read_bytes()
    ckptfix.convert(hub, renamed, ckptfix.ConvertOptions(max_shard_size="1MB", add_prefix="model."))
    for shard in shards:
        out = renamed / shard.name
        assert _data_start(out) % BLOCK == _data_start(shard) % BLOCK
        assert out.read_bytes()[_data_start(out) :] == shard.read_bytes()[_data_start(shard) :]
    merged = {k: v for shard in sorted(renamed.glob("*.safetensors")) for k, v in load_file(shard).items()}
    assert_same_tree(merged, {f"model.{k}": v for k, v in tensors.items()})


def test_records_kept_in_place_are_copied_in_one_kernel_call(tmp_path: Path, monkeypatch: Any) -> None:
    """strip-module leaves the records' bytes as they were (headers, data, descriptors): the
    whole run goes to the kernel as one copy (head to the block boundary, then the rest), on a
    file system where that copy may share blocks (XFS here; on ext4 the native engine copies
    each record once through a buffer instead, its CRC checked on the way: test_big_copies.py)."""
    monkeypatch.setattr(ranges, "_file_system", lambda device: "xfs")
    src, out = tmp_path / "ddp.pth", tmp_path / "bare.pth"
    sd = {f"module.layer{i}.weight": torch.randn(30_000 + 16 * i) for i in range(6)}
    torch.save(sd, src)
    calls: list[int] = []
    real = os.copy_file_range

    def counting(src_fd: int, dst_fd: int, count: int, offset_src: int, offset_dst: int) -> int:
        calls.append(count)
        return real(src_fd, dst_fd, count, offset_src, offset_dst)

    monkeypatch.setattr(os, "copy_file_range", counting)
    ckptfix.fix_prefix(src, out)
    assert len(calls) <= 2 and sum(calls) > sum(t.nbytes for t in sd.values())
    _loads_everywhere(out, {k.removeprefix("module."): v for k, v in sd.items()})


def test_merged_copies_are_bounded_and_give_the_same_bytes(tmp_path: Path, monkeypatch: Any) -> None:
    """Merging stops at MERGE_LIMIT (progress runs at most that far ahead of the copying): a
    small limit gives more kernel calls and the very same file."""
    src = tmp_path / "ddp.pth"
    torch.save(_ddp_state(), src)
    st = tmp_path / "a.safetensors"
    _st_source(st)
    outputs = {}
    for limit in (ranges.MERGE_LIMIT, 50_000):
        monkeypatch.setattr(ranges, "MERGE_LIMIT", limit)
        for source, name in ((src, "bare.pth"), (st, "b.safetensors")):
            out = tmp_path / f"{limit}-{name}"
            ckptfix.convert(source, out, ckptfix.ConvertOptions(strip_prefixes=("module.",)))
            outputs.setdefault(name, []).append(out.read_bytes())
    assert all(a == b for a, b in outputs.values())
