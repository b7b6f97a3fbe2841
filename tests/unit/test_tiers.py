"""The tier rule (tests/conftest.py), from the unit tier: no CLI, no process."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import TierError, current_tier, invoke_cli, run_cli, run_cli_batch


def test_this_is_the_unit_tier() -> None:
    assert current_tier() == "unit"


def test_unit_tests_cannot_run_the_cli() -> None:
    with pytest.raises(TierError, match=r"tests/cli/ or tests/e2e/ only, not tests/unit/test_tiers\.py"):
        invoke_cli("--version")


def test_unit_tests_cannot_spawn_a_process() -> None:
    with pytest.raises(TierError, match="tests/e2e/"):
        run_cli("--version")
    with pytest.raises(TierError, match="tests/e2e/"):
        run_cli_batch([["--version"]])
    with pytest.raises(TierError, match="spawning a process"):
        subprocess.run([sys.executable, "-c", "pass"], check=True)
