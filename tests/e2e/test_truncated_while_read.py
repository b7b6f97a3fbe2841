"""An input that shrinks while ckptfix reads its tensor data (another process truncates it):
exit 3 with one line, no output and no temporary file left -- never SIGBUS, which is what a
strided gather over a memory map got (ckptfix now reads tensor data with ``pread`` only; see
``ckptfix/model/data.py``).

Deterministic, not a race: ckptfix runs in a child process whose runner pauses it at the start
of its data phase (after every header and pickle was read and checked: at a chosen call into
``ckptfix.fileio.ranges``) and waits; the test has another child
process truncate the file, then lets ckptfix go on. Nothing in ckptfix is changed by the runner:
it only waits there."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, no_temp_files

RUNNER = """
import os, sys, time
from ckptfix.fileio import ranges
from ckptfix.cli import main

ready, go, where = sys.argv[1], sys.argv[2], sys.argv[3]
name, nth = where.split(":")
original = getattr(ranges, name.split(".")[0]).__dict__[name.split(".")[1]]
calls = [0]

def paused(*args, **kwargs):
    calls[0] += 1
    if calls[0] == int(nth):
        open(ready, "w").close()
        deadline = time.monotonic() + 60
        while not os.path.exists(go) and time.monotonic() < deadline:
            time.sleep(0.005)
    return original(*args, **kwargs)

setattr(getattr(ranges, name.split(".")[0]), name.split(".")[1], paused)
sys.argv = ["ckptfix", *sys.argv[4:]]
main()
"""


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two transposed matrices (gathered, not copied), 256 KiB each."""
    path = tmp_path_factory.mktemp("src") / "in.pth"
    torch.save({"a": torch.arange(256.0 * 256).reshape(256, 256).t(), "b": torch.ones(256, 256).t()}, path)
    return path


def run_truncated(source: Path, folder: Path, size: int, where: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``ckptfix ARGS`` in a child paused at the ``where`` call (``Class.method:n``, the n-th
    call); meanwhile another child truncates the input to ``size`` bytes."""
    victim = folder / "in.pth"
    victim.write_bytes(source.read_bytes())
    ready, go = folder / "ready", folder / "go"
    argv = [a.replace("{in}", str(victim)).replace("{dir}", str(folder)) for a in args]
    proc = subprocess.Popen(
        [sys.executable, "-c", RUNNER, str(ready), str(go), where, *argv],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "ckptfix never reached its data phase"
        time.sleep(0.005)
    subprocess.run(["truncate", "-s", str(size), str(victim)], check=True)  # another process shrinks it
    go.touch()
    out, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


CASES = {
    # after the header and the first matrix were written, before the second is gathered: a map
    # made for the first one would now SIGBUS
    "safetensors": ("OutputStream.write:2", 0.5, ("convert", "{in}", "{dir}/out.safetensors")),
    "diff": ("OpenFiles.__enter__:1", 0.0, ("diff", "{in}", "{in}")),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_file_truncated_while_its_data_is_read(case: str, source: Path, tmp_path: Path) -> None:
    where, fraction, command = CASES[case]
    size = int(source.stat().st_size * fraction)
    result = run_truncated(source, tmp_path, size, where, *command)
    assert result.returncode == 3, (result.returncode, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptfix: error: "), result.stderr[-2000:]
    assert "truncated" in lines[0], lines[0]
    assert not any(p.name.startswith("out.") for p in tmp_path.iterdir())
    assert no_temp_files(tmp_path)
    assert os.path.getsize(tmp_path / "in.pth") == size


LEGACY_RUNNER = """
import subprocess, sys
from ckptfix.formats import legacy_pickle
from ckptfix.cli import main

victim, nth = sys.argv[1], int(sys.argv[2])
original, calls = legacy_pickle.restricted_load, [0]

def shrinking(*args, **kwargs):
    calls[0] += 1
    if calls[0] == nth:  # another process cuts the file to its pickles' 16 KiB between two of them
        subprocess.run(["truncate", "-s", "16K", victim], check=True)
    return original(*args, **kwargs)

legacy_pickle.restricted_load = shrinking
sys.argv = ["ckptfix", *sys.argv[3:]]
main()
"""


def test_a_legacy_file_truncated_while_its_pickles_are_read(source: Path, tmp_path: Path) -> None:
    """The legacy format's storage counts lie after its pickles: read from a memory map of the
    whole file, a file shrunk meanwhile SIGBUSed there (a page wholly past the new end). Cut
    before the tree pickle (the 4th of five), the counts are past the new end: exit 3 with one
    line, nothing written."""
    victim = tmp_path / "in.pth"
    torch.save(torch.load(source, weights_only=True), victim, _use_new_zipfile_serialization=False)
    out = tmp_path / "out.safetensors"
    result = subprocess.run(
        [sys.executable, "-c", LEGACY_RUNNER, str(victim), "4", "convert", str(victim), str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 3, (result.returncode, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "truncated" in lines[0], result.stderr[-2000:]
    assert not out.exists() and no_temp_files(tmp_path)
