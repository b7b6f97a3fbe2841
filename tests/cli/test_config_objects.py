"""Issue 17: checkpoints that carry config objects (omegaconf, dataclasses, Enums, Namespace,
pathlib, numpy). Weights come out with no flags, the whole checkpoint needs one decision that
the refusal spells out, --sanitize gives what the libraries themselves give as plain data,
--allow-global keeps the objects exactly, and scan tells code from data. Each behaviour is
checked against torch and the libraries (omegaconf is a test-only dependency)."""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import torch
from config_types import Optim, hyper_parameters, lightning_style, plain_data
from conftest import invoke_cli, train_and_save_lightning
from omegaconf import OmegaConf
from safetensors.torch import load_file

import ckptfix

#: every global the Lightning-style checkpoint's hparams pickle besides torch's (as ckptfix names them)
HPARAM_MODULES = ("omegaconf.", "config_types.", "argparse.", "pathlib.", "numpy.", "typing.", "datetime.")


@pytest.fixture(scope="module")
def hydra_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("configs") / "train.ckpt"
    torch.save(lightning_style(), path)
    return path


def _weights() -> dict[str, torch.Tensor]:
    return lightning_style({})["state_dict"]


def _no_file(path: Path) -> None:
    assert not path.exists() and not [p for p in path.parent.iterdir() if p.name.startswith(f".{path.name}")]


# -- weights out, no flags -------------------------------------------------------------------------


def test_selected_weights_come_out_without_flags_and_the_rest_is_listed(hydra_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "w.safetensors"
    result = invoke_cli("convert", hydra_ckpt, out, "--select", "state_dict", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    ignored = {e["global"] for e in report["ignored"]}
    assert {e["path"] for e in report["ignored"]} == {"hyper_parameters"}
    assert "omegaconf.dictconfig.DictConfig" in ignored and "config_types.Optim" in ignored
    weights = load_file(out)
    assert weights.keys() == _weights().keys()
    assert all(torch.equal(weights[k], v) for k, v in _weights().items())
    text = invoke_cli("convert", hydra_ckpt, tmp_path / "w.pth", "--select", "state_dict")
    assert (
        text.returncode == 0 and "ignored, not in the output" in text.stderr and "hyper_parameters holds" in text.stderr
    )
    loaded = torch.load(tmp_path / "w.pth", weights_only=True)  # the real consumer accepts it as is
    assert all(torch.equal(loaded[k], v) for k, v in _weights().items())


@pytest.mark.parametrize("command", ["publish", "fit", "safetensors-whole"])
def test_weights_only_commands_need_no_flags(hydra_ckpt: Path, tmp_path: Path, command: str) -> None:
    if command == "publish":
        result = invoke_cli("publish", hydra_ckpt, tmp_path / "release")
        assert result.returncode == 0, result.stderr
        (out,) = (tmp_path / "release").iterdir()
        expected = {k.removeprefix("model."): v for k, v in _weights().items()}
        got = load_file(out)
    elif command == "fit":
        reference = tmp_path / "bare.pth"
        torch.save({k.removeprefix("model."): v for k, v in _weights().items()}, reference)
        result = invoke_cli("fit", hydra_ckpt, tmp_path / "fit.pth", "--reference", reference)
        assert result.returncode == 0, result.stderr
        got, expected = torch.load(tmp_path / "fit.pth", weights_only=True), torch.load(reference, weights_only=True)
    else:  # a safetensors output carries tensors only: the configs cannot ride along
        result = invoke_cli("convert", hydra_ckpt, tmp_path / "w.safetensors", "--select", "state_dict")
        assert result.returncode == 0, result.stderr
        got, expected = load_file(tmp_path / "w.safetensors"), _weights()
    assert got.keys() == expected.keys() and all(torch.equal(got[k], v) for k, v in expected.items())


def test_api_load_and_load_into_on_a_config_checkpoint(hydra_ckpt: Path) -> None:
    state_dict = ckptfix.load(hydra_ckpt, select="state_dict")
    assert all(torch.equal(state_dict[k], v) for k, v in _weights().items())
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2, bias=False))
    report = ckptfix.load_into(model, hydra_ckpt)
    assert report.stripped == ["model."] and not report.missing and not report.unexpected
    with pytest.raises(ckptfix.UnsafeInputError) as refused:
        ckptfix.load(hydra_ckpt)
    message = str(refused.value)  # the ways out in the API's own words
    assert "omegaconf.dictconfig.DictConfig" in message and "sanitize=True" in message
    assert "select='state_dict'" in message and "--" not in message
    plain = ckptfix.load(hydra_ckpt, sanitize=True)
    assert plain["hyper_parameters"]["cfg"] == plain_data(hyper_parameters()["cfg"])


# -- a whole-checkpoint write: one refusal, every global, three ways out ----------------------------


def _ways_out(stderr: str) -> list[str]:
    keep = re.search(r"without running anything: (.*?)(?: \(which also keeps|;)", stderr)
    assert keep, stderr
    return shlex.split(keep.group(1))


def test_whole_checkpoint_refusal_lists_everything_at_once(hydra_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.pth"
    result = invoke_cli("strip-module", hydra_ckpt, out, "--prefix", "model.")
    assert result.returncode == 3 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    _no_file(out)
    found = ckptfix.read_checkpoint(hydra_ckpt, inert_unknown=True).globals
    foreign = {g for g in found if g.startswith(HPARAM_MODULES)}
    for name in foreign:
        module, _, short = name.rpartition(".")
        assert name in result.stderr or (module in result.stderr and short in result.stderr), name
    assert "--allow-global 'omegaconf.*'" in result.stderr and "--allow-global 'config_types.*'" in result.stderr
    assert "--sanitize" in result.stderr and "--select state_dict" in result.stderr
    assert "typing.Any" in result.stderr.split("which also keeps")[1]  # kept along, not to allow one by one


def test_pasting_the_allow_options_keeps_the_objects_exactly(hydra_ckpt: Path, tmp_path: Path) -> None:
    first = invoke_cli("strip-module", hydra_ckpt, tmp_path / "x.pth", "--prefix", "model.")
    out = tmp_path / "kept.pth"
    result = invoke_cli("strip-module", hydra_ckpt, out, "--prefix", "model.", *_ways_out(first.stderr), "--json")
    assert result.returncode == 0, result.stderr
    assert "typing.Any" in json.loads(result.stdout)["kept_globals"]
    loaded = torch.load(out, weights_only=False)  # the libraries are installed here: real objects again
    original = hyper_parameters()
    for key, value in original.items():
        got = loaded["hyper_parameters"][key]
        if key in ("cfg", "list_cfg"):
            assert OmegaConf.to_container(got) == OmegaConf.to_container(value) and type(got) is type(value)
        elif key == "confusion":
            assert (got == value).all() and got.dtype == value.dtype
        else:
            assert got == value and type(got) is type(value), key
    assert loaded["state_dict"].keys() == {k.removeprefix("model.") for k in _weights()}


def test_sanitize_gives_what_the_libraries_give_as_plain_data(hydra_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "plain.pth"
    result = invoke_cli("convert", hydra_ckpt, out, "--sanitize", "--json")
    assert result.returncode == 0, result.stderr
    got = torch.load(out, weights_only=True)["hyper_parameters"]  # loads with no allow-list at all
    expected = plain_data(hyper_parameters())
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value), key
        else:
            assert got[key] == value and type(got[key]) is type(value), (key, got[key], value)
    assert got["cfg"]["optim"]["warmup"] == "${optim.lr}" and got["cfg"]["data"]["missing"] == "???"
    assert type(got["flag"]) is bool and type(got["step"]) is int
    replaced = {e["path"]: e["global"] for e in json.loads(result.stdout)["sanitized"]}
    assert replaced["hyper_parameters.cfg"] == "omegaconf.dictconfig.DictConfig"


def test_a_real_lightning_checkpoint_with_an_omegaconf_config(tmp_path: Path) -> None:
    import pytorch_lightning as pl

    class Module(pl.LightningModule):
        def __init__(self, cfg: Any) -> None:
            super().__init__()
            self.save_hyperparameters(cfg)
            self.net = torch.nn.Linear(3, 2)

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=self.hparams.optim.lr)

    cfg = OmegaConf.create({"optim": {"lr": 0.01, "name": "adam"}, "dims": [3, 2]})
    module = Module(cfg)
    data = torch.utils.data.TensorDataset(torch.randn(4, 3), torch.randn(4, 2))
    ckpt = tmp_path / "real.ckpt"
    train_and_save_lightning(module, data, ckpt, batch_size=2, max_steps=1)
    with pytest.raises(Exception, match="Unsupported global"):
        torch.load(ckpt, weights_only=True)  # what the user hits first
    out = tmp_path / "w.safetensors"
    assert invoke_cli("convert", ckpt, out, "--select", "state_dict").returncode == 0
    assert all(torch.equal(load_file(out)[k], v) for k, v in module.state_dict().items())
    plain = tmp_path / "plain.ckpt"
    assert invoke_cli("convert", ckpt, plain, "--sanitize").returncode == 0
    loaded = torch.load(plain, weights_only=True)
    assert loaded["hyper_parameters"] == OmegaConf.to_container(cfg)
    fresh = Module(cfg)
    fresh.load_state_dict(loaded["state_dict"], strict=True)


# -- hostile stays hostile, whatever is selected ---------------------------------------------------


class _System:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("echo pwned",))


@pytest.mark.parametrize("protocol", [2, 4])
def test_code_execution_outside_the_selection_still_refuses(tmp_path: Path, protocol: int) -> None:
    src = tmp_path / "evil.ckpt"
    torch.save(lightning_style({"cfg": OmegaConf.create({"a": 1}), "x": _System()}), src, pickle_protocol=protocol)
    for args in (
        ("convert", src, tmp_path / "w.safetensors", "--select", "state_dict"),
        ("publish", src, tmp_path / "rel"),
        ("fit", src, tmp_path / "f.pth", "--reference", src),
        ("inspect", src),
    ):
        result = invoke_cli(*args)
        assert result.returncode == 3 and "the file is hostile" in result.stderr, (args[0], result.stderr)
        assert "--allow-global" not in result.stderr and "--sanitize" not in result.stderr
    with pytest.raises(ckptfix.UnsafeInputError):
        ckptfix.load(src, select="state_dict")


# -- scan: dangerous / unknown / safe ----------------------------------------------------------------


def test_scan_tells_code_from_data(hydra_ckpt: Path, tmp_path: Path) -> None:
    result = invoke_cli("scan", hydra_ckpt, "--json")
    assert result.returncode == 0, result.stdout
    (report,) = json.loads(result.stdout)["files"]
    assert report["dangerous"] == []
    assert "omegaconf.dictconfig.DictConfig" in report["unknown"] and "config_types.Optim" in report["unknown"]
    verdicts = {g["name"]: g["verdict"] for g in report["globals"]}
    for safe in ("typing.Any", "collections.defaultdict", "argparse.Namespace", "torch._utils._rebuild_tensor_v2"):
        assert verdicts[safe] == "safe", safe
    assert invoke_cli("scan", hydra_ckpt, "--strict").returncode == 1
    evil = tmp_path / "evil.ckpt"
    torch.save({"w": torch.ones(1), "x": _System()}, evil)
    flagged = invoke_cli("scan", evil)
    assert flagged.returncode == 1 and "dangerous: os.system: runs shell commands" in flagged.stdout


def test_python2_module_names_do_not_hide_code_execution(tmp_path: Path) -> None:
    """A protocol-2 pickle spells subprocess.Popen as commands.Popen (what Python 3's unpickler
    maps back with fix_imports): it is dangerous by its real name, everywhere."""
    import subprocess

    class Popen:
        def __reduce__(self) -> tuple[Any, ...]:
            return (subprocess.Popen, (["true"],))

    src = tmp_path / "p.pth"
    torch.save({"state_dict": {"w": torch.ones(1)}, "x": Popen()}, src)
    result = invoke_cli("convert", src, tmp_path / "w.pth", "--select", "state_dict")
    assert result.returncode == 3 and "subprocess.Popen" in result.stderr and "hostile" in result.stderr
    scanned = json.loads(invoke_cli("scan", src, "--json").stdout)["files"][0]
    assert scanned["dangerous"] == ["subprocess.Popen"]


def test_pass_through_of_a_dataclass_round_trips(tmp_path: Path) -> None:
    src = tmp_path / "d.pth"
    torch.save({"state_dict": {"w": torch.ones(2)}, "opt": Optim(lr=0.5)}, src)
    out = tmp_path / "o.pth"
    result = invoke_cli("convert", src, out, "--allow-global", "config_types.Optim", "--dtype", "bf16")
    assert result.returncode == 0, result.stderr
    loaded = torch.load(out, weights_only=False)
    assert loaded["opt"] == Optim(lr=0.5) and loaded["state_dict"]["w"].dtype == torch.bfloat16


def test_a_plain_training_checkpoint_with_configs(tmp_path: Path) -> None:
    """Not Lightning: {"model", "optimizer", "args", "config", "epoch"} as a hand-written loop saves it."""
    import argparse

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    optimizer.step()
    src = tmp_path / "last.pth"
    config = OmegaConf.create({"lr": 1e-3, "model": {"hidden": 4}})
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "args": argparse.Namespace(lr=1e-3, cfg=config),
            "config": config,
            "epoch": 3,
        },
        src,
    )
    out = tmp_path / "model.safetensors"
    assert invoke_cli("convert", src, out, "--select", "model").returncode == 0
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    fresh.load_state_dict(load_file(out), strict=True)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    report = ckptfix.load_into(fresh, src)
    assert report.state_dict == "model" and not report.missing
    whole = invoke_cli("convert", src, tmp_path / "plain.pth", "--sanitize")
    assert whole.returncode == 0, whole.stderr
    plain = torch.load(tmp_path / "plain.pth", weights_only=True)
    assert plain["args"] == {"lr": 1e-3, "cfg": OmegaConf.to_container(config)}
    assert plain["optimizer"]["param_groups"] == optimizer.state_dict()["param_groups"]


def test_diff_compares_config_checkpoints_by_what_was_pickled(hydra_ckpt: Path, tmp_path: Path) -> None:
    """diff writes nothing: configs are read as inert records and compared by class and state."""
    same = invoke_cli("diff", hydra_ckpt, hydra_ckpt)
    assert same.returncode == 0 and "equal" in same.stdout, same.stderr
    changed = hyper_parameters()
    changed["cfg"].optim.lr = 0.2
    changed["optim"].lr = 0.5
    other = tmp_path / "other.ckpt"
    torch.save(lightning_style(changed), other)
    result = invoke_cli("diff", hydra_ckpt, other, "--json")
    assert result.returncode == 1, result.stderr
    differ = {d["path"]: (d["a"], d["b"]) for d in json.loads(result.stdout)["values_differ"]}
    lr = next(path for path in differ if path.startswith("hyper_parameters.cfg.") and path.endswith("._val"))
    assert "optim" in lr and differ[lr] == ("0.1", "0.2")
    assert differ["hyper_parameters.optim.__state__.lr"] == ("0.0003", "0.5")
    assert len(differ) == 2  # nothing else differs: the weights and every other config are equal


def test_verify_fails_a_config_checkpoint_and_names_the_fix(hydra_ckpt: Path, tmp_path: Path) -> None:
    """verify is the gate for torch.load(weights_only=True): configs fail it, every other check
    still runs, and the fix it names makes a file that passes."""
    result = invoke_cli("verify", hydra_ckpt, "--json")
    assert result.returncode == 1
    (problem,) = json.loads(result.stdout)["files"][0]["problems"]
    assert "omegaconf.dictconfig.DictConfig" in problem and "--sanitize" in problem and "--select state_dict" in problem
    fixed = tmp_path / "fixed.ckpt"
    assert invoke_cli("convert", hydra_ckpt, fixed, "--sanitize").returncode == 0
    assert invoke_cli("verify", fixed).returncode == 0
