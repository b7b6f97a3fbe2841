"""Key surgery and model fitting: rename, --drop/--keep, prune, diff, fit."""

from __future__ import annotations

import json
import re
import tempfile
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, ROOT, assert_same_checkpoint, invoke_cli, tensor_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from models import TinyNet, tiny_net
from strategies import flat_state_dicts

import ckptfix

DP = FIXTURES / "dataparallel_tinynet.pth"
LIGHTNING = FIXTURES / "lightning_tinynet.ckpt"
RULES = [
    (r"^layer(\d+)\.", r"block\1."),
    (r"weight$", "w"),
    (r"^(\w+)\.(\w+)$", r"\2.\1"),
    (r"\.", "_"),
    (r"^layer[0-4]", "early"),
    (r"running_(\w+)", r"stats.\1"),
]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(flat_state_dicts(max_size=8), st.lists(st.sampled_from(RULES), min_size=1, max_size=3))
def test_rename_matches_re_sub_over_torch_load(sd: dict, rules: list[tuple[str, str]]) -> None:
    def apply(key: str) -> str:
        for pattern, replacement in rules:
            key = re.sub(pattern, replacement, key)
        return key

    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "in.pth", Path(tmp) / "out.pth"
        torch.save(sd, src)
        expected_keys = [apply(k) for k in torch.load(src, weights_only=True)]
        opts = ckptfix.ConvertOptions(rename=[f"{p}=>{r}" for p, r in rules])
        if len(set(expected_keys)) < len(expected_keys):
            with pytest.raises(ckptfix.CheckFailedError, match="same name"):
                ckptfix.convert(src, out, opts)
            assert not out.exists()
            return
        ckptfix.convert(src, out, opts)
        reference = {apply(k): v for k, v in torch.load(src, weights_only=True).items()}
        loaded = torch.load(out, weights_only=True)
        assert list(loaded) == list(reference)
        for key, value in reference.items():
            assert loaded[key].dtype == value.dtype and loaded[key].shape == value.shape
            assert tensor_bytes(loaded[key]) == tensor_bytes(value), key


def test_rename_cli_dry_run_and_bad_rules(tmp_path: Path) -> None:
    dry = invoke_cli("rename", DP, tmp_path / "out.pth", "--rule", r"^module\.bn1=>module.norm", "--dry-run")
    assert dry.returncode == 0 and "module.bn1.weight -> module.norm.weight" in dry.stdout
    assert not (tmp_path / "out.pth").exists()
    bad = invoke_cli("rename", DP, tmp_path / "out.pth", "--rule", "([unclosed=>x")
    assert bad.returncode == 2 and "invalid rename rule" in bad.stderr
    no_arrow = invoke_cli("rename", DP, tmp_path / "out.pth", "--rule", "module")
    assert no_arrow.returncode == 2 and "REGEX=>REPLACEMENT" in no_arrow.stderr
    clash = invoke_cli("rename", DP, tmp_path / "out.pth", "--rule", r"\.(weight|bias)$=>.p")
    assert clash.returncode == 1 and "same name" in clash.stderr


def test_drop_and_keep(tmp_path: Path) -> None:
    result = invoke_cli(
        "convert",
        LIGHTNING,
        tmp_path / "a.ckpt",
        "--drop",
        "optimizer_states",
        "--drop",
        "lr_*",
        "--keep",
        "*conv1*",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    out = torch.load(tmp_path / "a.ckpt", weights_only=True)
    assert "optimizer_states" not in out and "lr_schedulers" not in out and out["epoch"] == 3
    assert list(out["state_dict"]) == ["model.conv1.weight", "model.conv1.bias"]
    assert report["dropped_bytes"] > 0 and "optimizer_states" in report["dropped"]
    nbt = invoke_cli("convert", DP, tmp_path / "b.pth", "--drop", "*.num_batches_tracked")
    assert nbt.returncode == 0
    assert not any(k.endswith("num_batches_tracked") for k in torch.load(tmp_path / "b.pth"))


def test_prune_keeps_weights_and_reports_bytes(tmp_path: Path) -> None:
    result = invoke_cli("prune", LIGHTNING, tmp_path / "w.ckpt", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert sorted(report["dropped"]) == ["lr_schedulers", "optimizer_states"]
    pruned = torch.load(tmp_path / "w.ckpt", weights_only=True)
    original = torch.load(LIGHTNING, weights_only=True)
    assert set(pruned) == {"epoch", "global_step", "pytorch-lightning_version", "state_dict", "hyper_parameters"}
    assert set(pruned["state_dict"]) == set(original["state_dict"])
    assert report["dropped_bytes"] == sum(
        t.untyped_storage().nbytes() for s in original["optimizer_states"][0]["state"].values() for t in s.values()
    )
    assert (tmp_path / "w.ckpt").stat().st_size < LIGHTNING.stat().st_size
    nothing = invoke_cli("prune", DP, tmp_path / "x.pth")
    assert nothing.returncode == 0 and "nothing to prune" in nothing.stdout
    assert_same_checkpoint(tmp_path / "x.pth", DP)


def _flip_one_bit(src: Path, dest: Path, record: str, byte: int) -> None:
    with zipfile.ZipFile(src) as z, zipfile.ZipFile(dest, "w") as out:
        for info in z.infolist():
            data = bytearray(z.read(info))
            if info.filename.endswith(record):
                data[byte] ^= 0x01
            out.writestr(info.filename, bytes(data))


def test_diff_finds_a_single_flipped_bit(tmp_path: Path) -> None:
    sd = {f"layer{i}.weight": torch.randn(64, 64) for i in range(6)}
    torch.save(sd, tmp_path / "a.pth")
    _flip_one_bit(tmp_path / "a.pth", tmp_path / "b.pth", "/data/3", 1001)
    result = invoke_cli("diff", tmp_path / "a.pth", tmp_path / "b.pth", "--json")
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert [d["path"] for d in report["different"]] == ["layer3.weight"]
    assert report["different"][0]["differing_elements"] == 1 and report["tensors_equal"] == 5
    assert report["different"][0]["max_abs_diff"] > 0
    text = invoke_cli("diff", tmp_path / "a.pth", tmp_path / "b.pth").stdout
    assert "values differ: layer3.weight: 1/4096 elements" in text


def test_diff_equal_across_formats_and_after_a_fix(tmp_path: Path) -> None:
    ckptfix.convert(FIXTURES / "bare_tinynet.pth", tmp_path / "m.safetensors")
    ckptfix.convert(
        FIXTURES / "bare_tinynet.pth", str(tmp_path / "shards") + "/", ckptfix.ConvertOptions(max_shard_size=300)
    )
    for other in (tmp_path / "m.safetensors", tmp_path / "shards", FIXTURES / "legacy_dataparallel_tinynet.pth"):
        args = ["--strip-prefix", "module."] if "legacy" in other.name else []
        result = invoke_cli("diff", other, FIXTURES / "bare_tinynet.pth", *args)
        assert result.returncode == 0 and result.stdout.startswith("equal"), (other, result.stdout)
    wrapped = invoke_cli("diff", DP, FIXTURES / "bare_tinynet.pth")
    assert wrapped.returncode == 1 and "only in A (9)" in wrapped.stdout
    training = invoke_cli(
        "diff", LIGHTNING, tmp_path / "m.safetensors", "--select", "state_dict", "--strip-prefix", "model."
    )
    assert training.returncode == 0, training.stdout


def test_diff_tolerances_and_nan(tmp_path: Path) -> None:
    base = torch.tensor([1.0, float("nan"), -0.0, 3.0])
    torch.save({"w": base}, tmp_path / "a.pth")
    torch.save({"w": base + torch.tensor([1e-6, 0.0, 0.0, 0.0])}, tmp_path / "b.pth")
    assert invoke_cli("diff", tmp_path / "a.pth", tmp_path / "a.pth").returncode == 0  # NaN equals itself
    assert invoke_cli("diff", tmp_path / "a.pth", tmp_path / "b.pth").returncode == 1
    assert invoke_cli("diff", tmp_path / "a.pth", tmp_path / "b.pth", "--atol", "1e-5").returncode == 0
    torch.save({"w": base.half()}, tmp_path / "c.pth")
    across = invoke_cli("diff", tmp_path / "a.pth", tmp_path / "c.pth", "--json")  # values exact in float16
    report = json.loads(across.stdout)
    assert across.returncode == 0 and report["mismatched"] == [] and report["different"] == []
    assert report["dtype_changed"] == [{"path": "w", "a": "float32", "b": "float16"}]
    torch.save({"w": base.half()[:3]}, tmp_path / "d.pth")
    mismatch = invoke_cli("diff", tmp_path / "a.pth", tmp_path / "d.pth", "--json")
    assert json.loads(mismatch.stdout)["mismatched"] == [{"path": "w", "a": "float32 [4]", "b": "float16 [3]"}]


@pytest.mark.parametrize(
    "fixture",
    [
        "dataparallel_tinynet.pth",
        "dataparallel2_tinynet.pth",
        "ddp_cpu_tinynet.pth",
        "compiled_tinynet.pth",
        "compile_ddp_tinynet.pth",
        "lightning_tinynet.ckpt",
        "legacy_dataparallel_tinynet.pth",
    ],
)
def test_fit_wrapped_checkpoints_against_the_bare_model(tmp_path: Path, fixture: str) -> None:
    out = tmp_path / "fitted.pth"
    result = invoke_cli("fit", FIXTURES / fixture, out, "--reference", FIXTURES / "bare_tinynet.pth")
    assert result.returncode == 0, result.stdout + result.stderr
    model = TinyNet()
    model.load_state_dict(torch.load(out, weights_only=True), strict=True)
    for name, value in tiny_net().state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_fit_with_model_callable_and_common_prefix(tmp_path: Path) -> None:
    sd = {f"encoder.{k}": v for k, v in tiny_net().state_dict().items()}
    torch.save(sd, tmp_path / "enc.pth")
    # the current folder is never searched for --model: name the checkout explicitly
    result = invoke_cli(
        "fit",
        tmp_path / "enc.pth",
        tmp_path / "out.safetensors",
        "--model",
        "fixtures.models:TinyNet",
        "--model-path",
        ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "strip 'encoder.'" in result.stdout
    from safetensors.torch import load_file

    TinyNet().load_state_dict(load_file(tmp_path / "out.safetensors"), strict=True)
    wrapped = torch.nn.Sequential()
    wrapped.add_module("backbone", TinyNet())
    torch.save(wrapped.state_dict(), tmp_path / "ref.pth")
    add = invoke_cli("fit", FIXTURES / "bare_tinynet.pth", tmp_path / "bb.pth", "--reference", tmp_path / "ref.pth")
    assert add.returncode == 0 and "add 'backbone.'" in add.stdout
    wrapped.load_state_dict(torch.load(tmp_path / "bb.pth", weights_only=True), strict=True)


def test_fit_new_head_needs_allow_partial(tmp_path: Path) -> None:
    new_model = TinyNet()
    new_model.fc = torch.nn.Linear(4, 10)  # a new classifier head: fc has another shape
    torch.save(new_model.state_dict(), tmp_path / "new.pth")
    refused = invoke_cli("fit", DP, tmp_path / "out.pth", "--reference", tmp_path / "new.pth", "--json")
    assert refused.returncode == 1 and not (tmp_path / "out.pth").exists()
    plan = json.loads(refused.stdout)["plan"]
    assert {m["key"] for m in plan["shape_mismatches"]} == {"fc.weight", "fc.bias"}
    assert plan["loads_strictly"] is False and json.loads(refused.stdout)["written"] is False
    partial = invoke_cli("fit", DP, tmp_path / "out.pth", "--reference", tmp_path / "new.pth", "--allow-partial")
    assert partial.returncode == 1 and (tmp_path / "out.pth").exists()
    assert "shape mismatch: fc.weight: checkpoint [2, 4] vs reference [10, 4]" in partial.stdout
    result = new_model.load_state_dict(torch.load(tmp_path / "out.pth", weights_only=True), strict=False)
    assert sorted(result.missing_keys) == ["fc.bias", "fc.weight"] and not result.unexpected_keys


def test_fit_excuses_num_batches_tracked_only_where_batchnorm_fills_it_in(tmp_path: Path) -> None:
    sd = torch.nn.DataParallel(tiny_net()).state_dict()
    del sd["module.bn1.num_batches_tracked"]
    torch.save(sd, tmp_path / "v2.pth")  # metadata says BatchNorm version 2: the key is really missing
    strict = invoke_cli("fit", tmp_path / "v2.pth", tmp_path / "a.pth", "--reference", FIXTURES / "bare_tinynet.pth")
    assert strict.returncode == 1 and "missing (1): bn1.num_batches_tracked" in strict.stdout
    from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

    reference = torch.load(tmp_path / "v2.pth", weights_only=True)
    consume_prefix_in_state_dict_if_present(reference, "module.")
    with pytest.raises(RuntimeError, match="num_batches_tracked"):
        TinyNet().load_state_dict(reference, strict=True)  # torch agrees: really missing
    sd._metadata["module.bn1"]["version"] = 1  # as saved before torch 0.4.1
    torch.save(sd, tmp_path / "v1.pth")
    old = invoke_cli("fit", tmp_path / "v1.pth", tmp_path / "b.pth", "--reference", FIXTURES / "bare_tinynet.pth")
    assert old.returncode == 0 and "BatchNorm fills" in old.stdout
    TinyNet().load_state_dict(torch.load(tmp_path / "b.pth", weights_only=True), strict=True)
