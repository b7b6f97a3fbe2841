"""Awkward and hostile checkpoints: pass-through without execution, --sanitize, scan, hostile pickles."""

from __future__ import annotations

import argparse
import io
import json
import os
import pathlib
import pickle
import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import FIXTURES, invoke_cli

SAFE_GLOBALS = ["--allow-global", "argparse.Namespace", "--allow-global", "numpy.*", "--allow-global", "pathlib.*"]


def _training_checkpoint(path: Path) -> dict:
    ckpt = {
        "state_dict": torch.nn.DataParallel(torch.nn.Linear(3, 2)).state_dict(),
        "args": argparse.Namespace(lr=0.1, name="run", layers=[1, 2], nested=argparse.Namespace(seed=3)),
        "best_acc": np.float64(0.93),
        "step": np.int64(7),
        "flag": np.bool_(True),
        "confusion": np.arange(6, dtype=np.int32).reshape(2, 3),
        "fortran": np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3)),
        "big_endian": np.arange(3, dtype=">f8"),
        "out_dir": pathlib.PurePosixPath("/data/run1"),
    }
    torch.save(ckpt, path)
    return ckpt


def test_allow_global_passes_objects_through_unchanged(tmp_path: Path) -> None:
    src, out = tmp_path / "train.pth", tmp_path / "out.pth"
    _training_checkpoint(src)
    refused = invoke_cli("strip-module", src, out)
    assert refused.returncode == 3 and "--allow-global argparse.Namespace" in refused.stderr
    result = invoke_cli("strip-module", src, out, *SAFE_GLOBALS)
    assert result.returncode == 0, result.stderr
    original, fixed = torch.load(src, weights_only=False), torch.load(out, weights_only=False)
    assert set(fixed["state_dict"]) == {"weight", "bias"}
    assert vars(fixed["args"]) == vars(original["args"]) and isinstance(fixed["args"], argparse.Namespace)
    for key in ("best_acc", "step", "flag"):
        assert fixed[key] == original[key] and type(fixed[key]) is type(original[key])
    for key in ("confusion", "fortran", "big_endian"):
        assert np.array_equal(fixed[key], original[key]) and fixed[key].dtype == original[key].dtype
    assert fixed["out_dir"] == original["out_dir"]


def test_sanitize_output_loads_with_weights_only(tmp_path: Path) -> None:
    src, out = tmp_path / "train.pth", tmp_path / "clean.pth"
    original = _training_checkpoint(src)
    result = invoke_cli("strip-module", src, out, "--sanitize", "--json")
    assert result.returncode == 0, result.stderr
    replaced = {r["path"]: r["global"] for r in json.loads(result.stdout)["sanitized"]}
    assert replaced["args"] == "argparse.Namespace" and replaced["out_dir"] == "pathlib.PurePosixPath"
    clean = torch.load(out, weights_only=True)
    assert clean["args"] == {"lr": 0.1, "name": "run", "layers": [1, 2], "nested": {"seed": 3}}
    assert clean["best_acc"] == 0.93 and type(clean["best_acc"]) is float
    assert clean["step"] == 7 and type(clean["step"]) is int and clean["flag"] is True
    for key in ("confusion", "fortran", "big_endian"):
        expected = torch.from_numpy(np.ascontiguousarray(original[key]).astype(original[key].dtype.newbyteorder("=")))
        assert torch.equal(clean[key], expected), key
    assert clean["out_dir"] == "/data/run1"


class _Custom:
    def __init__(self) -> None:
        self.value = 1


def test_sanitize_refuses_what_it_cannot_convert(tmp_path: Path) -> None:
    src = tmp_path / "obj.pth"
    torch.save({"w": torch.ones(1), "odd": np.array(["a", "b"])}, src)
    result = invoke_cli("convert", src, tmp_path / "out.pth", "--sanitize")
    assert result.returncode == 3 and "only numeric dtypes" in result.stderr


def _payloads(marker: Path) -> dict[str, object]:
    class System:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    class Popen:
        def __reduce__(self):
            return (subprocess.Popen, (["touch", str(marker)],))

    class Exec:
        def __reduce__(self):
            return (exec, (f"open({str(marker)!r}, 'w').close()",))

    class Import:
        def __reduce__(self):
            return (__import__, ("os",))

    return {
        "os.system": System(),
        "subprocess.Popen": Popen(),
        "builtins.exec": Exec(),
        "builtins.__import__": Import(),
    }


@pytest.mark.parametrize("legacy", [False, True])
def test_hostile_pickles_never_run_in_any_command(tmp_path: Path, legacy: bool) -> None:
    marker = tmp_path / "pwned"
    for name, payload in _payloads(marker).items():
        src = tmp_path / f"{name}.pth"
        torch.save(
            {"state_dict": {"module.w": torch.ones(1)}, "x": payload}, src, _use_new_zipfile_serialization=not legacy
        )
        for args in (
            ["inspect", src],
            ["strip-module", src, tmp_path / "o.pth"],
            ["convert", src, tmp_path / "o.pth"],
            ["verify", src],
            ["diff", src, src],
            ["fit", src, tmp_path / "o.pth", "--reference", src],
        ):
            result = invoke_cli(*args)
            assert result.returncode in (1, 3), (name, args[0], result.stderr)
            assert name in result.stderr or name.split(".")[1] in result.stderr or args[0] == "verify"
            assert not marker.exists(), f"{name} ran during {args[0]}"
        scanned = invoke_cli("scan", src, "--json")
        assert scanned.returncode == 1 and not marker.exists()
        dangerous = json.loads(scanned.stdout)["files"][0]["dangerous"]
        assert any(name.split(".")[1] in d for d in dangerous), dangerous
        assert not (tmp_path / "o.pth").exists()


def test_a_dangerous_name_cannot_be_allowed(tmp_path: Path) -> None:
    """--allow-global never lets a code-execution primitive through, not even as an inert record
    written back: the file is hostile, whatever the flags (only --unsafe-load goes past it)."""
    marker = tmp_path / "pwned"
    src, out = tmp_path / "evil.pth", tmp_path / "out.pth"
    torch.save({"state_dict": {"module.w": torch.ones(1)}, "x": _payloads(marker)["os.system"]}, src)
    for select in ((), ("--select", "state_dict")):
        result = invoke_cli(
            "strip-module", src, out, "--allow-global", "posix.system", "--allow-global", "os.*", *select
        )
        assert result.returncode == 3 and "the file is hostile" in result.stderr, result.stderr
        assert "--allow-global" not in result.stderr and not out.exists() and not marker.exists()


def test_scan_finds_nested_and_stack_global_payloads(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    inner = io.BytesIO()
    torch.save(_payloads(marker)["os.system"], inner, _use_new_zipfile_serialization=False)

    class LoadFromBytes:
        def __reduce__(self):
            return (torch.storage._load_from_bytes, (inner.getvalue(),))

    torch.save({"w": LoadFromBytes()}, tmp_path / "nested.pth")
    (tmp_path / "proto4.pkl").write_bytes(pickle.dumps(_payloads(marker)["os.system"], protocol=4))
    report = json.loads(invoke_cli("scan", tmp_path / "nested.pth", tmp_path / "proto4.pkl", "--json").stdout)
    nested, proto4 = report["files"]
    assert "torch.storage._load_from_bytes" in nested["dangerous"] and "os.system" in nested["dangerous"]
    assert any(g["where"].endswith("(nested pickle)") for g in nested["globals"])
    assert proto4["dangerous"] == ["os.system"]  # STACK_GLOBAL resolved from the pushed strings
    assert not marker.exists()
    safe = invoke_cli("scan", FIXTURES / "dataparallel_tinynet.pth", FIXTURES / "legacy_dataparallel_tinynet.pth")
    assert safe.returncode == 0 and "dangerous" not in safe.stdout


def _with_data_pkl(payload: bytes, dest: Path) -> None:
    with zipfile.ZipFile(FIXTURES / "bare_tinynet.pth") as z, zipfile.ZipFile(dest, "w") as out:
        for info in z.infolist():
            out.writestr(info.filename, payload if info.filename.endswith("/data.pkl") else z.read(info))


@pytest.mark.parametrize(
    "payload",
    [
        b"\x80\x02" + b"]" * 200_000 + b".",  # 200 000 nested lists, never closed
        b"\x80\x02" + b"(" * 200_000 + b"t" * 200_000 + b".",  # deeply nested tuples
        b"\x80\x02X\xff\xff\xff\x7fabc.",  # a 2 GB string in 3 bytes
        b"\x80\x02\x8b\xff\xff\xff\x7f.",  # a 2 GB integer
        b"\x80\x02]q\x00(h\x00h\x00h\x00e" * 10 + b".",  # self-referencing lists
    ],
)
def test_hostile_pickle_structures_fail_fast(tmp_path: Path, payload: bytes) -> None:
    _with_data_pkl(payload, tmp_path / "h.pth")
    result = invoke_cli("strip-module", tmp_path / "h.pth", tmp_path / "out.pth", timeout=30)
    assert result.returncode in (0, 3), result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) <= 1
