"""``convert ... --format dcp [--dcp-files N]`` from the command line (issue 24): a DeepSpeed ZeRO
folder becomes a DCP folder for another world size, read back by torch as ckptfix consolidates it;
the option's misuse is a usage error; ``scan`` finds the output clean."""

from __future__ import annotations

import json
import pickle
import warnings
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, assert_same_tree, invoke_cli

DEEPSPEED = FIXTURES / "deepspeed"


def _through_torch(folder: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(folder, tmp_path / "back.pth")
    return torch.load(tmp_path / "back.pth", weights_only=True)


@pytest.mark.parametrize("case", ["z2_bf16_w2", "z3_fp16_w2"])
def test_a_zero_folder_becomes_a_dcp_folder_for_three_ranks(tmp_path: Path, case: str) -> None:
    """The ZeRO folder (2 ranks) -> DCP cut for 3: torch reads the fp32 master weights ckptfix
    consolidates, which equal zero_to_fp32's (the fixture's .fp32.pth) tensor for tensor."""
    out = tmp_path / "dcp"
    result = invoke_cli("convert", DEEPSPEED / case, out, "--format", "dcp", "--dcp-files", "3", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["input_format"] == "deepspeed" and report["output_format"] == "dcp"
    assert sorted(Path(p).name for p in report["outputs"]) == [".metadata", *(f"__{i}_0.distcp" for i in range(3))]
    assert invoke_cli("convert", DEEPSPEED / case, tmp_path / "model.pth").returncode == 0
    assert_same_tree(_through_torch(out, tmp_path), torch.load(tmp_path / "model.pth", weights_only=True))
    reference = torch.load(DEEPSPEED / f"{case}.fp32.pth", weights_only=True)
    back = _through_torch(out, tmp_path)
    floating = [k for k, v in reference.items() if v.is_floating_point() and back[k].is_floating_point()]
    assert len(floating) >= 8
    for key in floating:
        assert torch.equal(back[key], reference[key]), key
    scanned = invoke_cli("scan", out)
    assert scanned.returncode == 0, scanned.stdout + scanned.stderr


def test_dcp_files_is_a_dcp_option(tmp_path: Path) -> None:
    src = FIXTURES / "bare_tinynet.pth"
    for args, said in [
        (["--dcp-files", "2"], "--dcp-files splits a DCP folder: add --format dcp"),
        (["--format", "dcp", "--dcp-files", "0"], "--dcp-files takes 1 to"),
    ]:
        result = invoke_cli("convert", src, tmp_path / "out.pth", *args)
        assert result.returncode == 2 and said in result.stderr, result.stderr
    assert sorted(tmp_path.iterdir()) == []
    assert invoke_cli("publish", src, tmp_path, "--dcp-files", "2").returncode == 2  # not offered there
    torch.save({"a.b": torch.ones(1), "a": {"b": torch.ones(1)}}, tmp_path / "clash.pth")
    dry = invoke_cli("convert", tmp_path / "clash.pth", tmp_path / "out", "--format", "dcp", "--dry-run")
    assert dry.returncode == 3 and "two entries flatten to the key 'a.b'" in dry.stderr, dry.stderr


def test_average_writes_a_dcp_folder(tmp_path: Path) -> None:
    for i in (1, 2):
        torch.save({"w": torch.full((4, 2), float(i)), "n": torch.tensor(i)}, tmp_path / f"c{i}.pth")
    out = tmp_path / "avg"
    result = invoke_cli("average", tmp_path / "c1.pth", tmp_path / "c2.pth", out, "--format", "dcp", "--dcp-files", "2")
    assert result.returncode == 0, result.stderr
    back = _through_torch(out, tmp_path)
    assert torch.equal(back["w"], torch.full((4, 2), 1.5)) and torch.equal(back["n"], torch.tensor(2))
    with open(out / ".metadata", "rb") as f:
        assert len(pickle.load(f).state_dict_metadata["w"].chunks) == 2  # written by ckptfix in this test


def test_a_checkpoint_read_through_torch_is_written_too(tmp_path: Path) -> None:
    """``--unsafe-load`` hands ckptfix real tensors (and a config object): the same writer cuts
    them, and torch saves the values it alone can build."""
    import argparse

    source = {"w": torch.arange(12.0).reshape(4, 3).t(), "cfg": argparse.Namespace(lr=0.1), "n": torch.tensor(3)}
    torch.save(source, tmp_path / "in.pth")
    out = tmp_path / "out"
    result = invoke_cli("convert", tmp_path / "in.pth", out, "--format", "dcp", "--dcp-files", "2", "--unsafe-load")
    assert result.returncode == 0, result.stderr
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(out, tmp_path / "back.pth")
    back = torch.load(tmp_path / "back.pth", weights_only=False)  # the test's own file, with a Namespace
    assert back["cfg"] == source["cfg"]
    assert_same_tree({k: back[k] for k in ("w", "n")}, {k: source[k] for k in ("w", "n")}, check_stride=False)
    with open(out / ".metadata", "rb") as f:
        assert len(pickle.load(f).state_dict_metadata["w"].chunks) == 2  # written by ckptfix in this test
