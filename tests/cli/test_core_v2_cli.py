"""Core v2 on the command line: a dict that contains itself, and the one nesting limit, through every
command (the structure rules and round trips: tests/unit/test_core_v2.py)."""

from __future__ import annotations

import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from conftest import invoke_cli


def test_a_dict_that_contains_itself_is_stripped_like_torch_does(tmp_path: Path) -> None:
    """consume_prefix_in_state_dict_if_present edits the dict in place, so the inner reference
    is the stripped dict itself; ours must be the same shape, not an unstripped copy."""
    from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

    sd: Any = OrderedDict()
    sd["module.w"] = torch.ones(2)
    sd["module.self"] = sd
    torch.save({"state_dict": sd}, tmp_path / "in.pth")
    result = invoke_cli("strip-module", tmp_path / "in.pth", tmp_path / "out.pth", "--key", "state_dict")
    assert result.returncode == 0, result.stderr
    ours = torch.load(tmp_path / "out.pth", weights_only=True)["state_dict"]
    theirs = torch.load(tmp_path / "in.pth", weights_only=True)["state_dict"]
    consume_prefix_in_state_dict_if_present(theirs, "module.")
    assert list(ours) == list(theirs) == ["w", "self"]
    assert ours["self"] is ours and theirs["self"] is theirs
    assert torch.equal(ours["w"], theirs["w"])


def test_nesting_up_to_the_limit_works_everywhere_and_beyond_it_is_exit_3(tmp_path: Path) -> None:
    """One limit (1000), enforced while reading: anything the reader accepts every command
    handles (no recursion anywhere: no exit 5), anything deeper is refused with exit 3."""

    def nested(depth: int) -> Any:
        value: Any = {"leaf": 1}
        for _ in range(depth - 1):
            value = {"k": value}
        return value

    ok, deep = tmp_path / "ok.pth", tmp_path / "deep.pth"
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)  # torch.save pickles recursively
    try:
        for path, depth in ((ok, 990), (deep, 1100)):
            torch.save({"state_dict": {"module.w": torch.tensor([1.0, 2.0])}, "deep": nested(depth)}, path)
    finally:
        sys.setrecursionlimit(limit)
    for args in (
        ["inspect", ok, "--json"],
        ["strip-module", ok, tmp_path / "a.pth"],
        ["verify", ok],
        ["diff", ok, ok],
        ["prune", ok, tmp_path / "b.pth"],
        ["scan", ok],
        ["convert", ok, tmp_path / "c.pth", "--sanitize"],
        ["convert", ok, tmp_path / "d.safetensors", "--keep-metadata"],
    ):
        result = invoke_cli(*args)
        assert result.returncode in (0, 3), (args[0], result.stderr)  # 3: the deep value is too big to keep
    assert torch.load(tmp_path / "a.pth", weights_only=True)["state_dict"]["w"].tolist() == [1.0, 2.0]
    for args in (["inspect", deep], ["strip-module", deep, tmp_path / "e.pth"], ["verify", deep]):
        result = invoke_cli(*args)
        assert result.returncode in (1, 3) and "nested more than 1000 deep" in (result.stderr + result.stdout)
        assert len(result.stderr.strip().splitlines()) <= 1
    assert not (tmp_path / "e.pth").exists()
