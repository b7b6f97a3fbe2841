"""README claims, each run as written (the ones other tests do not already cover)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import torch
from conftest import FIXTURES, ROOT, invoke_cli
from models import TinyNet

README = (ROOT / "README.md").read_text()


def _section(title: str) -> str:
    start = README.index(title)
    return README[start : README.index("\n#", start + 1)]


def test_the_github_actions_example_runs_on_plain_state_dicts(tmp_path: Path) -> None:
    """Every `run: ckptfix ...` line of the example, in order, from a checkout with a folder of
    plain state dicts; `> file` is stdout, as the shell would write it."""
    (tmp_path / "checkpoints" / "sub").mkdir(parents=True)
    torch.save(TinyNet().state_dict(), tmp_path / "checkpoints" / "a.pth")
    torch.save(TinyNet().state_dict(), tmp_path / "checkpoints" / "sub" / "b.pt")
    example = README[README.index("Example GitHub Actions steps") :]
    example = example[: example.index("```\n", example.index("```yaml") + 7)]
    steps = re.findall(r"^\s*run: (ckptfix .*)$", example, re.M)
    assert len(steps) == 3, steps
    for line in steps:
        args, _, target = line.partition(" > ")
        result = invoke_cli(*shlex.split(args)[1:], cwd=tmp_path)
        assert result.returncode == 0, (line, result.stderr)
        (tmp_path / target.strip()).write_text(result.stdout)
        assert json.loads(result.stdout)["ok"] is True
    assert json.loads((tmp_path / "verify.json").read_text())["counts"] == {"passed": 2, "failed": 0}
    assert sorted(p.relative_to(tmp_path).as_posix() for p in (tmp_path / "dist").rglob("*.safetensors")) == [
        "dist/a.safetensors",
        "dist/sub/b.safetensors",
    ]


def test_the_formats_section_names_dcp_and_inspect_reads_it() -> None:
    formats = _section("Formats read")
    assert "torch.distributed.checkpoint` (DCP)" in formats and "--format dcp" in formats
    result = invoke_cli("inspect", FIXTURES / "dcp_sharded_2ranks", "--json")
    assert result.returncode == 0 and json.loads(result.stdout)["format"] == "dcp", result.stderr


def test_every_command_in_the_table_exists_and_every_command_is_in_the_table() -> None:
    from ckptfix.cli import cli

    table = _section("## Commands")
    named = set(re.findall(r"^\| `ckptfix ([a-z-]+)", table, re.M))
    assert named == set(cli.commands), named ^ set(cli.commands)


def test_every_verify_option_in_the_readme_exists() -> None:
    from ckptfix.cli import cli

    declared = {opt for p in cli.commands["verify"].params for opt in getattr(p, "opts", [])}
    mentioned = set(re.findall(r"`(--expect-[a-z-]+)", README))
    assert mentioned and mentioned <= declared, mentioned - declared
