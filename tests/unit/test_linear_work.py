"""Commands stay linear with a small constant on many tensor paths (a million references to a
memoized tensor fit in 2 MB): work is counted, and CPU time (never wall time) grows about 4x,
not 16x, from N to 4N paths."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptfix
from ckptfix.analysis import diff
from ckptfix.pipeline import diff_checkpoints


def many(folder: Path, n: int) -> Path:
    path = folder / f"many{n}.pth"
    t = torch.ones(2)
    torch.save({"state_dict": {"module.w": t}, "many": [t] * n, "other": [torch.zeros(3)] * n}, path)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    folder = tmp_path_factory.mktemp("many")
    return {n: many(folder, n) for n in (1000, 4000)}


def test_a_tensor_pair_is_compared_once_however_many_paths_reach_it(
    files: dict[int, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    compared: list[str] = []
    real = diff._compare_new_pair

    def counting(report: Any, path: str, *args: Any) -> None:
        compared.append(path)
        real(report, path, *args)

    monkeypatch.setattr(diff, "_compare_new_pair", counting)
    report = diff_checkpoints(files[1000], files[1000])
    assert report.equal and report.tensors_compared == 1 + 2 * 1000
    assert len(compared) == 2  # one per distinct tensor object


def _cpu(run: Callable[[], object]) -> float:
    started = time.process_time()
    run()
    return time.process_time() - started


COMMANDS: dict[str, Callable[[Path, Path], object]] = {
    "diff": lambda src, out: diff_checkpoints(src, src),
    "convert --verify": lambda src, out: ckptfix.convert(src, out, ckptfix.ConvertOptions(verify=True, force=True)),
    "strip-module": lambda src, out: ckptfix.convert(
        src, out, ckptfix.ConvertOptions(strip_prefixes=["module."], force=True)
    ),
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_commands_stay_linear_in_the_number_of_paths(command: str, files: dict[int, Path], tmp_path: Path) -> None:
    run = COMMANDS[command]
    run(files[1000], tmp_path / "warm.pth")  # imports and caches, not counted
    small = min(_cpu(lambda: run(files[1000], tmp_path / "a.pth")) for _ in range(2))
    large = _cpu(lambda: run(files[4000], tmp_path / "b.pth"))
    assert large < 8 * max(small, 0.01), f"{command}: {small:.3f}s of CPU for N paths, {large:.3f}s for 4N"
