"""The console script's ``inspect`` leaves the tree it read to the operating system: never
freed, not even while the interpreter shuts down (``keep_until_exit``: ~75 ms of 0.5 s at
200 000 tensors). Only a fresh process can tell what its shutdown freed."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT, invoke_cli

FIXTURE = str(ROOT / "fixtures" / "dataparallel_tinynet.pth")

#: runs ``main`` as the console script does (no argv) or as a caller does (argv), with a sentinel
#: kept beside the tree, which says on stderr when it is freed (its ``write`` bound early: at
#: shutdown this module's globals may be gone)
PROBE = """
import os, sys
import ckptfix.analysis.inspect as inspect_module

class Sentinel:
    def __init__(self, name):
        self.name = name
    def __del__(self):
        os.write(2, f"freed {self.name}\\n".encode())

keep = inspect_module.keep_until_exit
inspect_module.keep_until_exit = lambda tree: keep([tree, Sentinel("tree")])
from ckptfix.cli import main
if sys.argv[1] == "script":
    sys.argv = ["ckptfix", "inspect", sys.argv[2]]
    main()
main(["inspect", sys.argv[2]])
"""


def _run(how: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", PROBE, how, FIXTURE], capture_output=True, text=True, cwd=ROOT, timeout=60
    )


def test_the_console_script_leaves_the_tree_to_the_os() -> None:
    script, called = _run("script"), _run("argv")
    assert script.returncode == called.returncode == 0, (script.stderr, called.stderr)
    assert script.stdout == called.stdout == invoke_cli("inspect", FIXTURE).stdout
    assert "freed tree" not in script.stderr  # not by the run, nor by the interpreter's shutdown
    assert "freed tree" in called.stderr  # a caller's main(argv): freed as usual
