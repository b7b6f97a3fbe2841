"""Every fix a command suggests works: each suggestion printed for a problem file -- verify's
``fix: ckptfix ...``, the ways out of a refusal, strip-module's wrapper note, safetensors'
``--drop``/``--select``/``--tensor-name`` -- is run exactly as printed, and succeeds (and, where
it claims so, the output loads with ``torch.load(weights_only=True)``)."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import FIXTURES, invoke_cli

SD = {"fc.weight": torch.ones(2, 2), "fc.bias": torch.zeros(2)}


class Frame:
    """A class no sanitize rule converts: rebuilt from two arguments (as a dataframe is)."""

    def __init__(self, a: int, b: int) -> None:
        self.a, self.b = a, b

    def __reduce__(self) -> tuple:
        return (Frame, (self.a, self.b))


@pytest.fixture(scope="module")
def problems(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from torch.torch_version import TorchVersion

    folder = tmp_path_factory.mktemp("problems")
    module = types.ModuleType("oddpkg")
    Frame.__module__, Frame.__qualname__ = "oddpkg", "Frame"
    module.Frame = Frame  # type: ignore[attr-defined]
    sys.modules["oddpkg"] = module
    try:
        files = {
            "frame": {"state_dict": SD, "hparams": {"frame": Frame(1, 2), "lr": np.float64(0.1)}},
            "torch_version": {"state_dict": SD, "hparams": {"version": TorchVersion("2.4.0")}},
            "object_array": {"state_dict": SD, "names": np.array(["a", 1, 2.5], dtype=object)},
            "namespace": {"state_dict": SD, "args": argparse.Namespace(lr=0.1)},
            "param_store": {"model": {**SD, "guide._param_store": {"params": {}}}, "epoch": 1},
            "bare_tensor": torch.ones(3),
            "numpy_array": np.ones(3, dtype=np.float32),
        }
        for name, value in files.items():
            torch.save(value, folder / f"{name}.pth")
    finally:
        del sys.modules["oddpkg"]
    return {name: folder / f"{name}.pth" for name in files}


def _ways(stderr: str) -> list[list[str]]:
    """Every run of convert options the last stderr line offers, as a command line would take
    them (``KEY`` is filled in); ``--unsafe-load`` (for trusted files only) is left out."""
    from ckptfix.cli import cli

    params = {o: p for p in cli.commands["convert"].params for o in getattr(p, "opts", [])}
    tokens = re.findall(r"'[^']*'|[^\s;,()]+|[;,()]", stderr.strip().splitlines()[-1])
    ways: list[list[str]] = []
    current: list[str] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token in params:
            current.append(token)
            if not getattr(params[token], "is_flag", False) and i + 1 < len(tokens):
                i += 1
                current.append(shlex.split(tokens[i].replace("KEY", "weight"))[0])
        elif current:
            ways.append(current)
            current = []
        i += 1
    if current:
        ways.append(current)
    unique = {tuple(w) for w in ways if "--unsafe-load" not in w}
    return [list(w) for w in sorted(unique)]


def _loads_weights_only(path: Path) -> None:
    torch.load(path, weights_only=True)


@pytest.mark.parametrize("name", ["frame", "torch_version", "object_array", "namespace"])
def test_verify_fix_and_every_way_out_of_a_refusal_work(problems: dict[str, Path], name: str, tmp_path: Path) -> None:
    src = problems[name]
    verified = json.loads(invoke_cli("verify", src, "--json").stdout)
    (problem,) = verified["files"][0]["problems"]
    fix = shlex.split(problem.split("fix: ", 1)[1].split(" (", 1)[0].split("; ")[0])
    assert fix[:4] == ["ckptfix", "convert", "IN", "OUT"], problem
    out = tmp_path / "fixed.pth"
    done = invoke_cli("convert", src, out, *fix[4:])
    assert done.returncode == 0, (fix, done.stderr)
    _loads_weights_only(out)
    assert invoke_cli("verify", out).returncode == 0
    refused = invoke_cli("convert", src, tmp_path / "x.pth")
    assert refused.returncode == 3
    ways = _ways(refused.stderr)
    assert ways and any("--select" in w for w in ways), refused.stderr
    for index, way in enumerate(ways):
        result = invoke_cli("convert", src, tmp_path / f"way{index}.pth", *way)
        assert result.returncode == 0, (way, result.stderr)
        if "--allow-global" not in way:  # kept as they are: the one way that does not make plain data
            _loads_weights_only(tmp_path / f"way{index}.pth")


@pytest.mark.parametrize(
    ("name", "extra"), [("param_store", ["--select", "model"]), ("bare_tensor", []), ("numpy_array", [])]
)
def test_every_safetensors_suggestion_works(
    problems: dict[str, Path], name: str, extra: list[str], tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    refused = invoke_cli("convert", problems[name], tmp_path / "x.safetensors", *extra)
    assert refused.returncode == 3 and str(problems[name]) in refused.stderr
    ways = _ways(refused.stderr)
    assert ways, refused.stderr
    for index, way in enumerate(ways):
        if "--keep-metadata" in way:
            continue  # offered for small values; this one is a dict
        out = tmp_path / f"way{index}.safetensors"
        result = invoke_cli("convert", problems[name], out, *extra, *way)
        assert result.returncode == 0, (way, result.stderr)
        assert load_file(out)


def test_the_strip_module_note_runs_as_printed(tmp_path: Path) -> None:
    out = tmp_path / "same.pth"
    noted = invoke_cli("strip-module", FIXTURES / "compile_ddp_tinynet.pth", out)
    command = shlex.split(noted.stderr.split("strip with: ", 1)[1].splitlines()[0])
    assert command[:2] == ["ckptfix", "strip-module"]
    result = invoke_cli(*command[1:], "--force")
    assert result.returncode == 0, result.stderr
    assert list(torch.load(out, weights_only=True)) == list(torch.load(FIXTURES / "bare_tinynet.pth"))
