"""The "ZeRO folder -> DCP for another world size" workflow end to end (issue 24): a DeepSpeed
ZeRO-1 save made by 3 ranks is written by ckptfix as a DCP folder cut for 2 (``--dcp-files 2``,
no torch involved), then ``torch.distributed.checkpoint.load`` fills an FSDP2 (``fully_shard``)
model on 2 gloo ranks: every parameter's full tensor is what the consolidation gives (which
equals ``zero_to_fp32``'s fp32 master weights, the fixture's ``.fp32.pth``), each rank's shard
is its ``torch.chunk`` of it, and each rank read its sharded parameters from its own file only.
The same FSDP2 load from an uncut folder (one item per tensor) gives the same tensors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, ROOT, invoke_cli

CASE = FIXTURES / "deepspeed" / "z1_bf16_w3"

#: two ranks forked from one interpreter (torch imported once): each builds ZeroNet, shards it
#: with FSDP2 over 2 CPU ranks and dcp.loads each folder into it
_RANKS = r"""
import os, socket, sys, warnings
warnings.simplefilter("ignore")
import torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, sys.argv[1])
from deepspeed_models import ZeroNet

read = []
original = FileSystemReader.read_data


def recording(self, plan, planner):
    read.extend((item.storage_index.fqn, self.storage_data[item.storage_index].relative_path) for item in plan.items)
    return original(self, plan, planner)


def run(rank, world, port):
    warnings.simplefilter("ignore")
    FileSystemReader.read_data = recording
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    reference = torch.load(sys.argv[2], weights_only=True)
    for folder, cut in ((sys.argv[3], True), (sys.argv[4], False)):
        torch.manual_seed(rank)
        model = ZeroNet()
        fully_shard(model, mesh=mesh)
        state = model.state_dict()
        read.clear()
        dcp.load(state, checkpoint_id=folder)
        sharded = {k for k, v in state.items() if isinstance(v, DTensor)}
        assert len(sharded) >= 8, sorted(sharded)
        for key, value in state.items():
            full = value.full_tensor() if key in sharded else value
            # the frozen layer is kept in bf16 (ZeRO-1 keeps it out of the fp32 partitions):
            # dcp.load copies it into the model's fp32 parameter, exactly
            expected = reference[key] if not key.startswith("frozen.") else reference[key].to(full.dtype)
            assert full.dtype == expected.dtype and torch.equal(full, expected), key
            if key in sharded:
                assert torch.equal(value.to_local(), torch.chunk(expected, world)[rank]), key
        if cut:  # a rank reads its shards from its own file only
            files = {path for fqn, path in read if fqn in sharded}
            assert files == {f"__{rank}_0.distcp"}, files
    dist.destroy_process_group()


with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
mp.start_processes(run, args=(2, port), nprocs=2, start_method="fork")
print("ok")
"""


@pytest.mark.distributed  # two gloo ranks and torch.distributed: its own CI step (-m distributed)
def test_fsdp2_on_two_ranks_loads_a_zero_folder_written_as_dcp(tmp_path: Path) -> None:
    cut, whole, model = tmp_path / "cut", tmp_path / "whole", tmp_path / "model.pth"
    for args in (
        [CASE, cut, "--format", "dcp", "--dcp-files", "2"],
        [CASE, whole, "--format", "dcp"],
        [CASE, model],
    ):
        result = invoke_cli("convert", *args)
        assert result.returncode == 0, result.stderr
    consolidated = torch.load(model, weights_only=True)
    zero_to_fp32 = torch.load(FIXTURES / "deepspeed" / "z1_bf16_w3.fp32.pth", weights_only=True)
    for key, value in zero_to_fp32.items():  # the consolidation is DeepSpeed's own
        if value.is_floating_point() and consolidated[key].is_floating_point():
            assert torch.equal(consolidated[key], value), key
    script = tmp_path / "ranks.py"
    script.write_text(_RANKS)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    child = subprocess.run(
        [sys.executable, str(script), str(FIXTURES), str(model), str(cut), str(whole)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert child.returncode == 0 and child.stdout == "ok\n", child.stdout[-2000:] + child.stderr[-4000:]
