"""The command line around hostile names, folders and files: --allow-global patterns, where
`fit --model` imports from, what --in-place keeps, and what reaches the terminal."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from conftest import FIT_MODULE, FIXTURES, ROOT, CliResult, invoke_cli, no_temp_files

import ckptfix
from ckptfix.cli import cli
from ckptfix.errors import UsageError
from ckptfix.transforms.fit import reference_from_model

DP = FIXTURES / "dataparallel_tinynet.pth"


def _ckptfix(*args: Any, cwd: Path, umask: int | None = None) -> CliResult:
    """``python -m ckptfix ARGS`` run from ``cwd``, in-process: the current folder is first on
    ``sys.path``, where ``python -m`` puts it (the real ``python -m`` and console script:
    tests/e2e/test_entry_points.py); optionally under a given umask."""
    return invoke_cli(*args, cwd=cwd, umask=umask, sys_path_0=cwd)


# --- 1. --allow-global patterns and global names -------------------------------------------


@pytest.mark.parametrize(
    "command",
    [
        ["strip-module", DP, "OUT"],
        ["convert", DP, "OUT"],
        ["inspect", DP],
        ["publish", DP, "OUTDIR"],
    ],
)
@pytest.mark.parametrize("pattern", ["os.system\nGLOBAL", "numpy. *", "a..b", "os.", ".os"])
def test_bad_allow_global_is_a_one_line_usage_error(tmp_path: Path, command: list, pattern: str) -> None:
    args = [tmp_path / "out.pth" if a == "OUT" else tmp_path if a == "OUTDIR" else a for a in command]
    result = invoke_cli(*args, "--allow-global", "argparse.Namespace", "--allow-global", pattern)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and repr(pattern) in result.stderr, result.stderr
    assert result.stdout == "" and list(tmp_path.iterdir()) == []


def test_nul_in_allow_global_is_refused_while_parsing(tmp_path: Path) -> None:
    # NUL cannot travel through argv, but can through the API and click's own parsing
    result = CliRunner().invoke(cli, ["inspect", str(DP), "--allow-global", "os\x00system"])
    assert isinstance(result.exception, UsageError) and "'os\\x00system'" in str(result.exception)
    with pytest.raises(UsageError, match="allow-global"):
        ckptfix.convert(DP, tmp_path / "out.pth", ckptfix.ConvertOptions(allow_globals=["os.system\n"]))
    with pytest.raises(UsageError, match="allow-global"):
        ckptfix.inspect_checkpoint(DP, allow_globals=["a b"])
    assert list(tmp_path.iterdir()) == []


def test_valid_allow_global_patterns_still_work(tmp_path: Path) -> None:
    result = invoke_cli(
        "inspect",
        DP,
        "--allow-global",
        "numpy.*",
        "--allow-global",
        "argparse.Namespace",
        "--allow-global",
        "pathlib.[PW]*Path",
    )
    assert result.returncode == 0, result.stderr


# --- 2. fit --model: imports never come from the current folder -------------------------------


def test_model_path_finds_a_module_in_a_named_folder(fit_setup: dict[str, Path]) -> None:
    root, work = fit_setup["root"], fit_setup["work"]
    args = ["fit", fit_setup["ckpt"], root / "out.pth", "--model", "ckptfix_localtest_models:build"]
    missing = _ckptfix(*args, cwd=work)
    assert missing.returncode == 2 and "--model-path" in missing.stderr, missing.stderr
    found = _ckptfix(*args, "--model-path", "../models", cwd=work)  # relative to the current folder
    assert found.returncode == 0, found.stderr
    assert sorted(torch.load(root / "out.pth", weights_only=True)) == ["bias", "weight"]


def test_model_path_dot_is_an_explicit_opt_in_to_the_current_folder(fit_setup: dict[str, Path]) -> None:
    root, work = fit_setup["root"], fit_setup["work"]
    (work / "ckptfix_heretest_models.py").write_text(FIT_MODULE)
    args = ["fit", fit_setup["ckpt"], root / "out.pth", "--model", "ckptfix_heretest_models:build", "--force"]
    assert _ckptfix(*args, cwd=work).returncode == 2
    assert _ckptfix(*args, "--model-path", ".", cwd=work).returncode == 0


def test_model_path_needs_model_and_a_folder(fit_setup: dict[str, Path]) -> None:
    root, work = fit_setup["root"], fit_setup["work"]
    alone = _ckptfix(
        "fit",
        fit_setup["ckpt"],
        root / "o.pth",
        "--reference",
        fit_setup["ckpt"],
        "--model-path",
        "../models",
        cwd=work,
    )
    assert alone.returncode == 2 and "--model-path goes with --model" in alone.stderr
    with pytest.raises(UsageError, match="no such folder"):
        reference_from_model("ckptfix_localtest_models:build", [root / "nowhere"])


def test_reference_from_model_restores_sys_path(fit_setup: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(fit_setup["work"])
    monkeypatch.setattr(sys, "path", ["", str(fit_setup["work"]), *sys.path])
    before = list(sys.path)
    try:
        shapes = reference_from_model("ckptfix_localtest_models:build", [fit_setup["models"]])
        assert shapes == {"weight": (2, 3), "bias": (2,)}
        assert sys.path == before
        with pytest.raises(UsageError, match="cannot import"):
            reference_from_model("ckptfix_shadowtest_models:build")  # only in the current folder
        assert sys.path == before and not (fit_setup["root"] / "shadow-models").exists()
    finally:
        sys.modules.pop("ckptfix_localtest_models", None)
        sys.modules.pop("ckptfix_shadowtest_models", None)


# --- 3. --in-place keeps the file's mode, owner and symlinks -----------------------------------


def _keys(path: Path) -> list[str]:
    return sorted(torch.load(path, weights_only=True))


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o755])
def test_in_place_keeps_the_mode(tmp_path: Path, mode: int) -> None:
    src = tmp_path / "model.pth"
    src.write_bytes(DP.read_bytes())
    src.chmod(mode)
    result = _ckptfix("strip-module", src, "--in-place", cwd=tmp_path, umask=0o022)
    assert result.returncode == 0, result.stderr
    assert stat.S_IMODE(src.stat().st_mode) == mode
    assert not any(k.startswith("module.") for k in _keys(src))


def test_in_place_through_the_api_keeps_the_mode(tmp_path: Path) -> None:
    src = tmp_path / "model.pth"
    src.write_bytes(DP.read_bytes())
    src.chmod(0o600)
    report = ckptfix.fix_prefix(src, in_place=True)
    assert report.written and stat.S_IMODE(src.stat().st_mode) == 0o600


def test_new_outputs_still_follow_the_umask(tmp_path: Path) -> None:
    src = tmp_path / "model.pth"
    src.write_bytes(DP.read_bytes())
    src.chmod(0o600)  # the input's mode is no business of a new output
    result = _ckptfix("strip-module", src, tmp_path / "out.pth", cwd=tmp_path, umask=0o022)
    assert result.returncode == 0 and stat.S_IMODE((tmp_path / "out.pth").stat().st_mode) == 0o644


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="only root can give files away")
def test_in_place_as_root_keeps_owner_and_group(tmp_path: Path) -> None:
    src = tmp_path / "model.pth"
    src.write_bytes(DP.read_bytes())
    os.chown(src, 65534, 65533)
    src.chmod(0o640)
    result = _ckptfix("strip-module", src, "--in-place", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    info = src.stat()
    assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (65534, 65533, 0o640)


def _linked(tmp_path: Path) -> tuple[Path, Path]:
    real = tmp_path / "store" / "model-v1.pth"
    real.parent.mkdir()
    real.write_bytes(DP.read_bytes())
    real.chmod(0o600)
    (tmp_path / "links").mkdir()
    link = tmp_path / "links" / "model.pth"
    link.symlink_to(Path("..") / "store" / "model-v1.pth")  # relative, as `ln -s` users write them
    return link, real


def test_in_place_writes_through_a_symlink(tmp_path: Path) -> None:
    link, real = _linked(tmp_path)
    result = _ckptfix("strip-module", link, "--in-place", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert link.is_symlink() and os.readlink(link) == str(Path("..") / "store" / "model-v1.pth")
    assert _keys(real) == _keys(link) and not any(k.startswith("module.") for k in _keys(real))
    assert stat.S_IMODE(real.stat().st_mode) == 0o600
    assert no_temp_files(link.parent) and no_temp_files(real.parent)


def test_backup_through_a_symlink_keeps_the_old_contents(tmp_path: Path) -> None:
    link, real = _linked(tmp_path)
    original = real.read_bytes()
    result = _ckptfix("strip-module", link, "--in-place", "--backup", ".orig", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    backup = link.parent / "model.pth.orig"
    assert backup.is_file() and not backup.is_symlink()
    assert backup.read_bytes() == original
    assert link.is_symlink() and real.read_bytes() != original
    assert all(k.startswith("module.") for k in _keys(backup))


# --- 4. names from files reach the terminal escaped, and --json exactly -------------------------

RED, NEWLINE, CR, OSC = "\x1b[31mred", "a\nb", "\r", "t\x1b]0;pwned\x07"
RAW = ["\x1b", "\r", "\x07", "a\nb"]


def _assert_escaped(text: str, *shown: str) -> None:
    """No raw control character inside a name; the escaped forms are there instead."""
    for raw in RAW:
        assert raw not in text, f"{raw!r} reached the terminal raw:\n{text}"
    for escaped in shown:
        assert escaped in text, f"{escaped!r} not in:\n{text}"


@pytest.fixture
def hostile(tmp_path: Path) -> dict[str, Path]:
    sd = {f"module.{k}": torch.full((2,), float(i)) for i, k in enumerate([RED, NEWLINE, CR, OSC])}
    torch.save({"state_dict": sd, f"note{RED}\n{CR}": 3}, tmp_path / "hostile.pth")
    bare = {k: torch.full((2,), float(i)) for i, k in enumerate([RED, NEWLINE, CR, OSC])}
    torch.save(bare, tmp_path / "bare.pth")
    torch.save({"x" + RED: torch.ones(2), NEWLINE: torch.ones(3)}, tmp_path / "other.pth")
    return {"hostile": tmp_path / "hostile.pth", "bare": tmp_path / "bare.pth", "other": tmp_path / "other.pth"}


def test_inspect_escapes_names_and_json_keeps_them(hostile: dict[str, Path]) -> None:
    human = invoke_cli("inspect", hostile["hostile"])
    assert human.returncode == 0, human.stderr
    _assert_escaped(human.stdout, "note\\x1b[31mred\\n\\r")
    report = json.loads(invoke_cli("inspect", hostile["hostile"], "--json").stdout)
    assert f"note{RED}\n{CR}" in [entry["path"] for entry in report["tree"]]


def test_dry_run_listing_escapes_keys_and_json_keeps_them(hostile: dict[str, Path], tmp_path: Path) -> None:
    args = ["strip-module", hostile["hostile"], tmp_path / "out.pth", "--dry-run"]
    human = invoke_cli(*args)
    assert human.returncode == 0, human.stderr
    _assert_escaped(
        human.stdout,
        "module.\\x1b[31mred -> \\x1b[31mred",
        "module.a\\nb -> a\\nb",
        "module.\\r -> \\r",
        "module.t\\x1b]0;pwned\\x07 -> t\\x1b]0;pwned\\x07",
    )
    assert len(human.stdout.splitlines()) == 5  # four renames and the summary, one line each
    renames = json.loads(invoke_cli(*args, "--json").stdout)["state_dicts"][0]["renames"]
    assert sorted(map(tuple, renames)) == sorted((f"module.{k}", k) for k in [RED, NEWLINE, CR, OSC])


def test_written_file_round_trips_the_exact_keys(hostile: dict[str, Path], tmp_path: Path) -> None:
    result = invoke_cli("strip-module", hostile["hostile"], tmp_path / "out.pth")
    assert result.returncode == 0, result.stderr
    _assert_escaped(result.stdout)
    assert sorted(torch.load(tmp_path / "out.pth", weights_only=True)["state_dict"]) == sorted([RED, NEWLINE, CR, OSC])


def test_diff_escapes_keys_and_json_keeps_them(hostile: dict[str, Path]) -> None:
    human = invoke_cli("diff", hostile["bare"], hostile["other"])
    assert human.returncode == 1, human.stderr
    _assert_escaped(human.stdout, "x\\x1b[31mred", "a\\nb:", "\\r")
    report = json.loads(invoke_cli("diff", hostile["bare"], hostile["other"], "--json").stdout)
    assert set(report["only_in_a"]) == {RED, CR, OSC} and report["only_in_b"] == ["x" + RED]
    assert report["mismatched"][0]["path"] == NEWLINE


def test_fit_report_escapes_keys_and_json_keeps_them(hostile: dict[str, Path], tmp_path: Path) -> None:
    args = ["fit", hostile["other"], tmp_path / "out.pth", "--reference", hostile["bare"]]
    human = invoke_cli(*args)
    assert human.returncode == 1
    _assert_escaped(human.stdout, "unexpected (1): x\\x1b[31mred", "shape mismatch: a\\nb:")
    plan = json.loads(invoke_cli(*args, "--json").stdout)["plan"]
    assert plan["unexpected"] == ["x" + RED] and set(plan["missing"]) == {RED, CR, OSC}
    assert plan["shape_mismatches"][0]["key"] == NEWLINE


def test_batch_verify_and_scan_escape_file_names(hostile: dict[str, Path], tmp_path: Path) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    evil = folder / f"ev{RED}\nil{CR}.pth"
    evil.write_bytes(hostile["hostile"].read_bytes())
    batch = invoke_cli("strip-module", folder, "-o", tmp_path / "out", "-j", "1")
    assert batch.returncode == 0, batch.stderr
    _assert_escaped(batch.stderr, "ev\\x1b[31mred\\nil\\r.pth: wrote")
    report = json.loads(invoke_cli("strip-module", folder, "-o", tmp_path / "out2", "--json").stdout)
    assert report["files"][0]["input"] == str(evil)
    for command in ("verify", "scan"):
        result = invoke_cli(command, evil)
        assert result.returncode == 0, result.stderr
        _assert_escaped(result.stdout + result.stderr, "ev\\x1b[31mred\\nil\\r.pth")
    scanned = json.loads(invoke_cli("scan", evil, "--json").stdout)
    assert scanned["files"][0]["input"] == str(evil)


def test_help_documents_the_new_options() -> None:
    fit = " ".join(invoke_cli("fit", "--help").stdout.split())  # unwrap click's lines
    assert "--model-path" in fit and "never from the current folder" in fit
    assert "dotted Python name" in " ".join(invoke_cli("convert", "--help").stdout.split())
    docs = (ROOT / "docs" / "commands.md").read_text()  # the reference moved out of the README
    assert "--model-path" in docs and "dotted Python name" in docs
