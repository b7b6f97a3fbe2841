"""`convert` in the library: .pth <-> safetensors <-> HF shards, checked with torch and safetensors
(the command line: tests/cli/test_convert_cli.py)."""

from __future__ import annotations

import json
import tempfile
import zipfile
from pathlib import Path

import torch
from conftest import assert_values
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from strategies import flat_state_dicts

import ckptfix


def _settings(examples: int) -> settings:
    return settings(
        max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
    )


def _ties(sd: dict) -> set[frozenset[str]]:
    """Groups of names bound to one tensor object (what safetensors' save_model calls shared)."""
    groups: dict[int, set[str]] = {}
    for name, tensor in sd.items():
        groups.setdefault(id(tensor), set()).add(name)
    return {frozenset(g) for g in groups.values() if len(g) > 1}


def _assert_ties_restored(loaded: dict, original: dict) -> None:
    for group in _ties(original):
        if original[next(iter(group))].numel() == 0:
            continue
        ptrs = {(loaded[n].untyped_storage().data_ptr(), loaded[n].storage_offset()) for n in group}
        assert len(ptrs) == 1, f"tie {sorted(group)} not restored"


@_settings(120)
@given(flat_state_dicts())
def test_pth_to_safetensors_and_back(sd: dict) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        src, mid, back = (Path(tmp) / n for n in ("in.pth", "mid.safetensors", "back.pth"))
        torch.save(sd, src)
        ckptfix.convert(src, mid)
        stored = load_file(mid)
        with safe_open(mid, "pt") as f:
            aliases = {k: v for k, v in (f.metadata() or {}).items() if k in sd}
        assert set(stored) | set(aliases) == set(sd)
        assert_values({**stored, **{a: stored[k] for a, k in aliases.items()}}, sd)
        assert all(t.is_contiguous() for t in stored.values())
        ckptfix.convert(mid, back)
        loaded = torch.load(back, weights_only=True)
        assert_values(loaded, sd)
        _assert_ties_restored(loaded, sd)
        mapped = torch.load(back, weights_only=True, mmap=True)
        assert_values(mapped, sd)


@_settings(60)
@given(flat_state_dicts(max_size=10), st.integers(1, 400), st.sampled_from(["safetensors", "pth"]))
def test_pth_to_shards_and_back(sd: dict, max_bytes: int, shard_format: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        src, shards, back = Path(tmp) / "in.pth", Path(tmp) / "shards", Path(tmp) / "back.pth"
        torch.save(sd, src)
        opts = ckptfix.ConvertOptions(max_shard_size=max_bytes, out_format=shard_format)
        report = ckptfix.convert(src, str(shards) + "/", opts)
        index = next(shards.glob("*.index.json"), None)
        files = [Path(p) for p in report.outputs if not p.endswith(".json")]
        if index is not None:
            document = json.loads(index.read_text())
            listed = set(document["weight_map"])
            aliases = {k for k, v in document["metadata"].items() if k != "total_size"}
            assert listed | aliases == set(sd) and not listed & aliases
            assert set(document["weight_map"].values()) == {f.name for f in files}
        if shard_format == "safetensors":
            for f in files:
                content = load_file(f)
                assert len(content) == 1 or sum(t.nbytes for t in content.values()) <= max_bytes
        ckptfix.convert(shards, back)
        loaded = torch.load(back, weights_only=True)
        assert_values(loaded, sd)
        _assert_ties_restored(loaded, sd)


def test_oversized_tensor_gets_its_own_shard(tmp_path: Path) -> None:
    sd = {"a": torch.zeros(10), "big": torch.zeros(100), "b": torch.zeros(10), "c": torch.zeros(10)}
    torch.save(sd, tmp_path / "in.pth")
    ckptfix.convert(tmp_path / "in.pth", str(tmp_path / "out") + "/", ckptfix.ConvertOptions(max_shard_size=100))
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    shards = {}
    for key, shard in index["weight_map"].items():
        shards.setdefault(shard, []).append(key)
    assert sorted(shards.values()) == [["a"], ["b", "c"], ["big"]]
    assert index["metadata"]["total_size"] == 130 * 4


def test_safetensors_to_pth_writes_cpu_unless_mapped(tmp_path: Path) -> None:
    save_file({"w": torch.ones(2)}, tmp_path / "w.safetensors")
    ckptfix.convert(tmp_path / "w.safetensors", tmp_path / "cpu.pth")
    assert ckptfix.inspect_checkpoint(tmp_path / "cpu.pth")["devices"] == {"cpu": 1}
    ckptfix.convert(tmp_path / "w.safetensors", tmp_path / "gpu.pth", ckptfix.ConvertOptions(map_location="cuda"))
    assert ckptfix.inspect_checkpoint(tmp_path / "gpu.pth")["devices"] == {"cuda:0": 1}


def test_big_endian_and_deflated_sources_convert_to_correct_safetensors(tmp_path: Path) -> None:
    sd = {"f": torch.randn(3, 2), "c": torch.randn(2, dtype=torch.complex64), "i": torch.arange(4)}
    torch.save(sd, tmp_path / "in.pth")
    odd = zipfile.ZipFile(tmp_path / "odd.pth", "w", zipfile.ZIP_DEFLATED)
    with zipfile.ZipFile(tmp_path / "in.pth") as z, odd as o:
        for info in z.infolist():
            data = z.read(info)
            if info.filename.endswith("/byteorder"):
                data = b"big"
            elif "/data/" in info.filename and not info.filename.endswith("serialization_id"):
                item = 8 if info.filename.endswith("/1") or info.filename.endswith("/2") else 4
                data = b"".join(data[i : i + item][::-1] for i in range(0, len(data), item))
            o.writestr(info.filename, data)
    expected = torch.load(tmp_path / "odd.pth", weights_only=True)  # torch swaps to native order
    ckptfix.convert(tmp_path / "odd.pth", tmp_path / "out.safetensors")
    assert_values(load_file(tmp_path / "out.safetensors"), expected)
