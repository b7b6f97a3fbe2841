"""The core install has no torch (``pip install ckptfix``; torch is the ``[torch]`` extra): every
command that moves bytes works with torch absent, and what needs torch says "needs torch: pip
install 'ckptfix[torch]'" in one line with exit 2, never an ImportError traceback.

torch is blocked in one child process (``sys.modules['torch'] = None`` makes ``import torch``
fail exactly as when it is not installed), which runs every command in turn through the console
script's ``ckptfix.cli.main``. CI also runs ``.ci/smoke-no-torch.sh`` in a venv that really has
no torch. The numpy code on these paths is checked against torch in ``tests/unit/test_numeric.py``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
from conftest import FIXTURES, ROOT

from ckptfix.errors import NEEDS_TORCH
from ckptfix.native import engine

NEEDS_TORCH_LINE = f"ckptfix: error: {NEEDS_TORCH}"

#: runs each command of argv[1] (a JSON list) through ckptfix's entry point, torch blocked; prints
#: [{code, stdout, stderr}, ...] and then what ckptfix.load says
_RUNNER = r"""
import contextlib, io, json, sys
sys.modules["torch"] = None  # `import torch` now fails as if torch were not installed
try:
    import torch
except ModuleNotFoundError:
    pass
else:
    raise SystemExit("torch is importable")
import ckptfix
from ckptfix.cli import main

results = []
for args in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(args)
            code = 0
        except SystemExit as exc:
            code = exc.code
    results.append({"args": args, "code": code, "stdout": out.getvalue(), "stderr": err.getvalue()})
try:
    ckptfix.load(sys.argv[2])
    loaded = "loaded"
except ckptfix.NeedsTorchError as exc:
    loaded = f"{exc.exit_code.value} {exc}"
print(json.dumps({"results": results, "load": loaded, "torch": sys.modules.get("torch") is not None}))
"""


def test_without_torch(tmp_path: Path) -> None:
    ddp, lightning, bare = (
        FIXTURES / "ddp_cpu_tinynet.pth",
        FIXTURES / "lightning_tinynet.ckpt",
        FIXTURES / "bare_tinynet.pth",
    )
    legacy = FIXTURES / "legacy_dataparallel_tinynet.pth"
    t = tmp_path
    # inputs only torch reads: a pickle global outside the allow-list (the --unsafe-load fallback),
    # in both torch formats, and a tar-era checkpoint (torch < 0.4)
    config = {"w": torch.ones(2), "args": argparse.Namespace(lr=0.1)}
    torch.save(config, t / "config.pth")
    torch.save(config, t / "legacy_config.pth", _use_new_zipfile_serialization=False)
    with tarfile.open(t / "old.tar.pth", "w") as archive:
        archive.add(bare, arcname="sys_info")

    works: list[list[Any]] = [
        ["--version"],
        ["inspect", ddp],
        ["inspect", legacy, "--json"],
        ["scan", ddp, legacy, lightning],
        ["verify", bare, legacy, lightning],
        # the fixes on torch zip, legacy, safetensors and shard inputs
        ["strip-module", ddp, t / "bare.pth"],
        ["add-module", t / "bare.pth", t / "ddp.pth"],
        ["rename", t / "bare.pth", t / "renamed.pth", "--rule", r"^fc\.=>head."],
        ["remap", ddp, t / "gpu.pth", "--map-location", "cuda:0"],
        ["prune", lightning, t / "weights.ckpt", "--drop", "epoch"],
        ["convert", lightning, t / "w.safetensors", "--select", "state_dict", "--strip-prefix", "model."],
        ["convert", t / "w.safetensors", t / "w.pth", "--drop", "*num_batches_tracked"],
        ["convert", t / "w.pth", t / "shards/", "--max-shard-size", "300B"],
        ["strip-module", t / "shards/", t / "from_shards.pth", "--prefix", "bn1."],
        ["strip-module", legacy, t / "legacy.safetensors"],
        ["add-module", t / "w.safetensors", t / "wrapped.safetensors"],
        # casts in numpy, and diff measuring what they did
        ["convert", t / "shards/", t / "bf16.safetensors", "--dtype", "bf16"],
        ["convert", t / "w.safetensors", t / "half.pth", "--dtype", "float16"],
        ["convert", t / "bf16.safetensors", t / "back.pth", "--dtype", "float32"],
        ["diff", t / "legacy.safetensors", t / "w.safetensors"],
        ["diff", t / "wrapped.safetensors", t / "w.safetensors", "--strip-prefix", "module."],
        ["diff", t / "bare.pth", t / "ddp.pth", "--add-prefix", "module."],
        ["diff", t / "w.pth", t / "back.pth", "--rtol", "1e-2", "--atol", "1e-2"],
        ["verify", t / "shards", t / "bf16.safetensors", "--expect-prefix", "none"],
        ["publish", lightning, t],
        # a DCP folder written by ckptfix's own emitter, split in two, and read back
        ["convert", t / "w.safetensors", t / "dcp/", "--format", "dcp", "--dcp-files", "2"],
        ["convert", t / "dcp", t / "from_dcp.safetensors"],
        ["diff", t / "dcp", t / "w.safetensors"],
    ]
    fails = [
        ["diff", t / "w.pth", t / "back.pth", "--json"],  # bfloat16 rounding: values differ
        ["diff", t / "w.pth", t / "half.pth", "--json"],  # float32 vs float16: rounding differs
    ]
    needs = [
        ["fit", bare, t / "fit.pth", "--model", "models:TinyNet", "--model-path", FIXTURES],
        ["convert", t / "config.pth", t / "o.pth", "--unsafe-load"],
        ["inspect", t / "legacy_config.pth", "--unsafe-load"],
        ["inspect", t / "old.tar.pth"],
    ]
    commands = [[str(a) for a in args] for args in works + fails + needs]
    child = subprocess.run(
        [sys.executable, "-c", _RUNNER, json.dumps(commands), str(bare)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr
    report = json.loads(child.stdout)
    results = report["results"]
    assert report["torch"] is False and report["load"] == f"2 {NEEDS_TORCH}"
    for result in results[: len(works)]:
        assert result["code"] == 0, result
        assert "torch" not in result["stderr"], result
    # the child inherits this process's CKPTFIX_ENGINE and finds the same library
    assert results[0]["stdout"] == f"ckptfix, version {version('ckptfix')} ({engine()} engine)\n"
    assert len(list((t / "shards").glob("*.safetensors"))) > 1
    measured, mismatched = (json.loads(r["stdout"]) for r in results[len(works) : len(works) + len(fails)])
    assert all(r["code"] == 1 for r in results[len(works) : len(works) + len(fails)])
    assert measured["different"] and all(d["max_abs_diff"] > 0 for d in measured["different"])
    # across dtypes the values are compared (in float64), and float16 rounding shows
    assert mismatched["dtype_changed"] and mismatched["different"] and not mismatched["mismatched"]
    for result in results[len(works) + len(fails) :]:
        assert result["code"] == 2 and result["stderr"].splitlines() == [NEEDS_TORCH_LINE], result
    assert sorted(p.name for p in (t / "dcp").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    # what the commands wrote is what torch would have: the numpy casts are torch's
    original = torch.load(t / "w.pth", weights_only=True)
    half = torch.load(t / "half.pth", weights_only=True)
    assert all(torch.equal(half[k], v.half() if v.is_floating_point() else v) for k, v in original.items())
