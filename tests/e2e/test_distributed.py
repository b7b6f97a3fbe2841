"""One conversion split over processes by output shard (issue 25): ``torchrun`` starts the ranks
(torch.distributed with gloo on this machine), each writes its shards, rank 0 the index after
all are written; the folder must be byte for byte what one process writes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import invoke_cli
from safetensors.torch import load_file


def _torchrun() -> list[str]:
    here = Path(sys.executable).parent / "torchrun"
    found = str(here) if here.exists() else shutil.which("torchrun")
    if found is None:
        pytest.skip("torchrun is not installed (it comes with torch)")
    return [found]


@pytest.mark.distributed  # torchrun and two ranks importing torch: 11-17 s, its own CI step (-m distributed)
def test_torchrun_split_writes_the_same_folder_as_one_process(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    sd = {f"module.layer{i}.weight": torch.randn(32, 32, generator=gen) for i in range(12)}
    torch.save(sd, tmp_path / "in.pth")
    args = ["convert", str(tmp_path / "in.pth"), "--strip-prefix", "module.", "--max-shard-size", "9KB"]
    one = invoke_cli(*args[:2], str(tmp_path / "one") + "/", *args[2:])
    assert one.returncode == 0, one.stderr
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    cmd = [*_torchrun(), "--standalone", "--nproc-per-node", "2", "-m", "ckptfix"]
    split = subprocess.run(
        [*cmd, *args[:2], str(tmp_path / "split") + "/", *args[2:], "--distributed"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert split.returncode == 0, split.stderr[-2000:]
    names = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert len(names) == 7 and names == sorted(p.name for p in (tmp_path / "split").iterdir())
    for name in names:  # byte for byte, index included
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "split" / name).read_bytes(), name
    merged = {k: v for p in (tmp_path / "split").glob("*.safetensors") for k, v in load_file(p).items()}
    assert merged.keys() == {k.removeprefix("module.") for k in sd}


def test_distributed_outside_torchrun_or_for_one_file_is_a_usage_error(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2)}, tmp_path / "in.pth")
    result = invoke_cli("convert", tmp_path / "in.pth", str(tmp_path / "out") + "/", "--distributed")
    assert result.returncode == 2 and "torchrun" in result.stderr
    result = invoke_cli("convert", tmp_path / "in.pth", tmp_path / "out.safetensors", "--distributed")
    assert result.returncode == 2 and "folder" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.pth"]
