"""Checkpoints written by the real tools users have: a Lightning Trainer, torch.distributed.checkpoint."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from conftest import FIXTURES, assert_same_tree, invoke_cli, train_and_save_lightning
from models import TinyNet, tiny_net
from safetensors.torch import load_file

import ckptfix


def _lightning_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """Train a LightningModule wrapping TinyNet for two steps and save through the Trainer."""
    import pytorch_lightning as pl  # a test dependency (pyproject's [test] extra): never skipped

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_net()

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.cross_entropy(self.model(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    data = torch.utils.data.TensorDataset(torch.randn(8, 3, 8, 8), torch.randint(0, 2, (8,)))
    module = Module()
    train_and_save_lightning(module, data, path, batch_size=4, max_epochs=1, limit_train_batches=2)
    return {k: v.detach().clone() for k, v in module.model.state_dict().items()}


def test_lightning_trainer_checkpoint_to_safetensors_and_bare_pth(tmp_path: Path) -> None:
    ckpt = tmp_path / "trained.ckpt"
    weights = _lightning_checkpoint(ckpt)
    info = ckptfix.inspect_checkpoint(ckpt)
    assert [sd["path"] for sd in info["state_dicts"]] == ["state_dict"]
    assert info["state_dicts"][0]["prefixes"][0]["prefix"] == "model."
    result = invoke_cli(
        "convert", ckpt, tmp_path / "w.safetensors", "--select", "state_dict", "--strip-prefix", "model."
    )
    assert result.returncode == 0, result.stderr
    model = TinyNet()
    model.load_state_dict(load_file(tmp_path / "w.safetensors"), strict=True)
    for name, value in weights.items():
        assert torch.equal(model.state_dict()[name], value), name
    fixed = tmp_path / "fixed.ckpt"
    assert invoke_cli("strip-module", ckpt, fixed, "--prefix", "model.").returncode == 0
    original, stripped = torch.load(ckpt, weights_only=False), torch.load(fixed, weights_only=False)
    assert set(stripped["state_dict"]) == set(weights)
    for key in original:
        if key != "state_dict":
            assert_same_tree(stripped[key], original[key], key)


def _dcp_folder(path: Path) -> dict:
    import torch.distributed.checkpoint as dcp

    state = {"model": tiny_net().state_dict(), "step": 7}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
    return state


def test_dcp_folder_converts_without_unsafe_load(tmp_path: Path) -> None:
    """A genuine DCP folder's .metadata names only DCP's dataclasses: read as inert records."""
    state = _dcp_folder(tmp_path / "dcp")
    result = invoke_cli("convert", tmp_path / "dcp", tmp_path / "out.pth", "--select", "model")
    assert result.returncode == 0, result.stderr
    model = TinyNet()
    model.load_state_dict(torch.load(tmp_path / "out.pth", weights_only=True), strict=True)
    for name, value in state["model"].items():
        assert torch.equal(model.state_dict()[name], value), name


def test_pth_to_dcp_folder_reads_back_with_torch(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / "dcp_out"
    result = invoke_cli(
        "convert", FIXTURES / "dataparallel_tinynet.pth", out, "--format", "dcp", "--strip-prefix", "module."
    )
    assert result.returncode == 0, result.stderr
    assert (out / ".metadata").is_file() and not list(tmp_path.glob(".*ckptfix-tmp"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(out, tmp_path / "back.pth")
    back = torch.load(tmp_path / "back.pth", weights_only=True)
    expected = tiny_net().state_dict()
    assert set(back) == set(expected)
    for name, value in expected.items():
        assert torch.equal(back[name], value), name
    again = invoke_cli("convert", FIXTURES / "dataparallel_tinynet.pth", out, "--format", "dcp")
    assert again.returncode == 4 and "--force" in again.stderr
