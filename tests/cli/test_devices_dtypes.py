"""Device tags (--map-location, remap) and --dtype casts, against what torch itself does."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, assert_same_checkpoint, assert_same_tree, invoke_cli, tensor_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file
from strategies import flat_state_dicts

import ckptfix
from ckptfix.model.walk import iter_storages, iter_tensors

DP = FIXTURES / "dataparallel_tinynet.pth"
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
MIXED = FLOATS + [torch.int64, torch.bool, torch.uint8, torch.complex64, torch.float8_e4m3fn]


def _retag(src: Path, dst: Path, tags: dict[str, str] | str) -> None:
    """Give storages device tags as a GPU save would (by key prefix, or all the same)."""
    ckpt = ckptfix.read_checkpoint(src)
    for path, tensor in iter_tensors(ckpt.root):
        name = ".".join(map(str, path))
        tensor.storage.location = (
            tags
            if isinstance(tags, str)
            else next((tag for prefix, tag in tags.items() if name.startswith(prefix)), "cpu")
        )
    ckptfix.write_checkpoint(ckpt, ckpt.root, dst)


def _devices(path: Path) -> dict[str, int]:
    return ckptfix.inspect_checkpoint(path)["devices"]


def test_cuda_checkpoint_remapped_to_cpu_loads_with_plain_torch_load(tmp_path: Path) -> None:
    _retag(DP, tmp_path / "gpu.pth", "cuda:3")
    with pytest.raises(RuntimeError, match="CUDA"):
        torch.load(tmp_path / "gpu.pth", weights_only=True)
    result = invoke_cli("remap", tmp_path / "gpu.pth", tmp_path / "cpu.pth", "--map-location", "cpu")
    assert result.returncode == 0, result.stderr
    assert_same_tree(torch.load(tmp_path / "cpu.pth"), torch.load(DP, weights_only=True))
    assert (tmp_path / "cpu.pth").stat().st_size == (tmp_path / "gpu.pth").stat().st_size


def test_pairs_map_only_their_tags_and_bare_types_match_every_index(tmp_path: Path) -> None:
    _retag(DP, tmp_path / "mixed.pth", {"module.conv1": "cuda:1", "module.bn1": "cuda:2"})
    assert _devices(tmp_path / "mixed.pth") == {"cuda:2": 5, "cpu": 2, "cuda:1": 2}
    ckptfix.convert(tmp_path / "mixed.pth", tmp_path / "a.pth", ckptfix.ConvertOptions(map_location="cuda:1=cuda:0"))
    assert _devices(tmp_path / "a.pth") == {"cuda:2": 5, "cpu": 2, "cuda:0": 2}
    ckptfix.convert(tmp_path / "mixed.pth", tmp_path / "b.pth", ckptfix.ConvertOptions(map_location="cuda=cpu"))
    assert _devices(tmp_path / "b.pth") == {"cpu": 9}
    result = invoke_cli(
        "remap",
        tmp_path / "mixed.pth",
        tmp_path / "c.pth",
        "--map-location",
        "cuda:1=cuda",
        "--map-location",
        "cuda:2=meta",
    )
    assert result.returncode == 0, result.stderr
    assert _devices(tmp_path / "c.pth") == {"meta": 5, "cpu": 2, "cuda:0": 2}


def test_inspect_shows_devices_per_subtree_and_warns_on_mixed(tmp_path: Path) -> None:
    torch.save({"model": {"w": torch.ones(2)}, "stats": torch.zeros(1)}, tmp_path / "m.pth")
    _retag(tmp_path / "m.pth", tmp_path / "mixed.pth", {"model": "cuda:0"})
    info = ckptfix.inspect_checkpoint(tmp_path / "mixed.pth")
    entries = {e["path"]: e for e in info["tree"]}
    assert entries["model"]["devices"] == {"cuda:0": 1}
    assert "on cpu" in entries["stats"]["value"]
    assert len(info["warnings"]) == 1 and "several devices" in info["warnings"][0]
    assert "warning: tensors on several devices" in invoke_cli("inspect", tmp_path / "mixed.pth").stdout


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("cuda1", "write 'cuda:1'"),
        ("0", "write 'cuda:0'"),
        ("gpu", "write 'cuda'"),
        ("cpu,cuda", "several"),
        ("cuda:1=", "invalid device ''"),
        ("tpu:0", "invalid device 'tpu:0'"),
    ],
)
def test_bad_map_location_is_usage_error_naming_the_part(tmp_path: Path, spec: str, words: str) -> None:
    result = invoke_cli("remap", DP, tmp_path / "out.pth", "--map-location", spec)
    assert result.returncode == 2 and words in result.stderr, result.stderr
    assert not (tmp_path / "out.pth").exists()


def test_remap_with_nothing_to_change_writes_nothing(tmp_path: Path) -> None:
    result = invoke_cli("remap", DP, tmp_path / "out.pth", "--map-location", "cpu")
    assert result.returncode == 0 and "no device tag changes" in result.stdout
    assert_same_checkpoint(tmp_path / "out.pth", DP)  # an unchanged copy
    assert invoke_cli("remap", DP, tmp_path / "strict.pth", "--map-location", "cpu", "--strict").returncode == 1
    assert not (tmp_path / "strict.pth").exists()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(flat_state_dicts(dtypes=MIXED), st.sampled_from(FLOATS), st.sampled_from(["pth", "safetensors"]))
def test_dtype_cast_equals_tensor_to_bitwise(sd: dict, target: torch.dtype, fmt: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "in.pth", Path(tmp) / f"out.{fmt}"
        torch.save(sd, src)
        ckptfix.convert(src, out, ckptfix.ConvertOptions(dtype=str(target).replace("torch.", "")))
        loaded = torch.load(out, weights_only=True) if fmt == "pth" else load_file(out)
        aliases = {}  # safetensors stores a tie once; its metadata maps each other name to the one stored
        if fmt == "safetensors":
            with safe_open(out, "pt") as f:
                aliases = {k: v for k, v in (f.metadata() or {}).items() if k in sd}
        assert set(loaded) | set(aliases) == set(sd) and not set(loaded) & set(aliases), (list(loaded), aliases)
        for name, tensor in sd.items():
            expected = tensor.to(target) if tensor.dtype in FLOATS else tensor
            got = loaded[aliases.get(name, name)]
            assert got.dtype == expected.dtype and got.shape == expected.shape, name
            if tensor_bytes(got) != tensor_bytes(expected) and got.is_floating_point():
                # torch's own fp16->fp32 cast of a *signaling* NaN keeps or sets the quiet bit
                # depending on whether its vectorized or scalar loop runs (the storage we cast is
                # longer than the tensor): every other bit must match, and NaN must stay NaN
                flat, want = got.reshape(-1), expected.reshape(-1)  # either may be a strided view
                differ = flat.ne(want) & ~(flat.isnan() & want.isnan())
                assert not differ.any(), name
                continue
            assert tensor_bytes(got) == tensor_bytes(expected), name
        if fmt == "pth":
            for a in sd:
                for b in sd:
                    if sd[a] is sd[b] and sd[a].numel():
                        assert loaded[a].data_ptr() == loaded[b].data_ptr()


def test_dtype_keep_and_integer_buffers(tmp_path: Path) -> None:
    result = invoke_cli("convert", DP, tmp_path / "half.pth", "--dtype", "float16", "--dtype-keep", "*bn1*", "--json")
    assert result.returncode == 0, result.stderr
    import json

    cast = json.loads(result.stdout)["cast"]
    assert cast["tensors"] == 4 and len(cast["kept"]) == 4
    assert cast["bytes_before"] == 2 * cast["bytes_after"]
    half, original = torch.load(tmp_path / "half.pth"), torch.load(DP)
    assert half["module.bn1.num_batches_tracked"].dtype == torch.int64
    assert half["module.bn1.weight"].dtype == torch.float32
    assert half["module.fc.weight"].dtype == torch.float16
    assert torch.equal(half["module.fc.weight"], original["module.fc.weight"].half())


def test_dtype_leaves_optimizer_state_alone(tmp_path: Path) -> None:
    opts = ckptfix.ConvertOptions(dtype="bfloat16")
    ckptfix.convert(FIXTURES / "lightning_tinynet.ckpt", tmp_path / "half.ckpt", opts)
    fixed = torch.load(tmp_path / "half.ckpt", weights_only=True)
    assert {t.dtype for t in fixed["state_dict"].values()} == {torch.bfloat16, torch.int64}
    state = fixed["optimizer_states"][0]["state"]
    assert {t.dtype for s in state.values() for t in s.values() if t.is_floating_point()} == {torch.float32}


def test_cast_storage_shared_with_kept_tensor_is_left_alone(tmp_path: Path) -> None:
    weight = torch.randn(4)
    torch.save({"emb.weight": weight, "norm.weight": weight}, tmp_path / "tied.pth")
    report = ckptfix.convert(
        tmp_path / "tied.pth", tmp_path / "out.pth", ckptfix.ConvertOptions(dtype="float16", dtype_keep=["norm.*"])
    )
    assert report.cast["tensors"] == 0 and report.cast["shared_with_uncast"] == ["emb.weight"]
    assert {s.dtype for s in iter_storages(ckptfix.read_checkpoint(tmp_path / "out.pth").root)} == {"float32"}
