"""Issue 23, the path a new user walks: real checkpoints handled the way people expect, and
errors that name the file and the fix (each test failed before its fix)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from conftest import FIXTURES, invoke_cli

COMPILED = FIXTURES / "compiled_tinynet.pth"
COMPILE_DDP = FIXTURES / "compile_ddp_tinynet.pth"
BARE = FIXTURES / "bare_tinynet.pth"


# ----------------------------------------------------------------------------- torch.compile


def test_strip_module_names_the_compile_prefix_and_auto_strips_any_nesting(tmp_path: Path) -> None:
    plain = invoke_cli("strip-module", COMPILED, tmp_path / "same.pth")
    assert plain.returncode == 0
    assert f"strip-module {COMPILED} {tmp_path / 'same.pth'} --prefix auto" in plain.stderr
    assert "'_orig_mod.' (torch.compile)" in plain.stderr
    bare = list(torch.load(BARE, weights_only=True))
    for source in (COMPILED, COMPILE_DDP):
        out = tmp_path / f"auto_{source.name}"
        result = invoke_cli("strip-module", source, out, "--prefix", "auto")
        assert result.returncode == 0, result.stderr
        assert list(torch.load(out, weights_only=True)) == bare
    # order-independent: module._orig_mod. as well as _orig_mod.module.
    swapped = {k.replace("_orig_mod.module.", "module._orig_mod."): v for k, v in torch.load(COMPILE_DDP).items()}
    torch.save(swapped, tmp_path / "swapped.pth")
    result = invoke_cli("strip-module", tmp_path / "swapped.pth", tmp_path / "s.pth", "--prefix", "auto")
    assert result.returncode == 0 and list(torch.load(tmp_path / "s.pth", weights_only=True)) == bare


def test_strip_module_help_says_what_it_does_when_nothing_matches() -> None:
    text = invoke_cli("strip-module", "--help").stdout
    assert "writes nothing when no key has the prefix" not in text
    assert "--prefix auto" in text
