"""verify's --expect-* options are named after the writing options that meet them, and each
failure names a fix: running exactly that fix makes verify pass (the message is not a guess)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from conftest import FIXTURES, invoke_cli

DDP = FIXTURES / "dataparallel_tinynet.pth"


def _verify(path: Path, *expect: str) -> tuple[int, dict]:
    result = invoke_cli("verify", path, *expect, "--json")
    return result.returncode, json.loads(result.stdout)


@pytest.mark.parametrize(
    "expect",
    [
        ["--expect-no-prefix"],
        ["--expect-prefix", "none"],
        ["--expect-prefix", "_orig_mod."],
        ["--expect-device", "cuda:1"],
        ["--expect-dtype", "bfloat16"],
        ["--expect-dtype", "fp16"],
        ["--expect-format", "safetensors"],
        ["--expect-format", "pth"],
    ],
)
def test_the_fix_a_failure_names_makes_it_pass(expect: list[str], tmp_path: Path) -> None:
    src = tmp_path / "in.pth"
    if expect == ["--expect-format", "pth"]:  # start from another format
        assert invoke_cli("convert", DDP, tmp_path / "in.safetensors").returncode == 0
        src = tmp_path / "in.safetensors"
    else:
        src.write_bytes(DDP.read_bytes())
    code, document = _verify(src, *expect)
    assert code == 1 and not document["ok"], document
    (problem,) = document["files"][0]["problems"]
    fix = shlex.split(problem.split("fix: ", 1)[1])
    assert fix[:1] == ["ckptfix"] and fix[2:4] == ["IN", "OUT"], problem
    out = tmp_path / ("out.safetensors" if "safetensors" in fix else "out.pth")
    fixed = invoke_cli(fix[1], src, out, *fix[4:])
    assert fixed.returncode == 0, fixed.stderr
    code, document = _verify(out, *expect)
    assert code == 0 and document["files"][0]["problems"] == [], document


def test_keys_and_metadata(tmp_path: Path) -> None:
    out = tmp_path / "m.safetensors"
    assert invoke_cli("convert", DDP, out).returncode == 0
    assert _verify(out, "--expect-keys", "9", "--expect-metadata", "format=pt")[0] == 0
    code, document = _verify(out, "--expect-keys", "8", "--expect-metadata", "format=tf")
    assert code == 1 and document["files"][0]["problems"] == [
        "9 state-dict keys, expected 8",
        "__metadata__ format='tf' expected, it is 'pt'",
    ]
    code, document = _verify(DDP, "--expect-metadata", "format=pt")
    assert code == 1 and "not a safetensors file" in document["files"][0]["problems"][0]


def test_bad_expectations_are_usage_errors(tmp_path: Path) -> None:
    for args in (
        ["--expect-device", "cuda1"],
        ["--expect-metadata", "format"],
        ["--expect-dtype", "int8"],
        ["--expect-no-prefix", "--expect-prefix", "module."],
    ):
        result = invoke_cli("verify", DDP, *args)
        assert result.returncode == 2 and result.stderr.count("\n") <= 4, (args, result.stderr)
