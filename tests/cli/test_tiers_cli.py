"""The tier rule (tests/conftest.py), from the CLI tier: the CLI in-process, no process."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import TierError, current_tier, invoke_cli, run_cli, run_cli_batch

from ckptfix import __version__
from ckptfix.native import engine


def test_cli_tests_run_the_cli_in_process() -> None:
    assert current_tier() == "cli"
    result = invoke_cli("--version")
    assert (result.returncode, result.stdout, result.stderr) == (
        0,
        f"ckptfix, version {__version__} ({engine()} engine)\n",
        "",
    )


def test_cli_tests_cannot_spawn_a_process() -> None:
    with pytest.raises(TierError, match=r"tests/e2e/ only, not tests/cli/test_tiers_cli\.py"):
        run_cli("--version")
    with pytest.raises(TierError, match="tests/e2e/"):
        run_cli_batch([["--version"]])
    with pytest.raises(TierError, match="spawning a process"):
        subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_an_exception_escaping_main_is_not_swallowed(monkeypatch: pytest.MonkeyPatch) -> None:
    """What main() does not map to an exit code (a BaseException) reaches the test as itself."""

    class Escaped(BaseException):
        pass

    def explode(*args: object, **kwargs: object) -> None:
        raise Escaped

    monkeypatch.setattr("ckptfix.cli.cli.main", explode)
    with pytest.raises(Escaped):
        invoke_cli("--version")


def test_an_unexpected_error_is_exit_5_with_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug inside a command is what a user sees: exit 5 and the one-line internal error."""

    def explode(*args: object, **kwargs: object) -> None:
        raise ZeroDivisionError("boom")

    monkeypatch.setattr("ckptfix.analysis.inspect.inspect_checkpoint", explode)
    result = invoke_cli("inspect", "x.pth")
    assert result.returncode == 5, result
    assert result.stderr == "ckptfix: internal error (please report with --debug): ZeroDivisionError: boom\n"
