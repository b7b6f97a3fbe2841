"""``ckptfix average``: exit codes, one-line refusals, --json, --dry-run, shards, torch-free."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import invoke_cli
from safetensors.torch import load_file


@pytest.fixture
def three(tmp_path: Path) -> list[Path]:
    paths = []
    for seed in range(3):
        torch.manual_seed(seed)
        sd = {"fc.weight": torch.randn(4, 3), "fc.bias": torch.randn(4), "steps": torch.tensor(seed + 10)}
        paths.append(tmp_path / f"ep{seed}.pth")
        torch.save({"state_dict": sd, "epoch": seed}, paths[-1])
    return paths


def test_average_writes_shards_and_reports_json(three: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "avg"
    result = invoke_cli("average", *three, f"{out}/", "--max-shard-size", "64B", "--coefficients", "1,1,2", "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["command"] == "average" and doc["output_format"] == "sharded" and doc["shard_format"] == "safetensors"
    assert doc["coefficients"] == [1.0, 1.0, 2.0] and doc["from_last"] == ["steps"] and doc["averaged"] == 2
    assert [i["state_dict"] for i in doc["inputs"]] == ["state_dict"] * 3 and len(doc["outputs"]) > 2
    got = torch.load(three[-1], weights_only=True)["state_dict"]["steps"]
    shard = next(p for p in out.glob("*.safetensors") if "steps" in load_file(p))
    assert torch.equal(load_file(shard)["steps"], got)


def test_dry_run_writes_nothing_and_out_is_not_overwritten(three: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "avg.pth"
    result = invoke_cli("average", *three, out, "--dry-run")
    assert result.returncode == 0 and "would write" in result.stdout and not out.exists()
    out.write_bytes(b"keep")
    result = invoke_cli("average", *three, out)
    assert result.returncode == 4 and "already exists" in result.stderr and out.read_bytes() == b"keep"
    assert invoke_cli("average", *three, out, "--force").returncode == 0
    assert set(torch.load(out, weights_only=True)) == {"fc.weight", "fc.bias", "steps"}


def test_refusals_are_one_line_with_their_exit_code(three: list[Path], tmp_path: Path) -> None:
    other = tmp_path / "other.pth"
    torch.save(
        {"state_dict": {"fc.weight": torch.randn(4, 2), "fc.bias": torch.randn(4), "steps": torch.tensor(1)}}, other
    )
    out = tmp_path / "avg.pth"
    cases = [
        ([three[0], other, out], 3, f"{other}: 'fc.weight' is float32[4, 2] where {three[0]} has float32[4, 3]"),
        ([three[0], out], 2, "give at least two inputs, then OUT"),
        ([*three, three[0]], 2, "the output is the input file (choose an output path that is not one of the inputs)"),
        ([*three, out, "--coefficients", "1,2"], 2, "--coefficients has 2 numbers for 3 inputs"),
        ([*three, out, "--weights", "1,1,1"], 2, "'1,1,1' is not one of 'fp32', 'module'"),
        ([*three, out, "--select", "nothing"], 3, "nothing"),
    ]
    for args, code, words in cases:
        result = invoke_cli("average", *args)
        assert result.returncode == code and words in result.stderr, (args, result.stderr)
        assert not out.exists()
        assert result.stderr.count("\n") == 1 or "--weights" in args  # click's own usage text: 4 lines


def test_help_names_the_coefficients_and_why_not_weights() -> None:
    result = invoke_cli("average", "--help")
    assert result.returncode == 0 and "ckptfix average ep8.pth" in result.stdout
    text = " ".join(result.stdout.split())
    assert "--coefficients C1,C2,..." in text and "Not named --weights: that option picks a DeepSpeed folder's" in text
