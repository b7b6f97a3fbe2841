"""Consolidating a DeepSpeed folder needs neither torch nor deepspeed: one child process, both
blocked (``sys.modules[name] = None`` makes ``import`` fail as if they were not installed),
inspects and converts real saves; the outputs are then checked against DeepSpeed's own results."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from conftest import FIXTURES, ROOT
from safetensors.torch import load_file

DS = FIXTURES / "deepspeed"

_RUNNER = r"""
import contextlib, io, json, sys
sys.modules["torch"] = None
sys.modules["deepspeed"] = None
from ckptfix.cli import main

codes = []
for args in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            main(args)
            code = 0
        except SystemExit as exc:
            code = exc.code
    codes.append([code, err.getvalue()])
print(json.dumps({"codes": codes, "loaded": sorted(m for m in ("torch", "deepspeed") if sys.modules.get(m))}))
"""


def test_consolidation_without_torch_or_deepspeed(tmp_path: Path) -> None:
    runs = [
        ["inspect", str(DS / "z3_bf16_w3")],
        ["convert", str(DS / "z3_bf16_w3"), str(tmp_path / "z3.safetensors")],
        ["convert", str(DS / "z3_bf16_w3"), str(tmp_path / "z3m.safetensors"), "--weights", "module"],
        ["convert", str(DS / "z2_fp16_w3"), str(tmp_path / "z2.pth")],
    ]
    done = subprocess.run(
        [sys.executable, "-c", _RUNNER, json.dumps(runs)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert [c for c, _ in report["codes"]] == [0, 0, 0, 0], report
    assert report["loaded"] == []
    fp32 = torch.load(DS / "z3_bf16_w3.fp32.pth", weights_only=True)
    got = load_file(tmp_path / "z3.safetensors")
    assert all(torch.equal(got[k], v) for k, v in fp32.items() if k in got and k != "bn.num_batches_tracked")
    module = torch.load(DS / "z3_bf16_w3.module.pth", weights_only=True)
    got = load_file(tmp_path / "z3m.safetensors")  # rounded to bf16 without torch: the engine's bits
    assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in module.items() if k in got)
    pth = torch.load(tmp_path / "z2.pth", weights_only=True)
    assert pth["head.weight"].data_ptr() == pth["emb.weight"].data_ptr()
