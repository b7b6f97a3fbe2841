"""``--json`` is one schema: every command's document (success and failure) starts with the same
envelope, and a concept has one name and one type wherever it appears (docs/json.md).

The commands are enumerated from the click group: a new command fails
:func:`test_every_command_is_covered` until it has a row here.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import FIXTURES, invoke_cli

from ckptfix.cli import cli
from ckptfix.cli.render import ENVELOPE, SCHEMA_VERSION
from ckptfix.formats import checkpoint

DDP = FIXTURES / "dataparallel_tinynet.pth"
BARE = FIXTURES / "bare_tinynet.pth"

#: the words inspect prints for a format; verify and scan add "unknown" (a file they could not
#: read as a checkpoint), scan "pickle" (a file that is one plain pickle: DCP's .metadata)
FORMAT_WORDS = {v for k, v in vars(checkpoint).items() if k.startswith("FORMAT_")}
CHECK_WORDS = {"unknown", "pickle"}

#: every command, run with --json on the DataParallel fixture ({tmp}: a fresh folder)
RUNS: dict[str, list[list[str]]] = {
    "inspect": [["{ddp}"]],
    "verify": [["{ddp}", "{bare}"]],
    "scan": [["{ddp}"]],
    "diff": [["{ddp}", "{bare}"], ["{ddp}", "{bare}", "--strip-prefix", "module."]],
    "convert": [["{ddp}", "{tmp}/a.safetensors"], ["{ddp}", "{tmp}/shards/", "--max-shard-size", "300B"]],
    "strip-module": [["{ddp}", "{tmp}/b.pth"], ["{ddp}", "{bare}", "-o", "{tmp}/batch"]],
    "add-module": [["{bare}", "{tmp}/c.pth"]],
    "remap": [["{ddp}", "{tmp}/d.pth", "--map-location", "cpu=cuda:0"]],
    "rename": [["{ddp}", "{tmp}/e.pth", "--rule", "^module.=>"]],
    "prune": [["{ddp}", "{tmp}/f.pth"]],
    "fit": [  # the second fit refuses (exit 1): its reference, written by the first, lacks fc
        ["{ddp}", "{tmp}/g.pth", "--reference", "{bare}", "--drop", "module.fc.*"],
        ["{ddp}", "{tmp}/h.pth", "--reference", "{tmp}/g.pth"],
    ],
    "publish": [["{ddp}", "{tmp}"]],
}

#: dicts whose keys are data (dtypes, devices, metadata names...), not schema vocabulary
DATA_KEYED = {"counts", "dtypes", "devices", "device_moves", "metadata", "aliases"}
#: one name, one type (None allowed where listed); bool is checked apart from int
TYPES: dict[str, tuple[type, ...]] = {
    "schema_version": (int,),
    "command": (str,),
    "ok": (bool,),
    "exit_code": (int,),
    "input": (str,),
    "output": (str, type(None)),
    "input_a": (str,),
    "input_b": (str,),
    "written": (bool,),
    "unchanged": (bool,),
    "tensors": (int,),
    "tensor_bytes": (int,),
    "input_bytes": (int,),
    "output_bytes": (int, type(None)),
    "dropped_bytes": (int,),
    "shared_bytes": (int, type(None)),
    "format": (str,),
    "input_format": (str,),
    "output_format": (str,),
    "shard_format": (str, type(None)),
    "notes": (list,),
    "problems": (list,),
    "seconds": (float, int),
    "message": (str,),
    "error": (dict, type(None)),  # null in a batch's files that did not fail
}
#: names schema 2 replaced (file paths are input/output; sizes are <what>_bytes)
RETIRED = {"file", "file_bytes", "tensors_bytes", "bytes_in", "bytes_out", "bytes_dropped", "size", "write", "a", "b"}


def _run(args: list[str], tmp: Path) -> tuple[int, dict[str, Any]]:
    argv = [a.format(ddp=DDP, bare=BARE, tmp=tmp) for a in args]
    result = invoke_cli(*argv, "--json")
    assert result.stdout.count("\n{") == 0, "one JSON object on stdout"
    return result.returncode, json.loads(result.stdout)


def _keys(node: Any, top: bool = True) -> Iterator[tuple[str, Any, bool]]:
    """(key, value, at a document's top or a file entry's level) for every schema key."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield key, value, top
            if key not in DATA_KEYED:
                yield from _keys(value, top=key in ("files", "report"))
    elif isinstance(node, list):
        for item in node:
            yield from _keys(item, top)


def _check(document: dict[str, Any], command: str, code: int) -> None:
    assert tuple(document)[: len(ENVELOPE)] == ENVELOPE, list(document)
    assert document["schema_version"] == SCHEMA_VERSION == 2
    assert document["command"] == command and document["exit_code"] == code
    assert document["ok"] is (code == 0)
    for key, value, top in _keys(document):
        assert key not in RETIRED, f"{command}: retired field {key!r}"
        assert not (top and key == "path"), f"{command}: a file is 'input' or 'output', not 'path'"
        if key in TYPES:
            assert isinstance(value, TYPES[key]) and (bool in TYPES[key] or not isinstance(value, bool)), (
                f"{command}: {key} = {value!r}"
            )
        if key in ("format", "input_format", "output_format", "shard_format") and value is not None:
            allowed = FORMAT_WORDS | (CHECK_WORDS if command in ("scan", "verify") else set())
            assert value in allowed, f"{command}: {key} = {value!r} is not a word inspect prints"


def test_every_command_is_covered() -> None:
    assert set(RUNS) == set(cli.commands)


@pytest.mark.parametrize("command", sorted(RUNS))
def test_every_document_has_the_envelope_and_the_vocabulary(command: str, tmp_path: Path) -> None:
    for args in RUNS[command]:
        code, document = _run([command, *args], tmp_path)
        assert code in (0, 1), document
        _check(document, command, code)


@pytest.mark.parametrize("command", sorted(RUNS))
def test_every_failure_is_the_envelope_with_an_error(command: str, tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.pth")
    code, document = _run([command, missing, *RUNS[command][0][1:]], tmp_path)
    assert code == (1 if command == "verify" else 3), document
    _check(document, command, code)
    if command in ("verify", "scan"):  # a check of many files reports each file, then exits
        assert document["files"][0]["problems"] and document["files"][0]["input"] == missing
    else:
        assert set(document) == {*ENVELOPE, "error"}
        assert set(document["error"]) == {"type", "message", "hint"} and missing in document["error"]["message"]


def test_a_usage_error_names_its_command(tmp_path: Path) -> None:
    code, document = _run(["convert", str(DDP), str(tmp_path / "x.pth"), "--no-such-option"], tmp_path)
    assert code == 2 and document["command"] == "convert" and document["error"]["type"] == "NoSuchOption"


def test_inspect_and_writing_reports_use_the_same_format_words(tmp_path: Path) -> None:
    """What a writing command says it wrote is what inspect says the output is."""
    for out, fmt, *more in (
        ("o.pth", "torch-zip"),
        ("o.safetensors", "safetensors"),
        ("shards/", "sharded", "--max-shard-size", "300B"),
        ("one/", "safetensors"),  # one shard: the folder holds model.safetensors, no index (the hub's way)
    ):
        _, written = _run(["convert", str(DDP), f"{tmp_path}/{out}", *more], tmp_path)
        _, inspected = _run(["inspect", f"{tmp_path}/{out}"], tmp_path)
        assert written["output_format"] == inspected["format"] == fmt
        assert written["input_format"] == "torch-zip" and written["input_bytes"] == DDP.stat().st_size
