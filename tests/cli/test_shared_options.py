"""Every writing command takes the shared pipeline options, and they do the same thing in each.

The commands come from the registry (``WRITING_COMMANDS``: the table's rows, fit, publish) and
the options from the one declaration (``options.PIPELINE``), so a new command or a new shared
option is covered without touching this file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import FIXTURES, invoke_cli

from ckptfix.cli import cli
from ckptfix.cli.commands import WRITE_COMMANDS, WRITING_COMMANDS
from ckptfix.cli.options import PIPELINE, REFUSED_BY, option_names

DDP = FIXTURES / "dataparallel_tinynet.pth"
BARE = FIXTURES / "bare_tinynet.pth"


def _argv(command: str, tmp_path: Path, out: str = "out.pth") -> list[Any]:
    """IN, OUT (or OUTDIR) and what the command needs besides, for the DataParallel fixture."""
    needs: dict[str, list[Any]] = {
        "rename": ["--rule", r"^module\.=>"],
        "fit": ["--reference", BARE],
        "publish": ["--format", "pth"],  # safetensors has no device tags to move
    }
    target = tmp_path if command == "publish" else tmp_path / out
    return [command, DDP, target, *needs.get(command, [])]


def test_the_registry_names_every_command_that_writes() -> None:
    assert set(WRITING_COMMANDS) == {spec.name for spec in WRITE_COMMANDS} | {"fit", "publish"}
    assert set(WRITING_COMMANDS) <= set(cli.commands)


@pytest.mark.parametrize("command", WRITING_COMMANDS)
def test_every_writing_command_declares_every_shared_option(command: str) -> None:
    shared = option_names(PIPELINE)
    assert len(shared) > 20 and {"dtype", "map_location", "drop", "keep", "rename", "select"} <= set(shared)
    declared = {param.name for param in cli.commands[command].params}
    refused = set(REFUSED_BY.get(command, ()))  # not offered: the command cannot honour them
    assert set(shared) - declared == refused, f"{command} lacks {sorted(set(shared) - declared - refused)}"


@pytest.mark.parametrize("command", WRITING_COMMANDS)
def test_shared_steps_run_in_every_writing_command(command: str, tmp_path: Path) -> None:
    """--dtype, --map-location, --drop and --rename reach the pipeline in each command (a dry
    run: the report's steps say what each did)."""
    result = invoke_cli(
        *_argv(command, tmp_path),
        "--dtype",
        "float16",
        "--map-location",
        "cuda:1",
        "--drop",
        "*.num_batches_tracked",
        "--rename",
        r"fc\.=>head.",
        "--dry-run",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    report = document
    steps = {step["step"]: step["changed"] for step in report["steps"]}
    assert steps["--dtype float16"] and steps["--map-location cuda:1"], steps
    assert steps.get("--drop/--keep", steps.get("prune")) and steps["rename by rules"], steps
    assert report["written"] is False and not (tmp_path / "out.pth").exists()


def _load_with_locations(path: Path) -> tuple[dict[str, torch.Tensor], set[str]]:
    """torch.load on the CPU, recording each storage's saved device tag (map_location gets it)."""
    locations: set[str] = set()

    def keep(storage: Any, location: str) -> Any:
        locations.add(location)
        return storage

    return torch.load(path, weights_only=True, map_location=keep), locations


def test_fit_honours_dtype_and_map_location_as_torch_would(tmp_path: Path) -> None:
    out = tmp_path / "fitted.pth"
    result = invoke_cli(
        "fit", DDP, out, "--reference", BARE, "--dtype", "float16", "--map-location", "cuda:1", "--rename", "^fc=>head"
    )
    assert result.returncode == 0, result.stderr
    written, locations = _load_with_locations(out)
    source = torch.load(DDP, weights_only=True)
    expected = {}
    for key, value in source.items():
        key = key.removeprefix("module.")  # the fit first, then the rename: the pipeline's order
        key = "head" + key[2:] if key.startswith("fc") else key
        expected[key] = value.to(torch.float16) if value.is_floating_point() else value
    assert list(written) == list(expected)
    for key, value in expected.items():
        assert written[key].dtype == value.dtype and torch.equal(written[key], value), key
    assert locations == {"cuda:1"}


def test_publish_honours_dtype(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    result = invoke_cli("publish", DDP, tmp_path, "--dtype", "bfloat16", "--json")
    assert result.returncode == 0, result.stderr
    published = load_file(json.loads(result.stdout)["output"])
    source = torch.load(DDP, weights_only=True)
    for key, value in source.items():
        cast = value.to(torch.bfloat16) if value.is_floating_point() else value
        assert torch.equal(published[key.removeprefix("module.")], cast), key
