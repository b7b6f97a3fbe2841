"""The command line as users drive it: options, reports, exit codes (the entry points and the no-torch
import check are in tests/e2e/test_entry_points.py)."""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from pathlib import Path

import torch
from conftest import FIXTURES, assert_same_checkpoint, invoke_cli

DP = FIXTURES / "dataparallel_tinynet.pth"
COMMANDS = [
    "strip-module",
    "add-module",
    "inspect",
    "convert",
    "remap",
    "rename",
    "prune",
    "diff",
    "fit",
    "verify",
    "scan",
    "publish",
]


def test_version_and_help_with_examples() -> None:
    version = invoke_cli("--version")
    assert version.returncode == 0 and "ckptfix, version" in version.stdout
    top = invoke_cli("--help")
    assert top.returncode == 0 and "Exit codes" in top.stdout
    for command in COMMANDS:
        result = invoke_cli(command, "--help")
        assert result.returncode == 0, command
        assert "Example" in result.stdout and f"ckptfix {command}" in result.stdout, command


def test_unknown_option_is_usage_error() -> None:
    result = invoke_cli("strip-module", "--no-such-option")
    assert result.returncode == 2 and "No such option" in result.stderr


def test_json_report(tmp_path: Path) -> None:
    result = invoke_cli("strip-module", DP, tmp_path / "out.pth", "--json")
    assert result.returncode == 0
    report = json.loads(result.stdout)
    assert report["written"] and report["renamed"] == 9 and report["input_format"] == "torch-zip"
    assert report["state_dicts"][0]["renames"][0] == ["module.conv1.weight", "conv1.weight"]
    assert report["output_bytes"] == (tmp_path / "out.pth").stat().st_size


def test_dry_run_writes_nothing_and_lists_renames(tmp_path: Path) -> None:
    out = tmp_path / "out.pth"
    result = invoke_cli("strip-module", DP, out, "--dry-run")
    assert result.returncode == 0 and not out.exists()
    assert "module.bn1.running_mean -> bn1.running_mean" in result.stdout
    assert "dry run" in result.stdout


def test_refuses_to_overwrite_without_force(tmp_path: Path) -> None:
    out = tmp_path / "out.pth"
    out.write_bytes(b"precious")
    result = invoke_cli("strip-module", DP, out)
    assert result.returncode == 4 and "--force" in result.stderr
    assert out.read_bytes() == b"precious"
    assert invoke_cli("strip-module", DP, out, "--force").returncode == 0
    assert set(torch.load(out, weights_only=True)) == set(torch.load(FIXTURES / "bare_tinynet.pth"))


def test_output_same_as_input_needs_in_place(tmp_path: Path) -> None:
    src = tmp_path / "model.pth"
    src.write_bytes(DP.read_bytes())
    same = invoke_cli("strip-module", src, src, "--force")
    assert same.returncode == 2 and "--in-place" in same.stderr
    assert src.read_bytes() == DP.read_bytes()
    in_place = invoke_cli("strip-module", src, "--in-place")
    assert in_place.returncode == 0, in_place.stderr
    assert all(not k.startswith("module.") for k in torch.load(src, weights_only=True))
    assert [p.name for p in tmp_path.iterdir()] == ["model.pth"]


def test_nothing_to_strip_exit_0_or_1_with_strict(tmp_path: Path) -> None:
    bare = FIXTURES / "bare_tinynet.pth"
    plain = invoke_cli("strip-module", bare, tmp_path / "out.pth")
    assert plain.returncode == 0 and "no key starts with 'module.'" in plain.stdout
    # OUT exists all the same (a && b chains never miss a file): the input, byte for byte
    assert_same_checkpoint(tmp_path / "out.pth", bare)
    assert "is the input unchanged" in plain.stderr
    strict = invoke_cli("strip-module", bare, tmp_path / "strict.pth", "--strict")
    assert strict.returncode == 1 and "no key starts with" in strict.stderr
    assert not (tmp_path / "strict.pth").exists()


def test_collision_names_both_keys_and_writes_nothing(tmp_path: Path) -> None:
    src = tmp_path / "clash.pth"
    torch.save({"fc.weight": torch.zeros(1), "module.fc.weight": torch.ones(1)}, src)
    result = invoke_cli("strip-module", src, tmp_path / "out.pth")
    assert result.returncode == 1
    assert "'fc.weight'" in result.stderr and "'module.fc.weight'" in result.stderr
    assert not (tmp_path / "out.pth").exists()


def test_key_restricts_to_one_state_dict(tmp_path: Path) -> None:
    sd = torch.nn.DataParallel(torch.nn.Linear(2, 2)).state_dict()
    src, out = tmp_path / "two.pth", tmp_path / "out.pth"
    torch.save({"model": sd, "ema": OrderedDict(sd), "epoch": 1}, src)
    result = invoke_cli("strip-module", src, out, "--key", "ema", "--json")
    assert result.returncode == 0, result.stderr
    fixed = torch.load(out, weights_only=True)
    assert set(fixed["ema"]) == {"weight", "bias"} and set(fixed["model"]) == {"module.weight", "module.bias"}
    missing = invoke_cli("strip-module", src, out, "--key", "nope", "--force")
    assert missing.returncode == 3 and "nope" in missing.stderr  # a problem with this input


def test_prefix_without_dot_is_completed(tmp_path: Path) -> None:
    result = invoke_cli("strip-module", FIXTURES / "compiled_tinynet.pth", tmp_path / "o.pth", "--prefix", "_orig_mod")
    assert result.returncode == 0 and "'_orig_mod.'" in result.stdout


def test_add_module_leaves_prefixed_keys_alone(tmp_path: Path) -> None:
    src, out = tmp_path / "mixed.pth", tmp_path / "out.pth"
    torch.save({"module.a": torch.zeros(1), "b": torch.ones(1)}, src)
    result = invoke_cli("add-module", src, out, "--json")
    assert json.loads(result.stdout)["renamed"] == 1
    assert list(torch.load(out, weights_only=True)) == ["module.a", "module.b"]


def test_inspect_reports_layout_prefixes_devices_and_globals() -> None:
    result = invoke_cli("inspect", FIXTURES / "lightning_tinynet.ckpt", "--json")
    assert result.returncode == 0
    info = json.loads(result.stdout)
    # the weights, plus Adam's step, exp_avg and exp_avg_sq for each of the 6 parameters
    assert info["format"] == "torch-zip" and info["tensors"] == 9 + 6 * 3
    assert info["state_dicts"] == [
        {"path": "state_dict", "keys": 9, "prefixes": [{"prefix": "model.", "keys": 9}], "has_metadata": False}
    ]
    kinds = {e["path"]: e["kind"] for e in info["tree"]}
    assert kinds["epoch"] == "int" and kinds["state_dict"] == "state dict"
    assert kinds["optimizer_states.0"] == "optimizer state"
    assert info["devices"] == {"cpu": 27}
    assert "torch._utils._rebuild_tensor_v2" in info["globals"]
    text = invoke_cli("inspect", DP).stdout
    assert "'module.' on 9/9 keys" in text and "devices: cpu x9" in text


def test_inspect_reports_shared_storage(tmp_path: Path) -> None:
    src = tmp_path / "tied.pth"
    weight = torch.zeros(3, 2)
    torch.save({"emb.weight": weight, "head.weight": weight}, src)
    info = json.loads(invoke_cli("inspect", src, "--json").stdout)
    assert info["shared_storages"] == [{"storage": "0", "paths": ["emb.weight", "head.weight"]}]


def test_output_mode_follows_umask(tmp_path: Path) -> None:
    out = tmp_path / "out.pth"
    result = invoke_cli("strip-module", DP, out, umask=0o027)
    assert result.returncode == 0, result.stderr
    assert os.stat(out).st_mode & 0o777 == 0o640
