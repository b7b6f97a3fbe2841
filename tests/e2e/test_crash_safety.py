"""The destination is complete or untouched, whatever happens to the writing process."""

from __future__ import annotations

import random
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from conftest import FIXTURES, ROOT, no_temp_files, run_cli
from safetensors.torch import load_file


def _big_checkpoint(path: Path) -> None:
    torch.manual_seed(0)
    torch.save({f"module.layer{i}.weight": torch.randn(1 << 20) for i in range(24)}, path)  # 96 MiB


def test_sigkill_mid_write_leaves_old_or_new_complete_file(tmp_path: Path) -> None:
    src, out = tmp_path / "big.pth", tmp_path / "out.safetensors"
    _big_checkpoint(src)
    assert run_cli("convert", src, out).returncode == 0  # the previous, complete output (float32)
    old = out.read_bytes()
    assert run_cli("convert", src, tmp_path / "new.safetensors", "--dtype", "float16").returncode == 0
    new = (tmp_path / "new.safetensors").read_bytes()
    rng = random.Random(7)
    outcomes = set()
    for _ in range(6):
        proc = subprocess.Popen(
            [sys.executable, "-m", "ckptfix", "convert", str(src), str(out), "--force", "--dtype", "float16"],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(rng.uniform(0.3, 2.5))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        content = out.read_bytes()
        assert content in (old, new), "destination is neither the old nor the new complete file"
        outcomes.add("new" if content == new else "old")
        out.write_bytes(old)
        for leftover in tmp_path.glob(".*.ckptfix-tmp"):  # SIGKILL cannot be caught: temp may remain
            leftover.unlink()
    assert load_file(tmp_path / "new.safetensors")["module.layer0.weight"].dtype == torch.float16
    assert outcomes  # the kills landed before or after the rename; both are complete files


def test_sigterm_mid_write_cleans_up(tmp_path: Path) -> None:
    src, out = tmp_path / "big.pth", tmp_path / "out.safetensors"
    _big_checkpoint(src)
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckptfix", "convert", str(src), str(out), "--dtype", "float16"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 20
    while not list(tmp_path.glob(".out.safetensors.*.ckptfix-tmp")) and proc.poll() is None:
        assert time.monotonic() < deadline, "the writer never started"
        time.sleep(0.01)  # signal only once the output is being written
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate()
    if out.exists():  # the work finished before the signal (it may then hit interpreter shutdown)
        assert load_file(out)["module.layer23.weight"].dtype == torch.float16
        return
    assert proc.returncode == 130 and "interrupted" in err
    assert no_temp_files(tmp_path)


def _limit_file_size() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def test_write_failure_is_exit_4_with_no_output(tmp_path: Path) -> None:
    """A file-size limit makes writes fail mid-file, as a full disk does (EFBIG instead of ENOSPC)."""
    src = tmp_path / "m.pth"
    torch.save({"module.w": torch.randn(100_000)}, src)
    result = subprocess.run(
        [sys.executable, "-m", "ckptfix", "strip-module", str(src), str(tmp_path / "out.pth")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        preexec_fn=_limit_file_size,
    )
    assert result.returncode == 4, result.stderr
    assert "cannot write" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out.pth").exists() and no_temp_files(tmp_path)


def test_in_place_never_loses_the_input(tmp_path: Path) -> None:
    src = tmp_path / "m.pth"
    src.write_bytes((FIXTURES / "dataparallel_tinynet.pth").read_bytes())
    before = src.read_bytes()
    result = subprocess.run(
        [sys.executable, "-m", "ckptfix", "convert", str(src), "--in-place", "--dtype", "float16", "--quiet"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        preexec_fn=_limit_file_size,
    )
    assert result.returncode in (0, 4), result.stderr
    if result.returncode == 4:
        assert src.read_bytes() == before
    else:
        assert torch.load(src, weights_only=True)["module.fc.weight"].dtype == torch.float16
