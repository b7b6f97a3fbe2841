"""``ckptfix --help`` stays light: it loads neither the native library nor ``ctypes`` (docs/engine.md;
issue 26's start-up target). Only a fresh process can tell what was imported."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT

PROBE = """
import contextlib, io, json, sys
from ckptfix.cli import main
with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
    main(sys.argv[1:])
maps = open("/proc/self/maps").read() if sys.platform.startswith("linux") else ""
print(json.dumps({
    "modules": sorted(m for m in ("ctypes", "ckptfix.native", "numpy", "torch") if m in sys.modules),
    "library_mapped": "ckptfix_native" in maps,
}))
"""


def _imports(*args: str) -> dict[str, object]:
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    result: dict[str, object] = json.loads(proc.stdout)
    return result


def test_help_loads_neither_the_native_library_nor_ctypes() -> None:
    assert _imports("--help") == {"modules": [], "library_mapped": False}
    # the probe can see a load: --version names the engine, so it loads the library (when built)
    version = _imports("--version")
    assert "ckptfix.native" in version["modules"]  # type: ignore[operator]
