"""`convert` on the command line: .pth <-> safetensors <-> HF shards, checked with torch, safetensors
and huggingface_hub (the library's round trips: tests/unit/test_convert.py)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, assert_values, invoke_cli
from models import TinyNet, tiny_net
from safetensors import safe_open
from safetensors.torch import load_file, save_model

import ckptfix


def test_tied_model_round_trip_through_safetensors_loads_strictly(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight
    torch.save(model.state_dict(), tmp_path / "tied.pth")
    assert invoke_cli("convert", tmp_path / "tied.pth", tmp_path / "tied.safetensors").returncode == 0
    with safe_open(tmp_path / "tied.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt", "1.weight": "0.weight"}  # the hub marker, and the dropped name
        assert list(f.keys()) == ["0.weight"]
    assert invoke_cli("convert", tmp_path / "tied.safetensors", tmp_path / "back.pth").returncode == 0
    back = torch.load(tmp_path / "back.pth", weights_only=True)
    assert back["0.weight"].data_ptr() == back["1.weight"].data_ptr()
    fresh = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    fresh.load_state_dict(back, strict=True)


def test_reads_files_written_by_safetensors_save_model(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight
    save_model(model, str(tmp_path / "m.safetensors"))
    assert invoke_cli("convert", tmp_path / "m.safetensors", tmp_path / "m.pth").returncode == 0
    loaded = torch.load(tmp_path / "m.pth", weights_only=True)
    assert torch.equal(loaded["1.weight"], model[0].weight.detach())
    assert loaded["0.weight"].data_ptr() == loaded["1.weight"].data_ptr()


def test_shards_written_by_huggingface_hub(tmp_path: Path) -> None:
    from huggingface_hub import save_torch_state_dict

    sd = {f"layer{i}.weight": torch.randn(16, 16) for i in range(6)}
    (tmp_path / "hub").mkdir()
    save_torch_state_dict(sd, tmp_path / "hub", max_shard_size=3000)
    assert len(list((tmp_path / "hub").glob("*.safetensors"))) > 1
    result = invoke_cli("convert", tmp_path / "hub", tmp_path / "merged.pth")
    assert result.returncode == 0, result.stderr
    assert_values(torch.load(tmp_path / "merged.pth", weights_only=True), sd)


def test_our_shards_load_with_huggingface_hub(tmp_path: Path) -> None:
    from huggingface_hub import load_torch_model

    out = tmp_path / "shards"
    result = invoke_cli("convert", FIXTURES / "bare_tinynet.pth", str(out) + "/", "--max-shard-size", "200B")
    assert result.returncode == 0, result.stderr
    assert (out / "model.safetensors.index.json").exists()
    model = TinyNet()
    load_torch_model(model, out, strict=True)
    for name, value in tiny_net().state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_training_checkpoint_needs_select_and_names_candidates(tmp_path: Path) -> None:
    ckpt = FIXTURES / "lightning_tinynet.ckpt"
    refused = invoke_cli("convert", ckpt, tmp_path / "w.safetensors")
    assert refused.returncode == 3
    assert "--select state_dict" in refused.stderr and "optimizer state" in refused.stderr
    assert not (tmp_path / "w.safetensors").exists()
    ok = invoke_cli(
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
    result = invoke_cli("convert", tmp_path / "in.pth", tmp_path / "out.safetensors")
    assert result.returncode == 3 and "'bad.weight'" in result.stderr and words in result.stderr
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
    result = invoke_cli("convert", src, tmp_path / "out.pth")
    assert result.returncode == 3 and words in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_huge_safetensors_header_is_refused_quickly(tmp_path: Path) -> None:
    src = tmp_path / "huge.safetensors"
    src.write_bytes(struct.pack("<Q", 10**15) + b'{"a": 1}')
    result = invoke_cli("inspect", src)
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
        result = invoke_cli("convert", index_path, tmp_path / "merged.pth", "--force")
        assert result.returncode == 3 and words in result.stderr, (words, result.stderr)


def test_shard_folder_errors_are_exit_4(tmp_path: Path) -> None:
    missing_parent = invoke_cli("convert", FIXTURES / "bare_tinynet.pth", str(tmp_path / "no" / "shards") + "/")
    assert missing_parent.returncode == 4 and "does not exist" in missing_parent.stderr
    (tmp_path / "afile").write_text("x")
    not_folder = invoke_cli("convert", FIXTURES / "bare_tinynet.pth", tmp_path / "afile", "--max-shard-size", "1KB")
    assert not_folder.returncode == 4 and "not a folder" in not_folder.stderr
    out = tmp_path / "shards"
    assert (
        invoke_cli("convert", FIXTURES / "bare_tinynet.pth", str(out) + "/", "--max-shard-size", "200B").returncode == 0
    )
    again = invoke_cli("convert", FIXTURES / "bare_tinynet.pth", str(out) + "/", "--max-shard-size", "200B")
    assert again.returncode == 4 and "--force" in again.stderr
