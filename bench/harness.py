"""Shared benchmark harness: make a large checkpoint, time commands as separate processes.

Each contender runs ``runs`` times, interleaved with the others, as its own process; the
table reports the median wall time, every run, ratios to the first and last contenders
(``cp`` and the plain torch script) and the peak RSS of the process (``wait4``'s ru_maxrss).

``--sync`` runs ``sync`` (untimed) before each timed run, so no run pays for writing back the
previous one's output; ``--engine`` picks the ckptfix engine(s) timed (``both``: native and
python side by side); ``--no-torch`` leaves the torch script out. ckptfix's modules are
byte-compiled first (what ``pip install`` does; an editable checkout run with
``PYTHONDONTWRITEBYTECODE=1`` would otherwise compile ~100 modules in every timed run).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

MAKE_SCRIPT = """
import sys, torch
n_tensors, per_tensor = 200, int(float(sys.argv[2]) * 1e9 / 4 / 200)
torch.save({f"module.layer{i}.weight": torch.randn(per_tensor) for i in range(n_tensors)}, sys.argv[1])
"""


def setup(description: str | None = None) -> tuple[argparse.Namespace, Path, str]:
    """Common arguments (--size-gb, --runs, --workdir); makes the input; finds ckptfix."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--size-gb", type=float, default=1.2)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--workdir", type=Path, default=Path(__file__).parent / "_work")
    parser.add_argument("--sync", action="store_true", help="sync (untimed) before each timed run")
    parser.add_argument("--engine", choices=["auto", "native", "python", "both"], default="auto")
    parser.add_argument("--no-torch", action="store_true", help="leave the torch script out")
    args = parser.parse_args()
    src = args.workdir / "ddp_large.pth"
    make_checkpoint(src, args.size_gb)
    ckptfix = shutil.which("ckptfix") or sys.exit("ckptfix is not installed (pip install -e .)")
    import ckptfix as package

    subprocess.run([sys.executable, "-m", "compileall", "-q", str(Path(package.__file__).parent)], check=True)
    return args, src, ckptfix


def engines(args: argparse.Namespace, name: str, command: list[str]) -> dict[str, list[str]]:
    """``command`` once per engine asked for (``--engine``), named for it."""
    chosen = ["native", "python"] if args.engine == "both" else [args.engine]
    if chosen == ["auto"]:
        return {name: command}
    return {f"{name} ({e} engine)": ["env", f"CKPTFIX_ENGINE={e}", *command] for e in chosen}


def make_checkpoint(path: Path, size_gb: float) -> None:
    """A DataParallel-style checkpoint of 200 float32 tensors, unless one of that size exists.

    Made in a child process: this one must stay small, or forked children inherit its RSS.
    """
    if path.exists() and abs(path.stat().st_size - size_gb * 1e9) < 0.05e9:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-c", MAKE_SCRIPT, str(path), str(size_gb)], check=True)


class Run(NamedTuple):
    """One child process: wall seconds, CPU seconds (user + system) and peak RSS in bytes."""

    wall: float
    cpu: float
    rss: int


def timed(cmd: list[str]) -> Run:
    """Time one child process (``wait4``'s accounting). On a busy machine wall time includes
    waiting for a core; CPU time does not."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}: {proc.stderr.read().decode() if proc.stderr else ''}")
    return Run(elapsed, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024)


def compare(
    contenders: dict[str, list[str]],
    outputs: list[Path],
    runs: int,
    src: Path,
    label: str = "200 float32 tensors",
    *,
    sync: bool = False,
    last_is_torch: bool = True,
) -> None:
    """Run every contender ``runs`` times (outputs removed, and with ``sync`` the page cache
    written back, before each run); print the table, with ratios to the last contender (the
    torch script) unless ``last_is_torch`` is False."""
    results: dict[str, list[Run]] = {name: [] for name in contenders}
    for _ in range(runs):
        for name, cmd in contenders.items():
            for out in outputs:
                out.unlink(missing_ok=True)
            if sync:
                os.sync()
            results[name].append(timed(cmd))
    for out in outputs:
        out.unlink(missing_ok=True)
    names = list(contenders)
    base = statistics.median(r.wall for r in results[names[0]])
    torch_time = statistics.median(r.wall for r in results[names[-1]]) if last_is_torch else None
    synced = ", sync before each" if sync else ""
    print(f"input: {src.stat().st_size / 1e9:.2f} GB, {label}; {runs} runs each, interleaved{synced}")
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
    print()
    print(
        f"| command | median wall (s) | all runs (s) | median CPU (s) | vs {names[0]} | vs torch script "
        "| peak RSS (MiB) |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, runs_ in results.items():
        times = [r.wall for r in runs_]
        median = statistics.median(times)
        cpu = statistics.median(r.cpu for r in runs_)
        rss = max(r.rss for r in runs_) / 2**20
        vs_torch = f"{median / torch_time:.2f}x" if torch_time else "-"
        print(
            f"| {name} | {median:.2f} | {', '.join(f'{t:.2f}' for t in times)} | {cpu:.2f} | {median / base:.2f}x "
            f"| {vs_torch} | {rss:.0f} |"
        )
