"""Every option a command's --help lists is one the command takes: given on its own (with the
partner it names, if any), it is never refused as a usage error. The input does not exist, so
each run stops at the input check (exit 3, or verify's FAIL) after every usage check has run."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
from conftest import FIXTURES, invoke_cli

from ckptfix.cli import cli

#: usage checks only: every input is missing, so no checkpoint is read; CI runs these in one pass
pytestmark = pytest.mark.engine_independent

#: a value for each option that takes one (by parameter name)
VALUES = {
    "map_location": "cpu",
    "rename": "a=>b",
    "max_shard_size": "1GB",
    "max_expand": "1GB",
    "allow_globals": "numpy.dtype",
    "model": "models:TinyNet",
    "expect_metadata": "format=pt",
    "expect_prefix": "none",
    "expect_device": "cpu",
    "storage_options": "anon=true",
}
#: options that only mean something beside another one (given together)
PARTNERS = {
    "backup": ["--in-place"],
    "model": ["--model-path", str(FIXTURES)],
    "model_path": ["--model", "models:TinyNet"],
    "dtype_keep": ["--dtype", "float16"],
    "dcp_files": ["--format", "dcp"],
}
#: what torchrun sets for an option that only runs under it (else a usage error says so)
ENV = {"distributed": {"RANK": "0", "WORLD_SIZE": "1"}}
#: what the command needs whatever else is given
REQUIRED = {"remap": ["--map-location", "cpu"], "rename": ["--rule", "a=>b"]}
#: options of a run over several inputs
BATCH_OPTIONS = ("output_dir", "recursive", "jobs", "continue_on_error", "backup", "quiet")
#: command lines without the option under test; MISSING is an input that does not exist
BASE = {
    "fit": ["{missing}", "{out}", "--reference", "{missing}"],
    "publish": ["{missing}", "{out_dir}"],
    "diff": ["{missing}", "{missing}"],
    "verify": ["{missing}"],
    "scan": ["{missing}"],
    "inspect": ["{missing}"],
    "average": ["{missing}", "{missing}", "{out}"],
}


@pytest.mark.parametrize("command", sorted(cli.commands))
def test_every_option_in_help_is_accepted(command: str, tmp_path: Path) -> None:
    options = [p.name for p in cli.commands[command].params if isinstance(p, click.Option) and not p.hidden]
    assert len(options) > 1
    refused = [problem for option in options if option and (problem := _refused(command, option, tmp_path))]
    assert not refused, "\n".join(refused)


def _refused(command: str, option: str, tmp_path: Path) -> str | None:
    param = next(p for p in cli.commands[command].params if p.name == option)
    assert isinstance(param, click.Option)
    flag = max(param.opts, key=len)
    if param.is_flag:
        args = [flag]
    elif isinstance(param.type, click.Choice):
        args = [flag, str(param.type.choices[0])]
    elif isinstance(param.type, click.IntRange | click.types.IntParamType | click.types.FloatParamType):
        args = [flag, "1"]
    else:
        args = [flag, VALUES.get(option, "x")]
    base = BASE.get(command, ["{missing}", "{out}"])
    if option in ("in_place", "backup"):
        base = ["{missing}"] + base[2:]
    elif option in BATCH_OPTIONS and command not in BASE:
        base = ["{missing}", "-o", "{out_dir}"] if option != "output_dir" else ["{missing}"]
    elif option in ("max_shard_size", "distributed"):
        base = [("{out_dir}/" if a == "{out}" else a) for a in BASE.get(command, ["{missing}", "{out}"])]
    elif option in ("model", "model_path"):
        base = ["{missing}", "{out}"]
    required = REQUIRED.get(command, [])
    if required and required[0].lstrip("-").replace("-", "_") != option:
        base = base + required
    paths = {"missing": tmp_path / "missing.pth", "out": tmp_path / "out.pth", "out_dir": tmp_path / "rel"}
    argv = [command, *(a.format(**paths) for a in base), *args, *PARTNERS.get(option, [])]
    result = invoke_cli(*argv, env=ENV.get(option))
    return f"{' '.join(map(str, argv))}: {result.stderr}" if result.returncode == 2 else None
