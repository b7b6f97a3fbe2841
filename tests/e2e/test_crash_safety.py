"""The destination is complete or untouched, whatever happens to the writing process."""

from __future__ import annotations

import random
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, invoke_cli, no_temp_files
from safetensors.torch import load_file

#: the write's temporary file, beside the destination (``.NAME.RANDOM.ckptfix-tmp``)
TEMP_GLOB = ".out.safetensors.*.ckptfix-tmp"
#: what makes the "new" output differ from the "old" one
NEW = ("--strip-prefix", "module.")


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path | bytes]:
    """A 64 MiB checkpoint, and the complete outputs of converting it to safetensors: as it is (the
    "old" file a killed run must leave intact) and with the prefix stripped (the "new" one the run
    would write). Neither imports torch, so a process starts writing within a fraction of a second."""
    folder = tmp_path_factory.mktemp("big")
    src = folder / "big.pth"
    torch.manual_seed(0)
    torch.save({f"module.layer{i}.weight": torch.randn(1 << 20) for i in range(16)}, src)
    assert invoke_cli("convert", src, folder / "old.safetensors").returncode == 0
    assert invoke_cli("convert", src, folder / "new.safetensors", *NEW).returncode == 0
    assert set(load_file(folder / "new.safetensors")) == {f"layer{i}.weight" for i in range(16)}
    return {
        "src": src,
        "old": (folder / "old.safetensors").read_bytes(),
        "new": (folder / "new.safetensors").read_bytes(),
    }


def _temp_bytes(folder: Path) -> int:
    """How much of the output its temporary file holds so far (0 while there is none)."""
    try:
        return sum(p.stat().st_size for p in folder.glob(TEMP_GLOB))
    except FileNotFoundError:  # renamed in between
        return 0


def _wait_for(condition, proc: subprocess.Popen, what: str, seconds: float = 30) -> float:
    """Poll (1 ms) until ``condition()`` or the process exits; the time it became true."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert proc.poll() is None or condition(), f"the process exited before {what}"
        assert time.monotonic() < deadline, f"no {what} after {seconds} s"
        time.sleep(0.001)
    return time.monotonic()


def test_sigkill_mid_write_leaves_old_or_new_complete_file(big: dict, tmp_path: Path) -> None:
    """SIGKILL (nothing can be cleaned up) at points spread over the write: right as the temporary
    file appears, at random points while it is written, and right after the rename. Each time the
    destination is the old or the new complete file; both outcomes occur."""
    out = tmp_path / "out.safetensors"
    command = [sys.executable, "-m", "ckptfix", "convert", big["src"], out, "--force", *NEW]
    rng = random.Random(7)
    outcomes: list[tuple[str, str, bool]] = []  # (when killed, what the destination was, temp left behind)
    write_seconds = None
    for when in ["after the rename", "as the temp file appears", *["during the write"] * 4]:
        out.unlink(missing_ok=True)  # a new file: rewriting one in place makes ext4 flush it to disk first
        out.write_bytes(big["old"])
        inode = out.stat().st_ino
        proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        started = _wait_for(lambda: any(tmp_path.glob(TEMP_GLOB)), proc, "temporary file")
        if when == "after the rename":  # os.replace gives the destination a new inode
            write_seconds = _wait_for(lambda inode=inode: out.stat().st_ino != inode, proc, "rename") - started
        elif when == "during the write":
            time.sleep(rng.uniform(0, write_seconds))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        content = out.read_bytes()
        assert content in (big["old"], big["new"]), f"killed {when}: destination is neither complete file"
        leftovers = list(tmp_path.glob(TEMP_GLOB))
        outcomes.append((when, "new" if content == big["new"] else "old", bool(leftovers)))
        for leftover in leftovers:  # SIGKILL cannot be caught: the temporary file stays
            leftover.unlink()
    assert outcomes[0][1] == "new", outcomes  # killed after the rename: the new file, complete
    assert outcomes[1][1:] == ("old", True), outcomes  # killed mid-write: the old file, untouched
    assert {outcome for _, outcome, _ in outcomes} == {"old", "new"}, outcomes


def test_sigterm_mid_write_cleans_up(big: dict, tmp_path: Path) -> None:
    """SIGTERM as soon as the output is being written: exit 130, no output, no temporary file.
    A run that finishes before the signal lands must be complete; up to three tries, and at least
    one must have been interrupted mid-write (else the test proved nothing)."""
    out = tmp_path / "out.safetensors"
    interrupted = 0
    for _ in range(3):
        proc = subprocess.Popen(
            [sys.executable, "-m", "ckptfix", "convert", big["src"], out, *NEW],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        # once bytes are being written (a signal in the instant the temporary file is created,
        # before atomic_output's cleanup is armed, leaves it behind: a known race, left alone here)
        _wait_for(lambda: _temp_bytes(tmp_path) > 0, proc, "bytes written")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate()
        if out.exists():  # the work finished before the signal landed
            assert out.read_bytes() == big["new"]
            out.unlink()
            continue
        assert proc.returncode == 130 and "interrupted" in err, (proc.returncode, err)
        assert no_temp_files(tmp_path)
        interrupted += 1
        break
    assert interrupted, "every run finished before SIGTERM landed: the cleanup path never ran"


def _limit_file_size() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def _rlimited(*args: object) -> subprocess.CompletedProcess:
    """``python -m ckptfix ARGS`` where no file may grow past 20 000 bytes: writes fail mid-file,
    as on a full disk (EFBIG instead of ENOSPC)."""
    return subprocess.run(
        [sys.executable, "-m", "ckptfix", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        preexec_fn=_limit_file_size,
    )


def test_write_failure_is_exit_4_with_no_output(tmp_path: Path) -> None:
    src = tmp_path / "m.pth"
    torch.save({"module.w": torch.randn(100_000)}, src)  # 400 kB: the output cannot fit in 20 000 bytes
    result = _rlimited("strip-module", src, tmp_path / "out.pth")
    assert result.returncode == 4, result.stderr
    assert "cannot write" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out.pth").exists() and no_temp_files(tmp_path)


def test_in_place_never_loses_the_input(tmp_path: Path) -> None:
    """--in-place whose write fails half-way: exit 4, the input byte for byte as it was."""
    src = tmp_path / "m.pth"
    torch.save({"module.w": torch.randn(100_000)}, src)  # 400 kB in and out: over the limit
    before = src.read_bytes()
    assert len(before) > 20_000
    result = _rlimited("strip-module", src, "--in-place", "--quiet")
    assert result.returncode == 4, result.stderr
    assert "cannot write" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert src.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["m.pth"]
