"""Time 200 small (~100 KB) checkpoints through strip-module: ckptfix vs torch, per-file and in one process.

    python bench/bench_batch.py [--files 200] [--runs 5] [--loop-runs 2] [--workdir bench/_work]

Contenders: ``ckptfix strip-module in/*.pth -o out/`` (one command, default --jobs = CPUs);
a shell loop running a plain torch script once per file (what a CI job without ckptfix does);
one Python process doing torch.load -> consume_prefix -> torch.save per file. The per-file
loop pays torch's import 200 times, so it runs ``--loop-runs`` times only.
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

MAKE = """
import sys, torch
from pathlib import Path
folder, count = Path(sys.argv[1]), int(sys.argv[2])
folder.mkdir(parents=True, exist_ok=True)
for i in range(count):
    torch.manual_seed(i)
    model = torch.nn.Sequential(torch.nn.Linear(128, 96), torch.nn.LayerNorm(96), torch.nn.Linear(96, 64))
    torch.save(torch.nn.DataParallel(model).state_dict(), folder / f"ckpt_{i:03d}.pth")
"""
ONE_FILE = """
import sys, torch
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
sd = torch.load(sys.argv[1], weights_only=True)
consume_prefix_in_state_dict_if_present(sd, "module.")
torch.save(sd, sys.argv[2])
"""
ONE_PROCESS = """
import sys, torch
from pathlib import Path
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
out = Path(sys.argv[2])
out.mkdir(exist_ok=True)
for path in sorted(Path(sys.argv[1]).glob("*.pth")):
    sd = torch.load(path, weights_only=True)
    consume_prefix_in_state_dict_if_present(sd, "module.")
    torch.save(sd, out / path.name)
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", type=int, default=200)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--loop-runs", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=Path(__file__).parent / "_work")
    args = parser.parse_args()
    src, out = args.workdir / "batch_in", args.workdir / "batch_out"
    shutil.rmtree(src, ignore_errors=True)
    subprocess.run([sys.executable, "-c", MAKE, str(src), str(args.files)], check=True)
    inputs = sorted(src.glob("*.pth"))
    ckptfix = shutil.which("ckptfix") or sys.exit("ckptfix is not installed (pip install -e .)")
    loop = 'for f in {src}/*.pth; do {py} -c \'{code}\' "$f" {out}/$(basename "$f"); done'.format(
        src=src, out=out, py=sys.executable, code=ONE_FILE.replace("'", '"')
    )
    contenders = {
        "ckptfix strip-module in/*.pth -o out/": (
            [ckptfix, "strip-module", *map(str, inputs), "-o", str(out), "--quiet"],
            args.runs,
        ),
        "one python process: torch.load/save per file": (
            [sys.executable, "-c", ONE_PROCESS, str(src), str(out)],
            args.runs,
        ),
        "shell loop: a torch script per file": (["bash", "-c", f"mkdir -p {out} && {loop}"], args.loop_runs),
    }
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for round_ in range(max(args.runs, args.loop_runs)):
        for name, (cmd, runs) in contenders.items():
            if round_ >= runs:
                continue
            shutil.rmtree(out, ignore_errors=True)
            start = time.perf_counter()
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            times[name].append(time.perf_counter() - start)
    shutil.rmtree(out, ignore_errors=True)
    size = sum(p.stat().st_size for p in inputs) / len(inputs) / 1024
    ours = statistics.median(times[next(iter(contenders))])
    print(
        f"input: {len(inputs)} checkpoints of {size:.0f} KB; machine: {platform.machine()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}"
    )
    print()
    print("| command | runs | median wall (s) | all runs (s) | vs ckptfix |")
    print("|---|---|---|---|---|")
    for name, values in times.items():
        median = statistics.median(values)
        print(
            f"| {name} | {len(values)} | {median:.2f} | {', '.join(f'{t:.2f}' for t in values)} | "
            f"{median / ours:.1f}x |"
        )


if __name__ == "__main__":
    main()
