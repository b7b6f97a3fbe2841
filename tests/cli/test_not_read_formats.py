"""Checkpoints ckptfix recognises but does not read are refused by name (issue 24), exit 3, in
one line that says what the file is and what to do -- not called hostile, not a list of
``--allow-global`` options. Files made by the real tools: fixtures/make_fsdp1_fixtures.py
(FSDP1 on 2 gloo ranks) and fixtures/make_megatron_fixture.py (megatron-core's
``dist_checkpointing.save``, torch_dist backend)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import FIXTURES, invoke_cli
from hostile import data_pkl, with_data_pkl

FSDP1 = FIXTURES / "fsdp1"


@pytest.mark.parametrize("name", ["local_state_dict_rank0.pt", "sharded_state_dict_rank0.pt"])
def test_an_fsdp1_rank_file_is_refused_by_name(tmp_path: Path, name: str) -> None:
    for args in (["inspect", FSDP1 / name], ["convert", FSDP1 / name, tmp_path / "out.safetensors"]):
        result = invoke_cli(*args)
        assert result.returncode == 3, result.stderr
        assert result.stderr.count("\n") == 1 and "an FSDP1 per-rank state dict" in result.stderr, result.stderr
        assert "torch.distributed.checkpoint" in result.stderr and "hostile" not in result.stderr
    assert list(tmp_path.iterdir()) == []
    scanned = invoke_cli("scan", FSDP1 / name)
    assert "note: an FSDP1 per-rank state dict" in scanned.stdout, scanned.stdout


def test_an_fsdp1_name_does_not_excuse_a_payload(tmp_path: Path) -> None:
    """The nested-class getattr is what FSDP1 files hold; any other code-running global beside
    the ShardedTensor keeps the hostile refusal."""
    payload = data_pkl(FSDP1 / "local_state_dict_rank0.pt").replace(b"c__builtin__\ngetattr\n", b"cposix\nsystem\n")
    evil = with_data_pkl(FSDP1 / "local_state_dict_rank0.pt", payload, tmp_path / "evil.pt")
    result = invoke_cli("convert", evil, tmp_path / "out.safetensors")
    assert result.returncode == 3 and "os.system" in result.stderr and "FSDP1" not in result.stderr, result.stderr


MEGATRON = FIXTURES / "megatron_torch_dist"


def test_a_megatron_torch_dist_folder_is_refused_by_name(tmp_path: Path) -> None:
    """A DCP folder underneath, but its keys are Megatron's sharded layout (stacked layers) and
    half the state is in common.pt: refused as what it is, before its .metadata is read."""
    for args in (["inspect", MEGATRON], ["convert", MEGATRON, tmp_path / "out.safetensors"]):
        result = invoke_cli(*args)
        assert result.returncode == 3, result.stderr
        assert result.stderr.count("\n") == 1, result.stderr
        assert "a Megatron-core distributed checkpoint (torch_dist backend" in result.stderr
        assert "Megatron's own tools" in result.stderr and "--allow-global" not in result.stderr
    assert list(tmp_path.iterdir()) == []
    scanned = invoke_cli("scan", MEGATRON)
    assert "note: a Megatron-core distributed checkpoint" in scanned.stdout, scanned.stdout
    assert "common.pt" in scanned.stdout  # its other files are scanned too
