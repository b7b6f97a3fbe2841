"""`convert`: .pth <-> safetensors <-> HF shards, checked with torch, safetensors and huggingface_hub."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, ROOT, run_cli, tensor_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from models import TinyNet, tiny_net
from safetensors import safe_open
from safetensors.torch import load_file, save_file, save_model
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


def _assert_values(loaded: dict, original: dict) -> None:
    assert set(loaded) == set(original)
    for name, tensor in original.items():
        got = loaded[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert tensor_bytes(got) == tensor_bytes(tensor), name


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
        _assert_values({**stored, **{a: stored[k] for a, k in aliases.items()}}, sd)
        assert all(t.is_contiguous() for t in stored.values())
        ckptfix.convert(mid, back)
        loaded = torch.load(back, weights_only=True)
        _assert_values(loaded, sd)
        _assert_ties_restored(loaded, sd)
        mapped = torch.load(back, weights_only=True, mmap=True)
        _assert_values(mapped, sd)


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
        _assert_values(loaded, sd)
        _assert_ties_restored(loaded, sd)


def test_tied_model_round_trip_through_safetensors_loads_strictly(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight
    torch.save(model.state_dict(), tmp_path / "tied.pth")
    assert run_cli("convert", tmp_path / "tied.pth", tmp_path / "tied.safetensors").returncode == 0
    with safe_open(tmp_path / "tied.safetensors", "pt") as f:
        assert f.metadata() == {"1.weight": "0.weight"}  # save_model's record of the dropped name
        assert list(f.keys()) == ["0.weight"]
    assert run_cli("convert", tmp_path / "tied.safetensors", tmp_path / "back.pth").returncode == 0
    back = torch.load(tmp_path / "back.pth", weights_only=True)
    assert back["0.weight"].data_ptr() == back["1.weight"].data_ptr()
    fresh = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    fresh.load_state_dict(back, strict=True)


def test_reads_files_written_by_safetensors_save_model(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight
    save_model(model, str(tmp_path / "m.safetensors"))
    assert run_cli("convert", tmp_path / "m.safetensors", tmp_path / "m.pth").returncode == 0
    loaded = torch.load(tmp_path / "m.pth", weights_only=True)
    assert torch.equal(loaded["1.weight"], model[0].weight.detach())
    assert loaded["0.weight"].data_ptr() == loaded["1.weight"].data_ptr()


def test_shards_written_by_huggingface_hub(tmp_path: Path) -> None:
    from huggingface_hub import save_torch_state_dict

    sd = {f"layer{i}.weight": torch.randn(16, 16) for i in range(6)}
    (tmp_path / "hub").mkdir()
    save_torch_state_dict(sd, tmp_path / "hub", max_shard_size=3000)
    assert len(list((tmp_path / "hub").glob("*.safetensors"))) > 1
    result = run_cli("convert", tmp_path / "hub", tmp_path / "merged.pth")
    assert result.returncode == 0, result.stderr
    _assert_values(torch.load(tmp_path / "merged.pth", weights_only=True), sd)


def test_our_shards_load_with_huggingface_hub(tmp_path: Path) -> None:
    from huggingface_hub import load_torch_model

    out = tmp_path / "shards"
    result = run_cli("convert", FIXTURES / "bare_tinynet.pth", str(out) + "/", "--max-shard-size", "200B")
    assert result.returncode == 0, result.stderr
    assert (out / "model.safetensors.index.json").exists()
    model = TinyNet()
    load_torch_model(model, out, strict=True)
    for name, value in tiny_net().state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


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


def test_training_checkpoint_needs_select_and_names_candidates(tmp_path: Path) -> None:
    ckpt = FIXTURES / "lightning_tinynet.ckpt"
    refused = run_cli("convert", ckpt, tmp_path / "w.safetensors")
    assert refused.returncode == 2
    assert "--select state_dict" in refused.stderr and "optimizer state" in refused.stderr
    assert not (tmp_path / "w.safetensors").exists()
    ok = run_cli(
        "convert",
        ckpt,
        tmp_path / "w.safetensors",
        "--select",
        "state_dict",
        "--strip-prefix",
        "model.",
        "--keep-metadata",
    )
    assert ok.returncode == 0, ok.stderr
    model = TinyNet()
    model.load_state_dict(load_file(tmp_path / "w.safetensors"), strict=True)
    with safe_open(tmp_path / "w.safetensors", "pt") as f:
        meta = f.metadata()
    assert meta["epoch"] == "3" and meta["pytorch-lightning_version"] == "2.4.0"
    assert json.loads(meta["hyper_parameters"]) == {"lr": 0.001, "layers": [4, 2]}


@pytest.mark.parametrize(
    ("tensor", "words"),
    [
        (torch.eye(2).to_sparse(), "sparse"),
        (torch.zeros(2, dtype=torch.complex128), "complex128"),
        (torch.empty(2, device="meta"), "meta"),
    ],
)
def test_tensors_safetensors_cannot_hold_are_named(tmp_path: Path, tensor: torch.Tensor, words: str) -> None:
    torch.save({"ok": torch.ones(1), "bad.weight": tensor}, tmp_path / "in.pth")
    result = run_cli("convert", tmp_path / "in.pth", tmp_path / "out.safetensors")
    assert result.returncode == 2 and "'bad.weight'" in result.stderr and words in result.stderr
    assert not (tmp_path / "out.safetensors").exists()


def _write_raw_safetensors(path: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize(
    ("header", "data", "words"),
    [
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            bytes(12),
            "overlap",
        ),
        ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(8), "truncated or corrupt"),
        ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8), "does not fit"),
        ({"a": {"dtype": "XX", "shape": [2], "data_offsets": [0, 8]}}, bytes(8), "corrupt safetensors entry"),
    ],
)
def test_corrupt_safetensors_is_refused(tmp_path: Path, header: dict, data: bytes, words: str) -> None:
    src = tmp_path / "bad.safetensors"
    _write_raw_safetensors(src, header, data)
    result = run_cli("convert", src, tmp_path / "out.pth")
    assert result.returncode == 3 and words in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_huge_safetensors_header_is_refused_quickly(tmp_path: Path) -> None:
    src = tmp_path / "huge.safetensors"
    src.write_bytes(struct.pack("<Q", 10**15) + b'{"a": 1}')
    result = run_cli("inspect", src)
    assert result.returncode == 3


def _shards(tmp_path: Path) -> Path:
    torch.save({f"w{i}": torch.full((8,), float(i)) for i in range(4)}, tmp_path / "in.pth")
    out = tmp_path / "shards"
    ckptfix.convert(tmp_path / "in.pth", str(out) + "/", ckptfix.ConvertOptions(max_shard_size=64))
    return out


def test_index_problems_are_reported(tmp_path: Path) -> None:
    out = _shards(tmp_path)
    index_path = out / "model.safetensors.index.json"
    original = json.loads(index_path.read_text())
    cases = {
        "is missing": lambda d: d["weight_map"].update(w0="model-00009-of-00009.safetensors"),
        "in no shard": lambda d: d["weight_map"].update(ghost=d["weight_map"]["w0"]),
        "does not list": lambda d: d["weight_map"].pop("w1"),
        "is listed for": lambda d: d["weight_map"].update(w0=d["weight_map"]["w3"]),
        "not a file in the index's folder": lambda d: d["weight_map"].update(w0="../in.pth"),
    }
    for words, edit in cases.items():
        document = json.loads(json.dumps(original))
        edit(document)
        index_path.write_text(json.dumps(document))
        result = run_cli("convert", index_path, tmp_path / "merged.pth", "--force")
        assert result.returncode == 3 and words in result.stderr, (words, result.stderr)


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
    _assert_values(load_file(tmp_path / "out.safetensors"), expected)


def test_convert_between_pth_and_safetensors_does_not_import_torch(tmp_path: Path) -> None:
    code = (
        "import sys; from ckptfix.cli import main\n"
        "for args in (['convert', sys.argv[1], sys.argv[2] + '/a.safetensors'],\n"
        "             ['convert', sys.argv[2] + '/a.safetensors', sys.argv[2] + '/b.pth'],\n"
        "             ['convert', sys.argv[2] + '/b.pth', sys.argv[2] + '/shards/', '--max-shard-size', '1KB']):\n"
        "    try:\n        main(args)\n    except SystemExit as e:\n        assert e.code == 0, (args, e.code)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(FIXTURES / "dataparallel_tinynet.pth"), str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr


def test_shard_folder_errors_are_exit_4(tmp_path: Path) -> None:
    missing_parent = run_cli("convert", FIXTURES / "bare_tinynet.pth", str(tmp_path / "no" / "shards") + "/")
    assert missing_parent.returncode == 4 and "does not exist" in missing_parent.stderr
    (tmp_path / "afile").write_text("x")
    not_folder = run_cli("convert", FIXTURES / "bare_tinynet.pth", tmp_path / "afile", "--max-shard-size", "1KB")
    assert not_folder.returncode == 4 and "not a folder" in not_folder.stderr
    out = tmp_path / "shards"
    assert run_cli("convert", FIXTURES / "bare_tinynet.pth", str(out) + "/", "--max-shard-size", "200B").returncode == 0
    again = run_cli("convert", FIXTURES / "bare_tinynet.pth", str(out) + "/", "--max-shard-size", "200B")
    assert again.returncode == 4 and "--force" in again.stderr
