"""Time `ckptfix strip-module` against `cp` and a plain torch script on one large checkpoint.

    python bench/bench_strip.py [--size-gb 1.2] [--runs 5] [--workdir bench/_work]

Makes a DataParallel-style checkpoint (module.-prefixed float32 tensors) of the given size,
then runs each contender ``--runs`` times as a separate process, interleaved, and reports
the median wall time and the peak RSS of that process (from wait4). The page cache is warm
for all three (the file was just written and is read by every run). Prints a Markdown table.
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

TORCH_SCRIPT = """
import sys, torch
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
sd = torch.load(sys.argv[1], weights_only=True)
consume_prefix_in_state_dict_if_present(sd, "module.")
torch.save(sd, sys.argv[2])
"""


MAKE_SCRIPT = """
import sys, torch
n_tensors, per_tensor = 200, int(float(sys.argv[2]) * 1e9 / 4 / 200)
torch.save({f"module.layer{i}.weight": torch.randn(per_tensor) for i in range(n_tensors)}, sys.argv[1])
"""


def make_checkpoint(path: Path, size_gb: float) -> None:
    # in a child process: this process must stay small, or its forked children inherit its RSS
    subprocess.run([sys.executable, "-c", MAKE_SCRIPT, str(path), str(size_gb)], check=True)


def timed(cmd: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of one child process."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}: {proc.stderr.read().decode()}")
    return elapsed, usage.ru_maxrss * 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-gb", type=float, default=1.2)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=Path(__file__).parent / "_work")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    src = args.workdir / "ddp_large.pth"
    if not src.exists() or abs(src.stat().st_size - args.size_gb * 1e9) > 0.05e9:
        make_checkpoint(src, args.size_gb)
    out = args.workdir / "out.pth"
    ckptfix = shutil.which("ckptfix") or sys.exit("ckptfix is not installed (pip install -e .)")
    contenders = {
        "cp": ["cp", str(src), str(out)],
        "ckptfix strip-module": [ckptfix, "strip-module", str(src), str(out), "--force"],
        "torch.load -> consume_prefix -> torch.save": [sys.executable, "-c", TORCH_SCRIPT, str(src), str(out)],
    }
    results: dict[str, list[tuple[float, int]]] = {name: [] for name in contenders}
    for _ in range(args.runs):
        for name, cmd in contenders.items():
            out.unlink(missing_ok=True)
            results[name].append(timed(cmd))
    out.unlink(missing_ok=True)
    cp_time = statistics.median(t for t, _ in results["cp"])
    torch_time = statistics.median(t for t, _ in results[next(reversed(contenders))])
    print(f"input: {src.stat().st_size / 1e9:.2f} GB, 200 float32 tensors; {args.runs} runs each, interleaved")
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
    print()
    print("| command | median wall (s) | all runs (s) | vs cp | vs torch script | peak RSS (MiB) |")
    print("|---|---|---|---|---|---|")
    for name, runs in results.items():
        times = [t for t, _ in runs]
        median = statistics.median(times)
        rss = max(r for _, r in runs) / 2**20
        print(
            f"| {name} | {median:.2f} | {', '.join(f'{t:.2f}' for t in times)} | {median / cp_time:.2f}x "
            f"| {median / torch_time:.2f}x | {rss:.0f} |"
        )


if __name__ == "__main__":
    main()
