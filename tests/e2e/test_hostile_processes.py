"""Hostile inputs that need a process of their own: nesting that CPython would hash or repr
recursively in C (a crash there would take pytest down with it), bombs whose time and peak RSS
are measured, inputs run under an address-space limit, and a payload put to the real CLI.

Built with tests/hostile.py, as in tests/cli/test_hostile_core.py (which runs the rest
in-process). Each group runs in one fresh process (``run_cli_batch``): a command that kills it is
reported as killed (negative returncode) and the commands after it go on in a new process.
"""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import CliResult, run_cli_batch, run_cli_batches
from hostile import (
    CRASHY,
    DEEP,
    DEPTH_REFUSED,
    NAMESPACE,
    POSIX_STATE,
    PROTO,
    allow_args,
    assert_no_signal,
    assert_refused,
    assert_verify_fails,
    ckpt,
    g,
    id_reuse_key,
    tensor,
    u,
    with_data_pkl,
)

# =========================================================================== the real CLI


def test_laundering_through_the_real_cli_runs_nothing(base_zip: Path, tmp_path: Path) -> None:
    """In a fresh interpreter: a GLOBAL marker BUILT into os.system, then called with a touch
    payload. Refused at the BUILD, nothing executed, nothing written."""
    marker = tmp_path / "PWNED"
    call = g("torch", "FloatStorage") + POSIX_STATE + b"b" + u(f"touch {marker}") + b"\x85R"
    src = with_data_pkl(base_zip, ckpt(call), tmp_path / "hostile.pth")
    out, out_st = tmp_path / "out.pth", tmp_path / "o.safetensors"
    strip, convert = run_cli_batch([("strip-module", src, out), ("convert", src, out_st, "--select", "sd")])
    assert_refused(strip, "BUILD on a Global", out=out)
    assert_refused(convert, "BUILD on a Global", out=out_st)
    assert not marker.exists()


# =========================================================================== address-space limits


def test_expanding_a_stride_0_view_into_safetensors_is_bounded(base_zip: Path, tmp_path: Path) -> None:
    src = with_data_pkl(base_zip, ckpt(weight=tensor(size=(2**34,), stride=(0,))), tmp_path / "h.pth")
    out = tmp_path / "o.safetensors"
    [result] = run_cli_batch([("convert", src, out, "--select", "sd")], limit_as=2 << 30)
    assert_refused(result, out=out)


def test_deflated_pickle_bomb_is_bounded_by_the_file(base_zip: Path, tmp_path: Path) -> None:
    payload = PROTO + b"]" * (15 << 20) + b"."
    src = with_data_pkl(base_zip, payload, tmp_path / "bomb.pth", compress=zipfile.ZIP_DEFLATED)
    assert src.stat().st_size < 64 << 10
    [result] = run_cli_batch([("inspect", src)], limit_as=512 << 20)
    assert_refused(result)


# =========================================================================== depth


def _deep_json(folder: Path, where: str) -> Path:
    deep = "[" * 100_000 + "]" * 100_000
    if where == "safetensors header":
        header = ('{"x": ' + deep + ', "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}').encode()
        src = folder / "deep.safetensors"
        src.write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))
        return src
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(1)}, folder / "m-1.safetensors")
    src = folder / "model.safetensors.index.json"
    src.write_text('{"metadata": {"x": ' + deep + '}, "weight_map": {"w": "m-1.safetensors"}}')
    return src


@pytest.fixture(scope="module")
def deep_cases(base_zip: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[Any, tuple[Path, list[list[Any]]]]:
    """Every deep input below, each in its own folder: key -> (the folder, its command lines)."""
    cases: dict[Any, tuple[Path, list[list[Any]]]] = {}
    for name in sorted(CRASHY):
        folder = tmp_path_factory.mktemp("nesting")
        src = with_data_pkl(base_zip, DEPTH_REFUSED[name], folder / "deep.pth")
        allow = allow_args(NAMESPACE) if "allowed" in name else []
        commands = [["inspect", src, *allow], ["strip-module", src, folder / "o.pth", *allow], ["scan", src]]
        cases["nesting", name] = folder, commands
    for name in ("builtins.frozenset", "builtins.set"):
        folder = tmp_path_factory.mktemp("set")
        module, func = name.split(".")
        deep = u("x") + b"\x85" * DEEP
        src = with_data_pkl(base_zip, ckpt(g(module, func) + deep + b"\x85\x85R"), folder / "deep.pth")
        cases["set", name] = folder, [["inspect", src]]
    folder = tmp_path_factory.mktemp("id-reuse")
    src = with_data_pkl(base_zip, id_reuse_key(DEEP), folder / "deep.pth")
    cases["id-reuse"] = folder, [["inspect", src], ["scan", src]]
    for depth in (600, 999):
        folder = tmp_path_factory.mktemp("lists")
        src = with_data_pkl(base_zip, ckpt(b"]" * depth + b"a" * (depth - 1)), folder / "deep.pth")
        cases["lists", depth] = folder, [["inspect", src], ["inspect", "--json", src]]
    for where in ("safetensors header", "shard index"):
        folder = tmp_path_factory.mktemp("json")
        src = _deep_json(folder, where)
        cases["json", where] = folder, [["inspect", src], ["verify", src]]
    return cases


@pytest.fixture(scope="module")
def process_runs(
    deep_cases: dict[Any, tuple[Path, list[list[Any]]]], bomb_sources: list[Path]
) -> dict[str, list[CliResult]]:
    """The deep inputs' commands in one process, the bombs in another, the two side by side."""
    deep = [command for _, commands in deep_cases.values() for command in commands]
    return run_cli_batches({"deep": deep, "bombs": [("inspect", src) for src in bomb_sources]})


@pytest.fixture(scope="module")
def deep_runs(
    deep_cases: dict[Any, tuple[Path, list[list[Any]]]], process_runs: dict[str, list[CliResult]]
) -> dict[Any, tuple[Path, list[CliResult]]]:
    """Key -> (the folder, the results of its commands in order)."""
    results = iter(process_runs["deep"])
    return {key: (folder, [next(results) for _ in commands]) for key, (folder, commands) in deep_cases.items()}


#: inputs CPython hashes (dict keys, set elements) or so deep that any recursion left in C would
#: overflow the C stack (the others: tests/cli/test_hostile_core.py)
@pytest.mark.parametrize("name", sorted(CRASHY))
def test_nesting_beyond_the_limit_is_refused_without_a_crash(deep_runs: dict, name: str) -> None:
    folder, results = deep_runs["nesting", name]
    for result in results:
        assert_no_signal(result)
        if result.args[0] == "scan":  # deep but nothing dangerous -- or too big to read to the end,
            # which is never called clean (CPython reads on: a frozenset chain caches its hashes)
            assert result.returncode in (0, 3) or "<not read to the end" in result.stdout, result.stdout
            continue
        assert_refused(result, "deep", out=folder / "o.pth")


@pytest.mark.parametrize("name", ["builtins.frozenset", "builtins.set"])
def test_set_builders_check_element_depth(deep_runs: dict, name: str) -> None:
    _, [result] = deep_runs["set", name]
    assert_no_signal(result)
    assert_refused(result, "deep")


def test_key_depth_cache_cannot_be_fooled_by_address_reuse(deep_runs: dict) -> None:
    """A deep key whose last tuple reuses the address of a small key checked just before
    (tests/hostile.py: id_reuse_key); the small version runs in-process in tests/cli/."""
    _, results = deep_runs["id-reuse"]
    for result in results:
        assert_no_signal(result)
        if result.args[0] == "scan":  # scan reads on as CPython does: the key is kept unhashed
            assert result.returncode in (0, 3), result.stdout
            continue
        assert result.returncode == 3 and "deep" in result.stdout + result.stderr, result.args


@pytest.mark.parametrize("depth", [600, 999])
def test_lists_within_the_limit_are_inspected(deep_runs: dict, depth: int) -> None:
    """inspect's report of a list nested as deep as the reader accepts (the other commands on the
    same input: tests/cli/test_hostile_core.py::test_lists_within_the_limit_work_everywhere)."""
    _, results = deep_runs["lists", depth]
    for result in results:
        assert result.returncode == 0, (result.args, result.stderr[-500:])
    assert "x" in result.stdout


@pytest.mark.parametrize("where", ["safetensors header", "shard index"])
def test_deeply_nested_json_is_refused(deep_runs: dict, where: str) -> None:
    _, (inspect, verify) = deep_runs["json", where]
    assert_refused(inspect)
    assert_verify_fails(verify)


# =========================================================================== bombs

_Q = struct.Struct("<Q").pack
_I4 = struct.Struct("<I").pack

BOMBS = {  # a few bytes that declare gigabytes, or many cheap opcodes
    "BINBYTES8 of 2 GB": PROTO + b"\x8e" + _Q(2**31) + b"abc.",
    "BYTEARRAY8 of 2 GB": PROTO + b"\x96" + _Q(2**31) + b"abc.",
    "BINUNICODE8 of 2 GB": PROTO + b"\x8d" + _Q(2**31) + b"abc.",
    "BINUNICODE8 of 2**63": PROTO + b"\x8d" + _Q(2**63) + b"abc.",
    "BINBYTES of 4 GB": PROTO + b"B" + _I4(2**32 - 1) + b"abc.",
    "BINUNICODE of 4 GB": PROTO + b"X" + _I4(2**32 - 1) + b"abc.",
    "BINSTRING of 2 GB": PROTO + b"T" + struct.pack("<i", 2**31 - 1) + b"abc.",
    "FRAME of 2**63": b"\x80\x04\x95" + _Q(2**63) + b"N.",
    "LONG4 of 100 MB": PROTO + b"\x8b" + struct.pack("<i", 100 << 20) + b"\x01" * 64 + b".",
    "INT with 100 000 digits": PROTO + b"I" + b"7" * 100_000 + b"\n.",
    "LONG with 100 000 digits": PROTO + b"L" + b"7" * 100_000 + b"L\n.",
    "INT with 5 000 digits": PROTO + b"I" + b"7" * 5_000 + b"\n.",
    "10 million EMPTY_DICT": PROTO + b"](" + b"}" * 10_000_000 + b"e.",  # a valid list of them
    "memo index 700 000 000": PROTO + b"}r" + _I4(700_000_000) + b"j" + _I4(699_999_999) + b".",
    # proportional to its size: may be read (exit 0) or refused, but bounded like the rest
    "a million sparse memo entries": PROTO + b"N" + b"".join(b"r" + _I4(7 * i + 3) for i in range(1_000_000)) + b".",
    "2 million DUPs": PROTO + b"N" + b"2" * 2_000_000 + b".",
}


@pytest.fixture(scope="module")
def bomb_sources(base_zip: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    folder = tmp_path_factory.mktemp("bombs")
    return [with_data_pkl(base_zip, data, folder / f"bomb{i}.pth") for i, data in enumerate(BOMBS.values())]


@pytest.fixture(scope="module")
def bomb_runs(process_runs: dict[str, list[CliResult]]) -> dict[str, CliResult]:
    """``inspect`` of every bomb, one process for all: each result carries its own seconds and the
    process's peak RSS after it (a peak only grows: the first bomb over the limit is the culprit)."""
    return dict(zip(BOMBS, process_runs["bombs"]))


@pytest.mark.parametrize("name", list(BOMBS))
def test_bomb_is_refused_with_bounded_cpu_and_memory(bomb_runs: dict[str, CliResult], name: str) -> None:
    result = bomb_runs[name]
    if name in ("a million sparse memo entries", "2 million DUPs") and result.returncode == 0:
        assert not result.stderr  # bounded by its size; STOP over extra items is what CPython reads
    else:
        assert_refused(result)
    # the work, not the wall clock (a loaded 2-core machine took 16 s of wall time for 10 million
    # EMPTY_DICTs): CPU time with a wide margin; a hang is the runner's timeout
    assert result.cpu_seconds < 10, result.cpu_seconds
    assert result.maxrss_mib is not None and result.maxrss_mib < 1024, f"peak RSS {result.maxrss_mib} MiB"
