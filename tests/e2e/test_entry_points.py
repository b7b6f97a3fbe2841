"""What only a real process shows: the console script and ``python -m ckptfix``, the interpreter's
own ``sys.path`` for ``fit --model``, and that byte-moving commands never import torch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, CliResult, invoke_cli, make_fit_setup, run_cli, run_cli_batch

DP = FIXTURES / "dataparallel_tinynet.pth"
LEGACY = FIXTURES / "legacy_dataparallel_tinynet.pth"


def test_console_script_and_module_entry_point(tmp_path: Path) -> None:
    script = run_cli("strip-module", DP, tmp_path / "a.pth", script=True)
    assert script.returncode == 0, script.stderr
    module = run_cli("strip-module", DP, tmp_path / "b.pth")
    assert module.returncode == 0, module.stderr
    assert (tmp_path / "a.pth").read_bytes() == (tmp_path / "b.pth").read_bytes()
    # the in-process runs of tests/cli/ see what these processes saw
    in_process = invoke_cli("strip-module", DP, tmp_path / "c.pth")
    assert (tmp_path / "c.pth").read_bytes() == (tmp_path / "a.pth").read_bytes()
    outputs = {(r.returncode, r.stdout.replace(r.args[2], "OUT"), r.stderr) for r in (script, module, in_process)}
    assert len(outputs) == 1 and "wrote OUT" in next(iter(outputs))[1], outputs


#: what the in-process runner must reproduce exactly: exit code, stdout and stderr
SAME_AS_A_PROCESS = {
    "version": ["--version"],
    "help": ["strip-module", "--help"],
    "dry run": ["strip-module", DP, "out.pth", "--dry-run"],
    "json": ["inspect", DP, "--json"],
    "usage error": ["strip-module", "--no-such-option"],
    "bad input": ["inspect", FIXTURES / "models.py"],
    "check failed": ["verify", DP, "--expect-prefix", "none"],
    "nothing to strip, strict": ["strip-module", FIXTURES / "bare_tinynet.pth", "out.pth", "--strict"],
}


def test_in_process_runs_match_a_process() -> None:
    """The in-process helper of tests/cli/ against ``ckptfix.cli.main`` in a fresh interpreter."""
    processes = run_cli_batch(list(SAME_AS_A_PROCESS.values()))
    for (name, args), process in zip(SAME_AS_A_PROCESS.items(), processes):
        in_process = invoke_cli(*args)
        assert (in_process.returncode, in_process.stdout, in_process.stderr) == (
            process.returncode,
            process.stdout,
            process.stderr,
        ), name
    codes = {name: p.returncode for name, p in zip(SAME_AS_A_PROCESS, processes)}
    assert codes == {
        "version": 0,
        "help": 0,
        "dry run": 0,
        "json": 0,
        "usage error": 2,
        "bad input": 3,
        "check failed": 1,
        "nothing to strip, strict": 1,
    }


# --- fit --model: the interpreter's own sys.path ------------------------------------------------


@pytest.fixture(scope="module")
def shadow_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, tuple[dict[str, Path], CliResult]]:
    """``fit --model`` from a folder full of shadows, through ``python -m`` and through the console
    script (script=True), each in its own set of folders; the two processes side by side."""
    from concurrent.futures import ThreadPoolExecutor

    def run(script: bool) -> tuple[dict[str, Path], CliResult]:
        setup = make_fit_setup(tmp_path_factory.mktemp("console-script" if script else "python-m"))
        result = run_cli(
            "fit",
            setup["ckpt"],
            setup["root"] / "out.pth",
            "--model",
            "ckptfix_shadowtest_models:build",
            cwd=setup["work"],
            env={"PYTHONPATH": str(setup["site"])},
            script=script,
        )
        return setup, result

    with ThreadPoolExecutor(2) as pool:
        return dict(zip((False, True), pool.map(run, (False, True))))


@pytest.mark.parametrize("script", [False, True], ids=["python-m", "console-script"])
def test_fit_model_is_not_shadowed_by_files_in_the_current_folder(shadow_runs: dict, script: bool) -> None:
    """``python -m`` puts the current folder first on sys.path, the console script its own folder:
    neither may let a file in the current folder stand in for the model's module, or for a stdlib
    module it imports (colorsys: already imported in pytest, so only a fresh process can tell)."""
    setup, result = shadow_runs[script]
    root = setup["root"]
    assert result.returncode == 0, result.stdout + result.stderr
    assert not (root / "shadow-models").exists(), "the model module came from the current folder"
    assert not (root / "shadow-colorsys").exists(), "a stdlib module came from the current folder"
    assert sorted(torch.load(root / "out.pth", weights_only=True)) == ["bias", "weight"]


# --- torch is never imported by commands that only move bytes ------------------------------------

NO_TORCH: dict[str, list] = {
    "inspect": ["inspect", DP],
    "strip-module": ["strip-module", DP, "{tmp}/strip.pth"],
    "add-module": ["add-module", DP, "{tmp}/add.pth"],
    "help": ["--help"],
    "inspect legacy": ["inspect", LEGACY],
    "strip-module legacy": ["strip-module", LEGACY, "{tmp}/legacy.pth"],
    "scan": ["scan", DP, LEGACY],
    "verify": ["verify", DP, LEGACY],
    "diff": ["diff", DP, DP],
    "remap": ["remap", DP, "{tmp}/remap.pth", "--map-location", "cuda:1"],
    "convert pth to safetensors": ["convert", DP, "{tmp}/a.safetensors"],
    "convert safetensors to pth": ["convert", "{tmp}/a.safetensors", "{tmp}/b.pth"],
    "convert pth to shards": ["convert", "{tmp}/b.pth", "{tmp}/shards/", "--max-shard-size", "1KB"],
}


@pytest.fixture(scope="module")
def no_torch_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CliResult]:
    """Every command above in order, in as few fresh processes as possible: one that imports
    torch is the last its process runs, so each verdict is its own."""
    tmp = tmp_path_factory.mktemp("no-torch")
    commands = [[str(a).format(tmp=tmp) for a in args] for args in NO_TORCH.values()]
    return dict(zip(NO_TORCH, run_cli_batch(commands, isolate_torch=True)))


@pytest.mark.parametrize("case", list(NO_TORCH))
def test_torch_is_not_imported(no_torch_runs: dict[str, CliResult], case: str) -> None:
    result = no_torch_runs[case]
    assert result.returncode == 0, result.stderr
    assert result.torch_imported is False, f"{case} imported torch"
