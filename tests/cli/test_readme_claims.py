"""README claims, each run as written (the ones other tests do not already cover)."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import shutil
import sys
import types
from pathlib import Path

import pytest
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


# -- every example command line in README.md's code blocks, run as written -------------------------

#: lines of the README's shell code blocks that are not ckptfix commands CI can run here, each with why
NOT_RUN = {
    "pip install torch==2.13.0 && pip install -e '.[test]' && python -m pytest tests -q": (
        "installs packages and runs this suite itself (CI's own job: .ci/run)"
    ),
    "ckptfix: error: needs torch: pip install 'ckptfix[torch]'": (
        "an error message, not a command (test_without_torch_the_torch_features_stop_with_one_line)"
    ),
}


def _code_blocks(language: str) -> list[str]:
    """The text of README.md's fenced code blocks labelled ``language`` ("" for unlabelled)."""
    blocks, current, label = [], None, ""
    for line in README.splitlines():
        if line.strip().startswith("```"):
            if current is None:
                current, label = [], line.strip()[3:]
            else:
                if label == language:
                    blocks.append("\n".join(current) + "\n")
                current = None
        elif current is not None:
            current.append(line.strip())
    return blocks


def _shell_blocks() -> list[str]:
    """The lines of README.md's unlabelled code blocks (shell commands)."""
    return [line for block in _code_blocks("") for line in block.splitlines() if line]


EXAMPLES = [line for line in _shell_blocks() if line not in NOT_RUN]


def test_the_lines_not_run_are_still_in_the_readme() -> None:
    assert set(NOT_RUN) <= set(_shell_blocks()), set(NOT_RUN) - set(_shell_blocks())
    assert len(EXAMPLES) >= 5, EXAMPLES


def _workspace(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The files the examples name: a DataParallel checkpoint (ddp.pth) and a Lightning-style
    train.ckpt whose hyper_parameters hold an omegaconf config and a class from `mypkg`."""
    from config_types import lightning_style
    from omegaconf import OmegaConf

    shutil.copy(FIXTURES / "dataparallel_tinynet.pth", folder / "ddp.pth")
    mypkg = types.ModuleType("mypkg")

    @dataclasses.dataclass
    class Optim:
        lr: float = 3e-4

    Optim.__module__, Optim.__qualname__ = "mypkg", "Optim"
    mypkg.Optim = Optim  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mypkg", mypkg)
    hparams = {"cfg": OmegaConf.create({"lr": 0.1, "warmup": "${lr}"}), "optim": Optim()}
    torch.save(lightning_style(hparams), folder / "train.ckpt")
    monkeypatch.delitem(sys.modules, "mypkg")


@pytest.mark.parametrize("line", EXAMPLES)
def test_every_example_command_line_runs(line: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each line in a fresh folder holding the files it names; `a && b` in order, each exit 0;
    `fixtures/...` is the checkout's, `/tmp/` the test's folder, `pip install` is skipped."""
    _workspace(tmp_path, monkeypatch)
    (tmp_path / "fixtures").symlink_to(FIXTURES)
    ran = 0
    for command in line.split(" && "):
        words = shlex.split(command.replace("/tmp/", f"{tmp_path}/"), comments=True)
        if words[:2] == ["pip", "install"]:
            continue
        assert words[0] == "ckptfix", f"not a ckptfix command: add it to NOT_RUN with a reason: {command}"
        result = invoke_cli(*words[1:], cwd=tmp_path)
        assert result.returncode == 0, (command, result.stderr)
        ran += 1
    assert ran, line
    if "train.ckpt out.ckpt --sanitize" in line:  # "plain data: loads with weights_only=True"
        assert torch.load(tmp_path / "out.ckpt", weights_only=True)["hyper_parameters"]["optim"] == {"lr": 3e-4}
    if "--select state_dict" in line and "train.ckpt" in line:  # "the weights only"
        assert set(torch.load(tmp_path / "out.pth", weights_only=True)) == {
            "model.0.weight",
            "model.0.bias",
            "model.1.weight",
        }


def test_the_example_checkpoint_with_configs_needs_one_of_the_three_ways_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _workspace(tmp_path, monkeypatch)
    refused = invoke_cli("strip-module", "train.ckpt", "out.ckpt", cwd=tmp_path)
    assert refused.returncode == 3 and not (tmp_path / "out.ckpt").exists(), refused.stderr
    for way_out in ("--allow-global 'omegaconf.*'", "--allow-global mypkg.Optim", "--sanitize", "--select state_dict"):
        assert way_out in refused.stderr, (way_out, refused.stderr)


def test_the_python_api_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's Python block as written, on the files it names (`model` is the bare TinyNet)."""
    block = _code_blocks("python")
    assert len(block) == 1
    shutil.copy(FIXTURES / "dataparallel_tinynet.pth", tmp_path / "ddp.pth")
    shutil.copy(FIXTURES / "ddp_cpu_tinynet.pth", tmp_path / "ddp_8gpu.pth")
    shutil.copy(FIXTURES / "lightning_tinynet.ckpt", tmp_path / "train.ckpt")
    monkeypatch.chdir(tmp_path)
    names: dict[str, object] = {"model": TinyNet()}
    exec(compile(block[0], "README.md (Python API)", "exec"), names)
    assert torch.load("bare.pth", weights_only=True).keys() == TinyNet().state_dict().keys()
    assert torch.load("bare2.pth", weights_only=True).keys() == TinyNet().state_dict().keys()
    assert isinstance(names["sd"], dict) and json.loads(json.dumps(names["info"]))["format"] == "torch-zip"
    assert names["report"].stripped == ["module."] and not names["report"].missing  # type: ignore[attr-defined]
